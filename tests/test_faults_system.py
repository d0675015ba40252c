"""Fault tier, system classes: a full disk (a small tmpfs mounted for the test: needs root, else skipped), kill -9,
and concurrent writers on one run folder. Each failing command exits 2 with one stderr line naming the problem
and leaves the earlier good state (checkpoints, `latest`, the exported head, stage outputs) unchanged; the same
command then succeeds once the cause is gone."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fault_helpers import assert_one_line_error, assert_unchanged, run_cli, snapshot, world  # noqa: F401
from test_train_helpers import REPO, overrides, save_target, subprocess_env, write_cache

BASE = ("train.precision=fp32", "train.zero_stage=0", "train.lr=1e-3", "train.micro_batch_size=2",
        "train.checkpoint_every=2")


@pytest.fixture(scope="module")
def toy(tmp_path_factory, world):  # noqa: F811
    root = tmp_path_factory.mktemp("system")
    target = save_target(root / "target")
    return {"target": target, "cache": write_cache(root / "cache", target, n=24), "root": root}


def train_argv(toy, run, *extra, steps=4):
    return ["--recipe", "tiny", *overrides(toy["target"], run, f"train.cache_dir={toy['cache']}", *BASE, *extra,
                                           steps=steps)]


def train_cli(toy, run, capsys, *extra, steps=4):
    from train.main import main

    return run_cli(main, train_argv(toy, run, *extra, steps=steps), capsys)


def latest(run):
    p = Path(run) / "train" / "checkpoints" / "latest"
    return p.read_text().strip() if p.exists() else None


# ----------------------------------------------------------------------------- disk full (tmpfs)
@pytest.fixture
def small_disk(tmp_path):
    """make(size) -> a folder on a fresh tmpfs of that size (unmounted after the test)."""
    mounts = []

    def make(size: str) -> Path:
        path = tmp_path / f"disk{len(mounts)}"
        path.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                           text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the disk-full cases need root")
        mounts.append(path)
        return path

    yield make
    for p in mounts:
        subprocess.run(["umount", "-l", str(p)], capture_output=True)


def fill(disk: Path, leave: int) -> Path:
    """Fill `disk` until only ~`leave` bytes are free."""
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    filler = disk / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


def test_disk_full_during_a_checkpoint_keeps_latest_and_resumes(toy, small_disk, capsys):
    disk = small_disk("8m")
    run = disk / "run"
    code, _, err = train_cli(toy, run, capsys, "train.stop_after=2")
    assert code == 0, err
    good = snapshot(run / "train" / "checkpoints")
    filler = fill(disk, 64 * 1024)
    code, _, err = train_cli(toy, run, capsys)
    assert_one_line_error(code, err, "could not write checkpoint", "step-00000004", "still names step-00000002")
    assert latest(run) == "step-00000002" and not (run / "train" / "checkpoints" / "step-00000004").exists()
    assert_unchanged(good, run / "train" / "checkpoints")
    filler.unlink()
    code, out, err = train_cli(toy, run, capsys)
    assert code == 0, err
    assert "at step 2" in out and latest(run) == "step-00000004"


def test_disk_full_during_export_keeps_the_previous_export(toy, small_disk, tmp_path, capsys):
    disk = small_disk("1m")
    run = tmp_path / "run"
    head = disk / "head"
    code, _, err = train_cli(toy, run, capsys, f"export.dir={head}", "export.dtype=float32", steps=2)
    assert code == 0, err
    good = snapshot(head)
    fill(disk, 64 * 1024)
    code, _, err = train_cli(toy, tmp_path / "run2", capsys, f"export.dir={head}", "export.dtype=float32", steps=2)
    assert_one_line_error(code, err, "could not export the head", str(head), "previous export")
    assert_unchanged(good, head)
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "head"]  # no partial temporary folder


def test_disk_full_in_data_prep(small_disk, tmp_path, capsys):
    from data_prep.main import main
    from test_data_prep_helpers import save_target as save_chat_target, write_sharegpt

    target = save_chat_target(tmp_path / "target", chat_template=None)
    source = write_sharegpt(tmp_path / "convs.json", 6)
    disk = small_disk("2m")
    r = {"name": "t", "output_dir": str(disk / "run"), "target": {"path": str(target), "dtype": "float32",
                                                                  "chat_template": "chatml"},
         "data": {"source": str(source), "max_new_tokens": 4, "gen_batch_size": 3, "max_length": 64, "device": "cpu",
                  "regenerate": False, "disk_headroom_gb": 0.0}}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps(r))
    code, _, err = run_cli(main, ["--recipe", recipe, "--no-progress", "load"], capsys)
    assert code == 0, err
    data = disk / "run" / "data"
    good = snapshot(data)
    filler = fill(disk, 0)
    code, _, err = run_cli(main, ["--recipe", recipe, "--no-progress", "tokenize"], capsys)
    assert_one_line_error(code, err, "disk full while writing", str(data))
    assert_unchanged(good, data)  # no partial tokenized.jsonl, conversations untouched
    filler.unlink()
    code, _, err = run_cli(main, ["--recipe", recipe, "--no-progress", "data.disk_headroom_gb=0.01"], capsys)
    assert_one_line_error(code, err, "not enough disk")  # the cache's pre-flight check: 10 MB headroom on 2 MB
    assert (data / "tokenized.jsonl").exists()


# ----------------------------------------------------------------------------- concurrency and kill -9
HOLDER = """
import fcntl, os, sys, time
path = os.path.join(sys.argv[1], "." + sys.argv[2] + ".lock")  # the file eagle.run_lock.run_lock locks
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.ftruncate(fd, 0)
os.pwrite(fd, ("pid %d: holder" % os.getpid()).encode(), 0)
if sys.argv[3] == "fork" and os.fork() == 0:  # an orphan-to-be: inherits the locked file
    time.sleep(600)
    os._exit(0)
