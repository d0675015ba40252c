"""The embedded default target: a small Llama chat model trained locally on stdlib-docstring conversations.

`ensure_default_target()` returns a normal Hugging Face `LlamaForCausalLM` folder (config.json,
model.safetensors, tokenizer.json + tokenizer_config.json with a chat template, generation_config.json),
building it on first use (a few minutes on 2 CPU cores) and reusing it afterwards. The folder also holds
the prompt sets the pipeline uses: `conversations_train.json` (ShareGPT, what data prep regenerates from)
and `questions_eval.jsonl` (MT-bench question schema, names never seen in training).

The build is written to a temporary sibling folder and renamed into place, under a file lock, so an
interrupted or concurrent build never leaves a half-written target behind.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from filelock import FileLock
from tqdm.auto import tqdm

from data_prep.docstring_corpus import default_conversations, default_questions
from eagle.state_files import StateFile, StateFileError, read_json_state, register, write_json_state

FORMAT_VERSION = 2  # bump when the build recipe changes: cached targets with another version are rebuilt
BUILD_INFO_FILE = "default_target.json"  # fingerprint + training summary; its presence marks a complete build
BUILD_INFO = register(StateFile(
    BUILD_INFO_FILE, "DEFAULT_TARGET_DIR", writer="data_prep/default_target.py",
    schema={"fingerprint": dict, "parameters": int, "train_loss_last": float, "eval_loss": float, "*": object},
    rebuild="delete that target folder and rerun the quickstart: it builds the default target again",
    when_missing="an incomplete build: the quickstart builds it again",
    example={"fingerprint": {"seed": 0}, "parameters": 1000, "train_loss_last": 2.5, "eval_loss": 2.7}))
CONVERSATIONS_FILE = "conversations_train.json"
QUESTIONS_FILE = "questions_eval.jsonl"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json", CONVERSATIONS_FILE, QUESTIONS_FILE, BUILD_INFO_FILE)

BOS, EOS, USER, ASSISTANT, SYSTEM, PAD = "<|begin|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT, SYSTEM, PAD]

# Role tags are special tokens, so turns need no separators. `{% generation %}` wraps what the assistant
# writes (content + end-of-turn token): `return_assistant_tokens_mask=True` gives the loss mask from it.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|system|>{{ message['content'] }}<|end|>"
    "{%- elif message['role'] == 'user' -%}<|user|>{{ message['content'] }}<|end|>"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>"
    "{%- generation -%}{{ message['content'] }}<|end|>{%- endgeneration -%}"
    "{%- else -%}{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


@dataclass(frozen=True)
class TargetSize:
    """Architecture and training budget of one size preset."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    block_size: int  # tokens per training row (conversations are packed)
    batch_size: int
    steps: int
    lr: float
    max_conversations: int | None  # None = the whole split (train; held-out for the reported loss)


SIZES = {
    # Deep and narrow, so that speculation pays off on a CPU: decoding a token here is bound by per-layer
    # overhead, so a target step costs ~16 layer-steps while the one-layer draft head costs ~1 and
    # verifying a 10-16 node tree costs ~1.4 steps (benchmarks/step_costs.py --default-target).
    "default": TargetSize(vocab_size=1024, hidden_size=64, num_layers=16, num_heads=4, num_kv_heads=2,
                          intermediate_size=176, block_size=256, batch_size=16, steps=300, lr=4e-3,
                          max_conversations=None),
    # for tests: builds in a few seconds; 3 layers, the fewest an EAGLE-3 head's three aux layers fit (ids 0, 1, 2)
    "test": TargetSize(vocab_size=320, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1,
                       intermediate_size=64, block_size=64, batch_size=4, steps=4, lr=3e-3, max_conversations=60),
}


