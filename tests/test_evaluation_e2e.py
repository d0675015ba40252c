"""evaluation/ end to end on a tiny random Llama + head: CLI reports, lossy-decoder detection (T = 0 and
T > 0), auto-tuning, the live tau hook and multi-turn feeding."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from statistical_rule import assert_same_law, bonferroni
from test_evaluation_questions import TEMPLATE, char_tokenizer
from tiny_models import TEST_THREADS, random_head, tiny_llama

from eagle.decoding_config import DecodingConfig
from eagle.ea_model import EaModel, save_tree_config
from eagle.score_calibration import ScoreCalibration
from eagle.tau import measure_tau
from evaluation.chat_format import ChatFormat
from evaluation.losslessness import check_greedy, distribution_test
from evaluation.main import main
from evaluation.methods import Method, parse_methods
from evaluation.questions import Question
from evaluation.runner import GenerationArgs, run_benchmark

VOCAB = 258  # char_tokenizer: <s>, </s> + 256 byte symbols


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: tiny forwards are dominated by thread hand-off on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    target = tiny_llama(vocab_size=VOCAB, eos_token_id=1)
    return target, random_head(target)


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    """Target (with a chat-template-less tokenizer), head and a 2-turn question file on disk."""
    root = tmp_path_factory.mktemp("e2e")
    target, head = tiny
    target.save_pretrained(root / "target")
    char_tokenizer(with_template=False).save_pretrained(root / "target")
    head.save_pretrained(root / "head")
    rows = [{"question_id": 1, "category": "story", "turns": ["Once upon a time", "And then"]},
            {"question_id": 2, "category": "story", "turns": ["The dog ran"]},
            {"question_id": 3, "category": "code", "turns": ["def f(x):"]}]
    (root / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def cli(saved, *extra):
    return ["--base", str(saved / "target"), "--head", str(saved / "head"), "--questions", str(saved / "q.jsonl"),
            "target.dtype=float32", "eval.max_new_tokens=12", "eval.bootstrap_samples=200", "eval.threads=1",
            "decoding.total_token=12", "decoding.depth=3", "decoding.top_k=4", *extra]


def test_cli_bench_writes_every_report(saved, tmp_path):
    out = tmp_path / "eval"
    rc = main(cli(saved, "--out", str(out), "eval.methods=[vanilla,chain,eagle1,eagle2,eagle2:top_k=2]"))
    assert rc == 0
    for name in ("report.json", "report.md", "answers.jsonl", "tau_by_category.png", "speedup_by_category.png",
                 "depth_acceptance.png", "calibration_eagle2.png"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "report.json").read_text())
    assert data["meta"]["chat_format"] == "raw_text"
    assert data["losslessness"]["lossless"] and data["losslessness"]["compared"] == 4 * 4
    overall = {s["method"]: s for s in data["summaries"] if s["category"] == "overall"}
    assert list(overall) == ["vanilla", "chain", "eagle1", "eagle2", "eagle2:top_k=2"]
    assert overall["vanilla"]["tau"]["value"] == pytest.approx(1.0)
    assert all(s["tau"]["value"] >= 1.0 for s in overall.values())
    assert data["meta"]["methods"]["eagle2:top_k=2"]["top_k"] == 2
    cats = {s["category"] for s in data["summaries"]}
    assert cats == {"story", "code", "overall"}
    # every (question, turn) of every method is in answers.jsonl, tokens counted the same way
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 5 * 4
    turns = {(t["question_id"], t["turn"], t["method"]): t["new_tokens"] for t in data["turns"]}
    assert all(turns[(a["question_id"], a["turn"], a["method"])] == len(a["output_ids"]) for a in answers)
    pairs = {(c["a"], c["b"]) for c in data["comparisons"]}
    assert ("eagle2", "eagle2:top_k=2") in pairs and ("chain", "eagle1") in pairs


def test_cli_compare_head_and_template(saved, tmp_path):
    other = random_head(tiny_llama(vocab_size=VOCAB, eos_token_id=1), seed=3)
    other.save_pretrained(tmp_path / "head_b")
    rc = main(cli(saved, "--out", str(tmp_path / "eval"), "--compare-head", str(tmp_path / "head_b"),
                  "eval.methods=[eagle2]", "eval.num_questions=2", f"target.chat_template={TEMPLATE_FILE(tmp_path)}"))
    assert rc == 0
    data = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert data["meta"]["chat_format"] == "chat_template"
    assert [(c["a"], c["b"]) for c in data["comparisons"]] == [("eagle2", "eagle2[B]")]
    c = data["comparisons"][0]["tau_difference"]
    assert c["ci_low"] <= c["value"] <= c["ci_high"]


def TEMPLATE_FILE(tmp_path):  # noqa: N802 - a .jinja path is a valid target.chat_template
    p = tmp_path / "t.jinja"
    p.write_text(TEMPLATE)
    return p


class LossyModel:
    """Wraps an EaModel; its speculative output changes ONE token (position `at`), vanilla is untouched."""

    def __init__(self, model: EaModel, at: int):
        self.model, self.at, self.base_model = model, at, model.base_model

    def naivegenerate(self, *a, **kw):
        return self.model.naivegenerate(*a, **kw)

    def eagenerate(self, input_ids, **kw):
        out, stats = self.model.eagenerate(input_ids, **kw)
        if kw["decoding"].mode == "dynamic" and out.shape[1] > input_ids.shape[1] + self.at:
            out = out.clone()
            out[0, input_ids.shape[1] + self.at] = (out[0, input_ids.shape[1] + self.at] + 1) % VOCAB
        return out, stats


class IdFormat:
    """Prompts given as space-separated token ids (no tokenizer needed); raw-text multi-turn rules."""

    name = "ids"

    def first_prompt(self, turn):
        return [int(x) for x in turn.split()]

    def next_prompt(self, prev_prompt, prev_answer, history, turn, tools=None):
        return list(prev_prompt) + list(prev_answer) + self.first_prompt(turn) if history else self.first_prompt(turn)

    def decode(self, ids):
        return " ".join(map(str, ids))


QUESTIONS = [Question("a", "x", ["5 9 14 3", "7 7"]), Question("b", "y", ["100 2 30"])]


def test_mismatch_detection_fires_on_a_lossy_decoder(tiny):
    target, head = tiny
    model = EaModel(target, head, DecodingConfig(total_token=12, depth=3, top_k=4))
    methods = parse_methods(["chain", "eagle2"], model.decoding)
    gen = GenerationArgs(max_new_tokens=10, max_length=512, eos_token_id=[])
    clean = run_benchmark({"A": model}, IdFormat(), QUESTIONS, methods, gen, warmup=0, progress=False)
    assert check_greedy(clean.results).lossless
    lossy = run_benchmark({"A": LossyModel(model, at=4)}, IdFormat(), QUESTIONS, methods, gen, warmup=0,
                          progress=False)
    check = check_greedy(lossy.results)
    # eagle2 diverges at generated position 4 on the first turn of both questions; turn 2 of "a"
    # is built on the diverged answer, so it is not reported again; chain stays lossless
    assert [(m.question_id, m.turn, m.method, m.position) for m in check.mismatches] == [
        ("a", 0, "eagle2", 4), ("b", 0, "eagle2", 4)]
    m = check.mismatches[0]
    assert m.got == (m.expected + 1) % VOCAB


def test_multi_turn_feeds_each_methods_own_answer(tiny):
    target, head = tiny
    model = EaModel(target, head, DecodingConfig(total_token=12, depth=3, top_k=4))
    methods = parse_methods(["eagle2"], model.decoding)
    run = run_benchmark({"A": model}, IdFormat(), QUESTIONS[:1], methods,
                        GenerationArgs(max_new_tokens=6, max_length=512, eos_token_id=[]), warmup=0, progress=False)
    by = {(r.method, r.turn): r for r in run.results}
    for m in ("vanilla", "eagle2"):
        first, second = by[(m, 0)], by[(m, 1)]
        assert second.prompt_ids == first.prompt_ids + first.output_ids + [7, 7]
        assert len(first.output_ids) == 6


def test_real_chat_template_history(tiny):
    """Template mode re-renders the conversation with the decoded answer of the previous turn."""
    tok = char_tokenizer(with_template=True)
    target, head = tiny
    model = EaModel(target, head, DecodingConfig(total_token=12, depth=3, top_k=4))
    fmt = ChatFormat(tok)
    run = run_benchmark({"A": model}, fmt, [Question("q", "c", ["Hi", "More"])], parse_methods([], model.decoding),
                        GenerationArgs(max_new_tokens=5, max_length=512, eos_token_id=[]), warmup=0, progress=False)
    first, second = run.results
    answer = tok.decode(first.output_ids, skip_special_tokens=True)
    assert tok.decode(second.prompt_ids) == f"<user>Hi</s><assistant>{answer}</s><user>More</s><assistant>"


DISTRIBUTION_SAMPLES = 150  # power: tests/test_statistical_power.py


def distribution_test_run(model, vanilla, method, **kw):
    """`run(samples, seed)` for tests/statistical_rule.py: distribution_test's positions, one Bonferroni p-value (the
    tool's own pass rule: every position at alpha / positions)."""
    def run(samples, seed):
        t = distribution_test(model, vanilla, method, [5, 9, 14], samples=samples, seed=seed, **kw)
        return bonferroni(*(p.p_value for p in t.positions)), f"positions {[p.__dict__ for p in t.positions]}"
    return run


