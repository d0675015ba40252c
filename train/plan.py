"""Memory / disk / time plan for a recipe before a multi-day run: does it fit these GPUs and disks, and how long?

    python -m train.plan --recipe llama3-8b --gpus 8 --gpu-mem-gb 24          # 8 x RTX 3090 (one node)
    python -m train.plan --recipe llama3-8b --gpus 8 --nodes 2 train.micro_batch_size=4
    python -m train.plan --recipe llama3-8b --host                            # one CPU process (what this box measures)

Per rank (GPU) memory, worst case micro-batch (every sequence data.max_length tokens, every position a loss
position):
  * model states: the head's trainable parameters, gradients, fp32 master copy and AdamW moments under the
    recipe's ZeRO stage and precision: DeepSpeed's own estimators (estimate_zero2/3_model_states_mem_needs) for
    ZeRO-2/3 mixed precision, the same accounting written out for ZeRO-0/1 and fp32 (see `model_states`);
  * frozen target parts the trainer holds: the head's copy of the embedding and the lm_head, in the compute
    dtype (online mode: the whole target in target.dtype);
  * activations of the head layer kept for backward (per token: ~9 H + 2 kv D + 4 I values in the compute dtype
    + ~4 H float32 values of the loss and norm; attention by SDPA's flash / memory-efficient kernels, O(T));
  * the token loss: [rows, V] float32 logits, softmax and log-softmax of head and target, rows = all N loss
    positions, or train.loss_chunk of them (train/loss.py: ChunkedTokenLoss) plus its [N, H] gradient; EAGLE-3 /
    P-EAGLE: one chunk's target and draft logits (DraftVocabTargets.chunked, recomputed in the backward);
  * DeepSpeed buffers from the generated config: the contiguous-gradient (reduce) bucket, the all-gather
    bucket, ZeRO-3 prefetch; plus the CUDA context and a fragmentation reserve.
Inter-node traffic per optimizer step (`traffic_items`), the volumes of ring collectives over N = nodes x gpus ranks
(a ring crosses each node boundary once, so each node's network link carries what one rank sends): a gradient
all-reduce 2 (N-1)/N x P x gradient bytes once per step for ZeRO-0/1; ZeRO-2 reduce-scatters the gradients at every
accumulation micro-step ((N-1)/N P each) and all-gathers the updated 16-bit parameters once; ZeRO-3 also
all-gathers the parameters for the forward and again for the backward at every micro-step (the ZeRO paper's 1.5x of
plain data parallelism). Its time at a stated network bandwidth (--net-gbps, default 25 Gb/s Ethernet) is added to
the training time (not overlapped with compute: an upper bound).
Disk: feature cache = bytes/token (data_prep/feature_cache.py) x tokens, per cache dtype. Time: FLOPs at a
stated fraction (MFU) of a stated GPU peak (RTX 3090: 71 TFLOPS dense fp16/bf16 tensor-core, NVIDIA Ampere
GA102 whitepaper, Table 9; 35.6 TFLOPS fp32), and decoding (regeneration) at a stated fraction of the memory
bandwidth (936 GB/s). Every assumption is a command-line option and is printed.

Host mode (--host): the same breakdown for ONE CPU process in the CPU dtype (what benchmarks/real_shape.py
measures as peak RSS): no CUDA context and no allocator reserve, DeepSpeed buckets count only the part a
model of this size writes (CPU pages are committed on first touch, GPU buffers at allocation), plus the
tensors only the host holds (the target's embedding as read from disk) and the Python/torch/DeepSpeed runtime.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

from data_prep.default_target import built_default_target, default_target_config
from data_prep.docstring_corpus import default_conversations
from data_prep.feature_cache import bytes_per_token, merge_manifests
from data_prep.feature_shard import RECORD_HEADER_BYTES
from data_prep.target import load_target_config, resolve_target_path
from eagle.cli_errors import ArgumentParser, bounded, one_line_errors
from eagle.sliding_window import WINDOW_QUERY_BLOCK, window_size
from eagle.unroll import UNROLL_ROW_CHUNKS
from eagle.head_config import head_config_from_target
from eagle.head_kinds import text_config
from recipes import add_print_config, command_config, layout
from recipes.head import check_head_fits_target, head_options, section_kind
from train.distributed import import_deepspeed
from train.ds_config import deepspeed_config
from train.head_kinds import training_class
from train.stream import window_bytes

GB = 1e9

# Published config.json shape keys of the shipped recipes' targets (the hubs are gated / offline here), so the
# plan runs without downloading them. A local folder or reachable hub id is read with AutoConfig instead.
KNOWN_TARGETS: dict[str, dict] = {
    "meta-llama/Meta-Llama-3-8B-Instruct": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128009),
    "meta-llama/Llama-2-7b-chat-hf": dict(
        model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "lmsys/vicuna-7b-v1.3": dict(
        model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "Qwen/Qwen2-7B-Instruct": dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": dict(
        model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
        bos_token_id=1, eos_token_id=2),
}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Shipped-recipe data: ShareGPT_V4.3_unfiltered_cleaned_split.json has ~68k conversations; after regeneration
# with the target (<= 512 new tokens per reply) and truncation to 2048 tokens we assume 1,000 tokens per record
# on average (stated assumption; a finished cache's manifest replaces it with the real count).
DEFAULT_RECORDS = 68_000
DEFAULT_TOKENS_PER_RECORD = 1000


class PlanError(ValueError):
    """The plan cannot be made (unknown target shape, bad option); the message says what to pass."""


@dataclass
class Hardware:
    gpus: int = 8  # per node
    nodes: int = 1
    gpu_mem_gb: float = 24.0  # per GPU, decimal GB as on the spec sheet (RTX 3090: 24 GB)
    tflops: float = 71.0  # dense fp16/bf16 tensor-core peak (RTX 3090)
    mfu: float = 0.35  # achieved fraction of peak for training / prefill (stated assumption)
    mem_bw_gbs: float = 936.0  # HBM/GDDR bandwidth (RTX 3090: 936 GB/s)
    decode_eff: float = 0.6  # achieved fraction of bandwidth when generating (stated assumption)
    cuda_context_gb: float = 0.8  # CUDA context + cuBLAS/cuDNN workspaces per process (typical, torch 2.x on Ampere)
    reserve: float = 0.10  # fraction of GPU memory kept free for allocator fragmentation
    host: bool = False  # one CPU process instead of GPUs (see module docstring)
    host_runtime_gb: float = 0.55  # RSS of Python + torch + transformers + DeepSpeed after import (measured here)
    net_gbps: float = 25.0  # inter-node network per node, Gbit/s (25 GbE; InfiniBand HDR: 200)

    @property
    def world(self) -> int:
        return 1 if self.host else self.gpus * self.nodes


@dataclass
class Shape:
    """What the plan needs of the target and the head."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    max_positions: int
    target_params: int  # all parameters of the target
    target_active_params: int  # per token (MoE: the routed experts only)
    head_trainable: int  # trainable head parameters
    head_largest: int  # largest trainable tensor (ZeRO-3 estimator)
    kind: str = ""  # the head kind's name
    draft_vocab: int = 0  # tokens one draft step scores (eagle3: its own lm_head rows; eagle2: the target's vocabulary)
    ttt_steps: int = 1  # unrolled steps, each a full head pass (eagle3: head.ttt_steps; eagle2: head.align_steps)
    ttt_row_stride: int = 1  # steps >= 2 run at every n-th position only (head.ttt_row_stride / head.align_row_stride)
    cache_row: int = 1  # hidden states cached per token (eagle2 1 = last layer; eagle3 4 = 3 aux + last)
    draft_layers: int = 1  # decoder layers of the head (dflash: head.draft_layers)
    block_size: int = 1  # rows of one drafted block (dflash: head.block_size)
    block_rows: int = 0  # block query rows trained per record (dflash: head.anchors x head.block_size)
    record_tokens: int = 0  # data.max_length: the tokens of a record the block rows are counted against
    target_source: str = ""  # where the target's shape was read (printed with the plan's assumptions)


