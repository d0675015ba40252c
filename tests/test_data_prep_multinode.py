"""Data prep across nodes x ranks on one box (slow): torchrun "nodes" share regeneration and feature caching by
global rank; a rerun with another node count continues where the last run stopped, every record done once."""
import json
import subprocess
import sys

import pytest

from data_prep.feature_cache import FeatureCacheReader
from data_prep.tokenized import load_tokenized
from test_data_prep_helpers import REPO_ROOT, save_target, write_sharegpt
from test_train_multiproc import free_port

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
N = 12  # conversations


def data_prep(tmp_path, *args, nodes: int = 0) -> list[str]:
    """`data_prep/main.py` as one plain process (nodes=0) or as `nodes` torchrun nodes of one rank; the outputs."""
    cmd = [str(REPO_ROOT / "data_prep" / "main.py"), "--recipe", "tiny", "--no-progress", *args,
           f"output_dir={tmp_path / 'run'}", f"target.path={tmp_path / 'target'}", "target.dtype=float32",
           f"data.source={tmp_path / 'c.json'}", "data.max_new_tokens=5", "data.gen_batch_size=2",
           "data.disk_headroom_gb=0", "data.device=cpu"]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"}
    if not nodes:
        procs = [subprocess.Popen([sys.executable, *cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    else:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank",
                                   str(i), "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port",
                                   str(port), *cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(nodes)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    return outs


def regenerated(data) -> list[str]:
    return [json.loads(x)["id"] for p in sorted((data / "regenerated").glob("part-*.jsonl"))
            for x in p.read_text().splitlines()]


def test_another_node_count_continues_without_redoing_or_losing_records(tmp_path):
    """Regeneration: one of 2 nodes finished its share (`--shard 0/2`), then 3 nodes do the rest; caching: half
    of a 2-way split, then 3 nodes. Every record is regenerated once and cached once; the first run's records are
    skipped, not redone (its part files are untouched)."""
    save_target(tmp_path / "target")
    write_sharegpt(tmp_path / "c.json", N)
    data = tmp_path / "run" / "data"
    data_prep(tmp_path, "--shard", "0/2")  # node 0 of 2 did its share; node 1 never ran
    first = (data / "regenerated" / "part-00000-of-00002.jsonl").read_bytes()
    assert len(regenerated(data)) == N // 2
    data_prep(tmp_path, "regenerate", nodes=3)
    ids = regenerated(data)
    assert len(ids) == len(set(ids)) == N  # each once
    assert (data / "regenerated" / "part-00000-of-00002.jsonl").read_bytes() == first
    report = json.loads((data / "report.json").read_text())
    assert sum(report[f"regenerate_shard{i}of3"]["records_skipped_done"] for i in range(3)) == N // 2
    assert sum(report[f"regenerate_shard{i}of3"]["records_generated"] for i in range(3)) == N // 2
    data_prep(tmp_path, "tokenize")
    data_prep(tmp_path, "--shard", "0/2", "cache")
    data_prep(tmp_path, "cache", nodes=3)
    reader = FeatureCacheReader(data / "features")
    cached = list(reader.ids)
    assert sorted(cached) == sorted({r["id"] for r in load_tokenized(data)}) and len(cached) == len(set(cached))
    report = json.loads((data / "report.json").read_text())
    assert sum(report[f"cache_shard{i}of3"]["records_cached"] for i in range(3)) == len(cached) - report["cache_shard0of2"]["records_cached"]
