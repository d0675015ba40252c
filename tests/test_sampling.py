"""Sampling is exact: speculative sampling draws from the same distribution as vanilla sampling.

1. `eagle.sampling.target_probs` (temperature / top-k / top-p) equals transformers' own warpers, in
   transformers' order (temperature, top-k, top-p), i.e. what `generate(do_sample=True)` samples from.
2. End to end on a 32-token-vocabulary model: the joint law of the first 3 generated tokens is
   enumerated exactly (all 32^2 prefixes in one batched forward, transformers' warpers) and the
   tokens produced by `eagenerate` (and `naivegenerate`) are compared to it by a chi-square test, through
   the sequential rule of tests/statistical_rule.py (alpha 0.01, then a rerun at 4x the draws with another seed).
   20k draws per setting under `-m slow` (about 3 min each on one core); the default run keeps a 4k-draw T=1.0
   check (its power: tests/test_statistical_power.py). The >= 20k-draw exactness test that runs by default is on
   `verify_sampling` itself (tests/test_verify.py), where exactness lives.
3. The same for an EAGLE-3 head whose draft vocabulary leaves out a token the target samples with real
   probability: that token is never drafted, yet it is produced with its exact probability.
"""
from __future__ import annotations

import functools

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from eagle import DecodingConfig, EaModel
from eagle.sampling import SamplingParams, greedy_ids, target_probs
from float_tolerance import assert_same_function
from statistical_rule import assert_same_law, binomial_pvalue, bonferroni
from tiny_models import EAGLE3_LAYERS, fit_good_head, hf_greedy, random_prompts, single_thread, tiny_target  # noqa: F401

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.numeric]  # numeric: tests/float_variants.py
VOCAB = 32
NEW = 3


