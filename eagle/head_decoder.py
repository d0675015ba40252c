"""The draft head's decoding forward: its own preallocated KV cache and weights laid out for few-row steps.

Drafting runs the head 4-9 times per round on a handful of rows, where every tensor op costs several
microseconds of dispatch whatever its size, so the op count IS the cost. `HeadDecoder` computes what
`EagleHead.forward` computes (same math; float rounding differs in the last bits, which only the draft sees:
verification by the target keeps decoding lossless) with as few ops as the head's size allows.

Small heads (the extra copies below fit in FAST_HEAD_MAX_BYTES and are quick to rebuild) take the fast path,
15 ops per call:
  * fc:      fc(cat[embed(tok), f]) = T[tok] + f @ W_f^T, with T = embed @ W_e^T + b precomputed ([V, H]);
  * rotary:  one matmul yields q|k|v AND a copy with each head's rows rolled by D/2, so
             x * cos + rotate_half(x) * sin = y * cos + y_rolled * sin_signed is a mul and an addcmul; the
             tables hold cos = 1, sin = 0 for the v heads, so k and v come out side by side and enter the
             cache in ONE copy;
  * norm:    the post-attention RMSNorm weight (and sqrt(H)) is folded into gate|up, and the residual is
             written into a scratch row that ends with sqrt(H * eps), so ||row|| = sqrt(H (mean(x^2) + eps))
             and the whole norm is one vector_norm and one division.
Large heads (7B-class) keep views of their parameters and the plain formulation: their matmuls dwarf the
dispatch cost and the copies would cost hundreds of MB.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from eagle.attention import sdpa_attention
from eagle.layers import (accumulation_dtype, linear_t, positions_end, rms_norm, rotate_rolled, rows_at,
                          signed_sin)
from eagle.sliding_window import restrict_mask, window_size

FAST_HEAD_MAX_BYTES = 64 * 2**20  # extra bytes (tables, folded and rolled weight copies) the fast path may take
# The copies are re-taken at every reset (every generation, so weights edited in between are used); building
# the fc token table costs V H^2 multiply-adds, which must stay small next to a generation (2^28: a few ms).
FAST_HEAD_MAX_TABLE_MACS = 2**28


class HeadDecoder:
    """Decoding forward of an `EagleHead` over its own KV cache: committed positions, then tree nodes
    that are rolled back with `truncate`.

    Weights are snapshotted at construction and by `refresh()` (call it when the head's weights change,
    e.g. every generation: `Drafter.reset` does). An inference path: call it under `torch.no_grad()` or
    `torch.inference_mode()`, the same one it was built under (buffers made under inference_mode cannot be
    written outside it).
    """

    def __init__(self, head, capacity: int, fast: bool | None = None, lm_head: torch.nn.Module | None = None):
        """head: an `EagleHead`; fast: the small-head path (None = when its copies are small and quick to rebuild, see
        `_fast_fits`); lm_head: the target's, which scores the drafts (`topk`)."""
        c = head.config
        self.head = head
        self.lm_head = lm_head
        self.n_heads, self.n_kv, self.head_dim, self.hidden = (c.num_attention_heads, c.num_key_value_heads,
                                                               c.head_dim, c.hidden_size)
        self.eps = c.rms_norm_eps
        self._fast_request = fast
        self._allocate(capacity)
        self.refresh()

    # ------------------------------------------------------------------ setup
    def _fast_fits(self, capacity: int) -> bool:
        c = self.head.config
        heads = self.n_heads + 2 * self.n_kv
        extra = (c.vocab_size * c.hidden_size  # fc token table
                 + 2 * heads * self.head_dim * c.hidden_size  # q|k|v and its rolled copy
                 + 2 * c.intermediate_size * c.hidden_size  # folded gate|up
                 + 2 * max(capacity, 256) * heads * self.head_dim)  # rotary tables
        return (extra * self.head.fc.weight.element_size() <= FAST_HEAD_MAX_BYTES
                and c.vocab_size * c.hidden_size ** 2 <= FAST_HEAD_MAX_TABLE_MACS)

    def _allocate(self, capacity: int) -> None:
        """Buffers for `capacity` positions in the head's current dtype and device; decides the path."""
        self.fast = self._fast_fits(capacity) if self._fast_request is None else self._fast_request
        self.length = 0
        self._kv = torch.zeros(2 * self.n_kv, capacity, self.head_dim, dtype=self.head.dtype, device=self.head.device)  # [2 kv, cap, D]: K heads, then V heads
        self._keys, self._values = self._kv[None, : self.n_kv], self._kv[None, self.n_kv :]  # [1, kv, cap, D] views
        self._pos = torch.zeros(capacity, dtype=torch.long, device=self.head.device)  # [cap] each slot's position
        self._cos = self._sin = None  # fast path: [P, h + 2 kv, D] rotary tables (identity on v heads), built on use
        self._norm_rows = None  # fast path: [rows, H + 1] residual scratch ending in sqrt(H eps)

    @property
    def capacity(self) -> int:
        return self._kv.shape[1]

    def reset(self, capacity: int) -> None:
        """Empty the cache (growing it to `capacity`) and re-take the weights (and the buffers, when the head
        moved to another dtype or device)."""
        moved = (self._kv.dtype, self._kv.device) != (self.head.dtype, self.head.device)
        if capacity > self.capacity or moved:
            self._allocate(max(capacity, self.capacity))
        self.length = 0
        self.refresh()

    def truncate(self, length: int) -> None:
        self.length = length

    @torch.no_grad()
    def refresh(self) -> None:
        """(Re)take the weights: transposed views, or for the fast path the folded / rolled copies."""
        head, layer = self.head, self.head.layers[0]
        a, m = layer.self_attn, layer.mlp
        H, D = self.hidden, self.head_dim
        self.window = window_size(head.config.options)  # head.sliding_window (None = full attention)
        if self.lm_head is not None:  # the target's lm_head scores the drafts
            self._lm_t = self.lm_head.weight.detach().t()  # [H, V]
            self._lm_b = None if getattr(self.lm_head, "bias", None) is None else self.lm_head.bias.detach()
        self.o_t = a.o_proj.weight.detach().t()  # [h D, H]
        self.down_t = m.down_proj.weight.detach().t()  # [I, H]
        if not self.fast:
            self.emb = head.embed_tokens.weight.detach()
            self.fc_t, self.fc_b = head.fc.weight.detach().t(), None if head.fc.bias is None else head.fc.bias.detach()
            self.qkv_t = [p.weight.detach().t() for p in (a.q_proj, a.k_proj, a.v_proj)]
            self.qkv_b = [None if p.bias is None else p.bias.detach() for p in (a.q_proj, a.k_proj, a.v_proj)]
            self.ln = layer.post_attention_layernorm.weight.detach()
            self.gate_t, self.up_t = m.gate_proj.weight.detach().t(), m.up_proj.weight.detach().t()
            return
        w_fc = head.fc.weight.float()
        table = head.embed_tokens.weight.float() @ w_fc[:, :H].t()  # [V, H]
        if head.fc.bias is not None:
            table += head.fc.bias.float()
        dt = head.dtype
        self.tok_fc = table.to(dt)
        self.feat_fc_t = head.fc.weight[:, H:].detach().t()  # [H, H]
        w_qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])  # [(h + 2 kv) D, H]
        heads = self.n_heads + 2 * self.n_kv
        rolled = w_qkv.view(heads, D, H).roll(D // 2, dims=1).reshape(-1, H)  # output row i of a head -> i + D/2
        self.qkv2_t = torch.cat([w_qkv, rolled]).t()  # [H, 2 (h + 2 kv) D]
        self.qkv2_b = None
        if a.q_proj.bias is not None:
            b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            self.qkv2_b = torch.cat([b, b.view(heads, D).roll(D // 2, dims=1).flatten()])
        w_gu = torch.cat([m.gate_proj.weight, m.up_proj.weight]).float()  # [2 I, H]
        self.gate_up_t = (w_gu * (layer.post_attention_layernorm.weight.float() * math.sqrt(H))).to(dt).t()

    def _reserve(self, positions: int) -> None:
        """Fast-path rotary tables for positions [0, positions): cos / signed sin on q and k heads, 1 / 0 on v."""
        if self._cos is not None and self._cos.shape[0] >= positions:
            return
        size = max(positions, 256) if self._cos is None else max(positions, 2 * self._cos.shape[0])
        cos, sin = self.head.rotary.tables(size, self._kv.device, self._kv.dtype)  # [P, D]
        qk = self.n_heads + self.n_kv
        shape = (size, qk + self.n_kv, self.head_dim)
        self._cos = torch.ones(shape, dtype=cos.dtype, device=cos.device)
        self._sin = torch.zeros(shape, dtype=cos.dtype, device=cos.device)
        self._cos[:, :qk] = cos[:size, None]
        self._sin[:, :qk] = signed_sin(sin[:size])[:, None]

    def _scratch(self, n: int) -> torch.Tensor:
        """[n, H + 1] rows whose last column is sqrt(H eps) (the fast path's norm)."""
        if self._norm_rows is None or self._norm_rows.shape[0] < n:
            rows = max(n, 64) if self._norm_rows is None else max(n, 2 * self._norm_rows.shape[0])
            self._norm_rows = torch.full((rows, self.hidden + 1), math.sqrt(self.hidden * self.eps),
                                         dtype=self._kv.dtype, device=self._kv.device)
        return self._norm_rows[:n]

    # ------------------------------------------------------------------ forward
    def forward(self, features: torch.Tensor, next_ids: torch.Tensor, positions: "torch.Tensor | range | int",
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """n new positions (batch 1): features [n, H] (target features or the head's own predictions), next_ids
        [n] the tokens that follow them, positions a tensor [n], a `range`, or one int shared by every row (a
        draft-tree level); mask [n, length + n] bool (True = attend) or additive float, None = causal over the
        new rows. Appends their K/V; returns the predicted features [n, H]."""
        n = next_ids.shape[0]
        end, mask, start = self._append_bounds(n, mask, features.device, positions)
        h_, kv_, d_ = self.n_heads, self.n_kv, self.head_dim
        features = features.to(self._kv.dtype)
        if self.fast:
            x = torch.addmm(F.embedding(next_ids, self.tok_fc), features, self.feat_fc_t)  # [n, H] = fc(cat[embed, f])
            y = linear_t(x, self.qkv2_t, self.qkv2_b).view(n, 2, h_ + 2 * kv_, d_)  # q|k|v, then rolled
            cos, sin = self._rotary(positions)  # [n | 1, h + 2 kv, D]
            y, y_rolled = y.unbind(1)
            qkv = torch.addcmul(y * cos, y_rolled, sin).transpose(0, 1)  # rotated q, k; v as is: [h + 2 kv, n, D]
            self._kv[:, self.length : end] = qkv[h_:]  # K and V in one copy
            q = qkv[:h_]
        else:
            x = linear_t(torch.cat([F.embedding(next_ids, self.emb), features], dim=-1), self.fc_t, self.fc_b)  # [n, H]
            q, k, v = (linear_t(x, w, b).view(n, -1, d_).transpose(0, 1) for w, b in zip(self.qkv_t, self.qkv_b))
            cos, sin = self.head.rotary.at(positions, x.device, x.dtype)  # [n | 1, D]
            q = rotate_rolled(q, cos, sin)  # [h, n, D]
            self._kv[:kv_, self.length : end] = rotate_rolled(k, cos, sin)
            self._kv[kv_:, self.length : end] = v
        self.length = end
        keys, values = self._keys.narrow(2, start, end - start), self._values.narrow(2, start, end - start)  # [1, kv, L + n, D]
        att = sdpa_attention(q.unsqueeze(0), keys, values, mask)  # [n, h D]
        if self.fast:
            rows = self._scratch(n)
            x = torch.addmm(x, att, self.o_t, out=rows.narrow(1, 0, self.hidden))  # residual + o_proj, into the scratch rows
            norm = torch.linalg.vector_norm(rows, dim=-1, keepdim=True,
                                            dtype=accumulation_dtype(rows.dtype))  # sqrt(H (mean(x^2) + eps))
            gate, up = torch.mm(x, self.gate_up_t).div_(norm).chunk(2, -1)
        else:
            x = torch.addmm(x, att, self.o_t)  # residual + o_proj
            normed = rms_norm(x, self.ln, self.eps)
            gate, up = torch.mm(normed, self.gate_t), torch.mm(normed, self.up_t)
        return torch.addmm(x, F.silu(gate) * up, self.down_t)  # residual + down_proj: [n, H]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """What a committed position feeds the head: the target's final hidden state [n, H] as it is."""
        return features

    def topk(self, features: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, H] predicted features -> (float32 log-probs [n, k], target token ids [n, k]) of the k best draft tokens,
        through the target's lm_head."""
        logits = linear_t(features.to(self._lm_t.dtype), self._lm_t, self._lm_b).float()  # [n, V]
        return torch.log_softmax(logits, dim=-1).topk(k, dim=-1)

    def probs(self, features: torch.Tensor, temperature: float) -> torch.Tensor:
        """[n, H] predicted features -> [n, V] float32 draft distribution over the target vocabulary at `temperature`
        (probabilistic drafting, eagle/draft.py `draft_chain_sampled`)."""
        logits = linear_t(features.to(self._lm_t.dtype), self._lm_t, self._lm_b).float()  # [n, V]
        return torch.softmax(logits / temperature, dim=-1)

    def _append_bounds(self, n: int, mask: torch.Tensor | None, device,
                       positions: "torch.Tensor | range | int") -> tuple[int, torch.Tensor | None, int]:
        """(cache length after appending n rows, the mask: None = causal over the new rows, built here for n > 1,
        the first cache slot the rows may see: 0). With a sliding window, the mask is also restricted by
        eagle/sliding_window.py's rule on the slots' positions (recorded here) and starts at the first slot inside the
        lowest row's window (every earlier slot is outside every row's window): drafting reads W keys, not L."""
        end = self.length + n
        if end > self.capacity:
            raise RuntimeError(f"draft KV cache overflow: {end} positions > capacity {self.capacity}")
        if mask is None and n > 1:
            mask = torch.ones(n, end, dtype=torch.bool, device=device).tril(diagonal=self.length)  # [n, L + n]
        if self.window is not None:
            new = self._pos[self.length : end]
            if isinstance(positions, int):
                new.fill_(positions)
            elif isinstance(positions, range):
                new.copy_(torch.arange(positions.start, positions.stop, device=new.device))
            else:
                new.copy_(positions.reshape(-1).expand(n) if positions.numel() == 1 else positions.reshape(-1))
            mask = restrict_mask(mask, new, self._pos[:end], self.window)  # [.., n, L + n]
            start = int((self._pos[:end] > new.min() - self.window).nonzero()[0])  # one host sync per call
            return end, mask[..., start:], start
        return end, mask, 0

    def _rotary(self, positions: "torch.Tensor | range | int") -> tuple[torch.Tensor, torch.Tensor]:
        self._reserve(positions_end(positions))
        return rows_at(positions, self._cos, self._sin)


class Eagle3HeadDecoder(HeadDecoder):
    """Decoding forward of an `Eagle3Head` (same cache, `truncate`, `refresh` contract as `HeadDecoder`).

    `fuse(aux [n, 3H]) -> [n, H]` is fc on the target's aux states (committed positions; EAGLE-3.1's norms first);
    `forward(features [n, H], next_ids, positions, mask)` returns the layer's output hidden (pre-norm; with
    norm_output the final norm's output), which is both the next drafted node's feature and, through `logits`, the
    draft distribution over the draft vocabulary.

    Fast path (small heads), as `HeadDecoder`'s: the embedding half of q|k|v (input_layernorm included) is a [V, ...]
    token table, the feature half has hidden_norm's weight (and sqrt(H)) folded in and is divided by the feature's
    norm taken over a scratch row padded with sqrt(H eps) (one `addcdiv` joins both halves); q|k|v come with their
    rolled copy (rotary = mul + addcmul; K and V enter the cache in one copy); the post-attention norm is folded into
    gate|up. Same math as `Eagle3Head.unroll` up to float rounding, which only the draft sees.
    """

    def _fast_fits(self, capacity: int) -> bool:
        c = self.head.config
        heads = self.n_heads + 2 * self.n_kv
        extra = (2 * c.vocab_size * heads * self.head_dim  # token table (q|k|v and rolled)
                 + 2 * heads * self.head_dim * c.hidden_size  # feature half, and rolled
                 + 2 * c.intermediate_size * c.hidden_size  # folded gate|up
                 + 2 * max(capacity, 256) * heads * self.head_dim)  # rotary tables
        return (extra * self.head.fc.weight.element_size() <= FAST_HEAD_MAX_BYTES
                and c.vocab_size * c.hidden_size * 2 * heads * self.head_dim <= FAST_HEAD_MAX_TABLE_MACS)

    @torch.no_grad()
    def refresh(self) -> None:
        """(Re)take the weights: transposed views, or for the fast path the folded / rolled copies."""
        head, layer = self.head, self.head.midlayer
        a, m = layer.self_attn, layer.mlp
        H, D = self.hidden, self.head_dim
        self.window = window_size(head.config.options)  # head.sliding_window (None = full attention)
        self.fc_t = head.fc.weight.detach().t()  # [3H, H]
        self.o_t = a.o_proj.weight.detach().t()  # [h D, H]
        self.down_t = m.down_proj.weight.detach().t()  # [I, H]
        self.norm_w = head.norm.weight.detach()
        self.lm_t = head.lm_head.weight.detach().t()  # [H, Vd]
        # EAGLE-3.1: the norms before fc, and whether forward hands out norm(h) (then `logits` reads it as normed)
        self.in_norm_w = None if head.input_norm is None else head.input_norm.weight.detach()  # [3H]
        self.fc_norm_w = None if head.fc_norm is None else [n.weight.detach() for n in head.fc_norm]  # 3 x [H]
        self.norm_output = bool(head.config.options.norm_output)
        self.d2t = head.d2t
        w_qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()  # [(h + 2 kv) D, 2H]
        b_qkv = None if a.q_proj.bias is None else torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).detach()
        if not self.fast:
            self.emb = head.embed_tokens.weight.detach()
            self.ln_in, self.ln_h = layer.input_layernorm.weight.detach(), layer.hidden_norm.weight.detach()
            self.qkv_t, self.qkv_b = w_qkv.t(), b_qkv  # [2H, (h + 2 kv) D]
            self.ln = layer.post_attention_layernorm.weight.detach()
            self.gate_up_t = torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach().t()  # [H, 2 I]
            return
        dt = head.dtype
        heads = self.n_heads + 2 * self.n_kv

        def with_rolled(w):  # [(h + 2 kv) D, k] -> [2 (h + 2 kv) D, k]: output row i of a head -> i + D/2 in the copy
            return torch.cat([w, w.view(heads, D, -1).roll(D // 2, dims=1).reshape(heads * D, -1)])

        emb_normed = rms_norm(head.embed_tokens.weight.float(), layer.input_layernorm.weight.float(), self.eps)  # [V, H]
        table = emb_normed @ with_rolled(w_qkv[:, :H].float()).t()  # [V, 2 (h + 2 kv) D]
        if b_qkv is not None:
            table += with_rolled(b_qkv.float()[:, None])[:, 0]
        self.tok_qkv = table.to(dt)
        w_feat = w_qkv[:, H:].float() * (layer.hidden_norm.weight.float() * math.sqrt(H))  # hidden_norm folded in
        self.feat_qkv_t = with_rolled(w_feat).to(dt).t()  # [H, 2 (h + 2 kv) D]
        w_gu = torch.cat([m.gate_proj.weight, m.up_proj.weight]).float()  # [2 I, H]
        self.gate_up_t = (w_gu * (layer.post_attention_layernorm.weight.float() * math.sqrt(H))).to(dt).t()

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[n, 3H] target aux states -> [n, H] the committed positions' features (EAGLE-3.1's norms first when on)."""
        aux = aux.to(self.fc_t.dtype)
        if self.in_norm_w is not None:
            aux = rms_norm(aux, self.in_norm_w, self.eps)
        if self.fc_norm_w is not None:
            aux = torch.cat([rms_norm(a, w, self.eps) for a, w in zip(aux.chunk(len(self.fc_norm_w), -1), self.fc_norm_w)], -1)
        return torch.mm(aux, self.fc_t)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] output hidden -> [n, Vd] draft-vocabulary logits (lm_head(norm(hidden)); with norm_output `forward`
        already handed out norm(hidden))."""
        return torch.mm(hidden if self.norm_output else rms_norm(hidden, self.norm_w, self.eps), self.lm_t)

    def topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, H] output hiddens -> the k best of the draft vocabulary (float32 log-probs [n, k]), mapped to target
        ids [n, k] (d2t)."""
        lp, draft_ids = torch.log_softmax(self.logits(hidden).float(), dim=-1).topk(k, dim=-1)  # [n, k]
        return lp, draft_ids + self.d2t[draft_ids]

    def probs(self, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
        """[n, H] output hiddens -> [n, V] float32 draft distribution over the TARGET vocabulary at `temperature`: the
        draft vocabulary's probabilities at their target ids (d2t), 0 elsewhere."""
        draft = self.logits(hidden).float()  # [n, Vd]
        ids = torch.arange(draft.shape[-1], device=draft.device) + self.d2t  # [Vd] target ids
        logits = draft.new_full((draft.shape[0], self.head.config.vocab_size), float("-inf"))
        logits[:, ids] = draft
        return torch.softmax(logits / temperature, dim=-1)

    def forward(self, features: torch.Tensor, next_ids: torch.Tensor, positions: "torch.Tensor | range | int",
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """As `HeadDecoder.forward`: features [n, H] (fused aux states or the head's own output hiddens), next_ids [n],
        positions, mask [n, length + n] (None = causal over the new rows). Returns the output hiddens [n, H]."""
        n = next_ids.shape[0]
        end, mask, start = self._append_bounds(n, mask, features.device, positions)
        h_, kv_, d_ = self.n_heads, self.n_kv, self.head_dim
        features = features.to(self._kv.dtype)
        if self.fast:
            rows = self._scratch(n)
            rows[:, : self.hidden] = features
            norm = torch.linalg.vector_norm(rows, dim=-1, keepdim=True,
                                            dtype=accumulation_dtype(rows.dtype))  # sqrt(H (mean(f^2) + eps))
            y = torch.addcdiv(F.embedding(next_ids, self.tok_qkv), torch.mm(features, self.feat_qkv_t), norm.to(features.dtype))
            y, y_rolled = y.view(n, 2, h_ + 2 * kv_, d_).unbind(1)  # q|k|v, then rolled
            cos, sin = self._rotary(positions)  # [n | 1, h + 2 kv, D]
            qkv = torch.addcmul(y * cos, y_rolled, sin).transpose(0, 1)  # rotated q, k; v as is: [h + 2 kv, n, D]
            self._kv[:, self.length : end] = qkv[h_:]  # K and V in one copy
            q = qkv[:h_]
        else:
            x_in = torch.cat([rms_norm(F.embedding(next_ids, self.emb), self.ln_in, self.eps),
                              rms_norm(features, self.ln_h, self.eps)], dim=-1)  # [n, 2H]
            qkv = linear_t(x_in, self.qkv_t, self.qkv_b).view(n, -1, d_).transpose(0, 1)  # [h + 2 kv, n, D]
            cos, sin = self.head.rotary.at(positions, features.device, features.dtype)  # [n | 1, D]
            qk = rotate_rolled(qkv[: h_ + kv_], cos, sin)
            self._kv[:kv_, self.length : end] = qk[h_:]
            self._kv[kv_:, self.length : end] = qkv[h_ + kv_ :]
            q = qk[:h_]
        self.length = end
        keys, values = self._keys.narrow(2, start, end - start), self._values.narrow(2, start, end - start)  # [1, kv, L + n, D]
        att = sdpa_attention(q.unsqueeze(0), keys, values, mask)  # [n, h D]
        if self.fast:
            x = torch.addmm(features, att, self.o_t, out=rows.narrow(1, 0, self.hidden))  # residual + o_proj
            norm = torch.linalg.vector_norm(rows, dim=-1, keepdim=True, dtype=accumulation_dtype(rows.dtype))
            gate, up = torch.mm(x, self.gate_up_t).div_(norm).chunk(2, -1)
        else:
            x = torch.addmm(features, att, self.o_t)  # residual + o_proj
            gate, up = torch.mm(rms_norm(x, self.ln, self.eps), self.gate_up_t).chunk(2, -1)
        out = torch.addmm(x, F.silu(gate) * up, self.down_t)  # residual + down_proj: [n, H]
        return rms_norm(out, self.norm_w, self.eps) if self.norm_output else out
