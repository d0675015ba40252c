"""Train an EAGLE-2 or EAGLE-3 draft head (recipe `head.kind`) on a frozen target with DeepSpeed, as a recipe:
setup (config, data, head, engine, resume) -> the loop of train steps, evaluating and checkpointing as scheduled ->
save (summary, export) -> cleanup.

    python train/main.py --recipe tiny [key=value ...]                    # one CPU process
    torchrun --nproc_per_node 2 train/main.py --recipe tiny               # several processes (gloo on CPU)
    deepspeed --num_gpus 8 train/main.py --recipe llama3-8b               # GPUs (add --hostfile for multi-node)

Outputs under {output_dir}/train/: checkpoints/ (resumable), metrics.jsonl, tensorboard/, summary.json,
deepspeed_config.json (generated from the recipe, for reference only); the head goes to {output_dir}/head/.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # started by path (deepspeed, torchrun: once per rank): the repo root replaces this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np
import torch
from tqdm.auto import tqdm

from data_prep.target import load_target_config, resolve_target_path
from eagle.cli_errors import ArgumentParser, UserError, one_line, one_line_errors
from eagle.head_kinds import text_config
from eagle.run_lock import run_lock
from recipes import add_print_config, command_config, layout, list_recipes
from recipes.schema import describe_recipe_keys
from train import held_out
from train.batching import MicroBatchPlan
from train.checkpoint import (CheckpointError, check_checkpoint_head, check_complete,
                              commit_checkpoint, discard_uncommitted, latest_tag, load_checkpoint, make_universal,
                              needs_universal, ranks_text, save_checkpoint, saved_world_size, saved_zero_stage,
                              stage_change_error)
from train.data import (Subset, TokenizedRecords, apply_long_records, collate, head_positions, open_feature_cache,
                        micro_batch_loader, split_train_eval)
from train.distributed import (all_reduce_sum, barrier, collective_failed, describe_ranks,
                               destroy_process_groups, exit_process, import_deepspeed, init_distributed,
                               lost_rank_error, shutdown_distributed)
from train.divergence import DivergenceError, describe, exploded, non_finite_weights, remember
from train.ds_config import COMPUTE_DTYPES, deepspeed_config
from train.export import export_head, full_state_dict, push_exported_head, standalone_head
from train.frozen_target import check_cache_matches_target, load_frozen_target
from train.head_kinds import training_kind
from train.live_tau import LiveTau
from train.loss import LossOutput
from train.plan import check_run_memory, print_run_plan
from train.sequence_parallel import UlyssesShards, check_sequence_parallel, sequence_groups
from train.stream import StreamRecords
from train.tracking import Tracker


class NonFiniteLossError(UserError, RuntimeError):
    """Too many non-finite losses in a row: the run diverged or the data holds NaN/inf features."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def all_ranks_finite(loss: torch.Tensor, world_size: int) -> bool:
    """True when the loss is finite on every rank (ranks must skip a micro-batch together)."""
    bad = 0.0 if bool(torch.isfinite(loss.detach())) else 1.0
    return all_reduce_sum([bad])[0] == 0 if world_size > 1 else bad == 0


def any_rank(flag: bool, world_size: int) -> bool:
    """True when `flag` is set on some rank."""
    return all_reduce_sum([float(flag)])[0] > 0 if world_size > 1 else flag


