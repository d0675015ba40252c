"""Write evaluation/question_sets/long_context.jsonl (`eval.questions: long-context`): long prompts for acceptance by
context length (evaluation/context_buckets.py), in the MT-bench schema.

Every prompt is a long document followed by a task. The documents are logs and minutes of invented places, written
for this project (Apache-2.0, the project's licence): entries composed from the sentence templates below with values
from a seeded generator, so the text is varied but needs no outside source. Four lengths (about 0.7k, 2.5k, 9k and 18k
words: roughly 1k, 3.5k, 12k and 24k Llama tokens) x three documents; the tasks ask to continue the document in its
style, to summarise it, or to answer from it, so an answer leans on the long context.

    python -m benchmarks.long_context_questions            # rewrites the shipped file (deterministic)
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "evaluation" / "question_sets" / "long_context.jsonl"
WORDS = (700, 2500, 9000, 18000)
NAMES = ["Ilse Marwick", "Tomas Oduya", "Renata Quill", "Baptiste Hale", "Min-seo Varga", "Oren Ashdown", "Priya Lund",
         "Casimir Ebo", "Wren Talbot", "Anouk Serrat", "Dmitri Fane", "Lucia Brandt"]
VESSELS = ["Heron", "Saltmarsh", "Lantern", "Cormorant", "Tidewright", "Gull's Errand"]
PORTS = ["Kessholm", "Ardle Quay", "Brinmouth", "Port Vellan", "Oystergate"]
ISSUES = ["a slow leak at the stern gland", "vibration in the port shaft above half speed", "a sticking fuel rack",
          "corrosion on the radar mast bracket", "a weak battery in the emergency lighting", "water in the day tank",
          "a worn impeller on the bilge pump", "a cracked window in the wheelhouse", "an alarm that fired without cause"]
ACTIONS = ["The part was replaced before the evening sailing", "A temporary repair was made and logged for the yard",
           "The fault could not be reproduced and the watch was told to report it again",
           "The vessel was held in port until a fitter arrived", "The crew cleaned and reseated the connection"]
PLOTS = ["the north beds", "the herb spiral", "the orchard strip", "the shade border", "the children's patch",
         "the compost yard", "the glasshouse"]
TOPICS = ["the water bill", "the tool shed lock", "a request for a second bench", "the seed swap", "slugs",
          "the hedge along the lane", "the autumn open day", "a donation of fruit trees", "the rota for watering"]
SITES = ["Plot A", "Plot B", "the river terrace", "the old quarry floor", "the beech wood", "the salt meadow"]


def ferry_log(rng: random.Random, words: int) -> str:
    parts, n, day = ["Maintenance log of the Kessholm ferry service, kept by the duty engineers."], 0, 1
    while sum(len(p.split()) for p in parts) < words:
        n += 1
        day += rng.randint(1, 3)
        v, p, who = rng.choice(VESSELS), rng.choice(PORTS), rng.choice(NAMES)
        parts.append(f"Entry {n} (day {day}). The {v} returned to {p} after {rng.randint(2, 14)} crossings. The "
                     f"engineer on watch, {who}, noted {rng.choice(ISSUES)}. {rng.choice(ACTIONS)}. Fuel used since the "
                     f"last entry: {rng.randint(300, 2400)} litres; engine hours {rng.randint(1000, 9000)}.")
    return "\n\n".join(parts)


def garden_minutes(rng: random.Random, words: int) -> str:
    parts, n = ["Minutes of the Ardle Lane Community Garden Association."], 0
    while sum(len(p.split()) for p in parts) < words:
        n += 1
        chair, sec = rng.sample(NAMES, 2)
        topic, other = rng.sample(TOPICS, 2)
        parts.append(f"Meeting {n}. Chair: {chair}; minutes: {sec}; {rng.randint(6, 31)} members present. The meeting "
                     f"discussed {topic}. {rng.choice(NAMES)} reported that {rng.choice(PLOTS)} needs "
                     f"{rng.choice(['weeding', 'new edging', 'mulch', 'a fence repair', 'more light'])}. It was agreed "
                     f"to spend no more than {rng.randint(20, 400)} on it. Under any other business, {other} was raised "
                     f"and left to the next meeting. The treasurer reported a balance of {rng.randint(200, 5000)}.")
    return "\n\n".join(parts)


def soil_notebook(rng: random.Random, words: int) -> str:
    parts, n = ["Field notebook: soil measurements along the Brinmouth transect."], 0
    while sum(len(p.split()) for p in parts) < words:
        n += 1
        site = rng.choice(SITES)
        parts.append(f"Sample {n}, {site}, depth {rng.choice([5, 10, 20, 30])} cm. pH {rng.uniform(4.5, 8.2):.1f}, "
                     f"moisture {rng.randint(8, 46)}%, temperature {rng.uniform(4, 19):.1f} C. Colour "
                     f"{rng.choice(['dark brown', 'grey', 'reddish', 'pale yellow', 'black'])}, texture "
                     f"{rng.choice(['sandy', 'silty', 'clay-rich', 'loamy', 'stony'])}. Collected by {rng.choice(NAMES)}; "
                     f"{rng.choice(['no roots', 'fine roots', 'earthworms present', 'charcoal fragments', 'shell grit'])}.")
    return "\n\n".join(parts)


DOCUMENTS = [
    ("ferry", ferry_log, "Continue this log with the next five entries, in exactly the same style and format."),
    ("garden", garden_minutes, "Summarise the decisions recorded in these minutes, meeting by meeting, in the same "
                               "order, one line per meeting."),
    ("soil", soil_notebook, "List every sample taken at the river terrace with its pH and moisture, in order, then "
                            "say which site was the wettest on average."),
]


def questions() -> list[dict]:
    out = []
    for words in WORDS:
        for name, make, task in DOCUMENTS:
            rng = random.Random(f"{name}-{words}")
            out.append({"question_id": f"long-{name}-{words}", "category": f"long-{name}",
                        "turns": [f"{make(rng, words)}\n\n{task}"]})
    return out


def main(argv=None) -> int:
    argparse.ArgumentParser(prog="python -m benchmarks.long_context_questions", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    OUT.write_text("".join(json.dumps(q) + "\n" for q in questions()))
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
