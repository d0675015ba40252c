"""Greedy speculative decoding is token-identical to transformers' greedy `generate`.

Tiny Llama, Qwen2 (q/k/v bias) and Mistral (sliding window 16, shorter than prompt + generation)
targets with GQA; 20 prompts each; a random head (mostly rejects) and a fitted head (mostly accepts,
so long accepted paths are compacted in the KV cache); EAGLE-2 dynamic trees, the EAGLE-1 static
tree and chains; EOS inside an accepted path, max_new_tokens / max_length cuts; log/stats consistency.
Mixtral, Qwen2-MoE, Qwen3 and Qwen3-MoE run through their own HF decoder layers (random and fitted heads).
Both head kinds: EAGLE-3 heads (`kind="eagle3"`: 4-layer targets, aux layers 1, 2, 3) run the main cases on every
fused family, Mixtral through the HF layers, Gemma through the model's own forward, and a reduced draft vocabulary
that leaves some of the target's greedy tokens undraftable. P-EAGLE heads (`kind="peagle"`, every draft position from
one head forward: eagle/parallel_draft.py) run the main cases on Llama (all families under -m slow), and every round
of theirs costs exactly one head forward.
"""
from __future__ import annotations

import functools

import pytest
import torch

from eagle import DecodingConfig, EaModel
from float_tolerance import assert_same_function, rounding_bound
from tiny_models import (  # noqa: F401  (single_thread is a fixture)
    EAGLE3_LAYERS,
    FAMILIES,
    HF_LAYER_FAMILIES,
    NEW_TOKENS,
    family_setup,
    first_divergence_report,
    fit_good_head,
    hf_greedy,
    random_head,
    random_prompts,
    single_thread,
    TINY_VOCAB,
    tiny_target,
)

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.numeric]  # numeric: tests/float_variants.py

DECODINGS = {
    "dyn60-5-10": DecodingConfig(mode="dynamic", total_token=60, depth=5, top_k=10),
    "dyn16-3-4": DecodingConfig(mode="dynamic", total_token=16, depth=3, top_k=4),
    "dyn24-6-2": DecodingConfig(mode="dynamic", total_token=24, depth=6, top_k=2),
    "static-mc_sim_7b_63": DecodingConfig(mode="static", static_choices="mc_sim_7b_63"),
    "chain5": DecodingConfig(mode="chain", chain_length=5),
}


def head_of(setup, kind):
    return setup.random_head if kind == "random" else setup.good_head


def assert_same(target, expected, got, what):
    assert torch.equal(expected, got), f"{what}: {first_divergence_report(target, expected, got)}"


RANDOM_HEAD_NEW_TOKENS = 12  # a random head is rejected almost every round: one round per token, keep it short
MAIN = ["dyn60-5-10", "static-mc_sim_7b_63", "chain5"]
# the other dynamic shapes run on one family each by default and on all of them under -m slow
HEAD_KINDS = ("random", "good")
EXTRA = [("llama", "dyn16-3-4"), ("qwen2", "dyn24-6-2"), ("mistral", "dyn16-3-4"), ("llama", "dyn24-6-2")]
FULL = [(f, d) for f in FAMILIES for d in DECODINGS]
DEFAULT = [(f, d) for f in FAMILIES for d in MAIN] + EXTRA
CASES = [pytest.param(f, d, "eagle2", h, id=f"{f}-{d}-{h}") for f, d in DEFAULT for h in HEAD_KINDS] + [
    pytest.param(f, d, "eagle2", h, id=f"{f}-{d}-{h}", marks=pytest.mark.slow)
    for f, d in FULL if (f, d) not in DEFAULT for h in HEAD_KINDS
] + [  # EAGLE-3: fitted heads on the main decodings of every family, a random head on one (the rest under -m slow)
    pytest.param(f, d, "eagle3", h, id=f"eagle3-{f}-{d}-{h}",
                 marks=() if d in MAIN and (h == "good" or (f, d) == ("llama", "dyn60-5-10")) else pytest.mark.slow)
    for f, d in FULL for h in HEAD_KINDS
] + [  # P-EAGLE (parallel drafting, one head forward per round): fitted head on the main decodings of Llama, a
    # random one on its dynamic tree (the other families under -m slow)
    pytest.param(f, d, "peagle", h, id=f"peagle-{f}-{d}-{h}",
                 marks=() if f == "llama" and d in MAIN and (h == "good" or d == "dyn60-5-10") else pytest.mark.slow)
    for f, d in FULL for h in HEAD_KINDS
]


