"""Verification on fixed trees: greedy acceptance, and exactness of multi-draft rejection sampling.

`verify_sampling` is where losslessness under sampling lives: for a fixed tree and fixed target
distributions at its nodes, the committed tokens (accepted path + the token sampled after it) must
be distributed exactly as autoregressive sampling from those distributions. The exact law of the
output is enumerated and compared by a chi-square test over >= 20k draws, through the sequential rule of
tests/statistical_rule.py (alpha 0.01, then a rerun at 4x the draws with another seed).
"""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from eagle.tree import DraftTree
from eagle.verify import verify_greedy, verify_sampling
from float_tolerance import assert_same_function
from statistical_rule import assert_same_law

pytestmark = pytest.mark.numeric  # float comparisons: tests/float_variants.py runs them under every variant


def make_tree(tokens, parents) -> DraftTree:
    depth = [0]
    for p in parents[1:]:
        depth.append(depth[p] + 1)
    n = len(tokens)
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), depth=torch.tensor(depth),
                     prob=torch.ones(n), path_logprob=torch.zeros(n))


#        0:root(tok 0)
#       /     |      \
#   1:(3)   2:(5)   3:(1)        children listed in rank order
#   /   \     |
# 4:(2) 5:(6) 6:(3)
#   |
# 7:(7)
TREE = make_tree([0, 3, 5, 1, 2, 6, 3, 7], [-1, 0, 0, 0, 1, 1, 2, 4])
V = 8


def one_hot_logits(argmax_tokens, vocab=V):
    logits = torch.randn(len(argmax_tokens), vocab, generator=torch.Generator().manual_seed(0))
    for i, t in enumerate(argmax_tokens):
        logits[i, t] = logits[i].max() + 1.0
    return logits


# ----------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("argmax,path,bonus", [
    ([4, 0, 0, 0, 0, 0, 0, 0], [0], 4),  # root's argmax is no child: nothing accepted
    ([3, 2, 0, 0, 7, 0, 0, 0], [0, 1, 4, 7], 0),  # full path to the deepest leaf, bonus = argmax at the leaf
    ([3, 6, 0, 0, 0, 4, 0, 0], [0, 1, 5], 4),  # second child of node 1, a leaf
    ([5, 0, 3, 0, 0, 0, 2, 0], [0, 2, 6], 2),  # second branch of the root
    ([1, 0, 0, 6, 0, 0, 0, 0], [0, 3], 6),  # third branch, leaf
    ([3, 2, 0, 0, 5, 0, 0, 0], [0, 1, 4], 5),  # stops inside a path: node 7 holds 7, target wants 5
])
def test_verify_greedy_takes_the_longest_matching_path(argmax, path, bonus):
    got_path, got_new = verify_greedy(TREE, one_hot_logits(argmax))
    assert got_path.tolist() == path
    assert got_new.tolist() == TREE.tokens[path[1:]].tolist() + [bonus]  # accepted drafts, then the bonus


def test_verify_greedy_on_a_chain_and_on_the_root_alone():
    chain = make_tree([9, 4, 4, 2], [-1, 0, 1, 2])
    path, new = verify_greedy(chain, one_hot_logits([4, 4, 2, 1], vocab=10))
    assert path.tolist() == [0, 1, 2, 3] and new.tolist() == [4, 4, 2, 1]
    root = make_tree([9], [-1])
    path, new = verify_greedy(root, one_hot_logits([6], vocab=10))
    assert path.tolist() == [0] and new.tolist() == [6]


