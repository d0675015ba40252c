"""The import contract of pyproject.toml ([tool.importlinter]: the stages import only downward, eagle <- recipes <-
engine <- data_prep <- train <- export <- evaluation <- quickstart / benchmarks, and no package's modules import each
other in a cycle) holds. import-linter reads every import, also those inside functions; a broken contract fails this
test with import-linter's report, which names the importing module, the imported one and the line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def test_imports_follow_the_layers_and_form_no_cycle():
    proc = subprocess.run([sys.executable, "-c", LINT], cwd=REPO, capture_output=True, text=True, timeout=300)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, "\n" + report
    assert "Contracts: 2 kept, 0 broken." in report, report
