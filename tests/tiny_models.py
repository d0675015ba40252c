"""Tiny fixed-seed targets and draft heads for CPU tests (shared by every test module).

Targets: Llama, Qwen2 (q/k/v bias) and Mistral (sliding window) with GQA, a small vocabulary,
float32 and `attn_implementation="sdpa"` (the one attention backend whose 4D tree masks are correct
with a KV cache). `init_std` is larger than HF's 0.02 so that greedy argmax margins are far above
float32 noise (a tree forward and a one-token forward differ in the last bits).

Heads: `random_head` (fresh init: proposals mostly rejected) and `fit_good_head` (a real `EagleHead`
briefly fitted on the target's own greedy continuations of the given prompts, with a self-fed unroll
so deep draft steps are right too: long accepted paths, so KV-cache compaction is exercised).
`kind="eagle3"` gives the same for an `Eagle3Head` (fitted with its training-time-test `unroll`); EAGLE-3
needs 3 distinct aux layers, so its family setups use `EAGLE3_LAYERS`-layer targets with `EAGLE3_AUX` ids.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from eagle.head import Eagle3Head, EagleHead, head_config_from_target
from eagle.head_kinds import head_kind
from float_tolerance import assert_same_function

FAMILIES = ("llama", "qwen2", "mistral")
# the other families Target supports (eagle.target.SUPPORTED_FAMILIES): through the HF decoder layers, not fused
HF_LAYER_FAMILIES = ("mixtral", "qwen2_moe", "qwen3", "qwen3_moe")
# a family outside SUPPORTED_FAMILIES: Target runs it through the model's own forward
MODEL_FORWARD_FAMILIES = ("gemma",)
TINY_VOCAB = 256
KINDS = ("eagle2", "eagle3", "peagle")
EAGLE3_LAYERS = 4  # tiny targets for EAGLE-3 heads: ids 1, 2, 3 (the default (2, L//2, L-3) needs L >= 7)
EAGLE3_AUX = (1, 2, 3)
TEST_THREADS = int(os.environ.get("EAGLE_TEST_THREADS", "1"))


def tiny_target(
    family: str = "llama",
    seed: int = 0,
    vocab_size: int = TINY_VOCAB,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 4096,
    init_std: float = 0.1,
    sliding_window: int | None = None,
    eos_token_id: int | list[int] | None = None,
    tie_word_embeddings: bool = False,
    attn_implementation: str = "sdpa",
):
    """A randomly initialised HF causal LM (eval mode, float32, sdpa by default), identical for identical arguments."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        attn_implementation=attn_implementation,
        dtype="float32",
    )
    if family == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    elif family == "qwen2":  # Qwen2 always has q/k/v bias
        config, cls = Qwen2Config(**common, use_sliding_window=False), Qwen2ForCausalLM
    elif family == "mistral":
        config, cls = MistralConfig(**common, sliding_window=sliding_window), MistralForCausalLM
    elif family == "mixtral":  # 4 experts, top-2 routing
        config = MixtralConfig(**common, sliding_window=sliding_window, num_local_experts=4, num_experts_per_tok=2)
        cls = MixtralForCausalLM
    elif family == "qwen2_moe":  # 4 experts, top-2, plus the gated shared expert
        config = Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=intermediate_size)
        cls = Qwen2MoeForCausalLM
    elif family == "qwen3":  # q/k RMSNorm per head, explicit head_dim
        config, cls = Qwen3Config(**common, head_dim=hidden_size // num_heads), Qwen3ForCausalLM
    elif family == "qwen3_moe":
        config = Qwen3MoeConfig(**common, head_dim=hidden_size // num_heads, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32)
        cls = Qwen3MoeForCausalLM
    elif family == "gemma":  # embedding scale, (1 + w) norms, GELU MLP
        config, cls = GemmaConfig(**common, head_dim=hidden_size // num_heads), GemmaForCausalLM
    else:
        raise ValueError(f"unknown tiny target family {family!r}; expected one of "
                         f"{FAMILIES + HF_LAYER_FAMILIES + MODEL_FORWARD_FAMILIES}")
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    if family == "qwen2":  # HF zero-inits biases: make them non-trivial so a dropped bias changes outputs
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, init_std)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    model.requires_grad_(False)
    return model


def tiny_llama(**kw):
    return tiny_target("llama", **kw)


def tiny_qwen2(**kw):
    return tiny_target("qwen2", **kw)


def tiny_mistral(sliding_window: int | None = 4096, **kw):
    return tiny_target("mistral", sliding_window=sliding_window, **kw)


def enlarge_weights(head, std: float = 0.2):
    """`head` with its weights (all but embed_tokens) redrawn large enough that every unrolled step's or draft
    position's output differs visibly: norms 1 + N(0, 0.1), the rest N(0, std). Returns it in eval mode."""
    with torch.no_grad():
        for name, p in head.named_parameters():
            if not name.startswith("embed_tokens"):
                p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else std * torch.randn_like(p))
    return head.eval()


def random_head(target, seed: int = 0, bias: bool = True, kind: str = "eagle2", aux_layers=EAGLE3_AUX,
                draft_vocab_size: int | None = None, eagle31: dict | None = None) -> "EagleHead | Eagle3Head":
    """A freshly initialised head for `target` (its embedding copied from the target). kind="eagle3": an
    `Eagle3Head` on `aux_layers` whose draft vocabulary is the first `draft_vocab_size` ids (None = all), with the
    EAGLE-3.1 options `eagle31` ({"fc_norm": True, ...}; None = none)."""
    torch.manual_seed(seed)
    if kind != "eagle2":  # eagle3, peagle (P-EAGLE: the EAGLE-3 layout drafting in parallel)
        config = head_config_from_target(target.config, kind=kind, aux_layers=list(aux_layers),
                                         draft_vocab_size=draft_vocab_size or 0, **(eagle31 or {}))
        return head_kind(kind).module(config).bind_target(target).eval()
    head = EagleHead(head_config_from_target(target.config, bias=bias))
    head.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.detach())
    return head.eval()


