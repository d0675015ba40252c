"""Stream mode (`train.mode=stream`): a producer process (train/stream_producer.py) captures the target's features
while the trainer's ranks consume them, through a bounded window of shards on a filesystem every rank sees.

The order is the trainer's: the epoch's global micro-batches (train/batching.py, the order an offline run of the
same recipe uses) are cut into shards of whole optimizer steps, about a quarter of the window each
(`StreamOrder.shards`, computed by both sides from the same request), so shard `mA-B` holds the records of global
micro-batches [A, B) (counted over epochs) and its features are those the offline cache holds for the same records
(one forward per record, stored in data.cache_dtype: data_prep/feature_shard.py, the one shard format).

Files of the stream directory (train.stream_dir, default {output_dir}/train/stream)::

    request.json          rank 0, at every start: the order (train/eval record indices, batching, global batch),
                          the window, and `start` (the global micro-batch the resumed checkpoint needs first)
    stream.json           the producer: the features' meta (target, hidden size, layers, dtype)
    producer.json         the producer's heartbeat (every second): its state, wait and capture seconds, peak bytes
    producer-P.json       producer P's (P >= 1, train.stream_producers > 1: shard k of the order is producer k mod N's)
    producer.error        the producer's one error line, when it failed
    consumed/rankR.json   rank R needs no micro-batch before `next` any more
    done.json             rank 0, at the end: the producer exits
    shards/eval.safetensors, shards/mA-B.safetensors, shards/rest.safetensors (train.stream_epochs=keep)

A shard is deleted (by the rank that moves every marker past it, or by the producer) once every rank's marker is
past its end, except epoch 0's shards with train.stream_epochs=keep, which later epochs re-read. A rerun of the same
command resumes from the trainer's checkpoint: rank 0 resets the markers to the checkpoint's position, and the
producer keeps the shards still on disk and captures only the ones after it that are missing. A rerun on another
global batch (world_size x grad_accum) finishes the checkpoint's epoch in that epoch's order, as offline does
(request `order`, `StreamOrder.stride`); the producer then captures the new cut's shards from the checkpoint on.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from data_prep.feature_cache import bytes_per_token, segments_of
from data_prep.feature_shard import RECORD_HEADER_BYTES, ShardRecords
from eagle.cli_errors import UserError
from eagle.state_files import StateFile, read_json_state, read_text_state, register, write_json_state
from recipes import config_yaml
from train.batching import MicroBatchPlan
from train.distributed import all_reduce_sum, barrier

POLL_S = 0.05  # how often a waiting side looks again
HEARTBEAT_S = 1.0  # the producer's heartbeat period (stream_timeout_s must be well above it)
EVAL_SHARD, REST_SHARD = "eval.safetensors", "rest.safetensors"

REQUEST = register(StateFile(
    "request.json", "STREAM_DIR", writer="train/stream.py",
    schema={"run": str, "step_size": int, "micro_batch_size": int, "seed": int, "batching": str, "group_size": int,
            "window_steps": int, "window_cap_bytes": int, "epochs": str, "train": [int], "eval": [int], "limit": int, "start": int,
            "end": int, "world_size": int, "tokenized": str, "order?": [int], "producers?": int},
    rebuild="delete the stream directory and rerun the training command (it writes the request again)",
    example={"run": "x", "step_size": 1, "micro_batch_size": 1, "seed": 0, "batching": "grouped", "group_size": 1,
             "window_steps": 8, "window_cap_bytes": 0, "epochs": "recapture", "train": [0], "eval": [], "limit": 8, "start": 0, "end": 1,
             "world_size": 1, "tokenized": "t.jsonl"}))
STREAM_META = register(StateFile(
    "stream.json", "STREAM_DIR", writer="train/stream_producer.py", schema={"meta": dict, "dtype": str, "run": str},
    rebuild="delete the stream directory and rerun the training command", when_missing="the producer has not started",
    example={"meta": {"hidden_size": 8}, "dtype": "float32", "run": "x"}))
HEARTBEAT = register(StateFile(
    "producer.json", "STREAM_DIR", writer="train/stream_producer.py",
    schema={"time": float, "pid": int, "state": str, "wait_s": float, "capture_s": float, "records": int,
            "tokens": int, "peak_bytes": int, "run": str},
    rebuild="delete it; the producer writes it again every second", when_missing="the producer has not started",
    example={"time": 0.0, "pid": 1, "state": "capturing", "wait_s": 0.0, "capture_s": 0.0, "records": 0, "tokens": 0,
             "peak_bytes": 0, "run": "x"}))
PEER_HEARTBEAT = register(StateFile(
    "producer-P.json", "STREAM_DIR", writer="train/stream_producer.py", schema=HEARTBEAT.schema,
    rebuild=HEARTBEAT.rebuild, when_missing="that producer has not started", example=HEARTBEAT.example))
PRODUCER_ERROR = register(StateFile(
    "producer.error", "STREAM_DIR", writer="train/stream_producer.py", schema=str, format="text",
    check=lambda v: None if v.startswith("error: ") and "\n" not in v else "expected one line 'error: ...'",
    rebuild="fix what it names and rerun the training command", when_missing="the producer has not failed",
    example="error: disk full"))
CONSUMED = register(StateFile(
    "RANK.json", "STREAM_DIR/consumed", writer="train/stream.py", schema={"next": int, "run": str},
    rebuild="delete the stream directory's consumed/ folder and rerun the training command",
    when_missing="that rank has not started", example={"next": 0, "run": "x"}))
DONE = register(StateFile(
    "done.json", "STREAM_DIR", writer="train/stream.py", schema={"run": str},
    rebuild="delete it", when_missing="training is still running", example={"run": "x"}))


def heartbeat_file(sdir: Path, index: int) -> tuple[Path, StateFile]:
    """Producer `index`'s heartbeat: producer.json for the first (the only one by default), producer-P.json else."""
    return (Path(sdir) / "producer.json", HEARTBEAT) if index == 0 else (Path(sdir) / f"producer-{index}.json",
                                                                         PEER_HEARTBEAT)