def hf_warp(logits: torch.Tensor, temperature: float, top_p: float = 0.0, top_k: int = 0) -> torch.Tensor:
    """Probabilities `generate(do_sample=True, temperature, top_k, top_p)` samples from."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if 0 < top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    dummy = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    return warpers(dummy, logits.float().clone()).softmax(-1)


# ----------------------------------------------------------------------------- 1. the transform
@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.6])
@pytest.mark.parametrize("top_p,top_k", [(0.0, 0), (0.9, 0), (0.5, 0), (0.05, 0), (1.0, 0), (0.0, 1), (0.0, 5),
                                         (0.0, 40), (0.0, 64), (0.8, 8), (0.3, 3)])
def test_target_probs_equal_transformers_warpers(temperature, top_p, top_k):
    g = torch.Generator().manual_seed(int(temperature * 10) + top_k)
    logits = torch.randn(6, 40, generator=g) * 3
    logits[0, :5] = logits[0].max()  # ties at the top
    logits[1, 10:20] = logits[1].min()  # ties at the bottom
    got = target_probs(logits, SamplingParams(temperature, top_p, top_k))
    want = hf_warp(logits, temperature, top_p, top_k)
    assert got.shape == want.shape
    # probabilities (<= 1) through softmax (max, sum) and the top-p cumulative sum over 40 logits
    assert_same_function(got, want, terms=40, chained=3, magnitude=1.0)
    assert torch.equal(got > 0, want > 0), "different supports"


# ----------------------------------------------------------------------------- 2. end to end
@functools.lru_cache(maxsize=None)
def sampling_setup(kind: str = "eagle2"):
    """A 32-token Llama with peaked distributions and a head fitted on its greedy continuations.

    kind="eagle3": a 4-layer Llama and an EAGLE-3 head over a 16-token draft vocabulary (the most frequent greedy
    tokens) that leaves out `outside`, the second most likely first token after the prompt; kind="peagle": the same
    with a P-EAGLE head (parallel drafting)."""
    layers = {"num_layers": EAGLE3_LAYERS} if kind != "eagle2" else {}
    target = tiny_target("llama", vocab_size=VOCAB, init_std=0.3, seed=5, **layers)
    prompts = random_prompts(6, vocab_size=VOCAB, min_len=4, max_len=8, seed=3)
    if kind == "eagle2":
        return target, prompts[0], fit_good_head(target, prompts, new_tokens=8)
    with torch.no_grad():
        outside = int(target(prompts[0]).logits[0, -1].topk(2).indices[1])
    seqs = [hf_greedy(target, p, 8) for p in prompts]
    counts = torch.bincount(torch.cat([s[0] for s in seqs]), minlength=VOCAB)
    counts[outside] = -1
    vocab = counts.argsort(descending=True, stable=True)[:16].sort().values
    head = fit_good_head(target, sequences=seqs, kind=kind, draft_vocab_size=16, d2t=vocab - torch.arange(16))
    assert not bool(head.t2d[outside])
    head.outside = outside  # for the tests
    return target, prompts[0], head


@torch.no_grad()
def exact_joint(target, prompt, temperature, top_p, top_k) -> torch.Tensor:
    """[V, V, V] float64: P(first three generated tokens), enumerated with transformers' warpers."""
    V = VOCAB
    warp = functools.partial(hf_warp, temperature=temperature, top_p=top_p, top_k=top_k)
    p1 = warp(target(prompt).logits[:, -1]).double()[0]  # [V]
    x1 = torch.arange(V)[:, None]
    seq2 = torch.cat([prompt.expand(V, -1), x1], 1)  # [V, T+1]
    p2 = warp(target(seq2).logits[:, -1]).double()  # [V, V]
    seq3 = torch.cat([seq2.repeat_interleave(V, 0), x1.repeat(V, 1)], 1)  # [V*V, T+2]
    p3 = warp(target(seq3).logits[:, -1]).double().view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_against(counts: torch.Tensor, law: torch.Tensor) -> tuple[float, int]:
    """Pearson chi-square over cells with expected count >= 5, the rest pooled into one bin."""
    n = int(counts.sum())
    impossible = counts[law == 0].sum()
    assert impossible == 0, f"{int(impossible)} draws of zero-probability token sequences"
    exp = law.flatten() * n
    obs = counts.flatten().double()
    big = exp >= 5
    o = obs[big].tolist() + [float(obs[~big].sum())]
    e = exp[big].tolist() + [float(exp[~big].sum())]
    if e[-1] == 0:
        o, e = o[:-1], e[:-1]
    e = [x * sum(o) / sum(e) for x in e]
    return float(chisquare(o, e).pvalue), len(o)


def run_chi_square(generate, temperature, top_p, top_k, draws, seed, kind="eagle2", counts_out=None):
    target, prompt, _ = sampling_setup(kind)
    law = exact_joint(target, prompt, temperature, top_p, top_k)
    T = prompt.shape[1]
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    rounds = 0
    for _ in range(draws):
        out, _, r = generate(prompt, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=NEW,
                             log=True, generator=gen)
        assert out.shape == (1, T + NEW) and torch.equal(out[:, :T], prompt)
        a, b, c = out[0, T:].tolist()
        counts[a, b, c] += 1
        rounds += r
    pvalue, bins = chi_square_against(counts, law)
    if counts_out is not None:
        counts_out.append((counts, law))
    return pvalue, bins, rounds / draws


def chi_square_run(generate, temperature, top_p, top_k, kind="eagle2", max_rounds=None):
    """`run(draws, seed)` for tests/statistical_rule.py: the chi-square p-value of `draws` generations against the
    exact law; with max_rounds, also that drafts are accepted (fewer verification rounds per 3 tokens)."""
    def run(draws, seed):
        pvalue, bins, rounds = run_chi_square(generate, temperature, top_p, top_k, draws, seed, kind)
        if max_rounds is not None:
            assert rounds < max_rounds, f"{rounds:.2f} verification rounds per 3 tokens: drafts are rarely accepted"
        return pvalue, f"{bins} bins"
    return run


