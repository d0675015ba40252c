"""The trainer under 2-process launchers on CPU (gloo): torchrun (default suite) and the deepspeed launcher (slow),
for the head kinds (EAGLE-2 on the 2-layer toy, EAGLE-3 on a 4-layer toy with an aux-layer cache; DFlash's exact
resume on another number of ranks on a 4-layer toy with its multi-layer cache)."""
from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train.checkpoint import weights_only_load
from test_train_helpers import REPO, assert_same_training, overrides, save_target, subprocess_env, write_cache

EAGLE3 = ("head.kind=eagle3", "head.aux_layers=[1,2,3]", "head.draft_vocab_size=100", "head.ttt_steps=3",
          "head.ttt_row_stride=2")  # as tests/test_train.py: steps 2-3 at every other position
DFLASH = ("head.kind=dflash", "head.target_layers=[1,2,3]", "head.block_size=4", "head.draft_layers=2",
          "head.anchors=4", "train.token_weight=1.0", "train.noise=none")  # as tests/test_train_dflash.py

pytestmark = pytest.mark.multiproc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def toy2(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy2")
    target = save_target(root / "target")
    return {"kind": "eagle2", "target": target, "cache": write_cache(root / "cache", target, n=48)}


@pytest.fixture(scope="module")
def toy3(tmp_path_factory):
    """A 4-layer toy target + an EAGLE-3 cache (aux layers 1, 2, 3 + the final state)."""
    root = tmp_path_factory.mktemp("toy3")
    target = save_target(root / "target", num_layers=4)
    return {"kind": "eagle3", "target": target, "cache": write_cache(root / "cache", target, n=48, layers=[1, 2, 3, 4]),
            "extra": EAGLE3}


@pytest.fixture(scope="module")
def toydf(toy3):
    """The EAGLE-3 toy's target and cache (target layers 1, 2, 3 + the final state: what a DFlash head reads too)."""
    return {**toy3, "kind": "dflash", "extra": DFLASH}


@pytest.fixture(params=["eagle2", "eagle3"])
def toy(request):
    """The EAGLE-2 toy or the EAGLE-3 toy (module-scoped, built on first use)."""
    return request.getfixturevalue("toy2" if request.param == "eagle2" else "toy3")


def launch(launcher: list[str], toy, out, *extra, steps=4, timeout=300):
    cmd = [*launcher, str(REPO / "train" / "main.py"), "--recipe", "tiny",
           *overrides(toy["target"], out, f"train.cache_dir={toy['cache']}", *toy.get("extra", ()), *extra, steps=steps)]
    return subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout, cwd=out.parent)


