"""Shared pieces of the trainer tests (no tests here): a tiny random Llama target saved to disk, a feature
cache written from its forward with FeatureCacheWriter, and the recipe overrides that point `tiny` at them."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch

from data_prep.feature_cache import FeatureCacheWriter
from data_prep.target import target_config_hash
from float_tolerance import LAYER_REDUCTIONS, assert_same_function
from tiny_models import TEST_THREADS, tiny_llama

REPO = Path(__file__).resolve().parent.parent
VOCAB = 256
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@contextmanager
def gloo_world():
    """An in-process gloo world of size 1 at one thread, with any launcher's rank variables hidden; on exit every
    group (DeepSpeed's cached ones too) is destroyed and the environment and thread count are restored."""
    from train.distributed import destroy_process_groups, init_distributed

    saved = {k: os.environ.pop(k, None) for k in DIST_ENV}
    threads = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)  # tiny models: threads only add contention
    try:
        yield init_distributed("cpu")
    finally:
        destroy_process_groups()
        torch.set_num_threads(threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def toy_sequences(n: int, seed: int = 0, min_len: int = 8, max_len: int = 40) -> list[torch.Tensor]:
    """Learnable toy token streams: arithmetic progressions mod VOCAB with a per-record start and stride."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        T = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        start, stride = int(torch.randint(0, VOCAB, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        out.append((start + stride * torch.arange(T)) % VOCAB)
    return out


def save_target(path: Path, lm_head_scale: float = 8.0, **kw) -> Path:
    """A tiny random Llama as a HF folder (weights in model.safetensors). Its lm_head is scaled up so the
    next-token distributions are peaked, as in a trained LM (random init gives near-uniform ones, whose
    soft CE is almost all entropy and cannot show learning)."""
    model = tiny_llama(vocab_size=VOCAB, **kw)
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
    model.save_pretrained(path)
    return path


@torch.no_grad()
def write_cache(cache: Path, target: Path, n: int = 96, seed: int = 0, nan_ids: tuple[str, ...] = (),
                meta_override: dict | None = None, dtype: str = "float32", layers: list[int] | None = None) -> Path:
    """Feature cache of the target's last hidden states on toy sequences (loss on every token but the first 2);
    `layers` (EAGLE-3: aux ids + L): those hidden states concatenated, as data_prep writes them."""
    from transformers import AutoModelForCausalLM

    from data_prep.feature_layers import target_features

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    meta = {"target": str(target), "config_hash": target_config_hash(model.config),
            "hidden_size": model.config.hidden_size, "vocab_size": model.config.vocab_size, **(meta_override or {})}
    if layers is not None:
        meta["feature_layers"] = list(layers)
    w = FeatureCacheWriter(cache, meta, dtype=dtype)
    for i, ids in enumerate(toy_sequences(n, seed)):
        hidden = target_features(model.model, ids[None], None, layers)[0]  # [T, W]
        rid = f"r{i:04d}"
        if rid in nan_ids:
            hidden = torch.full_like(hidden, float("nan"))
        mask = torch.ones(len(ids), dtype=torch.long)
        mask[:2] = 0  # a "prompt" the loss skips
        w.add(rid, ids, hidden, mask)
    w.close()
    return cache


def overrides(target: Path, out: Path, *extra: str, steps: int = 6) -> list[str]:
    """`tiny` pointed at a toy target/run dir, quiet, exporting fp32, with a small number of steps."""
    return [f"target.path={target}", f"output_dir={out}", f"train.max_steps={steps}", "train.warmup_steps=2",
            "logging.backend=none", "logging.progress=false", "train.eval_fraction=0.1", "train.rollout_starts=4",
            "train.micro_batch_size=4", "train.keep_last=2", *extra]


def subprocess_env(threads: int = 1) -> dict:
    """Environment for a trainer subprocess: no inherited rank variables, offline logging, few threads."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(OMP_NUM_THREADS=str(threads), WANDB_MODE="disabled", PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    return env


def assert_same_training(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], steps: int, terms: int = VOCAB,
                         what: str = "") -> None:
    """Two runs that trained on the same micro-batches for `steps` optimizer steps, on different numbers of ranks
    (tensors by name: head weights, or a checkpoint's weights and Adam moments). Equal up to rounding, not bit for
    bit: (a + b) / 2 == a/2 + b/2 exactly, but that also needs each micro-batch's own gradient to come out the same
    bits in another process, which PyTorch does not promise and one CI machine did not deliver (a 1-rank ZeRO-0
    run's Adam moments 2 ulps from the 2-rank run's, which matched this box's; docs/results/resume-ranks.md: not
    reproduced here, cause unknown). Per step the backward runs through one decoder layer plus the fc and lm_head
    products; `terms`: its longest reduction (the vocabulary, or the positions of a micro-batch). Adam's moments are
    compared at the scale of the model's largest one (a backward's rounding is relative to the gradients flowing
    through it, and a weight whose gradient cancels to ~1e-8 still rounds at that scale); the second moment is
    quadratic in the gradient (twice the relative error). Step counters are compared exactly. A lost or repeated
    micro-batch moves a moment by its own scale and a weight by ~lr, orders of magnitude above these bounds."""
    assert a.keys() == b.keys(), what
    chained = steps * (LAYER_REDUCTIONS + 2)
    largest = {kind: max((float(t.abs().max()) for k, t in b.items() if k.endswith(kind)), default=0.0)
               for kind in (".exp_avg", ".exp_avg_sq")}
    for k in a:
        x, y = a[k], b[k]
        if not y.is_floating_point() or k.endswith(".step"):
            assert x.equal(y), f"{k} {what}"
        elif k.endswith(".exp_avg_sq"):
            assert_same_function(x, y, terms=terms, chained=2 * chained, magnitude=largest[".exp_avg_sq"],
                                 msg=f"{k} {what}")
        elif k.endswith(".exp_avg"):
            assert_same_function(x, y, terms=terms, chained=chained, magnitude=largest[".exp_avg"], msg=f"{k} {what}")
        else:
            assert_same_function(x, y, terms=terms, chained=chained, msg=f"{k} {what}")
