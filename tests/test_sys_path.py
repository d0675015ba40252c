"""Only the two scripts the launchers start by path edit `sys.path` (docs/design.md, "Commands"): train/main.py and
data_prep/main.py, which `deepspeed` / `torchrun` run as files once per rank, each with one guarded line of one
shared form. Every other program runs as a module (`eagle-train ...`, `python -m evaluation`, `python -m
benchmarks.NAME`) and imports this checkout without a bootstrap; a copied one would fail here. tests/ is scanned too
and needs no exception."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAUNCHED = ("train/main.py", "data_prep/main.py")  # started by path by deepspeed / torchrun, once per rank
MUTATORS = {"append", "insert", "extend", "remove", "pop", "clear", "reverse", "sort", "__setitem__", "__delitem__",
            "__iadd__"}


def project_files() -> list[Path]:
    """Every .py file of the project: each top-level package (a folder with __init__.py), tests/, top-level scripts."""
    roots = [d for d in sorted(REPO.iterdir()) if (d / "__init__.py").exists()] + [REPO / "tests"]
    return [f for root in roots for f in sorted(root.rglob("*.py"))] + sorted(REPO.glob("*.py"))


def sys_path_edits(source: str) -> list[int]:
    """Line numbers of the statements that change `sys.path`: an assignment to it or to an item or slice of it
    (`=`, `+=`, `del`), a call of one of its list methods (`insert`, `append`, `extend`...), `site.addsitedir`;
    through `import sys as s`, `from sys import path` and `p = sys.path` too. Reading it is not an edit."""
    tree = ast.parse(source)
    sys_names, path_names, site_calls = {"sys"}, set(), {"site.addsitedir"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            sys_names |= {a.asname for a in node.names if a.name == "sys" and a.asname}
            site_calls |= {f"{a.asname}.addsitedir" for a in node.names if a.name == "site" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module in ("sys", "site"):
            names = {a.asname or a.name for a in node.names if a.name in ("path", "addsitedir")}
            (path_names if node.module == "sys" else site_calls).update(names)

    def is_path(e: ast.expr) -> bool:
        return (isinstance(e, ast.Attribute) and e.attr == "path" and isinstance(e.value, ast.Name)
                and e.value.id in sys_names) or (isinstance(e, ast.Name) and e.id in path_names)

    for node in ast.walk(tree):  # `p = sys.path`: p is sys.path
        if isinstance(node, ast.Assign) and is_path(node.value):
            path_names |= {t.id for t in node.targets if isinstance(t, ast.Name)}

    def edits(target: ast.expr) -> bool:
        return is_path(target) or isinstance(target, ast.Subscript) and is_path(target.value)

    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(edits(t) for t in node.targets) \
                or isinstance(node, (ast.AugAssign, ast.AnnAssign)) and edits(node.target) \
                or isinstance(node, ast.Delete) and any(edits(t) for t in node.targets):
            lines.add(node.lineno)
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in MUTATORS and is_path(f.value) \
                    or ast.unparse(f) in site_calls:
                lines.add(node.lineno)
    return sorted(lines)


@pytest.mark.parametrize("source", [
    "import sys\nsys.path.insert(0, 'x')", "import sys\nsys.path[0] = 'x'", "import sys\nsys.path[:0] = ['x']",
    "import sys\nsys.path += ['x']", "import sys\nsys.path = ['x']", "import sys\ndel sys.path[0]",
    "import sys as s\ns.path.append('x')", "from sys import path\npath.extend(['x'])",
    "from sys import path as p\np[0] = 'x'", "import sys\np = sys.path\np.insert(0, 'x')",
    "import site\nsite.addsitedir('x')", "from site import addsitedir\naddsitedir('x')",
    "import sys\nif not __package__:\n    sys.path[0] = 'x'", "import sys\ndef f():\n    sys.path.append('x')",
])
def test_the_scan_finds_every_form_of_edit(source):
    assert sys_path_edits(source), source


@pytest.mark.parametrize("source", [
    "import sys\nprint(sys.path[0])", "import sys\nok = sys.path[0] != 'x'", "import sys\nn = len(sys.path)",
    "import os\nos.environ['PYTHONPATH'] = 'x'", "from pathlib import Path\npath = Path('x')\npath.rename('y')",
])
def test_the_scan_lets_reading_it_and_other_paths_be(source):
    assert not sys_path_edits(source), source


def test_only_the_scripts_the_launchers_start_by_path_edit_sys_path():
    files = project_files()
    assert {"train/main.py", "evaluation/main.py", "benchmarks/step_costs.py", "tests/test_sys_path.py"} <= {
        f.relative_to(REPO).as_posix() for f in files}  # the scan sees every package, the benchmarks and the tests
    editing = {f.relative_to(REPO).as_posix(): lines for f in files if (lines := sys_path_edits(f.read_text()))}
    others = {name: lines for name, lines in editing.items() if name not in LAUNCHED}
    assert not others, f"sys.path edited outside {LAUNCHED} (file: lines): {others}; run it as a module instead " \
                       "(python -m PACKAGE.MODULE from the checkout's root, or an eagle-train subcommand)"
    assert {name: len(editing.get(name, [])) for name in LAUNCHED} == dict.fromkeys(LAUNCHED, 1)


def test_the_two_launched_scripts_share_one_guard_before_the_projects_imports():
    """`if not __package__: sys.path[0] = <the repository root>` (the root replaces the script's folder only when run
    by path), the same statement in both, before their first import of the project. An `if` block before imports
    does not end the import section for E402 (pycodestyle, ruff), so no import needs `# noqa: E402`."""
    own = {d.name for d in REPO.iterdir() if (d / "__init__.py").exists()}
    guards = []
    for name in LAUNCHED:
        source = (REPO / name).read_text()
        body = ast.parse(source).body
        i, guard = next((i, node) for i, node in enumerate(body) if sys_path_edits(ast.unparse(node)))
        assert isinstance(guard, ast.If) and ast.unparse(guard.test) == "not __package__", ast.unparse(guard)
        assert len(guard.body) == 1 and not guard.orelse and ast.unparse(guard.body[0]).startswith("sys.path[0] = ")
        own_imports = [j for j, node in enumerate(body) if isinstance(node, ast.ImportFrom)
                       and (node.module or "").split(".")[0] in own
                       or isinstance(node, ast.Import) and any(a.name.split(".")[0] in own for a in node.names)]
        assert own_imports and min(own_imports) > i, f"{name}: the project is imported before the guard"
        assert "noqa: E402" not in source, name
        guards.append(ast.dump(guard))
    assert len(set(guards)) == 1, "the two launched scripts' guards differ: keep one form"
