"""The files a run writes and later reads back (state files), their shapes, and the one loader per format.

Every state file is declared once, where it is written, as a `StateFile` registered here:

    RANKS = register(StateFile("ranks.json", "OUTPUT_DIR/train/checkpoints/TAG", writer="train/checkpoint.py", schema={"world_size": int},
                               rebuild="delete the checkpoint folder to resume from an earlier one"))
    write_json_state(folder / RANKS.name, {"world_size": 2}, RANKS)     # checked against the schema, atomic
    read_json_state(folder / RANKS.name, RANKS)                         # -> the dict, or StateFileError

A file that is missing, truncated, binary garbage, of the wrong top-level type, or lacks a key / holds a key of the
wrong type is ONE line (`StateFileError`, a UserError) naming the file, what is wrong with it, and what to do
(`rebuild`: delete it and rerun the stage, or the command that rebuilds it), never a KeyError, a bare decoder
message or a silent default. A file whose absence is normal (no tuned tree yet, a fresh quickstart) declares what
absence means (`when_missing`) and its reader gets None for it.

Schemas are small and structural: a type (or a tuple of alternatives; `float` accepts ints, `int` refuses booleans),
a dict of keys to schemas (a key ending in "?" is optional; `ANY_KEY` gives the schema of every other key), or a
one-element list `[item_schema]`. A check beyond structure (a value's range, a tag's pattern) is `check`, a function
returning the problem or None. Formats: JSON (`read_json_state`), YAML (`read_yaml_state`: the recipe stored beside
a head), one line of text (`read_text_state`: `latest`); `read_state` picks the format's loader.

tests/test_state_files.py enumerates the registry and damages every file every way; it also scans the source so a
new JSON file written or read outside this module must be listed there with the reason it is not a state file.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from eagle.atomic_file import write_file_atomic
from eagle.cli_errors import FileFormatError

ANY_KEY = "*"  # in a dict schema: the schema of every key not named
Schema = Any  # type | tuple[type, ...] | dict[str, Schema] | list[Schema]


class StateFileError(FileFormatError):
    """A state file is missing or damaged; the one-line message names it and says how to rebuild it."""


@dataclass(frozen=True)
class StateFile:
    name: str  # file name as written (a pattern such as "PART.json" names the family)
    folder: str  # where it is written, e.g. "OUTPUT_DIR/train/checkpoints/TAG" (with `name`: the registry key)
    writer: str  # the module that writes it (repo-relative)
    schema: Schema  # the structure a reader relies on (module docstring)
    rebuild: str  # what to do about a missing or damaged one, e.g. "delete it and rerun data_prep"
    when_missing: str | None = None  # what absence means when it is normal (the reader then gets None)
    format: str = "json"  # "json" | "yaml" | "text"
    check: Callable[[Any], str | None] | None = None  # a problem beyond structure, or None
    example: Any = None  # a valid content (tests damage it)

    @property
    def key(self) -> str:
        return f"{self.folder}/{self.name}"


REGISTRY: dict[str, StateFile] = {}


def register(spec: StateFile) -> StateFile:
    """Declare a state file (once, beside its writer); the registry is what the tests enumerate."""
    old = REGISTRY.get(spec.key)
    if old is not None and old.writer != spec.writer:  # the same writer twice: its module also ran as __main__
        raise ValueError(f"state file {spec.key!r} declared twice ({old.writer} and {spec.writer})")
    problem = None if spec.example is None else schema_problem(spec.example, spec.schema) or (
        spec.check(spec.example) if spec.check else None)
    if problem:
        raise ValueError(f"state file {spec.name}: its example does not fit its schema: {problem}")
    REGISTRY[spec.key] = spec
    return spec


def _type_name(t) -> str:
    names = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
             bool: "true/false", type(None): "null"}
    ts = t if isinstance(t, tuple) else (t,)
    return " or ".join(names.get(x, x.__name__) for x in ts)


def _value_name(v) -> str:
    text = json.dumps(v) if isinstance(v, (str, int, float, bool, type(None))) else type(v).__name__
    return f"{_type_name(type(v))} ({text[:40]})" if not isinstance(v, (dict, list)) else _type_name(type(v))


def _is(value, t) -> bool:
    ts = t if isinstance(t, tuple) else (t,)
    if object in ts:
        return True
    if isinstance(value, bool):
        return bool in ts
    if isinstance(value, int) and float in ts:
        return True
    return isinstance(value, ts)


def schema_problem(value, schema: Schema, where: str = "") -> str | None:
    """The first place `value` departs from `schema` ("key 'shapes' missing", "world_size is a string..."), or None."""
    at = where or "the top level"
    if isinstance(schema, tuple) and any(isinstance(x, (dict, list)) for x in schema):  # e.g. ({...}, type(None))
        for alt in schema:
            if isinstance(alt, dict) and isinstance(value, dict) or isinstance(alt, list) and isinstance(value, list):
                return schema_problem(value, alt, where)
            if not isinstance(alt, (dict, list)) and _is(value, alt):
                return None
        wanted = " or ".join("an object" if isinstance(a, dict) else "a list" if isinstance(a, list) else _type_name(a)
                             for a in schema)
        return f"{at} is {_value_name(value)}, expected {wanted}"
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return f"{at} is {_value_name(value)}, expected a JSON object"
        rest = schema.get(ANY_KEY)
        for key, sub in schema.items():
            if key == ANY_KEY:
                continue
            optional = key.endswith("?")
            name = key[:-1] if optional else key
            if name not in value:
                if optional:
                    continue
                return f"key {where + '.' if where else ''}{name} missing"
            problem = schema_problem(value[name], sub, f"{where + '.' if where else ''}{name}")
            if problem:
                return problem
        if rest is not None:
            named = {k.rstrip("?") for k in schema if k != ANY_KEY}
            for key, v in value.items():
                if key not in named:
                    problem = schema_problem(v, rest, f"{where + '.' if where else ''}{key}")
                    if problem:
                        return problem
        return None
    if isinstance(schema, list):
        if not isinstance(value, list):
            return f"{at} is {_value_name(value)}, expected a JSON list"
        for i, item in enumerate(value):
            problem = schema_problem(item, schema[0], f"{where}[{i}]")
            if problem:
                return problem
        return None
    if not _is(value, schema):
        return f"{at} is {_value_name(value)}, expected {_type_name(schema)}"
    return None


def _fail(path: Path, spec: StateFile, what: str) -> StateFileError:
    return StateFileError(f"{path}: {what}; {spec.rebuild}")


def _read_bytes(path: Path, spec: StateFile) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        if spec.when_missing is not None:
            return None
        raise _fail(path, spec, f"missing ({spec.name}, written by {spec.writer})") from None
    except IsADirectoryError:
        raise _fail(path, spec, "is a folder, expected a file") from None


def _decode(path: Path, spec: StateFile, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(path, spec, f"damaged: not UTF-8 text (byte {e.start}: binary garbage or a partial write)") from None


def check_state(path: str | Path, value, spec: StateFile):
    """`value` if it fits `spec` (schema, then `check`), else the StateFileError naming `path`."""
    problem = schema_problem(value, spec.schema) or (spec.check(value) if spec.check else None)
    if problem:
        raise _fail(Path(path), spec, f"damaged: {problem}")
    return value


def _read_text(path: Path, spec: StateFile) -> str | None:
    """The file's text (None when absent and that is normal); one line for unreadable, non-UTF-8 or empty files."""
    data = _read_bytes(path, spec)
    if data is None:
        return None
    text = _decode(path, spec, data)
    if not text.strip():
        raise _fail(path, spec, "empty (a write was interrupted)")
    return text