@pytest.mark.statistical
def test_chi2_passes_for_eagle2_and_fails_for_a_biased_sampler():
    # a 16-token vocabulary and moderate logits: the next-token distributions are far from one-hot
    target = tiny_llama(vocab_size=16, init_std=0.2, seed=1)
    model = EaModel(target, random_head(target), DecodingConfig(total_token=8, depth=2, top_k=3))
    vanilla, eagle2 = parse_methods(["eagle2"], model.decoding)
    kw = dict(positions=[1, 2], samples=DISTRIBUTION_SAMPLES, temperature=1.0, max_length=64, eos_token_id=[],
              alpha=0.01)
    law = {k: v for k, v in kw.items() if k != "samples"}
    assert_same_law(distribution_test_run(model, vanilla, eagle2, **law), draws=DISTRIBUTION_SAMPLES, seed=0,
                    what="distribution_test of eagle2 against vanilla")

    class Biased:  # samples the speculative side at a lower temperature: a subtly wrong distribution
        base_model = model.base_model
        naivegenerate = model.naivegenerate

        def eagenerate(self, ids, **k):
            return model.eagenerate(ids, **{**k, "temperature": k["temperature"] * 0.5})

    bad = distribution_test(Biased(), vanilla, eagle2, [5, 9, 14], **kw)
    assert not bad.passed and min(p.p_value for p in bad.positions) < 1e-4


