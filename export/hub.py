"""Push an exported head to the Hugging Face Hub with a generated model card.

    python -m train.hub --recipe llama3-8b export.repo_id=me/EAGLE2-llama3-8b [--dry-run] [--head DIR]
    python -m train.hub --recipe llama3-8b export.repo_id=me/EAGLE2-llama3-8b-vllm --format vllm   # engine format

Everything to upload is first staged in {output_dir}/hub_upload/ (--format vllm|sglang: hub_upload-FORMAT/) (head
files, recipe, training summary, README.md model card, evaluation report + plots and serve-sweep's draft length per
concurrency level when {output_dir}/eval has them), in every format; `--dry-run` stops there and lists it. The token
comes from the environment variable named by export.token_env (HF_TOKEN).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from huggingface_hub import HfApi
from omegaconf import OmegaConf

from data_prep.feature_cache import CACHE_MANIFEST
from data_prep.target import load_target_config
from eagle.atomic_folder import write_folder
from eagle.cli_errors import ArgumentParser, UserError, one_line_errors
from eagle.head_config import read_head_json
from eagle.head_files import RECIPE_FILE, STORED_RECIPE, SUMMARY_FILE, TRAIN_SUMMARY
from eagle.head_kinds import DEFAULT_KIND, kind_of_config
from eagle.state_files import read_json_state, read_yaml_state, write_yaml_state
from export.head_kinds import check_head_folder, export_kind, served_kind, write_engine_head
from export.eval_outputs import EVAL_REPORT, SWEEP
from export.model_card import card_speculative_config, model_card, vllm_folder
from export.speculative_schedule import SPEC_CONFIG_FILE, write_speculative_config
from recipes import add_print_config, command_config, layout

HEAD_FILES = ("config.json", "model.safetensors", "pytorch_model.bin", RECIPE_FILE, SUMMARY_FILE, "tree_config.json")
STAGING_DIR = "hub_upload"  # in output_dir; engine formats: hub_upload-{fmt} (`staging_dir`)
EVAL_FILES = ("report.md", "report.json")


class HubPushError(UserError, RuntimeError):
    """The upload could not happen (no token, no network, no permission); the message says what to do."""


def staging_dir(cfg, fmt: str = "eagle") -> Path:
    """Where the upload of format `fmt` is staged: {output_dir}/hub_upload (official) or hub_upload-{fmt}: one folder
    per format, so staging one never mixes with or replaces another's."""
    return Path(cfg.output_dir) / (STAGING_DIR if fmt == "eagle" else f"{STAGING_DIR}-{fmt}")


def trained_recipe(cfg, head_dir: Path, head_config: dict):
    """The recipe the card describes and the upload ships: the one stored with the head at export (recipe.yaml),
    else this command's; either way it must train the head's own kind (from its config.json)."""
    kind = kind_of_config(dict(head_config))
    stored = head_dir / RECIPE_FILE
    saved = read_yaml_state(stored, STORED_RECIPE)
    recipe = cfg if saved is None else OmegaConf.create(saved)
    recipe_kind = OmegaConf.select(recipe, "head.kind", default=DEFAULT_KIND.name)
    if recipe_kind != kind.name:
        where = f"its {stored}" if stored.exists() else f"the recipe {cfg.name!r} (the head folder has no {RECIPE_FILE})"
        raise HubPushError(f"{head_dir} holds an {kind.title} head (kind {kind.name}) but {where} trains "
                           f"head.kind={recipe_kind}: the card would describe another head; pass the recipe the head "
                           "was trained with (--recipe)")
    return recipe


