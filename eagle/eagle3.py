"""The EAGLE-3 draft head (`Eagle3Head`) in the released yuhuili/EAGLE3-* / SpecForge checkpoint layout.

  x_t = fc( cat[ a_t^(l1), a_t^(l2), a_t^(l3) ] )              (committed positions: the target's aux layers)
        EAGLE-3.1 options: norm_before_fc = fc(input_norm(cat[...])) (one RMSNorm over 3H), fc_norm = each aux
        state through its own RMSNorm first (fc_norm.0/1/2; after input_norm when both are on)
  h   = x + Attn( cat[ input_layernorm(embed(tok)), hidden_norm(x) ] )   (q/k/v read 2H)
  h   = h + MLP(post_attention_layernorm(h))                     (the head's output hidden, pre-norm)
  logits over the DRAFT vocabulary = lm_head(norm(h)); draft id d is target id d + d2t[d]

Drafted nodes take the head's own output hidden h as their feature x (EAGLE-3.1's norm_output: norm(h), the final
norm's output, which the lm_head reads too). vLLM 0.32's llama_eagle3.py builds the same function from the same keys. Aux layer ids follow the EAGLE reference
and vLLM: id j = HF `output_hidden_states[j]` = the residual stream ENTERING decoder layer j (0 = embeddings).
"""
from __future__ import annotations

import torch
from torch import nn

from eagle.head_checks import layout_problems
from eagle.head_config import HeadConfig, head_config_from_target
from eagle.head_decoder import Eagle3HeadDecoder
from eagle.head_kinds import EAGLE3, N_AUX_LAYERS, HeadConfigError, draft_vocab_problems
from eagle.head_module import HeadModule
from eagle.layers import MLP, Attention, RMSNorm, Rotary, init_head_weights
from eagle.sliding_window import window_size
from eagle.unroll import causal_attention, padded_positions, unroll_self_fed


