"""Train an EAGLE-2 or EAGLE-3 draft head (recipe `head.kind`) on a frozen target with DeepSpeed. One explicit script: setup -> loop -> save -> cleanup.

    python train/main.py --recipe tiny [key=value ...]                    # one CPU process
    torchrun --nproc_per_node 2 train/main.py --recipe tiny               # several processes (gloo on CPU)
    deepspeed --num_gpus 8 train/main.py --recipe llama3-8b               # GPUs (add --hostfile for multi-node)

Outputs under {output_dir}/train/: checkpoints/ (resumable), metrics.jsonl, tensorboard/, summary.json,
deepspeed_config.json (generated from the recipe, for reference only); the head goes to {output_dir}/head/.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # `python train/main.py`: import the train package, not sibling files as top-level modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from eagle.cli_errors import ArgumentParser, UserError, one_line_errors  # noqa: E402
from recipes import layout, list_recipes, load_config  # noqa: E402
from recipes.schema import describe_recipe_keys  # noqa: E402

class NonFiniteLossError(UserError, RuntimeError):
    """Too many non-finite losses in a row: the run diverged or the data holds NaN/inf features."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def all_ranks_finite(loss: torch.Tensor, world_size: int) -> bool:
    """True when the loss is finite on every rank (ranks must skip a micro-batch together)."""
    from train.distributed import all_reduce_sum

    bad = 0.0 if bool(torch.isfinite(loss.detach())) else 1.0
    return all_reduce_sum([bad])[0] == 0 if world_size > 1 else bad == 0


def set_scheduled_lr(engine, say) -> None:
    """After a resume, put the LR the schedule gives for this step into the optimizer (the checkpoint holds the
    LR of the run that saved it; identical unless train.lr or the schedule changed)."""
    scheduler = engine.lr_scheduler
    if scheduler is None or not hasattr(scheduler, "get_lr") or getattr(scheduler, "last_batch_iteration", -1) < 0:
        return
    groups = engine.optimizer.param_groups
    new = scheduler.get_lr()
    if len(new) == len(groups) and any(g["lr"] != lr for g, lr in zip(groups, new)):
        say(f"learning rate {groups[0]['lr']:.3g} in the checkpoint -> {new[0]:.3g} from this run's schedule")
        for g, lr in zip(groups, new):
            g["lr"] = lr


def train(cfg, ctx=None) -> dict:
    """Train a head from a loaded recipe. Returns the run summary (also {output_dir}/train/summary.json).
    One writer per run: each rank holds `{output_dir}/train/.rank{r}.lock`; a second launch on the same folder
    (or orphaned ranks of a killed launcher still running) makes it stop with RunDirBusyError."""
    from eagle.run_lock import run_lock
    from train.distributed import init_distributed

    ctx = ctx or init_distributed(cfg.train.device)
    with run_lock(layout.train_dir(cfg), f"rank{ctx.rank}", "training"):
        return _train_locked(cfg, ctx)