def max_accept_length(decoding: DecodingConfig) -> int:
    if decoding.mode == "chain":
        return decoding.chain_length
    if decoding.mode == "static":
        return 5  # mc_sim_7b_63 is 5 levels deep
    return decoding.depth + 1  # root's top-k, then `depth` expansion steps


@pytest.mark.parametrize("family,decoding_name,kind,head_kind", CASES)
def test_greedy_matches_transformers_generate(family, decoding_name, kind, head_kind):
    s = family_setup(family, kind=kind)
    decoding = DECODINGS[decoding_name]
    model = EaModel(s.target, head_of(s, head_kind), decoding)
    n_new = NEW_TOKENS if head_kind == "good" else RANDOM_HEAD_NEW_TOKENS
    new_tokens, rounds, longest = 0, 0, 0
    for i, (prompt, ref) in enumerate(zip(s.prompts, s.references)):
        out, stats = model.eagenerate(prompt, max_new_tokens=n_new, return_stats=True)
        assert_same(s.target, ref[:, : prompt.shape[1] + n_new], out,
                    f"{kind} {family}/{head_kind}/{decoding_name} prompt {i}")
        new_tokens += sum(r.new_tokens for r in stats.rounds)
        rounds += len(stats.rounds)
        longest = max([longest] + [r.accept_length for r in stats.rounds])
    tau = new_tokens / rounds
    assert longest <= max_accept_length(decoding)
    if kind == "peagle":  # the whole draft of a round from one head forward, whatever the tree
        assert model.drafter.forwards == rounds
    if head_kind == "good":
        # the fitted head must really be accepted: long paths, non-trivial cache compaction
        assert longest == max_accept_length(decoding), f"longest accepted path {longest}"
        assert tau > 0.5 * (max_accept_length(decoding) + 1), f"tau={tau:.2f} with a head fitted on these continuations"
    else:
        assert tau < 2.0, f"tau={tau:.2f}: a random head should mostly be rejected"


EDGE_DECODINGS = [
    DecodingConfig(total_token=2, depth=1, top_k=1),  # the smallest tree: root + one draft token
    DecodingConfig(total_token=60, depth=2, top_k=1),  # fewer candidates (3) than total_token - 1
    DecodingConfig(total_token=100, depth=8, top_k=10),  # deeper than the head was fitted for
    DecodingConfig(mode="chain", chain_length=1),
    DecodingConfig(mode="chain", chain_length=8),
]


@pytest.mark.parametrize("decoding", EDGE_DECODINGS, ids=lambda d: f"{d.mode}-{d.total_token}-{d.depth}-{d.top_k}-{d.chain_length}")
def test_edge_tree_shapes(decoding):
    s = family_setup("llama")
    model = EaModel(s.target, s.good_head, decoding)
    for i, (prompt, ref) in enumerate(zip(s.prompts, s.references)):
        assert_same(s.target, ref, model.eagenerate(prompt, max_new_tokens=NEW_TOKENS), f"prompt {i}")


def test_one_and_two_token_prompts():
    s = family_setup("qwen2")
    model = EaModel(s.target, s.good_head)
    for prompt in (torch.tensor([[5]]), torch.tensor([[7, 9]]), torch.tensor([[0]]), torch.tensor([[255, 255]])):
        assert_same(s.target, hf_greedy(s.target, prompt, NEW_TOKENS), model.eagenerate(prompt, max_new_tokens=NEW_TOKENS),
                    f"prompt {prompt.tolist()}")


