"""The served target's weight quantization (`target.quantization`): the methods that run here, and the one function
every target loader applies (`quantize_target`), so a head is trained, measured and checked for losslessness against
the model it will be served beside.

Methods (round-to-nearest, weight-only, applied to every `nn.Linear` of the decoder layers; the embedding and the
lm_head stay in `target.dtype`, as AWQ / GPTQ checkpoints and vLLM keep them):

    none        the full-precision target
    int8        symmetric int8 per output channel (scale absmax / 127.5, levels -128..127): torchao's Int8WeightOnlyConfig
    int4        asymmetric int4 per output channel (min/max -> 0..15 with a zero point)
    int4-gN     asymmetric int4 per group of N input columns, N in 16 / 32 / 64 / 128 (the grid AWQ / GPTQ
                4-bit checkpoints use, group 128 most often)

How: quantize-dequantize ("fake quantization"). Each weight is replaced by the nearest point of its method's grid,
stored back in `target.dtype`; the model then computes exactly the function a weight-only int8 / int4 kernel
computes (dequantize, multiply), up to the order of the float accumulation. That is what matters here: the head is
trained on the quantized target's hidden states and decoded against its logits, and losslessness is defined against
that same quantized model's vanilla decoding. It costs no memory or speed (a CPU box measures tau, not int4
throughput), runs in every code path (the fused decoder copies plain weights) and needs no dependency.
torchao 0.18 is the packed-kernel route (no dependency of this project); docs/quantization.md says what it runs here.

GPU-served methods (fp8 W8A8, AWQ, GPTQ, bitsandbytes nf4, EXL2/EXL3, Marlin kernels) are not values of this key:
they need CUDA kernels. The nearest method here (docs/quantization.md's table) trains a head for them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


NONE = "none"


@dataclass(frozen=True)
class QuantMethod:
    """One value of `target.quantization`."""

    name: str
    bits: int  # 0 = not quantized
    group_size: int  # input columns sharing a scale; 0 = one per output channel
    symmetric: bool
    describe: str  # for reports and the model card
    vllm_serve: str  # how a GPU user serves the target quantized like this (the model card prints it)

    def quantize_weight(self, w: torch.Tensor) -> torch.Tensor:
        """w [out, in] -> the nearest point of this method's grid, same shape and dtype (computed in float32). Input
        column j is in group j // group_size; when group_size does not divide the columns the last group is shorter
        (GPTQ's g_idx convention), e.g. stories260K's down_proj (172 columns)."""
        if self.bits == 0:
            return w
        x = w.detach().float()
        chunks = torch.split(x, self.group_size or x.shape[1], dim=1)  # [out, g] each (the last may be shorter)
        return torch.cat([self._round(c) for c in chunks], dim=1).to(w.dtype)

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        """One scale (and zero point) per row of x [out, g]: round to nearest on that grid, dequantized."""
        if self.symmetric:  # levels -2^(b-1) .. 2^(b-1) - 1, scale absmax / (2^b - 1) / 2: torchao's symmetric mapping
            qmin, qmax = -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1
            scale = (x.abs().amax(dim=-1, keepdim=True) / ((qmax - qmin) / 2)).clamp(min=1e-12)
            return torch.round(x * (1.0 / scale)).clamp(qmin, qmax) * scale  # x * (1 / scale): torchao's rounding, ties too
        qmax = 2 ** self.bits - 1
        lo = x.amin(dim=-1, keepdim=True).clamp(max=0)  # the range holds 0 (exactly representable), as torchao's
        hi = x.amax(dim=-1, keepdim=True).clamp(min=0)
        scale = ((hi - lo) / qmax).clamp(min=1e-12)
        zero = torch.round(-lo / scale)
        return (torch.round(x * (1.0 / scale)) + zero).clamp(0, qmax).sub(zero) * scale


def _int4(group: int) -> QuantMethod:
    where = f"per group of {group} input columns" if group else "per output channel"
    serve = ("serve an AWQ / GPTQ 4-bit checkpoint of the target with group size "
             f"{group} (`vllm serve TARGET-AWQ --quantization awq`)" if group else
             "serve a 4-bit per-channel checkpoint of the target (GPTQ with group_size -1: `vllm serve TARGET-GPTQ "
             "--quantization gptq`)")
    return QuantMethod(f"int4-g{group}" if group else "int4", 4, group, False,
                       f"int4 weight-only, asymmetric {where} (round to nearest)", serve)


QUANT_METHODS: dict[str, QuantMethod] = {m.name: m for m in (
    QuantMethod(NONE, 0, 0, True, "none (full-precision weights)", "`vllm serve TARGET`"),
    QuantMethod("int8", 8, 0, True, "int8 weight-only, symmetric per output channel (round to nearest, torchao's grid)",
                "serve an int8 weight-only checkpoint of the target (e.g. compressed-tensors W8A16: `vllm serve "
                "TARGET-W8A16`)"),
    _int4(0), _int4(16), _int4(32), _int4(64), _int4(128),
)}


def quant_method(name: str) -> QuantMethod:
    """The method named `name` (ValueError naming the key and the valid values)."""
    if name not in QUANT_METHODS:
        raise ValueError(f"target.quantization={name!r}: expected one of {tuple(QUANT_METHODS)}")
    return QUANT_METHODS[name]


def quantized_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The linear layers a method quantizes: those inside the decoder layers (attention and MLP projections); the
    embedding and the lm_head are not among them."""
    body = model.get_decoder()
    layers = getattr(body, "layers", None)
    if layers is None:
        raise ValueError(f"target.quantization: cannot find the decoder layers of {type(model).__name__}")
    return [(f"layers.{i}.{name}", mod) for i, layer in enumerate(layers)
            for name, mod in layer.named_modules() if isinstance(mod, nn.Linear)]


@torch.no_grad()
def quantize_target(model: nn.Module, name: str) -> nn.Module:
    """Quantize `model`'s decoder weights in place by method `name` ("none": unchanged) and record it on the model
    (`model.eagle_quantization`, which `target_quantization` reads back; the config is left alone, so the target's
    config hash does not change); returns the model. Idempotent: a
    model already quantized by `name` is left as it is; another method on it is refused (its grid is not the
    full-precision weights')."""
    method = quant_method(name)
    done = target_quantization(model)
    if done == name:
        return model
    if done != NONE:
        raise ValueError(f"target.quantization={name}: this target was already quantized as {done}")
    for _, lin in quantized_linears(model):
        lin.weight.copy_(method.quantize_weight(lin.weight))
    model.eagle_quantization = name
    return model


def target_quantization(model: nn.Module) -> str:
    """The method `quantize_target` applied to `model` ("none" when it was not)."""
    return getattr(model, "eagle_quantization", NONE)