def default_cache_dir() -> Path:
    """`$EAGLE_HOME` if set, else ~/.cache/eagle2-train."""
    home = os.environ.get("EAGLE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "eagle2-train"


def default_target_dir(cache_dir: str | Path | None = None, size: str = "default") -> Path:
    """Where `ensure_default_target` keeps the model: {cache_dir}/default-target[-{size}]."""
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return base / ("default-target" if size == "default" else f"default-target-{size}")


def ensure_default_target(cache_dir: str | Path | None = None, *, size: str = "default", steps: int | None = None,
                          seed: int = 0, rebuild: bool = False, progress: bool = True) -> Path:
    """Return the cached default target folder, building it first if it is missing or was built differently.

    cache_dir: parent folder (default `$EAGLE_HOME` or ~/.cache/eagle2-train); size: a key of SIZES;
    steps: override the preset's optimizer steps; rebuild: build even if a matching cache exists.
    """
    preset, fingerprint = _preset(size, steps, seed)
    return build_cached(default_target_dir(cache_dir, size), fingerprint, REQUIRED_FILES, BUILD_INFO,
                        lambda tmp: build_default_target(tmp, preset, seed=seed, fingerprint=fingerprint,
                                                         progress=progress),
                        rebuild=rebuild, label="quickstart")


def build_cached(target: Path, fingerprint: dict, required: tuple[str, ...], info: StateFile,
                 build: Callable[[Path], None], *, rebuild: bool, label: str) -> Path:
    """`target` as built for `fingerprint`: reused when complete (every `required` file there, the build's state
    file `info` recording that fingerprint), else `build(tmp)` into a temporary sibling under a lock and moved into
    place whole, so an interrupted build never leaves a half folder where a good one was."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if not rebuild and build_matches(target, fingerprint, required, info):
        return target
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if not rebuild and build_matches(target, fingerprint, required, info):  # built by another process meanwhile
            return target
        if target.exists():
            print(f"[{label}] {target} was built with other settings or is incomplete: rebuilding", file=sys.stdout)
        remove_stale_tmp_dirs(target)
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            build(tmp)
            replace_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _preset(size: str, steps: int | None, seed: int) -> tuple[TargetSize, dict]:
    """The size preset (steps overridden) and the fingerprint a build of it records."""
    if size not in SIZES:
        raise ValueError(f"size={size!r}: expected one of {sorted(SIZES)}")
    preset = SIZES[size] if steps is None else replace(SIZES[size], steps=steps)
    if preset.steps < 1:
        raise ValueError(f"steps={preset.steps}: must be >= 1")
    return preset, {"format_version": FORMAT_VERSION, "size": size, "seed": seed, **asdict(preset)}


def built_default_target(cache_dir: str | Path | None = None, size: str = "default") -> Path | None:
    """The default target's folder when a complete build of the current recipe is there, else None. Never builds:
    for commands that only read what exists (train.plan)."""
    target = default_target_dir(cache_dir, size)
    return target if build_matches(target, _preset(size, None, 0)[1], REQUIRED_FILES, BUILD_INFO) else None


def default_target_config(preset: TargetSize = SIZES["default"], tokenizer=None):
    """The LlamaConfig of a default-target build of `preset`. Without the build's `tokenizer`, the vocabulary is the
    preset's size (the build trains its BPE tokenizer to exactly that many tokens) and the special ids are unset."""
    # lazy: transformers' model classes cost seconds at import; only building or planning the default target needs them
    from transformers import LlamaConfig

    ids = {} if tokenizer is None else dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                            pad_token_id=tokenizer.pad_token_id)
    return LlamaConfig(
        vocab_size=preset.vocab_size if tokenizer is None else len(tokenizer), hidden_size=preset.hidden_size,
        num_hidden_layers=preset.num_layers, num_attention_heads=preset.num_heads, num_key_value_heads=preset.num_kv_heads,
        intermediate_size=preset.intermediate_size, max_position_embeddings=2048, rms_norm_eps=1e-5,
        tie_word_embeddings=False,  # like Llama-2/3 7B/8B: the head's lm_head is its own tensor
        attn_implementation="sdpa", dtype="float32", **ids)


def read_build_info(target: str | Path) -> dict:
    """The fingerprint and training summary (losses, params, seconds, sample answer) of a built target."""
    return read_build_state(target, BUILD_INFO)


def read_build_state(target: str | Path, info: StateFile) -> dict:
    """A cached build's state file `info` (written last: its fingerprint and summary); missing = one line."""
    state = read_json_state(Path(target) / info.name, info)
    if state is None:
        raise StateFileError(f"{Path(target) / info.name}: missing; {info.rebuild}")
    return state


def build_matches(target: Path, fingerprint: dict, required: tuple[str, ...], info: StateFile) -> bool:
    """Whether `target` is a complete build (every `required` file) whose state file records `fingerprint`."""
    if not all((target / f).is_file() for f in required):
        return False
    try:
        return read_build_state(target, info).get("fingerprint") == fingerprint
    except (OSError, StateFileError):  # damaged: the caller says "incomplete: rebuilding"
        return False


def remove_stale_tmp_dirs(target: Path) -> None:
    # leftovers of interrupted builds (we hold the lock, so no live build owns them)
    for p in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in target.parent.glob(f".{target.name}.old-*"):
        shutil.rmtree(p, ignore_errors=True)


def replace_dir(src: Path, dst: Path) -> None:
    """Move a finished build into place; an existing (stale) folder is renamed away first, then deleted."""
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- build


