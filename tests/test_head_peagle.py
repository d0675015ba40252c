"""The P-EAGLE head (eagle/peagle.py) and its drafter (eagle/parallel_draft.py): config, the parallel unroll (== the
decoding forward over committed + mask rows), files, and trees built from one forward's per-position distributions."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from eagle.head import HeadConfig, HeadConfigError, load_head
from eagle.eagle3 import Eagle3Head
from eagle.parallel_draft import ParallelDrafter
from eagle.peagle import PeagleHead
from eagle.static_trees import MC_SIM_7B_63
from eagle.tree import StaticTreeSpec
from float_tolerance import LAYER_REDUCTIONS, assert_same_function
from tiny_models import enlarge_weights, single_thread, tiny_target  # noqa: F401

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.numeric]
AUX = [1, 2, 3]
STEP_REDUCTIONS, STEP_TERMS = 1 + LAYER_REDUCTIONS, 3 * 64  # as tests/test_head_eagle3.py: fc's 3H terms


def pe_head(target, seed: int = 0, std: float = 0.2, mask_token_id: int = 5) -> PeagleHead:
    """A random P-EAGLE head with weights large enough that every position's output differs visibly."""
    torch.manual_seed(seed)
    head = PeagleHead.from_target(target, aux_layers=AUX)
    head.kind.with_mask_token(head.config, mask_token_id)
    return enlarge_weights(head, std)


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", num_layers=4, seed=2)
    head = pe_head(target)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return target, head, ids, torch.cat([out.hidden_states[i] for i in AUX], dim=-1)


# ----------------------------------------------------------------------------- config
def test_config_round_trip_names_the_kind_and_its_mask_token(setup):
    _, head, _, _ = setup
    d = head.config.to_dict()
    assert d["architectures"] == ["PeagleLlamaForCausalLM"] and d["mask_token_id"] == 5
    assert d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX and "draft_vocab_size" in d
    back = HeadConfig.from_dict(json.loads(json.dumps(d)))
    assert back.kind == "peagle" and back.options.mask_token_id == 5 and back.to_dict() == d


@pytest.mark.parametrize("value,match", [(None, "mask_token_id=None"), (256, "mask_token_id=256"),
                                         (-1, "mask_token_id=-1"), (True, "mask_token_id=True")])
def test_a_bad_or_missing_mask_token_is_a_one_line_error(setup, value, match):
    d = setup[1].config.to_dict()
    d.pop("mask_token_id") if value is None else d.update(mask_token_id=value)
    with pytest.raises(HeadConfigError, match=match) as e:
        HeadConfig.from_dict(d)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- unroll == decoding
def test_unroll_position_j_is_the_decoding_forwards_mask_row(setup):
    """Step j at index t == output row j-1 of ONE decoding forward over committed 0..t and j-1 mask rows."""
    target, head, ids, aux = setup
    k = 5
    with torch.no_grad():  # float32, as tests/test_head_eagle3.py's decode-path test: the decoder's tables are float32
        hs = head.unroll(aux, ids, steps=k)
        rows = torch.tensor([2, 5, 9])
        sub = head.unroll(aux, ids, steps=k, rows=rows)
        drafter = ParallelDrafter(head, None, 64)
        drafter.reset(64)
        for b in range(2):
            for t in (0, 5, 11):
                drafter.decoder.truncate(0)
                drafter.extend(aux[b : b + 1, : t + 1], ids[b : b + 1, : t + 1])
                out = drafter.outputs(k)  # [k, H]
                assert drafter.decoder.length == t + 1  # the mask rows are rolled back
                for j in range(k):
                    assert_same_function(out[j], hs[j][b, t], terms=STEP_TERMS, chained=2 * STEP_REDUCTIONS,
                                         magnitude=float(hs[j].abs().max()), msg=f"b={b} t={t} position {j + 1}")
                    if t in rows.tolist() and j:
                        assert_same_function(sub[j][b, rows.tolist().index(t)], hs[j][b, t], terms=STEP_TERMS,
                                             chained=2 * STEP_REDUCTIONS, magnitude=float(hs[j].abs().max()))


