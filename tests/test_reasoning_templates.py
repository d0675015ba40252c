"""Reasoning and tool-call targets: the shipped qwen3 / llama-3.1 templates against transformers'
apply_chat_template (tools, assistant-token masks) token for token, the reasoning in or out of the mask, the parse of
a generated reply back into the message the template renders, regeneration keeping tool calls and results, and the
mask inspector's spans. Tokenizers are built in code (tests/test_data_prep_helpers.py)."""
import json
import re

import pytest

from data_prep.assistant_spans import ANSWER, REASONING, TOOL_CALL, label_tokens, split_reply
from data_prep.loss_mask import render_masked, tokenize_records, tokenize_with_mask
from data_prep.regenerate import Reply, regenerate_chunk
from data_prep.token_ids import chat_messages, prompt_ids
from data_prep.tool_calls import FORMATS, detect_format
from recipes.chat_templates import read_template
from test_data_prep_helpers import build_reasoning_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


# system, a tool exchange with reasoning, the answer; a second user turn answered with reasoning
CONVERSATION = [
    {"role": "system", "content": "Be nice."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I need the weather tool.", "tool_calls": [call("get_weather", city="Paris")]},
    {"role": "tool", "content": "sunny, 20 C"},
    {"role": "assistant", "content": "It is sunny in Paris.", "reasoning_content": "The tool said sunny."},
    {"role": "user", "content": "And the time?"},
    {"role": "assistant", "content": "Let me check.", "reasoning_content": "Time tool now.", "tool_calls": [call("get_time", city="Paris")]},
    {"role": "tool", "content": "noon"},
    {"role": "assistant", "content": "It is noon.", "reasoning_content": "It said noon."},
]
EOT = {"qwen3": "<|im_end|>", "llama-3.1": "<|eot_id|>"}


@pytest.fixture(scope="module", params=["qwen3", "llama-3.1"])
def tok(request):
    return build_reasoning_tokenizer(request.param)


def name_of(tok):
    return "qwen3" if "<tool_call>" in tok.chat_template else "llama-3.1"


def hf_reference(tok, messages, tools=TOOLS):
    out = tok.apply_chat_template(chat_messages(messages), tools=tools, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def runs(ids, mask):
    out, cur = [], []
    for t, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    return out


def replies(tok, messages):
    """What each assistant turn of `messages` renders to, from the template itself: the text between the prompt
    (messages before it, generation prompt) and the conversation through it."""
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            before = tok.apply_chat_template(chat_messages(messages[:i]), tools=TOOLS, tokenize=False, add_generation_prompt=True)
            through = tok.apply_chat_template(chat_messages(messages[: i + 1]), tools=TOOLS, tokenize=False)
            assert through.startswith(before)
            out.append(through[len(before):].rstrip("\n"))
    return out


def test_shipped_templates_name_their_tool_call_markup():
    assert detect_format(read_template("qwen3")).name == "hermes"
    assert detect_format(read_template("llama-3.1")).name == "llama3_json"
    for name in ("chatml", "llama-3", "llama-2-chat", "vicuna", "plain"):
        assert detect_format(read_template(name)).name == "none"


def test_mask_equals_transformers_assistant_mask_with_tools(tok):
    messages = CONVERSATION if name_of(tok) == "qwen3" else CONVERSATION[:5]
    ids, mask = tokenize_with_mask(tok, messages, tools=TOOLS)
    assert (ids, mask) == hf_reference(tok, messages)
    text = tok.decode(ids, skip_special_tokens=False)
    assert "get_weather" in text and "The weather in a city" in text  # the tools reached the template
    # every masked run is exactly one assistant reply and its end-of-turn token, nothing else is trained on
    # (each reply as the template renders it last; Qwen3's rule: turns before the last user turn without reasoning)
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    ruled = [{k: v for k, v in m.items() if k != "reasoning_content" or i > last_user} for i, m in enumerate(messages)]
    got = [tok.decode(r, skip_special_tokens=False) for r in runs(ids, mask)]
    assert got == replies(tok, ruled)
    assert all(g.endswith(EOT[name_of(tok)]) for g in got)
    unmasked = tok.decode([t for t, m in zip(ids, mask) if not m], skip_special_tokens=False)
    for m in messages:
        if m["role"] in ("user", "tool", "system"):
            assert m["content"] in unmasked


def test_qwen3_drops_the_reasoning_of_turns_before_the_last_user_turn():
    tok = build_reasoning_tokenizer("qwen3")
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    for m in (CONVERSATION[2], CONVERSATION[4]):  # answered before the last user turn: no reasoning left
        assert m["reasoning_content"] not in text
    for m in CONVERSATION[6:]:  # after it: the whole tool chain keeps its reasoning
        if m["role"] == "assistant":
            assert f"<think>\n{m['reasoning_content']}\n</think>\n\n" in text
    # an inline <think> in content renders as reasoning_content does
    inline = [CONVERSATION[5], {"role": "assistant", "content": "<think>\nIt said noon.\n</think>\n\nIt is noon."}]
    field = [CONVERSATION[5], CONVERSATION[-1]]
    assert tok.apply_chat_template(inline, tokenize=False) == tok.apply_chat_template(field, tokenize=False)


def test_generated_reply_parses_back_to_the_message_the_template_renders(tok):
    """Round trip of regeneration: the text a reply renders to (what the target generates), split into message fields
    by the template's markup, is the message again, and renders to the same tokens."""
    calls = detect_format(tok.chat_template)
    messages = CONVERSATION if name_of(tok) == "qwen3" else CONVERSATION[:5]
    eot = EOT[name_of(tok)]
    k = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        text = replies(tok, messages)[k][: -len(eot)]
        k += 1
        parsed = {"role": "assistant", **split_reply(text, calls, think=name_of(tok) == "qwen3")}
        want = {key: m[key] for key in ("role", "content", "tool_calls") if key in m}
        if name_of(tok) == "qwen3":  # a reply rendered last shows its reasoning (llama-3.1 has no reasoning)
            want["reasoning_content"] = m["reasoning_content"]
        if name_of(tok) == "llama-3.1" and "tool_calls" in m:
            want["content"] = ""  # this template writes a call as the whole reply
        assert parsed == want, (i, text)
        rebuilt = messages[:i] + [parsed]
        assert hf_reference(tok, rebuilt) == hf_reference(tok, messages[: i + 1])


def test_reasoning_out_of_the_mask_keeps_answers_and_calls():
    tok = build_reasoning_tokenizer("qwen3")
    recs = [{"id": "c", "messages": CONVERSATION, "tools": TOOLS}]
    calls = FORMATS["hermes"]
    (with_r,), s_in = tokenize_records(recs, tok, 4096, calls=calls)
    (without,), s_out = tokenize_records(recs, tok, 4096, calls=calls, train_reasoning=False)
    assert with_r["input_ids"] == without["input_ids"] == hf_reference(tok, CONVERSATION)[0]
    assert with_r["loss_mask"] == hf_reference(tok, CONVERSATION)[1]  # default: transformers' mask, reasoning in
    labels = label_tokens(tok, with_r["input_ids"], with_r["loss_mask"], calls)
    assert without["loss_mask"] == [int(m and lab != REASONING) for m, lab in zip(with_r["loss_mask"], labels)]
    assert s_in.reasoning_tokens == s_out.reasoning_tokens == sum(lab == REASONING for lab in labels) > 0
    assert s_in.loss_tokens - s_out.loss_tokens == s_in.reasoning_tokens
    # the two turns before the last user turn lost their reasoning in the template: counted, not hidden
    assert s_in.reasoning_not_rendered == 2
    kept = tok.decode([t for t, m in zip(without["input_ids"], without["loss_mask"]) if m], skip_special_tokens=False)
    assert "<think>" not in kept and "Time tool now." not in kept and "It said noon." not in kept
    assert "It is noon." in kept and '"name": "get_time"' in kept and "It is sunny in Paris." in kept
    # the labels: reasoning = the <think> blocks, tool_call = the <tool_call> blocks
    text_of = {kind: tok.decode([t for t, lab in zip(with_r["input_ids"], labels) if lab == kind], skip_special_tokens=False)
               for kind in (REASONING, TOOL_CALL, ANSWER)}
    assert text_of[REASONING].count("<think>") == 2 and "Time tool now." in text_of[REASONING]
    assert text_of[TOOL_CALL].count("<tool_call>") == 2 and "get_weather" in text_of[TOOL_CALL]
    assert "<think>" not in text_of[ANSWER] and "<tool_call>" not in text_of[ANSWER]


def test_labels_when_the_generation_prompt_opens_the_reasoning():
    """A reply run holding </think> without <think> (the prompt opened it) is reasoning up to </think>; a <think>
    never closed (cut by max_new_tokens) is reasoning to the end."""
    tok = build_reasoning_tokenizer("qwen3")
    for text, reasoning_part in (("plan it</think>\n\nDone.<|im_end|>", "plan it</think>"),
                                 ("<think>\nstill thinking", "<think>\nstill thinking")):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        labels = label_tokens(tok, ids, [1] * len(ids), FORMATS["hermes"])
        got = tok.decode([t for t, lab in zip(ids, labels) if lab == REASONING], skip_special_tokens=False)
        assert got == reasoning_part


class Scripted:
    """A backend answering with fixed texts (what a target would generate), ids as the HF backend keeps them."""

    def __init__(self, tok, answers, eot="<|im_end|>"):
        self.tok, self.answers, self.seen, self.eot = tok, list(answers), [], eot

    def generate_turn(self, histories, tools=None):
        out = []
        for h, t in zip(histories, tools):
            self.seen.append((h, t))
            text = self.answers.pop(0)
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.convert_tokens_to_ids(self.eot)]
            out.append(Reply(self.tok.decode(ids[:-1], skip_special_tokens=True).strip(), len(ids), False, ids))
        return out


def hermes(name, **args):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def test_regeneration_keeps_calls_and_the_datasets_results_and_its_mask_equals_transformers():
    tok = build_reasoning_tokenizer("qwen3")
    rec = {"id": "c", "messages": CONVERSATION, "tools": TOOLS}
    answers = ["<think>\nUse the tool.\n</think>\n\n" + hermes("get_weather", city="Paris"),
               "<think>\nSunny it is.\n</think>\n\nSunny!",
               "<think>\nCheck time.\n</think>\n\n" + hermes("get_time", city="Paris"),
               "<think>\nNoon.\n</think>\n\nNoon!"]
    backend = Scripted(tok, answers)
    (out,) = regenerate_chunk([rec], backend, FORMATS["hermes"], think=True)
    roles = [m["role"] for m in out["messages"]]
    assert roles == [m["role"] for m in CONVERSATION]
    assert out["tools"] == TOOLS and all(t == TOOLS for _, t in backend.seen)  # the tools reached every prompt
    assert out["tool_results_kept"] == 2 and "tool_exchanges_diverged" not in out
    assert [m["content"] for m in out["messages"] if m["role"] == "tool"] == ["sunny, 20 C", "noon"]  # the dataset's
    first = out["messages"][2]
    assert first["tool_calls"] == [call("get_weather", city="Paris")] and first["reasoning_content"] == "Use the tool."
    assert first["content"] == ""
    # the prompt of the reply after a tool result ends with that result and the generation prompt
    assert backend.seen[1][0][-1]["content"] == "sunny, 20 C"
    assert prompt_ids(tok, backend.seen[1][0], TOOLS)[-3:] == tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"][-3:]
    # tokenised from the generated ids where the prompts extend them, else from text: either way transformers' mask
    (sample,), stats = tokenize_records([out], tok, 4096, calls=FORMATS["hermes"])
    plain = [{k: v for k, v in m.items() if k != "token_ids"} for m in out["messages"]]
    assert (sample["input_ids"], sample["loss_mask"]) == hf_reference(tok, plain)
    assert stats.token_ids_fallback == 1  # qwen3 re-renders the first turns without their reasoning: text path


def test_regeneration_drops_results_of_calls_the_target_did_not_make():
    tok = build_reasoning_tokenizer("qwen3")
    rec = {"id": "c", "messages": CONVERSATION, "tools": TOOLS}
    # turn 1 answers without the weather call: the dataset's weather result (and its answer) is dropped, the
    # conversation goes on at the next user turn; there the target calls the time tool as the dataset did (the
    # result is kept), then calls a tool the dataset has no result for: the conversation ends there, that call kept
    backend = Scripted(tok, ["I know: sunny.", hermes("get_time", city="Paris"), hermes("get_weather", city="Rome")])
    (out,) = regenerate_chunk([rec], backend, FORMATS["hermes"], think=True)
    assert [m["role"] for m in out["messages"]] == ["system", "user", "assistant", "user", "assistant", "tool", "assistant"]
    assert out["tool_exchanges_diverged"] == 1 and out["tool_results_kept"] == 1 and out["ended_at_unanswered_call"]
    assert out["messages"][-1]["tool_calls"] == [call("get_weather", city="Rome")]
    # a different function than the dataset's at the first exchange: the conversation ends at once, the call kept
    (out,) = regenerate_chunk([rec], Scripted(tok, [hermes("get_time", city="Paris")]), FORMATS["hermes"], think=True)
    assert [m["role"] for m in out["messages"]] == ["system", "user", "assistant"] and out["ended_at_unanswered_call"]
    (sample,), stats = tokenize_records([out], tok, 4096, calls=FORMATS["hermes"])
    assert stats.from_token_ids == 1  # no reasoning to drop: every prompt extends the generated ids
    plain = [{k: v for k, v in m.items() if k != "token_ids"} for m in out["messages"]]
    ids, mask = hf_reference(tok, plain)
    # the sample built from the generated ids ends with the last reply's stop token; transformers' rendering goes on
    # with the template's untrained "\n" after it
    n = len(sample["input_ids"])
    assert (sample["input_ids"], sample["loss_mask"]) == (ids[:n], mask[:n])
    assert tok.decode(ids[n:]) == "\n" and not any(mask[n:])


def test_llama31_call_parsed_from_a_generated_reply():
    calls = FORMATS["llama3_json"]
    fields = split_reply('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', calls, think=False)
    assert fields == {"content": "", "tool_calls": [call("get_weather", city="Paris")]}
    assert split_reply('{"name": "x"} is JSON, and more text', calls, think=False) == {"content": '{"name": "x"} is JSON, and more text'}
    assert FORMATS["hermes"].split("<tool_call>\nnot json\n</tool_call>") == ("<tool_call>\nnot json\n</tool_call>", [])


def test_inspector_shows_reasoning_answer_and_tool_call_spans():
    tok = build_reasoning_tokenizer("qwen3")
    ids, mask = tokenize_with_mask(tok, CONVERSATION[5:], tools=TOOLS)
    text = render_masked(tok, ids, mask, color=False, calls=FORMATS["hermes"])
    assert "⟪<think>\nTime tool now.\n</think>⟫" in text
    assert '⦃<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>⦄' in text
    assert "⟦\n\nIt is noon.<|im_end|>⟧" in text and "⟦\n\nLet me check.\n⟧" in text
    colored = render_masked(tok, ids, mask, color=True, calls=FORMATS["hermes"])
    assert "\x1b[30;46m" in colored and "\x1b[30;43m" in colored and "\x1b[30;42m" in colored


def test_data_prep_cli_with_tools_and_reasoning(tmp_path, capsys):
    """load -> regenerate (a random target: it answers without the dataset's tool calls, so their results are dropped
    and counted) -> tokenize -> inspect; then the dataset's own replies (data.regenerate=false) with the reasoning
    out of the mask."""
    from data_prep.main import main
    from data_prep.tokenized import load_tokenized
    from test_data_prep_helpers import build_model

    tok = build_reasoning_tokenizer("qwen3")
    build_model(len(tok)).save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    source = tmp_path / "tools.jsonl"
    source.write_text(json.dumps({"id": "w", "tools": TOOLS, "messages": CONVERSATION}) + "\n")
    recipe = tmp_path / "t.yaml"
    recipe.write_text(json.dumps({"name": "t", "output_dir": str(tmp_path / "run"),
                                  "target": {"path": str(tmp_path / "target"), "dtype": "float32", "chat_template": "qwen3"},
                                  "data": {"source": str(source), "max_new_tokens": 4, "max_length": 2048,
                                           "cache_features": False, "device": "cpu"}}))
    main(["--recipe", str(recipe), "--no-progress", "--inspect", "1"])
    out = capsys.readouterr().out
    assert "tool exchanges diverged 2" in out and "=== w:" in out
    report = json.loads((tmp_path / "run" / "data" / "report.json").read_text())
    assert report["regenerate_shard0of1"]["tool_exchanges_diverged"] == 2
    regenerated = [json.loads(line) for line in (tmp_path / "run" / "data" / "regenerated").glob("part-*.jsonl").__next__().open()]
    assert [m["role"] for m in regenerated[0]["messages"]] == ["system", "user", "assistant", "user", "assistant"]

    main(["--recipe", str(recipe), "--no-progress", "--inspect", "1", "data.regenerate=false",
          "data.train_reasoning=false", f"output_dir={tmp_path / 'own'}"])
    out = capsys.readouterr().out
    (sample,) = load_tokenized(tmp_path / "own" / "data")
    ids, mask = hf_reference(tok, CONVERSATION)
    labels = label_tokens(tok, ids, mask, FORMATS["hermes"])
    assert sample["input_ids"] == ids
    assert sample["loss_mask"] == [int(m and lab != REASONING) for m, lab in zip(mask, labels)]
    assert "reasoning 0 ⟪⟫" in out and re.search(r"tool call [1-9][0-9]* ⦃⦄", out) and "⦃<tool_call>" in out
    assert "not trained on: data.train_reasoning=false" in out


def test_parallel_calls_group_their_results_into_one_step():
    from data_prep.regenerate import conversation_inputs

    msgs = [{"role": "user", "content": "Weather and time in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="Paris"), call("get_time", city="Paris")]},
            {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "noon"},
            {"role": "assistant", "content": "Sunny at noon."}, {"role": "user", "content": "Thanks"}]
    steps = conversation_inputs(msgs)
    assert [([t["content"] for t in s["turns"]], s["calls"]) for s in steps] == [
        (["Weather and time in Paris?"], None), (["sunny", "noon"], ["get_weather", "get_time"]), (["Thanks"], None)]
    text = hermes("get_weather", city="Paris") + "\n" + hermes("get_time", city="Paris")
    assert split_reply(text, FORMATS["hermes"]) == {"content": "", "tool_calls": msgs[1]["tool_calls"]}
    # and the qwen3 template renders those two calls back to that text
    tok = build_reasoning_tokenizer("qwen3")
    assert replies(tok, msgs[:2])[0] == text + "<|im_end|>"


def test_llama31_regeneration_keeps_the_json_call_and_its_mask_equals_transformers():
    tok = build_reasoning_tokenizer("llama-3.1")
    rec = {"id": "c", "messages": CONVERSATION[:5], "tools": TOOLS}
    backend = Scripted(tok, ['{"name": "get_weather", "parameters": {"city": "Paris"}}', "Sunny in Paris."], "<|eot_id|>")
    (out,) = regenerate_chunk([rec], backend, FORMATS["llama3_json"], think=False)
    assert [m["role"] for m in out["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert out["messages"][2]["tool_calls"] == [call("get_weather", city="Paris")] and out["tool_results_kept"] == 1
    (sample,), stats = tokenize_records([out], tok, 4096, calls=FORMATS["llama3_json"])
    assert stats.from_token_ids == 1 and stats.tool_call_tokens > 0
    plain = [{k: v for k, v in m.items() if k != "token_ids"} for m in out["messages"]]
    ids, mask = hf_reference(tok, plain)
    assert (sample["input_ids"], sample["loss_mask"]) == (ids, mask)  # llama-3.1 writes nothing after the last reply
