"""The Hub model card (README.md) of an exported head: base model, recipe, data, held-out metrics and, when
the evaluation has run, its tau/speedup table and plots."""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf


SWEEP_DIR = "serve_sweep"  # under the eval folder: evaluation/main.py serve-sweep writes it, the card and the Hub read it
SWEEP_FILES = ("sweep.md", "sweep.json", "throughput.png")


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


def eagle3_intro(head_config: dict, cfg) -> list[str]:
    """The EAGLE-3 card's description: aux layers with their convention, draft vocabulary, layout, engines."""
    eagle_config = head_config.get("eagle_config") or {}
    aux = eagle_config.get("eagle_aux_hidden_state_layer_ids") or head_config.get("eagle_aux_hidden_state_layer_ids")
    return [
        "A one-layer EAGLE-3 draft head (lossless speculative decoding; draft trees as in EAGLE-2), trained with the "
        f"training-time test ({OmegaConf.select(cfg, 'head.ttt_steps', default='k')} unrolled steps).",
        "",
        "| | |",
        "|---|---|",
        f"| aux layers | `{aux}`: HF `output_hidden_states` indices (0 = the embeddings, j = the hidden state ENTERING "
        "decoder layer j), the convention of the EAGLE-3 reference code and of vLLM's "
        "`eagle_aux_hidden_state_layer_ids`; tools that name \"the layer whose output is taken\" write j - 1 |",
        f"| draft vocabulary | {head_config.get('draft_vocab_size')} of the base model's {head_config.get('vocab_size')} "
        "tokens (`d2t`: target id = draft id + d2t[draft id]; `t2d`: bool mask over the target vocabulary) |",
        "| fusion | `fc` [H, 3H] (no bias) over the three aux states concatenated in that order |",
        "",
        "Released EAGLE-3 layout (yuhuili/EAGLE3-*, SpecForge): `config.json` (`LlamaForCausalLMEagle3`, "
        "`draft_vocab_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`) + `model.safetensors` with `midlayer.*`, "
        "`fc`, `norm`, `lm_head`, `d2t`, `t2d` and no `embed_tokens` (the base model's embedding is used).",
    ]


def model_card(cfg, repo_id: str, license: str, summary: dict | None, data_manifest: dict | None,
               eval_report: dict | None, plots: list[str], fmt: str = "eagle", head_config: dict | None = None,
               sweep: dict | None = None) -> str:
    """README.md text. `cfg`: the recipe the head was TRAINED with; `plots`: repo-relative PNG paths to embed;
    `fmt`: the folder format uploaded (eagle | vllm | sglang), which the serving commands load; `head_config`: the
    exported config.json (decides the head kind: an EAGLE-3 card states its aux layers and draft vocabulary);
    `sweep`: serve-sweep's sweep.json (the draft length to serve per concurrency level)."""
    t = cfg.train
    eagle3 = (head_config or {}).get("draft_vocab_size") is not None
    target = (summary or {}).get("target") or cfg.target.path or "embedded quickstart default target"
    tags = ["eagle", "eagle-3" if eagle3 else "eagle-2", "speculative-decoding", "draft-model"]
    card_meta = {"base_model": target if "/" in target and not Path(target).exists() else None,
                 "library_name": "eagle2-train", "license": license,
                 "tags": tags, "pipeline_tag": "text-generation"}
    front = "---\n" + OmegaConf.to_yaml(OmegaConf.create({k: v for k, v in card_meta.items() if v})) + "---\n"
    if eagle3:
        intro = [f"# EAGLE-3 draft head for `{target}`", "", *eagle3_intro(head_config, cfg)]
        weights = OmegaConf.select(cfg, "head.ttt_step_weights", default=None)
        loss = (f"| loss | soft CE over the draft vocabulary at each of {OmegaConf.select(cfg, 'head.ttt_steps', default='k')} "
                f"unrolled steps, step weights {list(weights) if weights else '0.8^(j-1)'}; no feature loss |")
        cite = "EAGLE (ICML 2024), EAGLE-2 (EMNLP 2024) and EAGLE-3 (NeurIPS 2025), Li et al."
    else:
        intro = [
            f"# EAGLE-2 draft head for `{target}`",
            "",
            "A one-layer EAGLE-1/2 feature extrapolator (lossless speculative decoding; draft trees as in EAGLE-2). "
            "Official EAGLE checkpoint format: `config.json` + `model.safetensors`; token logits come from the base "
            "model's own frozen `lm_head`, the token embedding is the base model's (included, frozen).",
        ]
        loss = (f"| loss | {t.feature_weight} x SmoothL1(feature) + {t.token_weight} x soft CE(token); {t.noise} input "
                f"noise {t.noise_std} |")
        cite = "EAGLE (ICML 2024) and EAGLE-2 (EMNLP 2024), Li et al."
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
        "                                total_token=60, depth=5, top_k=10, torch_dtype=torch.float16)",
        "ids = model.eagenerate(input_ids, temperature=0.0, max_new_tokens=512)",
        "```",
        "",
        "The reference EAGLE code loads this folder too (`ea_model_path=...`)." if fmt == "eagle" else
        f"This folder is in the {fmt} engine format (`python -m train.export --format {fmt}`); the official EAGLE "
        "folder is what the code above loads.",
        "",
        *serving_section(cfg, target, repo_id, fmt, "eagle3" if eagle3 else "eagle2"),
        *sweep_section(sweep),
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


