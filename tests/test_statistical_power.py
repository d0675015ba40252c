"""Power of the default tier's statistical tests (slow tier): for each test marked `statistical`, a deliberately
wrong sampler of the size that matters fails tests/statistical_rule.py's sequential rule, at the test's own draws,
with probability >= 0.99. docs/results/statistical_tests.md holds the measured table.

The wrong samplers (module-level functions below):
  verify_sampling_accepting_more   a tree's child accepted with min(1, 1.1 p(x)) instead of p(x)
  verify_sampling_unnormalised     after a rejected sibling p(x) is zeroed but p not renormalised, so the next sibling
                                   is accepted with p(y), not p(y) / (1 - p(x)) (the residual without renormalising)
  verify_chain_accepting_more      a sampled draft accepted with min(1, 1.1 p/q) instead of min(1, p/q)
  verify_chain_resampling_from_p   a rejection resampled from p instead of the residual max(p - q, 0)
  verify_sampling_within_draft_vocabulary   the next token drawn within the head's draft vocabulary (EAGLE-3)
  plus, for the tests of statistical tools: a second sample from another law (chi2_homogeneity), a speculative side
  at 0.5x the temperature (distribution_test), and a `compare` without its Bonferroni over the k positions
  (serve-check's agreement).

How the power is measured, per test (each way runs the rule itself, `sequential_verdict`, on many seeds; a seed is
a first stage at the test's draws and, when it fails, a rerun at 4x with another seed):
  law     the wrong verifier's law on the test's fixed distributions is enumerated exactly (checked against the wrong
          verifier's own draws first); each seed draws counts from it (numpy) through the test's own p-value.
  pool    end to end (eagenerate with a wrong verifier patched in) a draw costs ~4 ms on one core: the wrong
          sampler's law is estimated from POOL_BLOCKS blocks of draws, then shrunk toward the exact law so that its
          chi-square distance equals the pool's unbiased estimate (the pool's own noise would add (cells - 1) / pool
          draws to it and inflate the power); each seed draws counts from it through the test's own p-value. Power is
          given at that estimate and at its lower 95% bound (Student t over the blocks).
  real    the test's own draws from the wrong sampler (chi2_homogeneity: numpy, cheap).
  serve-check's agreement counts are Binomial(repeats, r): r of the wrong `compare` is measured over RATE_REPEATS
  real repeats, the power given at its lower 95% bound; distribution_test's wrong side is eagenerate at 0.5x the
  temperature, whose law (exact at any temperature) is enumerated like the target's.
Clopper-Pearson 95% intervals over the seeds. EAGLE_POWER_SEEDS (default 300: 0 failures of 300 bound the power
below by 0.990) and EAGLE_POWER_POOL (draws per block, default 4000) size it; EAGLE_POWER_TABLE=FILE appends one
JSON line per test.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch
from scipy.stats import binomtest, chisquare
from scipy.stats import t as student_t

import eagle.ea_model as ea_model
import test_evaluation_e2e as e2e
import test_evaluation_metrics as metrics
import test_probabilistic_draft as probabilistic
import test_sampling as sampling
import test_score_calibration as calibration
import test_serve_engine_logic as serve
import test_verify as verify
from eagle import EaModel
from eagle.sampling import sample_token
from statistical_rule import assert_same_law, bonferroni, sequential_verdict
from tiny_models import single_thread  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]
POWER = 0.99
SEEDS = int(os.environ.get("EAGLE_POWER_SEEDS", "300"))
POOL = int(os.environ.get("EAGLE_POWER_POOL", "4000"))
POOL_BLOCKS = 5
FACTOR = 1.1
RATE_REPEATS = 3000


# ----------------------------------------------------------------------------- the wrong samplers
def defective_tree_verifier(accept_factor: float = 1.0, renormalise: bool = True, t2d: torch.Tensor | None = None):
    """eagle.verify.verify_sampling with one deliberate defect: a child accepted with min(1, accept_factor p(x));
    after a rejected sibling p(x) zeroed but p not renormalised; or the next token drawn from p restricted to the
    draft vocabulary `t2d`. With the defaults it is the exact sampler."""
    def verify(tree, target_probs, generator=None):
        kids, tokens, node, path = tree.children(), tree.tokens.tolist(), 0, [0]
        while True:
            p = target_probs[node]
            for child in kids[node]:
                x = tokens[child]
                if float(torch.rand((), generator=generator)) < accept_factor * float(p[x]):
                    node = child
                    path.append(child)
                    break
                p = p.clone()
                p[x] = 0.0
                if renormalise:
                    total = p.sum()
                    p = p / total if total > 0 else p
            else:
                if t2d is not None:
                    inside = p * t2d
                    p = inside if inside.sum() > 0 else p
                if not bool(p.sum() > 0):  # every child rejected where renormalising would have accepted the last:
                    p = target_probs[node]  # fall back to p (a crash would be caught by any test)
                path_t = torch.tensor(path)
                return path_t, torch.cat([tree.tokens[path_t[1:]], sample_token(p, generator)])
    return verify


verify_sampling_accepting_more = defective_tree_verifier(accept_factor=FACTOR)  # WRONG: 1.1 p(x)
verify_sampling_unnormalised = defective_tree_verifier(renormalise=False)  # WRONG: not renormalised


def verify_sampling_within_draft_vocabulary(t2d: torch.Tensor):
    """The next token after the accepted drafts drawn from p restricted to the head's draft vocabulary (a t2d
    mix-up): a token the head cannot draft is then never produced."""
    return defective_tree_verifier(t2d=t2d)  # WRONG: the target's token need not be draftable


def wrong_chain_verifier(accept_factor: float = 1.0, residual: bool = True):
    def verify_chain(tree, target_probs, generator=None):
        q, tokens = tree.draft_probs, tree.tokens.tolist()
        n = len(tokens)
        for i in range(1, n):
            p, x = target_probs[i - 1], tokens[i]
            if float(torch.rand((), generator=generator)) * float(q[i, x]) < accept_factor * float(p[x]):
                continue
            if residual:
                rest = (p - q[i]).clamp(min=0.0)
                nxt = sample_token(rest / rest.sum() if rest.sum() > 0 else p, generator)
            else:
                nxt = sample_token(p, generator)  # WRONG: not the residual
            return torch.arange(i), torch.cat([tree.tokens[1:i], nxt])
        return torch.arange(n), torch.cat([tree.tokens[1:], sample_token(target_probs[n - 1], generator)])
    return verify_chain


verify_chain_accepting_more = wrong_chain_verifier(accept_factor=FACTOR)
verify_chain_resampling_from_p = wrong_chain_verifier(residual=False)


# ----------------------------------------------------------------------------- exact laws of the wrong verifiers
def tree_outcome_law(tree, probs, factor=1.0, renormalise=True) -> dict[tuple[int, ...], float]:
    """Law of verify_sampling's committed tokens with child acceptance min(1, factor * p(x)) and, after a rejection,
    p(x) zeroed and renormalised (or not); the final token drawn from what is left, normalised (as multinomial)."""
    kids, toks = tree.children(), tree.tokens.tolist()
    law: dict[tuple[int, ...], float] = {}

    def walk(node, prefix, mass):
        p = probs[node].double().clone()
        for c in kids[node]:
            x = toks[c]
            a = min(1.0, factor * float(p[x]))
            if a > 0:
                walk(c, prefix + [x], mass * a)
            mass *= 1 - a
            p[x] = 0.0
            if renormalise and p.sum() > 0:
                p = p / p.sum()
        if not bool(p.sum() > 0):  # as verify_sampling_unnormalised: nothing left, fall back to p
            p = probs[node].double()
        if mass > 0:
            for y in torch.nonzero(p).flatten().tolist():
                key = tuple(prefix + [y])
                law[key] = law.get(key, 0.0) + mass * float(p[y] / p.sum())

    walk(0, [], 1.0)
    return law


def chain_round_law(p, q, factor=1.0) -> torch.Tensor:
    """[2, V] law of (accepted at position 1, first output token) of draw_rounds with acceptance min(1, factor p/q)."""
    p1, q1 = p[0].double(), q[1].double()
    accept = torch.minimum(q1, factor * p1)  # P(draft x and accepted)
    rest = (p1 - q1).clamp(min=0.0)
    return torch.stack([(1 - accept.sum()) * rest / rest.sum(), accept])


# ----------------------------------------------------------------------------- measuring
def law_run(law_values: np.ndarray, pvalue_of_counts):
    """`run(draws, seed)`: counts of `draws` outcomes of a known law, through the test's own p-value."""
    probs = np.clip(law_values, 0, None) / np.clip(law_values, 0, None).sum()

    def run(draws, seed):
        return pvalue_of_counts(np.random.default_rng(seed).multinomial(draws, probs))
    return run


