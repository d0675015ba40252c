"""Stream mode (train.mode=stream, train/stream.py + train/stream_producer.py): a producer process captures the
features into a bounded window while the trainer consumes them. A streamed run trains the same head, bit for bit,
as an offline run of the same recipe on the cache the offline path writes for the same records; the window stays
bounded and is emptied; both sides' waits are reported; a dead producer and a full disk are one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from test_train_helpers import REPO, gloo_world, overrides, save_target, subprocess_env, toy_sequences

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

N_RECORDS, STEPS = 40, 12  # 36 train records / 4 per micro-batch = 9 steps per epoch: the run crosses into epoch 2


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A tiny target and tokenized records (ids + loss masks), the stream's input."""
    from data_prep.tokenized import write_tokenized

    root = tmp_path_factory.mktemp("stream")
    target = save_target(root / "target")
    recs = [{"id": f"t{i:03d}", "input_ids": s.tolist(), "loss_mask": [0, 0] + [1] * (len(s) - 2)}
            for i, s in enumerate(toy_sequences(N_RECORDS, seed=3))]
    write_tokenized(root / "tok.jsonl", recs)
    return {"root": root, "target": target, "tok": root / "tok.jsonl", "records": recs}


@pytest.fixture(scope="module")
def dist_ctx():
    with gloo_world() as ctx:
        yield ctx


def config(toy, out, *extra):
    from recipes import load_config

    return load_config("tiny", overrides(toy["target"], out, f"train.tokenized={toy['tok']}", "train.eval_every=5",
                                         *extra, steps=STEPS))


def offline_cache(cfg, records) -> None:
    """The feature cache data prep's cache stage writes for these records (its `cache_shard`, its meta)."""
    from data_prep.cache_features import cache_shard
    from data_prep.feature_cache import FeatureCacheWriter
    from data_prep.target import load_target_model, resolve_target_path, target_config_hash
    from eagle.device import pick_device
    from recipes import layout

    model = load_target_model(cfg.target, pick_device(cfg.data.device), resolve_target_path(cfg.target))
    meta = {"target": resolve_target_path(cfg.target), "config_hash": target_config_hash(model.config),
            "hidden_size": int(model.config.hidden_size), "vocab_size": int(model.config.vocab_size),
            "target_dtype": cfg.target.dtype}
    writer = FeatureCacheWriter(layout.cache_dir(cfg), meta, dtype=cfg.data.cache_dtype)
    cache_shard(model, records, writer, 0, 1, progress=False)
    writer.close()


def head_weights(out):
    return load_file(str(out / "head" / "model.safetensors"))


def stream_beside_offline(toy, tmp_path, ctx, *stream_overrides: str) -> tuple[dict, dict, object]:
    """An offline run (off/: the cache, then training) and a stream run (st/, `stream_overrides`) of the same recipe;
    asserts the streamed head is the offline head bit for bit. Returns both summaries and the stream run's config."""
    from train.main import train

    off = config(toy, tmp_path / "off")
    offline_cache(off, toy["records"])
    s_off = train(off, ctx)
    st = config(toy, tmp_path / "st", "train.mode=stream", *stream_overrides)
    s_st = train(st, ctx)
    a, b = head_weights(tmp_path / "off"), head_weights(tmp_path / "st")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), "streamed head differs from offline"
    return s_off, s_st, st


def test_streamed_run_equals_offline_bit_for_bit_within_a_bounded_window(toy, tmp_path, dist_ctx):
    window_mb = 0.03  # ~31 KiB: half of the toy's ~60 KiB per epoch
    s_off, s_st, _ = stream_beside_offline(toy, tmp_path, dist_ctx, f"train.stream_window_mb={window_mb}")
    assert s_st["eval"] == s_off["eval"] and s_st["train_tokens"] == s_off["train_tokens"]
    stream = s_st["stream"]
    assert 0 < stream["window_peak_bytes"] <= window_mb * 2**20
    need = STEPS * 4 + s_st["eval_records"]  # epoch 2 captured again; beyond the last step at most the rest of a shard
    assert need <= stream["producer_records"] <= need + 8
    assert {"trainer_wait_s", "producer_wait_s", "bottleneck"} <= stream.keys()
    shards = tmp_path / "st" / "train" / "stream" / "shards"
    assert not list(shards.glob("*.safetensors*")), "consumed shards are deleted, the held-out ones at the end"