def read_heartbeat(sdir: Path, index: int) -> dict | None:
    return read_json_state(*heartbeat_file(sdir, index))


class StreamError(UserError, RuntimeError):
    """The stream's producer died, failed, or went silent; the message names it and what to do."""


def shard_name(a: int, b: int) -> str:
    return f"m{a:09d}-{b:09d}.safetensors"


def parse_shard_name(name: str) -> tuple[int, int] | None:
    if not (name.startswith("m") and name.endswith(".safetensors")) or "-" not in name:
        return None
    a, b = name[1:-len(".safetensors")].split("-", 1)
    return (int(a), int(b)) if a.isdigit() and b.isdigit() else None


def shard_bytes_on_disk(shards: Path) -> int:
    """Bytes of the window now: every shard file in `shards` (committed ones and a .tmp being written)."""
    total = 0
    for p in shards.glob("*.safetensors*"):
        try:
            total += p.stat().st_size
        except FileNotFoundError:  # deleted by a rank meanwhile
            pass
    return total


class StreamOrder:
    """The global micro-batches of every epoch (train/batching.py's order for global batch G) and their cut into
    shards; a pure function of the request and the records' lengths, so the producer and every rank agree."""

    def __init__(self, request: dict, lengths: list[int], per_token: int, eval_lengths: list[int] = ()):
        self.request, self.per_token = request, per_token
        self.lengths = [min(n, request["limit"]) for n in lengths]  # of the train records, in request["train"] order
        # the held-out shard stays on disk for every evaluation and counts against the window: at most half of it
        # and never so much that one optimizer step (the smallest train shard; bounded by its G x micro_batch_size
        # longest records) no longer fits beside it. The held-out records are kept in their order while they fit
        # (the rest are not evaluated in stream mode); the train shards share the rest of the window, so the
        # held-out shard + the train shards on disk <= the window (a window below one step is exceeded by that step).
        mbs = request["micro_batch_size"]
        mean_record = sum(self.record_bytes(n) for n in self.lengths) / max(1, len(self.lengths))
        self.step_bytes = request["step_size"] * mbs * mean_record  # the mean optimizer step's features
        self.window_bytes = window = window_bytes(request["window_steps"], request["window_cap_bytes"],
                                                  self.step_bytes)
        step = sum(self.record_bytes(n) for n in sorted(self.lengths, reverse=True)[:request["step_size"] * mbs])
        budget = min(window // 2, window - step) if window > step else window // 2
        self.eval_bytes, self.eval_kept = 0, []
        for k, n in enumerate(eval_lengths):
            if self.eval_bytes + self.record_bytes(n) > budget:
                break
            self.eval_bytes += self.record_bytes(n)
            self.eval_kept.append(k)
        G = request["step_size"]
        self.plan = MicroBatchPlan(self.lengths, request["micro_batch_size"], request["seed"], request["batching"],
                                   request["group_size"], world_size=1, rank=0, grad_accum=G)
        self.G, self.per_epoch = G, self.plan.global_per_epoch
        # a resume on another global batch (another world_size x grad_accum) finishes the epoch it stopped in in
        # that epoch's order (train/batching.py `segment`): request["order"] = [epoch, its G]; every epoch then
        # takes `stride` global positions (m = epoch x stride + position), the longer of the two epochs' lengths
        self.reordered = tuple(request.get("order") or ())
        self.stride = stream_stride(self.plan, request.get("order"))
        self.shard_target = max(1, (window - self.eval_bytes) // 4)  # ~4 shards: one read, others ahead
        self._epoch: tuple[int, list, list] | None = None

    def record_bytes(self, n: int) -> int:
        """A record of n tokens in a shard: its tensors and its share of the header (RECORD_HEADER_BYTES)."""
        return min(n, self.request["limit"]) * self.per_token + RECORD_HEADER_BYTES

    def epoch(self, e: int) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """(micro-batches of epoch e in global order, its shards as global micro-batch ranges [a, b))."""
        if self._epoch is None or self._epoch[0] != e:
            batches = self.plan.global_epoch(e, self.reordered[1] if self.reordered[:1] == (e,) else None)
            shards, start, size, off = [], 0, 0, e * self.stride
            for s in range(0, len(batches), self.G):
                size += sum(self.record_bytes(self.lengths[i]) for b in batches[s:s + self.G] for i in b)
                if size >= self.shard_target or s + self.G >= len(batches):
                    shards.append((off + start, off + min(s + self.G, len(batches))))
                    start, size = s + self.G, 0
            self._epoch = (e, batches, shards)
        return self._epoch[1], self._epoch[2]

    def shard_of(self, m: int) -> tuple[int, int]:
        """The shard [a, b) holding global micro-batch m."""
        _, shards = self.epoch(m // self.stride)
        return next((a, b) for a, b in shards if a <= m < b)

    def next_shard(self, m: int) -> tuple[int, int]:
        """The shard holding global position m or, past its epoch's last one, the next epoch's first shard."""
        _, shards = self.epoch(m // self.stride)
        return next(((a, b) for a, b in shards if b > m), None) or self.epoch(m // self.stride + 1)[1][0]

    def rest(self) -> list[int]:
        """Train-record positions epoch 0 leaves out (the micro-batches short of a last optimizer step): with
        train.stream_epochs=keep they are captured once more, as shard rest, for the later epochs."""
        seen = set(self.records_of(0, self.per_epoch))
        return [i for i in range(len(self.lengths)) if i not in seen]

    def records_of(self, a: int, b: int) -> list[int]:
        """Train-record positions (into request["train"]) of shard [a, b), in order."""
        batches, _ = self.epoch(a // self.stride)
        off = (a // self.stride) * self.stride
        return [i for bt in batches[a - off:b - off] for i in bt]


def window_bytes(steps: int, cap_bytes: int, step_bytes: float) -> int:
    """The stream window (bytes): `steps` optimizer steps of features of the mean step (`step_bytes`: G x
    micro_batch_size mean records), at most `cap_bytes` (train.stream_window_mb; 0 = no cap). The one formula the
    trainer, the producer and the plan use."""
    w = max(1, int(steps * step_bytes))
    return min(w, cap_bytes) if cap_bytes > 0 else w


def stream_stride(plan: MicroBatchPlan, order: list | None) -> int:
    """Global positions per epoch in the stream's numbering: the plan's epoch, or after a resume on another global
    batch (order = [epoch, the G it was ordered for]) the longer of that epoch's and the plan's."""
    if not order:
        return plan.global_per_epoch
    return max(plan.global_per_epoch, len(plan.global_epoch(order[0], order[1])))


def write_request(sdir: Path, request: dict) -> None:
    write_json_state(sdir / "request.json", request, REQUEST, indent=None)


def read_request(sdir: Path) -> dict:
    return read_json_state(sdir / "request.json", REQUEST)


def write_marker(sdir: Path, rank: int, nxt: int, run: str) -> None:
    write_json_state(sdir / "consumed" / f"rank{rank}.json", {"next": nxt, "run": run}, CONSUMED)


def min_marker(sdir: Path, world_size: int, run: str) -> int:
    """The first global micro-batch some rank of this run still needs (-1: a rank has not said yet)."""
    low = None
    for r in range(world_size):
        m = read_json_state(sdir / "consumed" / f"rank{r}.json", CONSUMED)
        if m is None or m["run"] != run:
            return -1
        low = m["next"] if low is None else min(low, m["next"])
    return -1 if low is None else low


def sweep(sdir: Path, request: dict, per_epoch: int) -> None:
    """Delete every shard all ranks are past (epoch 0's stay with train.stream_epochs=keep)."""
    low = min_marker(sdir, request["world_size"], request["run"])
    if low <= 0:
        return
    for p in (sdir / "shards").glob("m*.safetensors"):
        ab = parse_shard_name(p.name)
        if ab is None or ab[1] > low or (request["epochs"] == "keep" and ab[0] < per_epoch):
            continue
        p.unlink(missing_ok=True)


class StreamRecords:
    """The trainer's records in stream mode: ids, lengths and tokens from the tokenized records (no features), and
    `r[i]` with the features read from the stream's shards as they arrive. `seek(m)` before reading micro-batch m's
    records (global, over epochs): opens its shard, waiting for it, and moves this rank's consumed marker to m."""

    def __init__(self, tokenized, sdir: Path, timeout_s: float, rank: int, producer=None):
        self.tok, self.sdir, self.timeout_s, self.rank = tokenized, Path(sdir), timeout_s, rank
        self.ids, self.lengths = tokenized.ids, tokenized.lengths
        self.producers = [producer] if producer is not None else []  # rank 0's Popens (a dead child is seen at once)
        self.order: StreamOrder | None = None
        self.request: dict | None = None
        self.wait_s = 0.0  # seconds this rank waited for the producer
        self.meta: dict | None = None
        self._shard: tuple[tuple[int, int], ShardRecords] | None = None
        self._eval: ShardRecords | None = None
        self._kept: dict[str, ShardRecords] | None = None
        self._eval_ids: set[str] = set()
        self.eval_indices: list[int] = []  # the held-out records the window holds (StreamOrder.eval_kept)

    def __len__(self) -> int:
        return len(self.ids)

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        rec = self.tok[i]
        return rec["input_ids"], rec["loss_mask"]

    def begin(self, cfg, ctx, train_set, eval_set, plan, pos: dict, total_steps: int) -> None:
        """Rank 0 writes the request (the order, the window, where this run starts) and the resolved recipe, and
        starts the producer; every rank then reads the request and waits for the producer's meta."""
        t = cfg.train
        order = None
        if pos["order_step_size"] != plan.step_size:  # resumed on another global batch: its epoch in its order
            if t.stream_epochs == "keep":
                raise StreamError(f"train.stream_epochs=keep resumes on the same global batch only: the checkpoint's "
                                  f"epoch was ordered for {pos['order_step_size']} micro-batches per step, this run "
                                  f"has {plan.step_size}; keep world_size x train.grad_accum, or use "
                                  "train.stream_epochs=recapture")
            order = [int(pos["epoch"]), int(pos["order_step_size"])]
        stride = stream_stride(plan, order)
        start = pos["epoch"] * stride + pos["consumed"]
        end = total_steps * plan.step_size if order is None else stride * math.ceil(t.epochs)  # an upper bound
        if ctx.is_main:
            self.wait_for_old_producer()
            for stale in ("producer.error", "done.json", *(p.name for p in self.sdir.glob("producer*.json"))):
                (self.sdir / stale).unlink(missing_ok=True)
            (self.sdir / "consumed").mkdir(parents=True, exist_ok=True)
            request = {"run": new_run_token(), "step_size": plan.step_size, "micro_batch_size": t.micro_batch_size,
                       "seed": int(cfg.seed), "batching": t.batching, "group_size": t.group_size,
                       "window_steps": int(t.stream_window_steps),
                       "window_cap_bytes": int(t.stream_window_mb * 2**20), "epochs": t.stream_epochs,
                       "train": [int(i) for i in train_set.indices],
                       "eval": [int(i) for i in eval_set.indices][: t.eval_max_records or None],  # what is evaluated
                       "limit": int(train_set.max_length or max(self.lengths)), "start": start,
                       "end": end, "world_size": ctx.world_size,
                       "tokenized": str(Path(self.tok.path).resolve())}
            if order is not None:  # absent otherwise: a same-batch resume keeps the shards of the same order
                request["order"] = order
            if t.stream_producers > 1:  # absent otherwise: one producer, the order identity of earlier runs
                request["producers"] = int(t.stream_producers)
            write_request(self.sdir, request)
            (self.sdir / "recipe.yaml").write_text(config_yaml(cfg))
            for index in range(int(t.stream_producers)):
                log = open(self.sdir / ("producer.log" if index == 0 else f"producer-{index}.log"), "ab")
                self.producers.append(subprocess.Popen(
                    [sys.executable, "-m", "train.stream_producer", "--recipe", str(self.sdir / "recipe.yaml"),
                     "--parent-pid", str(os.getpid()), "--index", str(index)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
                log.close()
        if ctx.world_size > 1:
            barrier()
        self.start(read_request(self.sdir))

    def wait_for_old_producer(self) -> None:
        """One producer per stream directory: the one an earlier (killed) trainer started exits once it sees its
        trainer gone, at the latest after the shard it is capturing; wait for that before starting a new one."""
        tic = time.perf_counter()
        for path in sorted(self.sdir.glob("producer*.json")):
            index = 0 if path.name == "producer.json" else int(path.stem.split("-")[1])
            beat = read_heartbeat(self.sdir, index)
            if beat is None or beat["pid"] == os.getpid():
                continue
            while alive(beat["pid"]):
                if time.perf_counter() - tic > self.timeout_s:
                    raise StreamError(f"the stream producer of an earlier run (pid {beat['pid']}) still runs on "
                                      f"{self.sdir} after train.stream_timeout_s={self.timeout_s:g} s: end it, then "
                                      "rerun")
                time.sleep(POLL_S)

    def stop(self, finished: bool) -> None:
        """The end of this rank's run (or its failure): rank 0 says done and ends the producer it started."""
        if finished and self.request is not None:
            self.finish()
            if self.request["world_size"] > 1:
                barrier()  # the producer stops once every rank has read its last shard
        if not self.producers:
            return
        if self.request is not None:
            try:
                mark_done(self.sdir, self.request["run"])
            except OSError:
                pass
        for producer in self.producers:
            try:
                producer.wait(timeout=10)
            except subprocess.TimeoutExpired:
                producer.kill()
                producer.wait()
        self.producers = []
        if finished:  # every rank has read everything: the held-out and kept shards go too
            for p in (self.sdir / "shards").glob("*.safetensors"):
                p.unlink(missing_ok=True)

    def summary(self, world_size: int) -> dict:
        """Who waited for whom: the trainer's wait (mean over ranks) and the producers' (mean over producers), with
        their throughput (records/s: the sum of each producer's records over its capture seconds)."""
        trainer_wait = all_reduce_sum([self.wait_s])[0] / world_size
        beats = self.producer_stats()
        p = {k: sum(b[k] for b in beats) for k in ("wait_s", "capture_s", "records", "tokens")}
        p["wait_s"] /= len(beats)
        p["peak_bytes"] = max(b["peak_bytes"] for b in beats)
        return {"trainer_wait_s": trainer_wait, "producer_wait_s": p["wait_s"], "producer_capture_s": p["capture_s"],
                "producer_records": p["records"], "producers": len(beats),
                "producer_records_per_s": sum(b["records"] / max(b["capture_s"], 1e-9) for b in beats),
                "window_peak_bytes": p["peak_bytes"], "window_bytes": self.order.window_bytes,
                "window_steps": self.request["window_steps"],
                "bottleneck": "producer (scale the engine)" if trainer_wait > p["wait_s"] else "trainer (scale the ranks)"}

    def start(self, request: dict) -> None:
        """Use the request rank 0 wrote (the same on every rank); this rank needs nothing before request["start"]."""
        self.request = request
        self.meta = self.wait_for(self._stream_meta, "the producer's stream.json")
        per_token = bytes_per_token(int(self.meta["meta"]["hidden_size"]), self.meta["dtype"],
                                    segments_of(self.meta["meta"]))
        self.order = StreamOrder(request, [self.lengths[i] for i in request["train"]], per_token,
                                 [self.lengths[i] for i in request["eval"]])
        self.eval_indices = [request["eval"][k] for k in self.order.eval_kept]  # what the window holds of them
        self._eval_ids = {self.ids[i] for i in self.eval_indices}
        write_marker(self.sdir, self.rank, request["start"], request["run"])

    def _stream_meta(self) -> dict | None:
        meta = read_json_state(self.sdir / "stream.json", STREAM_META)
        return meta if meta is not None and meta["run"] == self.request["run"] else None

    # ------------------------------------------------------------------ waiting
    def check_producer(self) -> None:
        """One line when the producer failed, exited, or stopped beating for train.stream_timeout_s."""
        err = read_text_state(self.sdir / "producer.error", PRODUCER_ERROR)
        if err:
            raise StreamError(f"stream producer failed: {err.removeprefix('error: ')}")
        for producer in self.producers:
            if producer.poll() is not None:
                raise StreamError(f"stream producer (pid {producer.pid}) exited with code {producer.returncode} "
                                  "before training had all its features; rerun the same command to resume (nothing "
                                  "consumed is captured again)")
        for index in range(self.request.get("producers", 1) if self.request else 1):
            beat = read_heartbeat(self.sdir, index)
            if beat is None or (self.request and beat["run"] != self.request["run"]):
                continue  # not started yet: the timeout of wait_for counts
            silent = time.time() - beat["time"]
            if silent > self.timeout_s:
                raise StreamError(f"stream producer (pid {beat['pid']}) silent for {silent:.0f} s > "
                                  f"train.stream_timeout_s={self.timeout_s:g}: it is dead or hung; rerun the same "
                                  "command to resume")

    def wait_for(self, ready, what: str):
        """ready() until it is not None, counting the wait; StreamError when the producer is dead or never came."""
        got = ready()
        if got is not None:
            return got
        tic = time.perf_counter()
        while (got := ready()) is None:
            self.check_producer()
            if time.perf_counter() - tic > self.timeout_s and \
                    read_json_state(self.sdir / "producer.json", HEARTBEAT) is None:
                raise StreamError(f"no stream producer wrote {what} in {self.sdir} within train.stream_timeout_s="
                                  f"{self.timeout_s:g} s; rerun the same command to resume")
            time.sleep(POLL_S)
        self.wait_s += time.perf_counter() - tic
        return got

    def _open(self, name: str) -> ShardRecords | None:
        path = self.sdir / "shards" / name
        return ShardRecords(path) if path.exists() else None

    # ------------------------------------------------------------------ reading
    def seek(self, m: int) -> None:
        """Make global micro-batch m's records readable (its shard, or epoch 0's kept copy); mark m as this rank's
        next need."""
        order = self.order
        write_marker(self.sdir, self.rank, m, self.request["run"])
        if m >= self.request["end"] and self.producers:
            # skipped (non-finite) micro-batches moved the data past the planned end: rank 0 asks for more (every
            # rank skips together, so the others need the same shards)
            self.request = {**self.request, "end": m + 16 * order.G}
            write_request(self.sdir, self.request)
        sweep(self.sdir, self.request, order.per_epoch)
        if self.request["epochs"] == "keep" and m >= order.per_epoch:
            if self._kept is None:
                names = [shard_name(a, b) for a, b in order.epoch(0)[1]] + ([REST_SHARD] if order.rest() else [])
                self._kept = {}
                for name in names:
                    s = self.wait_for(lambda: self._open(name), f"epoch 0's kept shard {name}")
                    self._kept.update({rid: s for rid in s.ids})
            self._shard = None
            return
        ab = order.shard_of(m)
        if self._shard is None or self._shard[0] != ab:
            self._shard = (ab, self.wait_for(lambda: self._open(shard_name(*ab)), f"shard {shard_name(*ab)}"))

    def finish(self) -> None:
        """This rank needs nothing more; rank 0 then tells the producer it is done."""
        write_marker(self.sdir, self.rank, 2**62, self.request["run"])
        sweep(self.sdir, self.request, self.order.per_epoch)

    def __getitem__(self, i: int) -> dict:
        rid = self.ids[i]
        if rid in self._eval_ids:
            if self._eval is None:
                self._eval = self.wait_for(lambda: self._open(EVAL_SHARD), "the held-out records' shard")
            return self._eval[rid]
        if self._kept is not None and self._shard is None:
            return self._kept[rid][rid]
        if self._shard is None or rid not in self._shard[1]:
            raise StreamError(f"record {rid!r} is not in stream shard {self._shard and self._shard[1].path}: the "
                              "stream directory holds another run's shards; delete it and rerun")
        return self._shard[1][rid]

    def producer_stats(self) -> list[dict]:
        """Every producer's last heartbeat numbers (zeros for one that never beat)."""
        beats = [read_heartbeat(self.sdir, i) or {} for i in range(self.request.get("producers", 1))]
        return [{k: b.get(k, 0) for k in ("wait_s", "capture_s", "records", "tokens", "peak_bytes")} for b in beats]


def alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine (a zombie child counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def mark_done(sdir: Path, run: str) -> None:
    write_json_state(Path(sdir) / "done.json", {"run": run}, DONE)


def is_done(sdir: Path, run: str) -> bool:
    d = read_json_state(Path(sdir) / "done.json", DONE)
    return d is not None and d["run"] == run


def new_run_token() -> str:
    return os.urandom(6).hex()