def power_of(run, draws, seeds) -> dict:
    start = time.time()
    verdicts = [sequential_verdict(run, draws, 10_000 + s) for s in range(seeds)]
    failures = sum(not v.passed for v in verdicts)
    ci = binomtest(failures, seeds).proportion_ci(0.95, method="exact")
    firsts = sorted(v.p_first for v in verdicts)
    return {"seeds": seeds, "failures": failures, "power": failures / seeds, "ci95": [ci.low, ci.high],
            "first_stage_failures": sum(v.p_rerun is not None for v in verdicts),
            "median_p_first": firsts[len(firsts) // 2], "largest_p_first": firsts[-1], "seconds": time.time() - start}


def record(test: str, defect: str, method: str, draws: int, result: dict) -> None:
    row = {"test": test, "defect": defect, "method": method, "draws": draws, **result}
    print(json.dumps(row))
    if os.environ.get("EAGLE_POWER_TABLE"):
        with open(os.environ["EAGLE_POWER_TABLE"], "a") as f:
            f.write(json.dumps(row) + "\n")


# ----------------------------------------------------------------------------- verify-level tests: exact laws
@pytest.mark.statistical  # slow tier: outside the default tier's budget
def test_the_enumerated_laws_are_the_verifiers_laws():
    """The enumeration is right: with factor 1 it is the exact law, and each wrong verifier's real draws follow
    its enumerated law (this very test passes by the rule, so the power below is about the real wrong samplers)."""
    probs = verify.distributions(0, False)
    exact = verify.exact_outcome_law(verify.TREE, probs)
    assert tree_outcome_law(verify.TREE, probs).keys() == exact.keys()
    assert max(abs(tree_outcome_law(verify.TREE, probs)[k] - v) for k, v in exact.items()) < 1e-6
    for wrong, kw in [(verify_sampling_accepting_more, {"factor": FACTOR}),
                      (verify_sampling_unnormalised, {"renormalise": False})]:
        law = tree_outcome_law(verify.TREE, probs, **kw)

        def run(n, seed, wrong=wrong, law=law):
            gen = torch.Generator().manual_seed(seed)
            counts: dict = {}
            for _ in range(n):
                out = tuple(wrong(verify.TREE, probs, gen)[1].tolist())
                counts[out] = counts.get(out, 0) + 1
            return verify.chi_square_pvalue(counts, law, n)[0]
        statistical_check(run, f"{wrong.__name__} against its enumerated law")
    p, q = probabilistic.chain_distributions()
    law = chain_round_law(p, q, FACTOR)

    def chain_run(n, seed):
        g = torch.Generator().manual_seed(seed)
        counts = torch.zeros(2, p.shape[1])
        for _ in range(n):
            toks = [0] + [int(torch.multinomial(q[i], 1, generator=g)) for i in (1, 2)]
            path, new = verify_chain_accepting_more(probabilistic.chain_tree(toks, q), p, g)
            counts[int(path.numel() > 1), int(new[0])] += 1
        keep = (law.flatten() * n >= 5)
        obs, exp = counts.flatten()[keep].double(), law.flatten()[keep] * n
        return float(chisquare(obs.tolist(), (exp * obs.sum() / exp.sum()).tolist()).pvalue)
    statistical_check(chain_run, "verify_chain_accepting_more against its enumerated law")


def statistical_check(run, what):
    assert_same_law(run, draws=20_000, seed=77, what=what)


def dict_counts_pvalue(keys, exact_law, n_of=None):
    def pvalue(counts):
        n = int(counts.sum())
        got = {k: int(c) for k, c in zip(keys, counts) if c}
        if set(got) - set(exact_law):
            return 0.0  # a draw the exact law forbids: the test fails on it
        return verify.chi_square_pvalue(got, exact_law, n)
    return pvalue


@pytest.mark.parametrize("seed,zero_child_token", [(0, False), (1, True)])
def test_power_verify_sampling_outcomes(seed, zero_child_token):
    probs = verify.distributions(seed, zero_child_token)
    exact = verify.exact_outcome_law(verify.TREE, probs)
    wrong = tree_outcome_law(verify.TREE, probs, factor=FACTOR)
    keys = list(wrong)
    result = power_of(law_run(np.array([wrong[k] for k in keys]), dict_counts_pvalue(keys, exact)), 20_000, SEEDS)
    record(f"test_verify.py::test_verify_sampling_is_exact_chi_square[{seed}-{zero_child_token}]",
           "child accepted with min(1, 1.1 p)", "law", 20_000, result)
    assert result["power"] >= POWER


def test_power_verify_sampling_first_token():
    probs = verify.distributions(2, False)
    wrong = tree_outcome_law(verify.TREE, probs, factor=FACTOR)
    first = np.zeros(verify.V)
    for k, v in wrong.items():
        first[k[0]] += v
    result = power_of(law_run(first, lambda c: verify.first_token_pvalue(torch.tensor(c, dtype=torch.float64),
                                                                         probs[0])), 20_000, SEEDS)
    record("test_verify.py::test_verify_sampling_first_token_marginal_matches_the_root_distribution",
           "child accepted with min(1, 1.1 p)", "law", 20_000, result)
    assert result["power"] >= POWER


def test_power_verify_chain_sampling():
    p, q = probabilistic.chain_distributions()
    wrong = chain_round_law(p, q, FACTOR)
    V = p.shape[1]

    def pvalue(counts):
        c = torch.tensor(counts.reshape(2, V))
        return probabilistic.chain_pvalue(c.sum(0), int(c[1].sum()), p, q)
    result = power_of(law_run(wrong.flatten().numpy(), pvalue), 20_000, SEEDS)
    record("test_probabilistic_draft.py::test_verify_chain_sampling_is_exact_and_the_test_can_fail",
           "draft accepted with min(1, 1.1 p/q)", "law", 20_000, result)
    assert result["power"] >= POWER


# ----------------------------------------------------------------------------- end to end: pooled laws
def pooled_power(generate, setting, kind, draws, pvalue_of_counts, test, defect, key):
    """The wrong end-to-end sampler's law from POOL_BLOCKS blocks of POOL draws, shrunk to its unbiased chi-square
    distance (and to that distance's lower 95% bound); the rule over SEEDS seeds of counts drawn from each."""
    target, prompt, _ = sampling.sampling_setup(kind)
    law = sampling.exact_joint(target, prompt, *sampling.SETTINGS[setting]).flatten()
    big = law * draws >= 5  # the test's cells at its draws; the rest pooled into one, as chi_square_against does

    def cells(v):  # the test's cells; those of probability 0 (top-k / top-p) carry no chi-square term
        grouped = torch.cat([v[big], v[~big].sum()[None]])
        return grouped[possible]
    possible = torch.cat([law[big], law[~big].sum()[None]]) > 0
    L = cells(law)
    start = time.time()
    pool = pool_counts(generate, setting, kind, key)
    pool_seconds = time.time() - start
    blocks, total = [], torch.zeros_like(law)
    for counts in pool:
        total += counts
        h = cells(counts) / POOL
        blocks.append(float((((h - L) ** 2 - h * (1 - h) / (POOL - 1)) / L).sum()))  # unbiased chi-square distance
    hat = total / total.sum()
    raw = float(((cells(hat) - L) ** 2 / L).sum())
    m = len(blocks)
    d_mean = float(np.mean(blocks))
    d_low = d_mean - float(student_t.ppf(0.95, m - 1)) * float(np.std(blocks, ddof=1)) / m ** 0.5
    results = {}
    for name, d in [("estimate", d_mean), ("lower95", d_low)]:
        shrink = max(d, 0.0) / raw  # raw includes the pool's noise, ~ (cells - 1) / (m * POOL)
        shrunk = law + min(1.0, shrink) ** 0.5 * (hat - law)
        results[name] = power_of(law_run(shrunk.numpy(), lambda c: pvalue_of_counts(
            torch.tensor(c).view(sampling.VOCAB, sampling.VOCAB, sampling.VOCAB), law.view(
                sampling.VOCAB, sampling.VOCAB, sampling.VOCAB))), draws, SEEDS)
    result = {**results["lower95"], "power_at_estimate": results["estimate"]["power"],
              "chi2_distance_per_draw": d_mean, "chi2_distance_lower95": d_low, "pool_draws": m * POOL,
              "pool_seconds": pool_seconds}
    record(test, defect, "pool", draws, result)
    return result


def pool_counts(generate, setting, kind, key) -> list[torch.Tensor]:
    """POOL_BLOCKS blocks of POOL draws of the wrong sampler: counts [V**3] each. EAGLE_POWER_CACHE=DIR keeps them
    (the power at other draws is then a matter of seconds)."""
    cache = os.environ.get("EAGLE_POWER_CACHE")
    path = os.path.join(cache, f"{key}-{POOL_BLOCKS}x{POOL}.pt") if cache else ""
    if path and os.path.exists(path):
        return torch.load(path, weights_only=True)
    pool = []
    for b in range(POOL_BLOCKS):
        found = []
        sampling.run_chi_square(generate, *sampling.SETTINGS[setting], draws=POOL, seed=20_000 + b, kind=kind,
                                counts_out=found)
        pool.append(found[0][0].flatten().double())
    if path:
        os.makedirs(cache, exist_ok=True)
        torch.save(pool, path)
    return pool


def chi_square_counts_pvalue(counts, law):
    if int(counts[law == 0].sum()):
        return 0.0  # a draw the exact law forbids: the test fails on it
    return sampling.chi_square_against(counts, law)


@pytest.fixture
def wrong_tree_verifier(monkeypatch):
    monkeypatch.setattr(ea_model, "verify_sampling", verify_sampling_unnormalised)


@pytest.mark.usefixtures("wrong_tree_verifier")
def test_power_eagenerate_dynamic():
    result = pooled_power(sampling.eagle_generate("dynamic"), "T1.0", "eagle2", sampling.DYNAMIC_DRAWS,
                          chi_square_counts_pvalue,
                          "test_sampling.py::test_eagenerate_sampling_matches_the_exact_law_4k_draws",
                          "sibling accepted without renormalising p", key="dynamic-eagle2-T1.0")
    assert result["power"] >= POWER


def test_power_eagle3_undraftable_token(monkeypatch):
    head = sampling.sampling_setup("eagle3")[2]
    monkeypatch.setattr(ea_model, "verify_sampling", verify_sampling_within_draft_vocabulary(head.t2d))

    def pvalue(counts, law):
        return 0.0 if int(counts[law == 0].sum()) else sampling.eagle3_pvalue(counts, law, head.outside)
    result = pooled_power(sampling.eagle_generate("dynamic", "eagle3"), "T1.0", "eagle3", 1_000, pvalue,
                          "test_sampling.py::test_eagle3_sampling_is_exact_with_an_undraftable_token_1k_draws",
                          "next token drawn within the draft vocabulary", key="dynamic-eagle3-T1.0-t2d")
    assert result["power"] >= POWER


TREE_DEFECTS = {  # name -> (wrong verify_sampling for a head, what it does)
    "unnormalised": (lambda head: verify_sampling_unnormalised, "sibling accepted without renormalising p"),
    "within-draft-vocabulary": (lambda head: verify_sampling_within_draft_vocabulary(head.t2d),
                                "next token drawn within the draft vocabulary"),
}


@pytest.mark.parametrize("kind,setting,draws,defect", [
    ("eagle2", "T1.0", 2000, "unnormalised"), ("eagle2", "T0.7-top_p0.9-top_k8", 2000, "unnormalised"),
    # an EAGLE-3 tree's later siblings carry little mass here, so an unnormalised sibling barely moves its law
    ("eagle3", "T1.0", 1000, "within-draft-vocabulary")])
def test_power_calibrated_tree(kind, setting, draws, defect, monkeypatch):
    make, what = TREE_DEFECTS[defect]
    monkeypatch.setattr(ea_model, "verify_sampling", make(sampling.sampling_setup(kind)[2]))
    model = calibration.calibrated_generate(kind, *sampling.SETTINGS[setting])
    result = pooled_power(model.eagenerate, setting, kind, draws, chi_square_counts_pvalue,
                          "test_score_calibration.py::test_sampling_with_a_calibrated_tree_matches_the_exact_law"
                          f"[{kind}-{setting}-{draws}]", what, key=f"calibrated-{kind}-{setting}-{defect}")
    assert result["power"] >= POWER


def test_power_probabilistic_chain(monkeypatch):
    monkeypatch.setattr(ea_model, "verify_chain_sampling", verify_chain_resampling_from_p)
    target, _, head = sampling.sampling_setup()
    result = pooled_power(EaModel(target, head, probabilistic.PROBABILISTIC).eagenerate, "T1.0", "eagle2", 2_000,
                          chi_square_counts_pvalue,
                          "test_probabilistic_draft.py::"
                          "test_probabilistic_chain_sampling_matches_the_exact_law_2k_draws",
                          "rejection resampled from p, not the residual", key="probabilistic-eagle2-T1.0")
    assert result["power"] >= POWER


# ----------------------------------------------------------------------------- tests of statistical tools: real draws
def test_power_chi2_homogeneity():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.45, 0.33, 0.17, 0.05])  # 5 points of probability moved
    result = power_of(metrics.homogeneity_run(p, q), metrics.HOMOGENEITY_DRAWS, SEEDS)
    record("test_evaluation_metrics.py::test_chi2_homogeneity", "second sample from a law 0.05 away in TV", "real",
           metrics.HOMOGENEITY_DRAWS, result)
    assert result["power"] >= POWER


