"""The train stage's part of each head kind: what the trainer, its evaluation, eval_head and the plan do differently,
one class per kind, keyed by the library's kind objects (eagle/head_kinds.py). Everything else is written once.

    part = training_kind(cfg, target_config)        # Eagle2Training | Eagle3Training
    head = part.new_head(target_config, source, train_set.indices, frozen.lm_head)
    out = part.loss(engine, features, batch, frozen.lm_head, micro)   # LossOutput (train/loss.py: draft_loss)
    batch = part.eval_batch(head, features, batch, lm_head)           # train/held_out.py: evaluate

EAGLE-2: fc over the final hidden state, ONE step with the feature loss, both token distributions through the target's
lm_head (chunked: train.loss_chunk); eval chains rolled out through the head's decoder, plus all-fed steps.
EAGLE-3: fc over three aux layers, the training-time-test unroll of `head.ttt_steps` steps (steps >= 2 at every
`head.ttt_row_stride`-th position, the offset cycling with the micro-step so every position is covered), the token
loss (recipe `loss.token`) over the draft vocabulary (built from the training split's loss tokens); eval chains read off one unroll.
P-EAGLE: EAGLE-3's, the unroll being the head's parallel one (k draft positions from one forward, mask inputs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from data_prep.feature_layers import feature_layers
from eagle.head_config import head_config_from_target
from eagle.head_kinds import DFLASH, EAGLE2, EAGLE3, EAGLE31_NORMS, PEAGLE, HeadKind, head_kind, text_config
from eagle.sampling import greedy_ids
from recipes import RecipeError
from recipes.head import check_head_fits_target, dpace, head_options
from recipes.loss import loss_section
from train.draft_vocab import build_draft_vocab, count_loss_tokens, vocab_coverage
from train.loss import ChunkedTokenLoss, LossOutput, Shifted, StepScore, add_input_noise, draft_loss, shift, topk_hits
from train.block_loss import block_loss, sample_anchors
from train.losses import TokenLoss, confidence, feature_loss, position_weighting, smooth_l1, token_loss
from train.held_out import all_fed_rollout, chain_rollout


@dataclass
class EvalBatch:
    """One eval micro-batch of a head kind: the training loss, and the self-fed chains from chosen start positions."""

    out: LossOutput
    weights: torch.Tensor  # [B, T-1] step 1's loss positions (chain starts are drawn among them)
    chains: Callable[[int, int, list[int]], torch.Tensor]  # (record b, its length, starts) -> correct [n, k] bool
    extra_hits: torch.Tensor  # [e] float64: the kind's extra per-step metric (EAGLE-2 all-fed, EAGLE-3 ttt steps)
    extra_counts: torch.Tensor  # [e] float64


class TrainingKind:
    """The interface; the shared parts (shift, the training step) are written here once."""

    kind: HeadKind
    extra_eval = ""  # eval/{extra_eval}_step{j}_acc (j = 1..extra_steps): the kind's extra per-step accuracy
    extra_steps = 0
    logged_steps = 0  # unrolled steps whose accuracy is logged as train/step{j}_acc
    sequence_parallel = False  # train.sequence_parallel_size > 1 splits its records over ranks (`sharded_loss`)

    def __init__(self, cfg, target_config):
        self.cfg, self.t = cfg, cfg.train
        self.options = head_options(cfg.head)  # the kind's own typed options (eagle/head_kinds.py)
        self.layers = feature_layers(cfg.head, target_config)  # which target states the head reads (cache layout)
        self.hidden = int(text_config(target_config).hidden_size)
        self.steps, self.step_weights, self.feature_weight = 1, [self.t.token_weight], 0.0
        self.stride = 1  # steps >= 2 run at every stride-th index (offset cycling with the micro-step)
        self.token_loss, self.feature_loss = token_loss(cfg), feature_loss(cfg)  # recipe `loss` (train/losses.py)
        self.weighting = position_weighting(cfg)  # None (fixed step weights) | DPace: per-chain step weights
        self.loss_cfg = loss_section(cfg)

    @property
    def steps_key(self) -> str:
        """The recipe key of the unrolled step count ("": the kind trains one step)."""
        return f"head.{self.options.steps_key}" if self.options.steps_key else ""

    @property
    def stride_key(self) -> str:
        """The recipe key of the row stride of steps >= 2."""
        return f"head.{self.options.stride_key}" if self.options.stride_key else ""

    def unrolled_weights(self) -> list[float]:
        """The unrolled steps' loss weights of the recipe (explicit, 0.8^(j-1), or 1 each under D-PACE)."""
        return self.options.step_weights(dpace(self.loss_cfg))

    def weights_text(self, w: list[float]) -> str:
        """How the describe line states the unrolled steps' weights."""
        if self.weighting is not None:
            return f"D-PACE weights, alpha {self.weighting.alpha}"
        return "weights " + ", ".join(f"{x:.2f}" for x in w)

    def describe(self) -> str | None:
        """What the trainer says about this kind's setup, if anything."""
        return None

    def check_steps_fit_records(self, lengths: list[int]) -> None:
        """RecipeError (one line naming the key and the bound) when the unrolled step count asks for more steps than
        the training records hold targets for: step j at input position t predicts token t + j, so a record of L
        tokens holds at most L - 1 steps; a step beyond the longest record would train on nothing while its
        activations are still allocated for every position."""
        longest = max(lengths, default=0)
        if self.steps_key and self.steps > max(longest - 1, 1):
            raise RecipeError(f"{self.steps_key}={self.steps} is more than the training records hold: the longest of "
                              f"the {len(lengths)} training records has {longest} tokens (after data.max_length and "
                              f"train.long_records), so at most {max(longest - 1, 1)} unrolled steps have a target; set "
                              f"{self.steps_key} <= {max(longest - 1, 1)}")

    def summary(self) -> dict:
        """Extra keys of the run summary."""
        return {}

    def shifted(self, features: torch.Tensor, batch) -> Shifted:
        """features [B, T, W] (the cached states; the last H the final state) aligned for the head."""
        return shift(self.kind.head_inputs(features, self.hidden), features[..., -self.hidden:], batch.input_ids,
                     batch.attention_mask, batch.loss_mask)

    def rows(self, T: int, micro: int, device) -> torch.Tensor | None:
        """Indices where unrolled steps >= 2 run this micro-batch: every stride-th, offset micro % stride (None = all)."""
        if self.stride == 1 or self.steps == 1:
            return None
        return torch.arange(micro % self.stride, T, self.stride, device=device)

    def loss(self, engine, features: torch.Tensor, batch, lm_head: torch.Tensor, micro: int, seed: int = 0,
             shards=None) -> LossOutput:
        """One micro-batch's training loss: the head (through the DeepSpeed engine) on noised inputs. `micro` is the
        micro-batch's key (the trainer's global position of it): its noise comes from a generator seeded by
        (seed, micro), so the same micro-batch gets the same noise on whichever rank of however many trains it.
        shards (train/sequence_parallel.py; None = the whole record here): `sharded_loss`."""
        t, s = self.t, self.shifted(features, batch)
        noise = torch.Generator(s.inputs.device).manual_seed((seed * 1_000_003 + micro) % 2**63)
        inputs = add_input_noise(s.inputs, t.noise, t.noise_std, noise)
        if shards is not None:
            return self.sharded_loss(engine, s, inputs, lm_head, micro, shards)
        rows = self.rows(s.inputs.shape[1], micro, s.inputs.device)
        targets = self.targets(engine.module, s.final, lm_head, self.steps)
        hiddens = self.unroll(engine, inputs, s.next_ids, s.attention_mask, self.steps, rows)
        return draft_loss(hiddens, s.weights, targets, self.step_weights, self.feature_weight, rows, self.weighting)

    def sharded_loss(self, engine, s: Shifted, inputs: torch.Tensor, lm_head: torch.Tensor, micro: int,
                     shards) -> LossOutput:
        """The loss of one record (B = 1) of which this rank holds the span `shards.span`: the record padded at its
        end to a multiple of the group size x the row stride (positions without loss, after every real one), this
        rank's span of its inputs and ids, and of its targets and loss weights plus the k - 1 positions after the span
        that steps 2..k score against; the head's attention spans the ranks (train/sequence_parallel.py)."""
        B, T = s.next_ids.shape
        if B != 1 or not bool(s.attention_mask.all()):
            raise ValueError(f"sequence parallelism trains one unpadded record per micro-batch, got {B} records of "
                             f"{T} positions (train.micro_batch_size must be 1)")
        multiple = shards.size * self.stride
        pad = -T % multiple
        lo, hi = shards.span(T + pad)
        k = self.steps
        halo = slice(lo, min(hi + k - 1, T + pad))

        def span(x: torch.Tensor, where: slice) -> torch.Tensor:  # [B, where, ...]: the rows past T are zeros
            part, short = x[:, min(where.start, T):min(where.stop, T)], where.stop - max(where.start, T)
            if short <= 0:
                return part.contiguous()
            return F.pad(part, (0, 0, 0, short) if x.dim() == 3 else (0, short))

        rows = self.rows(hi - lo, micro, s.inputs.device)  # lo is a multiple of the stride: the 1-rank rows' offset
        targets = self.targets(engine.module, span(s.final, halo), lm_head, k)
        hiddens = self.unroll(engine, span(inputs, slice(lo, hi)), span(s.next_ids, slice(lo, hi)), None, k, rows,
                              shards=shards)
        return draft_loss(hiddens, span(s.weights, halo), targets, self.step_weights, self.feature_weight, rows,
                          self.weighting, shards)

    def eval_loss(self, metrics: dict, loss_mean: float) -> float:
        """eval/loss: the mean training loss over the held-out positions."""
        return loss_mean

    # -- what differs -------------------------------------------------------------------
    def new_head(self, target_config, source, train_indices, lm_head):
        raise NotImplementedError

    def unroll(self, forward, inputs, next_ids, attention_mask, steps: int, rows) -> list[torch.Tensor]:
        """The head's outputs for `steps` unrolled steps (forward: the engine, or the plain head)."""
        raise NotImplementedError

    def targets(self, head, final: torch.Tensor, lm_head: torch.Tensor, steps: int):
        """What each unrolled step is scored against (a train.loss.StepTargets)."""
        raise NotImplementedError

    def eval_batch(self, head, features: torch.Tensor, batch, lm_head: torch.Tensor, k: int) -> EvalBatch:
        raise NotImplementedError

    # -- the plan (train/plan.py): per-kind memory formulas ---------------------------------
    @staticmethod
    def unrolled_rows(s, n_tok: int) -> list[int]:
        """Rows each unrolled step computes in a micro-batch of n_tok tokens: step 1 every token, steps >= 2 every
        ttt_row_stride-th."""
        return [n_tok] + [math.ceil(n_tok / s.ttt_row_stride)] * (s.ttt_steps - 1)

    @staticmethod
    def activation_bytes(s, cb: int, step: int = 1, keys: float = 0.0) -> float:
        """Bytes autograd keeps for backward per row of one head forward (eagle/eagle2.py; counted with
        torch.autograd.graph.saved_tensors_hooks, tests/test_plan.py pins it): fc input [2H], attention input, rotated
        q, SDPA output + its o_proj copy, MLP input (H each), k and v (2 kv), SwiGLU 4 x [I], in the compute dtype;
        the post-attention RMSNorm's float32 input (H); SDPA's log-sum-exp (h floats). An aligned step >= 2 keeps
        its score matrix over the `keys` step-1 keys instead (float32 softmax + its compute-dtype copy, h per key)."""
        H, I, kv, h = s.hidden, s.intermediate, s.kv_heads * s.head_dim, s.heads
        if step == 1:
            return (7 * H + 2 * kv + 4 * I) * cb + H * 4 + h * 4
        return (7 * H + 2 * kv + 4 * I) * cb + H * 4 + h * keys * (4 + (cb if cb < 4 else 0))

    @staticmethod
    def loss_memory(t, s, n_tok: int, cb: int) -> list[tuple]:
        """(name, bytes, note, knob, phases) of the token loss's memory (t: the recipe's train section)."""
        raise NotImplementedError

    @staticmethod
    def train_flops_per_token(s, P: int) -> float:
        """Training FLOPs per record token (the plan's time): fwd + bwd (6P) of every unrolled step, and the lm_head's
        logits of every step (fwd + bwd) plus the target's (one forward)."""
        return 6 * P * s.ttt_steps + 2 * s.hidden * (s.draft_vocab or s.vocab) * (3 * s.ttt_steps + 1)


