"""evaluation/: prompt sources, chat formatting (template and raw text) and method specs."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from eagle.decoding_config import DecodingConfig
from evaluation.chat_format import ChatFormat
from eagle.ea_model import save_tree_config
from evaluation.methods import load_tuned, parse_method, parse_methods
from evaluation.questions import QuestionError, load_questions

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def char_tokenizer(with_template: bool) -> PreTrainedTokenizerFast:
    """Byte-level characters as tokens (256 ids) + <s>, </s>; optional chat template."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders, processors
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    if with_template:
        fast.chat_template = TEMPLATE
    return fast


def write_jsonl(path, rows, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def test_question_file_multi_turn_and_filters(tmp_path):
    rows = [{"question_id": 81, "category": "writing", "turns": ["Write.", "Rewrite it."], "reference": ["r"]},
            {"question_id": 82, "category": "math", "turns": ["1+1?"]},
            {"question_id": 83, "category": "", "turns": ["Hi"]}]
    qs = load_questions(str(write_jsonl(tmp_path / "bench.jsonl", rows)))
    assert [q.question_id for q in qs] == ["81", "82", "83"]
    assert qs[0].turns == ["Write.", "Rewrite it."] and qs[0].reference == ["r"]
    assert qs[2].category == "bench"  # empty category -> the file's name
    assert [q.question_id for q in load_questions(str(tmp_path / "bench.jsonl"), categories=["math"])] == ["82"]
    assert len(load_questions(str(tmp_path / "bench.jsonl"), num_questions=2)) == 2
    gz = load_questions(str(write_jsonl(tmp_path / "b.jsonl.gz", rows, gz=True)))
    assert gz[0].turns == qs[0].turns


def test_bad_question_records_are_named(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question_id": 1, "turns": ["ok"]}, {"question_id": 2, "turns": []}])
    with pytest.raises(QuestionError, match=r"bad.jsonl:2 \(question_id=2\)"):
        load_questions(str(bad))
    (tmp_path / "nokey.jsonl").write_text('{"category": "x", "turns": ["a"]}\n')
    with pytest.raises(QuestionError, match="nokey.jsonl:1: record lacks \\['question_id'\\]"):
        load_questions(str(tmp_path / "nokey.jsonl"))
    with pytest.raises(QuestionError, match="no prompt source"):
        load_questions("")
    with pytest.raises(QuestionError, match="does not exist"):
        load_questions(str(tmp_path / "missing.jsonl"))
    with pytest.raises(QuestionError, match="no question in categories"):
        load_questions(str(write_jsonl(tmp_path / "ok.jsonl", [{"question_id": 1, "turns": ["a"]}])), categories=["zzz"])


def test_plain_prompt_file_and_paragraph_openings(tmp_path):
    (tmp_path / "prompts.txt").write_text("Once upon a time\n\n  \nThe cat\\nsat\n")
    qs = load_questions(str(tmp_path / "prompts.txt"))
    assert [q.turns for q in qs] == [["Once upon a time"], ["The cat\nsat"]]
    assert qs[0].category == "prompts"
    corpus = tmp_path / "stories.txt"
    corpus.write_text("First one. It ends.\n\nSecond story here! More text.\n\n\"Hi,\" said Tom. He ran.\n")
    qs = load_questions(f"paragraphs:{corpus}")
    assert [q.turns[0] for q in qs] == ['"Hi," said Tom.', "Second story here!", "First one."]  # from the end
    qs = load_questions(f"paragraphs:{corpus}", paragraph_sentences=2, paragraph_from_end=False, num_questions=1)
    assert qs[0].turns[0] == "First one. It ends." and qs[0].question_id == "stories-p0"


def test_hf_dataset_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"prompt": ["a?", "b?"], "kind": ["x", "y"]})
    # load_dataset on a local folder of data files: the same call users make with a hub id
    (tmp_path / "hub").mkdir()
    ds.to_json(tmp_path / "hub" / "train.jsonl")
    qs = load_questions(f"hf:{tmp_path / 'hub'}", hf_split="train", hf_column="prompt", hf_category_column="kind")
    assert [(q.category, q.turns) for q in qs] == [("x", ["a?"]), ("y", ["b?"])]
    with pytest.raises(QuestionError, match="no column 'turns'"):
        load_questions(f"hf:{tmp_path / 'hub'}", hf_split="train")


