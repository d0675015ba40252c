"""data_prep on ../shared assets (skipped when absent) and a 2-rank torchrun run (slow)."""
import json
import os
import subprocess
import sys

import pytest

from data_prep.conversations import load_conversations
from data_prep.feature_cache import FeatureCacheReader
from data_prep.main import main
from data_prep.tokenized import load_tokenized
from test_data_prep_helpers import REPO_ROOT, SHARED, one_torch_thread, save_target, write_sharegpt  # noqa: F401


@pytest.mark.shared
@pytest.mark.parametrize("name,kept,rejected", [
    ("dummy_conversation.json", 500, 0),
    ("alpaca_demo.json", None, None),
    ("sharegpt_sample50.json", None, None),
    ("glaive_toolcall_demo.json", None, None),
])
def test_shared_conversation_files_load_with_exact_accounting(name, kept, rejected):
    res = load_conversations(str(SHARED / "data" / "conversations" / name))
    assert len(res.kept) + len(res.rejects) == res.num_input > 0
    if kept is not None:
        assert (len(res.kept), len(res.rejects)) == (kept, rejected)
    if name.startswith("glaive"):  # ShareGPT with tools (function_call / observation turns, tools as JSON text)
        assert res.rejects == []
        assert any(m["role"] == "tool" for r in res.kept for m in r["messages"]) and any("tools" in r for r in res.kept)


@pytest.mark.shared
def test_stories260k_plain_template_pipeline(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": t}]}) + "\n"
                               for i, t in enumerate(["Once upon a time", "Tom had a red ball", "The sun was hot"])))
    main(["--recipe", "tiny", "--no-progress", f"output_dir={tmp_path / 'run'}",
          f"target.path={SHARED / 'models' / 'stories260K'}", "target.chat_template=plain", "target.dtype=float32",
          f"data.source={prompts}", "data.extra_stop_ids=[1]", "data.max_new_tokens=16", "data.disk_headroom_gb=0"])
    regen = {json.loads(x)["id"]: json.loads(x) for x in
             (tmp_path / "run/data/regenerated/part-00000-of-00001.jsonl").read_text().splitlines()}
    assert "there was a little girl named Lily" in regen["p0"]["messages"][1]["content"]  # the known greedy story
    reader = FeatureCacheReader(tmp_path / "run/data/features")
    assert len(reader) == 3 and reader.manifest["hidden_size"] == 64
    assert sum(reader[0]["loss_mask"].tolist()) > 0


@pytest.mark.slow
@pytest.mark.multiproc
def test_torchrun_two_ranks(tmp_path):
    target = save_target(tmp_path / "target")
    source = write_sharegpt(tmp_path / "c.json", 8)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29531",
           str(REPO_ROOT / "data_prep" / "main.py"), "--recipe", "tiny", "--no-progress", f"output_dir={tmp_path / 'run'}",
           f"target.path={target}", "target.dtype=float32", f"data.source={source}", "data.max_new_tokens=5",
           "data.gen_batch_size=2", "data.disk_headroom_gb=0", "data.device=cpu"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = tmp_path / "run" / "data"
    assert sorted(p.name for p in (data / "regenerated").glob("part-*")) == ["part-00000-of-00002.jsonl", "part-00001-of-00002.jsonl"]
    reader = FeatureCacheReader(data / "features")
    assert len(reader) == 8 == len(list(load_tokenized(data)))
    assert reader.manifest["parts"] == ["shard00000-of-00002", "shard00001-of-00002"]
