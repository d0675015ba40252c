"""The EAGLE-3 draft vocabulary: most frequent loss tokens, filled by lowest id when fewer occur, installable."""
from __future__ import annotations

import pytest
import torch

from train.draft_vocab import build_draft_vocab, count_loss_tokens, vocab_coverage


def test_most_frequent_tokens_ordered_by_target_id():
    counts = torch.tensor([0, 5, 1, 9, 0, 5, 2, 0])  # V = 8
    d2t, t2d = build_draft_vocab(counts, 3)
    target_ids = torch.arange(3) + d2t
    assert target_ids.tolist() == [1, 3, 5]  # 9, 5, 5 (tie 5/5 kept, 2 dropped); draft ids ordered by target id
    assert t2d.tolist() == [False, True, False, True, False, True, False, False]
    assert vocab_coverage(counts, t2d) == pytest.approx(19 / 22)


def test_ties_break_by_lower_target_id():
    counts = torch.tensor([3, 7, 3, 3, 7])
    d2t, _ = build_draft_vocab(counts, 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 4]


def test_fewer_distinct_tokens_than_slots_fills_with_lowest_unused_ids():
    """stories260K's case (~209 distinct of 512 for 256 slots): the vocabulary keeps the recipe's size."""
    counts = torch.zeros(16, dtype=torch.long)
    counts[[3, 9, 12]] = torch.tensor([4, 2, 1])
    d2t, t2d = build_draft_vocab(counts, 6)
    assert d2t.numel() == 6 and int(t2d.sum()) == 6
    assert (torch.arange(6) + d2t).tolist() == [0, 1, 2, 3, 9, 12]  # every seen token + fill 0, 1, 2
    assert vocab_coverage(counts, t2d) == 1.0


def test_full_vocabulary_is_the_identity_and_sizes_are_checked():
    d2t, t2d = build_draft_vocab(torch.randint(0, 5, (10,)), 10)
    assert torch.equal(d2t, torch.zeros(10, dtype=torch.long)) and bool(t2d.all())
    for bad in (0, 11):
        with pytest.raises(ValueError, match=f"draft vocabulary size {bad}"):
            build_draft_vocab(torch.ones(10), bad)


def test_counts_cover_loss_tokens_only_and_read_no_features(tmp_path):
    from data_prep.feature_cache import FeatureCacheReader, FeatureCacheWriter

    meta = {"target": "t", "config_hash": "h", "hidden_size": 4, "feature_layers": [1, 2, 3, 4]}
    with FeatureCacheWriter(tmp_path / "c", meta, dtype="float32") as w:
        w.add("a", torch.tensor([1, 2, 3, 3]), torch.randn(4, 16), torch.tensor([0, 1, 1, 1]))
        w.add("b", torch.tensor([2, 5, 5]), torch.randn(3, 16), torch.tensor([1, 1, 0]))
    reader = FeatureCacheReader(tmp_path / "c")
    assert count_loss_tokens(reader, [0, 1], 8).tolist() == [0, 0, 2, 2, 0, 1, 0, 0]
    assert count_loss_tokens(reader, [0], 8, max_length=2).tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="token id 5 >= the target vocabulary \\(4\\)"):
        count_loss_tokens(reader, [1], 4)


def test_the_vocabulary_installs_in_an_eagle3_head():
    from transformers import LlamaConfig

    from eagle.head import Eagle3Head, head_config_from_target

    target = LlamaConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=64)
    head = Eagle3Head(head_config_from_target(target, kind="eagle3", aux_layers=[1, 2, 3], draft_vocab_size=10))
    counts = torch.arange(64).flip(0)  # id 0 most frequent
    d2t, t2d = build_draft_vocab(counts, 10)
    head.set_vocab(d2t, t2d)
    assert head.map_to_target(torch.arange(10)).tolist() == list(range(10))
    counts = torch.zeros(64, dtype=torch.long)
    counts[50:60] = 1
    head.set_vocab(*build_draft_vocab(counts, 10))
    assert head.map_to_target(torch.tensor([0, 9])).tolist() == [50, 59]