def test_chat_template_multi_turn_feeds_the_answer_back():
    tok = char_tokenizer(with_template=True)
    fmt = ChatFormat(tok)
    assert fmt.name == "chat_template"
    first = fmt.first_prompt("Hi")
    assert tok.decode(first) == "<user>Hi</s><assistant>"  # no doubled BOS
    second = fmt.next_prompt(first, tok("Hello!", add_special_tokens=False)["input_ids"], [("Hi", "Hello!")], "More")
    assert tok.decode(second) == "<user>Hi</s><assistant>Hello!</s><user>More</s><assistant>"


def test_raw_text_without_template_continues_from_the_own_tokens():
    tok = char_tokenizer(with_template=False)
    fmt = ChatFormat(tok, turn_separator="\n")
    assert fmt.name == "raw_text"
    first = fmt.first_prompt("Once")
    assert first[0] == tok.bos_token_id and tok.decode(first[1:]) == "Once"
    answer = [5, 6, 7]
    second = fmt.next_prompt(first, answer, [("Once", "x")], "Then")
    assert second[: len(first) + 3] == first + answer
    assert tok.decode(second[len(first) + 3:]) == "\nThen"
    # a template passed explicitly (e.g. a shipped one) wins over the tokenizer's absence of one
    assert ChatFormat(tok, chat_template=TEMPLATE).name == "chat_template"


METHOD_SPEC_ERRORS = [  # (spec, what the one line must say)
    ("eagle2:calibrate=yes", "calibrate='yes': expected true or false"),
    ("eagle2:calibrate=1", "calibrate='1': expected true or false"),
    ("eagle2:calibrate=", "calibrate='': expected true or false"),
    ("eagle2@", "nothing after @; expected a head, one of ('A', 'B')"),
    ("eagle2@ :depth=3", "nothing after @"),
    ("eagle2@C", "'C' after @; expected a head, one of ('A', 'B')"),
    ("eagle2@A@B", "'A@B' after @"),
    ("eagle2:wdth=3", "unknown option 'wdth'; options: total_token (an integer); depth (an integer)"),
    ("eagle2:mode=chain", "unknown option 'mode'"),
    ("eagle2:depth", "'depth' is not key=value"),
    ("eagle2:depth=3,,top_k=2", "'' is not key=value"),
    ("eagle2:depth=three", "depth='three': expected an integer"),
    ("eagle2:depth=3,depth=4", "option depth given twice"),
    ("eagle2:", "nothing after ':'"),
    ("chain:draft_sampling=random", "draft_sampling='random': expected one of ('greedy', 'probabilistic')"),
    ("eagle1:static_choices=mine", "unknown static tree 'mine'; shipped: ['mc_sim_7b_63']"),
    ("", "empty; expected NAME[@HEAD][:key=value,...] with NAME one of ('vanilla', 'chain', 'eagle1', 'eagle2', 'tuned')"),
    ("Eagle2", "unknown method 'Eagle2' in 'Eagle2': expected one of ('vanilla', 'chain', 'eagle1', 'eagle2', 'tuned')"),
]


@pytest.mark.parametrize("spec,needle", METHOD_SPEC_ERRORS, ids=[s or "empty" for s, _ in METHOD_SPEC_ERRORS])
def test_a_method_spec_off_the_grammar_is_one_line_listing_what_is_accepted(spec, needle):
    from evaluation.methods import MethodSpecError
    with pytest.raises(MethodSpecError) as e:
        parse_method(spec, DecodingConfig())
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_method_spec_booleans_and_heads_parse():
    base = DecodingConfig()
    assert parse_method("eagle2:calibrate=false", base).decoding.calibrate is False
    assert parse_method("eagle2:calibrate=TRUE", base).decoding.calibrate is True
    m = parse_method(" eagle2 @ B : depth = 3 ", base)
    assert (m.head, m.decoding.depth) == ("B", 3)
    assert parse_method("chain:draft_sampling=probabilistic", base).decoding.draft_sampling == "probabilistic"


