"""The feature cache from vLLM (`data.feature_source=vllm`, data_prep/vllm_features.py) without an engine: vLLM's
hidden-state ids against the cache's (its id L is before the final norm), the capture files checked and turned into
the same cache the transformers path writes, a capture that fails part-way (a full disk) keeps what it captured and
resumes, and an engine without the capture support is one line; the served capture (one server regenerating and
capturing) against a fake server that writes as the connector does. Against real vLLM: tests/test_vllm_features.py."""
from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import save_file

import data_prep.vllm_features as vf
from data_prep.cache_features import cache_shard
from data_prep.feature_cache import FeatureCacheReader, FeatureCacheWriter
from data_prep.vllm_features import EngineCaptureError, FinalNorm, capture_layer_ids, features_of
from eagle.cli_errors import is_expected
from engine.engine_process import ENGINE_DIR, EngineError, engine_env
from engine.vllm_server import capture_args
from float_tolerance import LAYER_REDUCTIONS, assert_same_function
from recipes import RecipeError, load_config
from test_data_prep_helpers import build_model

LAYERS = 2  # build_model: a 2-layer Llama, hidden 32


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = build_model(64, seed=3)
    path = tmp_path_factory.mktemp("target") / "t"
    model.save_pretrained(path)
    return model, path


def engine_states(model, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """What vLLM's aux-state capture holds for `ids`: [T, n, H], id j = the residual stream after j layers, id L
    BEFORE the final norm (read here off the norm's input)."""
    seen = {}
    hook = model.model.norm.register_forward_hook(lambda m, args, out: seen.setdefault("pre", args[0]))
    with torch.no_grad():
        out = model.model(torch.tensor([ids]), output_hidden_states=True)
    hook.remove()
    states = [seen["pre"][0] if j == LAYERS else out.hidden_states[j][0] for j in layer_ids]
    return torch.stack(states, dim=1)


def test_layer_ids_and_the_final_norm(target):
    model, path = target
    assert capture_layer_ids(None, 5) == [5] and capture_layer_ids([1, 2, 4, 5], 5) == [1, 2, 4, 5]
    norm = FinalNorm(str(path), model.config)
    x = torch.randn(7, 32) * 3
    with torch.no_grad():
        assert_same_function(norm(x), model.model.norm(x), terms=32, chained=2)
    ids = [1, 5, 9, 12, 40, 3]
    with torch.no_grad():
        out = model.model(torch.tensor([ids]), output_hidden_states=True)
    for layer_ids, want in (([LAYERS], out.last_hidden_state[0]),
                            ([1, 1, 0, LAYERS], torch.cat([out.hidden_states[1][0], out.hidden_states[1][0],
                                                           out.hidden_states[0][0], out.last_hidden_state[0]], -1))):
        data = {"hidden_states": engine_states(model, ids, layer_ids), "token_ids": torch.tensor(ids)}
        got = features_of(data, ids, layer_ids, LAYERS, norm, "f")
        assert_same_function(got, want, terms=32, chained=2)
    with pytest.raises(EngineCaptureError, match=r"f: the engine captured other token ids .*position 2, 6 vs 6") as e:
        features_of({**data, "token_ids": torch.tensor([1, 5, 8, 12, 40, 3])}, ids, [1, 1, 0, LAYERS], LAYERS, norm, "f")
    assert is_expected(e.value)
    with pytest.raises(EngineCaptureError, match=r"hidden_states of shape \(6, 4, 32\), expected \(6, 2, H\)"):
        features_of(data, ids, [1, LAYERS], LAYERS, norm, "f")
    with pytest.raises(EngineCaptureError, match="no tensor 'model.norm.weight'"):
        FinalNorm(str(path.parent), model.config)


def records(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        T = 4 + i % 5
        out.append({"id": f"rec/{i}", "input_ids": torch.randint(3, 64, (T,), generator=g).tolist(),
                    "loss_mask": [0] * 2 + [1] * (T - 2)})
    return out


def fake_engine(model, fail: set[str] = frozenset()):
    """engine_capture writing what vLLM's capture writes (`engine_states`); names in `fail` get a write error."""
    def capture(engine_python, served, dtype, recs, layer_ids, work, seed, max_model_len, log_path):
        files, errors = {}, {}
        (work / "files").mkdir(parents=True, exist_ok=True)
        for r in recs:
            if r["name"] in fail:
                errors[r["name"]] = "OSError: [Errno 28] No space left on device"
                continue
            p = work / "files" / f"{r['name']}.safetensors"
            save_file({"hidden_states": engine_states(model, r["input_ids"], layer_ids).contiguous(),
                       "token_ids": torch.tensor(r["input_ids"])}, str(p))
            files[r["name"]] = str(p)
        return {"vllm_version": "fake", "files": files, "errors": errors, "load_s": 0.0, "capture_s": 0.0}
    return capture


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_the_engine_cache_equals_the_transformers_cache(target, tmp_path, monkeypatch, kind):
    model, path = target
    layers = None if kind == "eagle2" else [1, 0, 1, LAYERS]
    cfg = load_config("tiny", [f"target.path={path}", "data.cache_dtype=float32", "data.engine_python=python"])
    monkeypatch.setattr(vf, "resolve_engine_python", lambda value: "python")
    monkeypatch.setattr(vf, "served_target_folder", lambda target_cfg, p, config, work: p)
    meta = {"target": str(path), "config_hash": "h", "hidden_size": 32}
    if layers:
        meta["feature_layers"] = layers
    recs = records(9)
    hf = FeatureCacheWriter(tmp_path / "hf", meta, dtype="float32")
    cache_shard(model, recs, hf, 0, 1, progress=False, layers=layers)
    hf.close()
    # the engine path, failing for two records on the first run (a full disk): the rest is committed, one line
    monkeypatch.setattr(vf, "engine_capture", fake_engine(model, fail={"r00000002", "r00000005"}))
    writer = FeatureCacheWriter(tmp_path / "vllm", meta, dtype="float32")
    with pytest.raises(EngineCaptureError, match=r"could not write 2 of 9 records .*record rec/2: OSError: \[Errno 28\] "
                                                 r"No space left on device\); the 7 captured are committed") as e:
        vf.cache_shard_vllm(cfg, str(path), model.config, recs, writer, 0, 1, layers, tmp_path / "data")
    assert is_expected(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "data" / f"{vf.CAPTURE_DIR}-00000" / "files").exists()  # capture files gone once committed
    monkeypatch.setattr(vf, "engine_capture", fake_engine(model))
    writer = FeatureCacheWriter(tmp_path / "vllm", meta, dtype="float32")  # the rerun: only the two missing
    stats = vf.cache_shard_vllm(cfg, str(path), model.config, recs, writer, 0, 1, layers, tmp_path / "data")
    writer.close()
    assert (stats.records_skipped_done, stats.records_cached) == (7, 2)
    a, b = FeatureCacheReader(tmp_path / "hf"), FeatureCacheReader(tmp_path / "vllm")
    assert sorted(a.ids) == sorted(b.ids) == sorted(r["id"] for r in recs)
    assert b.feature_layers == layers
    rows = {r["id"]: r for r in b}
    for r in a:
        got = rows[r["id"]]
        assert torch.equal(got["input_ids"], r["input_ids"]) and torch.equal(got["loss_mask"], r["loss_mask"])
        # two float32 computations of the 2-layer target (+ the final norm): the rounding bound of that depth
        assert_same_function(got["hidden_states"], r["hidden_states"], terms=64,
                             chained=LAYER_REDUCTIONS * LAYERS + 1)


class FakeCaptureServer:
    """A /v1/completions server writing what the served connector writes: the `.lock` taken before the reply and
    released once the file is written (after it, as vLLM's worker may); names in `fail` get a `.error`, names in
    `refuse` an HTTP 400."""

    def __init__(self, model, layer_ids, fail=frozenset(), refuse=frozenset()):
        self.bodies, self.served_model_name, self.model_lock = [], "served", threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                path = body["kv_transfer_params"]["hidden_states_path"]
                name = os.path.basename(path).split(".")[0]
                if name in refuse:
                    self.send_response(400)
                    self.end_headers()
                    self.wfile.write(b'{"error": "prompt too long"}')
                    return
                fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
                fcntl.flock(fd, fcntl.LOCK_EX)

                def write():
                    try:
                        time.sleep(0.2)
                        if name in fail:
                            open(path + ".error", "w").write("OSError: [Errno 28] No space left on device")
                        else:
                            with outer.model_lock:  # engine_states hooks the model: one request at a time
                                states = engine_states(model, body["prompt"], layer_ids).contiguous()
                            save_file({"hidden_states": states, "token_ids": torch.tensor(body["prompt"])}, path)
                    finally:
                        os.close(fd)
                threading.Thread(target=write).start()
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b'{"choices": [{"text": "x"}]}')

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def died(self):
        return None


def test_the_served_capture_equals_the_transformers_cache(target, tmp_path):
    model, path = target
    layers = [1, 0, 1, LAYERS]
    cfg = load_config("tiny", [f"target.path={path}", "data.cache_dtype=float32", "data.gen_batch_size=3"])
    meta = {"target": str(path), "config_hash": "h", "hidden_size": 32, "feature_layers": layers}
    recs = records(9)
    hf = FeatureCacheWriter(tmp_path / "hf", meta, dtype="float32")
    cache_shard(model, recs, hf, 0, 1, progress=False, layers=layers)
    hf.close()
    # a full disk for one record and a refused request for another: the 7 others committed, one line naming both
    fake = FakeCaptureServer(model, layers, fail={"r00000002"}, refuse={"r00000005"})
    writer = FeatureCacheWriter(tmp_path / "vllm", meta, dtype="float32")
    with pytest.raises(EngineCaptureError, match=r"could not write 2 of 9 records .*the 7 captured are committed"):
        vf.cache_shard_vllm(cfg, str(path), model.config, recs, writer, 0, 1, layers, tmp_path / "data",
                            server=lambda: fake)
    fake.httpd.shutdown()
    assert sorted(b["prompt"] for b in fake.bodies) == sorted(r["input_ids"] for r in recs)
    assert all(b["max_tokens"] == 1 and b["temperature"] == 0.0 and b["model"] == "served" for b in fake.bodies)
    started = []
    fake = FakeCaptureServer(model, layers)
    writer = FeatureCacheWriter(tmp_path / "vllm", meta, dtype="float32")  # the rerun: only the two missing
    stats = vf.cache_shard_vllm(cfg, str(path), model.config, recs, writer, 0, 1, layers, tmp_path / "data",
                                server=lambda: started.append(1) or fake)
    writer.close()
    assert (stats.records_skipped_done, stats.records_cached, len(fake.bodies), started) == (7, 2, 2, [1])
    writer = FeatureCacheWriter(tmp_path / "vllm", meta, dtype="float32")  # nothing left: the server is not asked for
    vf.cache_shard_vllm(cfg, str(path), model.config, recs, writer, 0, 1, layers, tmp_path / "data",
                        server=lambda: started.append(1) or fake)
    writer.close()
    fake.httpd.shutdown()
    assert started == [1]
    a, b = FeatureCacheReader(tmp_path / "hf"), FeatureCacheReader(tmp_path / "vllm")
    rows = {r["id"]: r for r in b}
    assert sorted(a.ids) == sorted(rows)
    for r in a:
        got = rows[r["id"]]
        assert torch.equal(got["input_ids"], r["input_ids"]) and torch.equal(got["loss_mask"], r["loss_mask"])
        assert_same_function(got["hidden_states"], r["hidden_states"], terms=64, chained=LAYER_REDUCTIONS * LAYERS + 1)
    assert not (tmp_path / "data" / f"{vf.CAPTURE_DIR}-00000" / "files").exists()


def test_the_capture_server_arguments(tmp_path):
    args = capture_args([0, 1, 4], tmp_path / "u")
    spec = json.loads(args[args.index("--speculative-config") + 1])
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert spec == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 4]}}}
    assert kv["kv_connector"] == "CPUHiddenStatesConnector"
    assert kv["kv_connector_module_path"] == "vllm_side.capture_connector"
    assert kv["kv_connector_extra_config"]["capture_only_requested"] is True and "--no-enable-prefix-caching" in args
    # the engine process imports it from its PYTHONPATH, engine/ (engine_env), as it imports vllm_side.cli
    assert (ENGINE_DIR / "vllm_side" / "capture_connector.py").exists()
    assert engine_env(sys.executable)["PYTHONPATH"] == str(ENGINE_DIR)