def test_two_ranks_with_torchrun_zero2_bf16(toy, tmp_path):
    out = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    proc = launch(torchrun, toy, out, "train.zero_stage=2", "train.precision=bf16", "train.checkpoint_every=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "train" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    if toy["kind"] == "eagle3":
        assert summary["head_kind"] == "eagle3" and summary["aux_layers"] == [1, 2, 3]
    assert summary["eval"]["eval/positions"] > 0
    # both ranks saved their RNG state; the optimizer state is partitioned over the 2 ranks (ZeRO-2)
    ckpt = out / "train" / "checkpoints" / "step-00000004"
    assert {p.name for p in ckpt.glob("rng_rank*.pt")} == {"rng_rank00000.pt", "rng_rank00001.pt"}
    assert len(list(ckpt.glob("*optim_states.pt"))) == 2
    assert load_file(out / "head" / "model.safetensors")["fc.weight"].abs().sum() > 0


@pytest.mark.parametrize("kind", ["eagle2", "dflash"])
def test_zero0_checkpoint_of_two_ranks_resumes_on_one(request, kind, tmp_path):
    """The shipped stories260k recipe's stage: a ZeRO-0 checkpoint written by 2 torchrun ranks resumes under plain
    `python` (1 rank, the global batch kept by train.grad_accum=2) with no universal conversion (its one model-states
    file holds the whole optimizer state), and its checkpoint and head equal an uninterrupted 1-rank run's up to
    rounding (tests/test_train_helpers.py: assert_same_training says why not bit for bit). Every stage x direction:
    tests/test_train_multinode.py (slow). DFlash too: its anchors are drawn from (seed, micro-batch), so the records
    rank 1 trained get the same blocks when the 1-rank run accumulates them."""
    toy = request.getfixturevalue("toy2" if kind == "eagle2" else "toydf")
    plain = [sys.executable]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    common = ("train.zero_stage=0", "train.precision=fp32", "train.checkpoint_every=2")
    runs = [(plain, tmp_path / "straight", ("train.grad_accum=2",)),
            (torchrun, tmp_path / "resized", ("train.stop_after=2",)),
            (plain, tmp_path / "resized", ("train.grad_accum=2",))]
    logs = []
    for launcher, out, extra in runs:
        proc = launch(launcher, toy, out, *common, *extra)
        assert proc.returncode == 0, proc.stderr[-4000:]
        logs.append(f"$ {' '.join(launcher[-4:])} {' '.join(extra)}\n{proc.stdout[-1500:]}")
    assert "written by 2 ranks under ZeRO stage 0" in proc.stdout and "continued on 1" in proc.stdout
    assert not (tmp_path / "resized" / "train" / "checkpoints" / "universal").exists()
    # where a difference starts: the step-2 checkpoint (2 ranks vs 1 rank accumulating 2 micro-batches), then the end
    step2 = [checkpoint_tensors(tmp_path / run / "train" / "checkpoints" / "step-00000002") for run in ("resized", "straight")]
    ends = [load_file(tmp_path / run / "head" / "model.safetensors") for run in ("resized", "straight")]
    for what, steps, (a, b) in (("step-2 checkpoint (model + optimizer)", 2, step2), ("final head", 4, ends)):
        diffs = {k: float((a[k].double() - b[k].double()).abs().max()) for k in a if not torch.equal(a[k], b[k])}
        print(f"{what}: max |resized - uninterrupted| {max(diffs.values(), default=0.0):.3g}")
        assert_same_training(a, b, steps, what=f"({what} vs the uninterrupted 1-rank run's)\n" + "\n".join(logs))


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


def start_ranks(cmd: list[str], cwd, world: int = 2) -> list[tuple[int, str]]:
    """`world` ranks of `cmd` started as DeepSpeed's launcher starts them (rank variables; rank 0's process group
    hosts the rendezvous store): each rank's (exit code, stderr)."""
    port = str(free_port())
    env = {**subprocess_env(), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": port}
    ranks = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, cwd=cwd) for r in range(world)]
    return [(p.communicate(timeout=300)[1], p.returncode)[::-1] for p in ranks]


