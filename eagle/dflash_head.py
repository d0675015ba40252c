"""The DFlash draft (`DFlashHead`, block drafting, arXiv 2602.06036) and its decoding forward (`DFlashDecoder`).

  c_t   = hidden_norm( fc( cat[ h_t^(l1), ..., h_t^(lK) ] ) )     the context: K target layers' states at position t
  block = [ x_p, m, ..., m ]  at positions p .. p + B - 1          the last verified token, B - 1 mask tokens
  x     = embed(block)                                              (the target's frozen embedding)
  each of the `draft_layers` layers (Qwen3-style: per-head q_norm / k_norm before RoPE):
    a   = input_layernorm(x);  q = q_norm(q_proj(a));  keys / values = [k_norm(k_proj(c_<p)), k_norm(k_proj(a))] /
          [v_proj(c_<p), v_proj(a)]  (the context is injected into EVERY layer; it is not input-normed again)
    x   = x + o_proj(attn(q, keys, values)); x = x + MLP(post_attention_layernorm(x))
  out   = norm(x)  -> the target's frozen lm_head: block position i (1..B-1) is the draft of token x_{p+i}

The block attends to the whole context before p and to itself: bidirectionally (the paper's), or causally with
`causal`. One forward drafts B - 1 tokens; position i does not see the drafts before it, only the mask tokens.

Training (`forward`) runs every anchor of a record in one call: A anchors x B query rows, the context keys computed
once per layer for all T positions, a mask giving each anchor's block the context before its anchor (and the
record's real tokens only) and its own block. Decoding (`DFlashDecoder`) keeps the committed context's keys / values
per layer (they never depend on a block) and runs one block per round over them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eagle.block_draft import BlockDrafter
from eagle.head_checks import layout_problems
from eagle.head_config import HeadConfig
from eagle.head_kinds import DFLASH, HeadConfigError
from eagle.head_module import HeadModule
from eagle.layers import MLP, RMSNorm, Rotary, init_head_weights, rotate_half


class DFlashAttention(nn.Module):
    """Attention of one draft layer: queries from the block, keys / values from [context ; block] (Qwen3 layout:
    q_norm / k_norm over each head's dim before RoPE)."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        H, D = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=c.qkv_bias)
        self.k_proj = nn.Linear(H, self.n_kv * D, bias=c.qkv_bias)
        self.v_proj = nn.Linear(H, self.n_kv * D, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, c.rms_norm_eps)
        self.k_norm = RMSNorm(D, c.rms_norm_eps)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, h, n, D], cos / sin [B|1, n, D]."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return x * cos + rotate_half(x) * sin

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, n, H] -> rotated k, v [B, kv, n, D]."""
        B, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, n, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, n, self.n_kv, self.head_dim).transpose(1, 2)
        return self.rope(k, cos, sin), v

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask):
        """x [B, Q, H] (input-normed block rows); ctx_k / ctx_v [B, kv, C, D]; mask [B, 1, Q, C + Q] bool."""
        B, Q, _ = x.shape
        q = self.rope(self.q_norm(self.q_proj(x).view(B, Q, self.n_heads, self.head_dim)).transpose(1, 2), cos, sin)
        k, v = self.kv(x, cos, sin)
        out = F.scaled_dot_product_attention(q, torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2), attn_mask=mask,
                                             enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class DFlashLayer(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.self_attn = DFlashAttention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(HeadModule, kind=DFLASH):
    """The DFlash draft (module docstring). `embed_tokens` is a frozen copy of the target's, never saved; it has no
    lm_head (the target's scores its outputs: `DFlashDecoder.topk`, the trainer's loss)."""

    drafter_class = BlockDrafter

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.check_kind(config)
        self.config = config
        o, H = config.options, config.hidden_size
        if not o.target_layers:
            raise HeadConfigError("a DFlash head needs its target_layers resolved (head_config_from_target / "
                                  "fit_to_target)")
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(len(o.target_layers) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(o.draft_layers)])
        if o.tie_k_norm:  # one k_norm module (one weight) in every layer
            for layer in self.layers[1:]:
                layer.self_attn.k_norm = self.layers[0].self_attn.k_norm
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.rotary = Rotary(config)
        init_head_weights(self)

    @property
    def block_size(self) -> int:
        return int(self.config.options.block_size)

    @property
    def mask_token_id(self) -> int:
        return int(self.config.options.mask_token_id)

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, config: HeadConfig, sd: dict[str, torch.Tensor], source: str = "state dict",
                        dtype: torch.dtype | None = None, device=None) -> "DFlashHead":
        head = cls(config)
        problems = layout_problems(config, {k: tuple(v.shape) for k, v in sd.items()}, optional={"embed_tokens.weight"})
        if problems:
            raise HeadConfigError(f"DFlash checkpoint {source} does not match its config: {'; '.join(problems)}")
        head.load_state_dict(sd, strict=False)
        if dtype is not None:
            head.to(dtype)
        return head.to(device) if device is not None else head

    def official_state_dict(self) -> dict[str, torch.Tensor]:
        """Every layer's k_norm under its own name (a copy each when tie_k_norm shares one weight)."""
        return {k: v.clone() for k, v in super().official_state_dict().items()}

    def decoder(self, capacity: int, fast: bool | None = None, lm_head: nn.Module | None = None) -> "DFlashDecoder":
        return DFlashDecoder(self, capacity, lm_head)

    # -- forward ----------------------------------------------------------------------
    def context(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., K H] (the target layers' states) -> the context rows [..., H]: hidden_norm(fc(.))."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def block_tokens(self, roots: torch.Tensor) -> torch.Tensor:
        """roots [...] -> [..., B]: each root (the last verified token) then B - 1 mask tokens."""
        masks = roots.new_full((*roots.shape, self.block_size - 1), self.mask_token_id)
        return torch.cat([roots[..., None], masks], -1)

    def block_mask(self, n_blocks: int, device) -> torch.Tensor:
        """[n B, n B] bool: a block row sees its own block (all of it, or causally with `causal`)."""
        B = self.block_size
        own = torch.ones(B, B, dtype=torch.bool, device=device)
        if self.config.options.causal:
            own = own.tril()
        return torch.block_diag(*[own] * n_blocks) if n_blocks > 1 else own

    def run(self, x: torch.Tensor, ctx: torch.Tensor, ctx_pos: torch.Tensor, q_pos: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor:
        """x [b, Q, H] block embeddings at q_pos [b, Q]; ctx [b, C, H] at ctx_pos [b, C]; mask [b, 1, Q, C + Q]
        -> norm(out) [b, Q, H]."""
        dt = x.dtype
        cos_c, sin_c = self.rotary(ctx_pos, dt)
        cos_q, sin_q = self.rotary(q_pos, dt)
        for layer in self.layers:
            ck, cv = layer.self_attn.kv(ctx, cos_c, sin_c)
            x = layer(x, ck, cv, cos_q, sin_q, mask)
        return self.norm(x)

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                anchors: torch.Tensor) -> torch.Tensor:
        """Training: features [b, T, K H] (the target layers' states at every position), input_ids / attention_mask
        [b, T], anchors [b, A] (positions p >= 1 of blocks; -1 = none) -> [b, A, B, H]: block position i of anchor p
        drafts token x_{p+i} from the context c_0 .. c_{p-1} (real tokens only) and its own block."""
        b, T = input_ids.shape
        A, B = anchors.shape[1], self.block_size
        ctx = self.context(features)  # [b, T, H]
        p = anchors.clamp(min=0)  # [b, A]
        roots = input_ids.gather(1, p)  # [b, A]
        x = self.embed_tokens(self.block_tokens(roots)).reshape(b, A * B, -1).to(ctx.dtype)  # [b, A B, H]
        q_pos = (p[..., None] + torch.arange(B, device=p.device)).reshape(b, A * B)  # [b, A B]
        ctx_pos = torch.arange(T, device=p.device).expand(b, T)
        sees_ctx = (torch.arange(T, device=p.device)[None, None] < p[..., None]) & attention_mask.bool()[:, None]
        sees_ctx = sees_ctx & (anchors >= 0)[..., None]  # [b, A, T]
        sees_ctx = sees_ctx[:, :, None].expand(b, A, B, T).reshape(b, A * B, T)
        own = self.block_mask(A, p.device).expand(b, A * B, A * B)
        mask = torch.cat([sees_ctx, own], -1)[:, None]  # [b, 1, A B, T + A B]
        return self.run(x, ctx, ctx_pos, q_pos, mask).view(b, A, B, -1)


class DFlashDecoder:
    """Decoding forward of a `DFlashHead`: the committed context's keys / values per layer (appended by `commit`,
    never rolled back: no block enters them), one block per `block` call, drafts scored by the target's lm_head."""

    def __init__(self, head: DFlashHead, capacity: int, lm_head: nn.Module | None):
        self.head, self.lm_head = head, lm_head
        self.reset(capacity)

    def reset(self, capacity: int) -> None:
        self.length = 0
        self._k: list[list[torch.Tensor]] = [[] for _ in self.head.layers]
        self._v: list[list[torch.Tensor]] = [[] for _ in self.head.layers]

    def truncate(self, length: int) -> None:
        if length != self.length:
            raise RuntimeError(f"DFlashDecoder: the context holds committed positions only ({self.length}); "
                               f"cannot truncate to {length}")

    def commit(self, features: torch.Tensor) -> None:
        """features [n, K H]: the target layers' states of n newly committed positions (positions length ..)."""
        head = self.head
        ctx = head.context(features)[None]  # [1, n, H]
        pos = torch.arange(self.length, self.length + ctx.shape[1], device=ctx.device)[None]
        cos, sin = head.rotary(pos, ctx.dtype)
        for i, layer in enumerate(head.layers):
            k, v = layer.self_attn.kv(ctx, cos, sin)
            self._k[i].append(k)
            self._v[i].append(v)
        self.length += ctx.shape[1]

    def block(self, root: torch.Tensor) -> torch.Tensor:
        """root [] (the last verified token, at position `length`) -> the block's outputs [B, H] (row i drafts the
        token i positions after the root; row 0 is unused)."""
        head, B = self.head, self.head.block_size
        self._compact()
        x = head.embed_tokens(head.block_tokens(root.reshape(1)))[None].reshape(1, B, -1).to(head.dtype)
        q_pos = torch.arange(self.length, self.length + B, device=x.device)[None]
        mask = torch.cat([torch.ones(B, self.length, dtype=torch.bool, device=x.device),
                          head.block_mask(1, x.device)], -1)[None, None]  # [1, 1, B, C + B]
        dt = x.dtype
        cos_q, sin_q = head.rotary(q_pos, dt)
        for i, layer in enumerate(head.layers):
            x = layer(x, self._k[i][0], self._v[i][0], cos_q, sin_q, mask)
        return head.norm(x)[0]

    def _compact(self) -> None:
        for cache in (self._k, self._v):
            for i, parts in enumerate(cache):
                if len(parts) > 1:
                    cache[i] = [torch.cat(parts, 2)]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.lm_head.weight
        return F.linear(hidden.to(w.dtype), w, getattr(self.lm_head, "bias", None)).float()

    def topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, H] block outputs -> (float32 log-probs [n, k], target token ids [n, k]) through the target's lm_head."""
        return torch.log_softmax(self.logits(hidden), dim=-1).topk(k, dim=-1)

    def probs(self, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
        return torch.softmax(self.logits(hidden) / temperature, dim=-1)
