"""`EaModel`: the EAGLE-style API over a target LLM and a draft head.

The decode loop (`_rounds`): the prefill, then one round per iteration by a function per decoding mode (vanilla,
chain, static tree, dynamic tree), each reading top to bottom: commit -> draft -> verify -> accept -> keep, the
drafting modes sharing one verify step (`_verify`), as gpt-fast's speculative loop.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from eagle.decoding_config import DecodingConfig
from eagle.draft import Drafter
from eagle.head_config import check_head_fits_target
from eagle.head_files import head_config_of, load_head
from eagle.head_kinds import text_config
from eagle.head_module import HeadModule
from eagle.quantization import NONE, quantize_target
from eagle.sampling import SamplingParams, greedy_ids, sample_token, target_probs
from eagle.score_calibration import ScoreCalibration, pick_calibration
from eagle.state_files import StateFile, read_json_state, register, write_json_state
from eagle.static_trees import static_choices
from eagle.stats import GenerationStats, RoundStats
from eagle.target import Target
from eagle.tree import DraftTree, StaticTreeSpec, chain_choices
from eagle.verify import verify_chain_sampling, verify_greedy, verify_sampling

TREE_CONFIG_NAME = "tree_config.json"  # auto-tuned DecodingConfig saved next to a head by evaluation


def prompt_tensor(input_ids) -> torch.Tensor:
    """The prompt as ids [1, T]: a tensor, or what a tokenizer returns (a `BatchEncoding` / dict holding
    "input_ids": in transformers 5 `apply_chat_template(..., return_tensors="pt")` returns one). Padding in its
    attention_mask is refused: one unpadded prompt (batch size 1)."""
    if isinstance(input_ids, Mapping):
        if "input_ids" not in input_ids:
            raise ValueError(f"the prompt is a mapping without 'input_ids' (keys: {sorted(input_ids)})")
        mask = input_ids.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).all()):
            raise ValueError("the prompt's attention_mask has zeros (padding): pass one unpadded prompt, batch size 1")
        input_ids = input_ids["input_ids"]
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a tensor [1, T] of token ids or a tokenizer's output holding "
                        f"'input_ids', got {type(input_ids).__name__}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    return input_ids



DEFAULT_MAX_LENGTH = 2048  # prompt + new tokens when max_length is None (capped by max_position_embeddings)
@dataclass(frozen=True)
class StopRule:
    eos_ids: tuple[int, ...]
    budget: int  # new tokens allowed: min(max_new_tokens, max_length - prompt_len)


@dataclass(frozen=True)
class RoundSettings:
    """What every round of one generate call uses."""
    decoding: DecodingConfig
    sampling: SamplingParams
    generator: torch.Generator | None
    spec: StaticTreeSpec | None  # chain / static modes: the tree the draft fills
    aux_layers: tuple[int, ...] | None  # the target layers the draft reads (None: the last hidden state, or vanilla)
    calibration: ScoreCalibration | None  # dynamic mode: the tree-score map (None: raw draft probabilities)
    sampled_chain: bool  # the chain is drawn from the draft's distribution (draft_sampling probabilistic, T > 0)


@dataclass(frozen=True)
class Committed:
    """What one round hands the next: the newest token and what the draft has not committed yet."""
    root: torch.Tensor  # [1] the newest committed token: the next tree's root
    feats: torch.Tensor | None  # [1, n, H'] the target's features of the accepted positions (None: vanilla)
    next_ids: torch.Tensor  # [1, n] the token after each of those positions


@dataclass(frozen=True)
class RoundOutcome:
    tree: DraftTree | None  # None: vanilla
    path: torch.Tensor | None  # [a + 1] accepted node indices, the root included
    new: torch.Tensor  # [a + 1] the round's new tokens (before the stops cut them)
    feats: torch.Tensor | None  # [1, a + 1, H'] the target's features along the path
    drafted_at: float  # perf_counter when drafting ended (vanilla: when the target's forward ended)


def cut_at_stops(new: torch.Tensor, eos: torch.Tensor, left: int) -> tuple[torch.Tensor, bool]:
    """A round's new tokens [n] up to the first EOS (inclusive) and at most the `left` tokens of the budget; True
    when the generation ends with them."""
    cut = new.numel()
    hit = torch.isin(new, eos).nonzero()
    if hit.numel():
        cut = int(hit[0]) + 1
    cut = min(cut, left)
    return new[:cut], cut < new.numel() or hit.numel() > 0 or cut >= left


class EaModel(nn.Module):
    """Target + draft head. `eagenerate` is lossless w.r.t. `naivegenerate` (same target code path)."""

    def __init__(self, base_model: nn.Module, ea_layer: HeadModule, decoding: DecodingConfig | None = None,
                 static_tree: list[list[int]] | None = None, fused_target: bool | None = None):
        """static_tree: a custom EAGLE-1 choice list, used instead of `decoding.static_choices` in mode "static".
        fused_target: run the target through `FusedDecoder` (None = when it supports the target and it is small;
        False = always the HF layers)."""
        super().__init__()
        self.static_tree = static_tree
        self.base_model = base_model.eval()
        self.ea_layer = ea_layer.eval()
        self.kind = ea_layer.kind  # the head kind (eagle/head_kinds.py)
        self.draft_vocab_size = self.kind.draft_vocab_size(ea_layer.config)  # tokens a draft step chooses from
        self.decoding = (decoding or DecodingConfig()).validate(vocab_size=self.draft_vocab_size)
        self.ea_layer.bind_target(self.base_model)  # fits the target (hidden size, vocabulary, layers); EAGLE-3: its embedding
        # the hidden states the target hands the drafter: None = its final ones (EAGLE-2), else HF hidden_states ids
        self.aux_layers = self.kind.draft_inputs(ea_layer.config)
        self.target = Target(base_model, capacity=0, fused=fused_target)
        # the head's drafter: `Drafter` (one head forward per tree level), or the one its module names (P-EAGLE:
        # eagle/parallel_draft.py, one head forward per round)
        self.drafter = getattr(ea_layer, "drafter_class", Drafter)(ea_layer, self.target.lm_head, capacity=0)
        self.tokenizer = None
        # tree-score maps fitted for this head, one per sampling setting (tree_config.json "calibration"); the
        # dynamic tree uses the one matching the decoding setting when `decoding.calibrate` is on
        self.calibrations: list[ScoreCalibration] = []
        # the deepest draft position the head has a distribution for (None = any; DFlash: block_size - 1)
        self.draft_positions = ea_layer.config.options.draft_positions

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, base_model_path: str, ea_model_path: str, total_token: int | None = None,
                        depth: int | None = None, top_k: int | None = None, torch_dtype: torch.dtype | str = "auto",
                        device_map=None, tree_mode: str | None = None, static_tree: str | list | None = None,
                        chain_length: int | None = None, attn_implementation: str = "sdpa", quantization: str = NONE,
                        **model_kwargs) -> "EaModel":
        """Load a target (HF id or folder) and a head: EAGLE-1/2 or EAGLE-3, ours or released (`yuhuili/EAGLE-*`,
        `yuhuili/EAGLE3-*`, SpecForge exports); an EAGLE-3 head takes the target's embedding.

        Tree settings: explicit arguments > `tree_config.json` saved next to the head by the
        auto-tuner > DecodingConfig defaults (60 / 5 / 10). The calibrated tree scores in that file (one map per
        sampling setting) are used by dynamic trees decoded at a setting they were fitted for (`calibrate`).
        quantization: the served target's weight quantization (eagle/quantization.py), applied before anything
        decodes, so vanilla and speculative decoding both run the quantized target.
        """
        # lazy: transformers' model classes cost seconds at import; only loading from a folder or the Hub needs them
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        # a head that cannot fit the target fails before the target's weights load (one line, no loading output)
        head_config = head_config_of(ea_model_path)
        config_kw = {k: model_kwargs[k] for k in ("revision", "trust_remote_code") if k in model_kwargs}
        check_head_fits_target(head_config, AutoConfig.from_pretrained(base_model_path, **config_kw))
        base = AutoModelForCausalLM.from_pretrained(base_model_path, dtype=torch_dtype, device_map=device_map,
                                                    attn_implementation=attn_implementation, **model_kwargs)
        quantize_target(base, quantization)
        head = load_head(ea_model_path, dtype=base.dtype, device=base.get_output_embeddings().weight.device)
        decoding = load_tree_config(ea_model_path)
        overrides = {"total_token": total_token, "depth": depth, "top_k": top_k, "mode": tree_mode,
                     "chain_length": chain_length, "static_choices": static_tree if isinstance(static_tree, str) else None}
        decoding = replace(decoding, **{k: v for k, v in overrides.items() if v is not None})
        custom_tree = static_choices(static_tree) if isinstance(static_tree, list) else None
        model = cls(base, head, decoding, static_tree=custom_tree)
        model.calibrations = load_calibrations(ea_model_path)
        try:
            model.tokenizer = AutoTokenizer.from_pretrained(base_model_path)
        except (OSError, ValueError):  # a target folder without a tokenizer is usable with token ids
            model.tokenizer = None
        return model

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------------ public API
    def eagenerate(self, input_ids: torch.Tensor, temperature: float = 0.0, top_p: float = 0.0, top_k: float = 0.0,
                   max_new_tokens: int = 512, max_length: int | None = None, log: bool = False, eos_token_id=None,
                   decoding: DecodingConfig | None = None, generator: torch.Generator | None = None,
                   return_stats: bool = False):
        """Speculative generation from input_ids [1, T] (or a tokenizer's output, see `prompt_tensor`). Returns
        ids [1, T + new]; with log=True (ids, new_tokens, rounds); with return_stats=True (ids, GenerationStats).

        temperature: 0 = greedy (finite, >= 0). top_p: 0 or >= 1 = no nucleus cut (the whole distribution);
        0 < top_p < 1 keeps the smallest set of tokens whose probability reaches top_p. top_k: 0 = off.
        max_new_tokens >= 0. max_length (prompt + new tokens): None = min(2048, the target's
        max_position_embeddings); a larger value is refused unless the target's config.max_position_embeddings
        is raised explicitly (positions beyond it were never trained)."""
        return self._collect(self._prompt(input_ids), decoding or self.decoding, temperature, top_p, top_k,
                             max_new_tokens, max_length, log, eos_token_id, generator, return_stats)

    def naivegenerate(self, input_ids: torch.Tensor, temperature: float = 0.0, top_p: float = 0.0,
                      top_k: float = 0.0, max_new_tokens: int = 512, max_length: int | None = None, log: bool = False,
                      eos_token_id=None, generator: torch.Generator | None = None, return_stats: bool = False):
        """Vanilla autoregressive decoding on the same Target implementation and KV cache."""
        return self._collect(self._prompt(input_ids), replace(self.decoding, mode="vanilla"), temperature, top_p,
                             top_k, max_new_tokens, max_length, log, eos_token_id, generator, return_stats)

    def ea_generate(self, input_ids: torch.Tensor, temperature: float = 0.0, top_p: float = 0.0, top_k: float = 0.0,
                    max_new_tokens: int = 512, max_length: int | None = None, eos_token_id=None,
                    decoding: DecodingConfig | None = None, generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
        """Streaming: yields the ids generated so far ([1, T + new]) after every round."""
        ids = input_ids = self._prompt(input_ids)
        for new, _ in self._rounds(input_ids, decoding or self.decoding,
                                   SamplingParams(temperature, top_p, top_k),
                                   self._stop_rule(input_ids, max_new_tokens, max_length, eos_token_id),
                                   generator, collect=False):
            ids = torch.cat([ids, new[None]], dim=1)
            yield ids

    def naive_generate(self, input_ids: torch.Tensor, **kwargs) -> Iterator[torch.Tensor]:
        """Streaming vanilla decoding."""
        kwargs["decoding"] = replace(self.decoding, mode="vanilla")
        return self.ea_generate(input_ids, **kwargs)

    # ------------------------------------------------------------------ internals
    def _prompt(self, input_ids) -> torch.Tensor:
        """`prompt_tensor`, on the target's device (a tokenizer returns CPU tensors; the model may be on a GPU)."""
        return prompt_tensor(input_ids).to(self.target.device)

    def _collect(self, input_ids, decoding, temperature, top_p, top_k, max_new_tokens, max_length, log, eos_token_id,
                 generator, return_stats):
        stop = self._stop_rule(input_ids, max_new_tokens, max_length, eos_token_id)
        stats = GenerationStats(prompt_tokens=input_ids.shape[1])
        t0 = time.perf_counter()
        chunks = [input_ids[0]]
        for new, rs in self._rounds(input_ids, decoding, SamplingParams(temperature, top_p, top_k), stop,
                                    generator, collect=return_stats, stats=stats):
            chunks.append(new)
            if rs is not None:
                stats.rounds.append(rs)
        rounds = len(chunks) - 2 if len(chunks) > 1 else 0  # yields after the prefill's token
        ids = torch.cat(chunks)[None]
        stats.new_tokens = ids.shape[1] - input_ids.shape[1]
        stats.total_s = time.perf_counter() - t0
        if return_stats:
            return ids, stats
        if log:
            counted = stats.new_tokens - 1 if stats.new_tokens else 0  # tokens from verification rounds
            return ids, counted, rounds
        return ids

    def _stop_rule(self, input_ids: torch.Tensor, max_new_tokens: int, max_length: int, eos_token_id) -> StopRule:
        max_length = self._check_lengths(max_new_tokens, max_length)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must have shape [1, T] (batch size 1), got {tuple(input_ids.shape)}")
        n = input_ids.shape[1]
        if n == 0:
            raise ValueError("empty prompt: input_ids has no tokens")
        if n >= max_length:
            raise ValueError(f"prompt has {n} tokens, which is not shorter than max_length={max_length}")
        if int(input_ids.max()) >= self.target.vocab_size or int(input_ids.min()) < 0:
            raise ValueError(f"input_ids contain ids outside the vocabulary [0, {self.target.vocab_size})")
        if eos_token_id is None:
            gen = getattr(self.base_model, "generation_config", None)
            eos_token_id = getattr(gen, "eos_token_id", None) if gen is not None else None
            if eos_token_id is None:
                eos_token_id = getattr(self.base_model.config, "eos_token_id", None)
        eos = () if eos_token_id is None else tuple(int(e) for e in (
            eos_token_id if isinstance(eos_token_id, (list, tuple, set)) else [eos_token_id]))
        return StopRule(eos_ids=eos, budget=min(int(max_new_tokens), max_length - n))

    def _check_lengths(self, max_new_tokens, max_length) -> int:
        """Validate the length arguments; returns the effective max_length."""
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool) or (isinstance(v, torch.Tensor) and v.numel() == 1
                                                                      and not v.is_floating_point())
        if not is_int(max_new_tokens) or int(max_new_tokens) < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an integer >= 0")
        config = text_config(self.base_model.config)
        limit = getattr(config, "max_position_embeddings", None)
        if max_length is None:
            return min(DEFAULT_MAX_LENGTH, int(limit)) if limit else DEFAULT_MAX_LENGTH
        if not is_int(max_length) or int(max_length) < 1:
            raise ValueError(f"max_length={max_length!r}: expected an integer >= 1")
        if limit and int(max_length) > int(limit):
            raise ValueError(f"max_length={int(max_length)} exceeds the target's max_position_embeddings={limit}: positions "
                             "beyond it were never trained; to go further anyway, raise "
                             "base_model.config.max_position_embeddings explicitly")
        return int(max_length)

    def _tree_spec(self, decoding: DecodingConfig) -> StaticTreeSpec | None:
        if decoding.mode == "chain":
            return StaticTreeSpec.from_choices(chain_choices(decoding.chain_length))
        if decoding.mode == "static":
            return StaticTreeSpec.from_choices(self.static_tree or static_choices(decoding.static_choices))
        return None

    def _max_tree_nodes(self, decoding: DecodingConfig, spec: StaticTreeSpec | None) -> tuple[int, int]:
        """(target nodes per verification, draft KV slots per round)."""
        if decoding.mode == "vanilla":
            return 1, 0
        if spec is not None:
            return spec.size, spec.size
        return decoding.total_token, decoding.depth * decoding.top_k

    # inference_mode, not just no_grad: views and in-place writes skip version counting, ~15% off every step on
    # dispatch-bound targets (benchmarks/step_costs.py). Buffers first allocated here (KV caches, fused weight
    # copies) become inference tensors, so drive Target / Drafter directly only under inference_mode too.
    @torch.inference_mode()
    def _rounds(self, input_ids: torch.Tensor, decoding: DecodingConfig, sampling: SamplingParams, stop: StopRule,
                generator: torch.Generator | None, collect: bool, stats: GenerationStats | None = None
                ) -> Iterator[tuple[torch.Tensor, RoundStats | None]]:
        """Prefill, then one round of the decoding mode per iteration (`_round_of`: vanilla, chain, static tree,
        dynamic tree; each reads top to bottom, the drafting ones sharing `_verify`), cut at the stops.

        Yields (new tokens [n], RoundStats or None). The first yield is the prefill's token.
        """
        decoding.validate(vocab_size=self.draft_vocab_size)
        spec = self._tree_spec(decoding)
        tree_nodes, draft_slots = self._max_tree_nodes(decoding, spec)
        prompt_len = input_ids.shape[1]
        self.target.reset(capacity=prompt_len + stop.budget + tree_nodes + 1)
        self.drafter.reset(capacity=prompt_len + stop.budget + draft_slots + 2)
        if stop.budget <= 0:
            return
        eos = torch.tensor(stop.eos_ids, dtype=torch.long, device=input_ids.device)
        run = RoundSettings(decoding, sampling, generator, spec, None if decoding.mode == "vanilla" else self.aux_layers,
                            self.calibration_for(decoding, sampling),
                            sampled_chain=decoding.draft_sampling == "probabilistic" and not sampling.greedy)

        t = time.perf_counter()
        hidden, feats = self._target_forward(input_ids, run.aux_layers)  # prefill: [1, T, H]
        root = self._choose(self.target.logits(hidden[0, -1:]), sampling, generator)  # [1]
        if stats is not None:
            stats.prefill_s = time.perf_counter() - t
        produced = 1
        yield root, None
        if produced >= stop.budget or bool(torch.isin(root, eos).any()):
            return
        one_round = self._round_of(decoding.mode)
        last = Committed(root, feats, torch.cat([input_ids[:, 1:], root[None]], dim=1))  # what the draft must commit
        while True:
            t0 = time.perf_counter()
            out = one_round(run, last)
            t2 = time.perf_counter()
            new, done = cut_at_stops(out.new, eos, stop.budget - produced)
            produced += new.numel()
            rs = None
            if collect:
                rs = self._round_stats(out.tree, out.path, new.numel(), out.drafted_at - t0, t2 - out.drafted_at,
                                       time.perf_counter() - t2)
            yield new, rs
            if done:
                return
            last = Committed(new[-1:], out.feats, new[None])  # the draft commits the accepted positions next round

    def _round_of(self, mode: str) -> Callable[[RoundSettings, Committed], RoundOutcome]:
        """The round function of a decoding mode."""
        return {"vanilla": self._vanilla_round, "chain": self._chain_round, "static": self._static_tree_round,
                "dynamic": self._dynamic_tree_round}[mode]

    # ---- one function per decoding mode: commit -> draft -> verify -> accept -> keep
    def _vanilla_round(self, run: RoundSettings, last: Committed) -> RoundOutcome:
        """One target forward on the newest token; the next token chosen from its logits (no draft)."""
        hidden = self.target.forward(last.root[None])  # [1, 1, H]
        forwarded = time.perf_counter()
        token = self._choose(self.target.logits(hidden[0]), run.sampling, run.generator)  # [1]
        return RoundOutcome(None, None, token, None, forwarded)

    def _chain_round(self, run: RoundSettings, last: Committed) -> RoundOutcome:
        """k draft tokens in a row: the draft's argmax chain (a one-branch static tree), or with draft_sampling
        "probabilistic" at T > 0 each token drawn from the draft's distribution (verified by the chain rule)."""
        feature = self.drafter.extend(last.feats, last.next_ids)  # commit: [1, H]
        if run.sampled_chain:
            tree = self.drafter.draft_chain_sampled(last.root, feature, run.decoding.chain_length,
                                                    run.sampling.temperature, run.generator)
        else:
            tree = self.drafter.draft_static(last.root, feature, run.spec)
        return self._verify(run, tree)

    def _static_tree_round(self, run: RoundSettings, last: Committed) -> RoundOutcome:
        """EAGLE-1: the draft fills a fixed choice tree."""
        feature = self.drafter.extend(last.feats, last.next_ids)  # commit: [1, H]
        return self._verify(run, self.drafter.draft_static(last.root, feature, run.spec))

    def _dynamic_tree_round(self, run: RoundSettings, last: Committed) -> RoundOutcome:
        """EAGLE-2: the tree grown by the draft's (calibrated) path scores, depth x top_k, reranked to total_token."""
        feature = self.drafter.extend(last.feats, last.next_ids)  # commit: [1, H]
        d = run.decoding
        tree = self.drafter.draft_dynamic(last.root, feature, d.total_token, d.depth, d.top_k, run.calibration)
        return self._verify(run, tree)

    def _verify(self, run: RoundSettings, tree: DraftTree) -> RoundOutcome:
        """The step every drafting mode shares: one target forward over the tree, acceptance (greedy: the longest
        path the target's argmax agrees with; T > 0: the lossless rule for the way the draft was drawn), and the
        target's KV cache kept for the accepted path only."""
        drafted = time.perf_counter()
        prefix = self.target.length
        hidden, feats = self._target_forward(tree.tokens[None], run.aux_layers, tree.position_ids(prefix),
                                             tree.attention_mask())
        logits = self.target.logits(hidden[0])  # verify: [N, V]
        if run.sampling.greedy:  # accept: path [a + 1] incl. the root, new tokens [a + 1]
            path, new = verify_greedy(tree, logits)
        elif run.sampled_chain:
            path, new = verify_chain_sampling(tree, target_probs(logits, run.sampling), run.generator)
        else:
            path, new = verify_sampling(tree, target_probs(logits, run.sampling), run.generator)
        self.target.keep(prefix, path)  # KV of the accepted path only
        return RoundOutcome(tree, path, new, feats[:, path], drafted)

    def _target_forward(self, ids: torch.Tensor, aux_layers, position_ids=None, tree_mask=None):
        """(hidden [1, n, H], the features the draft reads: the hidden states, or EAGLE-3's aux states [1, n, 3H])."""
        out = self.target.forward(ids, position_ids, tree_mask, aux_layers=aux_layers)
        return out if aux_layers is not None else (out, out)

    def calibration_for(self, decoding: DecodingConfig, sampling: SamplingParams) -> ScoreCalibration | None:
        """The tree-score map a dynamic tree uses at this sampling setting (None: raw draft probabilities)."""
        if decoding.mode != "dynamic" or not decoding.calibrate:
            return None
        return pick_calibration(self.calibrations, sampling.temperature, sampling.top_p, sampling.top_k)

    def _choose(self, logits: torch.Tensor, sampling: SamplingParams, generator) -> torch.Tensor:
        """[1, V] logits -> [1] next token (argmax, or a draw from the processed distribution)."""
        if sampling.greedy:
            return greedy_ids(logits)  # [1]
        return sample_token(target_probs(logits[0], sampling), generator)

    @staticmethod
    def _round_stats(tree, path, committed: int, draft_s: float, verify_s: float, commit_s: float) -> RoundStats:
        if tree is None:  # vanilla
            empty = torch.zeros(0)
            return RoundStats(accept_length=0, new_tokens=committed, node_depth=empty.long(), node_prob=empty,
                              node_path_prob=empty, node_accepted=empty.bool(), node_parent=empty.long(),
                              draft_s=0.0, verify_s=draft_s,
                              commit_s=verify_s + commit_s)
        accepted = torch.zeros(tree.size, dtype=torch.bool)
        accepted[path.cpu()] = True
        node_score = node_path_score = None
        if tree.path_score is not None:
            score = tree.path_score.float().cpu()  # [N] log calibrated acceptance root->node
            node_path_score = score[1:].exp()
            node_score = (score[1:] - score[tree.parents[1:].cpu()]).exp()
        return RoundStats(
            accept_length=path.numel() - 1,
            new_tokens=committed,
            node_depth=tree.depth[1:].cpu(),
            node_prob=tree.prob[1:].float().cpu(),
            node_path_prob=tree.path_logprob[1:].float().exp().cpu(),
            node_accepted=accepted[1:],
            node_parent=(tree.parents[1:] - 1).cpu(),  # node i+1 of the tree is entry i here; the root becomes -1
            node_rank=None if tree.rank is None else tree.rank[1:].cpu(),
            node_score=node_score,
            node_path_score=node_path_score,
            draft_s=draft_s,
            verify_s=verify_s,
            commit_s=commit_s,
        )