# ----------------------------------------------------------------------------- EAGLE-2
class NextFeatureTargets:
    """EAGLE-2's one step: the head predicts the next feature; token distributions of prediction and truth through the
    target's frozen lm_head [V, H]; `chunk` > 0: `chunk` loss positions at a time (`ChunkedTokenLoss`: only [chunk, V]
    logits at once, same value and gradient up to float summation order). token_loss / feature_loss: the recipe's
    (train/losses.py; default soft CE and SmoothL1)."""

    def __init__(self, final: torch.Tensor, lm_head: torch.Tensor, chunk: int = 0, steps: int = 1,
                 token_loss: TokenLoss | None = None, feature_loss=smooth_l1):
        self.final, self.lm_head, self.chunk = final, lm_head, chunk
        self.token_loss, self.feature_loss = token_loss or TokenLoss(), feature_loss
        self.final_ext = F.pad(final, (0, 0, 0, steps - 1)) if steps > 1 else final  # [B, T + k - 1, H]

    def score(self, p: torch.Tensor, j: int, rows: torch.Tensor, sel: torch.Tensor) -> StepScore:
        """p [N, H]: step j's predictions at its loss positions; step j at index t is scored against f_{t+j}."""
        lm_head = self.lm_head
        truth = self.final if j == 1 else self.final_ext[:, rows + j - 1]  # [B, R, H]
        f = truth[sel].to(p.dtype)  # [N, H] the true next features
        feature = self.feature_loss(p.float(), f.float())  # [N]
        if self.chunk and self.chunk < p.shape[0]:
            correct = torch.zeros(3, dtype=torch.long)
            conf = torch.empty(p.shape[0], dtype=torch.float32, device=p.device)
            token = ChunkedTokenLoss.apply(p, f, lm_head, self.chunk, correct, self.token_loss, conf)
            return StepScore(token, [int(c) for c in correct], feature, conf)
        head_logits = F.linear(p.to(lm_head.dtype), lm_head).float()  # [N, V]
        with torch.no_grad():
            target_logits = F.linear(f.to(lm_head.dtype), lm_head).float()  # [N, V]
            target_p = target_logits.softmax(-1)
            target_top = greedy_ids(target_logits)  # [N]
        logq = head_logits.log_softmax(-1)
        token = self.token_loss.rows(logq, target_p)  # [N]
        with torch.no_grad():
            correct = topk_hits(head_logits, target_top)
        return StepScore(token, [int(c) for c in correct], feature, confidence(logq, target_p))


