"""Draft-tree construction on hand-written scores: rerank_tree, DraftTree geometry, static trees."""
from __future__ import annotations

import math

import pytest
import torch

from eagle.static_trees import MC_SIM_7B_63, static_choices
from eagle.tree import DraftTree, StaticTreeSpec, chain_choices, rerank_tree
from float_tolerance import assert_same_function

pytestmark = pytest.mark.numeric  # float comparisons: tests/float_variants.py runs them under every variant

# Hand-written candidates, generated level by level as EAGLE-2 drafting does (parents first).
#        idx: token, prob given parent, parent idx   -> path value (product of probs)
CANDS = [
    (10, 0.60, -1),  # 0  .600
    (11, 0.30, -1),  # 1  .300
    (12, 0.90, 0),  # 2  .540
    (13, 0.05, 0),  # 3  .030
    (14, 0.50, 1),  # 4  .150
    (15, 0.40, 1),  # 5  .120
    (16, 0.80, 2),  # 6  .432
    (17, 0.10, 2),  # 7  .054
    (18, 0.50, 4),  # 8  .075
    (19, 0.50, 5),  # 9  .060
]
ROOT = 7


def candidate_tensors(cands=CANDS):
    tokens = torch.tensor([c[0] for c in cands])
    logprob = torch.tensor([math.log(c[1]) for c in cands])
    parent = torch.tensor([c[2] for c in cands])
    path = torch.zeros(len(cands))
    for i, (_, _, par) in enumerate(cands):
        path[i] = logprob[i] + (path[par] if par >= 0 else 0.0)
    return tokens, logprob, path, parent


def candidate_depth(parent: torch.Tensor) -> torch.Tensor:
    """Depth of each candidate from its parent pointer (parents listed first; -1 = root)."""
    depth: list[int] = []
    for p in parent.tolist():
        depth.append(1 if p < 0 else depth[p] + 1)
    return torch.tensor(depth)


def build(total_token, cands=CANDS):
    tokens, logprob, path, parent = candidate_tensors(cands)
    return rerank_tree(ROOT, tokens, logprob, path, parent, candidate_depth(parent), total_token)


def parent_token_map(tree: DraftTree) -> dict[int, int | None]:
    toks = tree.tokens.tolist()
    return {toks[i]: (None if p < 0 else toks[p]) for i, p in enumerate(tree.parents.tolist())}


def expected_ancestors(tree: DraftTree) -> torch.Tensor:
    """Reference mask from the parent pointers, one node at a time (no vectorisation)."""
    n = tree.size
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = int(tree.parents[j])
    return mask


def check_tree_invariants(tree: DraftTree):
    n = tree.size
    parents = tree.parents.tolist()
    assert parents[0] == -1 and int(tree.depth[0]) == 0
    assert all(0 <= parents[i] < i for i in range(1, n)), f"parents must precede children: {parents}"
    for i in range(1, n):
        assert int(tree.depth[i]) == int(tree.depth[parents[i]]) + 1
        expect = float(tree.path_logprob[parents[i]]) + math.log(float(tree.prob[i]))
        # float32 sums of depth-many log-probs (all <= 0, so their |sum| is the sum of |terms|) vs float64 here
        assert_same_function(float(tree.path_logprob[i]), expect, terms=int(tree.depth[i]) + 1,
                             magnitude=abs(expect) + 1, dtype=torch.float32)
    assert float(tree.prob[0]) == 1.0 and float(tree.path_logprob[0]) == 0.0
    assert torch.equal(tree.attention_mask(), expected_ancestors(tree))


