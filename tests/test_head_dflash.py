"""The DFlash head (eagle/dflash_head.py), its kind (eagle/head_kinds.py DFlashKind) and its drafter
(eagle/block_draft.py): config round trip and one-line refusals, the training forward (all anchors in one call) ==
the decoding forward (context cache + one block), the block's mask (context before the anchor only, bidirectional or
causal inside), files, and drafts built from one block."""
from __future__ import annotations

import json

import pytest
import torch

from eagle.block_draft import BlockDrafter
from eagle.dflash_head import DFlashHead
from eagle.head_config import HeadConfig, head_config_from_target
from eagle.head_files import load_head
from eagle.head_kinds import DFLASH, HeadConfigError, default_target_layers, kind_of_config
from eagle.tree import StaticTreeSpec
from recipes import RecipeError, load_config
from tiny_models import enlarge_weights, single_thread, tiny_target  # noqa: F401

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.numeric]
LAYERS = [1, 2, 3]


def df_head(target, seed: int = 0, causal: bool = False, block_size: int = 4, std: float = 0.2) -> DFlashHead:
    torch.manual_seed(seed)
    c = head_config_from_target(target.config, kind=DFLASH.name, block_size=block_size, draft_layers=2,
                                target_layers=LAYERS, mask_token_id=5, causal=causal)
    return enlarge_weights(DFLASH.module(c).bind_target(target), std)


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", num_layers=4, seed=2)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    return target, df_head(target), ids, torch.cat([hs[i] for i in LAYERS], -1)


def test_config_round_trip_keeps_the_kinds_keys_apart(setup):
    _, head, _, _ = setup
    d = head.config.to_dict()
    assert d["architectures"] == ["DFlashDraftModel"] and "num_hidden_layers" not in d and "mask_token_id" not in d
    assert d["dflash"] == {"block_size": 4, "draft_layers": 2, "target_layers": LAYERS, "mask_token_id": 5,
                           "causal": False, "tie_k_norm": False}
    back = HeadConfig.from_dict(json.loads(json.dumps(d)))
    assert back.kind == DFLASH.name and back.options == head.config.options and back.to_dict() == d
    assert kind_of_config(dict(d)) is DFLASH


@pytest.mark.parametrize("change,match", [({"mask_token_id": 256}, "mask_token_id=256"),
                                          ({"target_layers": [0, 2]}, r"id\(s\) \[0\]"),
                                          ({"target_layers": [2, 1]}, "strictly increasing"),
                                          ({"block_size": 1}, "block_size=1"),
                                          ({"bogus": 1}, "dflash.bogus: not a DFlash head key")])
def test_bad_config_values_are_one_line_errors(setup, change, match):
    d = setup[1].config.to_dict()
    d["dflash"].update(change)
    with pytest.raises(HeadConfigError, match=match) as e:
        HeadConfig.from_dict(d)
    assert "\n" not in str(e.value)


def test_target_layers_must_be_layer_outputs_of_the_target(setup):
    target = setup[0]
    assert default_target_layers(4) == [1, 2, 3] and default_target_layers(16) == [1, 8, 15]
    with pytest.raises(HeadConfigError, match=r"id\(s\) \[4\] out of range: ids are HF hidden_states indices 1..3"):
        head_config_from_target(target.config, kind=DFLASH.name, target_layers=[1, 4])


def test_training_forward_equals_the_decoding_forward_at_every_anchor(setup):
    """Block position i of anchor p (training, all anchors in one call, padding after the record) == the decoder's
    block after committing positions 0..p-1 (its context cache), for anchors anywhere in the record."""
    target, head, ids, feats = setup
    anchors = torch.tensor([[1, 6, 12], [3, 9, -1]])
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0  # record 1 is 13 tokens long: padding never reaches its blocks
    with torch.no_grad():
        out = head(feats, ids, mask, anchors)  # [2, 3, 4, H]
        for b in range(2):
            for a, p in enumerate(anchors[b].tolist()):
                if p < 0:
                    continue
                dec = head.decoder(64, lm_head=target.lm_head)
                dec.commit(feats[b, :p][:2])  # in two commits, as rounds do
                if p > 2:
                    dec.commit(feats[b, 2:p])
                torch.testing.assert_close(out[b, a], dec.block(ids[b, p]), rtol=1e-5, atol=1e-5)


