"""Probabilistic drafting (DecodingConfig(mode="chain", draft_sampling="probabilistic"), vLLM's
`draft_sample_method: probabilistic`): drafts sampled from the head at the request's temperature, accepted with
min(1, p/q), a rejection resampled from max(p - q, 0). Lossless like every decoder here: greedy output identical
to vanilla, sampled output distributed exactly as vanilla (chi-square against the enumerated law of the first
three tokens, the harness of tests/test_sampling.py), and `verify_chain_sampling` itself exact and able to fail."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from eagle import DecodingConfig, EaModel
from eagle.tree import DraftTree
from eagle.verify import verify_chain_sampling
from test_sampling import ALPHA, SETTINGS, run_chi_square, sampling_setup
from tiny_models import single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")
PROBABILISTIC = DecodingConfig(mode="chain", chain_length=3, draft_sampling="probabilistic")


def chain_tree(tokens: list[int], q: torch.Tensor) -> DraftTree:
    n = len(tokens)
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.arange(-1, n - 1), depth=torch.arange(n),
                     prob=torch.ones(n), path_logprob=torch.zeros(n), draft_probs=q)


def draw_rounds(p: torch.Tensor, q: torch.Tensor, draws: int, seed: int, residual: bool = True):
    """(first output token counts [V], accepted-at-position-1 count) of `draws` rounds whose 2-token chain is drawn
    from q (fixed per position); residual=False is a broken verifier that resamples a rejection from p."""
    g = torch.Generator().manual_seed(seed)
    V = p.shape[1]
    first, accepted = torch.zeros(V, dtype=torch.long), 0
    for _ in range(draws):
        toks = [0] + [int(torch.multinomial(q[i], 1, generator=g)) for i in (1, 2)]
        path, new = verify_chain_sampling(chain_tree(toks, q), p, g)
        if not residual and path.numel() == 1:  # rejected at position 1: the broken rule draws from p, not the residual
            new = torch.multinomial(p[0], 1, generator=g)
        first[int(new[0])] += 1
        accepted += path.numel() > 1
    return first, accepted


def test_verify_chain_sampling_is_exact_and_the_test_can_fail():
    g = torch.Generator().manual_seed(0)
    V = 6
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)  # target for positions 1, 2 and the bonus token
    q = torch.zeros(3, V)
    q[1:] = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)  # the draft, unlike the target
    draws = 20_000
    expected = (p[0].double() / p[0].double().sum() * draws).tolist()
    first, accepted = draw_rounds(p, q, draws, seed=1)
    assert chisquare(first.tolist(), expected).pvalue > ALPHA  # the first token ~ p exactly
    rate = float(torch.minimum(p[0], q[1]).sum())  # P(accept) = sum_x min(p(x), q(x)) = 1 - TV(p, q)
    assert abs(accepted - draws * rate) < 4.5 * (draws * rate * (1 - rate)) ** 0.5
    assert 0.2 < rate < 0.9  # rejections happen often enough for the residual to matter
    biased, _ = draw_rounds(p, q, draws, seed=1, residual=False)
    assert chisquare(biased.tolist(), expected).pvalue < 1e-6  # a wrong rule is caught


def test_greedy_output_is_vanilla_and_probabilistic_needs_a_chain():
    target, prompt, head = sampling_setup()
    model = EaModel(target, head, PROBABILISTIC)
    assert torch.equal(model.eagenerate(prompt, max_new_tokens=12), model.naivegenerate(prompt, max_new_tokens=12))
    with pytest.raises(ValueError, match="needs mode 'chain'"):
        model.eagenerate(prompt, temperature=1.0, max_new_tokens=4,
                         decoding=DecodingConfig(mode="dynamic", draft_sampling="probabilistic"))
    with pytest.raises(ValueError, match="draft_sampling='sampled'"):
        DecodingConfig(mode="chain", draft_sampling="sampled").validate()


def test_probabilistic_chain_sampling_matches_the_exact_law_2k_draws():
    target, _, head = sampling_setup()
    pvalue, bins, rounds = run_chi_square(EaModel(target, head, PROBABILISTIC).eagenerate, 1.0, 0.0, 0, draws=2_000,
                                          seed=11)
    assert rounds < 2.0, f"{rounds:.2f} verification rounds per 3 tokens: drafts are hardly ever accepted"
    assert pvalue > ALPHA, f"chi-square p={pvalue:.2e} over {bins} bins"


def test_probabilistic_drafts_keep_their_distributions():
    """The drafted chain records q for every node; an EAGLE-3 head's q is zero outside its draft vocabulary."""
    target, prompt, head = sampling_setup("eagle3")
    model = EaModel(target, head, PROBABILISTIC)
    with torch.inference_mode():
        model.drafter.reset(64)
        model.drafter.extend(torch.randn(1, 3, 3 * 64), torch.tensor([[1, 2, 3]]))
        tree = model.drafter.draft_chain_sampled(torch.tensor([0]), torch.randn(1, 64), 3, 1.0,
                                                 torch.Generator().manual_seed(0))
    q = tree.draft_probs
    assert q.shape == (4, 32) and torch.allclose(q[1:].sum(-1), torch.ones(3))
    assert float(q[1:, ~head.t2d].sum()) == 0.0 and bool(head.t2d[tree.tokens[1:]].all())
    assert torch.allclose(tree.prob[1:], q[1:].gather(1, tree.tokens[1:, None])[:, 0])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
@pytest.mark.parametrize("setting", ["T1.0", "T0.7-top_p0.9-top_k8"])
def test_probabilistic_chain_sampling_is_exact_20k_draws(kind, setting):
    target, _, head = sampling_setup(kind)
    pvalue, bins, _ = run_chi_square(EaModel(target, head, PROBABILISTIC).eagenerate, *SETTINGS[setting],
                                     draws=20_000, seed=12, kind=kind)
    assert pvalue > ALPHA, f"{kind} {setting}: chi-square p={pvalue:.2e} over {bins} bins"