def test_cli_autotune_saves_tree_config(saved, tmp_path):
    head_dir = tmp_path / "head"
    head_dir.mkdir()
    for f in (saved / "head").iterdir():
        (head_dir / f.name).write_bytes(f.read_bytes())
    args = cli(saved, "--out", str(tmp_path / "eval"), "eval.tune_total_tokens=[6,12]", "eval.tune_depths=[2]",
               "eval.tune_top_ks=[2,4]", "eval.tune_prompts=2", "eval.tune_max_new_tokens=8", "eval.tune_finalists=2",
               "eval.tune_repeats=2")
    args[args.index("--head") + 1] = str(head_dir)
    assert main(["autotune", *args]) == 0
    saved_cfg = json.loads((head_dir / "tree_config.json").read_text())
    assert set(saved_cfg) == {f.name for f in dataclasses.fields(DecodingConfig)}
    report = json.loads((tmp_path / "eval" / "autotune" / "autotune.json").read_text())
    # 6/2/2 needs no more than 1 + 2 + 2*4 = 11 nodes, 12/2/2 does: skipped
    assert {(p["total_token"], p["top_k"]) for p in report["points"]} == {(6, 2), (6, 4), (12, 4)}
    assert [(s["total_token"], s["top_k"]) for s in report["skipped"]] == [(12, 2)]
    finalists = [p for p in report["points"] if p["final_tokens_per_s"] is not None]
    # the 2 settings with the highest predicted tokens/s (after the refit on every call) were re-timed, beside
    # vanilla and EAGLE-1; the pick is the highest predicted one unless the re-timing overruled it
    assert len(finalists) == 2 and all(p["final_tokens_per_s"] > 0 and p["final_vs_eagle1"] > 0 for p in finalists)
    assert report["eagle1_tokens_per_s"] > 0 and report["time_model"]["calls"] >= 3 * 2
    for p in report["points"]:  # tau / modelled round seconds
        assert p["predicted_tokens_per_s"] == p["tau"] / p["predicted_round_s"]  # the same two floats divided
    by_label = {f"{p['total_token']}/{p['depth']}/{p['top_k']}": p for p in finalists}
    predicted_best = max(finalists, key=lambda p: p["predicted_tokens_per_s"])
    assert by_label[report["pick"]["predicted_best"]] is predicted_best
    best = predicted_best if report["pick"]["by"] == "model" else max(
        finalists, key=lambda p: report["pick"]["challengers"].get(
            f"{p['total_token']}/{p['depth']}/{p['top_k']}", {}).get("median_ratio", 0))
    assert (saved_cfg["total_token"], saved_cfg["depth"], saved_cfg["top_k"]) == (best["total_token"], 2, best["top_k"])
    assert (tmp_path / "eval" / "autotune" / "autotune_surface.png").stat().st_size > 0
    # EaModel picks the saved tree up, and the "tuned" method reads it
    assert EaModel.from_pretrained(str(saved / "target"), str(head_dir)).decoding.total_token == best["total_token"]
    assert main([*args, "--out", str(tmp_path / "eval2"), "eval.methods=[tuned]", "eval.num_questions=1"]) == 0


