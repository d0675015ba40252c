"""A head folder on disk or on the Hub: config.json + model.safetensors (or a legacy pytorch_model.bin), found,
checked before a target loads, read without running code, and loaded as the module of its kind."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from eagle.cli_errors import FileFormatError, UserError, file_error
from eagle.head_checks import expected_shapes
from eagle.head_config import HeadConfig, read_head_config
from eagle.head_kinds import DEFAULT_KIND, HeadConfigError, kind_of_config
from eagle.hub_ids import check_local_exists
from eagle.state_files import StateFile, register

CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
LEGACY_WEIGHTS_NAME = "pytorch_model.bin"
# The trainer's export (train/export.py) also writes these two into the head folder; the Hub push and the model card
# (export/, a layer above train/) read them, so they are declared here with the folder's other files.
RECIPE_FILE = "recipe.yaml"  # the recipe that trained the head
STORED_RECIPE = register(StateFile(
    RECIPE_FILE, "HEAD_DIR", writer="train/export.py", format="yaml",
    schema={"name": str, "target": dict, "data": dict, "head": {"kind": str, "*": object}, "train": dict, "*": object},
    rebuild="export the head again (rerun `python train/main.py --recipe RECIPE`: a finished run only exports), or "
            "delete it and pass the recipe the head was trained with (--recipe)",
    when_missing="a head exported by another tool: the command's --recipe describes it",
    example={"name": "tiny", "target": {"path": "models/t"}, "data": {"source": ""}, "head": {"kind": DEFAULT_KIND.name},
             "train": {"max_steps": 4}}))
SUMMARY_FILE = "train_summary.json"  # the training run's summary
TRAIN_SUMMARY = register(StateFile(
    SUMMARY_FILE, "HEAD_DIR", writer="train/export.py (from train/main.py)",
    schema={"steps?": int, "total_steps?": int, "epochs?": float, "train_records?": int, "eval_records?": int,
            "train_tokens_per_s?": float, "eval?": (dict, type(None)), "*": object},
    rebuild="delete it (the model card then has no training section) or export the head again by rerunning "
            "`python train/main.py --recipe RECIPE` (a finished run only exports)",
    when_missing="a head exported by another tool: the model card has no training section",
    example={"steps": 10, "total_steps": 10, "epochs": 1.0, "train_records": 8, "eval_records": 2,
             "train_tokens_per_s": 100.0}))


def head_class(config: HeadConfig) -> type:
    """The module class of a head config: its kind's module (`EagleHead` for eagle2, `Eagle3Head` for eagle3)."""
    return config.head_kind.module


def load_head(path_or_hub_id: str | Path, dtype: torch.dtype | None = None, revision: str | None = None,
              device: str | torch.device | None = None):
    """Load any head folder as the module of its config's kind: EAGLE-1/2 -> `EagleHead`, EAGLE-3 -> `Eagle3Head`
    (call `bind_target` before use: an EAGLE-3 head's embedding is the target's)."""
    cls = head_class(head_config_of(path_or_hub_id, revision))
    return cls.from_pretrained(path_or_hub_id, dtype=dtype, revision=revision, device=device)


def head_config_of(path_or_hub_id: str | Path, revision: str | None = None) -> HeadConfig:
    """The HeadConfig of a head folder or hub id (its config.json only; one-line errors naming the file)."""
    config_file, weights_file = resolve_head_files(str(path_or_hub_id), revision)
    refuse_engine_export(config_file, weights_file)
    return read_head_config(config_file)


# config.json `architectures` only engine exports carry (export/engine_formats.py: SGLang's EAGLE-1/2 classes)
ENGINE_ARCHITECTURES = {"LlamaForCausalLMEagle": "SGLang", "Qwen2ForCausalLMEagle": "SGLang"}