# ----------------------------------------------------------------------------- sampling: exact law
def exact_outcome_law(tree: DraftTree, probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Law of the committed tokens: walk to node u (each step: child token x with prob p_parent(x)), then
    emit y ~ p_u with y not a child token of u (those would have moved on down the tree)."""
    kids = tree.children()
    toks = tree.tokens.tolist()
    law: dict[tuple[int, ...], float] = {}

    def walk(node, prefix, mass):
        child_tokens = {toks[c] for c in kids[node]}
        for y in range(probs.shape[1]):
            if y not in child_tokens and probs[node, y] > 0:
                law[tuple(prefix + [y])] = mass * float(probs[node, y])
        for c in kids[node]:
            walk(c, prefix + [toks[c]], mass * float(probs[node, toks[c]]))

    walk(0, [], 1.0)
    return law


def chi_square_pvalue(counts: dict, law: dict, n: int) -> tuple[float, int]:
    """Pearson chi-square of observed outcome counts against the exact law; cells with an expected
    count < 5 are pooled into one bin. Returns (p-value, number of bins)."""
    unexpected = set(counts) - set(law)
    assert not unexpected, f"outcomes with zero probability were produced: {sorted(unexpected)[:5]}"
    obs, exp = [], []
    pool_obs, pool_exp = 0, 0.0
    for outcome, p in law.items():
        if p * n >= 5:
            obs.append(counts.get(outcome, 0))
            exp.append(p * n)
        else:
            pool_obs += counts.get(outcome, 0)
            pool_exp += p * n
    if pool_exp > 0:
        obs.append(pool_obs)
        exp.append(pool_exp)
    scale = sum(obs) / sum(exp)  # the law sums to 1 up to float rounding
    return float(chisquare(obs, [e * scale for e in exp]).pvalue), len(obs)


def distributions(seed: int, zero_child_token: bool):
    """Fixed target distributions at the 8 nodes: peaked/flat, some processed with top-k-like zeros."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(TREE.size, V, generator=g) * torch.tensor([[1.0], [2.0], [0.5], [1.5], [1.0], [3.0], [1.0], [0.7]])
    probs = logits.softmax(-1)
    probs[1, [0, 4]] = 0.0  # node 1 truncated (top-k / top-p style zeros)
    if zero_child_token:
        probs[0, 5] = 0.0  # the root's 2nd child token is impossible: must never be accepted
    probs[4] = torch.zeros(V)
    probs[4, 7] = 1.0  # deterministic: node 7 is always accepted after node 4
    return probs / probs.sum(-1, keepdim=True)


def outcome_law_run(probs, zero_child_token: bool = False, verify=verify_sampling):
    """`run(draws, seed)` for tests/statistical_rule.py: chi-square p-value of `draws` outcomes of `verify` on TREE
    against their exact law."""
    law = exact_outcome_law(TREE, probs)
    toks = TREE.tokens

    def run(n, seed):
        gen = torch.Generator().manual_seed(seed)
        counts: dict[tuple[int, ...], int] = {}
        for _ in range(n):
            path, new = verify(TREE, probs, gen)
            assert path[0] == 0 and all(int(TREE.parents[b]) == int(a) for a, b in zip(path[:-1], path[1:]))
            assert new[:-1].tolist() == toks[path[1:]].tolist()
            outcome = tuple(new.tolist())
            counts[outcome] = counts.get(outcome, 0) + 1
        if zero_child_token:
            assert not any(o[0] == 5 for o in counts), "a draft token with target probability 0 was accepted"
        pvalue, bins = chi_square_pvalue(counts, law, n)
        assert bins >= 20
        return pvalue, f"{bins} bins"
    return run


def first_token_run(probs, verify=verify_sampling):
    """`run(draws, seed)`: chi-square p-value of the first committed token of `draws` verifications against p_root."""
    def run(n, seed):
        gen = torch.Generator().manual_seed(seed)
        counts = torch.zeros(V)
        for _ in range(n):
            path, new = verify(TREE, probs, gen)
            counts[int(new[0])] += 1
        return first_token_pvalue(counts, probs[0])
    return run


def first_token_pvalue(counts: torch.Tensor, p_root: torch.Tensor) -> tuple[float, str]:
    """Chi-square of first-token counts [V] against p_root over the tokens expected >= 5 times."""
    n = float(counts.sum())
    keep = (p_root * n >= 5).tolist()
    obs = [float(c) for c, k in zip(counts.tolist(), keep) if k]
    exp = [float(p) for p, k in zip(p_root.double().tolist(), keep) if k]
    pvalue = float(chisquare(obs, [e * sum(obs) / sum(exp) for e in exp]).pvalue)
    return pvalue, f"{counts.tolist()} vs {(p_root * n).tolist()}"


@pytest.mark.statistical
@pytest.mark.parametrize("seed,zero_child_token", [(0, False), (1, True)])
def test_verify_sampling_is_exact_chi_square(seed, zero_child_token):
    probs = distributions(seed, zero_child_token)
    law = exact_outcome_law(TREE, probs)
    # float32 probabilities (each normalised: relative u), products along <= 4 depths, summed over the outcomes
    assert_same_function(sum(law.values()), 1.0, terms=len(law) * V, chained=4, magnitude=1.0, dtype=torch.float32)
    assert_same_law(outcome_law_run(probs, zero_child_token), draws=20_000, seed=1234 + seed,
                    what="verify_sampling's outcomes")


@pytest.mark.statistical
def test_verify_sampling_first_token_marginal_matches_the_root_distribution():
    """Cheaper, sharper view of the same property: the first committed token ~ p_root."""
    assert_same_law(first_token_run(distributions(2, False)), draws=20_000, seed=99,
                    what="verify_sampling's first-token marginal")


def test_verify_sampling_detects_a_biased_sampler():
    """The chi-square machinery has power: sampling from the DRAFT's choice (always take the first child
    when it has any mass) is rejected."""
    probs = distributions(0, False)
    law = exact_outcome_law(TREE, probs)
    n = 20_000
    gen = torch.Generator().manual_seed(5)
    kids = TREE.children()
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(n):
        node, out = 0, []
        while kids[node] and float(probs[node, int(TREE.tokens[kids[node][0]])]) > 0:
            node = kids[node][0]
            out.append(int(TREE.tokens[node]))
        out.append(int(torch.multinomial(probs[node], 1, generator=gen)))
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    law_keys = set(law)
    counts = {k: v for k, v in counts.items() if k in law_keys}
    pvalue, _ = chi_square_pvalue(counts, law, sum(counts.values()))
    assert pvalue < 1e-6


def test_verify_sampling_is_reproducible_with_a_generator():
    probs = distributions(3, False)
    a = [verify_sampling(TREE, probs, torch.Generator().manual_seed(s)) for s in range(20)]
    b = [verify_sampling(TREE, probs, torch.Generator().manual_seed(s)) for s in range(20)]
    for (pa, ta), (pb, tb) in zip(a, b):
        assert torch.equal(pa, pb) and torch.equal(ta, tb)


def test_verify_sampling_with_one_hot_targets_equals_greedy():
    """A one-hot target distribution makes sampling deterministic: it must agree with verify_greedy."""
    for argmax in ([3, 2, 0, 0, 7, 0, 0, 0], [5, 0, 3, 0, 0, 0, 2, 0], [4, 0, 0, 0, 0, 0, 0, 0], [3, 6, 0, 0, 0, 4, 0, 0]):
        logits = one_hot_logits(argmax)
        probs = torch.nn.functional.one_hot(logits.argmax(-1), V).float()
        gpath, gnew = verify_greedy(TREE, logits)
        spath, snew = verify_sampling(TREE, probs, torch.Generator().manual_seed(0))
        assert spath.tolist() == gpath.tolist() and snew.tolist() == gnew.tolist()
