"""Decoding methods compared in one evaluation run.

A method spec is `NAME[@HEAD][:key=value,...]`:
  vanilla  - `EaModel.naivegenerate` (same target implementation and KV cache)
  chain    - DecodingConfig mode "chain"
  eagle1   - mode "static" (EAGLE-1 choice tree)
  eagle2   - mode "dynamic" (EAGLE-2 tree)
  tuned    - the head's tree_config.json (written by the `autotune` command)
The keys override fields of the base DecodingConfig (the recipe's `decoding` section), e.g.
"eagle2:total_token=30,depth=4,top_k=8" or "chain:chain_length=3"; a boolean is true or false, a count an integer,
a name one of its choices. Anything else (an unknown NAME, option or HEAD, `@` with nothing after it) is refused
with one line listing what is accepted (`MethodSpecError`).

Two heads in one interleaved run (e.g. an EAGLE-2 and an EAGLE-3 head on one target, paired per prompt):
HEAD is `A` (eval.head_path, the default) or `B` (eval.compare_head), e.g.
    eval.methods=[vanilla, eagle2, eagle2@B, "eagle2:depth=8", "eagle2@B:depth=8"]
When no spec names a head, every speculative method is repeated with head B as "LABEL[B]" (the older shorthand).
Either head may be EAGLE-2 or EAGLE-3 (`Method.describe` names the kind).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from eagle.cli_errors import UserError
from eagle.decoding_config import DRAFT_SAMPLING, TREE_MODES, DecodingConfig
from eagle.ea_model import CALIBRATION_KEY, TREE_CONFIG, TREE_CONFIG_NAME, load_tree_config
from eagle.state_files import read_json_state
from eagle.static_trees import STATIC_TREES, static_choices

METHOD_MODES = {"vanilla": "vanilla", "chain": "chain", "eagle1": "static", "eagle2": "dynamic"}
NAMES = (*METHOD_MODES, "tuned")
HEADS = ("A", "B")


@dataclass(frozen=True)
class Method:
    label: str  # unique name in reports, e.g. "eagle2" or "eagle2:total_token=30" or "eagle2[B]"
    decoding: DecodingConfig
    head: str = "A"  # which loaded head drafts ("A" = eval.head_path, "B" = eval.compare_head)
    head_kind: str = ""  # "eagle2" | "eagle3" once the heads are loaded (for reports)

    @property
    def is_vanilla(self) -> bool:
        return self.decoding.mode == "vanilla"

    def describe(self) -> str:
        """The fields of the decoding config that matter for its mode, e.g. "dynamic 60/5/10"."""
        d = self.decoding
        shape = {"vanilla": "naivegenerate", "chain": f"chain of {d.chain_length}",
                 "static": f"static tree {d.static_choices}",
                 "dynamic": f"dynamic total_token={d.total_token} depth={d.depth} top_k={d.top_k}"}[d.mode]
        kind = f" ({self.head_kind})" if self.head_kind else ""
        return shape + ("" if self.head == "A" and not kind else f", head {self.head}{kind}")


class MethodSpecError(UserError, ValueError):
    """A method spec that does not follow the grammar; the one-line message lists what is accepted."""


GRAMMAR = "NAME[@HEAD][:key=value,...]"
BOOLEAN = {"true": True, "false": False}
_OPTION_KINDS = {"int": "an integer", "bool": "true or false", "str": "a name"}
OPTIONS = tuple(f.name for f in dataclasses.fields(DecodingConfig) if f.name != "mode")  # the mode is the NAME


def option_values(key: str) -> str:
    """What the option `key` of a method spec accepts, e.g. "an integer" or "one of greedy, probabilistic"."""
    choices = {"mode": TREE_MODES, "draft_sampling": DRAFT_SAMPLING, "static_choices": tuple(STATIC_TREES)}.get(key)
    return f"one of {', '.join(choices)}" if choices else _OPTION_KINDS[type(getattr(DecodingConfig(), key)).__name__]


def options_listing() -> str:
    return "; ".join(f"{k} ({option_values(k)})" for k in OPTIONS)


def parse_option(spec: str, item: str, seen: dict):
    """One `key=value` of a spec's option list: (key, value typed as the DecodingConfig field), or MethodSpecError."""
    key, eq, text = (x.strip() for x in item.partition("="))
    if not eq or not key:
        raise MethodSpecError(f"method {spec!r}: {item!r} is not key=value (spec grammar {GRAMMAR}); options: "
                              f"{options_listing()}")
    if key not in OPTIONS:
        raise MethodSpecError(f"method {spec!r}: unknown option {key!r}; options: {options_listing()}"
                              + (" (the mode is the method NAME)" if key == "mode" else ""))
    if key in seen:
        raise MethodSpecError(f"method {spec!r}: option {key} given twice")
    default = getattr(DecodingConfig(), key)
    if isinstance(default, bool):
        if text.lower() not in BOOLEAN:
            raise MethodSpecError(f"method {spec!r}: {key}={text!r}: expected true or false")
        return key, BOOLEAN[text.lower()]
    if isinstance(default, int):
        try:
            return key, int(text)
        except ValueError:
            raise MethodSpecError(f"method {spec!r}: {key}={text!r}: expected an integer") from None
    if not text:
        raise MethodSpecError(f"method {spec!r}: {key} is empty: expected {option_values(key)}")
    return key, text