class Eagle2Training(TrainingKind):
    kind = EAGLE2
    extra_eval = "allfed"

    def __init__(self, cfg, target_config):
        super().__init__(cfg, target_config)
        self.feature_weight = self.t.feature_weight
        self.extra_steps = self.t.rollout_steps  # all-fed steps
        if self.options.steps > 1:  # HASS-style alignment: k unrolled steps, each with its token and feature loss
            self.steps, self.stride = self.options.steps, self.options.row_stride
            w = self.unrolled_weights()
            self.step_weights = [self.t.token_weight * x for x in w]
            self.feature_weight = [self.t.feature_weight * x for x in w]
            self.logged_steps = self.steps

    def describe(self) -> str | None:
        if self.steps == 1:
            return None
        return (f"EAGLE-2 head with multi-step alignment: {self.steps} unrolled steps (step "
                f"{self.weights_text(self.unrolled_weights())}), row stride {self.stride}")

    def summary(self) -> dict:
        if self.steps == 1:
            return {}
        return {"head_kind": self.kind.name, "align_steps": self.steps, "align_step_weights": self.unrolled_weights(),
                "align_row_stride": self.stride}

    def new_head(self, target_config, source, train_indices, lm_head):
        """A fresh head (or head.init_from), checked against the target (EAGLE-2 uses the frozen lm_head [V, H] as is)."""
        h = self.cfg.head
        expect = head_config_from_target(target_config, bias=h.bias, kind=self.kind.name, options=self.options)
        if not h.init_from:
            return self.kind.module(expect)
        head = self.kind.module.from_pretrained(h.init_from)
        if (head.config.hidden_size, head.config.vocab_size) != (expect.hidden_size, expect.vocab_size):
            raise ValueError(f"head.init_from={h.init_from}: hidden/vocab {head.config.hidden_size}/"
                             f"{head.config.vocab_size} do not match the target's {expect.hidden_size}/{expect.vocab_size}")
        return head

    def unroll(self, forward, inputs, next_ids, attention_mask, steps: int, rows) -> list[torch.Tensor]:
        if steps == 1:
            return [forward(inputs, next_ids, attention_mask)]  # [B, T-1, H]
        return forward(inputs, next_ids, attention_mask, steps=steps, rows=rows)  # steps x [B, T-1 | R, H]

    def targets(self, head, final, lm_head, steps):
        return NextFeatureTargets(final, lm_head, self.t.loss_chunk, steps, self.token_loss, self.feature_loss)

    def eval_loss(self, metrics: dict, loss_mean: float) -> float:
        """Step 1's loss (the plain EAGLE-2 objective, comparable across align_steps); the chains measure the rest."""
        return self.t.feature_weight * metrics["eval/feature_loss"] + self.t.token_weight * metrics["eval/token_loss"]

    def eval_batch(self, head, features, batch, lm_head, k: int) -> EvalBatch:
        """The loss; the chains rolled out through the head's decoder from each start; every position self-fed."""
        s = self.shifted(features, batch)
        out = draft_loss(self.unroll(head, s.inputs, s.next_ids, s.attention_mask, 1, None), s.weights,
                         self.targets(head, s.final, lm_head, 1), self.step_weights[:1], self.feature_weight)
        target_top = greedy_ids(F.linear(features.to(lm_head.dtype), lm_head))  # [B, T]
        hits, counts = all_fed_rollout(head, features, batch.input_ids, batch.attention_mask, s.weights, target_top, k,
                                       lm_head)

        def chains(b: int, n: int, starts: list[int]) -> torch.Tensor:
            return chain_rollout(head, features[b, :n], batch.input_ids[b, :n], target_top[b, :n], starts, k,
                                 lm_head).cpu()  # [n_starts, k]

        return EvalBatch(out, s.weights, chains, hits, counts)

    @staticmethod
    def loss_memory(t, s, n_tok: int, cb: int) -> list[tuple]:
        """Per unrolled step: the [rows, V] logits (a chunk of them with train.loss_chunk, which keeps only the
        [N, H] float32 gradient for the backward; unchunked, every step's logits are kept)."""
        chunk = t.loss_chunk if 0 < t.loss_chunk < n_tok else 0
        every = sum(Eagle2Training.unrolled_rows(s, n_tok))  # loss rows over all unrolled steps
        rows = chunk or every
        items = [("token-loss logits", loss_bytes(s, rows, n_tok, cb, 0),
                  f"{rows} rows x {s.vocab} vocab" + (" (train.loss_chunk)" if chunk else " (unchunked)"),
                  "train.loss_chunk", ("forward",) if chunk else ("forward", "backward"))]
        if chunk:  # only the [N, H] gradient is kept for the backward
            items.append(("token-loss gradient", every * s.hidden * 4, f"[{every}, {s.hidden}] float32 (kept for "
                          "backward by ChunkedTokenLoss)", "", ("forward", "backward")))
        return items


