"""The Hub model card (README.md) of an exported head: base model, recipe, data, held-out metrics and, when
the evaluation has run, its tau/speedup table and plots."""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from eagle.decoding_config import DecodingConfig
from eagle.head_kinds import EAGLE2
from eagle.quantization import NONE, QuantMethod, quant_method
from export.engine_formats import ENGINE_VERSIONS
from export.head_kinds import EXPORT, ExportKind, export_kind, served_kind
from export.eval_outputs import SWEEP
from export.speculative_schedule import (SCHEDULE_KEY, SPEC_CONFIG_FILE, check_speculative_config, schedule_text,
                                         vllm_speculative_config)
from recipes.layout import SERVE_SWEEP_DIR


def _fmt(x, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else "–"


def _estimate(e) -> float | None:
    if isinstance(e, dict):
        return e.get("value")
    return e if isinstance(e, (int, float)) else None


def evaluation_rows(report: dict) -> list[str]:
    """Markdown rows (method, tau, tokens/s, speedup) of an evaluation report.json's overall summaries."""
    rows = []
    for s in report.get("summaries", []):
        if s.get("category") != "overall":
            continue
        rows.append(f"| {s.get('method')} | {_fmt(_estimate(s.get('tau')), 2)} | {_fmt(_estimate(s.get('tokens_per_s')), 1)} | "
                    f"{_fmt(_estimate(s.get('speedup')), 2)} |")
    return rows


def model_card(cfg, repo_id: str, license: str, summary: dict | None, data_manifest: dict | None,
               eval_report: dict | None, plots: list[str], fmt: str = "eagle", head_config: dict | None = None,
               sweep: dict | None = None) -> str:
    """README.md text. `cfg`: the recipe the head was TRAINED with; `plots`: repo-relative PNG paths to embed;
    `fmt`: the folder format uploaded (eagle | vllm | sglang), which the serving commands load; `head_config`: the
    exported config.json (decides the head kind: an EAGLE-3 card states its aux layers and draft vocabulary);
    `sweep`: serve-sweep's sweep.json (the draft length to serve per concurrency level)."""
    t = cfg.train
    d = DecodingConfig()  # the library's tree defaults, which EaModel.from_pretrained takes too
    kind = export_kind(served_kind(head_config or {}))  # the uploaded folder: released layout or vLLM speculators
    target = (summary or {}).get("target") or cfg.target.path or "embedded quickstart default target"
    quant = quant_method(str(OmegaConf.select(cfg, "target.quantization", default=NONE)))  # an older recipe.yaml: none
    tags = ["eagle", kind.tag, "speculative-decoding", "draft-model"]
    card_meta = {"base_model": target if "/" in target and not Path(target).exists() else None,
                 "library_name": "eagle2-train", "license": license,
                 "tags": tags, "pipeline_tag": "text-generation"}
    front = "---\n" + OmegaConf.to_yaml(OmegaConf.create({k: v for k, v in card_meta.items() if v})) + "---\n"
    intro, loss, cite = kind.card_intro(target, head_config or {}, cfg), kind.card_loss(cfg), kind.citation
    lines = [
        front,
        *intro,
        "",
        "## Usage",
        "",
        "```python",
        "import torch",
        "from eagle import EaModel",
        "",
        f'model = EaModel.from_pretrained(base_model_path="{target}", ea_model_path="{repo_id}",',
        f"                                total_token={d.total_token}, depth={d.depth}, top_k={d.top_k}, "
        "torch_dtype=torch.float16" + (f', quantization="{quant.name}"' if quant.bits else "") + ")",
        "ids = model.eagenerate(input_ids, temperature=0.0, max_new_tokens=512)",
        "```",
        "",
        "The reference EAGLE code loads this folder too (`ea_model_path=...`)." if fmt == "eagle" else
        f"This folder is in the {fmt} engine format (`python -m train.export --format {fmt}`); the official EAGLE "
        "folder is what the code above loads.",
        "",
        *quantization_section(quant, eval_report),
        *serving_section(cfg, target, repo_id, fmt, kind),
        *sweep_section(sweep, target, vllm_folder(repo_id, fmt), kind),
        "## Training",
        "",
        "| setting | value |",
        "|---|---|",
        f"| recipe | `{cfg.name}` (`recipe.yaml` in this repo) |",
        f"| data | `{cfg.data.source or (data_manifest or {}).get('source') or 'see recipe.yaml'}`"
        + (f", {data_manifest.get('num_records')} records / {data_manifest.get('num_tokens')} tokens "
           f"({data_manifest.get('num_loss_tokens')} trained on)" if data_manifest else "") + " |",
        f"| feature source | {t.mode} ({'data_prep feature cache' if t.mode == 'offline' else 'target run inside the loop'}) |",
        f"| optimiser | AdamW lr {t.lr}, betas {list(t.betas)}, weight decay {t.weight_decay}, "
        f"{t.schedule} decay after {t.warmup_steps} warmup steps, clip {t.grad_clip} |",
        f"| batch | {t.micro_batch_size} sequences x {t.grad_accum} accumulation x {(summary or {}).get('world_size', 1)} ranks |",
        loss,
        f"| precision | {t.precision}, ZeRO-{t.zero_stage} |",
    ]
    if summary:
        lines += [f"| steps | {summary.get('steps')} ({_fmt(summary.get('epochs'), 2)} epochs, "
                  f"{summary.get('train_records')} train / {summary.get('eval_records')} held-out records) |",
                  f"| throughput | {_fmt(summary.get('train_tokens_per_s'), 0)} tokens/s |"]
    ev = (summary or {}).get("eval") or {}
    if ev:
        steps = sorted(int(k[len("eval/step"):-len("_acc")]) for k in ev if k.startswith("eval/step") and k.endswith("_acc"))
        lines += ["", "## Held-out metrics (teacher-forced, from training)", "",
                  "| top-1 | top-2 | top-3 | " + " | ".join(f"self-fed step {j}" for j in steps) + " | simulated acceptance length |",
                  "|" + "---|" * (4 + len(steps)),
                  f"| {_fmt(ev.get('eval/top1'))} | {_fmt(ev.get('eval/top2'))} | {_fmt(ev.get('eval/top3'))} | "
                  + " | ".join(_fmt(ev.get(f"eval/step{j}_acc")) for j in steps) + f" | {_fmt(ev.get('eval/sim_accept_len'), 2)} |",
                  "",
                  "top-k: the base model's argmax is among the head's k best tokens. Self-fed step j: accuracy of the j-th "
                  "draft token of a chain that feeds the head its own predicted features. Simulated acceptance length: "
                  "1 + mean accepted draft tokens of such greedy chains."]
    if eval_report:
        rows = evaluation_rows(eval_report)
        meta = eval_report.get("meta", {})
        lines += ["", "## Evaluation (speculative decoding)", ""]
        if meta.get("questions"):
            lines.append(f"Prompts: `{meta['questions']}`; hardware: {meta.get('hardware', 'see eval/report.json')}.")
            lines.append("")
        if rows:
            lines += ["| method | tau | tokens/s | speedup |", "|---|---|---|---|", *rows, ""]
        lines.append("Full report: [eval/report.md](eval/report.md).")
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    lines += ["", "## Citation", "", cite, ""]
    return "\n".join(lines)


def quantization_section(quant: QuantMethod, eval_report: dict | None) -> list[str]:
    """Markdown lines naming the target quantization the head was trained and measured for, and how to serve the
    target quantized so (none for a full-precision target: the card is as before)."""
    if not quant.bits:
        return []
    measured = ((eval_report or {}).get("meta") or {}).get("quantization", NONE)
    lines = ["## Target quantization", "",
             f"Trained on the hidden states of the target quantized as `{quant.name}`: {quant.describe} "
             "(`target.quantization`, docs/quantization.md)" + (f"; the evaluation below decoded against the same "
             "quantized target" if measured == quant.name else f"; the evaluation below decoded against a `{measured}` "
             "target, not the one it was trained for") + ". Serve it beside the target quantized the same way: "
             f"{quant.vllm_serve}, with the speculative config below naming that checkpoint as the base. Output "
             "stays exactly that quantized model's.", ""]
    return lines


def serving_section(cfg, target: str, repo_id: str, fmt: str, kind: ExportKind) -> list[str]:
    """Markdown lines: copy-paste vLLM and SGLang commands for this head (`serving_commands`)."""
    d = DecodingConfig()  # a recipe without a decoding section (e.g. an older recipe.yaml) gets the defaults
    get = lambda key: int(OmegaConf.select(cfg, f"decoding.{key}", default=getattr(d, key)))  # noqa: E731
    decoding = DecodingConfig(**{key: get(key) for key in ("total_token", "depth", "top_k", "chain_length")})
    cmds = serving_commands(target, repo_id, fmt, kind, decoding)
    lines = ["## Serving", ""]
    for engine, label in (("vllm", "vLLM"), ("sglang", "SGLang")):
        lines += [f"{label} (format checked against {ENGINE_VERSIONS[engine]}):", "", "```bash", cmds[engine], "```", ""]
    lines += ["vLLM drafts a chain (`num_speculative_tokens`); SGLang a tree (`--speculative-num-steps` = depth, "
              "`--speculative-eagle-topk`, `--speculative-num-draft-tokens`). Check the head in the engine before "
              "deploying: `python -m evaluation serve-check --engine vllm --base BASE --head HEAD`.", ""]
    return lines


def vllm_folder(draft: str, fmt: str) -> str:
    """The draft folder the card's vLLM commands serve: `draft` itself in vLLM's format, else the converted copy."""
    return str(draft) if fmt == "vllm" else f"{Path(str(draft)).name}-vllm"


def card_speculative_config(sweep: dict | None, draft: str, kind: ExportKind) -> dict | None:
    """serve-sweep's fitted speculative config (k per batch size) with `model` = the folder the card serves and the
    head kind's keys (`vllm_spec`: a P-EAGLE head's parallel_drafting), checked as served (`check_speculative_config`):
    the card's command and the uploaded speculative_config.json never name a schedule the engine cannot run."""
    config = ((sweep or {}).get("schedule") or {}).get("speculative_config")
    if not config:
        return None
    where = f"serve-sweep's {SWEEP.name} (its schedule's speculative_config)"
    return check_speculative_config({**config, **kind.vllm_spec(), "model": str(draft)}, where, served=kind.vllm_spec())


def sweep_section(sweep: dict | None, base: str = "BASE", draft: str = "HEAD-vllm",
                  kind: ExportKind = EXPORT[EAGLE2]) -> list[str]:
    """Markdown lines: serve-sweep's best num_speculative_tokens per concurrency level, with its plot, and the
    fitted per-batch-size schedule as a `vllm serve` command (`draft`: the vLLM-format folder)."""
    if not sweep or not sweep.get("best"):
        return []
    lines = ["### Draft length by load", "",
             f"Measured with `python -m evaluation serve-sweep` (vLLM {sweep.get('engine_version')}, greedy, "
             f"{sweep.get('max_new_tokens')} new tokens per request, machine load {sweep.get('load_average')}; "
             f"[eval/{SERVE_SWEEP_DIR}/sweep.md](eval/{SERVE_SWEEP_DIR}/sweep.md)). Throughput-optimal "
             "`num_speculative_tokens` per number of requests in flight (0 = serve without speculation):", "",
             "| concurrency | num_speculative_tokens | output tokens/s | vs no speculation | next best |",
             "|---|---|---|---|---|"]
    for b in sweep["best"]:
        runner_k = b.get("runner_up_k")
        runner = ("–" if runner_k is None else
                  f"{'no speculation' if runner_k == 0 else f'k = {runner_k}'}, {b['runner_up_slower_by']:.0%} slower")
        speed = b.get("speedup_vs_no_speculation")
        lines.append(f"| {b['concurrency']} | {b['best_k']}{' (no speculation)' if b['best_k'] == 0 else ''} | "
                     f"{b['output_tokens_per_s']:.0f} | {f'{speed:.2f}x' if speed else '–'} | {runner} |")
    lines += ["", f"![throughput vs concurrency](eval/{SERVE_SWEEP_DIR}/throughput.png)", ""]
    config = card_speculative_config(sweep, draft, kind)
    if config:
        cmp = sweep["schedule"].get("comparison") or {}
        per = cmp.get("per_level") or []
        lines += ["vLLM switches the draft length by batch size itself (`" + SCHEDULE_KEY + "`, fitted from the "
                  f"table above: {schedule_text(config[SCHEDULE_KEY])}; `{SPEC_CONFIG_FILE}` in this repo):", "",
                  "```bash", f"vllm serve {base} --speculative-config '{json.dumps(config)}'", "```", ""]
        if per:
            lines += ["Served in the same sweep, the schedule reached "
                      + ", ".join(f"{x['ratio']:.2f}x" for x in per) + " the best fixed k's tokens/s at concurrency "
                      + ", ".join(str(x["concurrency"]) for x in per) + ".", ""]
    return lines
def serving_commands(base: str, draft: str, fmt: str, kind: ExportKind = EXPORT[EAGLE2],
                     decoding: DecodingConfig | None = None, num_speculative_tokens: int | None = None) -> dict[str, str]:
    """Copy-paste commands serving `draft` (a folder or Hub id in format `fmt`) on `base`, per engine: SGLang's tree
    from `decoding` (default: the library's defaults), vLLM's chain of `num_speculative_tokens` (default: its
    chain_length). An engine whose format is not `fmt` gets the conversion command first (from the official folder:
    `draft` itself when fmt is eagle, else the placeholder OFFICIAL_HEAD_DIR)."""
    d = decoding or DecodingConfig()
    num_speculative_tokens = d.chain_length if num_speculative_tokens is None else num_speculative_tokens
    method, algo, flag = kind.vllm_method, kind.sglang_algorithm, kind.convert_flag  # what the engines call the kind
    official = draft if fmt == "eagle" else "OFFICIAL_HEAD_DIR"  # engine folders are converted from the official one
    out = {}
    for engine in ("vllm", "sglang"):
        path = draft if fmt == engine else f"{Path(str(draft)).name}-{engine}"
        convert = "" if fmt == engine else (
            f"python -m train.export {flag} {official} --base {base} --format {engine} --out {path}\n")
        if engine == "vllm":
            spec = json.dumps(vllm_speculative_config(kind.vllm_spec(), path, num_speculative_tokens))
            out[engine] = f"{convert}vllm serve {base} --speculative-config '{spec}'"
        elif kind.sglang_refusal:
            out[engine] = f"# {kind.sglang_refusal}"
        else:
            out[engine] = (f"{convert}python -m sglang.launch_server --model-path {base} "
                           f"--speculative-algorithm {algo} --speculative-draft-model-path {path} "
                           f"--speculative-num-steps {d.depth} --speculative-eagle-topk {d.top_k} "
                           f"--speculative-num-draft-tokens {d.total_token}")
    return out