def test_cli_bench_warns_once_when_a_tree_outgrows_its_calibration_map(saved, tmp_path, caplog):
    head_dir = tmp_path / "head"
    head_dir.mkdir()
    for f in (saved / "head").iterdir():
        (head_dir / f.name).write_bytes(f.read_bytes())
    # a greedy map fitted on node depths 1-2 x ranks 0-3: the 12/3/4 tree reaches depth 4
    cal = ScoreCalibration(0.0, 0.0, 0, [[[0.01, 0.5]]], [[[0.3, 0.9]]],
                           fitted_on={"nodes": 480, "coverage": {"nodes": [[60] * 4] * 2, "min_nodes": 30}})
    save_tree_config(head_dir, DecodingConfig(total_token=12, depth=3, top_k=4), cal)
    args = cli(saved, "--out", str(tmp_path / "eval"), "eval.methods=[eagle1,eagle2]", "eval.num_questions=1")
    args[args.index("--head") + 1] = str(head_dir)
    with caplog.at_level(logging.WARNING, logger="evaluation"):
        assert main(args) == 0
    lines = [r.getMessage() for r in caplog.records if "calibration map" in r.getMessage()]
    assert len(lines) == 1, lines  # eagle1 (static) uses no map
    assert lines[0].startswith("method eagle2: tree 12/3/4 reaches node depth 4 x 4 ranks") and "\n" not in lines[0]
    assert "covers depth 2 x 4 ranks (8 cells with fewer than 30 fitted nodes" in lines[0]
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert "covering node depths 1-2 x ranks 0-3" in json.dumps(report["meta"])  # the report names the coverage


def test_live_measure_tau_restores_the_head(tiny):
    target, _ = tiny
    head = random_head(target).train()
    flags = [p.requires_grad for p in head.parameters()]
    res = measure_tau(target, head, [[5, 9, 14], [100, 2]], decoding=DecodingConfig(total_token=12, depth=3, top_k=4),
                      max_new_tokens=8, eos_token_id=[])
    assert head.training and [p.requires_grad for p in head.parameters()] == flags
    assert res.prompts == 2 and res.new_tokens == 16 and res.rounds >= 1
    assert res.tau == pytest.approx((res.new_tokens - 2) / res.rounds)  # the prefill token of each prompt is not counted
    assert "eval/alpha_1" in res.to_dict("eval/")
    tok = char_tokenizer(with_template=False)
    assert measure_tau(target, head, ["Once"], tokenizer=tok, max_new_tokens=4, eos_token_id=[]).prompts == 1
    with pytest.raises(ValueError, match="need a tokenizer"):
        measure_tau(target, head, ["Once"])


def test_cli_exit_code_and_report_on_a_lossy_eagenerate(saved, tmp_path, monkeypatch):
    real = EaModel.eagenerate

    def lossy(self, input_ids, **kw):  # changes the 3rd generated token of every speculative output
        out, stats = real(self, input_ids, **kw)
        out = out.clone()
        out[0, input_ids.shape[1] + 2] = (out[0, input_ids.shape[1] + 2] + 1) % VOCAB
        return out, stats

    monkeypatch.setattr(EaModel, "eagenerate", lossy)
    out = tmp_path / "eval"
    rc = main(cli(saved, "--out", str(out), "eval.methods=[eagle2]", "eval.num_questions=2", "eval.warmup=0"))
    assert rc == 1
    data = json.loads((out / "report.json").read_text())
    assert not data["losslessness"]["lossless"]
    assert {(m["question_id"], m["turn"], m["position"]) for m in data["losslessness"]["mismatches"]} == {("1", 0, 2),
                                                                                                          ("2", 0, 2)}
    assert "NOT LOSSLESS" in (out / "report.md").read_text()