def parse_method(spec: str, base: DecodingConfig, head_dir: Path | None = None,
                 compare_dir: Path | None = None) -> Method:
    """`NAME[@HEAD][:key=value,...]` -> Method (see the module docstring). `tuned` reads the tree saved beside the
    head that drafts: head_dir for head A, compare_dir for head B. Anything off the grammar (an unknown NAME, an empty
    or unknown HEAD after @, an unknown option, a value of the wrong kind: a boolean other than true/false, a
    non-integer count, a name outside its choices) is one MethodSpecError listing what is accepted."""
    if not isinstance(spec, str) or not spec.strip():
        raise MethodSpecError(f"method {spec!r}: empty; expected {GRAMMAR} with NAME one of {NAMES}")
    head_part, colon, args = spec.partition(":")
    name, at, head = (x.strip() for x in head_part.partition("@"))
    if name not in NAMES:
        raise MethodSpecError(f"unknown method {name!r} in {spec!r}: expected one of {NAMES} ({GRAMMAR})")
    if at and head not in HEADS:
        what = "nothing" if not head else repr(head)
        raise MethodSpecError(f"method {spec!r}: {what} after @; expected a head, one of {HEADS} "
                              "(A = eval.head_path, B = eval.compare_head), or no @ for head A")
    head = head or "A"
    if colon and not args.strip():
        raise MethodSpecError(f"method {spec!r}: nothing after ':'; expected key=value,... (options: "
                              f"{options_listing()}) or no ':'")
    changes: dict = {}
    for item in args.split(",") if colon else []:
        key, value = parse_option(spec, item, changes)
        changes[key] = value
    decoding = load_tuned(compare_dir if head == "B" else head_dir) if name == "tuned" else \
        dataclasses.replace(base, mode=METHOD_MODES[name])
    try:
        decoding = dataclasses.replace(decoding, **changes).validate()
        if decoding.mode == "static":
            static_choices(decoding.static_choices)
    except ValueError as e:
        raise MethodSpecError(f"method {spec!r}: {' '.join(str(e).split())}") from None
    return Method(label=spec.strip(), decoding=decoding, head=head)


def parse_methods(specs: list[str], base: DecodingConfig, head_dir: Path | None = None,
                  compare_head: bool = False, compare_dir: Path | None = None) -> list[Method]:
    """Parse every spec; vanilla is always present and first (the baseline of every speedup).
    With `compare_head` and no spec naming a head (`@A` / `@B`), every speculative method is repeated with head B
    as "LABEL[B]"; a spec naming head B without a compare head is an error."""
    methods = [parse_method(s, base, head_dir, compare_dir) for s in specs]
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate methods in {labels}")
    vanilla = [m for m in methods if m.is_vanilla] or [Method("vanilla", dataclasses.replace(base, mode="vanilla"))]
    spec_methods = [m for m in methods if not m.is_vanilla]
    explicit = any("@" in s.partition(":")[0] for s in specs)
    if any(m.head == "B" for m in methods) and not compare_head:
        raise ValueError(f"methods {[m.label for m in methods if m.head == 'B']} use head B, but eval.compare_head "
                         "(--compare-head) is not set")
    if compare_head and not explicit:
        on_b = []
        for m in spec_methods:  # parsed again for head B: "tuned" then reads head B's own tree
            name, sep, args = m.label.partition(":")
            on_b.append(dataclasses.replace(parse_method(f"{name}@B{sep}{args}", base, head_dir, compare_dir),
                                            label=f"{m.label}[B]"))
        spec_methods += on_b
    return vanilla[:1] + spec_methods


def load_tuned(head_dir: Path | None) -> DecodingConfig:
    """The DecodingConfig the `autotune` command saved next to a head (an error when there is none)."""
    path = None if head_dir is None else Path(head_dir) / TREE_CONFIG_NAME
    saved = None if path is None else read_json_state(path, TREE_CONFIG)
    if not set(saved or {}) - {CALIBRATION_KEY}:
        raise FileNotFoundError(f"method 'tuned': no tuned tree in {path or head_dir}; run "
                                f"`python -m evaluation autotune ...` first")
    return load_tree_config(head_dir)
