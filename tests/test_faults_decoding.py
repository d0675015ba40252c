"""Fault tier, decoding class: eagenerate / naivegenerate / ea_generate refuse arguments they cannot honour (a clear
ValueError naming the argument, nothing generated, the model usable afterwards); the evaluation CLI turns them into
one line; top_p >= 1 means no nucleus cut."""
from __future__ import annotations

import math

import pytest
import torch

from eagle import EaModel
from fault_helpers import assert_one_line_error, run_cli
from tiny_models import random_head, single_thread, tiny_target  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model():
    target = tiny_target("llama", max_position_embeddings=64)
    return EaModel(target, random_head(target))


PROMPT = torch.tensor([[3, 7, 11, 5]])

BAD = [  # (kwargs, needle)
    ({"max_new_tokens": -1}, "max_new_tokens=-1"),
    ({"max_new_tokens": 2.5}, "max_new_tokens=2.5"),
    ({"max_new_tokens": True}, "max_new_tokens=True"),
    ({"temperature": math.nan}, "temperature=nan"),
    ({"temperature": math.inf}, "temperature=inf"),
    ({"temperature": -0.5}, "temperature=-0.5"),
    ({"top_p": math.nan}, "top_p=nan"),
    ({"top_p": -0.1}, "top_p=-0.1"),
    ({"top_k": math.nan}, "top_k=nan"),
    ({"top_k": 2.5}, "top_k=2.5"),
    ({"top_k": -1}, "top_k=-1"),
    ({"max_length": 65}, "max_position_embeddings=64"),
    ({"max_length": 0}, "max_length=0"),
    ({"max_length": 32.0}, "max_length=32.0"),
]


@pytest.mark.parametrize("kwargs,needle", BAD, ids=[f"{next(iter(k))}={next(iter(k.values()))}" for k, _ in BAD])
def test_bad_decoding_argument_is_refused(model, kwargs, needle):
    ref = model.naivegenerate(PROMPT, max_new_tokens=8)
    for call in (model.eagenerate, model.naivegenerate, lambda p, **kw: list(model.ea_generate(p, **kw))):
        with pytest.raises(ValueError) as e:
            call(PROMPT, **{"max_new_tokens": 8, **kwargs})
        assert needle in str(e.value) and "\n" not in str(e.value)
    assert torch.equal(model.naivegenerate(PROMPT, max_new_tokens=8), ref)  # nothing left half-done


def test_default_max_length_is_capped_by_the_target_and_raising_it_is_explicit(model):
    out = model.naivegenerate(PROMPT, max_new_tokens=500, eos_token_id=[])
    assert out.shape[1] == 64  # min(2048, max_position_embeddings)
    config = model.base_model.config
    try:
        config.max_position_embeddings = 80  # the user raises the limit explicitly
        assert model.eagenerate(PROMPT, max_new_tokens=500, max_length=80, eos_token_id=[]).shape[1] == 80
    finally:
        config.max_position_embeddings = 64
    assert model.eagenerate(PROMPT, max_new_tokens=0).shape[1] == PROMPT.shape[1]


def test_top_p_of_one_or_more_is_no_nucleus_cut(model):
    outs = [model.eagenerate(PROMPT, temperature=1.0, top_p=p, max_new_tokens=12,
                             generator=torch.Generator().manual_seed(5)) for p in (0.0, 1.0, 1.5)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_evaluation_cli_refuses_a_length_beyond_the_target(tmp_path, capsys, model):
    from evaluation.main import main

    model.base_model.save_pretrained(tmp_path / "target")
    model.ea_layer.save_pretrained(tmp_path / "head")
    (tmp_path / "q.txt").write_text("1 2 3\n")
    code, _, err = run_cli(main, ["--recipe", "tiny", "--base", tmp_path / "target", "--head", tmp_path / "head",
                                  "--questions", f"{tmp_path / 'q.txt'}", "--out", tmp_path / "eval",
                                  "target.dtype=float32", "eval.max_length=100", "eval.warmup=0",
                                  "eval.methods=[vanilla]"], capsys)
    assert_one_line_error(code, err, "eval.max_length=100", "max_position_embeddings=64")