def random_prompts(n: int, vocab_size: int = TINY_VOCAB, min_len: int = 3, max_len: int = 12, seed: int = 0):
    """n prompts [1, T] of random token ids, T uniform in [min_len, max_len]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        out.append(torch.randint(0, vocab_size, (1, length), generator=g))
    return out


@torch.no_grad()
def hf_greedy(target, prompt: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> torch.Tensor:
    """transformers' own greedy `generate` (the reference every speculative output must equal)."""
    return target.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        temperature=None,
        top_p=None,
        top_k=None,
    )


def first_divergence_report(target, expected: torch.Tensor, got: torch.Tensor) -> str:
    """Explain a mismatch: where the outputs diverge and the target's top-2 logit margin there."""
    n = min(expected.shape[1], got.shape[1])
    diff = (expected[0, :n] != got[0, :n]).nonzero()
    if len(diff) == 0:
        return f"same first {n} tokens, lengths differ: expected {expected.shape[1]}, got {got.shape[1]}"
    i = int(diff[0])
    with torch.no_grad():
        logits = target(expected[:, :i]).logits[0, -1]
    top = logits.topk(2).values
    return (
        f"first divergence at position {i}: expected {int(expected[0, i])}, got {int(got[0, i])} "
        f"(target top-2 logit margin there {float(top[0] - top[1]):.3g}); expected tail {expected[0, i:i + 8].tolist()}, "
        f"got tail {got[0, i:i + 8].tolist()}"
    )


@torch.no_grad()
def _greedy_batch(target, prompts, new_tokens: int, sequences=None, aux_layers=None):
    """Right-padded batch of prompt + greedy continuation, its features (final hidden states, or with aux_layers
    those HF hidden_states concatenated: [B, T, 3H]), the target's argmax and a mask."""
    seqs = [s[0] for s in sequences] if sequences is not None else [hf_greedy(target, p, new_tokens)[0] for p in prompts]
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    out = target(ids, attention_mask=mask, output_hidden_states=True)
    feats = out.hidden_states[-1] if aux_layers is None else torch.cat([out.hidden_states[i] for i in aux_layers], -1)
    return ids, mask, feats, out.logits.argmax(-1)  # [B,T], [B,T], [B,T,H | 3H], [B,T]


# (steps, unrolled depth, peak lr): depth 1 first (cheap, teacher-forced), then deeper self-fed unrolls.
GOOD_HEAD_CURRICULUM = ((80, 1, 1e-2), (25, 2, 5e-3), (25, 3, 5e-3), (25, 4, 5e-3), (20, 5, 3e-3))
# EAGLE-3's unroll trains every step at once: fewer stages reach the same acceptance (tau 6.2 of 6.2 at 60/5/10)
EAGLE3_CURRICULUM = ((60, 1, 1e-2), (30, 3, 5e-3), (30, 5, 3e-3))
# P-EAGLE's positions 2..k read only the mask inputs: every position a tree may draft is trained (dynamic depth 5 and
# the 8-long chain read positions up to 6 and 8), with more steps, as nothing carries over from the previous position
PEAGLE_CURRICULUM = ((60, 1, 1e-2), (60, 4, 5e-3), (80, 8, 3e-3))
FIT_CURRICULA = {"eagle3": EAGLE3_CURRICULUM, "peagle": PEAGLE_CURRICULUM}


