"""Probabilistic drafting (DecodingConfig(mode="chain", draft_sampling="probabilistic"), vLLM's
`draft_sample_method: probabilistic`): drafts sampled from the head at the request's temperature, accepted with
min(1, p/q), a rejection resampled from max(p - q, 0). Lossless like every decoder here: greedy output identical
to vanilla, sampled output distributed exactly as vanilla (chi-square against the enumerated law of the first
three tokens, the harness of tests/test_sampling.py), and `verify_chain_sampling` itself exact and able to fail;
every law check through the sequential rule of tests/statistical_rule.py."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from eagle import DecodingConfig, EaModel
from eagle.tree import DraftTree
from eagle.verify import verify_chain_sampling
from statistical_rule import assert_same_law, binomial_pvalue, bonferroni
from test_sampling import SETTINGS, chi_square_run, sampling_setup
from tiny_models import single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")
PROBABILISTIC = DecodingConfig(mode="chain", chain_length=3, draft_sampling="probabilistic")


def chain_tree(tokens: list[int], q: torch.Tensor) -> DraftTree:
    n = len(tokens)
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.arange(-1, n - 1), depth=torch.arange(n),
                     prob=torch.ones(n), path_logprob=torch.zeros(n), draft_probs=q)


def draw_rounds(p: torch.Tensor, q: torch.Tensor, draws: int, seed: int, residual: bool = True,
                verify=verify_chain_sampling):
    """(first output token counts [V], accepted-at-position-1 count) of `draws` rounds whose 2-token chain is drawn
    from q (fixed per position); residual=False is a broken verifier that resamples a rejection from p."""
    g = torch.Generator().manual_seed(seed)
    V = p.shape[1]
    first, accepted = torch.zeros(V, dtype=torch.long), 0
    for _ in range(draws):
        toks = [0] + [int(torch.multinomial(q[i], 1, generator=g)) for i in (1, 2)]
        path, new = verify(chain_tree(toks, q), p, g)
        if not residual and path.numel() == 1:  # rejected at position 1: the broken rule draws from p, not the residual
            new = torch.multinomial(p[0], 1, generator=g)
        first[int(new[0])] += 1
        accepted += path.numel() > 1
    return first, accepted


def chain_distributions():
    """Target p for positions 1, 2 and the bonus token; an overconfident draft q (sharper than p, and noisy), as a
    trained head's tends to be: where q > p the acceptance ratio p/q < 1 decides, so a wrong ratio shows."""
    V = 6
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0)) * 1.5
    p = torch.softmax(logits, -1)
    q = torch.zeros(3, V)
    q[1:] = torch.softmax(logits[:2] * 1.5 + 0.5 * torch.randn(2, V, generator=torch.Generator().manual_seed(1)), -1)
    return p, q


def chain_round_run(p, q, verify=verify_chain_sampling):
    """`run(draws, seed)`: the first output token ~ p exactly (chi-square) and drafts accepted at the rate
    sum_x min(p(x), q(x)) = 1 - TV(p, q) (exact binomial test), one Bonferroni p-value."""
    def run(draws, seed):
        return chain_pvalue(*draw_rounds(p, q, draws, seed, verify=verify), p, q)
    return run


def chain_pvalue(first: torch.Tensor, accepted: int, p: torch.Tensor, q: torch.Tensor) -> tuple[float, str]:
    draws = int(first.sum())
    rate = float(torch.minimum(p[0], q[1]).sum())
    expected = (p[0].double() / p[0].double().sum() * draws).tolist()
    p_first = float(chisquare(first.tolist(), expected).pvalue)
    p_rate = binomial_pvalue(accepted, draws, rate)
    return bonferroni(p_first, p_rate), (f"first token chi-square p={p_first:.2e}; {accepted} accepted, expected "
                                         f"{draws * rate:.0f}: binomial p={p_rate:.2e}")


@pytest.mark.statistical
def test_verify_chain_sampling_is_exact_and_the_test_can_fail():
    p, q = chain_distributions()
    rate = float(torch.minimum(p[0], q[1]).sum())
    assert 0.2 < rate < 0.9  # rejections happen often enough for the residual to matter (rate 0.85)
    assert_same_law(chain_round_run(p, q), draws=20_000, seed=1, what="verify_chain_sampling")
    draws = 20_000
    expected = (p[0].double() / p[0].double().sum() * draws).tolist()
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


@pytest.mark.statistical
def test_probabilistic_chain_sampling_matches_the_exact_law_2k_draws():
    target, _, head = sampling_setup()
    assert_same_law(chi_square_run(EaModel(target, head, PROBABILISTIC).eagenerate, *SETTINGS["T1.0"], max_rounds=2.0),
                    draws=2_000, seed=11, what="probabilistic chain T1.0")


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
@pytest.mark.statistical
@pytest.mark.parametrize("kind", ["eagle2", "eagle3", "peagle"])
@pytest.mark.parametrize("setting", ["T1.0", "T0.7-top_p0.9-top_k8"])
def test_probabilistic_chain_sampling_is_exact_20k_draws(kind, setting):
    target, _, head = sampling_setup(kind)
    assert_same_law(chi_square_run(EaModel(target, head, PROBABILISTIC).eagenerate, *SETTINGS[setting], kind=kind),
                    draws=20_000, seed=12, what=f"probabilistic chain {kind} {setting}")
