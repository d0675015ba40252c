"""Chat conversations made from the Python standard library's docstrings.

Real text that exists on every machine with Python: the user asks what `module.name` does and the
assistant answers with its documentation. The order is deterministic (sorted modules, sorted members),
duplicated docstrings are kept once, long docs are cut at a paragraph or sentence boundary, and a
fixed hash of the qualified name decides the split, so the held-out questions are never trained on.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
import subprocess
import sys
import warnings
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

# Pure-Python, side-effect-free stdlib modules, grouped into the categories the evaluation reports per.
# Modules missing on a platform (e.g. `pwd` on Windows) are skipped.
MODULE_CATEGORIES: dict[str, tuple[str, ...]] = {
    "text": ("string", "textwrap", "re", "difflib", "unicodedata", "html", "shlex", "fnmatch", "codecs",
             "locale", "gettext", "stringprep", "pprint", "reprlib"),
    "numbers": ("math", "cmath", "statistics", "random", "fractions", "decimal", "numbers", "operator",
                "bisect", "heapq", "colorsys"),
    "data": ("json", "csv", "base64", "binascii", "struct", "pickle", "copy", "collections", "array",
             "plistlib", "configparser", "tomllib", "zlib", "gzip", "bz2", "lzma", "zipfile", "tarfile",
             "hashlib", "hmac", "secrets", "uuid", "quopri", "graphlib"),
    "files": ("os", "os.path", "pathlib", "shutil", "glob", "tempfile", "filecmp", "fileinput", "io",
              "stat", "mimetypes", "linecache"),
    "system": ("sys", "time", "datetime", "calendar", "platform", "signal", "subprocess", "threading",
               "queue", "sched", "logging", "argparse", "getopt", "errno", "gc", "atexit", "contextvars",
               "concurrent.futures", "multiprocessing", "selectors", "pwd", "grp", "resource"),
    "internet": ("urllib.parse", "urllib.request", "http.client", "http.cookies", "email.utils",
                 "email.message", "smtplib", "socket", "ssl", "ipaddress", "mailbox", "webbrowser",
                 "wsgiref.util", "xml.etree.ElementTree", "html.parser"),
    "language": ("builtins", "functools", "itertools", "contextlib", "abc", "types", "typing", "dataclasses",
                 "enum", "inspect", "weakref", "warnings", "traceback", "ast", "dis", "keyword", "tokenize",
                 "importlib", "pkgutil", "timeit", "unittest", "doctest", "asyncio", "codeop"),
}

QUESTION_TEMPLATES = {
    "function": ("What does `{name}` do?", "Explain the function `{name}`.", "What is `{name}` used for?",
                 "How do I use `{name}` in Python?", "Describe `{name}`."),
    "class": ("What is the class `{name}`?", "Explain `{name}`.", "What is `{name}` used for?",
              "Describe the Python class `{name}`."),
    "method": ("What does the method `{name}` do?", "Explain `{name}`.", "How does `{name}` work?"),
}
FOLLOW_UP = "And what about `{name}`?"
EVAL_EVERY = 16  # ~1/16 of the documented names are held out for evaluation (by hash, stable across runs)
TWO_TURN_EVERY = 5  # ~1/5 of conversations ask a follow-up question about a second name


@dataclass(frozen=True)
class DocEntry:
    """One documented stdlib object."""

    name: str  # qualified name as a user would type it, e.g. "json.dumps", "str.split"
    kind: str  # function | class | method
    category: str
    doc: str  # cleaned, truncated documentation: the assistant's answer


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def clean_doc(doc: str, max_chars: int) -> str:
    """Dedent, strip reST noise, and cut at the last paragraph (else sentence) boundary within max_chars."""
    doc = inspect.cleandoc(doc).replace("\r", "").strip()
    doc = re.sub(r"\n{3,}", "\n\n", doc)
    if len(doc) <= max_chars:
        return doc
    head = doc[:max_chars]
    for sep in ("\n\n", ". ", ".\n"):
        cut = head.rfind(sep)
        if cut >= max_chars // 3:
            return head[: cut + (1 if sep != "\n\n" else 0)].rstrip()
    cut = head.rfind(" ")
    return head[: cut if cut > 0 else max_chars].rstrip()


def _top(module_name: str) -> str:
    return module_name.split(".")[0].lstrip("_")


def _members(module_name: str):
    """(qualified name, kind, object) for the public documented functions/classes of a module and the
    public methods of its classes, in sorted order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # not on this platform / build
            return
    prefix = "" if module_name == "builtins" else module_name + "."
    # `__all__` (resolved with getattr, which also loads lazy names like concurrent.futures'
    # ProcessPoolExecutor) keeps the member list independent of what else the process imported
    exported = getattr(module, "__all__", None)
    names = sorted(set(exported)) if exported is not None else sorted(vars(module))
    for attr in names:
        if attr.startswith("_"):
            continue
        obj = getattr(module, attr, None)
        if inspect.isclass(obj):
            kind = "class"
        elif inspect.isroutine(obj):
            kind = "function"
        else:
            continue
        # skip names re-exported from another package (they are documented under their home module);
        # compare top-level packages without a leading "_" so C accelerators (_json, _heapq) count as home
        home = getattr(obj, "__module__", None)
        if module_name != "builtins" and isinstance(home, str) and _top(home) != _top(module.__name__):
            continue
        yield prefix + attr, kind, obj
        if kind == "class":
            for meth, fn in sorted(vars(obj).items()):
                if meth.startswith("_") or not (inspect.isroutine(fn) or isinstance(fn, (classmethod, staticmethod))):
                    continue
                yield f"{prefix}{attr}.{meth}", "method", getattr(obj, meth, fn)