def test_power_serve_check_agreement():
    """compare with its Bonferroni over the k positions forgotten (alpha * k per position): its disagreement rate r
    over RATE_REPEATS real repeats, then the rule on Binomial(repeats, r) counts (the repeats are independent), at
    r's estimate and at its lower 95% bound."""
    def forgetful(e, o, k, alpha):
        return serve.compare(e, o, k, alpha * k)
    real = serve.agreement_run([0.8, 0.7, 0.6, 0.5], [0.8, 0.7, 0.6, 0.5], compare=forgetful)
    start = time.time()
    wrong = int(real(RATE_REPEATS, 50_000)[1].split()[0])
    seconds = time.time() - start
    low = binomtest(wrong, RATE_REPEATS).proportion_ci(0.95, method="exact").low
    results = {}
    for name, r in [("estimate", wrong / RATE_REPEATS), ("lower95", low)]:
        def run(repeats, seed, r=r):
            k = int(np.random.default_rng(seed).binomial(repeats, r))
            return serve.binomial_pvalue(k, repeats, serve.FALSE_ALARM_SLACK * 0.01, alternative="greater")
        results[name] = power_of(run, serve.AGREEMENT_REPEATS, SEEDS)
    result = {**results["lower95"], "power_at_estimate": results["estimate"]["power"],
              "disagreement_rate": wrong / RATE_REPEATS, "disagreement_rate_lower95": low,
              "rate_repeats": RATE_REPEATS, "rate_seconds": seconds}
    record("test_serve_engine_logic.py::test_agreement_holds_for_equal_rules_and_fails_for_a_real_gap",
           "compare without its Bonferroni over the k = 4 positions", "law (rate measured)", serve.AGREEMENT_REPEATS,
           result)
    assert result["power"] >= POWER


