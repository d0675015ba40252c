"""Held-out metrics of any head on a recipe's feature cache: the trainer's eval split and eval metrics.

    python -m train.eval_head --recipe stories260k --head runs/stories260k/head [key=value ...]

Same split (train.eval_fraction, seed, by record id), same metrics as the trainer's evaluation: loss parts,
top-1/2/3 agreement with the target's argmax, self-fed step accuracies and the simulated acceptance length.
Use it to compare heads trained on different data (or by other code) on ONE eval set. Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from data_prep.target import load_target_config, resolve_target_path
from eagle.device import pick_device
from eagle.cli_errors import ArgumentParser, one_line_errors
from eagle.head_files import check_head_files, load_head
from recipes import add_print_config, command_config, layout
from train.data import Subset, open_feature_cache, split_train_eval
from train.ds_config import COMPUTE_DTYPES
from train.frozen_target import check_cache_matches_target, load_frozen_target
from train.head_kinds import training_kind
from train.held_out import evaluate


def evaluate_head(cfg, head_path: str) -> dict:
    """Eval metrics of the head at `head_path` on the eval split of `cfg`'s feature cache (offline)."""
    t = cfg.train
    check_head_files(head_path)  # a missing, broken or engine-format head fails before anything loads
    source = open_feature_cache(cfg, t.verify_cache)
    cdir = layout.cache_dir(cfg)
    target_path = resolve_target_path(cfg.target)
    target_config = load_target_config(target_path)
    part = training_kind(cfg, target_config)  # the recipe's head.kind decides the cache layout and the metrics
    check_cache_matches_target(source.manifest, cdir, target_path, target_config, part.layers, cfg.target.quantization)
    _, eval_idx = split_train_eval(source.ids, t.eval_fraction, cfg.seed)
    if not eval_idx:
        raise ValueError(f"the eval split of {cdir} is empty (train.eval_fraction={t.eval_fraction})")
    device = pick_device(t.device)
    dtype = COMPUTE_DTYPES[t.precision]
    frozen, embedding = load_frozen_target("offline", cfg.target, target_path, device, dtype)
    head = load_head(head_path, dtype=dtype, device=device)
    if head.kind is not part.kind:
        raise ValueError(f"head {head_path} is an {head.config.kind} head; the recipe's head.kind is {part.kind.name}")
    if not head.kind.saves_embedding:  # its embedding is the target's (not saved with the head)
        with torch.no_grad():
            head.embed_tokens.weight.copy_(embedding.to(head.embed_tokens.weight))
    if head.config.vocab_size != frozen.lm_head.shape[0] or head.config.hidden_size != frozen.lm_head.shape[1]:
        raise ValueError(f"head {head_path} (hidden {head.config.hidden_size}, vocab {head.config.vocab_size}) does not "
                         f"fit the target's lm_head {tuple(frozen.lm_head.shape)}")
    with torch.no_grad():
        metrics = evaluate(head, Subset(source, eval_idx, cfg.data.max_length), frozen, part, device, dtype, cfg.seed)
    return {"head": str(head_path), "cache": str(cdir), "eval_records": len(eval_idx), **metrics}


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m train.eval_head", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True)
    p.add_argument("--head", required=True, help="head folder (config.json + model.safetensors) or hub id")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    add_print_config(p)
    args = p.parse_args(argv)
    print(json.dumps(evaluate_head(command_config(args), args.head), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