def on_every_rank(step, world_size: int, needs: str) -> None:
    """Run a setup `step` on every rank and agree on the outcome: when it fails on some rank, every rank stops with
    the same one-line error (instead of the others waiting for the failed ones at the next collective), which the
    launch then prints once (eagle/rank_errors.py): the failed rank's own line when every rank failed alike, else
    the failed ranks and the first one's line."""
    try:
        step()
        error = None
    except (UserError, OSError, ValueError) as e:
        error = e
    if world_size == 1:
        if error is not None:
            raise error
        return
    lines: list[str | None] = [None] * world_size
    torch.distributed.all_gather_object(lines, None if error is None else one_line(error))
    failed = [r for r, line in enumerate(lines) if line is not None]
    if not failed:
        return
    first, alike = lines[failed[0]], len({lines[r] for r in failed}) == 1
    if len(failed) == world_size and alike:
        agreed = first
    else:
        agreed = (f"{describe_ranks(failed)} could not set up ({needs}): "
                  + (first if alike else f"{describe_ranks(failed[:1])}: {first}"))
    if error is not None and one_line(error) == agreed:
        raise error
    raise UserError(agreed)


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
    makes it stop with RunDirBusyError (ranks of a killed launcher do not linger: they die with it)."""
    ctx = ctx or init_distributed(cfg.train.device, cfg.train.collective_timeout_s)
    with run_lock(layout.train_dir(cfg), f"rank{ctx.rank}", "training"):
        trainer = Trainer(cfg, ctx)
        try:
            trainer.setup()
            trainer.train()
            summary = trainer.save()
        except RuntimeError as e:
            if not collective_failed(e):
                raise
            good = latest_tag(trainer.ckpt_root)
            where = f"the last committed checkpoint {trainer.ckpt_root / good}" if good else "the start (no checkpoint yet)"
            raise lost_rank_error(e, getattr(trainer, "step", 0),
                                  f"rerun the same command on every node to resume from {where}") from None
        finally:
            if isinstance(getattr(trainer, "source", None), StreamRecords):
                trainer.source.stop(finished=False)  # stream mode: rank 0 ends the producer it started (if alive)
        trainer.cleanup()
        return summary


class Trainer:
    """One training run: `setup`, then `train` (the loop: `train_step` per micro-batch; at each optimizer step the
    logging, `evaluate` and `checkpoint` their schedules ask for), `save`, `cleanup`."""

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx, self.t = cfg, ctx, cfg.train
        self.say = (lambda msg: print(f"[train] {msg}", flush=True)) if ctx.is_main else (lambda msg: None)
        self.dtype = COMPUTE_DTYPES[self.t.precision]
        self.train_dir, self.ckpt_root = layout.train_dir(cfg), layout.checkpoint_dir(cfg)
        self.pending = None  # a checkpoint saved but not yet named by `latest`: committed once the next loss is sane
        self.eval_metrics: dict = {}
        self.last_eval_step, self.stopped_early = -1, False
        self.loader, self.segment, self.done = None, [], 0  # this rank's rest of the epoch, and how much of it ran
        self.batch_records: list[int] = []
        self.at_boundary = False
        # who writes a checkpoint's shared files (model states, ranks.json, `latest`): global rank 0 on a shared
        # filesystem; on per-node disks each node's local rank 0, so every node can resume from its own disk
        self.ckpt_writer = ctx.rank == 0 if self.t.shared_filesystem else ctx.local_rank == 0

    # ================================================================== setup
    def setup(self) -> None:
        self.train_dir.mkdir(parents=True, exist_ok=True)
        seed_everything(self.cfg.seed)
        self.check_filesystem()
        on_every_rank(self.setup_data, self.ctx.world_size,
                      f"every node needs the target, the training data ({self.cfg.train.cache_dir or 'the feature cache'}"
                      f" under output_dir {self.cfg.output_dir} by default) and a writable output_dir")
        self.setup_model()
        self.setup_resume()
        if self.t.mode == "stream":  # the producer starts at the resumed position (train/stream.py)
            on_every_rank(self.setup_stream, self.ctx.world_size, "the stream directory and its producer")
        self.tracker = Tracker(self.cfg, self.train_dir, enabled=self.ctx.is_main, resumed_step=self.step)
        live = self.t.live_tau_prompts and self.ctx.is_main and len(self.eval_set)
        self.live = LiveTau(self.cfg, self.target_path, self.frozen, self.eval_set, self.ctx.device) if live else None
        self.window = self.empty_window()

    def check_filesystem(self) -> None:
        """train.shared_filesystem=true on several ranks: every rank must see a file rank 0 just wrote into the run
        folder (else it names the ranks that do not, before anything is trained)."""
        ctx = self.ctx
        if not self.t.shared_filesystem or ctx.world_size == 1:
            return
        token = int(all_reduce_sum([float(int.from_bytes(os.urandom(6), "big")) if ctx.is_main else 0.0])[0])
        probe = self.train_dir / f".shared-check-{token}"
        if ctx.is_main:
            probe.write_text(str(token))
        barrier()
        blind = all_reduce_sum([float(r == ctx.rank and not probe.exists()) for r in range(ctx.world_size)])
        barrier()
        if ctx.is_main:
            probe.unlink()
        missing = [r for r, flag in enumerate(blind) if flag]
        if missing:
            raise UserError(f"train.shared_filesystem=true, but {describe_ranks(missing)} do not see {self.train_dir} "
                            "as rank 0 writes it: put output_dir on a filesystem every node mounts, or set "
                            "train.shared_filesystem=false (per-node disks: each node keeps its own checkpoints)")

    def setup_data(self) -> None:
        """The target's config, the head kind, the records and their train/eval split, the micro-batch plan.
        Mismatches (cache vs target, records too long) fail here, before anything is trained."""
        cfg, t, ctx = self.cfg, self.t, self.ctx
        self.target_path = resolve_target_path(cfg.target)
        self.target_config = load_target_config(self.target_path, cfg.target.revision)
        self.part = training_kind(cfg, self.target_config)  # what differs between head kinds (train/head_kinds.py)
        if t.mode == "offline":
            cdir = layout.cache_dir(cfg)
            self.source = open_feature_cache(cfg, t.verify_cache)
            check_cache_matches_target(self.source.manifest, cdir, self.target_path, self.target_config, self.part.layers,
                                       cfg.target.quantization)
        elif t.mode == "stream":  # ids and lengths from the tokenized records; features as the producer writes them
            self.source = StreamRecords(TokenizedRecords(layout.tokenized_file(cfg), cfg.data.max_length),
                                        layout.stream_dir(cfg), t.stream_timeout_s, ctx.rank)
        else:
            self.source = TokenizedRecords(layout.tokenized_file(cfg), cfg.data.max_length)
        train_idx, eval_idx = split_train_eval(self.source.ids, t.eval_fraction, cfg.seed)
        positions = head_positions(cfg, self.target_config)  # records beyond them: train.long_records
        lengths, max_length = self.source.lengths, cfg.data.max_length
        train_idx, limit = apply_long_records(t.long_records, positions, lengths, train_idx, max_length)
        eval_idx, _ = apply_long_records(t.long_records, positions, lengths, eval_idx, max_length)
        self.train_set, self.eval_set = Subset(self.source, train_idx, limit), Subset(self.source, eval_idx, limit)
        tc = text_config(self.target_config)
        check_sequence_parallel(t, self.part, ctx.world_size, tc.num_attention_heads,
                                getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads)
        sp = t.sequence_parallel_size  # the ranks of a sequence-parallel group train the same micro-batches
        self.plan = MicroBatchPlan(self.train_set.lengths, t.micro_batch_size, cfg.seed, t.batching, t.group_size,
                                   ctx.world_size // sp, ctx.rank // sp, t.grad_accum)
        self.total_steps = t.max_steps or max(1, int(t.epochs * self.plan.per_epoch) // t.grad_accum)
        self.say(f"target {self.target_path} ({t.mode}); {len(self.train_set)} train / {len(self.eval_set)} eval "
                 f"records; {self.plan.per_epoch} micro-batches per epoch per rank x {ctx.world_size} ranks; "
                 f"{self.total_steps} optimizer steps; batching={t.batching} (padding {self.plan.padding_fraction():.1%})")
        print_run_plan(cfg, ctx, self.target_config)  # rank 0: memory / disk / time plan of this run (train/plan.py)
        # the options that size memory, against this data, before anything is allocated: the unrolled step count
        # against the longest record, then the plan's peak at the data's largest micro-batch against this machine
        self.part.check_steps_fit_records(self.train_set.lengths)
        check_run_memory(cfg, ctx, self.target_config, max(self.train_set.lengths, default=1), self.part.steps_key,
                         self.part.stride_key)

    def setup_stream(self) -> None:
        """Stream mode: the request, the producer, and its features checked against the target like a cache's."""
        self.source.begin(self.cfg, self.ctx, self.train_set, self.eval_set, self.plan, self.pos, self.total_steps)
        meta = {k: v for k, v in self.source.meta["meta"].items() if k != "order"}
        check_cache_matches_target(meta, self.source.sdir, self.target_path, self.target_config, self.part.layers,
                                   self.cfg.target.quantization)
        if len(self.source.eval_indices) < len(self.eval_set):  # the held-out shard is bounded by the window
            self.say(f"stream: {len(self.source.eval_indices)} of {len(self.eval_set)} held-out records evaluated "
                     f"(their shard stays on disk: at most half of the window, {self.source.order.window_bytes / 2**20:.2f} "
                     f"MiB = train.stream_window_steps={self.t.stream_window_steps}"
                     + (f" capped at train.stream_window_mb={self.t.stream_window_mb:g}" if self.t.stream_window_mb else "")
                     + ")")
            self.eval_set = Subset(self.source, self.source.eval_indices, self.eval_set.max_length)

    def setup_model(self) -> None:
        """A fresh (or given) head with the target's frozen embedding, in a DeepSpeed engine; the target's frozen
        lm_head (and online, the target) beside it."""
        deepspeed = import_deepspeed()  # lazy (inside): a second at import; only training needs it

        cfg, t, ctx, part = self.cfg, self.t, self.ctx, self.part
        self.frozen, embedding = load_frozen_target("online" if t.mode == "online" else "offline", cfg.target, self.target_path, ctx.device, self.dtype,
                                                    part.layers)
        head = part.new_head(self.target_config, self.source, self.train_set.indices, self.frozen.lm_head)
        if part.describe() is not None:
            self.say(part.describe())
        if tuple(embedding.shape) != tuple(head.embed_tokens.weight.shape):
            raise ValueError(f"target embedding {tuple(embedding.shape)} does not fit the head's "
                             f"{tuple(head.embed_tokens.weight.shape)}")
        head.embed_tokens.weight.data.copy_(embedding)
        head.embed_tokens.weight.requires_grad_(False)  # frozen: the target's embedding
        ds_config = deepspeed_config(t, self.total_steps, ctx.world_size, on_cpu=ctx.device.type == "cpu")
        self.resume_tag = latest_tag(self.ckpt_root) if t.resume else None
        self.resume_from = None  # the checkpoint folder itself
        if self.resume_tag is not None:
            self.plan_resume(ds_config)
        if ctx.is_main:
            (self.train_dir / "deepspeed_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
        self.engine, _, _, _ = deepspeed.initialize(
            model=head, model_parameters=[p for p in head.parameters() if p.requires_grad], config=ds_config)
        self.shards = None  # sequence parallelism: this rank's group and span of each record
        if t.sequence_parallel_size > 1:
            c = head.config
            self.shards = UlyssesShards(sequence_groups(t.sequence_parallel_size, ctx.world_size, ctx.rank),
                                        c.num_attention_heads, c.num_key_value_heads, c.head_dim)
            self.say(f"sequence parallelism: each record split over {t.sequence_parallel_size} ranks (DeepSpeed "
                     f"Ulysses), {ctx.world_size // t.sequence_parallel_size} data-parallel group(s)")
        seed_everything(cfg.seed * 1000 + 1 + ctx.rank)  # a stream per rank, restored on resume (input noise has its own)

    def plan_resume(self, ds_config: dict) -> None:
        """How checkpoint `resume_tag` loads into this run, decided on every rank before DeepSpeed reads a byte of
        it: as it is (the same ranks and stage; or ZeRO stage 0, whose single file fits any number of ranks), or
        through DeepSpeed's universal checkpoint (ZeRO 1-3 partitions on another number of ranks), converted once by
        rank 0. A missing file, a change of ZeRO stage other than 1 <-> 2 or a failed conversion stops every rank
        with one line."""
        t, ctx, root, tag = self.t, self.ctx, self.ckpt_root, self.resume_tag
        folder = root / tag
        saved_world, saved_stage = saved_world_size(folder), saved_zero_stage(folder)
        refusal = stage_change_error(folder, saved_stage, t.zero_stage)
        if refusal is not None:
            raise refusal
        convert = needs_universal(saved_stage, saved_world, ctx.world_size)
        if convert and not t.shared_filesystem:
            raise CheckpointError(
                f"checkpoint {folder} was written by {ranks_text(saved_world)} under train.zero_stage={saved_stage}, "
                f"this run has {ctx.world_size}: converting it needs every rank's partition in one "
                "folder; copy all nodes' copies of it together on a filesystem every node mounts and set "
                "train.shared_filesystem=true, or resume on as many ranks")
        if convert:
            # its ZeRO partitions do not fit this run; DeepSpeed's universal checkpoint holds every parameter and
            # optimizer moment whole, and loads on any number of ranks under ZeRO 1-3
            self.say(f"checkpoint {folder} was written by {ranks_text(saved_world)} under ZeRO stage {saved_stage}, this "
                     f"run has {ctx.world_size}: converting it to a DeepSpeed universal checkpoint")
            ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
        elif saved_world != ctx.world_size:  # stage 0: the one model-states file holds the whole optimizer state
            self.say(f"checkpoint {folder} was written by {ranks_text(saved_world)} under ZeRO stage 0: its optimizer state "
                     f"is whole, loading it on {ctx.world_size} as it is")
        # without conversion, the files this rank reads (on a shared filesystem every rank checks every file, so all
        # stop together); the converter (rank 0) checks every rank's files itself
        mine = range(saved_world) if t.shared_filesystem else [ctx.rank]

        def step() -> None:
            if convert:
                self.resume_from = make_universal(root, tag, ctx.rank, ctx.world_size, t.zero_stage)
            else:
                check_complete(root, tag, saved_stage, mine)
        on_every_rank(step, ctx.world_size, f"checkpoint {folder} cannot be resumed on every rank")

    def setup_resume(self) -> None:
        """The trainer's state, from the latest checkpoint when there is one: weights, optimizer, scheduler, data
        position and RNG."""
        t, plan = self.t, self.plan
        # what the global sample order depends on (train/batching.py); the world size and grad_accum may change
        fingerprint = {"train_records": len(self.train_set), "batching": t.batching, "group_size": t.group_size,
                       "micro_batch_size": t.micro_batch_size}
        state = {"step": 0, "micro_step": 0, "tokens": 0, "train_time": 0.0, "train_cpu": 0.0, "bad_in_row": 0,
                 "skipped": 0, "evaluated_epochs": 0, "data": fingerprint, "world_size": self.ctx.world_size,
                 "data_pos": {"epoch": 0, "consumed": 0, "order_step_size": plan.step_size}}
        if self.resume_tag is not None:
            tag = self.resume_tag  # another head kind or shape (a rerun with another recipe): one line before torch's
            check_checkpoint_head(self.ckpt_root / tag, self.engine.module,
                                  f"recipe {self.cfg.name!r}, head.kind={self.cfg.head.kind}")
            state = load_checkpoint(self.engine, self.ckpt_root, tag, self.ctx.rank, self.resume_from)
            if "data_pos" not in state and state["data"].get("grad_accum") == 1 and \
                    state["data"].get("world_size") == self.ctx.world_size:
                # written before positions were global: with grad_accum 1 its order is the global one, so its
                # per-rank position converts (another grad_accum made another order: refused below)
                epoch, index = divmod(state["micro_step"], state["data"]["per_epoch"])
                state["data_pos"] = {"epoch": epoch, "consumed": index * self.ctx.world_size,
                                     "order_step_size": self.ctx.world_size}
                state["world_size"] = self.ctx.world_size
            if "data_pos" not in state:
                raise CheckpointError(f"checkpoint {self.ckpt_root / tag} was written before data positions were "
                                      "counted in global micro-batches; finish it with the trainer version that wrote "
                                      "it, or set train.resume=false")
            known = [k for k in fingerprint if k in state["data"]]  # older checkpoints did not record group_size
            if any(state["data"][k] != fingerprint[k] for k in known):
                raise CheckpointError(f"checkpoint {self.ckpt_root / tag} was made with data/batching {state['data']}, "
                                      f"this run has {fingerprint}; exact resume needs the same ones (or "
                                      "train.resume=false)")
            pos, old_world = state["data_pos"], state["world_size"]
            self.say(f"resumed from {self.ckpt_root / tag} at step {state['step']} (epoch {pos['epoch']}, "
                     f"{pos['consumed']} global micro-batches into it)"
                     + (f"; written by {old_world} ranks, continued on {self.ctx.world_size}" if old_world != self.ctx.world_size else ""))
            if pos["order_step_size"] != plan.step_size:
                self.say(f"the global batch changed ({pos['order_step_size']} -> {plan.step_size} micro-batches per "
                         "step): this epoch finishes its order in the new steps; keep world_size x train.grad_accum to "
                         "continue exactly as the interrupted run would have")
            state.update(world_size=self.ctx.world_size, data=fingerprint)
            set_scheduled_lr(self.engine, self.say)  # a rerun with another train.lr (after a divergence) uses the new one
        state.setdefault("loss_watch", {})  # recent finite micro-batch losses and the run's best level (divergence)
        self.state, self.step, self.micro = state, state["step"], state["micro_step"]
        self.pos = dict(state["data_pos"])  # where this rank's current segment of the epoch starts

    # ================================================================== the loop
    def train(self) -> None:
        """Micro-batch after micro-batch: one train step each; at every optimizer step, log, evaluate and checkpoint
        when their schedules say so; stop at the last step (or train.stop_after, as if interrupted)."""
        t, log_every = self.t, self.cfg.logging.log_every
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", dynamic_ncols=True,
                   disable=not (self.ctx.is_main and self.cfg.logging.progress))
        self.engine.train()
        while self.step < self.total_steps:
            tic, cpu_tic = time.perf_counter(), time.process_time()
            batch, key = self.next_batch()
            out = self.train_step(batch, key)
            if out is None:  # a non-finite loss on some rank: the micro-batch is skipped
                continue
            self.record(out, batch, time.perf_counter() - tic, time.process_time() - cpu_tic)
            if not self.at_boundary:  # gradients accumulate over train.grad_accum micro-batches
                continue
            self.step += 1
            bar.update(1)
            if self.step % log_every == 0 or self.step == self.total_steps:
                self.log_window(bar)
            if self.eval_due():
                self.evaluate(announce=True)
            self.checkpoint()
            if t.stop_after and t.stop_after <= self.step < self.total_steps:
                self.stopped_early = True
                break
        bar.close()

    def next_batch(self):
        """The next micro-batch of this rank's plan, on the device, and its key (epoch and global position: what its
        input noise and EAGLE-3 row subset derive from, the same on any number of ranks). A new epoch, or resuming
        inside one, starts a loader at the data position."""
        while self.loader is None or self.done == len(self.segment):
            if self.loader is not None:  # the epoch is over: the next one, in this run's steps
                self.pos = {"epoch": self.pos["epoch"] + 1, "consumed": 0, "order_step_size": self.plan.step_size}
            self.segment = self.plan.segment(self.pos["epoch"], self.pos["consumed"], self.pos["order_step_size"])
            self.done = 0
            self.loader = iter(()) if self.t.mode == "stream" else micro_batch_loader(
                self.train_set, [b for _, b in self.segment], self.t.num_workers, self.ctx.device.type == "cuda")
        where, self.batch_records = self.segment[self.done]
        self.done += 1
        if self.t.mode == "stream":  # its shard, as it arrives (train/stream.py)
            self.source.seek(self.pos["epoch"] * self.source.order.stride + where)
            batch = collate([self.train_set[j] for j in self.batch_records])
            return batch.to(self.ctx.device), self.pos["epoch"] * len(self.train_set) + where
        return next(self.loader).to(self.ctx.device), self.pos["epoch"] * len(self.train_set) + where

    def data_position(self) -> dict:
        """The data position after the micro-batches trained so far, in global micro-batches (any world size)."""
        if self.loader is not None and self.done == len(self.segment):  # the epoch's last step: the next one starts
            return {"epoch": self.pos["epoch"] + 1, "consumed": 0, "order_step_size": self.plan.step_size}
        done = self.plan.consumed(self.pos["consumed"], self.done) if self.loader is not None else self.pos["consumed"]
        return {**self.pos, "consumed": done}

    def epochs_done(self) -> float:
        """Epochs trained, with the fraction of the current one."""
        pos = self.data_position()
        return pos["epoch"] + pos["consumed"] / max(self.plan.global_per_epoch, 1)

    def train_step(self, batch, key: int) -> LossOutput | None:
        """Forward and loss (the head kind's), the non-finite and divergence checks, backward, and the optimizer step
        at an accumulation boundary. None: skipped (a non-finite loss on some rank)."""
        t, state = self.t, self.state
        features = self.frozen.features(batch).to(self.dtype)  # [B, T, W] the target's states the head reads
        out = self.part.loss(self.engine, features, batch, self.frozen.lm_head, key, self.cfg.seed, self.shards)
        self.micro += 1
        if not all_ranks_finite(out.loss, self.ctx.world_size):
            self.skip_non_finite()
            return None
        state["bad_in_row"] = 0
        loss_value = float(out.loss.detach())
        if any_rank(exploded(loss_value, state["loss_watch"], t.max_loss_ratio), self.ctx.world_size):
            raise DivergenceError(f"training diverged at step {self.step}: "
                                  f"{describe(loss_value, state['loss_watch'], t.max_loss_ratio)}; " + self.recovery())
        remember(loss_value, state["loss_watch"])
        if self.pending is not None:
            commit_checkpoint(self.ckpt_root, self.pending, t.keep_last, self.ctx.rank, self.ckpt_writer)
            self.pending = None
        self.engine.backward(out.loss)
        self.at_boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.step()
        return out

    def skip_non_finite(self) -> None:
        """Count the skipped micro-batch, name its records; stop after train.max_bad_steps in a row."""
        t, state = self.t, self.state
        state["bad_in_row"] += 1
        state["skipped"] += 1
        epoch = self.pos["epoch"]
        records = [self.train_set.source.ids[self.train_set.indices[i]] for i in self.batch_records]
        warnings.warn(f"non-finite loss at step {self.step}, micro-batch {self.micro - 1} (epoch {epoch}, records "
                      f"{records}); skipped ({state['bad_in_row']} in a row)", RuntimeWarning, stacklevel=1)
        if state["bad_in_row"] >= t.max_bad_steps:
            raise NonFiniteLossError(
                f"{state['bad_in_row']} non-finite losses in a row (train.max_bad_steps={t.max_bad_steps}) at step "
                f"{self.step}: lower train.lr, use train.precision=bf16/fp32, or check the feature cache for NaN/inf; "
                + self.recovery())

    def recovery(self) -> str:
        """What to do after a divergence (the uncommitted checkpoint is deleted first)."""
        discard_uncommitted(self.ckpt_root, self.pending, self.ctx.rank, self.ckpt_writer)
        good = latest_tag(self.ckpt_root)
        where = f"the last good checkpoint {self.ckpt_root / good}" if good else "the start (no checkpoint yet)"
        return (f"nothing was exported or checkpointed after it; rerun the same command with a lower train.lr "
                f"(now {self.t.lr:g}) to resume from {where}")

    # ================================================================== logging
    def empty_window(self) -> dict:
        """Running sums between two logs (every rank's, summed at the log)."""
        window = {"loss": 0.0, "feature": 0.0, "token": 0.0, "positions": 0, "top1": 0, "top2": 0, "top3": 0,
                  "tokens": 0, "time": 0.0}
        window.update({f"step{j}_{x}": 0 for j in range(1, self.part.logged_steps + 1) for x in ("hits", "n")})
        return window

    def record(self, out: LossOutput, batch, elapsed: float, cpu: float) -> None:
        """Add a trained micro-batch to the run's totals and the log window."""
        state, window, n = self.state, self.window, out.positions
        tokens = batch.num_tokens if self.shards is None or self.shards.rank == 0 else 0  # a group's record once
        state["tokens"] += tokens
        state["train_time"] += elapsed
        state["train_cpu"] += cpu
        window["loss"] += float(out.loss.detach()) * n
        window["feature"] += float(out.feature) * n
        window["token"] += float(out.token) * n
        window["positions"] += n
        for k, c in zip(("top1", "top2", "top3"), out.topk_correct):
            window[k] += c
        steps = self.part.logged_steps  # EAGLE-3: every unrolled step's hits / positions
        for j, (hits, cnt) in enumerate(zip(out.step_hits[:steps], out.step_counts[:steps]), start=1):
            window[f"step{j}_hits"] += hits
            window[f"step{j}_n"] += cnt
        window["tokens"] += tokens
        window["time"] += elapsed

    def log_window(self, bar) -> None:
        """The train/* metrics of the window, summed over ranks; the window restarts."""
        w = dict(zip(self.window, all_reduce_sum(list(self.window.values()))))
        pos = max(w["positions"], 1)
        logs = {"train/loss": w["loss"] / pos, "train/feature_loss": w["feature"] / pos,
                "train/token_loss": w["token"] / pos, "train/top1": w["top1"] / pos, "train/top2": w["top2"] / pos,
                "train/top3": w["top3"] / pos, "train/lr": self.engine.get_lr()[0],
                "train/tokens_per_s": w["tokens"] / max(w["time"] / self.ctx.world_size, 1e-9),
                "train/epoch": self.epochs_done()}
        logs.update({f"train/step{j}_acc": w[f"step{j}_hits"] / max(w[f"step{j}_n"], 1)
                     for j in range(1, self.part.logged_steps + 1)})
        self.tracker.log(logs, self.step)
        waits = {}
        if self.t.mode == "stream":  # who waits for whom: this rank for the producer, the producer for the window
            beats = self.source.producer_stats()  # the producers' mean wait
            waits = {"wait_s": f"{self.source.wait_s:.0f}",
                     "producer_wait_s": f"{sum(b['wait_s'] for b in beats) / len(beats):.0f}"}
        bar.set_postfix(loss=f"{logs['train/loss']:.3f}", top1=f"{logs['train/top1']:.3f}",
                        tok_s=f"{logs['train/tokens_per_s']:.0f}", **waits)
        self.window = dict.fromkeys(self.window, 0)

    # ================================================================== evaluate
    def eval_due(self) -> bool:
        """Every train.eval_every steps, else once per epoch (there being held-out records)."""
        t, epochs_done = self.t, int(self.epochs_done())
        due = len(self.eval_set) and ((t.eval_every and self.step % t.eval_every == 0)
                                      or (not t.eval_every and epochs_done > self.state["evaluated_epochs"]))
        if due:
            self.state["evaluated_epochs"] = epochs_done
        return bool(due)

    def evaluate(self, announce: bool) -> dict:
        """The held-out metrics of the head as it is now (train/held_out.py; + live tau on rank 0), logged."""
        t, ctx = self.t, self.ctx
        eval_head = standalone_head(self.engine.module, t.zero_stage, ctx.device, self.dtype)
        m = held_out.evaluate(eval_head, self.eval_set, self.frozen, self.part, ctx.device, self.dtype, self.cfg.seed,
                             ctx.rank, ctx.world_size)
        if self.live is not None:  # rank 0 only; the other ranks wait for it at the next collective
            m.update(self.live.measure(eval_head))
        self.tracker.log(m, self.step)
        self.eval_metrics, self.last_eval_step = m, self.step
        if announce:
            self.say(f"step {self.step}: eval top1 {m['eval/top1']:.3f}, steps 1-{t.rollout_steps} "
                     + "/".join(f"{m[f'eval/step{j + 1}_acc']:.2f}" for j in range(t.rollout_steps))
                     + f", sim. acceptance length {m['eval/sim_accept_len']:.2f}"
                     + (f", live tau {m['eval/live_tau']:.2f}" if self.live is not None else ""))
        return m

    # ================================================================== checkpoint, save, cleanup
    def checkpoint(self) -> None:
        """After an optimizer step: the weights must be finite; a checkpoint every train.checkpoint_every steps and
        at the end (committed by the next sane loss, or at once when it is the last)."""
        t, step = self.t, self.step
        self.state.update(step=step, micro_step=self.micro, data_pos=self.data_position())
        if any_rank(bool(non_finite_weights(self.engine.module)), self.ctx.world_size):
            raise DivergenceError(f"training diverged at step {step}: the head's weights "
                                  f"{non_finite_weights(self.engine.module)[:3]} are no longer finite; " + self.recovery())
        final = step == self.total_steps or bool(t.stop_after and step >= t.stop_after)
        if step % t.checkpoint_every == 0 or final:
            tag = save_checkpoint(self.engine, self.ckpt_root, step, self.state, t.keep_last, self.ctx.rank, commit=final,
                                  writer=self.ckpt_writer, world_size=self.ctx.world_size)
            self.pending = None if final else tag

    def save(self) -> dict:
        """The run summary ({output_dir}/train/summary.json); unless stopped early, the final evaluation and the
        exported head (and, with export.push_to_hub, its Hub push)."""
        cfg, t, ctx, state = self.cfg, self.t, self.ctx, self.state
        totals = all_reduce_sum([state["tokens"], state["train_time"], state["train_cpu"]])
        summary = {
            "recipe": cfg.name, "target": self.target_path, "mode": t.mode, "steps": self.step,
            "total_steps": self.total_steps, "epochs": self.epochs_done(), "world_size": ctx.world_size,
            "precision": t.precision, "zero_stage": t.zero_stage, "batching": t.batching,
            "padding_fraction": self.plan.padding_fraction(), "train_records": len(self.train_set),
            "eval_records": len(self.eval_set), "skipped_micro_batches": state["skipped"],
            "train_tokens": int(totals[0]), "train_time_s": totals[1] / ctx.world_size,
            "train_tokens_per_s": totals[0] / max(totals[1] / ctx.world_size, 1e-9),
            "train_cpu_s": totals[2],  # process CPU time of the training steps, summed over ranks (all threads)
            "stopped_early": self.stopped_early, "token_loss": self.part.token_loss.name,
            "position_weighting": "dpace" if self.part.weighting else "fixed",
            **({"dpace_alpha": self.part.weighting.alpha} if self.part.weighting else {}),
            **self.part.summary(),
        }
        if t.mode == "stream":
            self.source.stop(finished=True)  # every rank is past its last shard; rank 0's producer has exited
            summary["stream"] = self.source.summary(ctx.world_size)
            s = summary["stream"]
            self.say(f"stream: trainer waited {s['trainer_wait_s']:.1f} s, producer waited {s['producer_wait_s']:.1f} s "
                     f"({s['producer_records_per_s']:.1f} records/s captured), window peak "
                     f"{s['window_peak_bytes'] / 2**20:.2f} of {s['window_bytes'] / 2**20:.2f} MiB "
                     f"({s['window_steps']} steps); bottleneck: "
                     f"{s['bottleneck']}")
        if self.stopped_early:
            self.say(f"stopped after step {self.step} (train.stop_after={t.stop_after}); rerun the same command to resume")
        else:
            if len(self.eval_set) and self.last_eval_step != self.step:
                self.evaluate(announce=False)  # printed with the summary below
            summary["eval"] = self.eval_metrics
            weights = full_state_dict(self.engine.module, t.zero_stage)  # collective under ZeRO-3
            if ctx.is_main:
                path = export_head(weights, self.engine.module.config, layout.head_dir(cfg), cfg.export.dtype,
                                   cfg.export.legacy_bin, recipe=cfg, summary=summary)
                summary["head_dir"] = str(path)
                self.say(f"exported head to {path}")
        if ctx.is_main:
            (self.train_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.say("summary: " + json.dumps({k: v for k, v in summary.items() if k != "eval"})
                     + ("\n[train] eval: " + json.dumps(summary.get("eval", {})) if summary.get("eval") else ""))
            if cfg.export.push_to_hub and not self.stopped_early:
                push_exported_head(layout.head_dir(cfg))
        return summary

    def cleanup(self) -> None:
        self.tracker.close()
        self.engine.destroy()  # DeepSpeed's own release of its hooks and buffers (a test process may train again)
        del self.engine


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
    add_print_config(p)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # set by `deepspeed`
    return p.parse_args(argv)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = command_config(args)
    ctx = init_distributed(cfg.train.device, cfg.train.collective_timeout_s)
    try:
        train(cfg, ctx)
    except BaseException:
        destroy_process_groups()  # no barrier on failure: other ranks may never reach it (the launcher stops them)
        raise
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    exit_process(main())