SETTINGS = {
    "T1.0": (1.0, 0.0, 0),
    "T0.7": (0.7, 0.0, 0),
    "T1.0-top_p0.8": (1.0, 0.8, 0),
    "T1.0-top_k5": (1.0, 0.0, 5),
    "T0.7-top_p0.9-top_k8": (0.7, 0.9, 8),
}
DECODINGS = {
    "dynamic": DecodingConfig(mode="dynamic", total_token=16, depth=3, top_k=4),
    "static": DecodingConfig(mode="static", static_choices="mc_sim_7b_63"),
    "chain": DecodingConfig(mode="chain", chain_length=3),
}


def eagle_generate(decoding_name, kind="eagle2"):
    target, _, head = sampling_setup(kind)
    return EaModel(target, head, DECODINGS[decoding_name]).eagenerate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_is_argmax_with_first_index_on_ties(dtype):
    g = torch.Generator().manual_seed(0)
    for shape in [(7,), (1, 512), (60, 512), (3, 5, 300)]:
        x = torch.randn(*shape, generator=g).to(dtype)
        assert torch.equal(greedy_ids(x), x.argmax(-1))
    tied = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -3.0, -1.0, -2.0]], dtype=dtype)
    assert greedy_ids(tied).tolist() == [1, 0, 0]  # the FIRST maximum, as argmax and transformers' greedy search


DYNAMIC_DRAWS = 4_000  # power against an unnormalised sibling: tests/test_statistical_power.py


@pytest.mark.statistical
def test_eagenerate_sampling_matches_the_exact_law_4k_draws():
    assert_same_law(chi_square_run(eagle_generate("dynamic"), *SETTINGS["T1.0"], max_rounds=1.9),
                    draws=DYNAMIC_DRAWS, seed=0, what="eagenerate dynamic T1.0")


def eagle3_undraftable_run(decoding_name, setting="T1.0", max_rounds=None, generate=None, kind="eagle3"):
    """`run(draws, seed)`: chi-square of the EAGLE-3 (or P-EAGLE) head's samples, and the token outside its draft
    vocabulary (never in a draft tree) produced first as often as its exact probability says (exact binomial test);
    the two p-values of the same draws combined by Bonferroni."""
    target, prompt, head = sampling_setup(kind)
    generate = generate or eagle_generate(decoding_name, kind)

    def run(draws, seed):
        found = []
        _, _, rounds = run_chi_square(generate, *SETTINGS[setting], draws=draws, seed=seed, kind=kind,
                                      counts_out=found)
        if max_rounds is not None:
            assert rounds < max_rounds, f"{rounds:.2f} verification rounds per 3 tokens: EAGLE-3 drafts are hardly ever accepted"
        return eagle3_pvalue(*found[0], head.outside)
    return run


def eagle3_pvalue(counts: torch.Tensor, law: torch.Tensor, outside: int) -> tuple[float, str]:
    """Bonferroni of the chi-square against the exact law and the exact binomial test of how often the undraftable
    token comes first."""
    pvalue, bins = chi_square_against(counts, law)
    draws = int(counts.sum())
    p_first = float(law.sum((1, 2))[outside])
    seen = int(counts.sum((1, 2))[outside])
    assert p_first > 0.05, f"the undraftable token has p={p_first:.3f}: the test would not test anything"
    p_outside = binomial_pvalue(seen, draws, p_first)
    return bonferroni(pvalue, p_outside), (f"chi-square p={pvalue:.2e} over {bins} bins; token {outside} first "
                                           f"{seen} times, expected {draws * p_first:.0f}: binomial p={p_outside:.2e}")