CALIBRATION_KEY = "calibration"  # tree_config.json: list of ScoreCalibration dicts, one per sampling setting
_CALIBRATION_SCHEMA = {"temperature": float, "top_p": float, "top_k": int, "knots_x": [[[float]]], "knots_y": [[[float]]],
                       "fitted_on?": dict}


def _tree_config_problem(data: dict) -> str | None:
    """What tree_config.json holds beyond its structure: no unknown key, a valid tree, valid maps."""
    known = set(asdict(DecodingConfig())) | {CALIBRATION_KEY}
    unknown = set(data) - known
    if unknown:
        return f"unknown keys {sorted(unknown)}; valid: {sorted(known)}"
    try:
        DecodingConfig(**{k: v for k, v in data.items() if k != CALIBRATION_KEY}).validate()
        for i, entry in enumerate(data.get(CALIBRATION_KEY, [])):
            ScoreCalibration.from_dict(entry, f"calibration[{i}]")
    except ValueError as e:
        return " ".join(str(e).split())
    return None


TREE_CONFIG = register(StateFile(
    TREE_CONFIG_NAME, "HEAD_DIR", writer="eagle/ea_model.py (python -m evaluation autotune)",
    schema={**{f"{k}?": type(v) for k, v in asdict(DecodingConfig()).items()}, f"{CALIBRATION_KEY}?": [_CALIBRATION_SCHEMA]},
    check=_tree_config_problem,
    rebuild="delete it and rerun `python -m evaluation autotune --base TARGET --head HEAD` (it writes the tree "
            "and, unless eval.calibration_prompts=0, the score maps), or decode with an explicit tree",
    when_missing="no tuned tree: the recipe's (or the published) tree settings",
    example={"total_token": 30, "depth": 4, "top_k": 8, CALIBRATION_KEY: [
        {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "knots_x": [[[0.0, 1.0]]], "knots_y": [[[0.0, 1.0]]]}]}))


