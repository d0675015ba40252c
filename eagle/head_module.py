"""What every head module shares: the kind it implements, its dtype and device, and writing it as a head folder."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from torch import nn

from eagle.head_files import (CONFIG_NAME, LEGACY_WEIGHTS_NAME, SAFE_WEIGHTS_NAME, load_weights, read_head_config,
                              resolve_head_files)
from eagle.head_kinds import HeadConfigError, HeadKind, text_config


class HeadModule(nn.Module):
    """The base of the head modules. A subclass names the kind it implements, `class EagleHead(HeadModule,
    kind=EAGLE2)`, which makes it that kind's `module`. dtype and device are those of `fc` (never the frozen
    embedding)."""

    kind: HeadKind

    def __init_subclass__(cls, kind: HeadKind | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if kind is not None:
            cls.kind = kind
            kind.register(cls)

    @classmethod
    def check_kind(cls, config, where: str = "the config") -> None:
        """HeadConfigError unless `config` describes a head of this module's kind."""
        if config.head_kind is not cls.kind:
            raise HeadConfigError(f"{where} describes an {config.head_kind.title} head (kind={config.kind!r}), not an "
                                  f"{cls.kind.title} one (kind={cls.kind.name!r}): load it with "
                                  f"{config.head_kind.module.__name__} / load_head")

    @classmethod
    def from_pretrained(cls, path_or_hub_id: str | Path, dtype: torch.dtype | None = None, revision: str | None = None,
                        device: str | torch.device | None = None) -> "HeadModule":
        """Load a head folder of this module's kind from a local dir or the Hub; the kind's `from_state_dict` checks
        every key and shape (one-line errors). `embed_tokens` stays empty until `bind_target` when the folder lacks it."""
        config_file, weights_file = resolve_head_files(str(path_or_hub_id), revision)
        config = read_head_config(config_file)
        cls.check_kind(config, config_file)
        return cls.from_state_dict(config, load_weights(weights_file), str(weights_file), dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def bind_target(self, target_model) -> "HeadModule":
        """Check the head fits `target_model` (an HF causal LM: hidden size, vocabulary, what its kind needs, e.g.
        EAGLE-3's aux layers, resolving the default) and, unless the kind's checkpoints carry it, copy the target's
        input embedding into `embed_tokens`."""
        t, emb = text_config(target_model.config), target_model.get_input_embeddings().weight
        self.kind.fit_to_target(self.config, SimpleNamespace(hidden_size=t.hidden_size, vocab_size=emb.shape[0],
                                                             num_hidden_layers=t.num_hidden_layers))
        if not self.kind.saves_embedding:
            with torch.no_grad():
                self.embed_tokens.weight.copy_(emb.detach().to(self.embed_tokens.weight))
        return self

    def official_state_dict(self) -> dict[str, torch.Tensor]:
        """The released keys, no buffers that are not weights; without the target's embedding unless the kind's
        checkpoints carry it."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()
                if self.kind.saves_embedding or not k.startswith("embed_tokens")}

    def save_pretrained(self, save_directory: str | Path, legacy_bin: bool = False, dtype: torch.dtype | None = None):
        """Write config.json + model.safetensors (and pytorch_model.bin when legacy_bin) in the kind's released
        layout; floating tensors in `dtype` (integer / bool buffers, EAGLE-3's d2t and t2d, keep theirs)."""
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        sd = self.official_state_dict()
        if dtype is not None:
            sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        cfg = self.config.to_dict()
        cfg["torch_dtype"] = str(next(v for v in sd.values() if v.is_floating_point()).dtype).replace("torch.", "")
        (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(sd, str(out / SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        if legacy_bin:
            torch.save(sd, out / LEGACY_WEIGHTS_NAME)
        return out


def count_parameters(head: HeadModule) -> int:
    """Trainable parameters (the embedding is the target's, frozen)."""
    return sum(p.numel() for n, p in head.named_parameters() if not n.startswith("embed_tokens"))