@torch.no_grad()
def joint_of_three(target, prompt: list[int], temperature: float) -> np.ndarray:
    """[V**3] law of the first three generated tokens at `temperature` (no top-k/top-p), enumerated."""
    ids = torch.tensor([prompt])
    V = target.config.vocab_size
    p1 = (target(ids).logits[0, -1].double() / temperature).softmax(-1)  # [V]
    x = torch.arange(V)[:, None]
    seq2 = torch.cat([ids.expand(V, -1), x], 1)
    p2 = (target(seq2).logits[:, -1].double() / temperature).softmax(-1)  # [V, V]
    seq3 = torch.cat([seq2.repeat_interleave(V, 0), x.repeat(V, 1)], 1)
    p3 = (target(seq3).logits[:, -1].double() / temperature).softmax(-1).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).flatten().numpy()


def test_power_distribution_test():
    """distribution_test (vanilla vs eagle2, positions 1 and 2) against the test's own biased sampler, a speculative
    side at 0.5x the temperature. That test checks the tool's plumbing at 150 samples a side; small sampler defects
    are the law tests' (above). EAGLE-2 sampling is exact at any temperature, so that side's law is the target's at
    0.5x: both laws are enumerated and each seed draws both samples from them, through distribution_test's
    statistic. (Measured too: 0.8x the temperature needs ~2000 samples a side, power 0.89 at 1000.)"""
    target = e2e.tiny_llama(vocab_size=16, init_std=0.2, seed=1)
    prompt, V = [5, 9, 14], 16
    ref, cool = joint_of_three(target, prompt, 1.0), joint_of_three(target, prompt, 0.5)
    assert abs(ref.sum() - 1) < 1e-9 and abs(cool.sum() - 1) < 1e-9

    def run(samples, seed):
        rng = np.random.default_rng(seed)
        a = rng.choice(V ** 3, samples, p=ref / ref.sum())
        b = rng.choice(V ** 3, samples, p=cool / cool.sum())
        return bonferroni(*(metrics.chi2_homogeneity(a // V ** (2 - j) % V, b // V ** (2 - j) % V)[2] for j in (1, 2)))
    result = power_of(run, e2e.DISTRIBUTION_SAMPLES, SEEDS)
    record("test_evaluation_e2e.py::test_chi2_passes_for_eagle2_and_fails_for_a_biased_sampler",
           "speculative side at 0.5x the temperature", "law", e2e.DISTRIBUTION_SAMPLES, result)
    assert result["power"] >= POWER


# ----------------------------------------------------------------------------- the chi-square's own tail
def test_the_chi_square_tail_is_within_the_rules_margin():
    """Size, not power: counts drawn from the EXACT law (eagenerate's T1.0 law, the test's 2000 draws and the rerun's
    8000) through chi_square_against; the rule's budget allows the two stages' true false-alarm rates a product up
    to APPROXIMATION_MARGIN x ALPHA_FIRST x ALPHA_RERUN."""
    from statistical_rule import ALPHA_FIRST, ALPHA_RERUN, APPROXIMATION_MARGIN
    target, prompt, _ = sampling.sampling_setup("eagle2")
    law = sampling.exact_joint(target, prompt, 1.0, 0.0, 0)
    probs = (law.flatten() / law.sum()).numpy()
    sims = int(os.environ.get("EAGLE_SIZE_SIMULATIONS", "20000"))
    rates = {}
    for draws, alpha in [(2000, ALPHA_FIRST), (8000, ALPHA_RERUN)]:
        rng = np.random.default_rng(123)
        ps = np.array([sampling.chi_square_against(torch.from_numpy(rng.multinomial(draws, probs)).view_as(law), law)[0]
                       for _ in range(sims)])
        rates[draws] = float((ps < alpha).mean())
        record(f"chi_square_against at {draws} draws (exact law)", f"size at alpha {alpha:.1e}", "size", draws,
               {"simulations": sims, "rate": rates[draws], "ratio_to_alpha": rates[draws] / alpha})
    assert rates[2000] * rates[8000] <= APPROXIMATION_MARGIN * ALPHA_FIRST * ALPHA_RERUN