def test_method_specs(tmp_path):
    base = DecodingConfig(total_token=60, depth=5, top_k=10)
    assert parse_method("eagle2", base).decoding.mode == "dynamic"
    assert parse_method("eagle1", base).decoding.mode == "static"
    m = parse_method("eagle2:total_token=30,depth=4", base)
    assert (m.label, m.decoding.total_token, m.decoding.depth, m.decoding.top_k) == ("eagle2:total_token=30,depth=4", 30, 4, 10)
    assert parse_method("chain:chain_length=3", base).decoding.chain_length == 3
    with pytest.raises(ValueError, match="unknown method"):
        parse_method("medusa", base)
    with pytest.raises(ValueError, match="unknown option 'width'; options: total_token"):
        parse_method("eagle2:width=3", base)
    with pytest.raises(ValueError, match="top_k=0"):
        parse_method("eagle2:top_k=0", base)
    methods = parse_methods(["eagle2", "chain"], base, compare_head=True)
    assert [(m.label, m.head) for m in methods] == [("vanilla", "A"), ("eagle2", "A"), ("chain", "A"),
                                                    ("eagle2[B]", "B"), ("chain[B]", "B")]
    with pytest.raises(ValueError, match="duplicate"):
        parse_methods(["eagle2", "eagle2"], base)
    with pytest.raises(FileNotFoundError, match="autotune"):
        parse_method("tuned", base, tmp_path)
    save_tree_config(tmp_path, DecodingConfig(total_token=24, depth=4, top_k=6))
    assert load_tuned(tmp_path) == DecodingConfig(total_token=24, depth=4, top_k=6)
    assert parse_method("tuned", base, tmp_path).decoding.total_token == 24


def test_every_shipped_recipe_has_questions_out_of_the_box(monkeypatch):
    """Issue 28 item 1: a recipe with a target of its own and no eval.questions evaluates on MT-bench, shipped with the
    package (no ../shared, no network: HF_HUB_OFFLINE); tiny's default target brings its own questions, stories260k
    names a corpus in ../shared."""
    from evaluation.main import load_all_questions, question_source
    from evaluation.questions import QUESTION_SETS
    from recipes import list_recipes, load_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shipped = QUESTION_SETS["mt-bench"]
    assert shipped.is_relative_to(Path(__file__).resolve().parent.parent / "evaluation")
    sources = {}
    for name in list_recipes():
        cfg = load_config(name)
        if not cfg.target.path:  # the embedded default target: its questions_eval.jsonl (built with it)
            assert not cfg.eval.questions, name
            continue
        sources[name] = question_source(cfg)
        if sources[name] == "mt-bench":
            questions = load_all_questions(cfg)
            assert len(questions) == 80 and len({q.category for q in questions}) == 8, name
            assert all(len(q.turns) == 2 for q in questions)
    assert {n for n, s in sources.items() if s != "mt-bench"} <= {"stories260k", "stories260k-eagle3", "stories260k-peagle",
                                                              "stories260k-dflash"}
    assert sum(s == "mt-bench" for s in sources.values()) >= 10  # the 7B/8B recipes, EAGLE-2 and EAGLE-3
    assert [q.question_id for q in load_questions("mt-bench", num_questions=2)] == ["81", "82"]


def test_tuned_on_head_b_reads_head_b_tree(tmp_path):
    """`tuned@B` (and the `tuned[B]` shorthand) decode with the tree autotune saved beside head B, not head A's."""
    base = DecodingConfig(total_token=60, depth=5, top_k=10)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    save_tree_config(a, DecodingConfig(total_token=24, depth=4, top_k=3))
    save_tree_config(b, DecodingConfig(total_token=6, depth=6, top_k=2))
    methods = {m.label: m for m in parse_methods(["tuned", "tuned@B"], base, a, True, b)}
    assert (methods["tuned"].head, methods["tuned"].decoding.total_token) == ("A", 24)
    assert (methods["tuned@B"].head, methods["tuned@B"].decoding.total_token, methods["tuned@B"].decoding.depth) == \
        ("B", 6, 6)
    shorthand = {m.label: m for m in parse_methods(["eagle2:depth=4", "tuned"], base, a, True, b)}
    assert (shorthand["tuned[B]"].head, shorthand["tuned[B]"].decoding.total_token) == ("B", 6)
    assert (shorthand["eagle2:depth=4[B]"].head, shorthand["eagle2:depth=4[B]"].decoding.depth) == ("B", 4)
    with pytest.raises(FileNotFoundError, match="autotune"):
        parse_methods(["tuned@B"], base, a, True, tmp_path / "no-tree")
