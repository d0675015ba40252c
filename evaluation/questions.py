"""Evaluation prompts: question files (MT-bench / Spec-Bench schema), plain prompt files,
paragraph openings of a text corpus, and Hugging Face datasets -> a list of `Question`.

A Question has one or more user turns; the runner feeds each method's own previous answer back
before the next turn (MT-bench convention).
"""
from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Question:
    question_id: str
    category: str
    turns: list[str]
    reference: list[str] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)  # tool definitions the chat template is given (tool-call prompts)


class QuestionError(ValueError):
    """A prompt source is missing or a record does not match the schema (the message names it)."""


# Named question sets shipped with the package (evaluation/question_sets/README.md says where they come from):
# `eval.questions: mt-bench` works on a fresh clone, offline.
QUESTION_SETS = {"mt-bench": Path(__file__).resolve().parent / "question_sets" / "mt_bench.jsonl",
                 "reasoning-tools": Path(__file__).resolve().parent / "question_sets" / "reasoning_tools.jsonl",
                 "long-context": Path(__file__).resolve().parent / "question_sets" / "long_context.jsonl"}
STANDARD_SET = "mt-bench"  # what a recipe evaluates on when it names no questions (and has a target of its own)


def load_questions(
    source: str,
    *,
    num_questions: int = 0,
    categories: list[str] | tuple[str, ...] = (),
    paragraph_sentences: int = 1,
    paragraph_from_end: bool = True,
    hf_split: str = "test",
    hf_column: str = "turns",
    hf_category_column: str = "",
) -> list[Question]:
    """Read prompts from `source` (see EvalSettings.questions for the accepted forms), keep the
    requested categories, then the first `num_questions` (0 = all)."""
    if not source:
        raise QuestionError("no prompt source: set eval.questions (a .jsonl question file, a .txt prompt file, "
                            f"paragraphs:FILE, hf:DATASET or a shipped set: {', '.join(QUESTION_SETS)})")
    if source in QUESTION_SETS:
        questions = _load_jsonl(QUESTION_SETS[source])
    elif source.startswith("hf:"):
        questions = _load_hf(source[3:], hf_split, hf_column, hf_category_column)
    elif source.startswith("paragraphs:"):
        questions = paragraph_openings(Path(source[len("paragraphs:"):]), paragraph_sentences, paragraph_from_end)
    else:
        path = Path(source)
        if not path.exists():
            raise QuestionError(f"prompt file {path} does not exist")
        name = path.name
        if name.endswith((".jsonl", ".jsonl.gz")):
            questions = _load_jsonl(path)
        elif name.endswith(".txt"):
            questions = _load_lines(path)
        else:
            raise QuestionError(f"{path}: unknown prompt file type (expected .jsonl, .jsonl.gz or .txt)")
    if categories:
        wanted = set(categories)
        questions = [q for q in questions if q.category in wanted]
        if not questions:
            raise QuestionError(f"{source}: no question in categories {sorted(wanted)}")
    if num_questions > 0:
        questions = questions[:num_questions]
    if not questions:
        raise QuestionError(f"{source}: no prompts found")
    return questions


def _load_jsonl(path: Path) -> list[Question]:
    opener = gzip.open if path.name.endswith(".gz") else open
    default_category = path.name.split(".")[0]
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise QuestionError(f"{path}:{line_no}: not valid JSON ({e})") from None
            out.append(_question_from_record(rec, f"{path}:{line_no}", default_category))
    return out


def _question_from_record(rec: dict, where: str, default_category: str) -> Question:
    if not isinstance(rec, dict):
        raise QuestionError(f"{where}: expected a JSON object with question_id, category, turns")
    missing = [k for k in ("question_id", "turns") if k not in rec]
    if missing:
        raise QuestionError(f"{where}: record lacks {missing} (schema: question_id, category, turns[, reference])")
    turns = rec["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise QuestionError(f"{where} (question_id={rec['question_id']!r}): 'turns' must be a non-empty list of "
                            f"non-empty strings")
    reference = rec.get("reference") or []
    if not isinstance(reference, list):
        reference = [str(reference)]
    category = rec.get("category") or default_category  # e.g. alpaca.jsonl has category ""
    tools = rec.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function", t).get("name"), str)
                                              for t in tools):
        raise QuestionError(f"{where} (question_id={rec['question_id']!r}): 'tools' must be a list of tool definitions "
                            "({\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": ...}})")
    return Question(str(rec["question_id"]), str(category), list(turns), [str(r) for r in reference], list(tools))


def _load_lines(path: Path) -> list[Question]:
    """One prompt per non-empty line; `\\n` inside a line stands for a newline."""
    category = path.stem
    lines = path.read_text(encoding="utf-8").splitlines()
    return [Question(f"{category}-{i}", category, [line.replace("\\n", "\n")])
            for i, line in enumerate(lines) if line.strip()]


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"']?\s+")


def paragraph_openings(path: Path, sentences: int = 1, from_end: bool = True) -> list[Question]:
    """The first `sentences` sentences of every blank-line separated paragraph of a text corpus,
    ordered from the end of the file when `from_end` (training scripts usually read from the start)."""
    if not path.exists():
        raise QuestionError(f"corpus {path} does not exist")
    if sentences < 1:
        raise QuestionError(f"eval.paragraph_sentences={sentences}: must be >= 1")
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")) if p.strip()]
    indexed = list(enumerate(paragraphs))
    if from_end:
        indexed.reverse()
    out = []
    for i, para in indexed:
        text = " ".join(para.split())
        cut = [m.end() for m in _SENTENCE_END.finditer(text)]
        opening = text if len(cut) < sentences else text[: cut[sentences - 1]].rstrip()
        out.append(Question(f"{path.stem}-p{i}", path.stem, [opening]))
    return out


def _load_hf(spec: str, split: str, column: str, category_column: str) -> list[Question]:
    # lazy: datasets costs over a second at import; only hf: question sources need it
    import datasets

    name, _, config = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as e:  # noqa: BLE001 - re-raised with the source named
        raise QuestionError(f"hf:{spec} (split {split!r}) could not be loaded: {e}") from e
    if column not in ds.column_names:
        raise QuestionError(f"hf:{spec}: no column {column!r}; columns are {ds.column_names}")
    if category_column and category_column not in ds.column_names:
        raise QuestionError(f"hf:{spec}: no category column {category_column!r}; columns are {ds.column_names}")
    default_category = name.split("/")[-1]
    out = []
    for i, row in enumerate(ds):
        value = row[column]
        rec = {
            "question_id": row.get("question_id", i),
            "category": row[category_column] if category_column else default_category,
            "turns": value if isinstance(value, list) else [value],
        }
        out.append(_question_from_record(rec, f"hf:{spec}[{split}][{i}]", default_category))
    return out