def serving_section(cfg, target: str, repo_id: str, fmt: str, kind: str = "eagle2") -> list[str]:
    """Markdown lines: copy-paste vLLM and SGLang commands for this head (train/engine_formats.serving_commands)."""
    from train.engine_formats import ENGINE_VERSIONS, serving_commands

    from eagle.decoding_config import DecodingConfig

    d = DecodingConfig()  # a recipe without a decoding section (e.g. an older recipe.yaml) gets the defaults
    get = lambda key: int(OmegaConf.select(cfg, f"decoding.{key}", default=getattr(d, key)))  # noqa: E731
    cmds = serving_commands(target, repo_id, fmt, kind, num_speculative_tokens=get("chain_length"),
                            total_token=get("total_token"), depth=get("depth"), top_k=get("top_k"))
    lines = ["## Serving", ""]
    for engine, label in (("vllm", "vLLM"), ("sglang", "SGLang")):
        lines += [f"{label} (format checked against {ENGINE_VERSIONS[engine]}):", "", "```bash", cmds[engine], "```", ""]
    lines += ["vLLM drafts a chain (`num_speculative_tokens`); SGLang a tree (`--speculative-num-steps` = depth, "
              "`--speculative-eagle-topk`, `--speculative-num-draft-tokens`). Check the head in the engine before "
              "deploying: `python evaluation/main.py serve-check --engine vllm --base BASE --head HEAD`.", ""]
    return lines


def sweep_section(sweep: dict | None) -> list[str]:
    """Markdown lines: serve-sweep's best num_speculative_tokens per concurrency level, with its plot."""
    if not sweep or not sweep.get("best"):
        return []
    lines = ["### Draft length by load", "",
             f"Measured with `python evaluation/main.py serve-sweep` (vLLM {sweep.get('engine_version')}, greedy, "
             f"{sweep.get('max_new_tokens')} new tokens per request, machine load {sweep.get('load_average')}; "
             f"[eval/{SWEEP_DIR}/sweep.md](eval/{SWEEP_DIR}/sweep.md)). Throughput-optimal `num_speculative_tokens` per "
             "number of requests in flight (0 = serve without speculation):", "",
             "| concurrency | num_speculative_tokens | output tokens/s | vs no speculation | next best |",
             "|---|---|---|---|---|"]
    for b in sweep["best"]:
        runner_k = b.get("runner_up_k")
        runner = ("–" if runner_k is None else
                  f"{'no speculation' if runner_k == 0 else f'k = {runner_k}'}, {b['runner_up_slower_by']:.0%} slower")
        speed = b.get("speedup_vs_no_speculation")
        lines.append(f"| {b['concurrency']} | {b['best_k']}{' (no speculation)' if b['best_k'] == 0 else ''} | "
                     f"{b['output_tokens_per_s']:.0f} | {f'{speed:.2f}x' if speed else '–'} | {runner} |")
    return lines + ["", f"![throughput vs concurrency](eval/{SWEEP_DIR}/throughput.png)", ""]


def read_json(path: Path) -> dict | None:
    """The JSON file at `path`, None when absent; a damaged file raises naming it."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: damaged JSON ({e}); rerun the stage that writes it") from None
