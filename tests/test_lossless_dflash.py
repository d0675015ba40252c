"""DFlash decoding is lossless: greedy output token-identical to transformers' greedy `generate` for chains of
block_size - 1, static trees and dynamic trees (raw and calibrated scores) built from one block's per-position
distributions, with a random head (mostly rejected) and one fitted on the target's greedy continuations (long
accepted paths); every round costs exactly one draft forward. Sampled output follows the exact law (chi-square over
the first three tokens, tests/test_sampling.py's harness; slow)."""
from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from eagle import DecodingConfig, EaModel
from eagle.head_config import head_config_from_target
from eagle.head_kinds import DFLASH
from eagle.score_calibration import ScoreCalibration, pick_calibration
from evaluation.autotune import covered_tree, fit_tree_calibration, grid
from evaluation.runner import GenerationArgs
from statistical_rule import assert_same_law
from test_sampling import NEW, SETTINGS, VOCAB, chi_square_against, exact_joint
from tiny_models import first_divergence_report, hf_greedy, random_prompts, single_thread, tiny_target  # noqa: F401
from train.block_loss import block_loss
from train.losses import TokenLoss

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.numeric]
LAYERS, BLOCK, NEW_TOKENS = [1, 2, 3], 6, 30
DECODINGS = {
    "chain5": DecodingConfig(mode="chain", chain_length=5),
    "chain2": DecodingConfig(mode="chain", chain_length=2),
    "dyn16-3-4": DecodingConfig(mode="dynamic", total_token=16, depth=3, top_k=4),
    "dyn24-4-3": DecodingConfig(mode="dynamic", total_token=24, depth=4, top_k=3),
    "static-2x2": DecodingConfig(mode="static", static_choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0]]),
}


def new_head(target, seed: int):
    torch.manual_seed(seed)
    c = head_config_from_target(target.config, kind=DFLASH.name, block_size=BLOCK, draft_layers=2,
                                target_layers=LAYERS, mask_token_id=3)
    return DFLASH.module(c).bind_target(target)


