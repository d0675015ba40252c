"""Code that runs under the engine's own interpreter (a venv with vllm), never in this project's: it imports only the
standard library and vllm (with the torch and safetensors vllm brings), and its modules import each other relatively.

The engine process finds this package through PYTHONPATH (engine/engine_process.py `engine_env` sets it to engine/):
scripts run as `python -m vllm_side.NAME ...`, and vLLM imports the capture connector by its module path
`vllm_side.capture_connector`. The project imports these modules too (as `engine.vllm_side.*`) to test the parts that
need no engine.
"""