def test_rerank_keeps_the_highest_path_values_as_a_connected_tree():
    tree = build(total_token=6)
    assert tree.size == 6
    check_tree_invariants(tree)
    # top-5 values: .600 (10), .540 (12), .432 (16), .300 (11), .150 (14)
    assert parent_token_map(tree) == {ROOT: None, 10: ROOT, 11: ROOT, 12: 10, 16: 12, 14: 11}
    depth_of = dict(zip(tree.tokens.tolist(), tree.depth.tolist()))
    assert depth_of == {ROOT: 0, 10: 1, 11: 1, 12: 2, 14: 2, 16: 3}
    prob_of = dict(zip(tree.tokens.tolist(), tree.prob.tolist()))
    assert prob_of[12] == pytest.approx(0.9) and prob_of[16] == pytest.approx(0.8)
    value_of = dict(zip(tree.tokens.tolist(), tree.path_logprob.exp().tolist()))
    assert value_of[16] == pytest.approx(0.6 * 0.9 * 0.8) and value_of[14] == pytest.approx(0.3 * 0.5)


def test_rerank_mask_position_ids_and_retrieval_paths():
    tree = build(total_token=6)
    idx = {t: i for i, t in enumerate(tree.tokens.tolist())}
    mask = tree.attention_mask()
    assert mask.dtype == torch.bool and mask.shape == (6, 6)
    # node 16 sees root, 10, 12 and itself, and nothing on the 11 branch
    assert mask[idx[16]].nonzero().flatten().tolist() == sorted([idx[ROOT], idx[10], idx[12], idx[16]])
    assert mask[idx[14]].nonzero().flatten().tolist() == sorted([idx[ROOT], idx[11], idx[14]])
    assert mask[idx[ROOT]].nonzero().flatten().tolist() == [idx[ROOT]]
    assert tree.position_ids(37).tolist() == [37 + d for d in tree.depth.tolist()]
    paths = tree.retrieve_paths()
    assert paths.dtype == torch.long and paths.shape == (2, 4)  # one row per leaf, max_depth + 1 columns
    rows = {tuple(r) for r in paths.tolist()}
    assert rows == {(idx[ROOT], idx[10], idx[12], idx[16]), (idx[ROOT], idx[11], idx[14], -1)}


@pytest.mark.parametrize("total_token", range(2, 12))
def test_rerank_has_exactly_total_token_nodes(total_token):
    tree = build(total_token)
    assert tree.size == total_token
    check_tree_invariants(tree)
    tokens, logprob, path, parent = candidate_tensors()
    best = sorted(range(len(CANDS)), key=lambda i: (-float(path[i]), i))[: total_token - 1]
    assert sorted(tree.tokens.tolist()[1:]) == sorted(CANDS[i][0] for i in best)
    leaves = tree.retrieve_paths()
    n_leaves = sum(1 for i in range(tree.size) if i not in set(tree.parents.tolist()))
    assert leaves.shape == (n_leaves, int(tree.depth.max()) + 1)
    for row in leaves.tolist():  # every row is a real root->leaf chain
        nodes = [x for x in row if x >= 0]
        assert nodes[0] == 0 and row[len(nodes):] == [-1] * (len(row) - len(nodes))
        assert all(int(tree.parents[b]) == a for a, b in zip(nodes, nodes[1:]))


def test_rerank_ties_go_to_the_lower_candidate_index():
    # candidates 4 and 5 both have value .15; only one fits: the lower index (4, token 14) wins
    cands = list(CANDS)
    cands[5] = (15, 0.50, 1)
    tree = build(6, cands)
    assert 14 in tree.tokens.tolist() and 15 not in tree.tokens.tolist()
    # reversing which one is listed first flips the winner
    cands[4], cands[5] = (15, 0.50, 1), (14, 0.50, 1)
    cands[8], cands[9] = (18, 0.50, 5), (19, 0.50, 4)
    tree = build(6, cands)
    assert 15 in tree.tokens.tolist() and 14 not in tree.tokens.tolist()


def test_rerank_parent_child_tie_keeps_the_parent():
    # child with probability 1 has exactly its parent's value; cutting between them must keep the parent
    cands = [(10, 0.6, -1), (11, 0.3, -1), (12, 1.0, 1), (13, 0.2, 0)]
    tree = build(3, cands)  # keep 2 of {.6, .3, .3, .12}
    assert parent_token_map(tree) == {ROOT: None, 10: ROOT, 11: ROOT}
    tree = build(4, cands)
    assert parent_token_map(tree) == {ROOT: None, 10: ROOT, 11: ROOT, 12: 11}
    check_tree_invariants(tree)