def _read_tree_config(head_path: str | Path) -> dict:
    """tree_config.json as a dict ({} when absent); a damaged one (or one with unknown keys) is a StateFileError."""
    return read_json_state(Path(head_path) / TREE_CONFIG_NAME, TREE_CONFIG) or {}


def load_tree_config(head_path: str | Path) -> DecodingConfig:
    """DecodingConfig saved next to a head by the auto-tuner, else the defaults."""
    data = _read_tree_config(head_path)
    data.pop(CALIBRATION_KEY, None)
    return DecodingConfig(**data).validate()


def load_calibrations(head_path: str | Path) -> list[ScoreCalibration]:
    """The tree-score maps saved next to a head (tree_config.json "calibration"), [] when there are none."""
    entries = _read_tree_config(head_path).get(CALIBRATION_KEY, [])
    where = Path(head_path) / TREE_CONFIG_NAME
    return [ScoreCalibration.from_dict(e, f"{where} calibration[{i}]") for i, e in enumerate(entries)]


def save_tree_config(head_path: str | Path, decoding: DecodingConfig | None = None,
                     calibration: ScoreCalibration | None = None) -> Path:
    """Write tree_config.json next to a head: `decoding` replaces the tree settings (None keeps the saved ones),
    `calibration` replaces the map of its sampling setting (the others are kept)."""
    p = Path(head_path) / TREE_CONFIG_NAME
    data = _read_tree_config(head_path)
    maps = data.pop(CALIBRATION_KEY, [])
    if decoding is not None:
        data = asdict(decoding)
    if calibration is not None:
        c = calibration
        maps = [m for m in maps if not ScoreCalibration.from_dict(m).matches(c.temperature, c.top_p, c.top_k)]
        maps.append(c.to_dict())
    if maps:
        data[CALIBRATION_KEY] = maps
    return write_json_state(p, data, TREE_CONFIG, indent=2)