print("locked", flush=True)
time.sleep(600)
"""


def hold_lock(directory, name, fork=False) -> subprocess.Popen:
    """Another process holding the run folder's lock (a bare flock: starts in milliseconds)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), name, "fork" if fork else "no"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def kill9(proc: subprocess.Popen, group: bool = False) -> None:
    os.killpg(proc.pid, signal.SIGKILL) if group else proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def test_second_training_on_a_busy_folder_is_refused_until_the_holder_dies(toy, tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = train_cli(toy, run, capsys, "train.stop_after=2")
    assert code == 0, err
    good = snapshot(run)
    holder = hold_lock(run / "train", "rank0")
    try:
        code, _, err = train_cli(toy, run, capsys)
        assert_one_line_error(code, err, "in use by another training", f"pid {holder.pid}", ".rank0.lock")
        assert_unchanged(good, run)
    finally:
        kill9(holder)  # kill -9: the kernel drops its lock
    code, _, err = train_cli(toy, run, capsys)
    assert code == 0, err


def test_a_refused_launch_is_one_line_from_a_fresh_process(toy, tmp_path):
    """The refusal as a user sees it, from a new process (the in-process tests here import DeepSpeed once, before
    them): nothing a library prints at import (DeepSpeed's "Setting accelerator to CPU" warning) beside the line."""
    run = tmp_path / "run"
    holder = hold_lock(run / "train", "rank0")
    try:
        proc = cli_train(toy, run)
        _, err = proc.communicate(timeout=300)
        assert_one_line_error(proc.returncode, err, "in use by another training", f"pid {holder.pid}")
    finally:
        kill9(holder)


def test_orphaned_workers_keep_the_folder_busy(toy, tmp_path, capsys):
    """The launcher dies (kill -9) but a forked worker still runs: the folder stays locked until it ends."""
    run = tmp_path / "run"
    (run / "train").mkdir(parents=True)
    holder = hold_lock(run / "train", "rank0", fork=True)
    try:
        kill9(holder)  # only the parent
        code, _, err = train_cli(toy, run, capsys)
        assert_one_line_error(code, err, "in use by another training", "orphaned workers")
        assert not (run / "train" / "checkpoints").exists()
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
    for _ in range(100):  # the orphan is gone once its group is killed
        code, _, err = train_cli(toy, run, capsys, steps=2)
        if code == 0:
            break
        time.sleep(0.1)
    assert code == 0, err


def test_second_data_prep_on_a_busy_folder_is_refused(tmp_path, capsys):
    from data_prep.main import main

    data = tmp_path / "run" / "data"
    data.mkdir(parents=True)
    (data / "conversations.jsonl").write_text('{"id": "a"}\n')
    good = snapshot(data)
    holder = hold_lock(data, "shard0of1")
    try:
        code, _, err = run_cli(main, ["--recipe", "tiny", f"output_dir={tmp_path / 'run'}", "data.source=x.json"],
                               capsys)
        assert_one_line_error(code, err, "in use by another data prep", str(data))
        assert_unchanged(good, data)
    finally:
        kill9(holder)


def test_independent_shards_lock_separately(tmp_path):
    from eagle.cli_errors import RunDirBusyError
    from eagle.run_lock import run_lock

    with run_lock(tmp_path, "shard0of2", "data prep"), run_lock(tmp_path, "shard1of2", "data prep"):
        with pytest.raises(RunDirBusyError):
            with run_lock(tmp_path, "shard0of2", "data prep"):
                pass


def cli_train(toy, run, *extra, steps=4) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "train" / "main.py"), *train_argv(toy, run, *extra, steps=steps)],
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.slow
def test_two_launches_at_once_one_refuses(toy, tmp_path):
    run = tmp_path / "run"
    a, b = cli_train(toy, run, steps=30), cli_train(toy, run, steps=30)
    results = [p.communicate(timeout=600) + (p.returncode,) for p in (a, b)]
    codes = sorted(r[2] for r in results)
    assert codes == [0, 2], results
    refused = next(r for r in results if r[2] == 2)
    assert_one_line_error(2, refused[1], "in use by another training")


