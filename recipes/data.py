"""Recipe section `data`: data preparation settings (read by data_prep/). The one home of these defaults."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from recipes.check import check

FORMATS = ("auto", "sharegpt", "openai", "alpaca")
BACKENDS = ("hf", "openai")
API_ENDPOINTS = ("chat", "completions")
LENGTH_LIMIT_POLICIES = ("keep", "drop")
OVERLONG_POLICIES = ("truncate", "drop")
CACHE_DTYPES = ("bfloat16", "float16", "float32", "int8")
FEATURE_SOURCES = ("transformers", "vllm")
TOOL_CALL_FORMATS = ("auto", "hermes", "llama3_json", "none")  # data_prep/tool_calls.py holds each one's parser


@dataclass
class DataSettings:
    # --- load
    source: str = ""  # local .json/.jsonl/.parquet/.csv file, or a HF dataset id (loaded with `datasets`)
    format: str = "auto"  # auto | sharegpt | openai | alpaca (auto decides per record from its keys)
    hf_subset: str | None = None  # `name=` for datasets.load_dataset
    hf_split: str = "train"
    max_records: int | None = None  # read only the first N input records (None = all)
    system_prompt: str | None = None  # prepended as a system turn to conversations that have none

    # --- regenerate (on-policy responses from the target)
    regenerate: bool = True  # False = train on the dataset's own assistant replies
    backend: str = "hf"  # hf (transformers generate) | openai (an OpenAI-compatible /v1/chat/completions server)
    gen_batch_size: int = 8  # conversations per generate() call (hf) / concurrent requests (openai)
    max_new_tokens: int = 512  # per assistant turn
    do_sample: bool = False  # False = greedy
    temperature: float = 1.0  # used when do_sample
    top_p: float = 1.0  # used when do_sample
    extra_stop_ids: list[int] = field(default_factory=list)  # besides eos/end-of-turn (e.g. [1] for llama2.c stories models)
    on_length_limit: str = "keep"  # keep | drop: records whose generation hit max_new_tokens (always flagged + counted)
    api_base: str = "http://127.0.0.1:8000/v1"  # openai backend
    api_model: str = ""  # openai backend model name ("" = target.path)
    api_key_env: str = "OPENAI_API_KEY"  # env var holding the key (may be unset for local servers)
    api_timeout_s: float = 600.0
    api_retries: int = 3
    api_endpoint: str = "chat"  # chat (/v1/chat/completions) | completions (/v1/completions fed this project's prompt ids: raw-text models)
    api_token_ids: bool = True  # ask for vLLM's return_token_ids + stop_token_ids (exactly on-policy ids); false for servers refusing them
    serve: bool = False  # openai backend: start `vllm serve` on the target for this run (data_prep/main.py recipe_server), stop it at the end
    engine_python: str = ""  # interpreter of a venv with vllm for data.serve ("" = $EAGLE_VLLM_PYTHON)
    serve_args: list[str] = field(default_factory=list)  # extra `vllm serve` arguments, e.g. ["--tensor-parallel-size", "8"]

    tool_call_format: str = "auto"  # how the template writes tool calls (a regenerated call is parsed back): auto (from the template) | hermes | llama3_json | none

    # --- tokenize
    max_length: int = 2048  # tokens per training sample
    overlong: str = "truncate"  # truncate | drop (counted either way)
    train_reasoning: bool = True  # train on the assistant's <think>...</think> reasoning (the head drafts it when serving); false = answers and tool calls only

    # --- cache features
    cache_features: bool = True  # False = stop after tokenize (trainer's online mode runs the target itself)
    cache_dtype: str = "bfloat16"  # bfloat16 | float16 | float32 | int8 (per-row scales; error reported)
    feature_source: str = "transformers"  # transformers | vllm (the states computed in vLLM, data.engine_python: data_prep/vllm_features.py)
    cache_shard_mb: int = 512
    disk_headroom_gb: float = 1.0  # refuse to start unless estimate + headroom fits on the disk
    device: str = "auto"  # auto = cuda:LOCAL_RANK when available, else cpu


def validate_data_section(d) -> None:
    """Check every value of the `data` section (RecipeError naming the key)."""
    check(d.format in FORMATS, "data.format", d.format, f"expected one of {FORMATS}")
    check(d.backend in BACKENDS, "data.backend", d.backend, f"expected one of {BACKENDS}")
    check(d.api_endpoint in API_ENDPOINTS, "data.api_endpoint", d.api_endpoint, f"expected one of {API_ENDPOINTS}")
    check(not d.serve or d.backend == "openai", "data.serve", d.serve, "expected data.backend=openai with data.serve")
    check(d.on_length_limit in LENGTH_LIMIT_POLICIES, "data.on_length_limit", d.on_length_limit,
          f"expected one of {LENGTH_LIMIT_POLICIES}")
    check(d.overlong in OVERLONG_POLICIES, "data.overlong", d.overlong, f"expected one of {OVERLONG_POLICIES}")
    check(d.tool_call_format in TOOL_CALL_FORMATS, "data.tool_call_format", d.tool_call_format,
          f"expected one of {TOOL_CALL_FORMATS}")
    check(d.cache_dtype in CACHE_DTYPES, "data.cache_dtype", d.cache_dtype, f"expected one of {CACHE_DTYPES}")
    check(d.feature_source in FEATURE_SOURCES, "data.feature_source", d.feature_source,
          f"expected one of {FEATURE_SOURCES}")
    check(d.max_records is None or d.max_records >= 1, "data.max_records", d.max_records, "expected >= 1 (or null = all)")
    for key in ("gen_batch_size", "max_new_tokens", "cache_shard_mb"):
        check(d[key] >= 1, f"data.{key}", d[key], "expected >= 1")
    check(d.max_length >= 2, "data.max_length", d.max_length, "expected >= 2 tokens")
    check(d.api_retries >= 0, "data.api_retries", d.api_retries, "expected >= 0")
    check(math.isfinite(d.api_timeout_s) and d.api_timeout_s > 0, "data.api_timeout_s", d.api_timeout_s, "expected > 0")
    check(math.isfinite(d.temperature) and d.temperature >= 0, "data.temperature", d.temperature, "expected a number >= 0")
    check(not d.do_sample or d.temperature > 0, "data.temperature", d.temperature, "expected > 0 when data.do_sample")
    check(math.isfinite(d.top_p) and 0 < d.top_p <= 1, "data.top_p", d.top_p, "expected 0 < top_p <= 1 (1 = no nucleus cut)")
    check(math.isfinite(d.disk_headroom_gb) and d.disk_headroom_gb >= 0, "data.disk_headroom_gb", d.disk_headroom_gb,
          "expected >= 0")
    check(all(int(i) >= 0 for i in d.extra_stop_ids), "data.extra_stop_ids", list(d.extra_stop_ids),
          "expected token ids >= 0")
    check(d.device == "auto" or d.device == "cpu" or str(d.device).startswith("cuda"), "data.device", d.device,
          "expected auto, cpu or cuda[:N]")