@pytest.mark.parametrize("family,head_kind", [(f, "eagle2") for f in HF_LAYER_FAMILIES] + [
    ("mixtral", "eagle3"), ("gemma", "eagle3")])
def test_hf_layer_families_random_and_fitted_head(family, head_kind):
    """Mixtral, Qwen2-MoE, Qwen3 (q/k norms), Qwen3-MoE: decoded through their own HF decoder layers with our
    cache; Gemma through the model's own forward (aux states from its output_hidden_states); a random head
    (rejects) and a fitted one (long accepted paths, so compaction runs), 20 prompts."""
    layers = {"num_layers": EAGLE3_LAYERS} if head_kind == "eagle3" else {}
    target = tiny_target(family, seed=3, **layers)
    prompts = random_prompts(20, seed=30)
    refs = [hf_greedy(target, p, NEW_TOKENS) for p in prompts]
    for kind, head in (("random", random_head(target, kind=head_kind)),
                       ("fitted", fit_good_head(target, sequences=refs, kind=head_kind))):
        model = EaModel(target, head, DECODINGS["dyn60-5-10"])
        assert model.target.direct_layers == (family != "gemma") and model.target.fused is None
        new_tokens = rounds = 0
        for i, (prompt, ref) in enumerate(zip(prompts, refs)):
            out, n, r = model.eagenerate(prompt, max_new_tokens=NEW_TOKENS, log=True)
            assert_same(target, ref, out, f"{family} {head_kind} {kind} head, prompt {i}")
            new_tokens, rounds = new_tokens + n, rounds + r
        if kind == "fitted":
            assert new_tokens / rounds > 2.5, f"the fitted head should be accepted often (tau {new_tokens / rounds:.2f})"


@functools.lru_cache(maxsize=None)
def reduced_vocab_setup():
    """The qwen2 EAGLE-3 setup, an EAGLE-3 head fitted over a draft vocabulary of its 24 most frequent greedy tokens,
    and the greedy tokens left outside."""
    s = family_setup("qwen2", kind="eagle3")
    counts = torch.bincount(torch.cat([r[0, p.shape[1]:] for p, r in zip(s.prompts, s.references)]), minlength=256)
    vocab = counts.argsort(descending=True, stable=True)[:24].sort().values  # target ids of the draft vocabulary
    outside = set(torch.nonzero(counts).flatten().tolist()) - set(vocab.tolist())
    head = fit_good_head(s.target, sequences=s.references, kind="eagle3", draft_vocab_size=24,
                         d2t=vocab - torch.arange(24))
    return s, head, outside


@pytest.mark.parametrize("decoding_name", ["dyn60-5-10", "static-mc_sim_7b_63", "chain5"])
def test_eagle3_reduced_draft_vocabulary_is_lossless(decoding_name):
    """A draft vocabulary of the 24 most frequent greedy tokens: the other tokens are never drafted (the head cannot
    name them) but verification still emits every one of them: the output equals transformers' greedy."""
    s, head, outside = reduced_vocab_setup()
    assert outside, "every greedy token is in the draft vocabulary: the test would not test anything"
    model = EaModel(s.target, head, DECODINGS[decoding_name])
    new_tokens, rounds = 0, 0
    for i, (prompt, ref) in enumerate(zip(s.prompts, s.references)):
        out, stats = model.eagenerate(prompt, max_new_tokens=NEW_TOKENS, return_stats=True)
        assert_same(s.target, ref, out, f"prompt {i}")
        new_tokens += sum(r.new_tokens for r in stats.rounds)
        rounds += len(stats.rounds)
    tau = new_tokens / rounds
    assert 1.5 < tau, f"tau={tau:.2f}: the fitted head should still be accepted on in-vocabulary stretches"
    # drafting never proposes a token outside the draft vocabulary
    with torch.inference_mode():
        model.drafter.reset(64)
        tree = model.drafter.draft_dynamic(torch.tensor([3]), torch.randn(1, 64), 60, 5, 10)
    assert bool(head.t2d[tree.tokens[1:]].all()) and tree.size == 60


