"""Builders shared by the data_prep tests: a real (tokenizers-trained) byte-level BPE tokenizer and a
tiny random Llama, both made in code so the tests need no downloads and no ../shared."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, SHARED  # noqa: F401  (one home for where ../shared is: EAGLE_SHARED_DIR or beside the repo)
from tiny_models import TEST_THREADS

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]
CORPUS = [
    "Hello there, how are you today?", "I am fine, thank you. What can I do for you?",
    "Tell me a story about a cat.", "Once upon a time a little cat lived in a big house.",
    "What is two plus two?", "Two plus two is four.", "The quick brown fox jumps over the lazy dog.",
    "Can you help me write a poem?", "Sure, here is a short poem about the sea and the sky.",
]


def build_tokenizer(chat_template: str | None = "chatml"):
    """A byte-level BPE tokenizer (~400 tokens) trained on CORPUS, with a shipped chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from recipes.chat_templates import read_template

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template:
        fast.chat_template = read_template(chat_template)
    return fast


# a thinking / tool-calling target's added tokens: added, not special (Qwen3's <think> and <tool_call> are so too),
# so decoding a generated reply keeps them
REASONING_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                    "<|python_tag|>"]


def build_reasoning_tokenizer(chat_template: str = "qwen3"):
    """build_tokenizer plus the reasoning and tool-call tokens, with a thinking / tool-call template."""
    tok = build_tokenizer(None)
    tok.add_tokens(REASONING_TOKENS, special_tokens=False)
    from recipes.chat_templates import read_template

    tok.chat_template = read_template(chat_template)
    return tok


def build_model(vocab_size: int, seed: int = 0, hidden_size: int = 32):
    """A 2-layer random Llama (fixed init)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model


def save_target(path: Path, chat_template: str | None = "chatml", seed: int = 0) -> Path:
    """Save tokenizer + model as an HF folder usable as `target.path`."""
    tok = build_tokenizer(chat_template)
    model = build_model(len(tok), seed)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_sharegpt(path: Path, n: int, multi_turn_every: int = 3) -> Path:
    recs = []
    for i in range(n):
        conv = [{"from": "human", "value": CORPUS[i % len(CORPUS)]}, {"from": "gpt", "value": CORPUS[(i + 1) % len(CORPUS)]}]
        if i % multi_turn_every == 0:
            conv += [{"from": "human", "value": "And then?"}, {"from": "gpt", "value": "The end."}]
        recs.append({"id": f"c{i}", "conversations": conv})
    path.write_text(json.dumps(recs))
    return path


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models run fastest single-threaded, and 2 busy cores make multi-threaded torch crawl."""
    before = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(before)
