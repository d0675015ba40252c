"""Feature cache: round trip, dtypes, int8 error report, resume, multi-part, corruption errors."""
import json

import pytest
import torch

from data_prep.feature_cache import (
    FeatureCacheError,
    FeatureCacheReader,
    FeatureCacheWriter,
    bytes_per_token,
    reference_bytes_per_token,
)
from data_prep.tokenized import load_tokenized, write_tokenized

H = 16
META = {"target": "tiny-random-llama", "config_hash": "abc123", "hidden_size": H, "vocab_size": 100}


def make_records(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    recs = []
    for i in range(n):
        T = int(torch.randint(3, 20, (1,), generator=g))
        recs.append(
            {
                "id": f"r{i}",
                "input_ids": torch.randint(0, 100, (T,), generator=g),
                "hidden": torch.randn(T, H, generator=g) * 3,
                "loss_mask": (torch.rand(T, generator=g) > 0.5).long(),
            }
        )
    return recs


def write_all(out, recs, **kw):
    w = FeatureCacheWriter(out, META, **kw)
    for r in recs:
        w.add(r["id"], r["input_ids"], r["hidden"], r["loss_mask"])
    return w.close()


@pytest.mark.parametrize("dtype,tol", [("float32", 0.0), ("bfloat16", 2e-2), ("float16", 1e-3)])
def test_round_trip_random_access(tmp_path, dtype, tol):
    recs = make_records(12)
    manifest = write_all(tmp_path, recs, dtype=dtype, max_shard_bytes=600)  # several shards
    assert len(manifest["shards"]) > 2
    r = FeatureCacheReader(tmp_path)
    assert len(r) == 12
    assert r.lengths == [len(x["input_ids"]) for x in recs]
    assert r.manifest["dtype"] == dtype and r.manifest["config_hash"] == "abc123"
    assert r.manifest["num_tokens"] == sum(r.lengths)
    assert r.manifest["num_loss_tokens"] == sum(int(x["loss_mask"].sum()) for x in recs)
    for i in [7, 0, 11, 3]:  # random access order
        got, want = r[i], recs[i]
        assert got["id"] == want["id"]
        assert got["input_ids"].dtype == torch.long and torch.equal(got["input_ids"], want["input_ids"])
        assert got["loss_mask"].dtype == torch.long and torch.equal(got["loss_mask"], want["loss_mask"])
        assert got["hidden_states"].dtype == torch.float32 and got["hidden_states"].shape == want["hidden"].shape
        rel = (got["hidden_states"] - want["hidden"]).abs().max() / want["hidden"].abs().max()
        assert rel <= tol
    # no padding: shard rows = sum of lengths
    assert sum(s["num_tokens"] for s in manifest["shards"]) == sum(r.lengths)


def test_int8_reports_reconstruction_error_and_halves_bytes(tmp_path):
    recs = make_records(10)
    manifest = write_all(tmp_path, recs, dtype="int8")
    q = manifest["quantization"]
    assert 0 < q["relative_rmse"] < 0.01 and q["max_abs_error"] > 0
    r = FeatureCacheReader(tmp_path)
    got = torch.cat([r[i]["hidden_states"] for i in range(len(r))])
    want = torch.cat([x["hidden"] for x in recs])
    measured = ((got - want).pow(2).sum() / want.pow(2).sum()).sqrt().item()
    assert abs(measured - q["relative_rmse"]) < 1e-6
    # target: <= 1/2 of the reference layout at realistic hidden sizes
    for hidden in (64, 4096, 8192):
        assert bytes_per_token(hidden, "int8") <= reference_bytes_per_token(hidden) / 2
    assert manifest["bytes_per_token"] == bytes_per_token(H, "int8")


def test_resume_skips_written_ids_and_equals_uninterrupted(tmp_path):
    recs = make_records(9)
    full = tmp_path / "full"
    write_all(full, recs, max_shard_bytes=400)

    part = tmp_path / "resumed"
    w = FeatureCacheWriter(part, META, max_shard_bytes=400)
    for r in recs[:5]:
        w.add(r["id"], r["input_ids"], r["hidden"], r["loss_mask"])
    w.flush()  # "crash" here: no close(), the buffer of later records is lost
    del w
    w = FeatureCacheWriter(part, META, max_shard_bytes=400)
    assert "r0" in w and "r4" in w and "r5" not in w
    added = [w.add(r["id"], r["input_ids"], r["hidden"], r["loss_mask"]) for r in recs]
    assert added == [False] * 5 + [True] * 4
    w.close()
    a, b = FeatureCacheReader(full), FeatureCacheReader(part)
    assert a.ids == b.ids and a.lengths == b.lengths
    for i in range(len(a)):
        assert torch.equal(a[i]["hidden_states"], b[i]["hidden_states"])


def test_reopen_with_other_target_or_dtype_fails(tmp_path):
    write_all(tmp_path, make_records(2))
    with pytest.raises(FeatureCacheError, match="different target/dtype"):
        FeatureCacheWriter(tmp_path, {**META, "config_hash": "other"})
    with pytest.raises(FeatureCacheError, match="different target/dtype"):
        FeatureCacheWriter(tmp_path, META, dtype="float16")


def test_parts_from_several_writers_merge(tmp_path):
    recs = make_records(8)
    w0 = FeatureCacheWriter(tmp_path, META, part="rank0")
    w1 = FeatureCacheWriter(tmp_path, META, part="rank1")
    for i, r in enumerate(recs):
        (w0 if i % 2 == 0 else w1).add(r["id"], r["input_ids"], r["hidden"], r["loss_mask"])
    w0.close()
    manifest = w1.close()
    assert manifest["parts"] == ["rank0", "rank1"] and manifest["num_records"] == 8
    r = FeatureCacheReader(tmp_path)
    assert sorted(r.ids) == sorted(x["id"] for x in recs)
    # a later writer (any part name) skips ids already cached by any part
    w2 = FeatureCacheWriter(tmp_path, META, part="rank0of1")
    assert all(x["id"] in w2 for x in recs)


def test_corrupt_and_truncated_shards_are_named(tmp_path):
    manifest = write_all(tmp_path, make_records(6), max_shard_bytes=500)
    shard = tmp_path / manifest["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # flip bits, same size
    shard.write_bytes(bytes(data))
    with pytest.raises(FeatureCacheError, match=f"{shard.name}.*corrupt"):
        FeatureCacheReader(tmp_path)
    FeatureCacheReader(tmp_path, verify="size")  # the fast check only sees sizes
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(FeatureCacheError, match=f"{shard.name}.*truncated"):
        FeatureCacheReader(tmp_path, verify="size")
    shard.unlink()
    with pytest.raises(FeatureCacheError, match=f"{shard.name}.*missing"):
        FeatureCacheReader(tmp_path)


def test_bad_inputs_name_the_record(tmp_path):
    w = FeatureCacheWriter(tmp_path, META)
    with pytest.raises(ValueError, match="'bad'.*hidden"):
        w.add("bad", torch.tensor([1, 2, 3]), torch.zeros(2, H), torch.ones(3))
    with pytest.raises(ValueError, match="'bad2'.*loss_mask"):
        w.add("bad2", torch.tensor([1, 2, 3]), torch.zeros(3, H), torch.ones(2))
    with pytest.raises(ValueError, match="hidden_size"):
        FeatureCacheWriter(tmp_path / "x", {"target": "t", "config_hash": "h"})
    (tmp_path / "empty").mkdir()
    with pytest.raises(FeatureCacheError, match="not a feature cache"):
        FeatureCacheReader(tmp_path / "empty")


def test_tokenized_round_trip(tmp_path):
    recs = [{"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"id": "b", "input_ids": [4], "loss_mask": [1]}]
    assert write_tokenized(tmp_path / "tokenized.jsonl", recs) == 2
    assert list(load_tokenized(tmp_path)) == recs  # a directory works too
    (tmp_path / "bad.jsonl").write_text(json.dumps({"id": "x", "input_ids": [1, 2], "loss_mask": [1]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1.*'x'"):
        list(load_tokenized(tmp_path / "bad.jsonl"))


# ----------------------------------------------------------------------------- EAGLE-3: aux layers + final state
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_eagle3_cache_holds_four_states_per_token(tmp_path, dtype):
    """meta feature_layers [a, b, c, L]: rows are 4H wide; int8 has one scale per layer segment, so a layer of tiny
    magnitude (the embeddings) keeps its precision next to large ones; bytes/token counts all four states."""
    from data_prep.feature_cache import FeatureCacheReader, FeatureCacheWriter, bytes_per_token

    H = 8
    meta = {"target": "t", "config_hash": "h", "hidden_size": H, "feature_layers": [1, 2, 4, 5]}
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.01, 1.0, 30.0, 3.0]).repeat_interleave(H)  # [4H] very different layer magnitudes
    feats = torch.randn(6, 4 * H, generator=g) * scales
    with FeatureCacheWriter(tmp_path / "c", meta, dtype=dtype) as w:
        w.add("r0", torch.arange(6), feats, torch.ones(6, dtype=torch.long))
        with pytest.raises(ValueError, match=r"expected \(6, 32\)"):
            w.add("bad", torch.arange(6), feats[:, :H], torch.ones(6, dtype=torch.long))
    r = FeatureCacheReader(tmp_path / "c")
    got = r[0]["hidden_states"]
    assert got.shape == (6, 4 * H) and r.feature_layers == [1, 2, 4, 5]
    rel = ((got - feats).reshape(6, 4, H).norm(dim=-1) / feats.reshape(6, 4, H).norm(dim=-1)).max()
    assert rel < {"float32": 1e-6, "bfloat16": 1e-2, "int8": 2e-2}[dtype], rel  # per segment, the small layer too
    assert r.manifest["bytes_per_token"] == bytes_per_token(H, dtype, 4) == 4 * H * {"float32": 4, "bfloat16": 2,
                                                                                    "int8": 1}[dtype] + 5 + (8 if dtype == "int8" else 0)


def test_disk_estimate_states_bytes_per_token_first(tmp_path, capsys):
    from data_prep.cache_features import check_disk

    info = check_disk(tmp_path, num_tokens=1000, hidden_size=64, dtype="bfloat16", headroom_gb=0, layers=[1, 2, 4, 5])
    line = capsys.readouterr().out
    assert info["bytes_per_token"] == 4 * 64 * 2 + 5
    assert line.startswith("[cache] 517 B/token (4 x 64 hidden: layers [1, 2, 4, 5] x bfloat16)"), line
