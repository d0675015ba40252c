"""More than one node, exercised on one box (slow tier): resume on another number of ranks (ZeRO 0 as it is,
ZeRO 1-3 through DeepSpeed's universal checkpoint), two torchrun "nodes" vs one node, a killed launcher, a lost
node. Tiny toy target, few steps."""
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
from safetensors.torch import load_file

from test_train_helpers import REPO, assert_same_training, overrides, save_target, subprocess_env, write_cache
from test_train_multiproc import deepspeed_launcher, free_port

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
STEPS = 6  # optimizer steps of every run here; interrupted runs stop after 3


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    target = save_target(root / "target")
    return {"target": target, "cache": write_cache(root / "cache", target, n=48)}


def trainer_cmd(toy, out, *extra) -> list[str]:
    return [str(REPO / "train" / "main.py"), "--recipe", "tiny",
            *overrides(toy["target"], out, f"train.cache_dir={toy['cache']}", "train.checkpoint_every=3",
                       "train.precision=fp32", *extra, steps=STEPS)]


def torchrun(nproc: int, port: int, nnodes: int = 1, node_rank: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", str(nnodes),
            "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port)]


def train(toy, out, ranks: int, *extra, timeout=600) -> subprocess.CompletedProcess:
    proc = subprocess.run([*torchrun(ranks, free_port()), *trainer_cmd(toy, out, *extra)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout, cwd=out.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def head(out) -> dict:
    return load_file(out / "head" / "model.safetensors")


# ----------------------------------------------------------------------------- resume on another number of ranks
RESIZES = {"2to1": ((2, 1), (1, 2)), "1to2": ((1, 2), (2, 1)), "2to4": ((2, 2), (4, 1))}  # (ranks, grad_accum)
MATRIX = [(stage, d) for stage in (0, 1, 2, 3) for d in ("2to1", "1to2")] + [(3, "2to4")]


@pytest.fixture(scope="module")
def straight_runs(toy, tmp_path_factory):
    """Uninterrupted runs, one per (ZeRO stage, ranks, grad_accum), made on first use and shared by the cells."""
    made = {}

    def get(stage: int, ranks: int, accum: int) -> Path:
        if (stage, ranks, accum) not in made:
            out = tmp_path_factory.mktemp(f"straight-z{stage}-{ranks}x{accum}") / "run"
            train(toy, out, ranks, f"train.zero_stage={stage}", f"train.grad_accum={accum}")
            made[stage, ranks, accum] = out
        return made[stage, ranks, accum]
    return get


@pytest.mark.parametrize("stage,resize", MATRIX, ids=[f"{d}-zero{s}" for s, d in MATRIX])
def test_resume_on_another_number_of_ranks(toy, tmp_path, straight_runs, stage, resize):
    """A checkpoint written by N ranks resumes on M (the global batch kept: ranks x grad_accum) under every ZeRO
    stage: stage 0's one model-states file holds the whole optimizer state and loads as it is; ZeRO 1-3 partitions go
    through DeepSpeed's universal checkpoint. The data position is a count of global micro-batches and the input
    noise is keyed per micro-batch, so the head equals an uninterrupted N-rank run's up to rounding
    (tests/test_train_helpers.py: assert_same_training): each micro-batch's gradient in another process, and for
    2 x 2 -> 4 x 1 a reordered 4-term gradient sum. Measured here: 0 for 1 <-> 2 ranks, 1.3e-08 for 2 -> 4
    (docs/results/resume-ranks.md)."""
    (w0, a0), (w1, a1) = RESIZES[resize]
    common = (f"train.zero_stage={stage}",)
    straight = straight_runs(stage, w0, a0)
    train(toy, tmp_path / "resized", w0, *common, f"train.grad_accum={a0}", "train.stop_after=3")
    proc = train(toy, tmp_path / "resized", w1, *common, f"train.grad_accum={a1}")
    assert f"written by {w0} ranks, continued on {w1}" in proc.stdout
    universal = tmp_path / "resized" / "train" / "checkpoints" / "universal"
    assert (universal / "step-00000003" / "complete").exists() == (stage > 0)  # stage 0 needs no conversion
    summary = json.loads((tmp_path / "resized" / "train" / "summary.json").read_text())
    assert summary["world_size"] == w1 and summary["steps"] == STEPS
    a, b = head(tmp_path / "resized"), head(straight)
    assert a.keys() == b.keys()
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    print(f"zero{stage} {w0}x{a0} -> {w1}x{a1}: max |resumed - uninterrupted| = {diff:.3g}")
    assert_same_training(a, b, STEPS, what=f"zero{stage} {resize}")


def test_two_rank_checkpoint_without_its_optimizer_files_is_one_line_on_one_rank(toy, tmp_path):
    """A 2-rank ZeRO-1 checkpoint whose optimizer partitions were removed, resumed on 1 rank (the conversion case):
    one `error:` line naming the checkpoint, the missing files and what to do, before DeepSpeed's converter runs."""
    out = tmp_path / "run"
    train(toy, out, 2, "train.zero_stage=1", "train.stop_after=3")
    ckpt = out / "train" / "checkpoints" / "step-00000003"
    for f in ckpt.glob("*optim_states.pt"):
        f.unlink()
    proc = subprocess.run([sys.executable, *trainer_cmd(toy, out, "train.zero_stage=1", "train.grad_accum=2")],
                          env=subprocess_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: checkpoint {ckpt} is incomplete: zero_pp_rank_0_mp_rank_00_optim_states.pt, "
                                "zero_pp_rank_1_mp_rank_00_optim_states.pt missing (written by 2 ranks under "
                                "train.zero_stage=1)"), errors[0]
    assert "train.resume=false" in errors[0]


# ----------------------------------------------------------------------------- two nodes on one box
def launch_nodes(toy, outs, nodes: int, per_node: int, *extra, **popen) -> list[subprocess.Popen]:
    """`nodes` torchrun launchers on localhost (node ranks 0..nodes-1, one rendezvous address), `per_node` ranks
    each; outs[i] is node i's output_dir (the same folder = a shared filesystem)."""
    port = free_port()
    return [subprocess.Popen([*torchrun(per_node, port, nodes, i), *trainer_cmd(toy, outs[i], *extra)],
                             env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=outs[i].parent, **popen) for i in range(nodes)]


def finish(procs, timeout=900) -> list[tuple[int, str, str]]:
    results = [(p.wait(timeout=timeout), *p.communicate()) for p in procs]
    for code, _, err in results:
        assert code == 0, err[-4000:]
    return results


def files(root) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("per_node", [1, 2], ids=["2x1", "2x2"])
def test_two_nodes_train_the_head_of_one_node(toy, tmp_path, per_node):
    """Two torchrun "nodes" of `per_node` ranks on one box (node ranks, one rendezvous address, LOCAL_RANK 0..k-1
    on each) train exactly the head one node of 2 x per_node ranks trains: the same bytes. On a shared filesystem
    each file is written once: the run's files by global rank 0, a checkpoint's partitions and RNG by their rank."""
    finish(launch_nodes(toy, [tmp_path / "one"], 1, 2 * per_node))
    shared = tmp_path / "two"
    finish(launch_nodes(toy, [shared, shared], 2, per_node))
    assert (shared / "head" / "model.safetensors").read_bytes() == (tmp_path / "one" / "head" / "model.safetensors").read_bytes()
    one, two = files(tmp_path / "one"), files(shared)
    assert one.keys() == two.keys()  # the same files, none written twice under another name
    ckpt = f"train/checkpoints/step-{STEPS:08d}"
    ranks = 2 * per_node
    assert {k for k in two if k.startswith(ckpt)} == {
        f"{ckpt}/mp_rank_00_model_states.pt", f"{ckpt}/ranks.json", f"{ckpt}/head.json",
        *(f"{ckpt}/rng_rank{r:05d}.pt" for r in range(ranks)),
        *(f"{ckpt}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(ranks))}
    assert json.loads((shared / ckpt / "ranks.json").read_text()) == {"world_size": ranks, "zero_stage": 1}


def test_per_node_disks(toy, tmp_path):
    """train.shared_filesystem=false with each node's output_dir on its own disk (here: two folders): node 0 holds
    the run's files (head, summary, metrics) and its ranks' checkpoint parts, node 1 only its own parts plus its own
    copy of the model states and `latest`; a stopped run resumes from each node's own disk and ends with the head
    of a shared-filesystem run."""
    disks = [tmp_path / "node0", tmp_path / "node1"]
    finish(launch_nodes(toy, disks, 2, 1, "train.shared_filesystem=false", "train.stop_after=3"))
    finish(launch_nodes(toy, disks, 2, 1, "train.shared_filesystem=false"))
    ckpt = f"train/checkpoints/step-{STEPS:08d}"
    node1 = files(disks[1])
    assert {k for k in node1 if not k.startswith("train/.rank")} == {
        "train/checkpoints/latest", f"{ckpt}/mp_rank_00_model_states.pt", f"{ckpt}/ranks.json", f"{ckpt}/head.json",
        f"{ckpt}/rng_rank00001.pt", f"{ckpt}/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "train/checkpoints/step-00000003/mp_rank_00_model_states.pt", "train/checkpoints/step-00000003/ranks.json",
        "train/checkpoints/step-00000003/head.json",
        "train/checkpoints/step-00000003/rng_rank00001.pt",
        "train/checkpoints/step-00000003/zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    assert not (disks[1] / "head").exists() and (disks[0] / "head" / "model.safetensors").exists()
    assert f"{ckpt}/zero_pp_rank_1_mp_rank_00_optim_states.pt" not in files(disks[0])
    finish(launch_nodes(toy, [tmp_path / "shared"] * 2, 2, 1))
    assert head(disks[0]).keys() == head(tmp_path / "shared").keys()
    assert all(head(disks[0])[k].equal(head(tmp_path / "shared")[k]) for k in head(disks[0]))


# ----------------------------------------------------------------------------- a killed launcher, a lost node
LONG = ("train.max_steps=400", "train.checkpoint_every=10")  # long enough to be killed mid-run (after overrides)


def wait_for(predicate, timeout: float, what: str) -> float:
    """Poll until `predicate()`; the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - start


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (dead, not yet reaped by its orphaned parent's reaper) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def committed_step(out) -> int:
    latest = out / "train" / "checkpoints" / "latest"
    return int(latest.read_text().strip()[5:]) if latest.exists() and latest.read_text().strip() else 0


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_killed_launcher_takes_its_worker_along(toy, tmp_path, launcher):
    """SIGKILL of the launcher (torchrun; DeepSpeed's `deepspeed` runner, two levels above the worker) ends its
    worker within seconds, so the same command afterwards is not refused for an orphan holding the run lock."""
    out = tmp_path / "run"
    if launcher == "torchrun":
        cmd = torchrun(1, free_port())
    else:
        ds = deepspeed_launcher()
        if ds is None:
            pytest.skip("deepspeed launcher not found")
        cmd = [ds, "--num_gpus", "1", "--master_port", str(free_port())]
    proc = subprocess.Popen([*cmd, *trainer_cmd(toy, out, *LONG)], env=subprocess_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=tmp_path)
    lock = out / "train" / ".rank0.lock"
    wait_for(lambda: committed_step(out) >= 10, 600, "the first checkpoint")
    worker = int(lock.read_text().split()[1].rstrip(":"))
    assert worker != proc.pid and alive(worker)
    proc.kill()
    proc.wait()
    took = wait_for(lambda: not alive(worker), 30, f"worker {worker} to end after its launcher was killed")
    print(f"{launcher}: worker ended {took:.2f} s after SIGKILL of its launcher")
    rerun = subprocess.run([*torchrun(1, free_port()), *trainer_cmd(toy, out, "train.max_steps=12",
                                                                    "train.checkpoint_every=10")],
                           env=subprocess_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert rerun.returncode == 0 and "in use" not in rerun.stderr, rerun.stderr[-3000:]


def test_lost_node_ends_the_survivors_with_one_line_then_resumes_exactly(toy, tmp_path):
    """Every process of node 1 killed mid-run: node 0's worker ends within the stated bound (the peer's reset
    connection; train.collective_timeout_s when a node goes silent) with one line naming rank 1 / node 1 and the
    checkpoint to resume from; the same commands afterwards resume it, and the head equals an uninterrupted run's."""
    shared = tmp_path / "run"
    nodes = launch_nodes(toy, [shared, shared], 2, 1, *LONG, "train.collective_timeout_s=60", start_new_session=True)
    wait_for(lambda: committed_step(shared) >= 10, 600, "the first committed checkpoint")
    killed = time.monotonic()
    os.killpg(nodes[1].pid, signal.SIGKILL)  # node 1: its launcher and its worker
    code, _, err = nodes[0].wait(timeout=120), *nodes[0].communicate()
    took = time.monotonic() - killed
    nodes[1].wait()
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    print(f"node 0 ended {took:.1f} s after node 1 was killed: {errors}")
    assert code != 0 and len(errors) == 1, err[-3000:]
    assert errors[0].startswith("error: lost rank 1 (node 1) at step ") and "rerun the same command" in errors[0]
    assert took < 60
    stopped_at = committed_step(shared)
    assert 10 <= stopped_at < 400
    finish(launch_nodes(toy, [shared, shared], 2, 1, *LONG, "train.collective_timeout_s=60"))
    finish(launch_nodes(toy, [tmp_path / "straight"], 1, 2, *LONG))
    a, b = head(shared), head(tmp_path / "straight")
    assert all(a[k].equal(b[k]) for k in a), "the resumed head differs from the uninterrupted run's"


def test_silent_node_ends_the_survivors_after_the_collective_timeout(toy, tmp_path):
    """Node 1 stops answering (its worker SIGSTOPped: a hung host, a dead link): node 0 waits at most
    train.collective_timeout_s, then ends with one line naming rank 1 (node 1)."""
    shared = tmp_path / "run"
    nodes = launch_nodes(toy, [shared, shared], 2, 1, *LONG, "train.collective_timeout_s=15", start_new_session=True)
    try:
        wait_for(lambda: committed_step(shared) >= 10, 600, "the first committed checkpoint")
        worker = int((shared / "train" / ".rank1.lock").read_text().split()[1].rstrip(":"))
        stopped = time.monotonic()
        os.kill(worker, signal.SIGSTOP)
        code, _, err = nodes[0].wait(timeout=120), *nodes[0].communicate()
        took = time.monotonic() - stopped
    finally:
        os.killpg(nodes[1].pid, signal.SIGKILL)
        nodes[1].wait()
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    print(f"node 0 ended {took:.1f} s after node 1 went silent (collective timeout 15 s): {errors}")
    assert code != 0 and len(errors) == 1 and errors[0].startswith("error: lost rank 1 (node 1) at step "), err[-3000:]
    assert 15 <= took < 60


@pytest.mark.skipif(not (shutil.which("pdsh") and os.environ.get("PDSH_SSH_ARGS_APPEND")),
                    reason="needs pdsh and passwordless ssh to localhost (PDSH_RCMD_TYPE=ssh, PDSH_SSH_ARGS_APPEND; "
                           "README 'More than one node' sets one up)")
def test_deepspeed_hostfile_of_two_localhost_nodes(toy, tmp_path):
    """DeepSpeed's multi-node runner (pdsh over ssh) with a hostfile of two localhost entries trains the head one
    node of 2 ranks trains, byte for byte (the same OMP_NUM_THREADS on every node, through .deepspeed_env)."""
    ds = deepspeed_launcher()
    if ds is None:
        pytest.skip("deepspeed launcher not found")
    (tmp_path / "hosts").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    (tmp_path / "ds_env").write_text("OMP_NUM_THREADS=1\nWANDB_MODE=disabled\n")
    env = {**subprocess_env(), "DS_ENV_FILE": str(tmp_path / "ds_env")}
    proc = subprocess.run([ds, "--hostfile", str(tmp_path / "hosts"), "--no_ssh_check", "--master_addr", "127.0.0.1",
                           "--master_port", str(free_port()), *trainer_cmd(toy, tmp_path / "two")], env=env,
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train(toy, tmp_path / "one", 2)
    assert (tmp_path / "two" / "head" / "model.safetensors").read_bytes() == \
        (tmp_path / "one" / "head" / "model.safetensors").read_bytes()