def test_positions_read_the_mask_not_the_previous_output(setup):
    """The same weights unrolled as EAGLE-3 (self-fed) differ from 2 on; position j does not depend on the tokens
    after t (it reads the mask), while EAGLE-3's step j does."""
    target, head, ids, aux = setup
    e3 = Eagle3Head(HeadConfig.from_dict({k: v for k, v in head.config.to_dict().items()
                                          if k not in ("mask_token_id", "architectures")}))
    e3.load_state_dict({k: v for k, v in head.state_dict().items() if k != "mask_hidden"})
    e3.eval()
    ids2 = ids.clone()
    ids2[:, 6:] = (ids2[:, 6:] + 1) % 256
    with torch.no_grad():
        p, p2 = head.unroll(aux, ids, steps=3), head.unroll(aux, ids2, steps=3)
        s = e3.unroll(aux, ids, steps=3)
    assert torch.equal(p[0], s[0]) and (p[1] - s[1]).abs().max() > 1e-2
    assert torch.equal(p[2][:, :5], p2[2][:, :5])  # index t <= 4 never reads a token after position 5


def test_unroll_backward_reaches_mask_hidden(setup):
    target, head, ids, aux = setup
    head = copy.deepcopy(head).train()
    sum(h.sum() for h in head.unroll(aux, ids, steps=3)[1:]).backward()
    assert head.mask_hidden.grad is not None and head.mask_hidden.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- files
def test_save_and_load_round_trip(tmp_path, setup):
    target, head, _, _ = setup
    head.save_pretrained(tmp_path / "h")
    back = load_head(tmp_path / "h").bind_target(target)
    assert type(back) is PeagleHead and back.mask_token_id == 5
    assert torch.equal(back.mask_hidden, head.mask_hidden)
    from safetensors.torch import load_file
    assert "mask_hidden" in load_file(tmp_path / "h" / "model.safetensors")


# ----------------------------------------------------------------------------- drafting from one forward
def drafter_after(head, aux, ids, t: int) -> ParallelDrafter:
    d = ParallelDrafter(head, None, 64)
    d.reset(64)
    d.extend(aux[:1, : t + 1], ids[:1, : t + 1])
    return d


def test_chain_and_static_tree_take_each_positions_ranked_tokens(setup):
    target, head, ids, aux = setup
    with torch.no_grad():
        hs = head.unroll(aux, ids, steps=5)
        want = torch.stack([head.map_to_target(head.draft_logits(h[0, 7]).argmax()) for h in hs])  # [5]
        chain = drafter_after(head, aux, ids, 7).draft_static(ids[0, 8:9], None, StaticTreeSpec.from_choices(
            [[0] * d for d in range(1, 6)]))
        assert torch.equal(chain.tokens[1:], want) and chain.tokens[0] == ids[0, 8]
        spec = StaticTreeSpec.from_choices(MC_SIM_7B_63)
        d = drafter_after(head, aux, ids, 7)
        tree = d.draft_static(ids[0, 8:9], None, spec)
        assert d.forwards == 1 and d.decoder.length == 8
        ranked = [head.map_to_target(head.draft_logits(h[0, 7]).topk(spec.max_rank + 1).indices) for h in hs]
        for i in range(1, spec.size):
            assert tree.tokens[i] == ranked[int(spec.depth[i]) - 1][int(spec.ranks[i])]
        assert torch.allclose(tree.path_logprob[1:], tree.prob[1:].log() + torch.where(
            spec.parents[1:] > 0, tree.path_logprob[spec.parents[1:].clamp(min=0)], 0.0), atol=1e-5)


def test_dynamic_tree_from_one_forward(setup):
    """Every node at depth d is one of position d's top_k tokens; the tree is reranked to total_token nodes; one head
    forward drafts it and the cache keeps only the committed positions."""
    target, head, ids, aux = setup
    depth, k, total = 4, 3, 20
    with torch.no_grad():
        hs = head.unroll(aux, ids, steps=depth + 1)
        top = [set(head.map_to_target(head.draft_logits(h[0, 9]).topk(k).indices).tolist()) for h in hs]
        d = drafter_after(head, aux, ids, 9)
        tree = d.draft_dynamic(ids[0, 10:11], None, total, depth, k)
    assert d.forwards == 1 and d.decoder.length == 10 and tree.size == total
    assert all(int(tree.tokens[i]) in top[int(tree.depth[i]) - 1] for i in range(1, tree.size))
    assert int(tree.depth.max()) >= 3  # the best paths go deep: not a one-level tree
    parents = tree.parents[1:]
    assert bool((tree.depth[1:] == tree.depth[parents.clamp(min=0)] + 1).all())


def test_drafting_before_extend_is_refused(setup):
    d = ParallelDrafter(setup[1], None, 64)
    d.reset(64)
    with pytest.raises(RuntimeError, match="extend"):
        d.outputs(3)