@pytest.mark.parametrize("family", FAMILIES)
def test_naivegenerate_matches_transformers_generate(family):
    s = family_setup(family)
    model = EaModel(s.target, s.random_head)
    for i, (prompt, ref) in enumerate(zip(s.prompts, s.references)):
        out, new_tokens, rounds = model.naivegenerate(prompt, max_new_tokens=NEW_TOKENS, log=True)
        assert_same(s.target, ref, out, f"{family} naive prompt {i}")
        assert rounds == NEW_TOKENS - 1 and new_tokens == NEW_TOKENS - 1  # one forward per token after the prefill


def test_streaming_yields_growing_prefixes_of_the_greedy_output():
    s = family_setup("llama")
    model = EaModel(s.target, s.good_head)
    for prompt, ref in list(zip(s.prompts, s.references))[:5]:
        chunks = list(model.ea_generate(prompt, max_new_tokens=NEW_TOKENS))
        assert len(chunks) >= 2
        lengths = [c.shape[1] for c in chunks]
        assert lengths == sorted(set(lengths)), f"each yield must add tokens: {lengths}"
        for c in chunks:
            assert torch.equal(c, ref[:, : c.shape[1]])
        assert torch.equal(chunks[-1], ref)


# ----------------------------------------------------------------------------- stops
def eos_candidates(ref, prompt_len):
    """Tokens of the greedy continuation with the position of their first occurrence (>= 1 new token in)."""
    seen = {}
    for j, t in enumerate(ref[0, prompt_len:].tolist()):
        seen.setdefault(t, j)
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_eos_inside_an_accepted_path_stops_exactly_like_transformers(family):
    s = family_setup(family)
    model = EaModel(s.target, s.good_head, DECODINGS["dyn60-5-10"])
    cut_mid_round = 0
    for i, (prompt, ref) in enumerate(zip(s.prompts, s.references)):
        T = prompt.shape[1]
        first = eos_candidates(ref, T)
        # an EOS the model actually emits, first produced somewhere after the prefill's token
        eos = next((t for t, j in sorted(first.items(), key=lambda kv: kv[1]) if j >= 3 + i % 9), None)
        if eos is None:
            eos = next(t for t, j in first.items() if j >= 1)
        expected = hf_greedy(s.target, prompt, NEW_TOKENS, eos_token_id=eos)
        out, stats = model.eagenerate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=eos, return_stats=True)
        assert_same(s.target, expected, out, f"{family} eos={eos} prompt {i}")
        assert int(out[0, -1]) == eos and out.shape[1] == T + first[eos] + 1
        last = stats.rounds[-1]
        cut_mid_round += last.new_tokens < last.accept_length + 1
    # with a good head EOS regularly sits inside an accepted path, with accepted tokens after it
    assert cut_mid_round >= 5, f"only {cut_mid_round} of {len(s.prompts)} prompts stopped inside an accepted path"


def test_several_eos_ids_stop_at_the_first_one_emitted():
    s = family_setup("qwen2")
    model = EaModel(s.target, s.good_head)
    for i, (prompt, ref) in enumerate(zip(s.prompts, s.references)):
        T = prompt.shape[1]
        order = sorted(eos_candidates(ref, T).items(), key=lambda kv: kv[1])
        if len(order) < 3:
            continue
        late, early = order[-1][0], order[len(order) // 2][0]
        expected = hf_greedy(s.target, prompt, NEW_TOKENS, eos_token_id=[late, early])
        out = model.eagenerate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[late, early])
        assert_same(s.target, expected, out, f"eos ids [{late}, {early}] prompt {i}")
        assert int(out[0, -1]) == early


def test_eos_as_the_first_token_returns_prompt_plus_one():
    s = family_setup("llama")
    model = EaModel(s.target, s.good_head)
    for prompt, ref in zip(s.prompts[:5], s.references[:5]):
        T = prompt.shape[1]
        out, new_tokens, rounds = model.eagenerate(prompt, eos_token_id=int(ref[0, T]), log=True)
        assert torch.equal(out, ref[:, : T + 1]) and rounds == 0 and new_tokens == 0


