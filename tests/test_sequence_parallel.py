"""Sequence parallelism (train.sequence_parallel_size, train/sequence_parallel.py: DeepSpeed Ulysses) on 2 gloo ranks:
one record's loss and gradients split over the ranks equal the whole record's on one rank within
tests/float_tolerance.py's bound (EAGLE-3 and P-EAGLE, full attention and a window, row strides, MQA's replicated kv
head, the chunked token loss); the trainer on 2 ranks equals the 1-rank run, and its resume continues it exactly;
the refusals are one line each."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from recipes import RecipeError, load_config
from test_train_helpers import REPO, assert_same_training, overrides, save_target, subprocess_env, write_cache
from test_train_multiproc import EAGLE3, free_port
from tiny_models import tiny_llama
from train.head_kinds import training_kind
from train.plan import Hardware, memory_items, plan_shape
from train.sequence_parallel import sequence_parallel_problem

WORKER = Path(__file__).resolve().parent / "sequence_parallel_worker.py"


def worker_env() -> dict:
    """The trainer subprocess environment, with tests/ importable too (the worker imports its helpers by name)."""
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env["PYTHONPATH"]])
    return env


def torchrun(n: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port",
            str(free_port())]


# kind, record positions, row stride, window (0 = full attention), kv heads (1: replicated over the 2 ranks), chunk
# (~25 s a launch: the first in the default tier, all under -m slow)
CASES = [("eagle3", 37, 2, 0, 1, 16), pytest.param(("eagle3", 37, 1, 0, 2, 0), marks=pytest.mark.slow),
         pytest.param(("peagle", 41, 2, 8, 2, 0), marks=pytest.mark.slow)]


@pytest.mark.multiproc
@pytest.mark.numeric
@pytest.mark.parametrize("case", CASES, ids=["eagle3-stride2-mqa-chunk16", "eagle3-full", "peagle-window8"])
def test_split_record_equals_whole_record(case):
    """The worker (tests/sequence_parallel_worker.py) asserts loss, step-1 token loss and every gradient (averaged
    over the ranks, as DeepSpeed does) against the 1-rank computation in float64, and the counts / hits exactly."""
    proc = subprocess.run([*torchrun(), str(WORKER), *map(str, case)], env=worker_env(), capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "OK " in proc.stdout, proc.stdout[-2000:]


def test_refusals_are_one_line():
    target = tiny_llama(num_layers=4, num_heads=4, num_kv_heads=2)
    base = ["head.aux_layers=[1,2,3]", "train.micro_batch_size=1"]
    cfg = load_config("tiny-eagle3", [*base, "train.sequence_parallel_size=2"])
    part = training_kind(cfg, target.config)
    assert sequence_parallel_problem(cfg.train, part, 2, 4, 2) is None
    assert sequence_parallel_problem(cfg.train, part, 3, 4, 2) == \
        "train.sequence_parallel_size=2 does not divide the run's 3 ranks"
    cfg3 = load_config("tiny-eagle3", [*base, "train.sequence_parallel_size=3"])
    assert "does not split the head's 4 attention / 2 kv heads" in sequence_parallel_problem(cfg3.train, part, 3, 4, 2)
    cfg2 = load_config("tiny", ["train.micro_batch_size=1", "train.sequence_parallel_size=2"])
    assert sequence_parallel_problem(cfg2.train, training_kind(cfg2, target.config), 2, 4, 2) == \
        "train.sequence_parallel_size=2: head.kind=eagle2 trains whole records only (EAGLE-3 and P-EAGLE split them)"
    with pytest.raises(RecipeError, match=r"train\.micro_batch_size.*expected 1 with train\.sequence_parallel_size=2"):
        load_config("tiny-eagle3", ["train.sequence_parallel_size=2"])
    dpace = load_config("tiny-eagle3", [*base, "train.sequence_parallel_size=2", "loss.position_weighting=dpace"])
    assert "dpace" in sequence_parallel_problem(dpace.train, training_kind(dpace, target.config), 2, 4, 2)


def test_a_padded_micro_batch_is_refused():
    """Sequence parallelism splits one unpadded record: a padded batch (two records) is one clear error."""
    target = tiny_llama(num_layers=4)
    cfg = load_config("tiny-eagle3", ["head.aux_layers=[1,2,3]", "train.micro_batch_size=1",
                                      "train.sequence_parallel_size=2"])
    part = training_kind(cfg, target.config)
    ids = torch.zeros(2, 9, dtype=torch.long)
    s = SimpleNamespace(next_ids=ids[:, 1:], attention_mask=torch.ones(2, 8))
    with pytest.raises(ValueError, match="one unpadded record per micro-batch, got 2 records"):
        part.sharded_loss(None, s, None, None, 0, SimpleNamespace(size=2))


def test_the_plan_counts_a_ranks_span():
    """train.plan per rank under sequence parallelism: the step's rows (head activations, backward transients, the
    token loss) are the span's (1/n of the record, the 1-rank items' 1/n within rounding of the span), the span copy
    is added, and what every rank holds whole (the record's features as loaded, the frozen weights) is unchanged."""
    target = tiny_llama(num_layers=4).config

    def items(n: int) -> dict[str, float]:
        cfg = load_config(None, ["head.kind=eagle3", "head.aux_layers=[1,2,3]", "head.ttt_steps=3",
                                 "data.max_length=16384", "train.micro_batch_size=1", "train.precision=fp32",
                                 "train.loss_chunk=256", f"train.sequence_parallel_size={n}"])
        return {i.name: i.bytes for i in memory_items(cfg, Hardware(host=True), plan_shape(cfg, target))}

    one, two = items(1), items(2)
    for name in ("head activations", "backward transients", "token-loss checkpoints"):
        assert two[name] == pytest.approx(one[name] / 2, rel=0.01), name
    assert "sequence-parallel span" in two and "sequence-parallel span" not in one
    assert two["micro-batch features"] == one["micro-batch features"]


@pytest.fixture(scope="module")
def toy3(tmp_path_factory):
    """A 4-layer toy target + an EAGLE-3 cache (aux layers 1, 2, 3 + the final state)."""
    root = tmp_path_factory.mktemp("sp-toy3")
    target = save_target(root / "target", num_layers=4)
    return {"target": target, "cache": write_cache(root / "cache", target, n=24, layers=[1, 2, 3, 4])}


def train_run(launcher: list[str], toy, out: Path, *extra: str, steps: int = 4):
    cmd = [*launcher, str(REPO / "train" / "main.py"), "--recipe", "tiny",
           *overrides(toy["target"], out, f"train.cache_dir={toy['cache']}", *EAGLE3, "train.micro_batch_size=1",
                      "train.grad_accum=2", "train.zero_stage=0", "train.precision=fp32", "train.checkpoint_every=2",
                      *extra, steps=steps)]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=600, cwd=out.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.slow
@pytest.mark.multiproc
def test_trainer_on_two_ranks_equals_one_rank_and_resumes(toy3, tmp_path):
    """The trainer with train.sequence_parallel_size=2 on 2 torchrun ranks (1 data-parallel group: the 1-rank run's
    micro-batches, each record split over the ranks) ends where the 1-rank run ends, within
    tests/test_train_helpers.py's assert_same_training bound; stopped at step 2 and resumed on the same 2 ranks it
    ends bit for bit where the uninterrupted 2-rank run ends."""
    sp = ("train.sequence_parallel_size=2",)
    one = train_run([sys.executable], toy3, tmp_path / "one")
    two = train_run(torchrun(), toy3, tmp_path / "two", *sp)
    assert "sequence parallelism: each record split over 2 ranks" in two.stdout
    train_run(torchrun(), toy3, tmp_path / "resumed", *sp, "train.stop_after=2")
    resumed = train_run(torchrun(), toy3, tmp_path / "resumed", *sp)
    assert "resumed from" in resumed.stdout
    heads = {run: load_file(tmp_path / run / "head" / "model.safetensors") for run in ("one", "two", "resumed")}
    assert_same_training(heads["two"], heads["one"], 4, what="(2 ranks, sequence parallel, vs 1 rank)\n"
                         + one.stdout[-1500:] + "\n" + two.stdout[-1500:])
    for k in heads["two"]:
        assert torch.equal(heads["resumed"][k], heads["two"][k]), k