@pytest.mark.slow
def test_kill9_mid_training_then_rerun_equals_an_uninterrupted_run(toy, tmp_path):
    straight = tmp_path / "straight"
    p = cli_train(toy, straight, "train.checkpoint_every=1", steps=12)
    assert p.wait(timeout=600) == 0, p.stderr.read()
    run = tmp_path / "run"
    p = cli_train(toy, run, "train.checkpoint_every=1", steps=12)
    deadline = time.time() + 300
    while latest(run) in (None, "step-00000001", "step-00000002") and time.time() < deadline:
        time.sleep(0.05)
    kill9(p, group=True)
    assert p.returncode == -signal.SIGKILL and not (run / "head").exists()
    p = cli_train(toy, run, "train.checkpoint_every=1", steps=12)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    assert "resumed from" in out
    a, b = load_file(straight / "head" / "model.safetensors"), load_file(run / "head" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_kill9_during_data_prep_then_rerun_completes_identically(tmp_path):
    from test_data_prep_helpers import save_target as save_chat_target, write_sharegpt

    target = save_chat_target(tmp_path / "target", chat_template=None)
    source = write_sharegpt(tmp_path / "convs.json", 24)

    def recipe(out):
        r = {"name": "t", "output_dir": str(out), "target": {"path": str(target), "dtype": "float32",
                                                             "chat_template": "chatml"},
             "data": {"source": str(source), "max_new_tokens": 8, "gen_batch_size": 2, "max_length": 64,
                      "device": "cpu", "disk_headroom_gb": 0.0, "cache_shard_mb": 1}}
        path = out.with_suffix(".yaml")
        path.write_text(json.dumps(r))
        return path

    def launch(out):
        return subprocess.Popen([sys.executable, str(REPO / "data_prep" / "main.py"), "--recipe", str(recipe(out)),
                                 "--no-progress"], env=subprocess_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    ref = launch(tmp_path / "ref")
    assert ref.wait(timeout=600) == 0, ref.stderr.read()
    p = launch(tmp_path / "run")
    part = tmp_path / "run" / "data" / "regenerated" / "part-00000-of-00001.jsonl"
    deadline = time.time() + 300
    while (not part.exists() or part.stat().st_size == 0) and time.time() < deadline:
        time.sleep(0.02)
    kill9(p, group=True)
    p = launch(tmp_path / "run")
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    a = (tmp_path / "ref" / "data" / "tokenized.jsonl").read_bytes()
    assert (tmp_path / "run" / "data" / "tokenized.jsonl").read_bytes() == a
    from data_prep.feature_cache import FeatureCacheReader

    r1, r2 = FeatureCacheReader(tmp_path / "ref" / "data" / "features"), FeatureCacheReader(tmp_path / "run" / "data" / "features")
    assert sorted(r1.ids) == sorted(r2.ids)
    for rid in r1.ids:
        x, y = r1[r1.ids.index(rid)], r2[r2.ids.index(rid)]
        assert torch.equal(x["hidden_states"], y["hidden_states"]) and torch.equal(x["input_ids"], y["input_ids"])


def test_a_lock_leaves_nothing_behind_and_a_stale_opener_relocks(tmp_path):
    """Issue 28 item 17: the lock file goes with its holder; the folders the lock created go too when nothing was
    written in them, and stay (with their content) when something was."""
    import fcntl

    from eagle.run_lock import run_lock

    run = tmp_path / "runs" / "x" / "train"
    with pytest.raises(ValueError):
        with run_lock(run, "rank0", "training") as lock:
            assert lock.exists()
            raise ValueError("config error found in setup")
    assert not (tmp_path / "runs").exists()
    with run_lock(run, "rank0", "training"):
        (run / "summary.json").write_text("{}")
    assert [p.name for p in run.iterdir()] == ["summary.json"]
    # a process that opened the file just before its holder removed it must not hold a lock on a dead file
    with run_lock(run, "rank0", "training") as lock:
        stale = os.open(lock, os.O_RDWR)
    fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # it gets the old inode's lock ...
    with run_lock(run, "rank0", "training") as lock:  # ... while run_lock takes the path's own file
        assert lock.exists()
    os.close(stale)


def test_training_that_fails_in_setup_leaves_no_run_folder(toy, tmp_path, capsys):
    run = tmp_path / "runs" / "llama"
    code, _, err = train_cli(toy, run, capsys, f"train.cache_dir={tmp_path / 'no-cache'}")
    assert_one_line_error(code, err, "does not exist")
    assert not (tmp_path / "runs").exists()
