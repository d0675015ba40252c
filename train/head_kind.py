"""What differs between head kinds in training, behind one small interface the loop calls (`head.kind`).

    kind = head_kind(cfg, target_config)           # Eagle2Kind | Eagle3Kind
    head = kind.new_head(target_config, source, train_set.indices, frozen.lm_head)
    out = kind.loss(engine, features, batch, frozen.lm_head, micro)   # LossOutput (train/loss.py)
    metrics = kind.evaluate(head, eval_set, frozen, device, dtype, rank, world_size)

EAGLE-2: fc over the final hidden state, one forward, feature + token loss, chain rollouts for the eval metrics.
EAGLE-3: fc over three aux layers, the training-time-test unroll of `head.ttt_steps` steps (steps >= 2 at every
`head.ttt_row_stride`-th position, the offset cycling with the micro-step so every position is covered), the
per-step soft CE over the draft vocabulary, the draft vocabulary built from the training split's loss tokens.
"""
from __future__ import annotations

import torch

from data_prep.feature_layers import feature_layers


class Eagle2Kind:
    name = "eagle2"

    def __init__(self, cfg, target_config):
        self.cfg, self.t = cfg, cfg.train
        self.layers = None  # features = the final hidden state

    def summary(self) -> dict:
        """Extra keys of the run summary (none for EAGLE-2: its summary is unchanged)."""
        return {}

    def new_head(self, target_config, source, train_indices, lm_head):
        """A fresh head (or head.init_from), checked against the target (EAGLE-2 uses the frozen lm_head [V, H] as is)."""
        from eagle.head import EagleHead, head_config_from_target

        h = self.cfg.head
        expect = head_config_from_target(target_config, bias=h.bias)
        if not h.init_from:
            return EagleHead(expect)
        head = EagleHead.from_pretrained(h.init_from)
        if (head.config.hidden_size, head.config.vocab_size) != (expect.hidden_size, expect.vocab_size):
            raise ValueError(f"head.init_from={h.init_from}: hidden/vocab {head.config.hidden_size}/"
                             f"{head.config.vocab_size} do not match the target's {expect.hidden_size}/{expect.vocab_size}")
        return head

    def loss(self, engine, features, batch, lm_head, micro: int):
        """One micro-batch's LossOutput: features [B, T, H] (the target's final states)."""
        from train.loss import add_input_noise, eagle_loss, shift_for_head

        t = self.t
        feats, next_ids, attn, targets, weights = shift_for_head(features, batch.input_ids, batch.attention_mask,
                                                                 batch.loss_mask)
        pred = engine(add_input_noise(feats, t.noise, t.noise_std), next_ids, attn)  # [B, T-1, H]
        return eagle_loss(pred, targets, weights, lm_head, t.feature_weight, t.token_weight, t.loss_chunk)

    def evaluate(self, head, eval_set, frozen, device, dtype, rank, world_size) -> dict:
        from train.metrics import evaluate

        return evaluate(head, eval_set, frozen, self.t, device, dtype, self.cfg.seed, rank, world_size)


class Eagle3Kind(Eagle2Kind):
    name = "eagle3"

    def __init__(self, cfg, target_config):
        from recipes.head import ttt_weights

        super().__init__(cfg, target_config)
        self.layers = feature_layers(cfg.head, target_config)  # [a, b, c, L]: aux + final
        self.steps = cfg.head.ttt_steps
        self.step_weights = ttt_weights(cfg.head)
        self.stride = cfg.head.ttt_row_stride
        self.vocab_info: dict = {}

    def new_head(self, target_config, source, train_indices, lm_head):
        """A fresh EAGLE-3 head with the draft vocabulary of the training split (or head.init_from, its vocabulary kept);
        head.lm_head_init=target starts its lm_head [Vd, H] from the target's lm_head [V, H] rows of the draft tokens."""
        from eagle.head import Eagle3Head, head_config_from_target, text_config
        from train.draft_vocab import build_draft_vocab, count_loss_tokens, vocab_coverage

        h = self.cfg.head
        V = int(text_config(target_config).vocab_size)
        size = h.draft_vocab_size or V
        if size > V:
            from recipes import RecipeError

            raise RecipeError(f"head.draft_vocab_size={size}: larger than the target vocabulary ({V})")
        expect = head_config_from_target(target_config, kind="eagle3", aux_layers=self.layers[:-1], draft_vocab_size=size)
        counts = count_loss_tokens(source, train_indices, V, self.cfg.data.max_length)
        if h.init_from:
            head = Eagle3Head.from_pretrained(h.init_from)
            got = (head.config.hidden_size, head.config.vocab_size, list(head.config.aux_layers or []))
            want = (expect.hidden_size, expect.vocab_size, list(expect.aux_layers))
            if got != want:
                raise ValueError(f"head.init_from={h.init_from}: hidden/vocab/aux layers {got} do not match the recipe's {want}")
        else:
            head = Eagle3Head(expect)
            d2t, t2d = build_draft_vocab(counts, size)
            head.set_vocab(d2t, t2d)
            if h.lm_head_init == "target":
                with torch.no_grad():
                    head.lm_head.weight.copy_(lm_head[(torch.arange(size) + d2t).to(lm_head.device)].float())
        self.vocab_info = {"draft_vocab_size": head.config.draft_vocab_size, "distinct_loss_tokens": int((counts > 0).sum()),
                           "draft_vocab_coverage": vocab_coverage(counts, head.t2d.cpu())}
        return head

    def summary(self) -> dict:
        return {"head_kind": "eagle3", "aux_layers": self.layers[:-1], "ttt_steps": self.steps,
                "ttt_step_weights": self.step_weights, "ttt_row_stride": self.stride, **self.vocab_info}

    def rows(self, T: int, micro: int, device) -> torch.Tensor | None:
        """Indices [R] where steps >= 2 run this micro-batch (None = all): every stride-th, offset micro % stride."""
        if self.stride == 1:
            return None
        return torch.arange(micro % self.stride, T, self.stride, device=device)

    def loss(self, engine, features, batch, lm_head, micro: int):
        """One micro-batch's LossOutput: features [B, T, 4H] (aux layers + final state)."""
        from train.loss import add_input_noise, eagle3_loss, eagle3_targets, shift_for_eagle3

        t, head = self.t, engine.module
        aux, next_ids, attn, final, weights = shift_for_eagle3(features, batch.input_ids, batch.attention_mask,
                                                               batch.loss_mask, len(self.layers))
        draft_ids = torch.arange(head.d2t.numel(), device=head.d2t.device) + head.d2t  # [Vd]
        probs, top = eagle3_targets(final, lm_head, draft_ids)  # [B, T-1, Vd], [B, T-1]
        rows = self.rows(aux.shape[1], micro, aux.device)
        hiddens = engine(add_input_noise(aux, t.noise, t.noise_std), next_ids, attn, steps=self.steps, rows=rows)
        return eagle3_loss(head, hiddens, probs, top, weights, self.step_weights, rows)

    def evaluate(self, head, eval_set, frozen, device, dtype, rank, world_size) -> dict:
        from train.metrics import evaluate_eagle3

        return evaluate_eagle3(head, eval_set, frozen, self.t, self.steps, self.step_weights, len(self.layers), device,
                               dtype, self.cfg.seed, rank, world_size)


def head_kind(cfg, target_config) -> Eagle2Kind:
    """The training behaviour of the recipe's head.kind."""
    return {"eagle2": Eagle2Kind, "eagle3": Eagle3Kind}[cfg.head.kind](cfg, target_config)