def _random_candidates(seed: int, k: int, depth: int, vocab: int = 50):
    """Candidates as EAGLE-2 drafting makes them: top-k at the root, then depth levels of top-k of the
    k best frontier nodes."""
    g = torch.Generator().manual_seed(seed)
    lp, tok = torch.randn(vocab, generator=g).mul(2).log_softmax(-1).topk(k)
    cand_tok, cand_lp, cand_path, cand_parent = [tok], [lp], [lp.clone()], [torch.full((k,), -1)]
    front_path, front_cand, n = lp, torch.arange(k), k
    for _ in range(depth):
        lp, tok = torch.randn(k, vocab, generator=g).mul(2).log_softmax(-1).topk(k, dim=-1)  # [k, k]
        path = front_path[:, None] + lp
        cand_tok.append(tok.flatten())
        cand_lp.append(lp.flatten())
        cand_path.append(path.flatten())
        cand_parent.append(front_cand.repeat_interleave(k))
        best = path.flatten().topk(k).indices
        front_path, front_cand = path.flatten()[best], n + best
        n += k * k
    return [torch.cat(x) for x in (cand_tok, cand_lp, cand_path, cand_parent)]


@pytest.mark.parametrize("seed,k,depth,total_token", [(0, 10, 5, 60), (1, 4, 6, 30), (2, 3, 2, 16), (3, 10, 5, 2),
                                                      (4, 8, 4, 80), (5, 1, 5, 6)])
def test_rerank_on_drafting_shaped_candidates(seed, k, depth, total_token):
    tokens, logprob, path, parent = _random_candidates(seed, k, depth)
    tree = rerank_tree(3, tokens, logprob, path, parent, candidate_depth(parent), total_token)
    assert tree.size == total_token
    check_tree_invariants(tree)
    kept_values = sorted(tree.path_logprob[1:].tolist(), reverse=True)
    assert kept_values == pytest.approx(sorted(path.tolist(), reverse=True)[: total_token - 1])
    # siblings carry distinct tokens (verification relies on it)
    for kids in tree.children():
        toks = [int(tree.tokens[c]) for c in kids]
        assert len(toks) == len(set(toks))


def test_attention_mask_on_a_hand_written_tree():
    #     0
    #    / \
    #   1   2
    #  / \   \
    # 3   4   5
    #     |
    #     6
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 4])
    tree = DraftTree(tokens=torch.arange(7), parents=parents, depth=torch.tensor([0, 1, 1, 2, 2, 2, 3]),
                     prob=torch.ones(7), path_logprob=torch.zeros(7))
    expect = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 1, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.attention_mask(), expect)
    assert tree.position_ids(5).tolist() == [5, 6, 6, 7, 7, 7, 8]
    assert {tuple(r) for r in tree.retrieve_paths().tolist()} == {(0, 1, 3, -1), (0, 1, 4, 6), (0, 2, 5, -1)}
    assert tree.children() == [[1, 2], [3, 4], [5], [], [6], [], []]


def test_root_only_tree():
    tree = DraftTree(tokens=torch.tensor([4]), parents=torch.tensor([-1]), depth=torch.tensor([0]),
                     prob=torch.ones(1), path_logprob=torch.zeros(1))
    assert tree.attention_mask().tolist() == [[True]]
    assert tree.retrieve_paths().tolist() == [[0]]


# ----------------------------------------------------------------------------- EAGLE-1 static trees
def test_mc_sim_7b_63_matches_the_published_tree():
    assert static_choices("mc_sim_7b_63") == MC_SIM_7B_63
    assert len(MC_SIM_7B_63) == 25
    per_depth = [sum(1 for c in MC_SIM_7B_63 if len(c) == d) for d in range(1, 6)]
    assert per_depth == [4, 8, 8, 3, 2]
    assert MC_SIM_7B_63[:4] == [[0], [1], [2], [3]]
    assert [1, 0, 0] in MC_SIM_7B_63 and [0, 0, 0, 0, 1] in MC_SIM_7B_63