@pytest.mark.statistical
def test_eagle3_sampling_is_exact_with_an_undraftable_token_1k_draws():
    target, prompt, head = sampling_setup("eagle3")
    assert_same_law(eagle3_undraftable_run("dynamic", max_rounds=2.0), draws=1_000, seed=4,
                    what="eagle3 dynamic T1.0 with an undraftable token")
    model = EaModel(target, head, DECODINGS["dynamic"])
    with torch.inference_mode():  # a full draft tree never holds the token
        model.drafter.reset(64)
        model.drafter.extend(torch.randn(1, 3, 3 * 64), torch.tensor([[1, 2, 3]]))
        tree = model.drafter.draft_dynamic(torch.tensor([0]), torch.randn(1, 64), 16, 3, 4)
    assert not bool((tree.tokens[1:] == head.outside).any()) and bool(head.t2d[tree.tokens[1:]].all())


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.parametrize("decoding_name", ["dynamic", "static", "chain"])
@pytest.mark.parametrize("setting", ["T1.0", "T0.7-top_p0.9-top_k8"])
@pytest.mark.parametrize("kind", ["eagle3", "peagle"])  # peagle: every round's draft from one head forward
def test_eagle3_sampling_is_exact_with_an_undraftable_token_20k_draws(decoding_name, setting, kind):
    assert_same_law(eagle3_undraftable_run(decoding_name, setting, kind=kind), draws=20_000, seed=5,
                    what=f"{kind} {decoding_name} {setting} with an undraftable token")


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_eagenerate_sampling_is_exact_20k_draws(setting):
    assert_same_law(chi_square_run(eagle_generate("dynamic"), *SETTINGS[setting], max_rounds=1.9), draws=20_000,
                    seed=1, what=f"eagenerate dynamic {setting}")


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.parametrize("decoding_name", ["static", "chain"])
def test_eagle1_and_chain_sampling_is_exact_20k_draws(decoding_name):
    assert_same_law(chi_square_run(eagle_generate(decoding_name), 0.7, 0.0, 0), draws=20_000, seed=2,
                    what=f"eagenerate {decoding_name} T0.7")


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.parametrize("setting", ["T1.0", "T0.7-top_p0.9-top_k8"])
def test_naivegenerate_sampling_is_exact_20k_draws(setting):
    target, _, head = sampling_setup()
    assert_same_law(chi_square_run(EaModel(target, head).naivegenerate, *SETTINGS[setting]), draws=20_000, seed=3,
                    what=f"naivegenerate {setting}")


def test_sampling_with_a_generator_is_reproducible():
    target, prompt, head = sampling_setup()
    model = EaModel(target, head, DECODINGS["dynamic"])
    a = [model.eagenerate(prompt, temperature=1.0, max_new_tokens=8, generator=torch.Generator().manual_seed(s))
         for s in range(5)]
    b = [model.eagenerate(prompt, temperature=1.0, max_new_tokens=8, generator=torch.Generator().manual_seed(s))
         for s in range(5)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert len({tuple(x[0].tolist()) for x in a}) > 1, "different seeds should give different samples"


def test_tiny_temperature_is_greedy():
    target, prompt, head = sampling_setup()
    model = EaModel(target, head)
    greedy = model.eagenerate(prompt, max_new_tokens=10)
    assert torch.equal(model.eagenerate(prompt, temperature=1e-6, max_new_tokens=10), greedy)


def test_top_p_above_one_is_off_and_warns():
    """Issue 28 item 16: top_p > 1 keeps the EAGLE convention (no nucleus cut) but says so, once per value."""
    import warnings

    import torch

    from eagle.sampling import SamplingParams, target_probs

    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match=r"top_p=1.5 > 1 means no nucleus cut"):
        loose = SamplingParams(temperature=0.7, top_p=1.5)
    off = SamplingParams(temperature=0.7, top_p=0.0)
    assert torch.equal(target_probs(logits, loose), target_probs(logits, off))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SamplingParams(temperature=0.7, top_p=1.0)  # exactly 1: off, no warning
        SamplingParams(temperature=0.7, top_p=0.9)