def stage_upload(cfg, head_dir: Path, staging: Path, repo_id: str, fmt: str = "eagle") -> list[Path]:
    """Fill `staging` with exactly what will be uploaded, in every format: the head files (fmt eagle: the official
    folder; vllm | sglang: export/engine_formats.py, checked and drift-checked against the target), `recipe.yaml` and
    `train_summary.json` (what the card cites), the card, the evaluation report + plots. The card's recipe and kind
    come from the head itself (`trained_recipe`). Written atomically (eagle/atomic_folder.py). Returns the files
    (relative paths)."""
    head_dir = Path(head_dir)
    if not (head_dir / "config.json").exists() or not any((head_dir / f).exists() for f in HEAD_FILES[1:3]):
        raise HubPushError(f"{head_dir} is not an exported head (config.json + model.safetensors); train or export first")
    head_config = read_head_json(head_dir)
    trained = trained_recipe(cfg, head_dir, head_config)
    local = bool(cfg.target.path) and Path(cfg.target.path).exists()  # the official folder needs no Hub download
    target_config = load_target_config(cfg.target.path) if cfg.target.path and (fmt != "eagle" or local) else None
    if fmt == "eagle":  # shipped as it is: the checks every export applies (engine formats run them when converting)
        check_head_folder(head_dir, target_config)
    summary = read_json_state(head_dir / SUMMARY_FILE, TRAIN_SUMMARY)
    edir = layout.eval_dir(cfg)
    report = read_json_state(edir / EVAL_REPORT.name, EVAL_REPORT)
    sweep_dir = layout.serve_sweep_dir(cfg)
    sweep = read_json_state(sweep_dir / SWEEP.name, SWEEP)  # serve-sweep's draft length per concurrency level
    manifest = read_json_state(layout.cache_dir(cfg) / CACHE_MANIFEST.name, CACHE_MANIFEST)
    if manifest:
        manifest = {k: manifest.get(k) for k in ("num_records", "num_tokens", "num_loss_tokens", "source")}

    def fill(tmp: Path) -> None:
        if fmt != "eagle":  # the engine folder (carries the head's recipe, summary and tree) written into tmp
            write_engine_head(head_dir, tmp, fmt, target_config, verifier=str(cfg.target.path) or None, overwrite=True)
        else:
            for name in HEAD_FILES:
                if (head_dir / name).exists():
                    shutil.copy2(head_dir / name, tmp / name)
        if not (tmp / RECIPE_FILE).exists():  # the card cites recipe.yaml: ship the one it describes
            write_yaml_state(tmp / RECIPE_FILE, OmegaConf.to_container(trained, resolve=True), STORED_RECIPE,
                             text=OmegaConf.to_yaml(trained, resolve=True))
        plots: list[str] = []
        if edir.is_dir():
            (tmp / "eval").mkdir()
            for name in EVAL_FILES:
                if (edir / name).exists():
                    shutil.copy2(edir / name, tmp / "eval" / name)
            for png in sorted(edir.glob("*.png")):
                shutil.copy2(png, tmp / "eval" / png.name)
                plots.append(f"eval/{png.name}")
        if sweep:
            (tmp / "eval" / layout.SERVE_SWEEP_DIR).mkdir(parents=True)
            for name in layout.SERVE_SWEEP_FILES:
                if (sweep_dir / name).exists():
                    shutil.copy2(sweep_dir / name, tmp / "eval" / layout.SERVE_SWEEP_DIR / name)
        spec = card_speculative_config(sweep, vllm_folder(repo_id, fmt), export_kind(served_kind(head_config)))
        if spec:  # serve-sweep's k per batch size, naming this upload's vLLM folder: `--speculative-config "$(cat ...)"`
            write_speculative_config(tmp / SPEC_CONFIG_FILE, spec)
        card = model_card(trained, repo_id, cfg.export.license, summary, manifest, report, plots, fmt=fmt,
                          head_config=head_config, sweep=sweep)
        (tmp / "README.md").write_text(card)

    write_folder(staging, fill, sources=[head_dir], overwrite=True, what=f"Hub upload ({fmt})")  # ours to replace
    return sorted(p.relative_to(staging) for p in staging.rglob("*") if p.is_file())


def push_to_hub(cfg, head_dir: str | Path | None = None, dry_run: bool = False, fmt: str = "eagle") -> dict:
    """Stage and (unless dry_run) upload the head (in format `fmt`) to export.repo_id.
    Returns {repo_id, staging, files, url}."""
    repo_id = cfg.export.repo_id
    if not repo_id:
        raise HubPushError("export.repo_id is empty: set export.repo_id=USER/NAME")
    head_dir = Path(head_dir) if head_dir else layout.head_dir(cfg)
    staging = staging_dir(cfg, fmt)
    files = stage_upload(cfg, head_dir, staging, repo_id, fmt)
    result = {"repo_id": repo_id, "private": bool(cfg.export.private), "staging": str(staging),
              "files": [str(f) for f in files], "url": None}
    if dry_run:
        return result
    token = os.environ.get(cfg.export.token_env)
    if not token:
        raise HubPushError(f"no Hub token: set the environment variable {cfg.export.token_env} (export.token_env) "
                           f"to a write token; the upload is staged in {staging}")
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=bool(cfg.export.private), exist_ok=True, repo_type="model")
        commit = api.upload_folder(folder_path=str(staging), repo_id=repo_id, repo_type="model",
                                   commit_message=cfg.export.commit_message)
    except Exception as e:  # network (httpx), HTTP (HfHubHTTPError: auth, permissions), offline mode
        raise HubPushError(
            f"could not push to the Hub repo {repo_id!r}: {type(e).__name__}: {e}\n"
            f"The upload is staged in {staging}; from a machine with network access run "
            f"`hf upload {repo_id} {staging} .` (or rerun this command)."
        ) from e
    result["url"] = getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo_id}"
    return result


def print_push(result: dict, dry_run: bool) -> None:
    """What `push_to_hub` uploaded (or would): the repo, every file with its size, the commit's URL."""
    staging = Path(result["staging"])
    verb = "would upload" if dry_run else "uploaded"
    print(f"{verb} to {result['repo_id']} ({'private' if result['private'] else 'public'}) from {staging}:")
    for f in result["files"]:
        print(f"  {f}  ({(staging / f).stat().st_size:,} bytes)")
    if result["url"]:
        print(result["url"])


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m train.hub", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, help="recipe name or YAML path (the run whose head is pushed)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--head", default=None, help="head folder to push (default: export.dir or {output_dir}/head)")
    p.add_argument("--dry-run", action="store_true", help="stage the upload and list it; do not contact the Hub")
    p.add_argument("--format", default="eagle", choices=("eagle", "vllm", "sglang"),
                   help="folder format to upload: eagle (official) or an engine's (python -m train.export --help)")
    add_print_config(p)
    args = p.parse_args(argv)
    cfg = command_config(args)
    print_push(push_to_hub(cfg, args.head, dry_run=args.dry_run, fmt=args.format), args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