def fit_good_head(target, prompts=None, new_tokens: int = 40, sequences=None, curriculum=None,
                  feat_weight: float = 1.0, seed: int = 0, kind: str = "eagle2", aux_layers=EAGLE3_AUX,
                  draft_vocab_size: int | None = None, d2t: torch.Tensor | None = None,
                  eagle31: dict | None = None) -> "EagleHead | Eagle3Head":
    """An `EagleHead` fitted (memorised) on the target's greedy continuations of `prompts`.

    `sequences` (prompt + greedy continuation, [1, T] each) can be passed instead of generating them.
    Loss: CE of the target's lm_head on the predicted feature against the target's own argmax (what
    greedy verification accepts) plus a SmoothL1 feature term, summed over a self-fed unroll (step d
    feeds the predictions of step d-1 as features, like a d-deep draft), deepened by a curriculum.
    ~3 s on one CPU thread; typically > 90% top-1 on those continuations at every depth 1..5.
    kind="eagle3": an `Eagle3Head` (draft vocabulary `d2t`, default the first `draft_vocab_size` ids) fitted by CE
    over its draft vocabulary on every step of `unroll` (targets outside the draft vocabulary are ignored);
    `eagle31`: its EAGLE-3.1 options (random_head).
    """
    if kind != "eagle2":
        return _fit_eagle3(target, prompts, new_tokens, sequences, curriculum or FIT_CURRICULA[kind], seed, aux_layers,
                           draft_vocab_size, d2t, kind, eagle31)
    curriculum = curriculum or GOOD_HEAD_CURRICULUM
    ids, mask, feats, greedy = _greedy_batch(target, prompts, new_tokens, sequences)
    lm_head = target.get_output_embeddings()
    head = random_head(target, seed=seed).train()
    torch.manual_seed(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    for steps, depth, lr in curriculum:
        opt = torch.optim.Adam(params, lr=lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=lr / 20)
        for _ in range(steps):
            # step d, position j: input = (feature of position j+d, true or predicted; token ids[j+d+1]) -> f_{j+d+1}
            f_in, tok, am = feats[:, :-1], ids[:, 1:], mask[:, 1:]
            loss = 0.0
            for d in range(depth):
                pred = head(f_in, tok, am)  # [B, T-1-d, H]
                valid = mask[:, d + 1 :].bool() & am.bool()  # [B, T-1-d]
                loss = loss + F.cross_entropy(lm_head(pred)[valid], greedy[:, d + 1 :][valid])
                loss = loss + feat_weight * F.smooth_l1_loss(pred[valid], feats[:, d + 1 :][valid])
                f_in, tok, am = pred[:, :-1], ids[:, d + 2 :], mask[:, d + 2 :]
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    head.requires_grad_(False)
    return head.eval()


def _fit_eagle3(target, prompts, new_tokens, sequences, curriculum, seed, aux_layers, draft_vocab_size, d2t, kind,
                eagle31=None):
    ids, mask, aux, greedy = _greedy_batch(target, prompts, new_tokens, sequences, aux_layers=list(aux_layers))
    head = random_head(target, seed=seed, kind=kind, aux_layers=aux_layers, draft_vocab_size=draft_vocab_size,
                       eagle31=eagle31)
    if d2t is not None:
        head.set_vocab(d2t)
    draft_of = torch.full((head.config.vocab_size,), -100, dtype=torch.long)  # target id -> draft id (-100: ignored)
    draft_of[head.map_to_target(torch.arange(head.config.options.draft_vocab_size))] = torch.arange(head.config.options.draft_vocab_size)
    head.train()
    torch.manual_seed(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    T = ids.shape[1]
    for steps, depth, lr in curriculum:
        opt = torch.optim.Adam(params, lr=lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=lr / 20)
        for _ in range(steps):
            # index t: aux of position t, token ids[t + 1]; step j's output there predicts greedy[t + j]
            hs = head.unroll(aux[:, :-1], ids[:, 1:], mask[:, 1:], steps=depth)  # depth x [B, T - 1, H]
            loss = 0.0
            for j, h in enumerate(hs, start=1):
                labels = draft_of[greedy[:, j:]].masked_fill(~mask[:, j:].bool(), -100)  # [B, T - j]
                loss = loss + F.cross_entropy(head.draft_logits(h[:, : T - j]).flatten(0, 1), labels.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    head.requires_grad_(False)
    return head.eval()


@torch.no_grad()
def self_fed_accuracy(head: EagleHead, target, prompts, new_tokens: int = 40, depth: int = 5) -> list[float]:
    """Top-1 agreement with the target's argmax at each self-fed depth (1..depth) on greedy continuations."""
    ids, mask, feats, greedy = _greedy_batch(target, prompts, new_tokens)
    lm_head = target.get_output_embeddings()
    f_in, tok, am = feats[:, :-1], ids[:, 1:], mask[:, 1:]
    accs = []
    for d in range(depth):
        pred = head(f_in, tok, am)
        valid = mask[:, d + 1 :].bool() & am.bool()
        accs.append(float((lm_head(pred).argmax(-1) == greedy[:, d + 1 :])[valid].float().mean()))
        f_in, tok, am = pred[:, :-1], ids[:, d + 2 :], mask[:, d + 2 :]
    return accs


@pytest.fixture(scope="module")
def single_thread():
    """Run a module's tiny-model work on one intra-op thread (restored afterwards).

    Tiny matmuls gain nothing from a second thread, and on a busy 2-core machine OpenMP spin-waits made
    a decoding round ~50x slower in CPU time. Use: `pytestmark = pytest.mark.usefixtures("single_thread")`
    after `from tiny_models import single_thread`. `EAGLE_TEST_THREADS=N` runs them on N threads instead
    (tests/float_variants.py: another thread count splits reductions differently).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- cached per-family setups
N_PROMPTS = 20
NEW_TOKENS = 32
MISTRAL_WINDOW = 16  # shorter than prompt + generation, so the sliding window really masks keys


@dataclass
class FamilySetup:
    family: str
    kind: str
    target: object
    prompts: list  # N_PROMPTS x [1, T]
    references: list  # transformers greedy outputs, NEW_TOKENS new tokens each
    random_head: "EagleHead | Eagle3Head"
    good_head: "EagleHead | Eagle3Head | None"


@functools.lru_cache(maxsize=None)
def family_setup(family: str, good: bool = True, kind: str = "eagle2") -> FamilySetup:
    """Target, prompts, transformers' greedy references and both heads of `kind` for one family (built once per
    process). EAGLE-3 setups use an `EAGLE3_LAYERS`-layer target (same seed) and aux ids `EAGLE3_AUX`."""
    kw = {"sliding_window": MISTRAL_WINDOW} if family == "mistral" else {}
    if kind != "eagle2":  # EAGLE-3-layout kinds read 3 aux layers
        kw["num_layers"] = EAGLE3_LAYERS
    index = (FAMILIES + HF_LAYER_FAMILIES + MODEL_FORWARD_FAMILIES).index(family)
    target = tiny_target(family, seed=index, **kw)
    prompts = random_prompts(N_PROMPTS, seed=10 + index)
    refs = [hf_greedy(target, p, NEW_TOKENS) for p in prompts]
    good_head = None
    if good:
        good_head = fit_good_head(target, sequences=refs, kind=kind)
    return FamilySetup(family, kind, target, prompts, refs, random_head(target, seed=1, kind=kind), good_head)


def assert_unroll_ignores_padding(head, ids: torch.Tensor, inputs: torch.Tensor, side: str, terms: int,
                                  reductions: int, steps: int = 3, n: int = 9, pad: int = 3) -> None:
    """A head's `unroll` on the first n tokens of record 0, padded on `side` with `pad` slots, equals the unpadded
    run at every index whose step-j token lies inside the real sequence (both head kinds; inputs [B, T, W])."""
    ids_p = torch.zeros(1, n + pad, dtype=torch.long)
    in_p = torch.zeros(1, n + pad, inputs.shape[-1], dtype=inputs.dtype)
    am = torch.zeros(1, n + pad, dtype=torch.long)
    sl = slice(0, n) if side == "right" else slice(pad, n + pad)
    ids_p[0, sl], in_p[0, sl], am[0, sl] = ids[0, :n], inputs[0, :n], 1
    with torch.no_grad():
        hs = head.unroll(in_p, ids_p, am, steps=steps)
        ref = head.unroll(inputs[:1, :n], ids[:1, :n], steps=steps)
    for j in range(steps):
        valid = n - j  # indices whose step-j token is inside the real sequence
        assert_same_function(hs[j][0, sl][:valid], ref[j][0, :valid], terms=terms, chained=(j + 1) * reductions,
                             msg=f"step {j + 1}")