@dataclass
class Item:
    name: str
    bytes: float
    note: str = ""
    knob: str = ""  # what reduces it
    phases: tuple[str, ...] = ()  # the PHASES of a step it is live in; () = held all run


PHASES = ("forward", "backward", "step")  # forward (+ loss), backward, optimizer step
FWD, BWD, FWD_BWD, STEP = ("forward",), ("backward",), ("forward", "backward"), ("step",)


def peak_bytes(items: list[Item]) -> tuple[float, str]:
    """(peak, phase): what is held all run + what is live in the fullest phase of a training step.

    The loss's vocabulary-wide logits exist only in the forward, the gradients of the SwiGLU only in the backward,
    activations in both, and what the optimizer step allocates is gone before the next forward: summing all of
    them over-predicts. Measured at Llama-3-8B shape on CPU (benchmarks/real_shape.py --phases): the peak is the
    optimizer step at micro-batch 1-2 and the backward at 4."""
    per = phase_bytes(items)
    phase = max(PHASES, key=lambda ph: per[ph])
    return per[phase], phase


def phase_bytes(items: list[Item]) -> dict[str, float]:
    """{phase: bytes live during it}: what is held all run + the items of that phase."""
    held = sum(i.bytes for i in items if not i.phases)
    return {ph: held + sum(i.bytes for i in items if ph in i.phases) for ph in PHASES}


@dataclass
class Plan:
    hw: Hardware
    shape: Shape
    memory: list[Item] = field(default_factory=list)
    disk: list[Item] = field(default_factory=list)
    time: list[Item] = field(default_factory=list)  # "bytes" holds seconds here
    traffic: list[Item] = field(default_factory=list)  # inter-node bytes per optimizer step, per node
    verdict: str = ""
    fits: bool = False
    knobs: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)  # what the plan took as given (printed, and in --json)
    stream: list[str] = field(default_factory=list)  # train.mode=stream: the window, each side's throughput, which to scale

    @property
    def total(self) -> float:
        """Peak bytes (the allocator reserve, once appended, is held all run)."""
        return peak_bytes(self.memory)[0]

    @property
    def peak_phase(self) -> str:
        return peak_bytes(self.memory)[1]


# ----------------------------------------------------------------------------- shapes
def target_config(cfg):
    """(HF config of the recipe's target, where it came from): a local folder, the KNOWN_TARGETS table, or the Hub.
    The embedded default target (target.path "") is read where it is built; when it is not built yet, its
    architecture comes from its build recipe: a plan never builds a target or starts any other job."""
    # lazy: transformers costs over a second at import; the plan's --help and its table of known shapes do not need it
    from transformers import AutoConfig

    if not cfg.target.path:
        built = built_default_target()
        if built is not None:
            return load_target_config(built), f"the embedded default target built at {built}"
        return default_target_config(), ("the embedded default target's architecture from its build recipe "
                                         "(data_prep/default_target.py; not built yet: data prep or the demo builds it)")
    path = resolve_target_path(cfg.target)
    if Path(path).is_dir():
        return load_target_config(path), f"config.json of {path}"
    if path in KNOWN_TARGETS:
        known = dict(KNOWN_TARGETS[path])
        return AutoConfig.for_model(known.pop("model_type"), **known), f"the published config of {path} (train/plan.py)"
    try:
        return AutoConfig.from_pretrained(path, revision=cfg.target.revision), f"config.json of {path} on the Hub"
    except Exception as e:  # offline / gated / typo: say what would work
        raise PlanError(f"cannot read the config of target {path!r} ({type(e).__name__}: {e}); pass target.path=<local "
                        f"folder with config.json> or one of {sorted(KNOWN_TARGETS)}") from None