def build_default_target(out_dir: str | Path, preset: TargetSize, *, seed: int = 0, fingerprint: dict | None = None,
                         progress: bool = True) -> Path:
    """Train tokenizer and model from scratch and save the complete HF folder to out_dir (no caching)."""
    # lazy: transformers and tokenizers cost seconds at import; only building the default target needs them
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    torch.manual_seed(seed)

    train_records = default_conversations("train")[: preset.max_conversations]
    eval_records = heldout_conversations()[: preset.max_conversations]

    tokenizer = train_chat_tokenizer(train_records, preset.vocab_size)
    train_rows = pack_conversations(tokenizer, train_records, preset.block_size)  # [R, block+1]
    eval_rows = pack_conversations(tokenizer, eval_records, preset.block_size)
    model = build_model(preset, tokenizer)
    losses = train_model(model, train_rows, preset, seed=seed, progress=progress)
    eval_loss = evaluate_loss(model, eval_rows, preset.batch_size)

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
        do_sample=False)
    model.save_pretrained(out_dir)
    save_tokenizer(tokenizer, out_dir)
    (out_dir / CONVERSATIONS_FILE).write_text(json.dumps(train_records, indent=1, ensure_ascii=False))
    with open(out_dir / QUESTIONS_FILE, "w") as f:
        for q in default_questions("eval"):
            f.write(json.dumps(q, ensure_ascii=False) + "\n")

    sample_q = default_questions("eval")[0]["turns"][0]
    info = {
        "fingerprint": fingerprint or {"format_version": FORMAT_VERSION, "seed": seed, **asdict(preset)},
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_conversations": len(train_records),
        "train_tokens_per_epoch": int(train_rows.numel()),
        "train_loss_first": losses[0],
        "train_loss_last": sum(losses[-10:]) / len(losses[-10:]),
        "eval_loss": eval_loss,
        "build_seconds": round(time.time() - started, 1),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "sample": {"question": sample_q, "answer": greedy_answer(model, tokenizer, sample_q, max_new_tokens=48)},
    }
    # written last: its presence (with a matching fingerprint) marks the folder as complete
    write_json_state(out_dir / BUILD_INFO_FILE, info, BUILD_INFO)
    print(f"[quickstart] default target: {info['parameters'] / 1e6:.2f}M params, train loss "
          f"{info['train_loss_last']:.3f}, held-out loss {eval_loss:.3f}, built in {info['build_seconds']}s",
          file=sys.stdout)
    return out_dir


def sharegpt_to_messages(record: dict) -> list[dict]:
    """ShareGPT turns ({"from": human|gpt, "value"}) -> chat-template messages."""
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    try:
        return [{"role": roles[t["from"]], "content": t["value"]} for t in record["conversations"]]
    except KeyError as e:
        raise ValueError(f"conversation {record.get('id')!r}: bad turn (missing key or unknown role {e})") from None


def heldout_conversations() -> list[dict]:
    """The held-out questions with their reference docs as ShareGPT records (for the held-out loss)."""
    out = []
    for q in default_questions("eval"):
        turns = []
        for user, ref in zip(q["turns"], q["reference"]):
            turns += [{"from": "human", "value": user}, {"from": "gpt", "value": ref}]
        out.append({"id": f"stdlib-eval-{q['question_id']}", "conversations": turns})
    return out


def train_chat_tokenizer(records: list[dict], vocab_size: int):
    """Byte-level BPE trained on the conversations' text, wrapped as a transformers fast tokenizer."""
    # lazy: transformers and tokenizers cost seconds at import; only building the default target needs them
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator((t["value"] for r in records for t in r["conversations"]), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                        additional_special_tokens=[USER, ASSISTANT, SYSTEM])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 2048
    return tokenizer


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    """Save with the chat template inside tokenizer_config.json (readable by transformers 4.x and 5.x)."""
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def pack_conversations(tokenizer, records: list[dict], block_size: int) -> torch.Tensor:
    """Render every conversation with the chat template, concatenate, cut into rows of block_size + 1."""
    stream: list[int] = []
    for r in records:
        stream += tokenizer.apply_chat_template(sharegpt_to_messages(r), tokenize=True, return_dict=True)["input_ids"]
    rows = len(stream) // (block_size + 1)
    if rows == 0:
        raise ValueError(f"{len(stream)} tokens do not fill one training row of {block_size + 1}")
    return torch.tensor(stream[: rows * (block_size + 1)], dtype=torch.long).view(rows, block_size + 1)


def build_model(preset: TargetSize, tokenizer):
    # lazy: transformers' model classes cost seconds at import; only building the default target needs them
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(default_target_config(preset, tokenizer))


def _lr_at(step: int, preset: TargetSize) -> float:
    """Linear warmup then cosine decay to 10%."""
    warmup = max(1, preset.steps // 20)
    if step < warmup:
        return preset.lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, preset.steps - warmup)
    return preset.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train_model(model, rows: torch.Tensor, preset: TargetSize, *, seed: int, progress: bool) -> list[float]:
    """AdamW on random batches of packed rows (next-token loss on every token), float32; returns losses.

    float32, not bf16 autocast: CPUs without native bf16 (no AVX512-BF16/AMX) run autocast ~10x slower."""
    gen = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=preset.lr, betas=(0.9, 0.95))
    model.train()
    losses = []
    bar = tqdm(range(preset.steps), desc="default target: training", disable=not progress, file=sys.stdout)
    for step in bar:
        idx = torch.randint(0, rows.shape[0], (preset.batch_size,), generator=gen)
        batch = rows[idx]  # [B, block+1]
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, preset)
        logits = model(input_ids=batch[:, :-1]).logits  # [B, block, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


@torch.no_grad()
def evaluate_loss(model, rows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token loss (nats/token) over packed rows, in float32."""
    total, count = 0.0, 0
    for i in range(0, rows.shape[0], batch_size):
        batch = rows[i: i + batch_size]
        logits = model(input_ids=batch[:, :-1]).logits
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count


@torch.no_grad()
def greedy_answer(model, tokenizer, question: str, max_new_tokens: int = 64) -> str:
    """The model's greedy reply to one user question (stops at the end-of-turn token)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
