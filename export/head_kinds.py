"""The export stage's part of each head kind: how an exported folder of that kind becomes an engine's folder, what the
engines call it, and how its Hub card describes it. Keyed by the library's kind objects (eagle/head_kinds.py).

    write_engine_head(head_dir, out_dir, "vllm", target_config)   # any exported head, by its config's kind
    export_kind(kind).card_intro(target, head_config, cfg)        # export/model_card.py
"""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from eagle.head_config import HeadConfig
from eagle.head_checks import check_head_weights
from eagle.head_files import load_weights, resolve_head_files, read_head_config
from eagle.head_kinds import DFLASH, EAGLE2, EAGLE3, PEAGLE, HeadConfigError, HeadKind, kind_of_config
from export.dflash_format import write_vllm_dflash_folder
from export.engine_formats import (EAGLE3_SPECULATOR, EngineFormatError, Speculator, convert_eagle3_folder,
                                   read_eagle3_folder, write_eagle2_engine_head)
from recipes.head import dpace, head_options, step_weights
from recipes.loss import loss_section


class ExportKind:
    kind: HeadKind
    vllm_method: str  # vLLM's speculative-config "method"
    sglang_algorithm: str  # SGLang's --speculative-algorithm
    convert_flag: str  # `python -m train.export` flag that names a folder of this kind
    tag: str  # the Hub card's tag
    citation: str
    parallel_drafting = False  # vLLM's speculative-config "parallel_drafting" the kind is served with
    speculators_type = ""  # vLLM's speculators_model_type of the kind's vllm folder ("" = vllm_method)
    sglang_refusal = ""  # why SGLang cannot serve the kind ("" = it can, as sglang_algorithm)

    def vllm_spec(self, method: str | None = None, parallel_drafting: bool | None = None) -> dict:
        """The kind's vLLM speculative-config keys beyond model / num_speculative_tokens: {"method": vllm_method}, plus
        "parallel_drafting": true for a kind that drafts in parallel (P-EAGLE). The one place these keys are made:
        export/speculative_schedule.py `vllm_speculative_config` adds the draft folder and k, `speculative_config`
        a schedule. `method` / `parallel_drafting` (None: the kind's own) override them on purpose: serve-check's
        --engine-method / --parallel-drafting, serving a head the wrong way to show the trap."""
        method = self.vllm_method if method is None else method
        parallel = self.parallel_drafting if parallel_drafting is None else parallel_drafting
        return {"method": method, **({"parallel_drafting": True} if parallel else {})}

    def write_engine_folder(self, config: HeadConfig, weights_file: str, head_dir: Path, out_dir: Path, fmt: str,
                            target_config=None, dtype: str | None = None, verifier: str | None = None,
                            num_speculative_tokens: int = 3, overwrite: bool = False) -> Path:
        """The head folder written in `fmt` at `out_dir`, checked first and atomically (export/engine_formats.py
        `write_engine_folder`: overwrite = replace a different head already there)."""
        raise NotImplementedError

    def source_weights(self, config: HeadConfig, weights_file: str, head_dir: Path) -> tuple[dict, set[str]]:
        """The head folder's tensors under the kind's own names, and the ones an exported folder may omit beyond the
        kind's `optional_weights` (for `check_head_folder`)."""
        raise NotImplementedError

    def card_intro(self, target: str, head_config: dict, cfg) -> list[str]:
        """The card's title and description lines."""
        raise NotImplementedError

    def card_loss(self, cfg) -> str:
        """The card's `| loss | ... |` row."""
        raise NotImplementedError


class Eagle2Export(ExportKind):
    kind, vllm_method, sglang_algorithm, convert_flag, tag = EAGLE2, "eagle", "EAGLE", "--head", "eagle-2"
    citation = "EAGLE (ICML 2024) and EAGLE-2 (EMNLP 2024), Li et al."

    def write_engine_folder(self, config, weights_file, head_dir, out_dir, fmt, target_config=None, dtype=None,
                            verifier=None, num_speculative_tokens=3, overwrite=False) -> Path:
        return write_eagle2_engine_head(config, weights_file, head_dir, out_dir, fmt, target_config, dtype, overwrite)

    def source_weights(self, config, weights_file, head_dir):
        return load_weights(weights_file), {"embed_tokens.weight"}  # released EAGLE-1/2 heads may leave it out

    def card_intro(self, target: str, head_config: dict, cfg) -> list[str]:
        return [
            f"# EAGLE-2 draft head for `{target}`",
            "",
            "A one-layer EAGLE-1/2 feature extrapolator (lossless speculative decoding; draft trees as in EAGLE-2). "
            "Official EAGLE checkpoint format: `config.json` + `model.safetensors`; token logits come from the base "
            "model's own frozen `lm_head`, the token embedding is the base model's (included, frozen).",
        ]

    def card_loss(self, cfg) -> str:
        t = cfg.train
        steps = head_options(cfg.head).steps  # recipes older than the keys: 1
        align = ""
        if steps > 1:
            align = (f"; HASS-style multi-step alignment: {steps} unrolled steps on its own features, step weights "
                     + card_step_weights(cfg, "head.align_step_weights", ", ".join(f"{x:.2f}" for x in step_weights(cfg.head))))
        return (f"| loss | {t.feature_weight} x {loss_name(cfg, 'feature')}(feature) + {t.token_weight} x "
                f"{loss_name(cfg, 'token')}(token); {t.noise} input "
                f"noise {t.noise_std}{align} |")