def test_default_eos_comes_from_the_generation_config():
    s = family_setup("llama")
    prompt, ref = s.prompts[0], s.references[0]
    T = prompt.shape[1]
    eos = int(ref[0, T + 6])
    cut = T + eos_candidates(ref, T)[eos] + 1
    s.target.generation_config.eos_token_id = eos
    try:
        out = EaModel(s.target, s.good_head).eagenerate(prompt, max_new_tokens=NEW_TOKENS)
    finally:
        s.target.generation_config.eos_token_id = None
    assert torch.equal(out, ref[:, :cut])


@pytest.mark.parametrize("head_kind", ["random", "good"])
@pytest.mark.parametrize("decoding_name", ["dyn60-5-10", "static-mc_sim_7b_63", "chain5"])
def test_max_new_tokens_and_max_length_cut_exactly(decoding_name, head_kind):
    s = family_setup("mistral")  # sliding window: the cuts also land past the window
    model = EaModel(s.target, head_of(s, head_kind), DECODINGS[decoding_name])
    for i, (prompt, ref) in enumerate(list(zip(s.prompts, s.references))[:6]):
        T = prompt.shape[1]
        for n in (1, 2, 3, 7, 18):
            out = model.eagenerate(prompt, max_new_tokens=n)
            assert_same(s.target, ref[:, : T + n], out, f"prompt {i} max_new_tokens={n}")
            out = model.eagenerate(prompt, max_new_tokens=NEW_TOKENS, max_length=T + n)
            assert_same(s.target, ref[:, : T + n], out, f"prompt {i} max_length=T+{n}")
        # both limits: the tighter one wins
        out = model.eagenerate(prompt, max_new_tokens=9, max_length=T + 4)
        assert out.shape[1] == T + 4
        out = model.eagenerate(prompt, max_new_tokens=4, max_length=T + 9)
        assert out.shape[1] == T + 4


# ----------------------------------------------------------------------------- log / stats
@pytest.mark.parametrize("decoding_name", ["dyn60-5-10", "dyn24-6-2", "static-mc_sim_7b_63", "chain5"])
def test_log_and_round_stats_are_consistent(decoding_name):
    s = family_setup("llama")
    decoding = DECODINGS[decoding_name]
    expected_nodes = {"dynamic": decoding.total_token - 1, "static": 25, "chain": decoding.chain_length}[decoding.mode]
    for head in (s.random_head, s.good_head):
        model = EaModel(s.target, head, decoding)
        for prompt, ref in list(zip(s.prompts, s.references))[:4]:
            T = prompt.shape[1]
            ids, new_tokens, rounds = model.eagenerate(prompt, max_new_tokens=NEW_TOKENS, log=True)
            ids2, stats = model.eagenerate(prompt, max_new_tokens=NEW_TOKENS, return_stats=True)
            assert torch.equal(ids, ref) and torch.equal(ids2, ref)
            assert stats.prompt_tokens == T and stats.new_tokens == NEW_TOKENS
            assert rounds == len(stats.rounds) > 0
            # log counts the tokens of the verification rounds (the prefill's token is not a round's)
            assert new_tokens == sum(r.new_tokens for r in stats.rounds) == NEW_TOKENS - 1
            assert stats.tau == pytest.approx(new_tokens / rounds)
            assert stats.prefill_s > 0 and stats.total_s >= stats.prefill_s
            for k, r in enumerate(stats.rounds):
                n = r.node_depth.numel()
                assert n == expected_nodes
                assert r.node_prob.shape == r.node_path_prob.shape == r.node_accepted.shape == (n,)
                assert r.node_depth.dtype == torch.int64 and r.node_accepted.dtype == torch.bool
                assert r.node_prob.dtype == torch.float32 and r.node_path_prob.dtype == torch.float32
                assert int(r.node_depth.min()) >= 1
                assert int(r.node_accepted.sum()) == r.accept_length
                acc_depths = sorted(r.node_depth[r.node_accepted].tolist())
                assert acc_depths == list(range(1, r.accept_length + 1))
                if k < len(stats.rounds) - 1:
                    assert r.new_tokens == r.accept_length + 1
                else:
                    assert 1 <= r.new_tokens <= r.accept_length + 1
                # path value = product of the draft probabilities along the path. The tree keeps exp(sum of
                # float32 log-probs): relative error ~ u (sum |log p| + one rounding per factor), the softmax over
                # the vocabulary (2 reductions) on top, so the bounds are relative (magnitude = p * that).
                order = r.node_depth[r.node_accepted].argsort()
                acc_prob = r.node_prob[r.node_accepted][order]
                acc_path = r.node_path_prob[r.node_accepted][order]
                rel = acc_path.log().abs() + len(acc_path)
                assert_same_function(acc_path, acc_prob.cumprod(0), terms=TINY_VOCAB, chained=2,
                                     magnitude=acc_path * rel)
                top = r.node_depth == 1
                rel = r.node_prob[top].log().abs() + 1
                assert_same_function(r.node_path_prob[top], r.node_prob[top], terms=TINY_VOCAB, chained=2,
                                     magnitude=r.node_prob[top] * rel)
                slack = rounding_bound(torch.float32, TINY_VOCAB, 1.0, chained=2)
                rel = r.node_path_prob.log().abs() + r.node_depth
                assert bool((r.node_path_prob <= r.node_prob * (1 + slack * rel)).all())
                assert bool(((r.node_prob > 0) & (r.node_prob <= 1 + slack)).all())
                assert min(r.draft_s, r.verify_s, r.commit_s) >= 0