def _train_locked(cfg, ctx) -> dict:
    import deepspeed
    from tqdm.auto import tqdm

    from data_prep.target import load_target_config, resolve_target_path
    from train.batching import MicroBatchPlan
    from train.checkpoint import (CheckpointError, commit_checkpoint, discard_uncommitted, latest_tag, load_checkpoint,
                                  save_checkpoint)
    from train.data import Subset, TokenizedRecords, apply_long_records, head_positions, micro_batch_loader, split_train_eval
    from train.distributed import all_reduce_sum
    from train.divergence import DivergenceError, describe, exploded, non_finite_weights, remember
    from train.ds_config import COMPUTE_DTYPES, deepspeed_config
    from train.export import export_head, full_state_dict, standalone_head
    from train.frozen_target import check_cache_matches_target, load_frozen_target
    from train.head_kinds import training_kind
    from train.metrics import evaluate
    from train.plan import print_run_plan
    from train.tracking import Tracker

    # ================================================================== setup
    t = cfg.train
    say = (lambda msg: print(f"[train] {msg}", flush=True)) if ctx.is_main else (lambda msg: None)
    dtype = COMPUTE_DTYPES[t.precision]
    train_dir = layout.train_dir(cfg)
    train_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)

    # -- target and data (mismatches fail here, before anything is trained)
    target_path = resolve_target_path(cfg.target)
    target_config = load_target_config(target_path, cfg.target.revision)
    kind = training_kind(cfg, target_config)  # what differs between head kinds (train/head_kinds.py)
    if t.mode == "offline":
        from data_prep.feature_cache import FeatureCacheReader

        cdir = layout.cache_dir(cfg)
        source = FeatureCacheReader(cdir, verify=t.verify_cache)
        check_cache_matches_target(source.manifest, cdir, target_path, target_config, kind.layers)
    else:
        source = TokenizedRecords(layout.tokenized_file(cfg), cfg.data.max_length)
    train_idx, eval_idx = split_train_eval(source.ids, t.eval_fraction, cfg.seed)
    positions = head_positions(cfg, target_config)  # records beyond them: train.long_records
    train_idx, limit = apply_long_records(t.long_records, positions, source.lengths, train_idx, cfg.data.max_length)
    eval_idx, _ = apply_long_records(t.long_records, positions, source.lengths, eval_idx, cfg.data.max_length)
    train_set = Subset(source, train_idx, limit)
    eval_set = Subset(source, eval_idx, limit)
    plan = MicroBatchPlan(train_set.lengths, t.micro_batch_size, cfg.seed, t.batching, t.group_size,
                          ctx.world_size, ctx.rank)
    total_steps = t.max_steps or max(1, int(t.epochs * plan.per_epoch) // t.grad_accum)
    say(f"target {target_path} ({t.mode}); {len(train_set)} train / {len(eval_set)} eval records; "
        f"{plan.per_epoch} micro-batches per epoch per rank x {ctx.world_size} ranks; {total_steps} optimizer steps; "
        f"batching={t.batching} (padding {plan.padding_fraction():.1%})")
    print_run_plan(cfg, ctx, target_config)  # rank 0: memory / disk / time plan of this run (train/plan.py)

    # -- model: a fresh (or given) head + the target's frozen embedding and lm_head
    frozen, embedding = load_frozen_target(t.mode, cfg.target, target_path, ctx.device, dtype, kind.layers)
    head = kind.new_head(target_config, source, train_set.indices, frozen.lm_head)  # eagle3: + the draft vocabulary of the train split
    if kind.describe() is not None:
        say(kind.describe())
    if tuple(embedding.shape) != tuple(head.embed_tokens.weight.shape):
        raise ValueError(f"target embedding {tuple(embedding.shape)} does not fit the head's {tuple(head.embed_tokens.weight.shape)}")
    head.embed_tokens.weight.data.copy_(embedding)
    head.embed_tokens.weight.requires_grad_(False)  # frozen: the target's embedding
    ds_config = deepspeed_config(t, total_steps, ctx.world_size, on_cpu=ctx.device.type == "cpu")
    if ctx.is_main:
        (train_dir / "deepspeed_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
    engine, _, _, _ = deepspeed.initialize(
        model=head, model_parameters=[p for p in head.parameters() if p.requires_grad], config=ds_config)
    seed_everything(cfg.seed * 1000 + 1 + ctx.rank)  # noise stream: differs per rank, restored on resume

    # -- resume: weights, optimizer, scheduler, data position and RNG
    fingerprint = {"world_size": ctx.world_size, "train_records": len(train_set), "per_epoch": plan.per_epoch,
                   "batching": t.batching, "micro_batch_size": t.micro_batch_size, "grad_accum": t.grad_accum}
    state = {"step": 0, "micro_step": 0, "tokens": 0, "train_time": 0.0, "train_cpu": 0.0, "bad_in_row": 0, "skipped": 0,
             "evaluated_epochs": 0, "data": fingerprint}
    ckpt_root = layout.checkpoint_dir(cfg)
    tag = latest_tag(ckpt_root) if t.resume else None
    if tag is not None:
        state = load_checkpoint(engine, ckpt_root, tag, ctx.rank)
        if state["data"] != fingerprint:
            raise CheckpointError(f"checkpoint {ckpt_root / tag} was made with data/batching {state['data']}, "
                                  f"this run has {fingerprint}; exact resume needs the same ones (or train.resume=false)")
        say(f"resumed from {ckpt_root / tag} at step {state['step']}")
        set_scheduled_lr(engine, say)  # a rerun with another train.lr (e.g. after a divergence) uses the new one
    state.setdefault("loss_watch", {})  # recent finite micro-batch losses and the run's best level (divergence)

    def any_rank(flag: bool) -> bool:
        return all_reduce_sum([float(flag)])[0] > 0 if ctx.world_size > 1 else flag

    pending = None  # a checkpoint saved but not yet named by `latest`: committed once the next loss is sane

    def recovery() -> str:
        discard_uncommitted(ckpt_root, pending, ctx.rank)
        good = latest_tag(ckpt_root)
        where = f"the last good checkpoint {ckpt_root / good}" if good else "the start (no checkpoint yet)"
        return (f"nothing was exported or checkpointed after it; rerun the same command with a lower train.lr "
                f"(now {t.lr:g}) to resume from {where}")
    tracker = Tracker(cfg, train_dir, enabled=ctx.is_main, resumed_step=state["step"])
    live = None
    if t.live_tau_prompts and ctx.is_main and len(eval_set):
        from train.live_tau import LiveTau

        live = LiveTau(cfg, target_path, frozen, eval_set, ctx.device)

    # ================================================================== loop
    step, micro = state["step"], state["micro_step"]
    window = {"loss": 0.0, "feature": 0.0, "token": 0.0, "positions": 0, "top1": 0, "top2": 0, "top3": 0,
              "tokens": 0, "time": 0.0}
    n_steps = kind.logged_steps  # EAGLE-3: per unrolled step hits / positions
    window.update({f"step{j}_{x}": 0 for j in range(1, n_steps + 1) for x in ("hits", "n")})
    eval_metrics: dict = {}
    bar = tqdm(total=total_steps, initial=step, desc="train", dynamic_ncols=True,
               disable=not (ctx.is_main and cfg.logging.progress))
    loader_epoch, loader, epoch_batches = -1, None, []
    last_eval_step = -1
    stopped_early = False
    engine.train()
    while step < total_steps:
        epoch, index = plan.position(micro)
        if loader_epoch != epoch:  # a new epoch, or resuming in the middle of one: start at `index`
            epoch_batches = plan.epoch(epoch)
            loader = micro_batch_loader(train_set, epoch_batches[index:], t.num_workers, ctx.device.type == "cuda")
            loader_epoch = epoch
        tic, cpu_tic = time.perf_counter(), time.process_time()
        batch = next(loader).to(ctx.device)
        features = frozen.features(batch).to(dtype)  # [B, T, H] (EAGLE-3: [B, T, 4H], aux layers + final state)
        out = kind.loss(engine, features, batch, frozen.lm_head, micro)
        micro += 1
        if not all_ranks_finite(out.loss, ctx.world_size):
            state["bad_in_row"] += 1
            state["skipped"] += 1
            warnings.warn(f"non-finite loss at step {step}, micro-batch {micro - 1} (epoch {epoch}, records "
                          f"{[train_set.source.ids[train_set.indices[i]] for i in epoch_batches[index]]}); skipped "
                          f"({state['bad_in_row']} in a row)", RuntimeWarning, stacklevel=1)
            if state["bad_in_row"] >= t.max_bad_steps:
                raise NonFiniteLossError(
                    f"{state['bad_in_row']} non-finite losses in a row (train.max_bad_steps={t.max_bad_steps}) at step "
                    f"{step}: lower train.lr, use train.precision=bf16/fp32, or check the feature cache for NaN/inf; "
                    + recovery())
            continue
        state["bad_in_row"] = 0
        loss_value = float(out.loss.detach())
        if any_rank(exploded(loss_value, state["loss_watch"], t.max_loss_ratio)):
            raise DivergenceError(f"training diverged at step {step}: {describe(loss_value, state['loss_watch'], t.max_loss_ratio)}; "
                                  + recovery())
        remember(loss_value, state["loss_watch"])
        if pending is not None:
            commit_checkpoint(ckpt_root, pending, t.keep_last, ctx.rank)
            pending = None
        engine.backward(out.loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        elapsed = time.perf_counter() - tic
        state["tokens"] += batch.num_tokens
        state["train_time"] += elapsed
        state["train_cpu"] += time.process_time() - cpu_tic
        n = out.positions
        window["loss"] += float(out.loss.detach()) * n
        window["feature"] += float(out.feature) * n
        window["token"] += float(out.token) * n
        window["positions"] += n
        for k, c in zip(("top1", "top2", "top3"), out.topk_correct):
            window[k] += c
        for j, (hits, cnt) in enumerate(zip(out.step_hits[:n_steps], out.step_counts[:n_steps]), start=1):
            window[f"step{j}_hits"] += hits
            window[f"step{j}_n"] += cnt
        window["tokens"] += batch.num_tokens
        window["time"] += elapsed
        if not boundary:
            continue
        step += 1
        bar.update(1)

        if step % cfg.logging.log_every == 0 or step == total_steps:
            w = dict(zip(window, all_reduce_sum(list(window.values()))))
            pos = max(w["positions"], 1)
            logs = {"train/loss": w["loss"] / pos, "train/feature_loss": w["feature"] / pos,
                    "train/token_loss": w["token"] / pos, "train/top1": w["top1"] / pos, "train/top2": w["top2"] / pos,
                    "train/top3": w["top3"] / pos, "train/lr": engine.get_lr()[0],
                    "train/tokens_per_s": w["tokens"] / max(w["time"] / ctx.world_size, 1e-9),
                    "train/epoch": micro / plan.per_epoch}
            logs.update({f"train/step{j}_acc": w[f"step{j}_hits"] / max(w[f"step{j}_n"], 1) for j in range(1, n_steps + 1)})
            tracker.log(logs, step)
            bar.set_postfix(loss=f"{logs['train/loss']:.3f}", top1=f"{logs['train/top1']:.3f}",
                            tok_s=f"{logs['train/tokens_per_s']:.0f}")
            window = dict.fromkeys(window, 0)

        epochs_done = micro // plan.per_epoch
        if len(eval_set) and ((t.eval_every and step % t.eval_every == 0)
                              or (not t.eval_every and epochs_done > state["evaluated_epochs"])):
            state["evaluated_epochs"] = epochs_done
            eval_head = standalone_head(engine.module, t.zero_stage, ctx.device, dtype)
            eval_metrics = evaluate(eval_head, eval_set, frozen, kind, ctx.device, dtype, cfg.seed, ctx.rank, ctx.world_size)
            if live is not None:  # rank 0 only; the other ranks wait for it at the next collective
                eval_metrics.update(live.measure(eval_head))
            tracker.log(eval_metrics, step)
            last_eval_step = step
            say(f"step {step}: eval top1 {eval_metrics['eval/top1']:.3f}, steps 1-{t.rollout_steps} "
                + "/".join(f"{eval_metrics[f'eval/step{j + 1}_acc']:.2f}" for j in range(t.rollout_steps))
                + f", sim. acceptance length {eval_metrics['eval/sim_accept_len']:.2f}"
                + (f", live tau {eval_metrics['eval/live_tau']:.2f}" if live is not None else ""))

        state.update(step=step, micro_step=micro)
        if any_rank(bool(non_finite_weights(engine.module))):
            raise DivergenceError(f"training diverged at step {step}: the head's weights {non_finite_weights(engine.module)[:3]} "
                                  f"are no longer finite; " + recovery())
        if step % t.checkpoint_every == 0 or step == total_steps or (t.stop_after and step >= t.stop_after):
            final = step == total_steps or (t.stop_after and step >= t.stop_after)
            tag = save_checkpoint(engine, ckpt_root, step, state, t.keep_last, ctx.rank, commit=bool(final))
            pending = None if final else tag
        if t.stop_after and step >= t.stop_after and step < total_steps:
            stopped_early = True
            break
    bar.close()

    # ================================================================== save
    totals = all_reduce_sum([state["tokens"], state["train_time"], state["train_cpu"]])
    summary = {
        "recipe": cfg.name, "target": target_path, "mode": t.mode, "steps": step, "total_steps": total_steps,
        "epochs": micro / plan.per_epoch, "world_size": ctx.world_size, "precision": t.precision,
        "zero_stage": t.zero_stage, "batching": t.batching, "padding_fraction": plan.padding_fraction(),
        "train_records": len(train_set), "eval_records": len(eval_set), "skipped_micro_batches": state["skipped"],
        "train_tokens": int(totals[0]), "train_time_s": totals[1] / ctx.world_size,
        "train_tokens_per_s": totals[0] / max(totals[1] / ctx.world_size, 1e-9),
        "train_cpu_s": totals[2],  # process CPU time of the training steps, summed over ranks (all threads)
        "stopped_early": stopped_early,
        **kind.summary(),
    }
    if stopped_early:
        say(f"stopped after step {step} (train.stop_after={t.stop_after}); rerun the same command to resume")
    else:
        if len(eval_set) and last_eval_step != step:
            eval_head = standalone_head(engine.module, t.zero_stage, ctx.device, dtype)
            eval_metrics = evaluate(eval_head, eval_set, frozen, kind, ctx.device, dtype, cfg.seed, ctx.rank, ctx.world_size)
            if live is not None:
                eval_metrics.update(live.measure(eval_head))
            tracker.log(eval_metrics, step)
        summary["eval"] = eval_metrics
        weights = full_state_dict(engine.module, t.zero_stage)  # collective under ZeRO-3
        if ctx.is_main:
            path = export_head(weights, engine.module.config, layout.head_dir(cfg), cfg.export.dtype, cfg.export.legacy_bin,
                               recipe=cfg, summary=summary)
            summary["head_dir"] = str(path)
            say(f"exported head to {path}")
    if ctx.is_main:
        (train_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        say("summary: " + json.dumps({k: v for k, v in summary.items() if k != "eval"})
            + ("\n[train] eval: " + json.dumps(summary.get("eval", {})) if summary.get("eval") else ""))
        if cfg.export.push_to_hub and not stopped_early:
            from train.export import push_exported_head

            push_exported_head(layout.head_dir(cfg))

    # ================================================================== cleanup
    tracker.close()
    engine.destroy()  # DeepSpeed's own release of its hooks and buffers (a test process may train again)
    del engine
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        prog="train/main.py",
        description="Train an EAGLE-2 or EAGLE-3 draft head (DeepSpeed) from a recipe (head.kind). Overrides: key=value, e.g. "
                    "train.lr=1e-4 train.max_steps=100 target.path=/models/llama.",
        epilog=f"shipped recipes: {', '.join(list_recipes())}\n\nrecipe keys (default  # meaning):\n{describe_recipe_keys()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--recipe", required=True, help="recipe name in recipes/ (e.g. tiny, llama3-8b) or a YAML path")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # set by `deepspeed`
    return p.parse_args(argv)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    from train.distributed import destroy_process_groups, init_distributed, shutdown_distributed

    args = parse_args(argv)
    cfg = load_config(args.recipe, args.overrides)
    ctx = init_distributed(cfg.train.device)
    try:
        train(cfg, ctx)
    except BaseException:
        destroy_process_groups()  # no barrier on failure: other ranks may never reach it (the launcher stops them)
        raise
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    from train.distributed import exit_process

    exit_process(main())
