"""A head kind is one object: everything the library knows that differs between EAGLE-2 and EAGLE-3 heads.

    kind = head_kind("eagle3")            # or config.head_kind, or head.kind (a head's module class names its kind)
    kind.module                            # Eagle3Head: the nn.Module (registered by `class Eagle3Head(HeadModule, kind=EAGLE3)`)
    kind.feature_layers(aux, L)            # which target hidden states it reads: the feature-cache layout
    kind.draft_vocab_size(config)          # the tokens one draft step chooses from
    kind.config_dict(config)               # its config.json layout (and parse_config / check_config / fit_to_target)

`HEAD_KINDS` maps every kind name (recipe `head.kind`, `HeadConfig.kind`) to its object. The stages keep their own
per-kind part in one file each, keyed by these objects (recipes/head.py, train/head_kinds.py, export/head_kinds.py);
docs/design.md "Adding a head kind" lists every place a new kind touches.

Aux layer ids (EAGLE-3) are HF `output_hidden_states` indices: id j = the residual stream ENTERING decoder layer j
(0 = the embeddings); a cache's last layer id L (= num_hidden_layers) is the final, normed output.
"""
from __future__ import annotations

import importlib

import torch

N_AUX_LAYERS = 3  # EAGLE-3 fuses three target layers (low, middle, high): fc is [H, 3H]


class HeadConfigError(ValueError):
    """A head config, checkpoint or target that does not fit: the one-line message names the mismatch."""


EAGLE31_NORMS = ("norm_before_fc", "fc_norm", "norm_output")  # EAGLE-3.1's options of an EAGLE-3 head (HeadConfig)


def text_config(target_config):
    """The language-model part of a (possibly multimodal) HF config."""
    return target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config


def default_aux_layers(num_layers: int) -> list[int]:
    """The common EAGLE-3 default (2, L//2, L-3) for an L-layer target (ids: see `check_aux_layers`)."""
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layers(ids, num_layers: int | None = None) -> list[int]:
    """Validate EAGLE-3 aux layer ids: 3 strictly increasing HF `output_hidden_states` indices, each in [0, L-1]
    (id j = the state ENTERING decoder layer j, 0 = the embeddings; L, the final normed output, is not a valid id)."""
    ids = list(ids)
    if len(ids) != N_AUX_LAYERS or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise HeadConfigError(f"aux_layers={ids}: EAGLE-3 needs exactly {N_AUX_LAYERS} integer layer ids")
    if num_layers is not None:
        bad = [i for i in ids if not 0 <= i < num_layers]
        if bad:
            raise HeadConfigError(
                f"aux layer id(s) {bad} out of range for a {num_layers}-layer target: ids are HF hidden_states indices "
                f"0..{num_layers - 1} (0 = embeddings, j = the input of decoder layer j)")
    elif min(ids) < 0:
        raise HeadConfigError(f"aux_layers={ids}: ids must be >= 0 (HF hidden_states indices, 0 = embeddings)")
    if any(a >= b for a, b in zip(ids, ids[1:])):
        raise HeadConfigError(f"aux_layers={ids} must be strictly increasing (distinct low < middle < high layers)")
    return ids


def fitted_aux_layers(aux_layers, num_layers: int) -> list[int]:
    """A head's aux ids checked against an L-layer target; None = the default (2, L//2, L-3), which must fit too."""
    if aux_layers is not None:
        return check_aux_layers(aux_layers, num_layers)
    try:
        return check_aux_layers(default_aux_layers(num_layers), num_layers)
    except HeadConfigError as e:
        raise HeadConfigError(f"the head names no aux layers and the default does not fit a "
                              f"{num_layers}-layer target: {e}") from None