@lru_cache(maxsize=8)
def collect_doc_entries(max_chars: int = 480, min_chars: int = 24) -> tuple[DocEntry, ...]:
    """All documented names of MODULE_CATEGORIES, deterministic order, docstrings deduplicated.

    Collected in a pristine interpreter (`python -I -S this_file`): libraries imported by the caller
    patch stdlib objects (transformers adds methods to logging.Logger, torch wraps inspect.getfile),
    which would make the corpus depend on what the calling process happened to import.
    """
    cmd = [sys.executable, "-I", "-S", str(Path(__file__).resolve()), str(max_chars), str(min_chars)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"collecting stdlib docstrings failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
    return tuple(DocEntry(**e) for e in json.loads(proc.stdout))


def _collect_here(max_chars: int, min_chars: int) -> list[DocEntry]:
    seen_docs: set[str] = set()
    seen_names: set[str] = set()
    out = []
    for category, modules in MODULE_CATEGORIES.items():
        for module_name in modules:
            for name, kind, obj in _members(module_name):
                raw = getattr(obj, "__doc__", None)
                if not isinstance(raw, str) or name in seen_names:
                    continue
                doc = clean_doc(raw, max_chars)
                if len(doc) < min_chars or doc in seen_docs:
                    continue
                seen_docs.add(doc)
                seen_names.add(name)
                out.append(DocEntry(name=name, kind=kind, category=category, doc=doc))
    return out


def split_of(entry: DocEntry) -> str:
    """'eval' for the held-out names, else 'train' (a fixed hash, so stable across runs and machines)."""
    return "eval" if _stable_hash(entry.name) % EVAL_EVERY == 0 else "train"


def question_for(entry: DocEntry) -> str:
    templates = QUESTION_TEMPLATES[entry.kind]
    return templates[_stable_hash("q:" + entry.name) % len(templates)].format(name=entry.name)


def _entries(split: str) -> list[DocEntry]:
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: expected 'train' or 'eval'")
    return [e for e in collect_doc_entries() if split_of(e) == split]


def _pairs(split: str) -> list[tuple[DocEntry, DocEntry | None]]:
    """Group entries into conversations: every TWO_TURN_EVERY-th one gets the next entry as follow-up."""
    entries = _entries(split)
    out, i = [], 0
    while i < len(entries):
        first = entries[i]
        if _stable_hash("t:" + first.name) % TWO_TURN_EVERY == 0 and i + 1 < len(entries):
            out.append((first, entries[i + 1]))
            i += 2
        else:
            out.append((first, None))
            i += 1
    return out


def default_conversations(split: str = "train") -> list[dict]:
    """ShareGPT-format records {"id", "conversations": [{"from": "human"|"gpt", "value"}, ...]}."""
    records = []
    for first, second in _pairs(split):
        turns = [{"from": "human", "value": question_for(first)}, {"from": "gpt", "value": first.doc}]
        if second is not None:
            turns += [{"from": "human", "value": FOLLOW_UP.format(name=second.name)},
                      {"from": "gpt", "value": second.doc}]
        records.append({"id": f"stdlib-{split}-{first.name}", "conversations": turns})
    return records


def default_questions(split: str = "eval", n: int | None = None) -> list[dict]:
    """Question records in the MT-bench schema {"question_id", "category", "turns"[, "reference"]}."""
    out = []
    for i, (first, second) in enumerate(_pairs(split)):
        turns = [question_for(first)] + ([FOLLOW_UP.format(name=second.name)] if second else [])
        reference = [first.doc] + ([second.doc] if second else [])
        out.append({"question_id": i + 1, "category": first.category, "turns": turns, "reference": reference})
    return out if n is None else out[:n]


def default_prompts(split: str = "eval", n: int | None = None) -> list[str]:
    """The first user turn of each question (held out from training for split='eval')."""
    return [q["turns"][0] for q in default_questions(split, n)]


if __name__ == "__main__":  # run by collect_doc_entries in a fresh `python -I -S`: print the entries as JSON
    json.dump([asdict(e) for e in _collect_here(int(sys.argv[1]), int(sys.argv[2]))], sys.stdout)  # ASCII-safe in any locale