class Eagle3Layer(nn.Module):
    """The EAGLE-3 draft layer: attention reads [input_layernorm(embed) ; hidden_norm(feature)] (2H wide), the
    residual stream starts at the feature; then the usual post-attention norm + SwiGLU MLP."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.self_attn = Attention(c, in_features=2 * c.hidden_size)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def attn_input(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """emb, feat [..., H] -> [..., 2H] (embedding first, as the reference)."""
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(feat)], dim=-1)

    def finish(self, feat: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + MLP: feat [..., H] + o_proj output [..., H] -> the layer's output hidden [..., H]."""
        x = feat + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(HeadModule, kind=EAGLE3):
    """The EAGLE-3 draft head (see module docstring). Keys follow the released EAGLE-3 checkpoints; `embed_tokens`
    is a frozen copy of the target's, never saved (`bind_target` / `EaModel.from_pretrained` fill it)."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.check_kind(config)
        self.config = config
        H, V, Vd, o = config.hidden_size, config.vocab_size, config.options.draft_vocab_size, config.options
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's frozen embedding
        self.input_norm = RMSNorm(N_AUX_LAYERS * H, config.rms_norm_eps) if o.norm_before_fc else None
        self.fc_norm = nn.ModuleList([RMSNorm(H, config.rms_norm_eps) for _ in range(N_AUX_LAYERS)]) \
            if o.fc_norm else None
        self.fc = nn.Linear(N_AUX_LAYERS * H, H, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.d2t = nn.Buffer(torch.zeros(Vd, dtype=torch.long))  # target id = draft id + d2t[draft id]
        self.t2d = nn.Buffer(torch.arange(V) < Vd)  # [V] bool: target token is in the draft vocabulary
        self.rotary = Rotary(config)
        self._init_weights()

    def _init_weights(self, std: float = 0.02) -> None:
        init_head_weights(self, std)

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_target(cls, target_model, aux_layers=None, draft_vocab_size: int | None = None) -> "Eagle3Head":
        """A freshly initialised EAGLE-3 head for `target_model` (HF causal LM), its embedding copied in; the draft
        vocabulary is the first `draft_vocab_size` target ids until `set_vocab` installs a real one."""
        head = cls(head_config_from_target(target_model.config, kind=cls.kind.name, aux_layers=list(aux_layers or []),
                                           draft_vocab_size=draft_vocab_size or 0))
        head.bind_target(target_model)
        return head

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor | None = None) -> None:
        """Install a draft vocabulary: d2t int [Vd] (target id = draft id + d2t[draft id]); t2d bool [V] (derived from
        d2t when None). Checked: lengths, target ids in range and distinct, t2d consistent with d2t."""
        c = self.config
        problems, derived = draft_vocab_problems(c.vocab_size, c.options.draft_vocab_size, d2t, t2d)
        if problems:
            raise HeadConfigError(problems[0])
        d2t = torch.as_tensor(d2t).long().flatten().cpu()
        self.d2t.copy_(d2t.to(self.d2t.device))
        self.t2d.copy_(derived.to(self.t2d.device))

    def decoder(self, capacity: int, fast: bool | None = None, lm_head: nn.Module | None = None) -> Eagle3HeadDecoder:
        """An `Eagle3HeadDecoder` (eagle/head_decoder.py): the decoding forward with its own KV cache; it scores drafts
        with the head's own lm_head over the draft vocabulary (the target's `lm_head` is not used)."""
        return Eagle3HeadDecoder(self, capacity, fast=fast)

    # -- forward ----------------------------------------------------------------------
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., 3H] (the target's aux states) -> the committed positions' features [..., H]: fc, after EAGLE-3.1's
        input_norm (norm_before_fc) and per-state fc_norm when on."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([norm(a) for norm, a in zip(self.fc_norm, aux.chunk(N_AUX_LAYERS, dim=-1))], dim=-1)
        return self.fc(aux)

    def feed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The feature a drafted node hands its children: its output hidden, or norm(hidden) with norm_output."""
        return self.norm(hidden) if self.config.options.norm_output else hidden

    def _self_fed_input(self, emb: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A self-fed step's (attention input [.., 2H], residual [.., H]) from the token embedding and the previous
        step's output hidden."""
        feat = self.feed(prev)
        return self.midlayer.attn_input(emb, feat), feat

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (the layer's output, pre-norm) -> logits over the draft vocabulary [..., Vd]."""
        return self.lm_head(self.norm(hidden))

    def map_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids [...] -> target ids [...] (draft id + d2t[draft id])."""
        return draft_ids + self.d2t[draft_ids]

    def unroll(self, aux: torch.Tensor, next_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               steps: int = 1, rows: torch.Tensor | None = None, shards=None) -> list[torch.Tensor]:
        """Training forward with the training-time test: the head unrolled `steps` times over every position.

        aux [B, T, 3H]: the target's aux-layer states at position t; next_ids [B, T]: the token after position t;
        attention_mask [B, T] (1 = real token; right or left padding). Returns `steps` hiddens (pre-norm):
        step 1 [B, T, H] at index t reads (fc(aux_t), embed(next_ids[t])) at position t, causal over step-1 keys;
        step j >= 2 [B, R, H] at index t reads (its own step j-1 hidden, embed(next_ids[t + j - 1])) at position
        t + j - 1 and attends to the step-1 keys at indices <= t plus its own steps 2..j (the diagonal): exactly what
        decoding sees for a drafted chain. Step j's output at t predicts the token at t + j + 1; indices where
        t + j - 1 runs off the sequence read a pad token and must be masked by the caller.
        rows [R] (sorted indices, None = all T): steps >= 2 are computed only at these indices (a cost knob: each
        such step costs one [R, T] score matrix against the cached step-1 keys plus j - 1 diagonal products).
        shards (None = the whole record): sequence parallelism (train/sequence_parallel.py): aux, next_ids, rows are
        this rank's span of ONE unpadded record (B = 1, attention_mask None), at the span's positions; every attention
        runs over the whole record for this rank's share of the heads (DeepSpeed Ulysses' all-to-all), so the span's
        hiddens equal the 1-rank unroll's at those indices.
        """
        if steps < 1:
            raise ValueError(f"steps={steps}: must be >= 1")
        B, T, _ = aux.shape
        layer, attn = self.midlayer, self.midlayer.self_attn
        dev, dt = aux.device, aux.dtype
        feat = self.fuse(aux)  # [B, T, H]
        emb = self.embed_tokens(next_ids).to(dt)  # [B, T, H]
        window = window_size(self.config.options)
        if shards is None:
            real, pos, mask = padded_positions(attention_mask, T, dev)  # [B, T] | None, [B|1, T], [B, 1, T, T] | None
        else:
            real, pos, mask = None, shards.positions(T, dev), None  # [1, T]: the span's positions in the record
        cos, sin = self.rotary(pos, dt)
        q, k1, v1 = attn.qkv(layer.attn_input(emb, feat), cos, sin)  # [B, h, T, D], [B, kv, T, D] x 2
        if shards is None:
            out = causal_attention(q, k1, v1, mask, pos, real, window).transpose(1, 2).reshape(B, T, -1)  # [B, T, hD]
        else:
            out = shards.attend(attn, q, k1, v1, lambda q_, k_, v_, pos_: causal_attention(q_, k_, v_, None, pos_, None,
                                                                                          window), keep=True)
        hidden = layer.finish(feat, attn.o_proj(out))  # [B, T, H]
        if steps == 1:
            return [hidden]
        return [hidden] + self.later_steps(hidden, k1, v1, next_ids, pos, real, steps, rows, shards)

    def later_steps(self, hidden, k1, v1, next_ids, pos, real, steps: int, rows, shards=None) -> list[torch.Tensor]:
        """Steps 2..`steps` of `unroll` from step 1's outputs and keys (eagle/unroll.py): the training-time test, each
        step reading its own step j-1 hidden and the data's token. A kind drafting otherwise overrides this."""
        layer = self.midlayer
        return unroll_self_fed(layer.self_attn, self.rotary, self.embed_tokens, self._self_fed_input, layer.finish,
                               hidden, k1, v1, next_ids, pos, real, steps, rows, window_size(self.config.options),
                               shards)

    def forward(self, aux: torch.Tensor, next_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                steps: int = 1, rows: torch.Tensor | None = None, shards=None) -> list[torch.Tensor]:
        """= `unroll` (so a DeepSpeed engine wrapping the head runs it through its forward hooks)."""
        return self.unroll(aux, next_ids, attention_mask, steps=steps, rows=rows, shards=shards)

    # -- checkpoint I/O ---------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, config: HeadConfig, sd: dict[str, torch.Tensor], source: str = "state dict",
                        dtype: torch.dtype | None = None, device=None) -> "Eagle3Head":
        """Build a head from released-layout tensors (ours, or the released / SpecForge layout), checking every key and
        shape (one-line errors). `embed_tokens` is loaded when the checkpoint has it, else stays empty until
        `bind_target`; `t2d` is derived from `d2t` when absent, and both may be absent only for a full draft vocabulary;
        `from_pretrained` (HeadModule's) reads a folder into it."""
        head = cls(config)
        sd = dict(sd)
        d2t, t2d = sd.pop("d2t", None), sd.pop("t2d", None)
        if d2t is None and config.options.draft_vocab_size != config.vocab_size:
            raise HeadConfigError(f"{source} has no d2t but draft_vocab_size={config.options.draft_vocab_size} < "
                                  f"vocab_size={config.vocab_size}")
        problems = layout_problems(config, {k: tuple(v.shape) for k, v in sd.items()},
                                   optional={"d2t", "t2d"})  # eagle/head_checks.py; the maps: set_vocab below
        if problems:
            raise HeadConfigError(f"EAGLE-3 checkpoint {source} does not match its config: {'; '.join(problems)}")
        head.load_state_dict(sd, strict=False)
        if d2t is not None:
            head.set_vocab(d2t, t2d)
        if dtype is not None:
            head.to(dtype)
        if device is not None:
            head.to(device)
        return head