def draft_vocab_problems(vocab_size: int, draft_vocab_size: int, d2t, t2d=None) -> tuple[list[str], torch.Tensor | None]:
    """What is wrong with an EAGLE-3 draft vocabulary (d2t int [Vd]: target id = draft id + d2t[draft id]; t2d bool
    [V], optional): lengths, target ids in range and distinct, t2d marking exactly d2t's ids. Returns (problems, the
    t2d mask d2t implies; None when d2t is unusable). Shared by `Eagle3Head.set_vocab` and every export
    (eagle/head_checks.py)."""
    d2t = torch.as_tensor(d2t).flatten().cpu()
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        return [f"d2t has dtype {d2t.dtype}, expected an integer tensor"], None
    d2t = d2t.long()
    if d2t.numel() != draft_vocab_size:
        return [f"d2t has {d2t.numel()} entries, draft_vocab_size is {draft_vocab_size}"], None
    target_ids = torch.arange(d2t.numel()) + d2t  # [Vd]
    outside = (target_ids < 0) | (target_ids >= vocab_size)  # [Vd] bool
    if bool(outside.any()):
        first = int(outside.nonzero()[0])
        return [f"d2t maps {int(outside.sum())} draft id(s) outside the target vocabulary [0, {vocab_size}) "
                f"(draft id {first} -> target id {int(target_ids[first])})"], None
    derived = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, target_ids, True)  # [V] bool
    if int(derived.sum()) != d2t.numel():
        return ["d2t maps two draft ids to the same target id"], None
    if t2d is not None:
        t2d = torch.as_tensor(t2d).flatten().cpu()
        if t2d.numel() != vocab_size:
            return [f"t2d has {t2d.numel()} entries, the target vocabulary (vocab_size) has {vocab_size}"], derived
        if not torch.equal(t2d.bool(), derived):
            return ["t2d does not mark exactly the target ids that d2t maps to"], derived
    return [], derived


def llama_layer_config(c, architecture: str, after_vocab: dict, after_act: dict) -> dict:
    """A one-layer LlamaConfig dict of HeadConfig `c`, the kind's own keys in their released places."""
    return {"architectures": [architecture], "model_type": "llama", "num_hidden_layers": 1, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
            **after_vocab, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
            "max_position_embeddings": c.max_position_embeddings, "hidden_act": c.hidden_act, **after_act,
            "pad_token_id": c.pad_token_id, "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
            "torch_dtype": c.torch_dtype}


class HeadKind:
    """What a head kind is, for the library. Subclasses override what differs; `module` is the nn.Module class."""

    name: str
    title: str
    saves_embedding: bool  # the checkpoint carries the target's embedding (else the target's is bound at load)
    module_file: str = ""  # the library module defining the kind's nn.Module, imported on first use of `module`
    _module: type | None = None

    @property
    def module(self) -> type:
        """The head's nn.Module class (it names this kind: `class EagleHead(HeadModule, kind=EAGLE2)`); its module
        (`module_file`) is imported on first use, so no other file has to import it for the kind to work."""
        if self._module is None and self.module_file:
            importlib.import_module(self.module_file)  # registers the class (HeadModule.__init_subclass__)
        if self._module is None:
            raise HeadConfigError(f"no module class implements head kind {self.name!r}")
        return self._module

    def register(self, module: type) -> None:
        self._module = module

    def __repr__(self) -> str:
        return f"<head kind {self.name}>"

    # -- config ------------------------------------------------------------------------
    def check_config(self, c) -> None:
        """Check (and complete) the kind's fields of a HeadConfig `c`, at construction."""

    def recognises(self, d: dict) -> bool:
        """True when a config.json without a `kind` key describes a head of this kind."""
        return False

    def parse_config(self, d: dict) -> tuple[dict, dict]:
        """Take this kind's keys out of a config.json dict `d`: (HeadConfig kwargs, keys kept in `extra`)."""
        return {}, {}

    def config_dict(self, c) -> dict:
        """The config.json dict of HeadConfig `c` in this kind's released layout."""
        raise NotImplementedError

    def from_target(self, kwargs: dict, num_layers: int, aux_layers, draft_vocab_size) -> dict:
        """HeadConfig kwargs for an L-layer target, from the shape kwargs every kind shares."""
        return kwargs

    def fit_to_target(self, c, target_text_config) -> None:
        """Check HeadConfig `c` fits a target (`target_text_config`: its hidden_size, vocab_size, num_hidden_layers; a
        one-line HeadConfigError) and complete what the target decides (EAGLE-3: the default aux layers)."""
        t = target_text_config
        if c.hidden_size != t.hidden_size:
            raise HeadConfigError(f"head hidden_size={c.hidden_size} does not match the target's hidden_size={t.hidden_size}")
        vocab = getattr(t, "vocab_size", None)
        if vocab is not None and c.vocab_size != vocab:
            raise HeadConfigError(f"head vocab_size={c.vocab_size} does not match the target's vocabulary ({vocab})")

    # -- which target states it reads, and what it drafts from ----------------------------
    def feature_layers(self, aux_layers: list[int], num_layers: int) -> list[int] | None:
        """The target hidden-state ids the head trains on, in cache order (None = the final state only: the layout
        of every EAGLE-2 cache). aux_layers: the recipe's `head.aux_layers` ([] = the kind's default)."""
        return None

    def head_inputs(self, features, hidden_size: int):
        """The part of a cached feature row [..., W] the head reads (the final state is always the last H)."""
        return features

    def draft_inputs(self, config) -> tuple[int, ...] | None:
        """Hidden-state ids the target hands the drafter while decoding (None = its final hidden state)."""
        return None

    def draft_vocab_size(self, config) -> int:
        """How many tokens a draft step chooses from."""
        return config.vocab_size

    def optional_weights(self, config) -> set[str]:
        """Tensors a checkpoint of this kind may leave out."""
        return set()

    def weight_problems(self, config, state_dict: dict) -> list[str]:
        """What the kind's non-weight tensors get wrong beyond their shapes (EAGLE-3: the draft vocabulary maps);
        eagle/head_checks.py adds the checks every kind shares."""
        return []