def test_the_held_out_shard_counts_against_the_window(toy, tmp_path, dist_ctx):
    """A window too small for all held-out records beside one optimizer step: the held-out shard keeps the first
    ones that fit (a line says how many), the train shards share the rest, and the peak on disk stays <= the window;
    training itself is untouched (the offline head, bit for bit)."""
    window_mb = 0.027  # ~28 KiB: the longest step (4 records, ~22 KiB) + not all 4 held-out records (~9 KiB)
    s_off, s_st, _ = stream_beside_offline(toy, tmp_path, dist_ctx, f"train.stream_window_mb={window_mb}")
    assert 0 < s_st["eval_records"] < s_off["eval_records"]
    assert 0 < s_st["stream"]["window_peak_bytes"] <= window_mb * 2**20


def test_the_default_window_is_counted_in_optimizer_steps(toy, tmp_path, dist_ctx):
    """No train.stream_window_mb: the window is train.stream_window_steps (default 8) mean optimizer steps of
    features (G x micro_batch_size records of the train records' mean size), below the whole cache here, and the
    peak on disk stays within it; training is untouched (the offline head, bit for bit)."""
    from data_prep.feature_cache import bytes_per_token
    from data_prep.feature_shard import RECORD_HEADER_BYTES
    from recipes import load_config

    assert load_config("tiny").train.stream_window_steps == 8 and load_config("tiny").train.stream_window_mb == 0
    _, s_st, st = stream_beside_offline(toy, tmp_path, dist_ctx, "train.stream_window_steps=3")
    sdir = tmp_path / "st" / "train" / "stream"
    request = json.loads((sdir / "request.json").read_text())
    hidden = json.loads((sdir / "stream.json").read_text())["meta"]["hidden_size"]
    per_token = bytes_per_token(hidden, st.data.cache_dtype)
    per_record = [min(len(toy["records"][i]["input_ids"]), request["limit"]) * per_token + RECORD_HEADER_BYTES
                  for i in request["train"]]
    assert request["step_size"] == 1 and request["micro_batch_size"] == 4  # 1 rank x grad_accum 1
    step = 4 * sum(per_record) / len(per_record)
    stream = s_st["stream"]
    assert stream["window_steps"] == 3 and stream["window_bytes"] == int(3 * step)
    cache = sum(p.stat().st_size for p in (tmp_path / "off" / "data" / "features" / "shards").glob("*.safetensors"))
    assert 0 < stream["window_peak_bytes"] <= stream["window_bytes"] < cache


def test_several_producers_stream_the_offline_head(toy, tmp_path, dist_ctx):
    """train.stream_producers=2: shard k is producer k mod 2's, both capture, the shards land in the order's
    sequence within the window, and the head is the offline one bit for bit."""
    window_mb = 0.03
    _, s_st, _ = stream_beside_offline(toy, tmp_path, dist_ctx, f"train.stream_window_mb={window_mb}",
                                       "train.stream_producers=2")
    sdir = tmp_path / "st" / "train" / "stream"
    beats = [json.loads((sdir / name).read_text()) for name in ("producer.json", "producer-1.json")]
    assert all(beat["records"] > 0 for beat in beats) and beats[0]["pid"] != beats[1]["pid"]
    stream = s_st["stream"]
    assert stream["producers"] == 2 and stream["producer_records"] == sum(beat["records"] for beat in beats)
    need = STEPS * 4 + s_st["eval_records"]
    assert need <= stream["producer_records"] <= need + 8  # nothing captured twice
    assert 0 < stream["window_peak_bytes"] <= window_mb * 2**20
    assert not list((sdir / "shards").glob("*.safetensors*"))