def fake_engine_python(path, body: str) -> str:
    """An engine interpreter that runs `body` instead of the capture script (argv: -m vllm_side.capture REQUEST
    RESULT)."""
    path.write_text(f"#!{sys.executable}\nimport json, sys\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_an_engine_without_capture_support_or_that_crashes_is_one_line(tmp_path):
    refusing = fake_engine_python(tmp_path / "refusing", "json.dump({'files': {}, 'errors': {}, 'error': \"ValueError: "
                                  "Invalid method extract_hidden_states\"}, open(sys.argv[4], 'w'))")
    args = ("m", "float32", [{"name": "a", "input_ids": [1, 2]}], [2], tmp_path / "w", 0, 8, tmp_path / "log")
    with pytest.raises(EngineCaptureError, match=r"cannot capture hidden states .*ValueError: Invalid method "
                                                 r"extract_hidden_states; use data.feature_source=transformers") as e:
        vf.engine_capture(refusing, *args)
    assert is_expected(e.value) and "\n" not in str(e.value)
    assert f"{refusing} -m vllm_side.capture " in (tmp_path / "log").read_text().splitlines()[0]
    crashing = fake_engine_python(tmp_path / "crashing", "print('engine died: out of memory')\nsys.exit(3)")
    with pytest.raises(EngineError, match=r"exited with code 3 \(log .*\): .*engine died: out of memory") as e:
        vf.engine_capture(crashing, *args)
    assert is_expected(e.value) and "\n" not in str(e.value)
    request = json.loads((tmp_path / "w" / "request.json").read_text())
    assert request["layer_ids"] == [2] and request["records"] == [{"name": "a", "input_ids": [1, 2]}]


def test_the_recipe_key():
    assert load_config("tiny", []).data.feature_source == "transformers"
    with pytest.raises(RecipeError, match="data.feature_source"):
        load_config("tiny", ["data.feature_source=sglang"])
