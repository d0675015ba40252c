"""The float comparisons hold under every arithmetic variant this machine offers (tests/float_variants.py):
another thread count, ATen's scalar kernels, MKL's SSE4.2 GEMM, SDPA's math kernel, oneDNN off. Slow: it runs the
`numeric` tests once per variant."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_numeric_tests_pass_under_every_arithmetic_variant():
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "float_variants.py")], cwd=REPO, capture_output=True,
                          text=True, timeout=3 * 3600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "every variant passed" in proc.stdout
