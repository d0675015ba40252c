"""The trainer under 2-process launchers on CPU (gloo): torchrun (default suite) and the deepspeed launcher (slow)."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from test_train_helpers import REPO, overrides, save_target, subprocess_env, write_cache

pytestmark = pytest.mark.multiproc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy2")
    target = save_target(root / "target")
    return {"target": target, "cache": write_cache(root / "cache", target)}


def launch(launcher: list[str], toy, out, *extra, steps=4, timeout=300):
    cmd = [*launcher, str(REPO / "train" / "main.py"), "--recipe", "tiny",
           *overrides(toy["target"], out, f"train.cache_dir={toy['cache']}", *extra, steps=steps)]
    return subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout, cwd=out.parent)


def test_two_ranks_with_torchrun_zero2_bf16(toy, tmp_path):
    out = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    proc = launch(torchrun, toy, out, "train.zero_stage=2", "train.precision=bf16", "train.checkpoint_every=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "train" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert summary["eval"]["eval/positions"] > 0
    # both ranks saved their RNG state; the optimizer state is partitioned over the 2 ranks (ZeRO-2)
    ckpt = out / "train" / "checkpoints" / "step-00000004"
    assert {p.name for p in ckpt.glob("rng_rank*.pt")} == {"rng_rank00000.pt", "rng_rank00001.pt"}
    assert len(list(ckpt.glob("*optim_states.pt"))) == 2
    assert load_file(out / "head" / "model.safetensors")["fc.weight"].abs().sum() > 0


@pytest.mark.slow
def test_two_ranks_with_deepspeed_launcher_and_exact_resume(toy, tmp_path):
    """`deepspeed --num_gpus 2` on a CPU-only machine starts 2 gloo ranks; 2N straight == N + resume + N."""
    if shutil.which("deepspeed") is None and not (REPO.parent / "venv" / "bin" / "deepspeed").exists():
        pytest.skip("deepspeed launcher not on PATH")
    ds = shutil.which("deepspeed") or str(REPO.parent / "venv" / "bin" / "deepspeed")

    def run(out, *extra):
        proc = launch([ds, "--num_gpus", "2", "--master_port", str(free_port())], toy, out, "train.zero_stage=1", *extra,
                      steps=6)
        assert proc.returncode == 0, proc.stderr[-4000:]

    run(tmp_path / "straight")
    run(tmp_path / "resumed", "train.stop_after=3")
    run(tmp_path / "resumed")
    a = load_file(tmp_path / "straight" / "head" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "head" / "model.safetensors")
    assert all((a[k] == b[k]).all() for k in a)