class Eagle2Kind(HeadKind):
    """EAGLE-1/2: fc over [embed(token), the target's final hidden state]; predicts the next feature; drafts through
    the target's own lm_head over the full vocabulary. The released yuhuili/EAGLE-* layout."""

    name, title, saves_embedding, module_file = "eagle2", "EAGLE-2", True, "eagle.eagle2"

    def check_config(self, c) -> None:
        if c.aux_layers is not None or c.draft_vocab_size is not None:
            raise HeadConfigError("aux_layers / draft_vocab_size are EAGLE-3 settings: set kind='eagle3'")
        if any(getattr(c, k) for k in EAGLE31_NORMS):
            raise HeadConfigError(f"{', '.join(k for k in EAGLE31_NORMS if getattr(c, k))}: EAGLE-3.1 settings of an "
                                  "EAGLE-3 head: set kind='eagle3'")

    def config_dict(self, c) -> dict:
        """Official-format config dict (what the reference code reads as a LlamaConfig)."""
        d = llama_layer_config(c, "LlamaForCausalLM", after_vocab={}, after_act={"bias": c.bias})
        if c.qkv_bias:
            d["qkv_bias"] = True
        return {**c.extra, **d}


class Eagle3Kind(HeadKind):
    """EAGLE-3: fc over three target layers (aux), its own lm_head over a draft vocabulary (d2t / t2d), trained on its
    own outputs (the training-time test). The released yuhuili/EAGLE3-* / SpecForge layout."""

    name, title, saves_embedding, module_file = "eagle3", "EAGLE-3", False, "eagle.eagle3"

    def check_config(self, c) -> None:
        c.bias = False  # EAGLE-3's fc has no bias
        if c.draft_vocab_size is None:
            c.draft_vocab_size = c.vocab_size
        if not 1 <= c.draft_vocab_size <= c.vocab_size:
            raise HeadConfigError(f"draft_vocab_size={c.draft_vocab_size} must be in [1, vocab_size={c.vocab_size}]")
        if c.aux_layers is not None:
            c.aux_layers = check_aux_layers(c.aux_layers)

    def recognises(self, d: dict) -> bool:
        return "draft_vocab_size" in d or any("eagle3" in str(a).lower() for a in d.get("architectures") or [])

    def parse_config(self, d: dict) -> tuple[dict, dict]:
        eagle_config = dict(d.pop("eagle_config", None) or {})
        aux = eagle_config.pop("eagle_aux_hidden_state_layer_ids", None)
        top = d.pop("eagle_aux_hidden_state_layer_ids", None)
        aux = top if aux is None else aux
        eagle_config.pop("use_aux_hidden_state", None)  # always true for EAGLE-3; written back by config_dict
        if "norm_before_fc" in eagle_config:  # vLLM reads it there first, then at the top level
            d["norm_before_fc"] = bool(eagle_config.pop("norm_before_fc"))
        if d.get("norm_before_residual"):
            raise HeadConfigError("head config has norm_before_residual=true (the residual starts at hidden_norm's "
                                  "output): this project's EAGLE-3 head keeps the released residual (the un-normed fc "
                                  "output); convert or retrain the head")
        d.pop("norm_before_residual", None)
        d.pop("bias", None)  # EAGLE-3's fc has no bias
        d.pop("tie_word_embeddings", None)
        if "attention_bias" in d:  # the q/k/v bias of its layer
            d.setdefault("qkv_bias", bool(d["attention_bias"]))
            del d["attention_bias"]
        target_h = d.get("target_hidden_size")
        if target_h is not None and target_h != d.get("hidden_size"):
            raise HeadConfigError(f"head config has target_hidden_size={target_h} != hidden_size="
                                  f"{d.get('hidden_size')}: heads narrower than their target are not supported")
        return {"kind": self.name, "aux_layers": aux}, ({"eagle_config": eagle_config} if eagle_config else {})

    def config_dict(self, c) -> dict:
        """The released EAGLE-3 layout (yuhuili/EAGLE3-*, SpecForge): a one-layer LlamaConfig with
        `draft_vocab_size` and `architectures: ["LlamaForCausalLMEagle3"]` (what SGLang requires; vLLM maps it to its
        EAGLE-3 Llama), the aux ids in `eagle_config.eagle_aux_hidden_state_layer_ids` (read by vLLM)."""
        d = llama_layer_config(c, "LlamaForCausalLMEagle3", after_vocab={"draft_vocab_size": c.draft_vocab_size},
                               after_act={"attention_bias": c.qkv_bias, "tie_word_embeddings": False})
        extra = dict(c.extra)
        eagle_config = dict(extra.pop("eagle_config", None) or {})
        if c.aux_layers is not None:
            eagle_config.update(eagle_aux_hidden_state_layer_ids=list(c.aux_layers), use_aux_hidden_state=True)
        if eagle_config:
            d["eagle_config"] = eagle_config
        d.update({k: True for k in EAGLE31_NORMS if getattr(c, k)})  # written only when on: older heads unchanged
        return {**extra, **d}

    def from_target(self, kwargs: dict, num_layers: int, aux_layers, draft_vocab_size) -> dict:
        ids = default_aux_layers(num_layers) if aux_layers is None else list(aux_layers)
        try:
            ids = check_aux_layers(ids, num_layers)
        except HeadConfigError as e:
            if aux_layers is not None:
                raise
            raise HeadConfigError(f"the default aux layers {ids} do not fit a {num_layers}-layer target ({e}); "
                                  f"set aux_layers explicitly") from None
        return {**kwargs, "bias": False, "qkv_bias": False, "kind": self.name, "aux_layers": ids,
                "draft_vocab_size": draft_vocab_size}

    def fit_to_target(self, c, target_text_config) -> None:
        t = target_text_config
        if c.hidden_size != t.hidden_size:
            raise HeadConfigError(f"EAGLE-3 head hidden_size={c.hidden_size} (fc reads 3 x {c.hidden_size}) "
                                  f"does not fit the target's hidden_size={t.hidden_size}")
        vocab = getattr(t, "vocab_size", None)
        if vocab is not None and c.vocab_size != vocab:
            raise HeadConfigError(f"EAGLE-3 head vocab_size={c.vocab_size} does not match the target's vocabulary ({vocab})")
        c.aux_layers = fitted_aux_layers(c.aux_layers, t.num_hidden_layers)

    def feature_layers(self, aux_layers: list[int], num_layers: int) -> list[int]:
        """[a, b, c, L]: the three aux states (the head's input) + the final state (the token loss's target)."""
        return [*check_aux_layers(list(aux_layers) or default_aux_layers(num_layers), num_layers), num_layers]

    def head_inputs(self, features, hidden_size: int):
        return features[..., :-hidden_size]  # the aux states [..., 3H]

    def draft_inputs(self, config) -> tuple[int, ...]:
        return tuple(config.aux_layers)

    def draft_vocab_size(self, config) -> int:
        return config.draft_vocab_size

    def optional_weights(self, config) -> set[str]:
        """The target's embedding and t2d (derived from d2t); d2t too for a full draft vocabulary."""
        return {"embed_tokens.weight", "t2d"} | ({"d2t"} if config.draft_vocab_size == config.vocab_size else set())

    def weight_problems(self, config, state_dict: dict) -> list[str]:
        """d2t / t2d: in range, distinct, consistent (`draft_vocab_problems`); d2t required for a partial vocabulary."""
        d2t, t2d = state_dict.get("d2t"), state_dict.get("t2d")
        if d2t is None:
            return [] if config.draft_vocab_size == config.vocab_size else [
                f"no d2t but draft_vocab_size={config.draft_vocab_size} < vocab_size={config.vocab_size}"]
        return draft_vocab_problems(config.vocab_size, config.draft_vocab_size, d2t, t2d)[0]