def fit_head(target, sequences: list[torch.Tensor], steps: int = 150, seed: int = 0):
    """A DFlash head fitted on `sequences` [1, T] (the target's own continuations) with the training loss at every
    anchor: a draft the target mostly accepts."""
    head = new_head(target, seed).train()
    T = max(s.shape[1] for s in sequences)
    ids = torch.stack([torch.nn.functional.pad(s[0], (0, T - s.shape[1])) for s in sequences])
    mask = torch.stack([(torch.arange(T) < s.shape[1]).long() for s in sequences])
    with torch.no_grad():
        hs = target(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    feats, final = torch.cat([hs[i] for i in LAYERS], -1), hs[-1]
    batch = SimpleNamespace(attention_mask=mask, loss_mask=mask)
    anchors = torch.arange(1, T - 1).expand(len(sequences), -1)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        out = head(feats, ids, mask, anchors)
        loss = block_loss(out, final, batch, anchors, target.lm_head.weight, TokenLoss(), [1.0] * (BLOCK - 1)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


@functools.lru_cache(maxsize=None)
def setup():
    target = tiny_target("llama", num_layers=4, seed=2)
    prompts = random_prompts(8, seed=1)
    refs = [hf_greedy(target, p, NEW_TOKENS) for p in prompts]
    return target, prompts, refs, new_head(target, 1).eval(), fit_head(target, refs)


@pytest.mark.parametrize("head_kind", ["random", "good"])
@pytest.mark.parametrize("decoding_name", list(DECODINGS))
def test_greedy_matches_transformers_generate(decoding_name, head_kind):
    target, prompts, refs, random_head, good_head = setup()
    decoding = DECODINGS[decoding_name]
    model = EaModel(target, random_head if head_kind == "random" else good_head, decoding)
    rounds, new, longest = 0, 0, 0
    for i, (prompt, ref) in enumerate(zip(prompts, refs)):
        out, stats = model.eagenerate(prompt, max_new_tokens=NEW_TOKENS, return_stats=True)
        assert torch.equal(ref, out), f"{decoding_name}/{head_kind} prompt {i}: {first_divergence_report(target, ref, out)}"
        rounds += len(stats.rounds)
        new += sum(r.new_tokens for r in stats.rounds)
        longest = max([longest] + [r.accept_length for r in stats.rounds])
    assert model.drafter.forwards == rounds  # one block forward per round, whatever the tree
    depth = decoding.chain_length if decoding.mode == "chain" else (
        decoding.depth + 1 if decoding.mode == "dynamic" else 3)
    assert longest <= depth
    if head_kind == "good":  # the fitted head is really accepted: full-depth paths, tau well above a random head's
        assert longest >= min(depth, 2) and new / rounds > min(2.0, 0.6 * (depth + 1)), f"tau={new / rounds:.2f}, longest {longest}"
    else:
        assert new / rounds < 2.0


def test_calibrated_dynamic_tree_is_lossless():
    target, prompts, refs, _, good_head = setup()
    """A tree-score map (greedy) that favours deep rank-0 paths changes which nodes the block's tree keeps, never the
    output."""
    target, prompts, refs, _, good_head = setup()
    xs = [[[0.0, 1.0] for _ in range(4)] for _ in range(5)]
    ys = [[[0.0, 0.95 - 0.25 * r - 0.02 * d] for r in range(4)] for d in range(5)]
    model = EaModel(target, good_head, DecodingConfig(mode="dynamic", total_token=12, depth=4, top_k=3))
    model.calibrations = [ScoreCalibration(0.0, 1.0, 0, knots_x=xs, knots_y=ys)]
    plain = EaModel(target, good_head, DecodingConfig(mode="dynamic", total_token=12, depth=4, top_k=3))
    for prompt, ref in zip(prompts[:4], refs[:4]):
        out, stats = model.eagenerate(prompt, max_new_tokens=NEW_TOKENS, return_stats=True)
        assert torch.equal(ref, out)
        assert torch.equal(ref, plain.eagenerate(prompt, max_new_tokens=NEW_TOKENS))
        assert model.drafter.forwards > 0
    assert pick_calibration(model.calibrations, 0.0, 1.0, 0) is not None  # greedy decoding ranks by the map


def test_autotune_fits_the_map_over_the_whole_block_and_its_grid_stops_at_the_block():
    """`autotune`'s calibration for a DFlash head (evaluation/main.py calibrate_tree -> fit_tree_calibration): the
    coverage tree reaches the block's last position (block_size - 1), never past it (that has no distribution), every
    (depth, rank) cell gets nodes, the grid skips trees deeper than the block with the reason, and the calibrated
    tree decodes losslessly. The autoregressive kinds' coverage is unchanged (draft_positions None)."""
    target, prompts, refs, _, good_head = setup()
    model = EaModel(target, good_head, DecodingConfig(mode="dynamic", total_token=16, depth=3, top_k=4))
    assert model.draft_positions == BLOCK - 1
    cover = covered_tree(model.decoding, [3, 4, 5, 6, 7], [2, 4], model.draft_positions)
    assert cover == (BLOCK - 1, 4) and covered_tree(model.decoding, [3, 7], [2, 4], None) == (8, 4)
    configs, skipped = grid([10, 16], [3, 4, 5], [2, 4], model.decoding, model.draft_positions)
    block = [x for x in skipped if "draft positions" in x["reason"]]
    assert {c.depth for c in configs} == {3, 4} and len(block) == 4 and {x["depth"] for x in block} == {5}
    assert all(x["reason"] == f"depth 5 expands 6 draft positions; the head drafts {BLOCK - 1}" for x in block)
    gen = GenerationArgs(max_new_tokens=NEW_TOKENS, max_length=256)
    cal = fit_tree_calibration(model, [p[0].tolist() for p in prompts[:6]], model.decoding, gen, passes=2,
                               cover=cover, progress=False)
    cells = cal.fitted_on["coverage"]["nodes"]  # [depth][rank] nodes whose parent was accepted
    assert len(cells) == BLOCK - 1 and all(len(row) == 4 for row in cells) and cells[-1][0] > 0
    assert model.calibrations == [cal]
    for prompt, ref in zip(prompts[6:], refs[6:]):
        out, stats = model.eagenerate(prompt, max_new_tokens=NEW_TOKENS, return_stats=True)
        assert torch.equal(ref, out) and all(r.node_score is not None for r in stats.rounds)
    with pytest.raises(ValueError, match=f"drafts head.block_size - 1 = {BLOCK - 1}"):  # what the bound keeps away
        fit_tree_calibration(model, [prompts[0][0].tolist()], model.decoding, gen, passes=1, cover=(BLOCK, 4),
                             progress=False)


def test_a_tree_deeper_than_the_block_is_refused_in_one_line():
    target, prompts, _, head, _ = setup()
    model = EaModel(target, head, DecodingConfig(mode="chain", chain_length=BLOCK))
    with pytest.raises(ValueError, match=f"drafts head.block_size - 1 = {BLOCK - 1}") as e:
        model.eagenerate(prompts[0], max_new_tokens=4)
    assert "\n" not in str(e.value)


@functools.lru_cache(maxsize=None)
def sampling_target():
    """tests/test_sampling.py's peaked 4-layer target and prompt, with a DFlash head fitted on its continuations."""
    target = tiny_target("llama", vocab_size=VOCAB, init_std=0.3, seed=5, num_layers=4)
    prompts = random_prompts(6, vocab_size=VOCAB, min_len=4, max_len=8, seed=3)
    return target, prompts[0], fit_head(target, [hf_greedy(target, p, 8) for p in prompts], steps=120)


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.parametrize("mode", ["chain", "probabilistic", "dynamic"])
def test_sampled_output_follows_the_exact_law(mode):
    target, prompt, head = sampling_target()
    decoding = {"chain": DecodingConfig(mode="chain", chain_length=3),
                "probabilistic": DecodingConfig(mode="chain", chain_length=3, draft_sampling="probabilistic"),
                "dynamic": DecodingConfig(mode="dynamic", total_token=12, depth=3, top_k=3)}[mode]
    generate = EaModel(target, head, decoding).eagenerate
    temperature, top_p, top_k = SETTINGS["T1.0"]
    law = exact_joint(target, prompt, temperature, top_p, top_k)

    def run(draws, seed):
        counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.long)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(draws):
            out = generate(prompt, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=NEW,
                           generator=gen)
            a, b, c = out[0, prompt.shape[1]:].tolist()
            counts[a, b, c] += 1
        pvalue, bins = chi_square_against(counts, law)
        return pvalue, f"{bins} bins"

    assert_same_law(run, draws=2_000, seed=21, what=f"DFlash {mode} T1.0")