def read_json_state(path: str | Path, spec: StateFile):
    """The JSON state file at `path`, checked against `spec`; None when absent and `spec.when_missing` says that is
    normal; StateFileError (one line naming the file and what to do) for anything else wrong with it."""
    path = Path(path)
    text = _read_text(path, spec)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        cut = " (truncated: a write was interrupted?)" if e.pos >= len(text.rstrip()) else ""
        raise _fail(path, spec, f"damaged: not valid JSON{cut} ({e.msg}: line {e.lineno} column {e.colno})") from None
    return check_state(path, value, spec)


def read_yaml_state(path: str | Path, spec: StateFile):
    """The YAML state file at `path` (a recipe stored beside a head), checked against `spec` like a JSON one."""
    path = Path(path)
    text = _read_text(path, spec)
    if text is None:
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        raise _fail(path, spec, f"damaged: not valid YAML ({getattr(e, 'problem', None) or type(e).__name__}{where})") \
            from None
    return check_state(path, value, spec)


def write_yaml_state(path: str | Path, value, spec: StateFile, text: str | None = None) -> Path:
    """Write a YAML state file atomically after checking it against its schema. `text`: the rendering to write
    (e.g. OmegaConf's), which must load back to `value`; default yaml.safe_dump's."""
    _check_registered(spec)
    check_state(path, value, spec)
    if text is None:
        text = yaml.safe_dump(value, sort_keys=False, allow_unicode=True)
    elif yaml.safe_load(text) != value:
        raise ValueError(f"{path}: the YAML to write does not load back to the value checked")
    return write_file_atomic(path, text)


def read_state(path: str | Path, spec: StateFile):
    """The state file at `path` read by the loader of its format (json, yaml, text)."""
    return {"json": read_json_state, "yaml": read_yaml_state, "text": read_text_state}[spec.format](path, spec)


def read_text_state(path: str | Path, spec: StateFile) -> str | None:
    """The one-line text state file at `path` (stripped), checked by `spec.schema` (str) and `spec.check`; None when
    absent and that is normal."""
    path = Path(path)
    data = _read_bytes(path, spec)
    return None if data is None else check_state(path, _decode(path, spec, data).strip(), spec)


def _check_registered(spec: StateFile) -> None:
    old = REGISTRY.get(spec.key)
    if old is None or old.writer != spec.writer:
        raise ValueError(f"state file {spec.key} is not registered (eagle/state_files.py register)")


def write_json_state(path: str | Path, value, spec: StateFile, indent: int | None = 1) -> Path:
    """Write a JSON state file atomically (eagle/atomic_file.py) after checking it against its own schema: a writer
    that drifts from what its readers expect fails at the writer, in the tests."""
    _check_registered(spec)
    check_state(path, value, spec)
    return write_file_atomic(path, json.dumps(value, indent=indent, ensure_ascii=False) + "\n")


def write_text_state(path: str | Path, value: str, spec: StateFile) -> Path:
    """Write a one-line text state file atomically, after its check."""
    _check_registered(spec)
    check_state(path, value, spec)
    return write_file_atomic(path, value)


def pattern_check(pattern: str, what: str) -> Callable[[str], str | None]:
    """A `check` for a text state file: the stripped content must match `pattern`."""
    rx = re.compile(pattern)

    def check(value: str) -> str | None:
        return None if rx.fullmatch(value) else f"holds {value[:60]!r}, expected {what}"

    return check


__all__ = ["ANY_KEY", "REGISTRY", "StateFile", "StateFileError", "check_state", "pattern_check", "read_json_state",
           "read_state", "read_text_state", "read_yaml_state", "register", "schema_problem", "write_json_state",
           "write_text_state", "write_yaml_state"]