def test_a_block_sees_only_the_context_before_its_anchor(setup):
    _, head, ids, feats = setup
    later = feats.clone()
    later[:, 8:] += 5.0  # change the context from position 8 on
    anchors = torch.tensor([[8, 4], [8, 4]])
    with torch.no_grad():
        a = head(feats, ids, torch.ones_like(ids), anchors)
        b = head(later, ids, torch.ones_like(ids), anchors)
    torch.testing.assert_close(a, b)  # anchor 8 reads 0..7 only


def test_bidirectional_block_rows_see_later_rows_causal_ones_do_not(setup):
    target, _, ids, feats = setup
    for causal in (False, True):
        head = df_head(target, causal=causal)
        with torch.no_grad():
            a = head(feats, ids, torch.ones_like(ids), torch.tensor([[6], [6]]))
            head.config.options.mask_token_id = 7  # the mask tokens change: rows after the root see it
            b = head(feats, ids, torch.ones_like(ids), torch.tensor([[6], [6]]))
        torch.testing.assert_close(a[:, :, 0], b[:, :, 0]) if causal else None
        assert not torch.allclose(a[:, :, 0], b[:, :, 0]) or causal  # bidirectional: the root row sees the masks


def test_backward_reaches_every_trainable_weight_and_never_the_embedding(setup):
    target, _, ids, feats = setup
    head = df_head(target).train()
    head(feats, ids, torch.ones_like(ids), torch.tensor([[3, 9], [2, 7]])).square().sum().backward()
    for name, p in head.named_parameters():
        if name.startswith("embed_tokens"):
            assert p.grad is None
        else:
            assert p.grad is not None and bool(p.grad.abs().sum() > 0), name


def test_save_and_load_round_trip(tmp_path, setup):
    target, head, ids, feats = setup
    head.save_pretrained(tmp_path / "h")
    loaded = load_head(tmp_path / "h")
    assert type(loaded) is DFlashHead and "embed_tokens.weight" not in __import__("safetensors.torch").torch.load_file(
        tmp_path / "h" / "model.safetensors")
    loaded.bind_target(target).eval()
    with torch.no_grad():
        anchors = torch.tensor([[4], [9]])
        torch.testing.assert_close(loaded(feats, ids, torch.ones_like(ids), anchors),
                                   head(feats, ids, torch.ones_like(ids), anchors))


def test_chain_and_dynamic_tree_come_from_one_block(setup):
    target, head, ids, feats = setup
    drafter = BlockDrafter(head, target.lm_head, capacity=0)
    with torch.no_grad():
        drafter.reset(64)
        drafter.extend(feats[:1, :10], ids[:1, 1:11])
        chain = drafter.draft_static(ids[0, 10:11], None, StaticTreeSpec.from_choices([[0], [0, 0], [0, 0, 0]]))
        rows = drafter.decoder.block(ids[0, 10])[1:]
        want = drafter.decoder.topk(rows, 1)[1][:, 0]
        assert chain.tokens[1:].tolist() == want.tolist() and drafter.forwards == 1
        drafter.extend(feats[:1, 10:11], ids[:1, 11:12])
        tree = drafter.draft_dynamic(ids[0, 11:12], None, total_token=8, depth=2, top_k=3)
        assert drafter.forwards == 2 and tree.tokens.numel() == 8
        drafter.extend(feats[:1, 11:12], ids[:1, 12:13])
        with pytest.raises(ValueError, match="drafts head.block_size - 1 = 3") as e:
            drafter.draft_dynamic(ids[0, 12:13], None, total_token=8, depth=3, top_k=2)
        assert "\n" not in str(e.value)


def test_a_window_on_a_dflash_head_is_refused_in_one_line(setup):
    """head.sliding_window is every other kind's option; the block drafter attends its whole context (training, our
    decoder and vLLM's qwen3_dflash.py), so a window there would be silently ignored: refused at the recipe and at
    the config instead."""
    with pytest.raises(RecipeError, match="head.sliding_window.*not supported by head.kind=dflash") as e:
        load_config("tiny-dflash", ["head.sliding_window.size=16"])
    assert "\n" not in str(e.value)
    with pytest.raises(HeadConfigError, match="not supported by head.kind=dflash"):
        head_config_from_target(setup[0].config, kind=DFLASH.name, target_layers=LAYERS, mask_token_id=5,
                                sliding_window={"size": 16})
