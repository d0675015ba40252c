"""head.sliding_window in the engine folders: vLLM's speculators layout (EAGLE-3, P-EAGLE) carries the window where
vLLM's Llama layer reads it (transformer_layer_config.sliding_window + layer_types); a folder an engine would serve
with full attention (EAGLE-1/2 for vLLM and SGLang, EAGLE-3 for SGLang) is refused in one line and nothing written;
our own layout (--format eagle) keeps the window."""
from __future__ import annotations

import json

import pytest

from eagle.head import load_head
from eagle.sliding_window import SlidingWindowOptions, window_size
from export.cli import main
from tiny_models import random_head, single_thread, tiny_target  # noqa: F401

pytestmark = [pytest.mark.usefixtures("single_thread")]
SERVED = {"eagle2": (), "eagle3": ("vllm",), "peagle": ("vllm",)}  # the formats that honour the window


@pytest.mark.parametrize("kind", ["eagle2", "eagle3", "peagle"])
def test_windowed_heads_export_where_the_window_is_honoured_and_are_refused_elsewhere(kind, tmp_path, capsys):
    target = tiny_target("llama", num_layers=4)
    head = random_head(target, kind=kind, aux_layers=[0, 1, 3])
    if kind == "peagle":
        head.kind.with_mask_token(head.config, 9)
    head.config.options.sliding_window = SlidingWindowOptions(size=16)
    head.save_pretrained(tmp_path / "head")
    target.save_pretrained(tmp_path / "target")
    base = ["--head", str(tmp_path / "head"), "--base", str(tmp_path / "target")]
    assert main([*base, "--format", "eagle", "--out", str(tmp_path / "eagle")]) == 0
    assert window_size(load_head(tmp_path / "eagle").config.options) == 16
    for fmt in ("vllm", "sglang"):
        capsys.readouterr()
        code = main([*base, "--format", fmt, "--out", str(tmp_path / fmt)])
        if fmt in SERVED[kind]:
            assert code == 0
            layer = json.loads((tmp_path / fmt / "config.json").read_text())["transformer_layer_config"]
            assert layer["sliding_window"] == 16 and layer["layer_types"] == ["sliding_attention"]
            continue
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / fmt).exists()
        if kind != "peagle" or fmt != "sglang":  # SGLang has no P-EAGLE loader at all: that refusal comes first
            assert "sliding_window.size=16" in err and "full attention" in err


def test_full_attention_heads_export_as_before(tmp_path):
    target = tiny_target("llama", num_layers=4)
    head = random_head(target, kind="eagle3", aux_layers=[0, 1, 3])
    head.save_pretrained(tmp_path / "head")
    target.save_pretrained(tmp_path / "target")
    assert main(["--head", str(tmp_path / "head"), "--base", str(tmp_path / "target"), "--format", "vllm",
                 "--out", str(tmp_path / "v")]) == 0
    layer = json.loads((tmp_path / "v" / "config.json").read_text())["transformer_layer_config"]
    assert "sliding_window" not in layer and "layer_types" not in layer