def test_static_tree_spec_from_mc_sim_7b_63():
    spec = StaticTreeSpec.from_choices(MC_SIM_7B_63)
    assert spec.size == 26 and spec.max_depth == 5 and spec.max_rank == 3
    parents = spec.parents.tolist()
    assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, 26))
    # node i+1 <-> choices[i] (sorted by depth then lexicographically); its parent is the prefix path
    index = {(): 0}
    for i, c in enumerate(spec.choices, start=1):
        index[c] = i
    for c, i in list(index.items())[1:]:
        assert parents[i] == index[c[:-1]], c
        assert int(spec.ranks[i]) == c[-1] and int(spec.depth[i]) == len(c)
    tree = DraftTree(tokens=torch.zeros(26, dtype=torch.long), parents=spec.parents, depth=spec.depth,
                     prob=torch.ones(26), path_logprob=torch.zeros(26))
    assert torch.equal(spec.ancestors, expected_ancestors(tree))
    assert tree.retrieve_paths().shape[0] == sum(1 for c in MC_SIM_7B_63 if not any(
        len(o) == len(c) + 1 and o[:-1] == c for o in MC_SIM_7B_63))


def test_chain_is_a_static_tree():
    spec = StaticTreeSpec.from_choices(chain_choices(4))
    assert spec.size == 5
    assert spec.parents.tolist() == [-1, 0, 1, 2, 3]
    assert spec.ranks.tolist() == [0, 0, 0, 0, 0]


@pytest.mark.parametrize("choices,match", [([], "at least one"), ([[0, 1]], "parent"), ([[-1]], "negative")])
def test_static_tree_rejects_bad_choice_lists(choices, match):
    with pytest.raises(ValueError, match=match):
        StaticTreeSpec.from_choices(choices)


def test_unknown_static_tree_name_is_a_clear_error():
    with pytest.raises(ValueError, match="mc_sim_7b_64"):
        static_choices("mc_sim_7b_64")


@pytest.mark.parametrize("total_token,depth,top_k", [(60, 5, 10), (20, 5, 4), (8, 3, 3), (2, 1, 1), (40, 2, 6)])
def test_drafter_dynamic_trees_are_reranked_drafts(total_token, depth, top_k):
    """draft_dynamic on a real (random) head: a valid tree of the highest-value candidates, each node's
    probability the head's own, and the draft KV cache rolled back to the committed prefix."""
    from eagle.draft import Drafter
    from tiny_models import random_head, tiny_target

    target = tiny_target("llama")
    head = random_head(target)
    drafter = Drafter(head, target.get_output_embeddings(), capacity=64)
    drafter.reset(64)
    gen = torch.Generator().manual_seed(0)
    feats, ids = torch.randn(1, 7, 64, generator=gen), torch.randint(0, 256, (1, 7), generator=gen)
    feature = drafter.extend(feats, ids)
    tree = drafter.draft_dynamic(ids[0, -1:], feature, total_token, depth, top_k)
    assert drafter.length == 7
    assert tree.size == min(total_token, 1 + top_k + depth * top_k * top_k)
    check_tree_invariants(tree)
    assert int(tree.depth.max()) <= depth + 1
    # depth-1 nodes: the head's top-k after the committed prefix, with its probabilities
    top = torch.log_softmax(target.get_output_embeddings()(feature), -1)[0].topk(top_k)
    level1 = (tree.depth == 1).nonzero().flatten()
    assert set(tree.tokens[level1].tolist()) <= set(top.indices.tolist())
    for node in level1.tolist():
        j = top.indices.tolist().index(int(tree.tokens[node]))
        # the tree's softmax vs exp(log_softmax) over the vocabulary: relative error ~ u (|log p| + 1)
        want = float(top.values[j].exp())
        assert_same_function(float(tree.prob[node]), want, terms=256, chained=2, dtype=torch.float32,
                             magnitude=want * (abs(math.log(want)) + 1))