def test_vanilla_round_stats():
    s = family_setup("llama")
    model = EaModel(s.target, s.random_head)
    ids, stats = model.naivegenerate(s.prompts[0], max_new_tokens=10, return_stats=True)
    assert torch.equal(ids, s.references[0][:, : s.prompts[0].shape[1] + 10])
    assert len(stats.rounds) == 9 and all(r.new_tokens == 1 and r.accept_length == 0 for r in stats.rounds)
    assert stats.tau == 1.0


def test_one_model_serves_prompts_of_growing_and_shrinking_length():
    """The preallocated caches are reused across calls; a longer prompt must not read stale state."""
    s = family_setup("qwen2")
    model = EaModel(s.target, s.good_head)
    order = sorted(range(len(s.prompts)), key=lambda i: s.prompts[i].shape[1])
    for i in order[:3] + order[::-1][:3] + order[:2]:
        assert torch.equal(model.eagenerate(s.prompts[i], max_new_tokens=NEW_TOKENS), s.references[i])
    long_prompt = torch.cat([s.references[order[-1]], s.references[order[-2]]], dim=1)  # ~90 tokens, past the cache
    expected = hf_greedy(s.target, long_prompt, 40)
    assert_same(s.target, expected, model.eagenerate(long_prompt, max_new_tokens=40), "long prompt")


# ----------------------------------------------------------------------------- a real pretrained target
@pytest.mark.shared
def test_stories260k_greedy_is_lossless(shared_dir):
    """stories260K (a real pretrained Llama) with a random head: identical to transformers, stop ids {1, 2}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = shared_dir / "models" / "stories260K"
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(path)
    openings = ["Once upon a time", "Tom and Lily went to the park.", "The little dog was sad because",
                "One day, a girl named Sue found a", "Max had a red ball. He"]
    for name, texts in (("dyn60-5-10", openings), ("static-mc_sim_7b_63", openings[:2]), ("chain5", openings[2:4])):
        model = EaModel(target, random_head(target), DECODINGS[name])
        for text in texts:
            prompt = tok(text, return_tensors="pt").input_ids
            expected = hf_greedy(target, prompt, 40, eos_token_id=[1, 2])
            got = model.eagenerate(prompt, max_new_tokens=40, eos_token_id=[1, 2])
            assert_same(target, expected, got, f"{name}: {text!r}")