def engine_export(config_file: str, weights_file: str) -> str | None:
    """The engine ("vLLM", "SGLang") whose format a head folder is in (export/engine_formats.py), None for an official
    head: vLLM's EAGLE-3 speculators config; SGLang's EAGLE-1/2 architectures; an EAGLE-1/2 layer without the
    embedding (both engines take the target's; an official EAGLE-1/2 checkpoint always has embed_tokens)."""
    try:
        cfg = json.loads(Path(config_file).read_text())
        shapes = {}
        if weights_file.endswith(".safetensors"):
            with safe_open(weights_file, "pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (OSError, ValueError, SafetensorError):
        return None  # unreadable: the loader's own check names the file
    if not isinstance(cfg, dict):
        return None
    if "speculators_model_type" in cfg:
        return "vLLM"
    engine = next((ENGINE_ARCHITECTURES[a] for a in cfg.get("architectures") or [] if a in ENGINE_ARCHITECTURES), None)
    fc = shapes.get("fc.weight", ())
    try:
        saves_embedding = kind_of_config(cfg).saves_embedding  # a kind that does not (EAGLE-3) may leave it out
    except HeadConfigError:
        return engine  # an unknown kind: the loader's own check names it
    if engine is None and saves_embedding and len(fc) == 2 and fc[1] == 2 * fc[0] and "embed_tokens.weight" not in shapes:
        engine = "vLLM"  # an EAGLE-1/2 fc [H, 2H] without the embedding it reads
    return engine


def refuse_engine_export(config_file: str, weights_file: str) -> None:
    """A UserError saying what to pass instead when a head folder is a vLLM / SGLang engine export."""
    engine = engine_export(config_file, weights_file)
    if engine is not None:
        folder = Path(config_file).parent
        raise UserError(f"head {folder} is a {engine} engine export, not an official EAGLE head (engines take the "
                        f"target's embedding; the project's loaders need the official layout): pass the head it was made "
                        f"from ({{output_dir}}/head of the training run), and give {folder} to {engine} itself")


def resolve_head_files(path_or_hub_id: str, revision: str | None) -> tuple[str, str]:
    p = Path(path_or_hub_id)
    if p.is_dir():
        cfg = p / CONFIG_NAME
        if not cfg.exists():
            raise FileNotFoundError(f"head folder {p} has no {CONFIG_NAME}")
        for name in (SAFE_WEIGHTS_NAME, LEGACY_WEIGHTS_NAME):
            if (p / name).exists():
                return str(cfg), str(p / name)
        raise FileNotFoundError(f"head folder {p} has neither {SAFE_WEIGHTS_NAME} nor {LEGACY_WEIGHTS_NAME}")
    if p.exists():
        raise ValueError(f"{p} is a file; pass the head folder (config.json + weights)")
    check_local_exists(path_or_hub_id, "head", "a head folder (config.json + model.safetensors)")
    try:
        cfg = hf_hub_download(path_or_hub_id, CONFIG_NAME, revision=revision)
        try:
            weights = hf_hub_download(path_or_hub_id, SAFE_WEIGHTS_NAME, revision=revision)
        except EntryNotFoundError:
            weights = hf_hub_download(path_or_hub_id, LEGACY_WEIGHTS_NAME, revision=revision)
    except Exception as e:  # network / auth / missing repo: say what we tried
        raise OSError(f"could not load head {path_or_hub_id!r}: not a local folder, and the Hub download failed: {e}") from e
    return cfg, weights


def check_head_files(path_or_hub_id: str | Path, revision: str | None = None) -> HeadConfig:
    """Cheap pre-flight check of a head folder before a target is loaded: config.json parses, the weights file
    opens (safetensors header / weights-only unpickling) and holds the tensors its config implies (EAGLE-1/2 or
    EAGLE-3 layout, by the config's kind)."""
    config_file, weights_file = resolve_head_files(str(path_or_hub_id), revision)
    refuse_engine_export(config_file, weights_file)
    config = read_head_config(config_file)
    if weights_file.endswith(".safetensors"):
        try:
            with safe_open(weights_file, "pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except SafetensorError as e:
            raise file_error(weights_file, e, "head weights") from None
    else:
        shapes = {k: tuple(v.shape) for k, v in load_weights(weights_file).items()}
    expect = expected_shapes(config, set(shapes))  # eagle/head_checks.py: the kind's module on the meta device
    if shapes != expect:
        missing, unexpected = sorted(set(expect) - set(shapes)), sorted(set(shapes) - set(expect))
        differ = sorted(k for k in set(shapes) & set(expect) if shapes[k] != expect[k])
        parts = ([f"missing keys {missing[:4]}"] if missing else []) + \
                ([f"unexpected keys {unexpected[:4]}"] if unexpected else []) + \
                ([f"shapes of {differ[:4]} (file {[shapes[k] for k in differ[:4]]}, config "
                  f"{[expect[k] for k in differ[:4]]})"] if differ else [])
        raise FileFormatError(f"head weights {weights_file} do not match {config_file}: {', '.join(parts)}")
    return config


def load_weights(weights_file: str) -> dict[str, torch.Tensor]:
    """The head's tensors: safetensors, or a legacy .bin through the weights-only unpickler (never runs code)."""
    if weights_file.endswith(".safetensors"):
        try:
            return load_file(weights_file)
        except SafetensorError as e:
            raise file_error(weights_file, e, "head weights") from None
    try:
        sd = torch.load(weights_file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise file_error(weights_file, e, "head weights") from None
    except (RuntimeError, EOFError) as e:  # not a torch file / truncated zip
        raise file_error(weights_file, e, "head weights") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise FileFormatError(f"head weights {weights_file}: expected a mapping of tensor names to tensors")
    return sd
