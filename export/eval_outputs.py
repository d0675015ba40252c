"""The evaluation outputs read back below the evaluation layer (the model card, export/hub.py) and by the quickstart:
their state-file declarations (eagle/state_files.py) live here, at the lowest layer that reads them; evaluation/
writes them through these."""
from __future__ import annotations

from eagle.state_files import StateFile, register

_CI = {"value": (float, type(None)), "ci_low?": (float, type(None)), "ci_high?": (float, type(None))}
EVAL_REPORT = register(StateFile(
    "report.json", "EVAL_DIR", writer="evaluation/report.py",
    schema={"meta?": dict,
            "summaries": [{"method": str, "category": str, "questions?": int, "tau": _CI, "tokens_per_s": _CI,
                           "speedup?": (_CI, type(None)), "*": object}],
            "comparisons?": [{"a": str, "b": str, "category": str, "tau_ratio": _CI, "speed_ratio": _CI, "*": object}],
            "headline?": (dict, type(None)), "losslessness?": ({"mismatches": list, "compared": int, "*": object},
                                                             type(None)),
            "*": object},
    rebuild="delete it and rerun the evaluation that wrote it (`python -m evaluation --recipe RECIPE`, or the "
            "quickstart stage eval)",
    when_missing="no evaluation was run: the model card has no evaluation section",
    example={"meta": {}, "summaries": [{"method": "eagle2", "category": "overall", "questions": 2,
                                        "tau": {"value": 1.5, "ci_low": 1.2, "ci_high": 1.8},
                                        "tokens_per_s": {"value": 9.0}, "speedup": None}],
             "comparisons": [], "headline": None, "losslessness": {"mismatches": [], "compared": 4}}))


SWEEP = register(StateFile(
    "sweep.json", "SERVE_SWEEP_DIR", writer="evaluation/serve_sweep.py",
    schema={"engine_version": (str, type(None)), "max_new_tokens": int, "load_average": ([float], type(None)),
            "best": [{"concurrency": int, "best_k": int, "output_tokens_per_s": float, "*": object}], "points": [dict],
            "*": object},
    rebuild="delete it and rerun `python -m evaluation serve-sweep --recipe RECIPE`",
    when_missing="no serve-sweep was run: the model card has no draft-length table",
    example={"engine_version": "0.32.0", "max_new_tokens": 128, "load_average": [1.0, 1.0, 1.0],
             "best": [{"concurrency": 1, "best_k": 3, "output_tokens_per_s": 80.0}], "points": []}))