def count_target_params(config) -> tuple[int, int]:
    """(all, active per token) parameters of a target config, counted on the meta device (no weights)."""
    # lazy: transformers' model classes cost seconds at import; --help does not need them
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total, experts = 0, 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".experts." in name or ".experts" in name.rsplit(".", 1)[0]:
            experts += p.numel()
    c = text_config(config)
    n_exp, k = getattr(c, "num_local_experts", 0) or getattr(c, "num_experts", 0), getattr(c, "num_experts_per_tok", 0)
    active = total - experts + (experts * k // n_exp if n_exp and k else experts)
    return total, active


def plan_shape(cfg, config=None) -> Shape:
    """Target and head shape for `cfg`: the recipe's head built by its kind on the meta device (its trainable
    parameters counted, never a per-kind formula), its unrolled steps and cached states from the kind's options."""
    source = "the run's target"
    if config is None:
        config, source = target_config(cfg)
    check_head_fits_target(cfg.head, config)  # what training would refuse (aux layers, draft vocabulary)
    c = text_config(config)
    options = head_options(cfg.head)  # a recipe.yaml of an older export without head.kind: the default kind's
    hc = head_config_from_target(config, bias=cfg.head.bias, kind=section_kind(cfg.head).name, options=options)
    with torch.device("meta"):
        head = hc.head_kind.module(hc)
    trainable = [p.numel() for p in head.parameters() if p.requires_grad]
    total, active = count_target_params(config)
    H, D, L = hc.hidden_size, hc.head_dim, c.num_hidden_layers
    return Shape(hidden=H, intermediate=hc.intermediate_size, heads=hc.num_attention_heads,
                 kv_heads=hc.num_key_value_heads, head_dim=D, vocab=hc.vocab_size, layers=L,
                 max_positions=hc.max_position_embeddings, target_params=total, target_active_params=active,
                 head_trainable=sum(trainable), head_largest=max(trainable), kind=hc.kind,
                 draft_vocab=hc.head_kind.draft_vocab_size(hc), ttt_steps=options.steps,
                 ttt_row_stride=options.row_stride, cache_row=len(hc.head_kind.feature_layers(options, L) or [L]),
                 target_source=source, record_tokens=int(cfg.data.max_length), **options.plan_fields())


# ----------------------------------------------------------------------------- memory
def deepspeed_zero(cfg) -> dict:
    """The zero_optimization section DeepSpeed will run with (generated config + DeepSpeed's own defaults)."""
    import_deepspeed()  # its log lines to stderr: --json prints only JSON on stdout
    # lazy: deepspeed costs a second at import (--help does not need it)
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ds = deepspeed_config(cfg.train, total_steps=1, world_size=1, on_cpu=False)
    return DeepSpeedZeroConfig(**ds["zero_optimization"]).model_dump()


def model_states(P: int, largest: int, stage: int, precision: str, world: int, gpus_per_node: int, nodes: int,
                 offload: bool, host: bool) -> list[Item]:
    """Head parameters / gradients / fp32 master / AdamW moments per rank (bytes)."""
    import_deepspeed()  # its log lines to stderr: --json prints only JSON on stdout
    # lazy: deepspeed costs a second at import (--help does not need it)
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    mixed = precision != "fp32"
    p_bytes = 2 if mixed else 4
    n = world
    if mixed and stage >= 2 and not host:  # DeepSpeed's estimators (GPU bytes): 2P + 18P/N (ZeRO-2), 4 L + 18P/N (ZeRO-3)
        if stage == 2:
            _, gpu = estimate_zero2_model_states_mem_needs(P, gpus_per_node, nodes, cpu_offload=offload)
            params = 2 * P
        else:
            _, gpu, largest_mem = estimate_zero3_model_states_mem_needs(P, largest, gpus_per_node, nodes,
                                                                         cpu_offload=offload, cpu_offload_params=False)
            params = largest_mem
        rest = gpu - params  # DeepSpeed: 16-bit + fp32 grads 6P/N, fp32 master 4P/N, AdamW 8P/N
        if offload:
            return [Item("head params (16-bit)", gpu, "DeepSpeed estimator, optimizer offloaded to CPU")]
        return [Item("head params (16-bit)" if stage == 2 else "head params (ZeRO-3 live layer)", params,
                     "estimate_zero%d_model_states_mem_needs" % stage),
                Item("head grads (16 + 32-bit)", rest * 6 / 18, f"partitioned /{n}", "zero_stage"),
                Item("fp32 master params", rest * 4 / 18, f"partitioned /{n}", "zero_stage"),
                Item("AdamW moments (fp32)", rest * 8 / 18, f"partitioned /{n}", "zero_stage / offload_optimizer")]
    # ZeRO-0/1 and fp32 (and host mode): what DeepSpeed's ZeRO-1/2 optimizer allocates. It keeps its own fp32
    # partition ("single_partition_of_fp32_groups", a copy even when training in fp32) and an fp32 gradient
    # partition; ZeRO-0 keeps full fp32 grads and, mixed, a full fp32 master.
    part = 1 if stage == 0 else n
    params = (largest * p_bytes if stage == 3 else P * p_bytes)
    grads16 = (P * p_bytes / (n if stage >= 2 else 1)) if mixed else 0
    items = [Item("head params" + (" (16-bit)" if mixed else " (fp32)"), params, "" if stage < 3 else "ZeRO-3 live layer")]
    if grads16:
        items.append(Item("head grads (16-bit)", grads16, f"/{n}" if stage >= 2 else "full", "zero_stage"))
    # host: DeepSpeed fills the gradient partition at the end of backward and frees it after the step
    items.append(Item("head grads (fp32 partition)", 4 * P / (n if stage >= 2 else 1), "", "zero_stage",
                      STEP if host else ()))
    if mixed or stage >= 1:
        items.append(Item("fp32 master params", 4 * P / part, f"/{part}", "zero_stage"))
    if offload:
        items.append(Item("AdamW moments", 0, "offloaded to CPU", ""))
    else:
        items.append(Item("AdamW moments (fp32)", 8 * P / part, f"/{part}", "zero_stage / offload_optimizer"))
        if host:  # torch's AdamW (DeepSpeed's torch_adam on CPU): sqrt(v) of its foreach path, and ZeRO-1/2's flat
            copies = 2 if stage in (1, 2) else 1  # fp32 gradient partition handed to it
            items.append(Item("optimizer step temporaries", copies * 4 * P / part,
                              "AdamW sqrt(v)" + (" + flat fp32 grad copy" if copies == 2 else ""), "zero_stage", STEP))
    return items


def activation_bytes_per_token(s: Shape, cb: int, step: int = 1, keys: float = 0.0) -> float:
    """Bytes autograd keeps for backward per row of one head forward (per head kind: train/head_kinds.py,
    `activation_bytes`; tests/test_plan.py pins them against saved_tensors_hooks), + the [I] gradients of gate/up."""
    return training_class(s.kind).activation_bytes(s, cb, step, keys) + backward_transient_bytes_per_token(s, cb)


def backward_transient_bytes_per_token(s: Shape, cb: int) -> float:
    """What the backward allocates per row beyond the kept activations: the gradients of gate/up [T, I]."""
    return 2 * s.intermediate * cb


def memory_items(cfg, hw: Hardware, shape: Shape) -> list[Item]:
    """Per-rank (or, host mode, per-process) memory breakdown of recipe `cfg` (bytes; no allocator reserve)."""
    t = cfg.train
    s = shape
    precision = "fp32" if hw.host and t.precision == "fp16" else t.precision  # DeepSpeed on CPU: no fp16
    cb = COMPUTE_BYTES[precision]
    P = s.head_trainable
    B, T = t.micro_batch_size, cfg.data.max_length
    n_tok = B * T
    world = hw.world
    zero = deepspeed_zero(cfg)
    mem = []
    if hw.host:
        mem.append(Item("Python/torch/DeepSpeed runtime", hw.host_runtime_gb * GB, "RSS after imports"))
    else:
        mem.append(Item("CUDA context + workspaces", hw.cuda_context_gb * GB, "assumption"))
    mem += model_states(P, s.head_largest, t.zero_stage, precision, world, hw.gpus, hw.nodes, t.offload_optimizer,
                        hw.host)
    VH = s.vocab * s.hidden
    tdt = DTYPE_BYTES[cfg.target.dtype]
    if t.mode in ("offline", "stream"):  # stream: the producer process holds the target, not the trainer
        mem.append(Item("frozen embedding (head copy)", VH * cb, f"[{s.vocab}, {s.hidden}] in compute dtype"))
        mem.append(Item("frozen lm_head", VH * cb, f"[{s.vocab}, {s.hidden}] in compute dtype"))
        if hw.host:
            mem.append(Item("target embedding as read (host)", VH * tdt, f"target.dtype {cfg.target.dtype}"))
    else:
        mem.append(Item("frozen target (online mode)", s.target_params * tdt, f"{s.target_params / 1e9:.1f}B params "
                        f"in {cfg.target.dtype}", "train.mode=offline (feature cache)"))
        mem.append(Item("frozen embedding (head copy)", VH * cb, "compute dtype"))
        if cb != tdt:
            mem.append(Item("frozen lm_head (compute dtype copy)", VH * cb, ""))
        mem.append(Item("target forward (no grad)", n_tok * (2 * s.hidden + 2 * s.intermediate) * tdt, "one layer live"))
    mem.append(Item("micro-batch features", n_tok * s.hidden * s.cache_row * (4 + cb),
                    f"{B} x {T} tokens, fp32 + compute dtype", "train.micro_batch_size / data.max_length", FWD_BWD))
    part = training_class(s.kind)
    # train.sequence_parallel_size n: each rank holds the whole record's features as loaded, then its 1/n span of
    # them and of every step's rows (its attention: the whole record's rows for 1/n of the heads, the same bytes)
    sp = t.sequence_parallel_size
    n_rank = math.ceil(n_tok / sp)
    if sp > 1:
        mem.append(Item("sequence-parallel span", n_rank * s.hidden * s.cache_row * cb,
                        f"1/{sp} of the record's features (compute dtype)", "train.sequence_parallel_size", FWD_BWD))
    rows = part.unrolled_rows(s, n_rank)
    # steps >= 2 read on average (1 + 1/chunks) / 2 of the T step-1 keys; under head.sliding_window W, a block of
    # WINDOW_QUERY_BLOCK rows (every ttt_row_stride-th index) reads W - 1 + its span keys (eagle/sliding_window.py)
    window = window_size(head_options(cfg.head))
    keys = T * (1 + 1 / UNROLL_ROW_CHUNKS) / 2 if window is None else min(
        T, window - 1 + WINDOW_QUERY_BLOCK * s.ttt_row_stride)
    act = activation_bytes_per_token(s, cb) * rows[0] + sum(
        activation_bytes_per_token(s, cb, step=j, keys=keys) * r for j, r in enumerate(rows[1:], start=2))
    if len(rows) > 1:  # the unroll's contiguous copy of the step-1 keys and values, read by every later step
        act += rows[0] * 2 * s.kv_heads * s.head_dim * cb
    transient = backward_transient_bytes_per_token(s, cb) * sum(rows)
    steps = "" if s.ttt_steps == 1 else f" x {s.ttt_steps} unrolled steps (steps >= 2 at 1/{s.ttt_row_stride} of the rows)"
    per_rank = f", 1/{sp} per rank" if sp > 1 else ""
    mem.append(Item("head activations", act - transient, f"{B} x {T} tokens{steps}{per_rank}",
                    "train.micro_batch_size / data.max_length", FWD_BWD))
    mem.append(Item("backward transients", transient, "SwiGLU gate/up gradients",
                    "train.micro_batch_size / data.max_length", BWD))
    mem += [Item(*item) for item in part.loss_memory(t, s, n_rank, cb)]
    # DeepSpeed buffers (ZeRO-1/2: contiguous-gradient reduce bucket(s), all-gather bucket; ZeRO-3: prefetch)
    if t.zero_stage in (1, 2):
        red_dtype = 4 if (t.zero_stage == 1 or precision == "fp32") else cb
        bucket = int(zero["reduce_bucket_size"])
        n_buf = 2 if zero["overlap_comm"] else 1
        touched = min(bucket, P) if hw.host else bucket
        if zero["contiguous_gradients"]:
            # a GPU buffer is allocated whole; a CPU process commits the pages backward writes (until the step ends)
            mem.append(Item("DeepSpeed reduce bucket", n_buf * touched * red_dtype,
                            f"{n_buf} x reduce_bucket_size {bucket:.0e}" + (" (touched part)" if hw.host else ""),
                            "train.deepspeed.zero_optimization.reduce_bucket_size", (*BWD, *STEP) if hw.host else ()))
        if world > 1:
            mem.append(Item("DeepSpeed all-gather bucket", min(int(zero["allgather_bucket_size"]), P) * cb,
                            f"allgather_bucket_size {zero['allgather_bucket_size']:.0e}",
                            "train.deepspeed.zero_optimization.allgather_bucket_size"))
    elif t.zero_stage == 3:
        mem.append(Item("DeepSpeed ZeRO-3 prefetch", min(int(zero["prefetch_bucket_size"]), P) * cb,
                        f"prefetch_bucket_size {zero['prefetch_bucket_size']:.0e}", ""))
    return mem


def budget_bytes(hw: Hardware) -> float:
    """Bytes the breakdown may use: the GPU minus the fragmentation reserve (host mode: the given memory)."""
    return hw.gpu_mem_gb * GB * (1 if hw.host else 1 - hw.reserve)


def build_plan(cfg, hw: Hardware, shape: Shape | None = None, tokens: int | None = None) -> Plan:
    """The plan for recipe `cfg` on `hw` (see module docstring)."""
    t = cfg.train
    s = shape or plan_shape(cfg)
    plan = Plan(hw, s, memory=memory_items(cfg, hw, s))
    P, world = s.head_trainable, hw.world
    tdt = DTYPE_BYTES[cfg.target.dtype]
    budget = budget_bytes(hw)
    used = plan.total
    plan.fits = used <= budget
    if not hw.host:
        plan.memory.append(Item("allocator reserve", hw.gpu_mem_gb * GB * hw.reserve, f"{hw.reserve:.0%} of the GPU"))
    plan.knobs = suggest(cfg, hw, s, budget) if not plan.fits else []
    where = "process" if hw.host else "GPU"
    plan.verdict = (f"fits: {used / GB:.1f} GB needed of {budget / GB:.1f} GB usable per {where}" if plan.fits else
                    f"does NOT fit: {used / GB:.1f} GB needed > {budget / GB:.1f} GB usable per {where}; "
                    + ("set " + " | or ".join(plan.knobs) if plan.knobs else
                       "no single knob is enough: use GPUs with more memory"))
    # ---------------------------------------------------------------- disk and time
    data = data_size(cfg)
    plan.assumptions += [f"target shape: {s.target_source}", f"data: {data.source}"]
    if tokens:
        plan.assumptions.append(f"training tokens: {tokens:,} (--tokens)")
    n_tokens = tokens or data.records * data.tokens_per_record
    if not n_tokens:
        plan.assumptions.append("disk and time not planned: the size of the data is unknown (pass --tokens N)")
        return plan
    for dt in ("bfloat16", "float16", "int8", "float32"):
        bpt = bytes_per_token(s.hidden * s.cache_row, dt)
        mark = " (recipe)" if dt == cfg.data.cache_dtype else ""
        plan.disk.append(Item(f"feature cache {dt}{mark}", bpt * n_tokens, f"{bpt} B/token x {n_tokens:,} tokens"))
    if not hw.host:
        plan.assumptions.append(f"GPU throughput: {hw.tflops:g} TFLOPS x MFU {hw.mfu:.0%}; regeneration at "
                                f"{hw.decode_eff:.0%} of {hw.mem_bw_gbs:g} GB/s")
    peak = hw.tflops * 1e12 * hw.mfu * world
    prefill = 2 * s.target_active_params * n_tokens / peak
    gen_tokens = n_tokens * 0.5  # regenerated replies: about half of the tokens (assumption)
    weight_bytes = s.target_params * tdt
    per_replica = max(1, math.ceil(weight_bytes / (hw.gpu_mem_gb * GB * 0.8)))  # GPUs holding one target copy
    replicas = max(1, world // per_replica)
    gen = gen_tokens / (cfg.data.gen_batch_size * hw.mem_bw_gbs * 1e9 * hw.decode_eff / weight_bytes * replicas)
    head_flops = training_class(s.kind).train_flops_per_token(s, P)
    steps = t.epochs * n_tokens * (1 - t.eval_fraction)
    train_s = head_flops * steps / peak
    if data.regenerates:
        plan.time.append(Item(
            "data prep: regenerate replies", gen, f"~{gen_tokens:,.0f} new tokens (assumed half of the tokens), batch "
            f"{cfg.data.gen_batch_size}, {replicas} target replica(s) of {per_replica} GPU(s) ({weight_bytes / GB:.2g} GB "
            f"of weights) at {hw.decode_eff:.0%} of {hw.mem_bw_gbs:g} GB/s (HF generate; data.backend=openai with a "
            "serving engine is faster)"))
    if data.caches:
        plan.time.append(Item("data prep: cache features (prefill)", prefill,
                              f"2 x {_count(s.target_active_params)} x tokens"))
    plan.time.append(Item("training", train_s, f"{t.epochs:g} epochs; {head_flops / 1e9:.2g} GFLOP/token (the head "
                                               "kind's train_flops_per_token)"))
    if t.mode == "stream":
        plan.stream = stream_lines(cfg, hw, s, n_tokens, data.tokens_per_record, head_flops)
    plan.traffic = traffic_items(cfg, hw, P)
    if plan.traffic:
        records = n_tokens / data.tokens_per_record
        opt_steps = t.epochs * records * (1 - t.eval_fraction) / (t.micro_batch_size * t.grad_accum * world
                                                                   / t.sequence_parallel_size)
        per_step = sum(i.bytes for i in plan.traffic)
        plan.time.append(Item("training: inter-node traffic", per_step * opt_steps / (hw.net_gbps * 1e9 / 8),
                              f"~{opt_steps:,.0f} steps x {per_step / GB:.2f} GB at {hw.net_gbps:g} Gb/s per node (not "
                              "overlapped: an upper bound)"))
    return plan


def traffic_items(cfg, hw: Hardware, P: int) -> list[Item]:
    """Bytes each node sends over the network per optimizer step for the recipe's ZeRO stage (module docstring);
    empty on one node (NVLink / PCIe traffic is not planned)."""
    if hw.host or hw.nodes == 1:
        return []
    t, N = cfg.train, hw.world
    ring = (N - 1) / N
    pb = 4 if t.precision == "fp32" else 2  # 16-bit parameters and gradients are what DeepSpeed communicates
    A = t.grad_accum
    if t.zero_stage <= 1:
        return [Item("gradient all-reduce", 2 * ring * P * pb, f"2 (N-1)/N x P x {pb} B, once per step")]
    items = [Item("gradient reduce-scatter", A * ring * P * pb, f"(N-1)/N x P x {pb} B x grad_accum {A}")]
    if t.zero_stage == 2:
        items.append(Item("parameter all-gather", ring * P * pb, f"(N-1)/N x P x {pb} B after the optimizer step"))
    else:
        items.append(Item("parameter all-gathers", 2 * A * ring * P * pb,
                          f"(N-1)/N x P x {pb} B, forward + backward x grad_accum {A}"))
    return items


@dataclass
class DataSize:
    """How much data the plan counts with, and which data-prep stages are still to run."""

    records: int
    tokens_per_record: int
    source: str  # what was read or assumed (printed)
    regenerates: bool = False  # data prep will regenerate the replies
    caches: bool = False  # a feature cache is still to be built (by data prep or train.corpus_cache)


def data_size(cfg) -> DataSize:
    """The recipe's own data: a finished cache's manifest (nothing left to prepare); else data.source (a local file
    is counted; a hub dataset is assumed ShareGPT-sized); else, for the embedded default target, its conversations;
    else (no data.source, e.g. stories260k, whose cache train.corpus_cache builds) unknown: 0 records."""
    d = cfg.data
    cache = layout.cache_dir(cfg)
    if (cache / "parts").is_dir():  # the part manifests (manifest.json is a derived summary nothing reads)
        m = merge_manifests(cache)
        n = int(m["num_records"])
        return DataSize(n, max(1, int(m["num_tokens"]) // max(1, n)), f"{n:,} records, {int(m['num_tokens']):,} tokens "
                        f"in the feature cache {cache} (data prep done)")
    per = min(DEFAULT_TOKENS_PER_RECORD, d.max_length)
    tokens = f"x {per} tokens each (assumed: {DEFAULT_TOKENS_PER_RECORD} per record, at most data.max_length)"
    stages = dict(regenerates=d.regenerate, caches=True)
    if d.source:
        counted = count_records(Path(d.source)) if Path(d.source).is_file() else None
        if counted is not None:
            n = min(counted, d.max_records or counted)
            return DataSize(n, per, f"{n:,} records of {d.source} {tokens}", **stages)
        n = d.max_records or DEFAULT_RECORDS
        how = "data.max_records" if d.max_records else "assumed: the size of ShareGPT_V4.3, not found here to count"
        return DataSize(n, per, f"{n:,} records of {d.source} ({how}) {tokens}", **stages)
    if not cfg.target.path:
        n = len(default_conversations("train"))
        n = min(n, d.max_records or n)
        return DataSize(n, per, f"{n:,} conversations of the embedded default target (the data.source the demo "
                        f"passes) {tokens}", **stages)
    return DataSize(0, per, "data.source is empty and no feature cache exists at "
                    f"{layout.cache_dir(cfg)}: build it (data_prep with data.source=..., or train.corpus_cache for raw "
                    "text) or pass --tokens", caches=True)


def stream_lines(cfg, hw: Hardware, s: Shape, n_tokens: int, tokens_per_record: int, head_flops: float) -> list[str]:
    """train.mode=stream (train/stream.py): the window's disk against the cache it replaces, the producer's memory,
    and per GPU the tokens/s the engine captures (a prefill, 2 x active params per token) and the trainer trains
    (the head's FLOPs per token), so which side needs more GPUs. The window is train/stream.py `window_bytes` of the
    mean step (world x grad_accum x micro_batch_size records of the data's mean length)."""
    t = cfg.train
    bpt = bytes_per_token(s.hidden * s.cache_row, cfg.data.cache_dtype)
    cache = bpt * n_tokens
    records = hw.world * t.grad_accum * t.micro_batch_size
    step = records * (min(tokens_per_record, cfg.data.max_length) * bpt + RECORD_HEADER_BYTES)
    window = window_bytes(t.stream_window_steps, int(t.stream_window_mb * 2**20), step)
    held = cache if t.stream_epochs == "keep" else min(window, cache)
    cap = f", capped at train.stream_window_mb={t.stream_window_mb:g}" if t.stream_window_mb else ""
    lines = [f"stream window (disk)                 {_gb(held)}  "
             + (f"{window / 2**20:,.2f} MiB = {window / max(cache, 1):.1%} of the {cache / GB:.2f} GB "
                f"{cfg.data.cache_dtype} cache: train.stream_window_steps={t.stream_window_steps} steps of {records} "
                f"records x ~{tokens_per_record:,} tokens ({step / 2**20:,.2f} MiB each){cap}, held-out shard "
                "included; every epoch captured again"
                if t.stream_epochs != "keep" else "train.stream_epochs=keep: epoch 1 stays on disk, the whole cache"),
             f"stream producer memory               {_gb(s.target_params * DTYPE_BYTES[cfg.target.dtype] + window / 4)}  "
             f"the target in {cfg.target.dtype} + one shard being written (a quarter of the window), its own process"]
    if hw.host:
        lines.append("stream throughput: not planned in host mode; the run summary measures both sides (records/s, "
                     "who waited)")
        return lines
    per_gpu = hw.tflops * 1e12 * hw.mfu
    engine = per_gpu / (2 * s.target_active_params)  # tokens/s one engine GPU captures
    trainer = per_gpu / head_flops  # tokens/s one trainer GPU trains
    ratio = trainer / engine  # engine GPUs per trainer GPU to keep both busy
    lines.append(f"stream throughput per GPU: engine {engine:,.0f} tokens/s, trainer {trainer:,.0f} tokens/s -> "
                 f"{ratio:.2g} engine GPU(s) per trainer GPU keep both busy; with {hw.world} trainer GPU(s) and one "
                 f"engine GPU the {'engine' if ratio > 1 else 'trainer'} is the bottleneck: scale "
                 f"{'the engine (more vLLM/producer GPUs)' if ratio > 1 else 'the trainer ranks'}"
                 + (f"; recapture prefills every epoch: {t.epochs:g}x the tokens of one offline capture"
                    if t.stream_epochs != "keep" else ""))
    return lines


def count_records(path: Path) -> int | None:
    """Records in a local .json (a list) or .jsonl file; None for other formats (parquet, csv: not counted here)."""
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except (ValueError, OSError):
            return None
        return len(data) if isinstance(data, list) else None
    return None


def suggest(cfg, hw: Hardware, shape: Shape, budget: float) -> list[str]:
    """Up to three settings that each alone bring the memory under `budget`, cheapest first."""
    tries = []
    t = cfg.train
    if t.loss_chunk == 0:
        tries.append(["train.loss_chunk=256"])
    if t.mode == "online":
        tries.append(["train.mode=offline"])
    for mb in range(t.micro_batch_size - 1, 0, -1):
        tries.append([f"train.micro_batch_size={mb}", f"train.grad_accum={t.grad_accum * t.micro_batch_size // mb}"])
    if t.zero_stage < 3:
        tries.append([f"train.zero_stage={t.zero_stage + 1}"])
    tries.append(["train.deepspeed={zero_optimization: {reduce_bucket_size: 50000000, allgather_bucket_size: 50000000}}"])
    if not t.offload_optimizer:
        tries.append(["train.offload_optimizer=true"])
    for length in (1024, 512):
        if length < cfg.data.max_length:
            tries.append([f"data.max_length={length}"])
    out = []
    for overrides in tries:
        c2 = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
        need = peak_bytes(memory_items(c2, hw, shape))[0]
        if need <= budget:
            out.append(" ".join(overrides) + f" ({need / GB:.1f} GB)")
            if len(out) == 3:
                break
    return out


# ----------------------------------------------------------------------------- output
def _hms(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds < 60:
        return f"{seconds:.2g} s"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def _count(n: float) -> str:
    """A parameter count at a readable scale (8.03B, 0.87M, 260K)."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def format_plan(cfg, plan: Plan) -> str:
    """The plan as text (the table printed by the CLI and at the start of training)."""
    hw, s, t = plan.hw, plan.shape, cfg.train
    where = (f"1 CPU process (host mode, {t.precision if t.precision != 'fp16' else 'fp32'})" if hw.host else
             f"{hw.nodes} node(s) x {hw.gpus} GPU(s) x {hw.gpu_mem_gb:g} GB")
    lines = [f"plan for recipe {cfg.name}: {where}; {s.kind} head, {s.head_trainable / 1e6:.1f}M trainable params over a "
             f"{_count(s.target_params)} target (H {s.hidden}, V {s.vocab}, I {s.intermediate}, "
             f"{s.heads}/{s.kv_heads} heads); {t.mode} mode, ZeRO-{t.zero_stage}, {t.precision}, micro-batch "
             f"{t.micro_batch_size} x {cfg.data.max_length} tokens, loss_chunk {t.loss_chunk}",
             f"  {'memory per ' + ('process' if hw.host else 'GPU'):<36} {'GB':>7}  note"]
    for i in plan.memory:
        when = " + ".join(i.phases) + " only" if i.phases else ""
        note = "; ".join(x for x in (i.note, when) if x)
        lines.append(f"  {i.name:<36} {_gb(i.bytes)}  {note}")
    need, phase = peak_bytes([i for i in plan.memory if i.name != "allocator reserve"])
    lines.append(f"  {'peak (without the reserve)':<36} {_gb(need)}  in the {phase} -> {plan.verdict}")
    if plan.disk:
        lines.append(f"  {'disk':<36} {'GB':>7}")
    for i in plan.disk:
        lines.append(f"  {i.name:<36} {_gb(i.bytes)}  {i.note}")
    if hw.host:
        lines.append("  time: not planned in host mode (the figures assume GPUs)")
    elif plan.time:
        if plan.traffic:
            lines.append(f"  {'inter-node traffic per step, per node':<36} {'GB':>7}  ZeRO-{t.zero_stage}, "
                         f"{hw.world} ranks in a ring over {hw.nodes} nodes")
            for i in plan.traffic:
                lines.append(f"  {i.name:<36} {i.bytes / GB:7.3f}  {i.note}")
        lines.append(f"  {'time (' + str(hw.world) + ' GPUs' + (f' on {hw.nodes} nodes' if hw.nodes > 1 else '') + ')':<36}")
        for i in plan.time:
            lines.append(f"  {i.name:<36} {_hms(i.bytes):>7}  {i.note}")
    lines += [f"  {x}" for x in plan.stream]
    lines += [f"  assumed: {a}" for a in plan.assumptions]
    return "\n".join(lines)


def _gb(n: float) -> str:
    """Bytes as GB in the table's 7-character column, small sizes with their significant digits."""
    return f"{n / GB:7.2f}" if n >= 0.01 * GB or n == 0 else f"{n / GB:7.1e}"


def plan_as_dict(plan: Plan) -> dict:
    return {"fits": plan.fits, "verdict": plan.verdict, "total_bytes": plan.total,
            "memory": {i.name: i.bytes for i in plan.memory}, "disk": {i.name: i.bytes for i in plan.disk},
            "time_s": {i.name: i.bytes for i in plan.time}, "traffic_per_step": {i.name: i.bytes for i in plan.traffic},
            "shape": plan.shape.__dict__, "knobs": plan.knobs, "assumptions": plan.assumptions,
            **({"stream": plan.stream} if plan.stream else {})}


def hardware_for_run(ctx) -> Hardware:
    """The hardware a training run is on: its world size and, on GPUs, the device's memory."""
    if ctx.device.type == "cuda":
        mem = torch.cuda.get_device_properties(ctx.device).total_memory / GB
        per_node = torch.cuda.device_count()
        return Hardware(gpus=per_node, nodes=max(1, ctx.world_size // max(1, per_node)), gpu_mem_gb=mem)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    return Hardware(gpus=1, nodes=1, gpu_mem_gb=total / max(1, ctx.world_size), host=True)


def print_run_plan(cfg, ctx, config=None) -> None:
    """Rank 0 prints the plan at the start of training (a plan that cannot be made is a warning, not an error)."""
    if not ctx.is_main:
        return
    try:
        print(format_plan(cfg, build_plan(cfg, hardware_for_run(ctx), plan_shape(cfg, config))), flush=True)
    except PlanError as e:
        print(f"[train] no plan: {e}", flush=True)


def data_bound_cfg(cfg, longest: int):
    """`cfg` with the plan's worst-case sequence length (data.max_length) cut to the data's longest record: a
    micro-batch is padded to its longest record, so no micro-batch of this data is larger."""
    return OmegaConf.merge(cfg, {"data": {"max_length": max(1, min(int(cfg.data.max_length), longest))}})


def largest_fitting(need, low: int, high: int, budget: float) -> int:
    """The largest n in [low, high] with need(n) <= budget (need grows with n), low - 1 when none does."""
    if need(low) > budget:
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if need(mid) <= budget else (low, mid - 1)
    return low


def check_run_memory(cfg, ctx, config, longest: int, steps_key: str = "", stride_key: str = "") -> None:
    """`check_run_fits` for a training run on its own hardware (`hardware_for_run`); a recipe the plan cannot shape
    (print_run_plan said so) is not checked."""
    try:
        shape = plan_shape(cfg, config)
    except PlanError:
        return
    check_run_fits(cfg, hardware_for_run(ctx), shape, longest, steps_key, stride_key)


def check_run_fits(cfg, hw: Hardware, shape: Shape, longest: int, steps_key: str = "", stride_key: str = "") -> None:
    """Before anything is trained: PlanError, one line naming the key and the bound, when the plan says this run
    does not fit in `hw`'s memory at the data's worst micro-batch (train.micro_batch_size records of its longest
    record, `data_bound_cfg`). An unrolled step count (`steps_key`, the kind's head.align_steps / head.ttt_steps) is
    named with the largest count that fits; anything else with the plan's knobs (`suggest`). train.check_memory=false
    skips the check (the plan is an estimate)."""
    if not cfg.train.get("check_memory", True):
        return
    c = data_bound_cfg(cfg, longest)
    budget = budget_bytes(hw)

    def need(steps: int) -> float:
        return peak_bytes(memory_items(c, hw, replace(shape, ttt_steps=steps)))[0]

    used = need(shape.ttt_steps)
    if used <= budget:
        return
    where = "process" if hw.host else "GPU"
    t = cfg.train
    at = (f"the plan (train/plan.py) needs {used / GB:.2f} GB per {where} at micro-batch {t.micro_batch_size} x "
          f"{c.data.max_length} tokens (the longest training record), {budget / GB:.2f} GB usable")
    anyway = "train.check_memory=false starts it anyway"
    if steps_key and shape.ttt_steps > 1:
        fits = largest_fitting(need, 1, shape.ttt_steps - 1, budget)
        if fits >= 1:
            stride = f", raise {stride_key} (now {shape.ttt_row_stride})" if stride_key else ""
            raise PlanError(f"{steps_key}={shape.ttt_steps} does not fit in memory: {at}; at most {steps_key}={fits} "
                            f"fits (or lower train.micro_batch_size{stride}); {anyway}")
    knobs = suggest(c, hw, shape, budget)
    fix = ("set " + " | or ".join(knobs)) if knobs else "no single setting is enough: use a machine with more memory"
    raise PlanError(f"this run does not fit in memory: {at}; {fix}; {anyway}")


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m train.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, help="recipe name in recipes/ or a YAML path")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides (as for train/main.py)")
    d = Hardware()
    count, positive = bounded(int, at_least=1), bounded(float, above=0)
    p.add_argument("--gpus", type=count, default=d.gpus, help="GPUs per node (default %(default)s)")
    p.add_argument("--nodes", type=count, default=d.nodes, help="nodes (default %(default)s)")
    p.add_argument("--gpu-mem-gb", type=positive, default=d.gpu_mem_gb, help="memory per GPU in GB (default %(default)s, RTX 3090)")
    p.add_argument("--tflops", type=positive, default=d.tflops, help="GPU dense 16-bit peak TFLOPS (default %(default)s, RTX 3090)")
    p.add_argument("--mfu", type=bounded(float, above=0, at_most=1), default=d.mfu,
                   help="achieved fraction of peak (default %(default)s)")
    p.add_argument("--mem-bw-gbs", type=positive, default=d.mem_bw_gbs, help="GPU memory bandwidth GB/s (default %(default)s)")
    p.add_argument("--cuda-context-gb", type=bounded(float, at_least=0), default=d.cuda_context_gb,
                   help="per-process CUDA context (default %(default)s)")
    p.add_argument("--reserve", type=bounded(float, at_least=0, below=1), default=d.reserve,
                   help="fraction kept free for fragmentation (default %(default)s)")
    p.add_argument("--net-gbps", type=positive, default=d.net_gbps, help="inter-node network per node in Gbit/s (default %(default)s)")
    p.add_argument("--tokens", type=count, default=None, help="training tokens (default: the cache manifest, else an assumption)")
    p.add_argument("--host", action="store_true", help="one CPU process instead of GPUs (--gpu-mem-gb = RAM for it)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    add_print_config(p)
    return p.parse_args(argv)


@one_line_errors
def main(argv=None) -> int:
    args = parse_args(argv)  # every number range-checked here (eagle.cli_errors.bounded)
    cfg = command_config(args)
    hw = Hardware(gpus=args.gpus, nodes=args.nodes, gpu_mem_gb=args.gpu_mem_gb, tflops=args.tflops, mfu=args.mfu,
                  mem_bw_gbs=args.mem_bw_gbs, cuda_context_gb=args.cuda_context_gb, reserve=args.reserve,
                  host=args.host, net_gbps=args.net_gbps)
    plan = build_plan(cfg, hw, tokens=args.tokens)  # errors: one line from one_line_errors (--debug: the traceback)
    print(json.dumps(plan_as_dict(plan), indent=1) if args.json else format_plan(cfg, plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