def test_a_damaged_checkpoint_on_two_ranks_is_one_line_and_one_exit_code(toy2, tmp_path):
    """README's promise on several ranks: a refused resume prints ONE `error:` line (not one per rank) and every rank
    exits with code 2 (eagle/rank_errors.py). Under torchrun, whose agent hosts the rendezvous store and stops the
    other ranks with SIGTERM as soon as one exits: `latest` names a missing step. Two ranks started as DeepSpeed's
    launcher starts them (rank 0's process group hosts the store; each rank's exit code seen directly): a truncated
    model-states file. Both are refused on every rank alike, at the same point of setup."""
    out = tmp_path / "run"
    common = ("train.zero_stage=0", "train.precision=fp32", "train.checkpoint_every=2")
    proc = launch([sys.executable], toy2, out, *common, "train.stop_after=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    checkpoints = out / "train" / "checkpoints"
    (checkpoints / "latest").write_text("step-00000009")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    proc = launch(torchrun, toy2, out, *common)
    errors = error_lines(proc.stderr)
    codes = re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", proc.stderr, re.M)  # torchrun's report: each failed rank
    assert len(errors) == 1 and sorted(codes) == ["2", "2"], f"{errors}\nexit codes {codes}\n{proc.stderr[-3000:]}"
    assert errors[0] == (f"error: {checkpoints / 'latest'} names checkpoint 'step-00000009', but "
                         f"{checkpoints / 'step-00000009'} does not exist")

    (checkpoints / "latest").write_text("step-00000002")
    states = checkpoints / "step-00000002" / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[: states.stat().st_size // 2])
    cmd = [sys.executable, str(REPO / "train" / "main.py"), "--recipe", "tiny",
           *overrides(toy2["target"], out, f"train.cache_dir={toy2['cache']}", *common, steps=4)]
    ended = start_ranks(cmd, tmp_path)
    errors = [ln for _, err in ended for ln in error_lines(err)]
    assert len(errors) == 1 and [code for code, _ in ended] == [2, 2], "\n".join(err[-2000:] for _, err in ended)
    assert errors[0].startswith(f"error: checkpoint file {states} is unreadable") and "train.resume=false" in errors[0]


def test_a_setup_step_failing_on_one_rank_is_one_line_on_every_rank(tmp_path):
    """A setup step (`on_every_rank`) that fails on rank 1 only: every rank stops with the same line, printed once,
    naming the rank, what every rank needs and rank 1's own reason; both ranks exit with code 2."""
    script = ("from eagle.cli_errors import UserError, one_line_errors\n"
              "from train.distributed import destroy_process_groups, exit_process, init_distributed\n"
              "from train.main import on_every_rank\n"
              "@one_line_errors\n"
              "def main(argv):\n"
              "    ctx = init_distributed('cpu')\n"
              "    def step():\n"
              "        if ctx.rank == 1:\n"
              "            raise UserError('no data at /rank1/cache')\n"
              "    try:\n"
              "        on_every_rank(step, ctx.world_size, 'every rank needs the data')\n"
              "    finally:\n"
              "        destroy_process_groups()\n"
              "exit_process(main([]))\n")
    ended = start_ranks([sys.executable, "-c", script], tmp_path)
    errors = [ln for _, err in ended for ln in error_lines(err)]
    assert errors == ["error: rank 1 (node 0) could not set up (every rank needs the data): no data at /rank1/cache"], (
        "\n".join(err[-2000:] for _, err in ended))
    assert [code for code, _ in ended] == [2, 2]


def checkpoint_tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a ZeRO-0 checkpoint's model-states file (module weights and the optimizer state), by path."""
    state = weights_only_load(folder / "mp_rank_00_model_states.pt")
    flat = {}

    def walk(obj, path):
        if torch.is_tensor(obj):
            flat[path] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}.{i}")

    walk({k: state[k] for k in ("module", "optimizer")}, "")
    return flat


def deepspeed_launcher() -> str | None:
    """The `deepspeed` launcher script: on PATH, or next to this interpreter (a venv not activated)."""
    for cand in (shutil.which("deepspeed"), Path(sys.executable).parent / "deepspeed", REPO.parent / "venv" / "bin" / "deepspeed"):
        if cand and Path(cand).exists():
            return str(cand)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("kind,stage", [("eagle2", 1), ("eagle3", 3)])
def test_two_ranks_with_deepspeed_launcher_and_exact_resume(request, kind, stage, tmp_path):
    """`deepspeed --num_gpus 2` on a CPU-only machine starts 2 gloo ranks; 2N straight == N + resume + N: EAGLE-2 under
    ZeRO-1, EAGLE-3 under ZeRO-3 (parameters partitioned over the ranks: its loss reads the head's lm_head and norm
    outside the engine's forward)."""
    toy = request.getfixturevalue("toy2" if kind == "eagle2" else "toy3")
    ds = deepspeed_launcher()
    if ds is None:
        pytest.skip("deepspeed launcher not found")

    def run(out, *extra):
        proc = launch([ds, "--num_gpus", "2", "--master_port", str(free_port())], toy, out, f"train.zero_stage={stage}",
                      "train.checkpoint_every=3", *extra, steps=6)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads((out / "train" / "summary.json").read_text())

    straight = run(tmp_path / "straight")
    run(tmp_path / "resumed", "train.stop_after=3")
    resumed = run(tmp_path / "resumed")
    assert straight["world_size"] == resumed["world_size"] == 2 and resumed["steps"] == 6
    a = load_file(tmp_path / "straight" / "head" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "head" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert straight["eval"] == resumed["eval"]
    if kind == "eagle3":  # trained, also the parts only the loss calls (outside the engine's forward) under ZeRO-3
        target_lm_head = load_file(toy["target"] / "model.safetensors")["lm_head.weight"]
        draft_ids = torch.arange(a["d2t"].numel()) + a["d2t"]
        assert not torch.equal(a["lm_head.weight"], target_lm_head[draft_ids])  # warm start: the target's rows
        assert not torch.equal(a["norm.weight"], torch.ones_like(a["norm.weight"]))


@pytest.mark.parametrize("code", [0, 3])
def test_exit_process_flushes_and_keeps_the_code(code, tmp_path):
    """A rank that joined a process group leaves through `exit_process`: on success without interpreter teardown
    (os._exit), so output still buffered in a pipe must be flushed first; a failure code exits normally."""
    script = ("from train.distributed import exit_process, init_distributed, shutdown_distributed\n"
              "init_distributed('cpu')\n"
              "print('trained', flush=False)\n"
              "shutdown_distributed()\n"
              f"exit_process({code})\n")
    env = {k: v for k, v in subprocess_env().items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered, as in a pipe
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "trained"