class PeagleKind(Eagle3Kind):
    """P-EAGLE (parallel drafting): an EAGLE-3 head (aux layers, draft vocabulary) that drafts all k tokens in ONE
    forward. Draft positions 2..k read the mask token `mask_token_id` (a target token id, through the target's frozen
    embedding) and the learned `mask_hidden` [1, 3H] (aux space, fused by fc like the target's aux states): vLLM's
    speculators `peagle` layout (`PeagleLlamaForCausalLM`, `mask_token_id` -> `pard_token`), served with
    `"method": "eagle3", "parallel_drafting": true`. The id lives in the config's `mask_token_id` key (HeadConfig.extra)."""

    name, title, module_file = "peagle", "P-EAGLE", "eagle.peagle"
    architecture = "PeagleLlamaForCausalLM"

    def check_config(self, c) -> None:
        super().check_config(c)
        m = c.extra.get("mask_token_id")
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m < c.vocab_size:
            raise HeadConfigError(f"mask_token_id={m!r}: a P-EAGLE head needs the mask token's id, an integer in "
                                  f"[0, vocab_size={c.vocab_size})")

    def recognises(self, d: dict) -> bool:
        return "mask_token_id" in d or any("peagle" in str(a).lower() for a in d.get("architectures") or [])

    def parse_config(self, d: dict) -> tuple[dict, dict]:
        kwargs, extra = super().parse_config(d)  # mask_token_id stays in d: HeadConfig keeps it in `extra`
        return {**kwargs, "kind": self.name}, extra

    def config_dict(self, c) -> dict:
        """The EAGLE-3 released layout with `architectures: ["PeagleLlamaForCausalLM"]` and `mask_token_id`."""
        return {**super().config_dict(c), "architectures": [self.architecture]}

    def from_target(self, kwargs: dict, num_layers: int, aux_layers, draft_vocab_size) -> dict:
        """As EAGLE-3's, with the mask token id 0 until the trainer picks one (`with_mask_token`)."""
        out = super().from_target(kwargs, num_layers, aux_layers, draft_vocab_size)
        return {**out, "kind": self.name, "extra": {**out.get("extra", {}), "mask_token_id": 0}}

    def mask_token_id(self, config) -> int:
        return int(config.extra["mask_token_id"])

    def with_mask_token(self, config, mask_token_id: int):
        """`config` with its mask token set to `mask_token_id` (checked)."""
        config.extra["mask_token_id"] = int(mask_token_id)
        self.check_config(config)
        return config


EAGLE2, EAGLE3, PEAGLE = Eagle2Kind(), Eagle3Kind(), PeagleKind()
HEAD_KINDS: dict[str, HeadKind] = {k.name: k for k in (EAGLE2, EAGLE3, PEAGLE)}
DEFAULT_KIND = EAGLE2  # a config.json with no marker of another kind: the released EAGLE-1/2 heads carry none


def head_kind(name: str) -> HeadKind:
    """The kind object of a kind name (HeadConfigError naming the valid ones)."""
    if name not in HEAD_KINDS:
        raise HeadConfigError(f"head kind={name!r}: expected one of {tuple(HEAD_KINDS)}")
    return HEAD_KINDS[name]


def kind_of_config(d: dict) -> HeadKind:
    """The kind a config.json dict describes: its `kind` key (popped), else the most specific kind that recognises it
    (a P-EAGLE config is also an EAGLE-3 one: the subclass wins)."""
    name = d.pop("kind", None)
    if name:
        return head_kind(name)
    found = [k for k in HEAD_KINDS.values() if k.recognises(d)]
    return max(found, key=lambda k: len(type(k).__mro__)) if found else DEFAULT_KIND