def loss_bytes(s, rows: int, n_positions: int, cb: int, chunk: int) -> float:
    """Token-loss peak: [rows, V] tensors (head logits in cb and fp32, log-softmax, target logits in cb and fp32,
    target softmax, the product) + for the chunked path its [N, H] fp32 gradient."""
    V = s.draft_vocab or s.vocab
    per_row = V * (2 * cb + 5 * 4)
    return rows * per_row + (n_positions * s.hidden * 4 if chunk else 0)


# ----------------------------------------------------------------------------- EAGLE-3
class DraftVocabTargets:
    """EAGLE-3's steps: the target's next-token distribution over the draft vocabulary (renormalised there) probs
    [B, T, Vd] and its argmax over the FULL vocabulary top [B, T], at every position (padded for `steps` unrolled
    steps); the head scores its step outputs with its own lm_head over the draft vocabulary with `token_loss` (the
    recipe's, train/losses.py; default the soft CE). With `chunk` > 0 (train.loss_chunk; `chunked`) no [T, V] or
    [rows, Vd] tensor is built: the targets keep the target's final states and each step's rows are scored `chunk`
    at a time, each chunk under torch.utils.checkpoint (its target logits, distribution and draft logits recomputed
    in the backward, so the backward holds one chunk's logits, not every chunk's)."""

    def __init__(self, head, probs: torch.Tensor | None, top: torch.Tensor, steps: int,
                 token_loss: TokenLoss | None = None, chunk: int = 0, final: torch.Tensor | None = None,
                 lm_head: torch.Tensor | None = None):
        self.head, self.probs, self.top, self.token_loss = head, probs, top, token_loss or TokenLoss()
        self.chunk, self.lm_head = chunk, lm_head
        self.draft_ids = torch.arange(head.d2t.numel(), device=head.d2t.device) + head.d2t  # [Vd] target id per draft id
        self.probs_ext = None if probs is None else F.pad(probs, (0, 0, 0, steps - 1))  # [B, T + k - 1, Vd]
        self.final_ext = None if final is None else F.pad(final, (0, 0, 0, steps - 1))  # [B, T + k - 1, H]
        self.top_ext = F.pad(top, (0, steps - 1), value=-1)  # [B, T + k - 1]

    @classmethod
    @torch.no_grad()
    def of(cls, head, final: torch.Tensor, lm_head: torch.Tensor, steps: int,
           token_loss: TokenLoss | None = None, chunk: int = 0) -> "DraftVocabTargets":
        """From the target's final states final [B, T, H] through its lm_head [V, H] (`chunk` > 0: `chunked`)."""
        if chunk > 0:
            return cls.chunked(head, final, lm_head, steps, token_loss, chunk)
        draft_ids = torch.arange(head.d2t.numel(), device=head.d2t.device) + head.d2t  # [Vd]
        logits = F.linear(final.to(lm_head.dtype), lm_head).float()  # [B, T, V]
        return cls(head, logits[..., draft_ids].softmax(-1), greedy_ids(logits), steps, token_loss)

    @classmethod
    @torch.no_grad()
    def chunked(cls, head, final, lm_head, steps, token_loss, chunk: int) -> "DraftVocabTargets":
        """The targets without their [B, T, Vd] distribution: the full-vocabulary argmax top [B, T] from `chunk`
        positions' logits at a time; the distributions come per chunk of scored rows (`score`)."""
        B, T, H = final.shape
        flat = final.reshape(B * T, H)
        top = torch.cat([greedy_ids(F.linear(flat[s:s + chunk].to(lm_head.dtype), lm_head).float())
                         for s in range(0, B * T, chunk)]).reshape(B, T) if B * T else final.new_zeros((B, T), dtype=torch.long)
        return cls(head, None, top, steps, token_loss, chunk, final, lm_head)

    def chunk_rows(self, h: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One chunk: h [c, H] step outputs, f [c, H] the target's final states they are scored against ->
        (token loss [c], confidence [c], the head's top-3 draft ids [c, <=3]). Its [c, V] / [c, Vd] tensors are
        transient (the caller checkpoints it)."""
        with torch.no_grad():
            p = F.linear(f.to(self.lm_head.dtype), self.lm_head).float()[:, self.draft_ids].softmax(-1)  # [c, Vd]
        logits = self.head.draft_logits(h).float()  # [c, Vd]
        logq = logits.log_softmax(-1)
        with torch.no_grad():
            top3 = logits.topk(min(3, logits.shape[-1]), dim=-1).indices
        return self.token_loss.rows(logq, p), confidence(logq, p), top3

    def score(self, h: torch.Tensor, j: int, rows: torch.Tensor, sel: torch.Tensor) -> StepScore:
        want = self.top_ext[:, rows + j - 1][sel]  # [N] target argmax (full vocabulary)
        if self.probs is None:  # chunked: train.loss_chunk rows at a time, each chunk recomputed in the backward
            f = self.final_ext[:, rows + j - 1][sel]  # [N, H]
            parts = [checkpoint(self.chunk_rows, h[s:s + self.chunk], f[s:s + self.chunk], use_reentrant=False)
                     for s in range(0, h.shape[0], self.chunk)]
            token, conf, top3 = (torch.cat(x) for x in zip(*parts))
            hit = self.draft_ids[top3] == want[:, None]  # [N, 3]
            return StepScore(token, [int(hit[:, :m].any(-1).sum()) for m in (1, 2, 3)], confidence=conf)
        logits = self.head.draft_logits(h).float()  # [N, Vd]
        p = self.probs_ext[:, rows + j - 1][sel]  # [N, Vd]
        logq = logits.log_softmax(-1)
        token = self.token_loss.rows(logq, p)  # [N]
        with torch.no_grad():
            ranked = self.draft_ids[logits.topk(min(3, logits.shape[-1]), dim=-1).indices]  # [N, 3] target ids
            hit = ranked == want[:, None]  # [N, 3]
        return StepScore(token, [int(hit[:, :m].any(-1).sum()) for m in (1, 2, 3)], confidence=confidence(logq, p))


class Eagle3Training(TrainingKind):
    kind = EAGLE3
    extra_eval = "ttt"
    sequence_parallel = True

    def __init__(self, cfg, target_config):
        super().__init__(cfg, target_config)
        self.steps = self.options.steps
        self.logged_steps = self.extra_steps = self.steps
        self.step_weights = self.unrolled_weights()
        self.stride = self.options.row_stride
        self.vocab_info: dict = {}

    def describe(self) -> str:
        return (f"EAGLE-3 head: aux layers {self.layers[:-1]}, {self.steps} unrolled steps "
                f"({self.weights_text(self.step_weights)}), row stride {self.stride}; draft vocabulary "
                + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in self.vocab_info.items())
                + "".join(f"; EAGLE-3.1 {k}" for k in self.options.norms()))

    def new_head(self, target_config, source, train_indices, lm_head):
        """A fresh EAGLE-3 head with the draft vocabulary of the training split (or head.init_from, its vocabulary kept);
        head.lm_head_init=target starts its lm_head [Vd, H] from the target's lm_head [V, H] rows of the draft tokens."""
        h = self.cfg.head
        V = int(text_config(target_config).vocab_size)
        size = self.options.draft_vocab_size or V  # <= V: recipes.head.check_head_fits_target (training_kind)
        expect = head_config_from_target(target_config, kind=self.kind.name, options=self.options,
                                         aux_layers=self.layers[:-1], draft_vocab_size=size)
        counts = count_loss_tokens(source, train_indices, V, self.cfg.data.max_length)
        module = self.kind.module
        if h.init_from:
            head = module.from_pretrained(h.init_from)
            got, want = (self.shape_of(c) for c in (head.config, expect))
            if got != want:
                raise ValueError(f"head.init_from={h.init_from}: hidden/vocab/aux layers/{'/'.join(EAGLE31_NORMS)} {got} "
                                 f"do not match the recipe's {want}")
        else:
            head = module(self.complete_config(expect, counts))
            d2t, t2d = build_draft_vocab(counts, size)
            head.set_vocab(d2t, t2d)
            if h.lm_head_init == "target":
                with torch.no_grad():
                    head.lm_head.weight.copy_(lm_head[(torch.arange(size) + d2t).to(lm_head.device)].float())
        self.vocab_info = {"draft_vocab_size": head.config.options.draft_vocab_size, "distinct_loss_tokens": int((counts > 0).sum()),
                           "draft_vocab_coverage": vocab_coverage(counts, head.t2d.cpu())}
        return head

    @staticmethod
    def shape_of(config) -> tuple:
        """What an init_from head must share with the recipe's: hidden, vocabulary, aux layers, EAGLE-3.1's norms."""
        o = config.options
        return (config.hidden_size, config.vocab_size, list(o.aux_layers), *(getattr(o, k) for k in EAGLE31_NORMS))

    def complete_config(self, config, counts: torch.Tensor):
        """The fresh head's config with what the kind picks from the training split's loss-token counts [V]."""
        return config

    def summary(self) -> dict:
        return {"head_kind": self.kind.name, "aux_layers": self.layers[:-1], "ttt_steps": self.steps,
                "ttt_step_weights": self.step_weights, "ttt_row_stride": self.stride, **self.vocab_info,
                **{k: bool(getattr(self.options, k)) for k in EAGLE31_NORMS}}

    def unroll(self, forward, inputs, next_ids, attention_mask, steps: int, rows, shards=None) -> list[torch.Tensor]:
        return forward(inputs, next_ids, attention_mask, steps=steps, rows=rows, shards=shards)  # steps x [B, T-1 | R, H]

    def targets(self, head, final, lm_head, steps):
        return DraftVocabTargets.of(head, final, lm_head, steps, self.token_loss, self.t.loss_chunk)

    def eval_batch(self, head, features, batch, lm_head, k: int) -> EvalBatch:
        """The unroll IS the self-fed chain: step j at index s sees the true prefix 0..s (step 1) and its own chain's
        steps 2..j only, as when decoding a chain (tokens fed = the data's). So the chains come from one unroll of
        max(k, ttt_steps) steps at every position; the training loss from its first ttt_steps."""
        s = self.shifted(features, batch)
        targets = self.targets(head, s.final, lm_head, self.steps)
        hiddens = head.unroll(s.inputs, s.next_ids, s.attention_mask, steps=max(k, self.steps))  # [B, T-1, H] each
        out = draft_loss(hiddens[: self.steps], s.weights, targets, self.step_weights, weighting=self.weighting)
        # draft (as target ids) of step j at index s, compared with the target's argmax at s + j - 1 (shifted index)
        drafts = torch.stack([targets.draft_ids[head.draft_logits(h).argmax(-1)] for h in hiddens[:k]], dim=-1)
        T1 = targets.top.shape[1]
        top_ext = F.pad(targets.top, (0, k), value=-1)  # [B, T-1+k]
        want = torch.stack([top_ext[:, j : j + T1] for j in range(k)], dim=-1)  # [B, T-1, k]
        correct = drafts == want  # [B, T-1, k]

        def chains(b: int, n: int, starts: list[int]) -> torch.Tensor:
            return correct[b, starts].cpu()  # [n_starts, k]

        return EvalBatch(out, s.weights, chains, torch.tensor(out.step_hits, dtype=torch.float64),
                         torch.tensor(out.step_counts, dtype=torch.float64))

    @staticmethod
    def activation_bytes(s, cb: int, step: int = 1, keys: float = 0.0) -> float:
        """Step 1: fc input [3H], attention input [2H], and two float32 norms (input_layernorm's and hidden_norm's).
        Step >= 2 (training-time test) also keeps its score matrix over the `keys` step-1 keys it reads (float32
        softmax + its compute-dtype copy, h per key)."""
        H, I, kv, h = s.hidden, s.intermediate, s.kv_heads * s.head_dim, s.heads
        if step == 1:
            return (11 * H + 2 * kv + 4 * I) * cb + 2 * H * 4 + h * 4
        return (9.5 * H + 2 * kv + 4 * I) * cb + 2 * H * 4 + h * keys * (4 + (cb if cb < 4 else 0))

    @staticmethod
    def loss_memory(t, s, n_tok: int, cb: int) -> list[tuple]:
        """Not chunked (train.loss_chunk=0): the target's full-vocabulary logits [n_tok, V] fp32 (transient, no grad)
        and its draft-vocabulary distribution [n_tok, Vd] fp32, plus per unrolled step the draft logits kept for the
        backward ([R, Vd] in cb and fp32, and their log-softmax). Chunked (DraftVocabTargets.chunked): one chunk's
        tensors at a time, in the forward and again in the backward's recompute (target logits in cb and fp32, the
        gathered draft-vocabulary logits and their softmax, draft logits in cb and fp32, log-softmax and its
        gradient), plus what each step's checkpoints keep: its rows' outputs (cb) and target states (fp32)."""
        rows = Eagle3Training.unrolled_rows(s, n_tok)
        if t.loss_chunk == 0:
            total = n_tok * s.vocab * 4 + n_tok * s.draft_vocab * 4 + sum(r * s.draft_vocab * (cb + 8) for r in rows)
            return [("token-loss logits", total,
                     f"{n_tok} x {s.vocab} target logits + {s.ttt_steps} steps x {s.draft_vocab} draft vocab",
                     "train.loss_chunk / train.micro_batch_size / data.max_length / head.ttt_row_stride",
                     ("forward", "backward"))]
        chunk = min(t.loss_chunk, rows[0])
        per_row = s.vocab * (cb + 4) + s.draft_vocab * (cb + 5 * 4)
        kept = sum(rows) * (s.hidden * (cb + 4) + 8) + n_tok * 8
        return [("token-loss logits", chunk * per_row, f"{chunk} rows x {s.vocab} target + {s.draft_vocab} draft "
                 "vocab (train.loss_chunk, recomputed in backward)", "train.loss_chunk", ("forward", "backward")),
                ("token-loss checkpoints", kept, f"{sum(rows)} rows' outputs and target states over "
                 f"{s.ttt_steps} steps", "", ("forward", "backward"))]


class PeagleTraining(Eagle3Training):
    """P-EAGLE: the EAGLE-3 trainer with the head's parallel unroll (eagle/peagle.py): ONE forward's k = head.ttt_steps
    draft positions, position j (at index t, the mask row j - 1 after committing 0..t) scored like EAGLE-3's step j:
    soft CE over the draft vocabulary against the target's distribution of token t + j + 1, weight
    head.ttt_step_weights[j] (0.8^(j-1)). Same data (the EAGLE-3 cache), same cost per step at equal k; the learned
    `mask_hidden` [1, 3H] is the one parameter it adds."""

    kind = PEAGLE
    extra_eval = "parallel"

    def describe(self) -> str:
        return (f"P-EAGLE head (parallel drafting, mask token {self.mask_token}): " + super().describe()
                .removeprefix("EAGLE-3 head: ").replace("unrolled steps", "parallel draft positions"))

    def complete_config(self, config, counts: torch.Tensor):
        """head.mask_token_id, or (-1) the smallest target id absent from the training split's loss tokens (the
        rarest one when every id occurs): a token the head's real positions rarely read."""
        chosen = self.options.mask_token_id
        if chosen < 0:
            chosen = int(counts.argmin())  # the first zero when there is one
        self.mask_token = chosen
        return self.kind.with_mask_token(config, chosen)

    def new_head(self, target_config, source, train_indices, lm_head):
        head = super().new_head(target_config, source, train_indices, lm_head)
        self.mask_token = head.mask_token_id
        return head

    def summary(self) -> dict:
        return {**super().summary(), "mask_token_id": getattr(self, "mask_token", None)}



# ----------------------------------------------------------------------------- DFlash
class DFlashTraining(TrainingKind):
    """DFlash (block drafting, eagle/dflash_head.py): per record `head.anchors` anchor positions p sampled among its
    loss positions (train/block_loss.py, from a generator seeded by (seed, micro-batch): the same anchors on any
    number of ranks and after a resume); each anchor's block [x_p, mask x (B - 1)] sees the context before p only;
    block position i is scored against the target's distribution of x_{p+i} with `head.block_weights` (0.8^(i-1))
    or D-PACE's per-block weights. Data: the cache of the target layers + the final state ((K + 1) H per token)."""

    kind = DFLASH
    extra_eval = "block"

    def __init__(self, cfg, target_config):
        super().__init__(cfg, target_config)
        o = self.options
        self.logged_steps = self.extra_steps = o.drafted
        self.step_weights = self.unrolled_weights()  # head.block_weights, 0.8^(i-1), or 1 each (D-PACE)
        self.mask_token = o.mask_token_id

    def describe(self) -> str:
        o = self.options
        return (f"DFlash head: {o.draft_layers} draft layers over target layers {self.layers[:-1]}, block of "
                f"{o.block_size} ({'causal' if o.causal else 'bidirectional'}), {o.anchors} anchors per record "
                f"({self.weights_text(self.step_weights)}), mask token {self.mask_token}")

    def new_head(self, target_config, source, train_indices, lm_head):
        """A fresh DFlash head (or head.init_from) with the mask token: the recipe's, or (-1) the smallest target id
        absent from the training split's loss tokens."""
        h, module = self.cfg.head, self.kind.module
        if h.init_from:
            head = module.from_pretrained(h.init_from)
            self.kind.fit_to_target(head.config, text_config(target_config))
        else:
            config = head_config_from_target(target_config, kind=self.kind.name, options=self.options)
            chosen = self.options.mask_token_id
            if chosen < 0:
                V = int(text_config(target_config).vocab_size)
                chosen = int(count_loss_tokens(source, train_indices, V, self.cfg.data.max_length).argmin())
            head = module(self.kind.with_mask_token(config, chosen))
        self.mask_token = head.mask_token_id
        return head

    def summary(self) -> dict:
        o = self.options
        return {"head_kind": self.kind.name, "target_layers": self.layers[:-1], "block_size": o.block_size,
                "draft_layers": o.draft_layers, "causal": bool(o.causal), "anchors": o.anchors,
                "block_weights": self.step_weights, "mask_token_id": self.mask_token}

    def parts(self, features, batch):
        """(context states [b, T, K H], final states [b, T, H])."""
        return self.kind.head_inputs(features, self.hidden), features[..., -self.hidden:]

    def loss(self, engine, features, batch, lm_head, micro: int, seed: int = 0, shards=None) -> LossOutput:
        # shards: always None here (sequence_parallel = False: train.sequence_parallel_size > 1 is refused first)
        t = self.t
        inputs, final = self.parts(features, batch)
        gen = torch.Generator(features.device).manual_seed((seed * 1_000_003 + micro) % 2**63)
        anchors = sample_anchors(batch.attention_mask, batch.loss_mask, self.options.anchors, gen)
        inputs = add_input_noise(inputs, t.noise, t.noise_std, gen)
        out = engine(inputs, batch.input_ids, batch.attention_mask, anchors)
        return block_loss(out, final, batch, anchors, lm_head, self.token_loss, self.step_weights, self.weighting)

    def eval_batch(self, head, features, batch, lm_head, k: int) -> EvalBatch:
        """The loss at anchors drawn from a fixed generator; the chains: the block at anchor p = start + 1 (the
        start's next token is the root), its position j + 1 right when it is the target's argmax of x_{p+j+1}."""
        inputs, final = self.parts(features, batch)
        gen = torch.Generator(features.device).manual_seed(0)
        anchors = sample_anchors(batch.attention_mask, batch.loss_mask, self.options.anchors, gen)
        out = block_loss(head(inputs, batch.input_ids, batch.attention_mask, anchors), final, batch, anchors, lm_head,
                         self.token_loss, self.step_weights, self.weighting)
        target_top = greedy_ids(F.linear(final.to(lm_head.dtype), lm_head))  # [b, T]: argmax of x_{t+1}
        weights = (batch.loss_mask[:, 1:] * batch.attention_mask[:, 1:])
        drafted = self.options.drafted

        def chains(b: int, n: int, starts: list[int]) -> torch.Tensor:
            p = torch.tensor(starts, device=features.device) + 1  # [s]
            blocks = head(inputs[b:b + 1, :n], batch.input_ids[b:b + 1, :n], batch.attention_mask[b:b + 1, :n],
                          p[None])[0, :, 1:]  # [s, B-1, H]
            drafts = F.linear(blocks.to(lm_head.dtype), lm_head).argmax(-1)  # [s, B-1]
            idx = p[:, None] + torch.arange(drafted, device=p.device)  # [s, B-1] final index of x_{p+j+1}
            want = torch.where(idx < n, target_top[b, idx.clamp(max=n - 1)], -1)
            correct = (drafts == want)[:, :k]
            return F.pad(correct, (0, k - correct.shape[1]), value=False).cpu()  # [s, k]

        return EvalBatch(out, weights, chains, torch.tensor(out.step_hits, dtype=torch.float64),
                         torch.tensor(out.step_counts, dtype=torch.float64))

    # -- the plan ------------------------------------------------------------------------
    @staticmethod
    def unrolled_rows(s, n_tok: int) -> list[int]:
        """One forward of the block query rows: anchors x block_size per record of `record_tokens`."""
        return [math.ceil(n_tok * s.block_rows / max(s.record_tokens, 1))]

    @staticmethod
    def train_flops_per_token(s, P: int) -> float:
        """Per record token: fc + every layer's context K/V projections over EVERY token (fwd + bwd), the draft layers
        over the block rows only (block_rows / record_tokens per token), and the lm_head logits (fwd + bwd) plus the
        target's of the block_size - 1 scored rows of each block, not ttt_steps full head passes."""
        H, kv = s.hidden, s.kv_heads * s.head_dim
        context = (s.cache_row - 1) * H * H + s.draft_layers * 2 * H * kv
        rows = s.block_rows / max(s.record_tokens, 1)
        scored = rows * (s.block_size - 1) / max(s.block_size, 1)
        return 6 * context + 6 * max(P - context, 0) * rows + 2 * H * s.vocab * 4 * scored

    @staticmethod
    def activation_bytes(s, cb: int, step: int = 1, keys: float = 0.0) -> float:
        """Per block row, every draft layer keeps what a Llama layer keeps (input norm, q, k, v, attention output,
        MLP input, SwiGLU 4 x [I]; two float32 norms; q_norm / k_norm inputs), plus the final norm's float32 input."""
        H, I, kv, h, D = s.hidden, s.intermediate, s.kv_heads * s.head_dim, s.heads, s.head_dim
        per_layer = (7 * H + 2 * kv + 4 * I + h * D + kv) * cb + 2 * H * 4 + h * 4
        return s.draft_layers * per_layer + H * 4

    @staticmethod
    def loss_memory(t, s, n_tok: int, cb: int) -> list[tuple]:
        """The context K/V of every draft layer over all n_tok positions, the block rows' attention scores over
        (record + block rows) keys, and the token loss over (block_size - 1) / block_size of the rows through the
        target's lm_head (head logits in cb and fp32, log-softmax, the target's distribution)."""
        rows = DFlashTraining.unrolled_rows(s, n_tok)[0]
        kv = s.kv_heads * s.head_dim
        keys = s.record_tokens + s.block_rows
        context = n_tok * (s.hidden * (cb + 4) + s.draft_layers * (3 * kv * cb + kv * 4))
        scores = s.draft_layers * s.heads * rows * keys * (4 + cb)
        loss_rows = math.ceil(rows * (s.block_size - 1) / s.block_size)
        return [("context K/V (all draft layers)", context, f"{n_tok} tokens x {s.draft_layers} layers "
                 f"(fc + hidden_norm, k/v)", "train.micro_batch_size / data.max_length", ("forward", "backward")),
                ("block attention scores", scores, f"{rows} block rows (head.anchors x head.block_size per record) x "
                 f"{keys} keys x {s.heads} heads x {s.draft_layers} layers", "head.anchors / head.block_size",
                 ("forward", "backward")),
                ("token-loss logits", loss_rows * s.vocab * (2 * cb + 12), f"{loss_rows} rows x {s.vocab} vocab",
                 "head.anchors", ("forward", "backward"))]


TRAINING: dict[HeadKind, type[TrainingKind]] = {EAGLE2: Eagle2Training, EAGLE3: Eagle3Training, PEAGLE: PeagleTraining,
                                                DFLASH: DFlashTraining}


def training_class(kind_name: str) -> type[TrainingKind]:
    """The train stage's class for a head kind name."""
    return TRAINING[head_kind(kind_name)]


def training_kind(cfg, target_config) -> TrainingKind:
    """The training behaviour of the recipe's head.kind (its target-dependent keys checked first, as train.plan does)."""
    check_head_fits_target(cfg.head, target_config)
    return training_class(cfg.head.kind)(cfg, target_config)
