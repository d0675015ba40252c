"""Recipe section `data`: data preparation settings (owned by data_prep/). The one home of these defaults."""
from __future__ import annotations

from dataclasses import dataclass, field


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

    # --- tokenize
    max_length: int = 2048  # tokens per training sample
    overlong: str = "truncate"  # truncate | drop (counted either way)

    # --- cache features
    cache_features: bool = True  # False = stop after tokenize (trainer's online mode runs the target itself)
    cache_dtype: str = "bfloat16"  # bfloat16 | float16 | float32 | int8 (per-row scales; error reported)
    cache_shard_mb: int = 512
    disk_headroom_gb: float = 1.0  # refuse to start unless estimate + headroom fits on the disk
    device: str = "auto"  # auto = cuda:LOCAL_RANK when available, else cpu