def test_cli_sampling_bench_and_chi2_command(saved, tmp_path):
    out = tmp_path / "eval"
    assert main(cli(saved, "--out", str(out), "eval.methods=[eagle2]", "eval.num_questions=2",
                    "eval.temperature=1.0", "eval.top_p=0.9")) == 0
    data = json.loads((out / "report.json").read_text())
    assert data["losslessness"] is None and data["meta"]["generation"]["temperature"] == 1.0
    assert "distribution test" in (out / "report.md").read_text()
    assert main(["chi2", *cli(saved, "--out", str(out), "eval.methods=[chain,eagle2]", "eval.chi2_samples=25",
                              "eval.chi2_positions=[0,3]")]) == 0
    chi2 = json.loads((out / "chi2" / "chi2.json").read_text())
    assert [t["method"] for t in chi2["tests"]] == ["chain", "eagle2"]
    assert [p["position"] for p in chi2["tests"][1]["positions"]] == [0, 3]
    assert (out / "chi2" / "chi2.md").read_text().count("PASS") == 2


def test_cli_eagle2_and_eagle3_heads_in_one_interleaved_run(tmp_path, capsys):
    """Head A (EAGLE-2) and head B (EAGLE-3) on one 4-layer target: methods name the head with @B, each setting runs
    once per head, every pair is compared on the same prompts (tau ratio with a CI), outputs stay lossless."""
    from tiny_models import EAGLE3_AUX, EAGLE3_LAYERS

    target = tiny_llama(vocab_size=VOCAB, eos_token_id=1, num_layers=EAGLE3_LAYERS)
    target.save_pretrained(tmp_path / "target")
    char_tokenizer(with_template=False).save_pretrained(tmp_path / "target")
    random_head(target).save_pretrained(tmp_path / "head2")
    random_head(target, kind="eagle3", aux_layers=EAGLE3_AUX).save_pretrained(tmp_path / "head3")
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [t]}) + "\n"
                                              for i, t in enumerate(["Once upon a time", "The dog ran"])))
    rc = main(["--base", str(tmp_path / "target"), "--head", str(tmp_path / "head2"), "--compare-head",
               str(tmp_path / "head3"), "--questions", str(tmp_path / "q.jsonl"), "--out", str(tmp_path / "eval"),
               "target.dtype=float32", "eval.max_new_tokens=12", "eval.bootstrap_samples=200", "eval.threads=1",
               "decoding.total_token=12", "decoding.depth=3", "decoding.top_k=4",
               "eval.methods=[vanilla,eagle2,eagle2@B,'eagle2@B:depth=2']"])
    assert rc == 0
    data = json.loads((tmp_path / "eval" / "report.json").read_text())
    overall = [s["method"] for s in data["summaries"] if s["category"] == "overall"]
    assert overall == ["vanilla", "eagle2", "eagle2@B", "eagle2@B:depth=2"]  # no automatic "[B]" copies
    meta = data["meta"]["methods"]
    assert meta["eagle2@B"]["head"] == "B" and meta["eagle2@B"]["describe"].endswith("head B (eagle3)")
    assert meta["eagle2"]["describe"].endswith("head A (eagle2)") and meta["eagle2@B:depth=2"]["depth"] == 2
    pairs = {(c["a"], c["b"]): c for c in data["comparisons"]}
    ratio = pairs[("eagle2", "eagle2@B")]["tau_ratio"]
    assert ratio["ci_low"] <= ratio["value"] <= ratio["ci_high"]
    assert data["losslessness"]["lossless"]
    assert "| tau(a) / tau(b) |" in (tmp_path / "eval" / "report.md").read_text()
    capsys.readouterr()
    assert main(["--base", str(tmp_path / "target"), "--head", str(tmp_path / "head2"), "--questions",
                 str(tmp_path / "q.jsonl"), "eval.methods=[eagle2@B]"]) == 2  # not a silent head A
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use head B, but eval.compare_head" in err[0]
