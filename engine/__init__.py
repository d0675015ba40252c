"""The serving engine stage (docs/design.md "engine/"): everything that starts or talks to vLLM as a process.

Above recipes/ and eagle/, below data_prep/, so data prep (regeneration through `data.serve`, the feature capture),
serve-check and serve-sweep all use it; it never imports a stage above it.

    engine_process.py  the engine's interpreter (a venv with vllm, never this project's), its environment, and the one
                       way a process of it starts: a server, a vLLM command run to its end, or an engine-side script
                       with a request file, a result file and a log (one failure line for all of them)
    vllm_server.py     `vllm serve` on 127.0.0.1: start, wait for /health, stop; its arguments (`serve_args`,
                       `capture_args`); `vllm bench serve` against it (`VLLMServer.bench`)
    head_dim_pad.py    what vLLM's CPU attention can serve (`servable_target`) and exactly equivalent head_dim-padded
                       copies of a target and a head
    quantized_target.py  a quantized target (`target.quantization`) as vLLM serves it: its dequantized float copy,
                       cached once (`engine_target`: the folder every vLLM start for the recipe's target uses)
    vllm_side/         the code that runs under the engine's interpreter (the standard library and vllm only, never
                       this project): vLLM's CLI, serve-check's and feature capture's scripts, the capture connector

Nothing outside this package starts a vLLM process (tests/test_engine_boundary.py). What a head looks like to an
engine (export/engine_formats.py, export/speculative_schedule.py, export/config_drift.py) stays in export/: a
head's layout per engine is its export kind's, which sits above this stage.
"""
