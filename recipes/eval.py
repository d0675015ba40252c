"""Recipe section `eval` (read by evaluation/). Every evaluation default lives here, once.

Tree shapes are NOT defaulted here: methods start from the recipe's `decoding` section
(eagle/decoding_config.py) and override single fields, e.g. "eagle2:total_token=30,depth=4".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from recipes.check import check


@dataclass
class EvalSettings:
    # --- what to evaluate -------------------------------------------------------------
    head_path: str = ""  # draft head folder or hub id; "" = {output_dir}/head
    compare_head: str = ""  # a second head (EAGLE-2 or -3): methods "NAME@B[:k=v]" use it; none named: all repeat as "NAME[B]"
    output_dir: str = ""  # reports go here; "" = {output_dir}/eval
    # --- prompts ----------------------------------------------------------------------
    # questions: *.jsonl[.gz] in the MT-bench/Spec-Bench schema (question_id, category, turns),
    # *.txt with one prompt per line, "paragraphs:FILE" (opening sentences of blank-line separated
    # paragraphs), "hf:DATASET[:CONFIG]" (see hf_* keys), or a set shipped with the package: "mt-bench",
    # "reasoning-tools" (reasoning and tool-call prompts, evaluation/question_sets/README.md), "long-context"
    # (12 prompts of about 1k-24k tokens, for eval.context_buckets)
    # (evaluation/question_sets/). "" = the embedded default target's questions_eval.jsonl when target.path
    # is "", else mt-bench.
    questions: str = ""
    num_questions: int = 0  # 0 = all (after the category filter)
    categories: list[str] = field(default_factory=list)  # [] = all categories
    paragraph_sentences: int = 1  # "paragraphs:" sources: sentences kept per paragraph
    paragraph_from_end: bool = True  # "paragraphs:" sources: take paragraphs from the END of the file
    hf_split: str = "test"
    hf_column: str = "turns"  # a list-of-strings column (turns) or a string column (one turn)
    hf_category_column: str = ""  # "" = one category named after the dataset
    turn_separator: str = "\n"  # raw-text prompts (no chat template): joins history and the next turn
    # --- decoding ---------------------------------------------------------------------
    methods: list[str] = field(default_factory=lambda: ["vanilla", "chain", "eagle1", "eagle2"])
    max_new_tokens: int = 256
    max_length: int = 0  # prompt + generated limit; 0 = the target's max_position_embeddings
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    warmup: int = 1  # warm-up generations per method before anything is timed
    eos_token_ids: list[int] = field(default_factory=list)  # [] = generation config + tokenizer + template stops
    threads: int = 0  # torch intra-op threads; 0 = torch's default. 1 is far faster on a busy machine
    # --- statistics -------------------------------------------------------------------
    bootstrap_samples: int = 5000
    confidence_level: float = 0.95
    calibration_bins: int = 10
    context_buckets: list[int] = field(default_factory=lambda: [1024, 4096, 16384])  # prompt-token edges of the report's "by context length" buckets (<1k, 1k-4k, 4k-16k, 16k+); [] = one bucket
    save_outputs: bool = True  # answers.jsonl with every method's decoded text and token ids
    fail_on_mismatch: bool = True  # exit code 1 when a T = 0 output diverges from vanilla's (beyond a near-tie)
    tie_ulps: float = 4.0  # a mismatch whose target logits differ by <= this many ulps (target dtype) is a near-tie
    # --- tree auto-tuning (`autotune` command) -----------------------------------------
    # narrow trees (top_k 2-3, 10-20 nodes) win on small or CPU targets, where a draft row or a verified
    # node is not free; wide ones on large GPU targets
    tune_total_tokens: list[int] = field(default_factory=lambda: [10, 16, 20, 30, 45, 60, 80])
    tune_depths: list[int] = field(default_factory=lambda: [3, 4, 5, 6, 7, 8])
    tune_top_ks: list[int] = field(default_factory=lambda: [2, 3, 4, 6, 8, 10])
    tune_prompts: int = 4  # taken after the first num_questions (disjoint from the bench) when the source has enough
    tune_max_new_tokens: int = 96
    tune_finalists: int = 5  # the settings with the highest predicted tokens/s (tau / modelled round time), re-timed
    tune_repeats: int = 5  # re-timed repeats of every finalist beside vanilla and EAGLE-1; they overrule the model
    # only when a finalist beats its pick in every repeat by > 10% (evaluation/autotune.py)
    tune_save: bool = True  # write tree_config.json next to the head (when it is a local folder)
    # --- calibrated tree scores (`autotune` fits them first; eagle/score_calibration.py) -------------------
    # held-out prompts decoded (after the bench's and the tuning's) to fit the map from draft probability to
    # acceptance at eval.temperature (/top_p/top_k); 0 = fit none (trees rank by the raw draft probabilities)
    calibration_prompts: int = 16
    calibration_passes: int = 2  # pass 1 on the coverage tree (every (depth, rank) cell), then refits with the map so far
    # --- distribution test at T > 0 (`chi2` command; tests every speculative method) ------
    chi2_samples: int = 400  # samples per method
    chi2_positions: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # 0-based generated positions
    chi2_temperature: float = 1.0
    chi2_alpha: float = 0.01  # family-wise, Bonferroni-corrected over positions
    chi2_min_expected: float = 5.0  # rarer tokens are pooled into one "other" cell


def validate_eval_section(ev) -> None:
    """Check every value of the `eval` section (RecipeError naming the key)."""
    def finite(key, lo, hi=math.inf, lo_open=False, hi_open=False):
        v = ev[key]
        ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
        check(ok, f"eval.{key}", v, f"expected a number in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}")

    for key in ("num_questions", "max_length", "top_k", "warmup", "threads", "calibration_prompts"):
        check(ev[key] >= 0, f"eval.{key}", ev[key], "expected >= 0")
    for key in ("max_new_tokens", "bootstrap_samples", "calibration_bins", "paragraph_sentences", "tune_prompts",
                "tune_max_new_tokens", "tune_finalists", "tune_repeats", "chi2_samples", "calibration_passes"):
        check(ev[key] >= 1, f"eval.{key}", ev[key], "expected >= 1")
    finite("temperature", 0)
    finite("top_p", 0, 1)
    finite("confidence_level", 0, 1, lo_open=True, hi_open=True)
    finite("tie_ulps", 0)
    finite("chi2_temperature", 0, lo_open=True)
    finite("chi2_alpha", 0, 1, lo_open=True, hi_open=True)
    finite("chi2_min_expected", 0, lo_open=True)
    check(len(ev.methods) >= 1, "eval.methods", list(ev.methods), "expected at least one method")
    for key in ("tune_total_tokens", "tune_depths", "tune_top_ks"):
        check(len(ev[key]) >= 1 and all(int(v) >= 1 for v in ev[key]), f"eval.{key}", list(ev[key]),
              "expected a non-empty list of integers >= 1")
    check(all(int(p) >= 0 for p in ev.chi2_positions), "eval.chi2_positions", list(ev.chi2_positions),
          "expected positions >= 0")
    check(all(int(e) >= 0 for e in ev.eos_token_ids), "eval.eos_token_ids", list(ev.eos_token_ids), "expected ids >= 0")
    edges = [int(e) for e in ev.context_buckets]
    check(all(e >= 1 for e in edges) and edges == sorted(set(edges)), "eval.context_buckets", edges,
          "expected strictly increasing token counts >= 1 (bucket edges)")
