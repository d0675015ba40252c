"""The producer of stream mode (train/stream.py): the recipe's target captures the features of the records in the
order the trainer consumes them and writes them as shards into the window, waiting while the window is full. Rank 0 of the trainer starts it (`python -m train.stream_producer --recipe STREAM_DIR/recipe.yaml`,
the run's resolved recipe); it exits when the trainer is done or gone.

What computes the states is train.stream_producer, one capture object per kind (train/stream_capture.py: `hf` =
transformers, one forward per record as data prep's cache stage, bit for bit the offline cache's; `vllm` = a vLLM
server this process starts and stops, capturing as data.feature_source=vllm does, the offline-from-vLLM cache's
features); the loop here (window, waits, heartbeat, resume) is the same for both. Features are stored in
data.cache_dtype in the one shard format (data_prep/feature_shard.py). A failure (a full disk above all) is one line in producer.error, which the trainer
prints; the shard being written is not left behind, nothing consumed is lost, and a rerun resumes.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

from data_prep.feature_cache import CACHE_DTYPES, bytes_per_token, quantize_int8, segments_of
from data_prep.feature_shard import write_shard
from eagle.cli_errors import ArgumentParser, one_line, one_line_errors
from eagle.state_files import read_json_state, write_json_state, write_text_state
from recipes import add_print_config, command_config, layout
from train.data import TokenizedRecords
from train.stream_capture import capture_for
from train.stream import (EVAL_SHARD, HEARTBEAT_S, POLL_S, PRODUCER_ERROR, REST_SHARD, STREAM_META, StreamError,
                          StreamOrder, heartbeat_file, is_done, min_marker, read_request, shard_bytes_on_disk,
                          shard_name, sweep)


def order_identity(request: dict, meta: dict, dtype: str) -> str:
    """What the shards' content depends on (not the run token, start or world size): shards of another identity
    in the directory are another run's and are deleted."""
    keep = {k: v for k, v in request.items() if k not in ("run", "start", "end", "world_size")}
    return hashlib.sha256(json.dumps([keep, meta, dtype], sort_keys=True).encode()).hexdigest()[:16]