def card_step_weights(cfg, key: str, default: str = "0.8^(j-1)") -> str:
    """The card's words for the unrolled steps' loss weights: D-PACE's per-chain weights (loss.position_weighting),
    the recipe's explicit list (`key`), or `default` (the decay)."""
    loss = loss_section(cfg)
    if dpace(loss):
        return f"D-PACE (per-chain, from the head's confidences; alpha {loss.dpace_alpha})"
    weights = OmegaConf.select(cfg, key, default=None)
    return ", ".join(f"{float(x):.2f}" for x in weights) if weights else default


def loss_name(cfg, part: str) -> str:
    """The model card's name of the recipe's token or feature loss (recipes older than the `loss` section: EAGLE's)."""
    name = getattr(loss_section(cfg), part)
    return LOSS_NAMES.get(name, name)


LOSS_NAMES = {"ce": "soft CE", "smooth_l1": "SmoothL1", "tv": "TV (1 - expected acceptance)",
              "nla": "-log expected acceptance", "lk": "LK (KL/TV hybrid)", "rkl": "reverse KL", "jsd": "JSD",
              "mse": "MSE", "l1": "L1"}


class Eagle3Export(ExportKind):
    kind, vllm_method, sglang_algorithm, convert_flag, tag = EAGLE3, "eagle3", "EAGLE3", "--eagle3", "eagle-3"
    citation = "EAGLE (ICML 2024), EAGLE-2 (EMNLP 2024) and EAGLE-3 (NeurIPS 2025), Li et al."
    speculator = EAGLE3_SPECULATOR  # the vllm folder's speculators algorithm (export/engine_formats.py)

    def write_engine_folder(self, config, weights_file, head_dir, out_dir, fmt, target_config=None, dtype=None,
                            verifier=None, num_speculative_tokens=3, overwrite=False) -> Path:
        """The released layout, converted (`verifier`: the target's path or hub id, named in vLLM's speculators
        config)."""
        archs = list(getattr(target_config, "architectures", None) or []) if target_config is not None else None
        if fmt == "sglang" and self.sglang_refusal:
            raise EngineFormatError(f"{head_dir}: {self.sglang_refusal}")
        return convert_eagle3_folder(head_dir, out_dir, fmt, verifier=verifier, verifier_architectures=archs,
                                     num_speculative_tokens=num_speculative_tokens, target_config=target_config,
                                     overwrite=overwrite, speculator=self.speculator)

    def source_weights(self, config, weights_file, head_dir):
        return read_eagle3_folder(head_dir)[1], set()  # `layers.0.` folders read as `midlayer.`

    def card_intro(self, target: str, head_config: dict, cfg) -> list[str]:
        """Aux layers with their convention, draft vocabulary, layout, engines."""
        eagle_config = head_config.get("eagle_config") or {}
        aux = eagle_config.get("eagle_aux_hidden_state_layer_ids") or head_config.get("eagle_aux_hidden_state_layer_ids")
        return [
            f"# EAGLE-3 draft head for `{target}`",
            "",
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

    def card_loss(self, cfg) -> str:
        return (f"| loss | {loss_name(cfg, 'token')} over the draft vocabulary at each of {OmegaConf.select(cfg, 'head.ttt_steps', default='k')} "
                f"unrolled steps, step weights {card_step_weights(cfg, 'head.ttt_step_weights')}; no feature loss |")


# vLLM's speculators `peagle` (transformers_utils/configs/speculators/algos.py `update_peagle`): mask_token_id (required,
# becomes pard_token) and the mask_hidden weight; of EAGLE-3.1's norms it keeps only norm_before_fc (fc_norm and
# norm_output are not copied into the model config, so their weights would not load / the function would differ)
PEAGLE_SPECULATOR = Speculator("peagle", "PeagleSpeculator", ("mask_token_id",), ("mask_hidden",), ("norm_before_fc",))


class PeagleExport(Eagle3Export):
    """P-EAGLE: the EAGLE-3 released layout (+ mask_hidden, mask_token_id); vLLM's speculators `peagle` folder, served
    as method eagle3 with parallel_drafting; SGLang refused."""

    kind, sglang_algorithm, convert_flag, tag = PEAGLE, "", "--eagle3", "p-eagle"
    citation = ("EAGLE (ICML 2024), EAGLE-2 (EMNLP 2024) and EAGLE-3 (NeurIPS 2025), Li et al.; parallel drafting: "
                "PARD (Chen et al. 2025) and P-EAGLE as served by vLLM (speculators `peagle`)")
    speculator, speculators_type, parallel_drafting = PEAGLE_SPECULATOR, PEAGLE_SPECULATOR.algorithm, True
    sglang_refusal = ("SGLang has no P-EAGLE (parallel drafting) loader: sgl-project/sglang's speculative algorithms "
                      "are EAGLE / EAGLE3 only and its EAGLE-3 model reads no mask_hidden; serve it in vLLM "
                      "(--format vllm)")

    def card_intro(self, target: str, head_config: dict, cfg) -> list[str]:
        lines = super().card_intro(target, head_config, cfg)
        k = OmegaConf.select(cfg, "head.ttt_steps", default="k")
        lines[0] = f"# P-EAGLE (parallel drafting) draft head for `{target}`"
        lines[2] = (f"A one-layer EAGLE-3 head that drafts {k} tokens in ONE forward (P-EAGLE): draft positions 2..{k} "
                    f"read the mask token `{head_config.get('mask_token_id')}` (`mask_token_id`) with the learned "
                    "`mask_hidden` [1, 3H] (fused by `fc` like the aux states). vLLM: `\"method\": \"eagle3\", "
                    "\"parallel_drafting\": true` (the `vllm` format is its speculators `peagle` config).")
        lines[-1] = ("Layout: the released EAGLE-3 one (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`, no "
                     "`embed_tokens`) plus `mask_hidden`; config.json `PeagleLlamaForCausalLM` with `mask_token_id`, "
                     "`draft_vocab_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`.")
        return lines

    def card_loss(self, cfg) -> str:
        return (f"| loss | {loss_name(cfg, 'token')} over the draft vocabulary at each of the {OmegaConf.select(cfg, 'head.ttt_steps', default='k')} "
                f"parallel draft positions of one forward, position weights {card_step_weights(cfg, 'head.ttt_step_weights')} |")


class DFlashExport(ExportKind):
    """DFlash (block drafting): vLLM's `DFlashDraftModel` folder (export/dflash_format.py; method "dflash",
    num_speculative_tokens <= block_size - 1); SGLang refused."""

    kind, vllm_method, sglang_algorithm, convert_flag, tag = DFLASH, "dflash", "", "--head", "dflash"
    citation = "DFlash: block diffusion drafting for speculative decoding (arXiv 2602.06036)"
    sglang_refusal = ("SGLang 0.5.23 has no DFlash loader (its speculative algorithms are EAGLE / EAGLE3 / "
                      "STANDALONE / NGRAM, no DFlashDraftModel): serve it in vLLM (--format vllm)")

    def write_engine_folder(self, config, weights_file, head_dir, out_dir, fmt, target_config=None, dtype=None,
                            verifier=None, num_speculative_tokens=None, overwrite=False) -> Path:
        if fmt == "sglang":
            raise EngineFormatError(f"{head_dir}: {self.sglang_refusal}")
        if fmt != "vllm":
            raise EngineFormatError(f"{head_dir}: a DFlash head has no {fmt!r} engine format (this project's folder "
                                    "is the head folder itself; engines: --format vllm)")
        return write_vllm_dflash_folder(config, weights_file, head_dir, out_dir, target_config, dtype,
                                        num_speculative_tokens, overwrite)

    def source_weights(self, config, weights_file, head_dir):
        return load_weights(weights_file), set()

    def card_intro(self, target: str, head_config: dict, cfg) -> list[str]:
        o = head_config.get("dflash") or {}
        B = o.get("block_size", "B")
        return [
            f"# DFlash (block drafting) draft for `{target}`",
            "",
            f"{o.get('draft_layers', 'N')} decoder layers of the base model's width reading the base model's hidden "
            f"states at HF `hidden_states` ids `{o.get('target_layers')}` (fused by `fc` + `hidden_norm`, injected as "
            f"keys / values into every layer); one forward over the last verified token and {B} - 1 mask tokens "
            f"(`mask_token_id` {o.get('mask_token_id')}) drafts a block of {B} - 1 tokens. No embedding or LM head "
            "of its own (the base model's). vLLM: `\"method\": \"dflash\"` with `num_speculative_tokens` <= "
            f"{B} - 1 (the `vllm` format: `DFlashDraftModel`, `dflash_config.target_layer_ids` = our ids - 1).",
        ]

    def card_loss(self, cfg) -> str:
        return (f"| loss | {loss_name(cfg, 'token')} at each drafted block position against the base model's "
                f"distribution, {OmegaConf.select(cfg, 'head.anchors', default='A')} anchors per record, position "
                f"weights {card_step_weights(cfg, 'head.block_weights', '0.8^(i-1)')} |")


EXPORT: dict[HeadKind, ExportKind] = {EAGLE2: Eagle2Export(), EAGLE3: Eagle3Export(), PEAGLE: PeagleExport(),
                                      DFLASH: DFlashExport()}


def export_kind(kind: HeadKind) -> ExportKind:
    return EXPORT[kind]


def served_kind(config: dict) -> HeadKind:
    """The kind of a draft folder an engine is given, from its config.json: the released / official layouts
    (`kind_of_config`), or vLLM's speculators config (`speculators_model_type`, written by the vllm format)."""
    config = dict(config)
    speculators = config.get("speculators_model_type")
    if speculators:
        return next((e.kind for e in EXPORT.values() if (e.speculators_type or e.vllm_method) == speculators),
                    kind_of_config(config))
    return kind_of_config(config)


def check_vllm_method(method: str, config: dict, folder: str, parallel_drafting: bool = False) -> None:
    """Refuse a vLLM `method` / `parallel_drafting` that does not match the draft folder's head kind (the classic
    traps: an EAGLE-3 folder served with "eagle", an EAGLE-1/2 folder with "eagle3", a P-EAGLE folder without
    parallel_drafting (vLLM then drafts it sequentially, feeding its own hiddens where it was trained on mask
    inputs), a sequential head with it); the message names both and the right setting. Methods this project does
    not export (mtp, ngram, ...) are the user's own choice and pass."""
    right = export_kind(served_kind(config))
    served = next((e for e in EXPORT.values() if (e.vllm_method, e.parallel_drafting) == (method, parallel_drafting)),
                  None)
    known = any(e.vllm_method == method for e in EXPORT.values())
    if known and served is not right:
        layout = f"config architectures {config.get('architectures')}" + (
            f", speculators_model_type {config['speculators_model_type']}" if "speculators_model_type" in config else "")
        what = (f"vLLM method {method!r}" + (" with parallel_drafting" if parallel_drafting else "")
                + (f", which is for {served.kind.title} heads" if served is not None else
                   ", which no head kind is served with"))
        article = "an" if right.kind.title[0] in "AEIOU" else "a"
        raise EngineFormatError(f"the draft folder {folder} holds {article} {right.kind.title} head ({layout}) but is served "
                                f"with {what}: use {json.dumps(right.vllm_spec())[1:-1]}")


def check_head_folder(head_dir: str | Path, target_config=None) -> HeadConfig:
    """The checks every export applies (eagle/head_checks.py), on a head folder shipped as it is (Hub staging of the
    official format); HeadConfigError naming the folder."""
    config_file, weights_file = resolve_head_files(str(head_dir), None)
    config = read_head_config(config_file)
    sd, optional = export_kind(config.head_kind).source_weights(config, weights_file, Path(config_file).parent)
    check_head_weights(config, sd, f"not exporting head {head_dir}", target_config, optional=optional)
    return config


def check_convert_flag(head_dir: str | Path, flag: str) -> None:
    """`python -m train.export FLAG DIR` with a kind's own flag (`--eagle3`): the folder must hold a head of that kind
    (`--head` takes every kind); a HeadConfigError naming the folder's kind and its flag otherwise."""
    config_file, _ = resolve_head_files(str(head_dir), None)
    found = export_kind(read_head_config(config_file).head_kind)
    if flag != "--head" and found.convert_flag != flag:
        raise HeadConfigError(f"{flag} {head_dir}: the folder holds an {found.kind.title} head; pass it with "
                              f"{found.convert_flag}")


def write_engine_head(head_dir: str | Path, out_dir: str | Path, fmt: str, target_config=None,
                      dtype: str | None = None, verifier: str | None = None, num_speculative_tokens: int = 3,
                      overwrite: bool = False) -> Path:
    """Read an exported head folder (a local folder or Hub id) and write it in `fmt`, as its kind does: EAGLE-1/2
    drift-checked against the target and converted (dtype: of the output, default the head's), EAGLE-3 (the released
    layout) converted with `verifier` (the target's path or hub id, named in vLLM's speculators config). Every kind and
    format gets the same checks before anything is written (eagle/head_checks.py) and the same atomic writer
    (overwrite: replace a different head at `out_dir`). Raises DriftError / HeadConfigError on an inconsistent head."""
    config_file, weights_file = resolve_head_files(str(head_dir), None)
    config = read_head_config(config_file)
    return export_kind(config.head_kind).write_engine_folder(
        config, weights_file, Path(config_file).parent, Path(out_dir), fmt, target_config, dtype=dtype,
        verifier=verifier, num_speculative_tokens=num_speculative_tokens, overwrite=overwrite)