@pytest.mark.slow
def test_keep_mode_rereads_epoch_one(toy, tmp_path, dist_ctx):
    _, s_st, _ = stream_beside_offline(toy, tmp_path, dist_ctx, "train.stream_epochs=keep")
    assert s_st["stream"]["producer_records"] == N_RECORDS  # each record captured once


def assert_offline_head(toy, tmp_path, out) -> None:
    """The head a rerun after a kill streamed into `out` is bit for bit the head of an offline run."""
    with gloo_world() as ctx:
        from train.main import train

        off = config(toy, tmp_path / "off")
        offline_cache(off, toy["records"])
        train(off, ctx)
    a, b = head_weights(tmp_path / "off"), head_weights(out)
    assert all((a[k] == b[k]).all() for k in a), "the resumed streamed head differs from offline"


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["", "step-00000006"])  # before the first checkpoint; at step 6 of 12
def test_dead_producer_is_one_line_and_a_rerun_resumes(toy, tmp_path, tag):
    """kill -9 of the producer at two points (after 4 captured records; at the trainer's checkpoint `tag`): the trainer stops with one line within
    train.stream_timeout_s; the same command then resumes from the last checkpoint (or the start) and trains the
    offline head, bit for bit."""
    out = tmp_path / "st"
    args = [sys.executable, str(REPO / "train" / "main.py"), "--recipe", "tiny",
            *overrides(toy["target"], out, f"train.tokenized={toy['tok']}", "train.eval_every=5", "train.mode=stream",
                       "train.stream_window_mb=0.01", "train.checkpoint_every=2", "train.stream_timeout_s=20",
                       steps=STEPS)]
    proc = subprocess.Popen(args, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    beat, latest = out / "train" / "stream" / "producer.json", out / "train" / "checkpoints" / "latest"
    deadline = time.time() + 120
    while time.time() < deadline:  # the producer has written some shards (and the trainer checkpointed `tag`)
        if beat.exists() and json.loads(beat.read_text() or "{}").get("records", 0) >= 4 and (
                not tag or (latest.exists() and latest.read_text().strip() >= tag)):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the producer never reported 4 captured records (or no checkpoint {tag!r})")
    pid = json.loads(beat.read_text())["pid"]
    subprocess.run(["kill", "-9", str(pid)], check=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: stream producer") and "rerun the same command" in lines[-1], err
    assert sum(ln.startswith("error:") for ln in lines) == 1
    rerun = subprocess.run(args, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "resumed from" in rerun.stdout or json.loads((out / "train" / "summary.json").read_text())["steps"] == STEPS
    assert_offline_head(toy, tmp_path, out)


def test_full_disk_is_one_line_and_leaves_no_partial_shard(toy, tmp_path, monkeypatch):
    """The producer's shard write hits ENOSPC: one line in producer.error naming the shard, no .tmp left behind."""
    import errno

    import train.stream_producer as sp

    calls = {"n": 0}
    real = sp.write_shard

    def full_after_one(path, records, dtype):
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, records, dtype)

    monkeypatch.setattr(sp, "write_shard", full_after_one)
    cfg = config(toy, tmp_path / "st", "train.mode=stream", "train.stream_window_mb=1")  # no wait: no trainer here
    from recipes import layout
    from train.stream import write_request

    sdir = layout.stream_dir(cfg)
    (sdir / "consumed").mkdir(parents=True)
    write_request(sdir, {"run": "r1", "step_size": 1, "micro_batch_size": 4, "seed": int(cfg.seed),
                         "batching": "grouped", "group_size": 32, "window_steps": 8, "window_cap_bytes": 2**14,
                         "epochs": "recapture",
                         "train": list(range(36)), "eval": [36, 37], "limit": 512, "start": 0, "end": 9,
                         "world_size": 1, "tokenized": str(toy["tok"])})
    (sdir / "recipe.yaml").write_text(__import__("recipes").config_yaml(cfg))
    code = sp.main(["--recipe", str(sdir / "recipe.yaml")])
    assert code == 2
    err = (sdir / "producer.error").read_text()
    assert err.startswith("error: disk full writing stream shard") and "\n" not in err.strip() and "rerun" in err
    assert not list((sdir / "shards").glob("*.tmp"))
    assert [p.name for p in (sdir / "shards").iterdir()] == ["eval.safetensors"]  # written before: valid, kept


@pytest.mark.slow
@pytest.mark.parametrize("when", ["after_first_checkpoint", "late"])
def test_killed_trainer_reruns_to_the_offline_head(toy, tmp_path, when):
    """kill -9 of the trainer (the producer then exits on its own): the same command resumes from the checkpoint, the
    producer captures only the shards after it that are not on disk, and the head is the offline one, bit for bit."""
    out = tmp_path / "st"
    args = [sys.executable, str(REPO / "train" / "main.py"), "--recipe", "tiny",
            *overrides(toy["target"], out, f"train.tokenized={toy['tok']}", "train.eval_every=5", "train.mode=stream",
                       "train.stream_window_mb=0.03", "train.checkpoint_every=2", steps=STEPS)]
    proc = subprocess.Popen(args, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    latest = out / "train" / "checkpoints" / "latest"
    tag = "step-00000002" if when == "after_first_checkpoint" else "step-00000008"
    deadline = time.time() + 200
    while time.time() < deadline and not (latest.exists() and latest.read_text().strip() >= tag):
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)
    beat = json.loads((out / "train" / "stream" / "producer.json").read_text())
    proc.kill()
    proc.wait()
    from train.stream import alive

    deadline = time.time() + 60
    while alive(beat["pid"]) and time.time() < deadline:  # the orphaned producer sees its trainer gone
        time.sleep(0.05)
    assert not alive(beat["pid"]), "the producer outlived its trainer"
    rerun = subprocess.run(args, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "resumed from" in rerun.stdout
    summary = json.loads((out / "train" / "summary.json").read_text())
    assert_offline_head(toy, tmp_path, out)
    assert summary["stream"]["producer_records"] < STEPS * 4 + summary["eval_records"]  # the consumed part is not redone


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_torchrun_ranks_consume_the_stream_as_they_read_the_cache(toy, tmp_path):
    """2 ranks under torchrun: each reads its micro-batches of every shard, a shard goes once both markers are past
    it, and the head equals the 2-rank offline run's, bit for bit."""
    import socket

    def torchrun(out, *extra):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               str(REPO / "train" / "main.py"), "--recipe", "tiny",
               *overrides(toy["target"], out, f"train.tokenized={toy['tok']}", "train.eval_every=5", *extra,
                          steps=6)]
        proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads((out / "train" / "summary.json").read_text())

    off = config(toy, tmp_path / "off")
    offline_cache(off, toy["records"])
    torchrun(tmp_path / "off")
    summary = torchrun(tmp_path / "st", "train.mode=stream", "train.stream_window_mb=0.06")  # > eval + one 2-rank step
    a, b = head_weights(tmp_path / "off"), head_weights(tmp_path / "st")
    assert all((a[k] == b[k]).all() for k in a), "2-rank streamed head differs from the 2-rank offline head"
    sdir = tmp_path / "st" / "train" / "stream"
    assert {p.name for p in (sdir / "consumed").iterdir()} == {"rank0.json", "rank1.json"}
    assert not list((sdir / "shards").glob("*.safetensors"))
    assert summary["world_size"] == 2 and 0 < summary["stream"]["window_peak_bytes"] <= 0.06 * 2**20


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the trainer process of global rank `rank` among the children of torchrun's agent `launcher_pid`."""
    from pathlib import Path

    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return int(child)
    return None


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("rank,tag", [(1, "step-00000002"), (0, "step-00000004")])
def test_kill_of_one_rank_of_two_reruns_to_the_offline_head(toy, tmp_path, rank, tag):
    """kill -9 of ONE rank of a 2-rank stream run under torchrun (rank 1 after the first checkpoint, rank 0 -- the
    producer's parent -- after the second): torchrun ends the other rank, the orphaned producer exits on its own, and
    the same command again resumes from the last checkpoint and trains the 2-rank offline head bit for bit (nothing
    lost, nothing twice), capturing less than a whole run."""
    import socket

    def torchrun(out, *extra):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
                str(REPO / "train" / "main.py"), "--recipe", "tiny",
                *overrides(toy["target"], out, f"train.tokenized={toy['tok']}", "train.eval_every=5",
                           "train.checkpoint_every=2", *extra, steps=6)]

    off = config(toy, tmp_path / "off")
    offline_cache(off, toy["records"])
    done = subprocess.run(torchrun(tmp_path / "off"), env=subprocess_env(), capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    out = tmp_path / "st"
    stream = ("train.mode=stream", "train.stream_window_mb=0.06", "train.stream_timeout_s=30")
    proc = subprocess.Popen(torchrun(out, *stream), env=subprocess_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    latest = out / "train" / "checkpoints" / "latest"
    deadline = time.time() + 400
    while time.time() < deadline and not (latest.exists() and latest.read_text().strip() >= tag):
        assert proc.poll() is None, proc.stderr.read()[-4000:]
        time.sleep(0.02)
    victim = rank_pid(proc.pid, rank)
    assert victim is not None, "no trainer process of that rank under torchrun"
    beat = json.loads((out / "train" / "stream" / "producer.json").read_text())
    os.kill(victim, 9)
    assert proc.wait(timeout=120) != 0  # torchrun ends the surviving rank and fails
    from train.stream import alive

    deadline = time.time() + 60
    while alive(beat["pid"]) and time.time() < deadline:  # the orphaned producer sees its trainer gone
        time.sleep(0.05)
    assert not alive(beat["pid"]), "the producer outlived its trainer"
    rerun = subprocess.run(torchrun(out, *stream), env=subprocess_env(), capture_output=True, text=True, timeout=600,
                           cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert "resumed from" in rerun.stdout
    a, b = head_weights(tmp_path / "off"), head_weights(out)
    assert all((a[k] == b[k]).all() for k in a), "the resumed 2-rank streamed head differs from the 2-rank offline head"
    summary = json.loads((out / "train" / "summary.json").read_text())
    assert summary["stream"]["producer_records"] < 6 * 8 + summary["eval_records"]  # the consumed part is not redone
    assert not list((out / "train" / "stream" / "shards").glob("*.safetensors"))


def offline_vllm_cache(cfg, records, engine_python: str, work) -> None:
    """The cache data prep writes with data.feature_source=vllm from a capture server (data_prep/vllm_features.py
    `cache_shard_vllm` with a server started as `vllm serve` + `capture_args`)."""
    from data_prep.feature_cache import FeatureCacheWriter
    from data_prep.target import load_target_config, resolve_target_path
    from data_prep.vllm_features import cache_shard_vllm, capture_layer_ids
    from engine.head_dim_pad import servable_target
    from engine.vllm_server import VLLMServer, capture_args, serve_args
    from recipes import layout
    from train.stream_capture import features_meta

    path = resolve_target_path(cfg.target)
    config = load_target_config(path)
    meta, layers = features_meta(cfg, path, config)
    model, _ = servable_target(path, config, work / "models")
    args = serve_args(cfg.target.dtype, cfg.seed, cfg.data.max_length + 1, None, work) + capture_args(
        capture_layer_ids(layers, config.num_hidden_layers), work / "unrequested") + list(cfg.data.serve_args)
    writer = FeatureCacheWriter(layout.cache_dir(cfg), meta, dtype=cfg.data.cache_dtype)
    with VLLMServer(engine_python, model, work / "server.log", served_model_name="target", args=args) as server:
        cache_shard_vllm(cfg, path, config, records, writer, 0, 1, layers, work, server=lambda: server)
    writer.close()


def vllm_stream_equals_offline(toy, tmp_path, dist_ctx, engine_python: str, exact: bool, *extra: str) -> dict:
    """train.stream_producer=vllm against the offline run on the offline-from-vLLM cache of the same records."""
    from train.main import train

    eng = f"data.engine_python={engine_python}"
    off = config(toy, tmp_path / "off", eng, *extra)
    offline_vllm_cache(off, toy["records"], engine_python, tmp_path / "offline-engine")
    s_off = train(off, dist_ctx)
    window_mb = 0.03
    st = config(toy, tmp_path / "st", "train.mode=stream", "train.stream_producer=vllm", eng,
                f"train.stream_window_mb={window_mb}", *extra)
    s_st = train(st, dist_ctx)
    a, b = head_weights(tmp_path / "off"), head_weights(tmp_path / "st")
    assert a.keys() == b.keys()
    if exact:
        assert all((a[k] == b[k]).all() for k in a), "streamed-from-vLLM head differs from offline-from-vLLM"
        assert s_st["eval"] == s_off["eval"]
    assert s_st["train_tokens"] == s_off["train_tokens"]
    assert 0 < s_st["stream"]["window_peak_bytes"] <= window_mb * 2**20
    assert not list((tmp_path / "st" / "train" / "stream" / "shards").glob("*.safetensors*"))
    assert not list((tmp_path / "st" / "train" / "stream" / "vllm" / "files").glob("*"))  # capture files read, gone
    return {"heads": (a, b), "eval": (s_off["eval"], s_st["eval"])}


def test_vllm_producer_streams_the_offline_vllm_cache_s_head(toy, tmp_path, dist_ctx):
    """train.stream_producer=vllm through a fake capture server (tests/fake_vllm_capture.py, what the connector
    writes): the producer starts it, captures shard by shard, stops it; the head equals the offline one bit for bit."""
    from fake_vllm_capture import fake_engine_python

    vllm_stream_equals_offline(toy, tmp_path, dist_ctx, fake_engine_python(tmp_path / "engine"), exact=True)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("EAGLE_VLLM_PYTHON"), reason="needs $EAGLE_VLLM_PYTHON (a vLLM interpreter)")
def test_real_vllm_producer_streams_the_offline_vllm_cache_s_head(toy, tmp_path, dist_ctx):
    """The same through real vLLM (the toy target served as its padded head_dim copy): the stream's shards are
    captured by a server of its own, per shard, the offline cache's by another, all records at once; the heads are
    compared bit for bit (vLLM's CPU forward of a record does not depend on what it is batched with)."""
    # the toy target has no tokenizer: the capture server needs none (its prompts are token ids)
    vllm_stream_equals_offline(toy, tmp_path, dist_ctx, os.environ["EAGLE_VLLM_PYTHON"], True,
                               'data.serve_args=["--skip-tokenizer-init"]')


def test_every_stream_producer_name_has_its_capture():
    from recipes.train import STREAM_PRODUCERS
    from train.stream_capture import CAPTURES

    assert set(CAPTURES) == set(STREAM_PRODUCERS)


@pytest.mark.parametrize("old_g,new_g", [(2, 1), (1, 2), (2, 3)])
def test_a_resume_on_another_global_batch_finds_every_micro_batch_in_its_shard(toy, old_g, new_g):
    """The stream's cut after a resume with another world_size x grad_accum (train/stream.py `order`): every
    micro-batch the trainer's plan (train/batching.py `segment`, the offline resume) trains from the checkpoint's
    position on -- the rest of that epoch in its old order, then epochs in the new one -- lies whole in the shard the
    trainer seeks and the producer writes (next_shard walks the producer's way; nothing skipped, nothing twice)."""
    from train.batching import MicroBatchPlan
    from train.stream import StreamOrder, stream_stride

    lengths = [len(r["input_ids"]) for r in toy["records"]][:36]
    plan = MicroBatchPlan(lengths, 4, 0, "grouped", 2, world_size=1, rank=0, grad_accum=new_g)
    for consumed in range(0, len(plan.global_epoch(0, old_g)), old_g):
        order = [0, old_g]
        stride = stream_stride(plan, order)
        request = {"step_size": new_g, "micro_batch_size": 4, "seed": 0, "batching": "grouped", "group_size": 2,
                   "window_steps": 1000, "window_cap_bytes": 40_000, "limit": 64, "order": order, "start": consumed}
        so = StreamOrder(request, lengths, per_token=32)
        wanted = [(e * stride + p, b) for e, start in ((0, consumed), (1, 0), (2, 0))
                  for p, b in plan.segment(e, start, old_g if e == 0 else None)]
        written, m = [], so.next_shard(consumed)[0]
        while m < 3 * stride:
            a, b = so.next_shard(m)
            written.append((a, b))
            m = b
        assert len(set(written)) == len(written) and all(b1 <= a2 for (_, b1), (a2, _) in zip(written, written[1:]))
        for m, batch in wanted:
            a, b = so.shard_of(m)
            assert (a, b) in written and set(batch) <= set(so.records_of(a, b)), (consumed, m)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("ranks", [(2, 1), (1, 2)])
def test_a_stream_run_resumes_on_another_number_of_ranks_as_offline_does(toy, tmp_path, ranks):
    """Stopped after 2 steps (train.stop_after) on one number of ranks and resumed on another (grad_accum 1: the
    global batch changes as well), a streamed run trains what the offline run resumed the same way trains (up to the
    rounding tests/test_train_helpers.py's assert_same_training allows for rank-count changes); the stopped run's
    shards of the old cut are not read, and a marker of a rank that no longer exists does not keep shards on disk."""
    import socket

    from test_train_helpers import assert_same_training

    def launch(n, out, *extra):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launcher = [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                                    str(n), "--master_port", str(port)]
        cmd = [*launcher, str(REPO / "train" / "main.py"), "--recipe", "tiny",
               *overrides(toy["target"], out, f"train.tokenized={toy['tok']}", "train.eval_every=5",
                          "train.checkpoint_every=2", *extra, steps=8)]
        proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout

    off = config(toy, tmp_path / "off")
    offline_cache(off, toy["records"])
    stream = ("train.mode=stream", "train.stream_window_mb=0.06")
    for out, extra in ((tmp_path / "off", ()), (tmp_path / "st", stream)):
        launch(ranks[0], out, "train.stop_after=2", *extra)
        log = launch(ranks[1], out, *extra)
        assert "resumed from" in log and "global batch changed" in log, log[-3000:]
    a, b = head_weights(tmp_path / "st"), head_weights(tmp_path / "off")
    assert_same_training(a, b, 8, what=f"stream vs offline, {ranks[0]} -> {ranks[1]} ranks")
    sdir = tmp_path / "st" / "train" / "stream"
    assert (sdir / "consumed" / "rank1.json").exists()
    assert not list((sdir / "shards").glob("*.safetensors"))
    summary = json.loads((tmp_path / "st" / "train" / "summary.json").read_text())
    assert summary["world_size"] == ranks[1] and 0 < summary["stream"]["window_peak_bytes"] <= 0.06 * 2**20


def test_keep_mode_refuses_another_global_batch_in_one_line(tmp_path):
    """train.stream_epochs=keep re-reads epoch 0's shards, cut for the checkpoint's global batch: a resume on another
    one is one line naming the setting, before anything is written."""
    from types import SimpleNamespace

    from train.stream import StreamError, StreamRecords

    records = StreamRecords(SimpleNamespace(ids=["a"], lengths=[4]), tmp_path / "s", 1.0, 0)
    cfg = SimpleNamespace(train=SimpleNamespace(stream_epochs="keep"))
    with pytest.raises(StreamError, match="train.stream_epochs=keep resumes on the same global batch only"):
        records.begin(cfg, None, None, None, SimpleNamespace(step_size=1),
                      {"epoch": 0, "consumed": 2, "order_step_size": 2}, 4)
    assert not (tmp_path / "s").exists()