class Producer:
    def __init__(self, cfg, sdir: Path, parent_pid: int | None = None, index: int = 0):
        self.cfg, self.sdir, self.parent_pid, self.index = cfg, Path(sdir), parent_pid, index
        self.request = read_request(self.sdir)
        self.producers = int(self.request.get("producers", 1))  # shard k of the order is producer k mod N's
        self.run = self.request["run"]
        self.shards = self.sdir / "shards"
        self.stats = {"wait_s": 0.0, "capture_s": 0.0, "records": 0, "tokens": 0, "peak_bytes": 0}
        self.state = "loading"
        self._stop = threading.Event()

    # ------------------------------------------------------------------ heartbeat
    def beat(self) -> None:
        path, spec = heartbeat_file(self.sdir, self.index)
        write_json_state(path, {"time": time.time(), "pid": os.getpid(), "state": self.state, "run": self.run,
                                **self.stats}, spec)

    def _beating(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.beat()
            except OSError:  # a full disk: the main thread reports it when its shard fails
                pass

    def trainer_gone(self) -> bool:
        return is_done(self.sdir, self.run) or (self.parent_pid is not None and os.getppid() != self.parent_pid)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        self.tok = TokenizedRecords(self.request["tokenized"], cfg.data.max_length)
        self.capture = capture_for(cfg, self.sdir, self.index)
        self.state = "loading (" + self.capture.what + ")"
        meta = self.capture.open()
        self.dtype = cfg.data.cache_dtype
        self.segments = segments_of(meta)
        self.per_token = bytes_per_token(meta["hidden_size"], self.dtype, self.segments)
        if self.index == 0:  # the first producer owns the directory: the others wait for its stream.json
            ident = order_identity(self.request, meta, self.dtype)
            old = read_json_state(self.sdir / "stream.json", STREAM_META)
            if old is not None and old.get("meta", {}).get("order") != ident and self.shards.is_dir():
                shutil.rmtree(self.shards)  # another recipe's or data's shards
            self.shards.mkdir(parents=True, exist_ok=True)
            for tmp in self.shards.glob("*.tmp"):
                tmp.unlink(missing_ok=True)  # a write a kill interrupted
            write_json_state(self.sdir / "stream.json", {"meta": {**meta, "order": ident}, "dtype": self.dtype,
                                                         "run": self.run}, STREAM_META)
        else:
            self.state = "waiting (for producer 0's stream.json)"
            while not self.trainer_gone():
                old = read_json_state(self.sdir / "stream.json", STREAM_META)
                if old is not None and old["run"] == self.run:
                    break
                time.sleep(POLL_S)
        self.order = StreamOrder(self.request, [self.tok.lengths[i] for i in self.request["train"]], self.per_token,
                                 [self.tok.lengths[i] for i in self.request["eval"]])
        self.limit = self.request["limit"]

    # ------------------------------------------------------------------ capture
    def records(self, indices: list[int]) -> list[tuple]:
        """(id, input_ids, stored hidden, loss_mask, scales) of tokenized records `indices`, as the offline cache
        stores them; the capture object computes their states together (a server batches them)."""
        recs = [self.tok[i] for i in indices]
        ids = [r["input_ids"][: self.limit] for r in recs]
        states = self.capture.states([r["id"] for r in recs], [x.tolist() for x in ids])
        return [self.stored(r, x, h) for r, x, h in zip(recs, ids, states)]

    def stored(self, rec: dict, ids: torch.Tensor, hidden: torch.Tensor) -> tuple:
        mask = rec["loss_mask"][: self.limit]
        hidden = hidden.detach().cpu()  # [T, W]
        scales = None
        if self.dtype == "int8":
            stored, scales = quantize_int8(hidden, self.segments)
        else:
            stored = hidden.to(CACHE_DTYPES[self.dtype])
        self.stats["records"] += 1
        self.stats["tokens"] += int(ids.shape[0])
        return rec["id"], ids.to(torch.int32), stored.contiguous(), mask.to(torch.uint8), scales

    def write(self, name: str, indices: list[int], window: bool = True, span: tuple[int, int] | None = None,
              after: tuple[int, int] | None = None) -> None:
        """Capture records `indices` (into the tokenized records) and write them as shard `name`, after waiting for
        room in the window (when `window`; a window holding no train shard always takes the next one, and so does the
        shard `span` = [a, b) that the slowest rank waits for: after a resume, shards kept from the killed run may fill
        the window ahead of the one the checkpoint needs first). With several producers, `after` = the shard before
        this one in the order (another producer's): this one is captured meanwhile, and written once that one is on
        disk or consumed and there is room again, so the window fills in the order's sequence and stays bounded."""
        path = self.shards / name
        if path.exists():
            return  # kept from an earlier run of the same order: not captured again
        size = sum(self.order.record_bytes(self.tok.lengths[i]) for i in indices)
        if window:
            self.wait_for_room(size, span)
        if self.trainer_gone():
            return
        self.state = "capturing"
        tic = time.perf_counter()
        records = self.records(indices)
        self.stats["capture_s"] += time.perf_counter() - tic
        if window and after is not None:
            self.wait_for_turn(after)
            self.wait_for_room(size, span)
        if self.trainer_gone():  # killed meanwhile: a rerun's producer owns the directory now
            return
        try:
            write_shard(path, records, self.dtype)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            free = shutil.disk_usage(self.shards).free / 2**20
            raise StreamError(f"disk full writing stream shard {path} ({free:.0f} MiB free): free space or lower "
                              "train.stream_window_steps (or cap it: train.stream_window_mb), then rerun the same command (nothing consumed is lost; "
                              "this shard is captured again)") from None
        self.stats["peak_bytes"] = max(self.stats["peak_bytes"], shard_bytes_on_disk(self.shards))

    def wait_for_room(self, size: int, span: tuple[int, int] | None) -> None:
        tic = time.perf_counter()
        self.state = "waiting (window full)"
        while not self.trainer_gone():
            sweep(self.sdir, self.request, self.order.per_epoch)  # what every rank is past goes before measuring
            used = shard_bytes_on_disk(self.shards)
            trains = any(p.name.startswith("m") for p in self.shards.glob("m*.safetensors"))
            if not trains or used + size <= self.order.window_bytes:
                break
            low = min_marker(self.sdir, self.request["world_size"], self.run)
            if span is not None and span[0] <= low < span[1]:
                break
            time.sleep(POLL_S)
        self.stats["wait_s"] += time.perf_counter() - tic

    def wait_for_turn(self, before: tuple[int, int]) -> None:
        """Until shard `before` (another producer's) is on disk or every rank is past it."""
        tic = time.perf_counter()
        self.state = "waiting (for the shard before, another producer's)"
        while not self.trainer_gone():
            if (self.shards / shard_name(*before)).exists() or \
                    min_marker(self.sdir, self.request["world_size"], self.run) >= before[1]:
                break
            time.sleep(POLL_S)
        self.stats["wait_s"] += time.perf_counter() - tic

    def produce(self) -> None:
        req, order = self.request, self.order
        train = req["train"]
        first = self.index == 0  # the held-out and the rest shard are the first producer's
        if order.eval_kept and first:  # held out: read at every evaluation, kept; at most half the window (StreamOrder)
            self.write(EVAL_SHARD, [req["eval"][k] for k in order.eval_kept], window=False)
        a, _ = order.next_shard(req["start"])
        m, k, before = a, 0, None  # k: the shard's place in the order from the start; before: the one before it
        while not self.trainer_gone():
            if req["epochs"] == "keep" and m >= order.per_epoch:
                if order.rest() and first:
                    self.write(REST_SHARD, [train[i] for i in order.rest()], window=False)
                break
            if m >= req["end"]:
                req = self.request = {**req, "end": read_request(self.sdir)["end"]}  # a trainer that skipped needs more
                if m >= req["end"]:
                    self.state = "idle (all captured)"
                    time.sleep(POLL_S * 4)
                    continue
            a, b = order.next_shard(m)
            if a >= req["end"]:
                m = a
                continue
            if k % self.producers == self.index:
                self.write(shard_name(a, b), [train[i] for i in order.records_of(a, b)],
                           window=req["epochs"] != "keep", span=(a, b),  # keep: epoch 0 stays whole on disk, never deleted
                           after=before if self.producers > 1 else None)
            m, k, before = b, k + 1, (a, b)
        self.state = "idle (all captured)"
        while not self.trainer_gone():  # the last shards are read: the heartbeat keeps saying it is alive
            sweep(self.sdir, self.request, self.order.per_epoch)
            time.sleep(POLL_S * 4)

    def run_all(self) -> None:
        thread = threading.Thread(target=self._beating, daemon=True)
        self.beat()
        thread.start()
        try:
            self.setup()
            self.produce()
            sweep(self.sdir, self.request, self.order.per_epoch)
        finally:
            if getattr(self, "capture", None) is not None:
                self.capture.close()  # a server this process started is stopped on every exit
            self._stop.set()
            self.state = "stopped"
            try:
                self.beat()
            except OSError:
                pass


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m train.stream_producer", description=__doc__)
    p.add_argument("--recipe", required=True)
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the trainer) is gone")
    p.add_argument("--index", type=int, default=0, help="this producer's number of train.stream_producers (it writes "
                   "shards k with k mod N = index)")
    add_print_config(p)
    args = p.parse_args(argv)
    cfg = command_config(args)
    sdir = layout.stream_dir(cfg)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    producer = Producer(cfg, sdir, args.parent_pid, args.index)
    try:
        producer.run_all()
    except BaseException as e:
        try:
            current = read_request(sdir)["run"] == producer.run
        except Exception:  # noqa: BLE001 - unreadable: report anyway
            current = True
        if not current:  # a newer run took the directory over (this one's trainer was killed): nothing to say
            return 0
        if not isinstance(e, (SystemExit, KeyboardInterrupt)):
            try:
                write_text_state(sdir / "producer.error", "error: " + one_line(e), PRODUCER_ERROR)
            except OSError:
                pass
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
