"""Decoding methods compared in one evaluation run.

A method spec is `NAME[@HEAD][:key=value,...]`:
  vanilla  - `EaModel.naivegenerate` (same target implementation and KV cache)
  chain    - DecodingConfig mode "chain"
  eagle1   - mode "static" (EAGLE-1 choice tree)
  eagle2   - mode "dynamic" (EAGLE-2 tree)
  tuned    - the head's tree_config.json (written by the `autotune` command)
The keys override fields of the base DecodingConfig (the recipe's `decoding` section), e.g.
"eagle2:total_token=30,depth=4,top_k=8" or "chain:chain_length=3".

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

from eagle.decoding_config import DecodingConfig
from eagle.ea_model import CALIBRATION_KEY, TREE_CONFIG, TREE_CONFIG_NAME, load_tree_config
from eagle.state_files import read_json_state

METHOD_MODES = {"vanilla": "vanilla", "chain": "chain", "eagle1": "static", "eagle2": "dynamic"}
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


def parse_method(spec: str, base: DecodingConfig, head_dir: Path | None = None,
                 compare_dir: Path | None = None) -> Method:
    """`NAME[@HEAD][:key=value,...]` -> Method (see the module docstring). `tuned` reads the tree saved beside the
    head that drafts: head_dir for head A, compare_dir for head B."""
    name, _, args = spec.partition(":")
    name, _, head = name.strip().partition("@")
    name, head = name.strip(), head.strip() or "A"
    if head not in HEADS:
        raise ValueError(f"method {spec!r}: unknown head {head!r}; expected one of {HEADS} (A = eval.head_path, "
                         f"B = eval.compare_head)")
    if name == "tuned":
        decoding = load_tuned(compare_dir if head == "B" else head_dir)
    elif name in METHOD_MODES:
        decoding = dataclasses.replace(base, mode=METHOD_MODES[name])
    else:
        raise ValueError(f"unknown method {spec!r}: expected one of {[*METHOD_MODES, 'tuned']}[:key=value,...]")
    valid = {f.name: f.type for f in dataclasses.fields(DecodingConfig)}
    changes = {}
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in valid or key == "mode":
            raise ValueError(f"method {spec!r}: bad override {item!r}; valid keys: {sorted(set(valid) - {'mode'})}")
        default = getattr(base, key)
        changes[key] = type(default)(value) if not isinstance(default, bool) else value.lower() in ("1", "true")
    decoding = dataclasses.replace(decoding, **changes).validate()
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
                                f"`python evaluation/main.py autotune ...` first")
    return load_tree_config(head_dir)
