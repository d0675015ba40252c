"""Run the float-comparison tests and the statistical tests under every arithmetic variant this machine offers, to
see before CI does which comparisons depend on the machine (summation order, vector width, thread count, kernel
choice) and how far the seeded statistical tests' p-values move with the arithmetic.

    python tests/float_variants.py                 # every variant, the tests marked `numeric` or `statistical`
    python tests/float_variants.py -k unroll       # extra pytest arguments narrow the run
    python tests/float_variants.py --list          # the variants this machine offers
    EAGLE_VARIANTS=aten-default,sdpa-math python tests/float_variants.py   # only these variants

Each variant runs pytest in a fresh process (the environment must be set before torch loads its kernels):
  threads-2       two intra-op threads in the tests that otherwise pin one (EAGLE_TEST_THREADS=2)
  aten-default    ATen's scalar kernels instead of the vectorised ones (ATEN_CPU_CAPABILITY=default): other
                  reduction orders in softmax, norms and sums, as on a CPU with other vector widths
  aten-avx512     AVX-512 kernels (only where the CPU has them)
  mkl-sse42       MKL's SSE4.2 GEMM kernels (MKL_ENABLE_INSTRUCTIONS=SSE4_2): another blocking of every matmul
  sdpa-math       scaled_dot_product_attention through its math kernel (EAGLE_TEST_SDPA=math), not the flash one
  no-mkldnn       oneDNN off (EAGLE_TEST_MKLDNN=0): bf16 and some fp32 ops take ATen's own kernels
and the baseline. Every comparison through tests/float_tolerance.py is logged; the summary prints, per test, the
largest observed difference as a fraction of its bound over all variants (the headroom), and which variants
failed. Every statistical test (marked `statistical`, tests/statistical_rule.py) logs its p-values: the summary
prints them per test and variant (a seeded draw sequence is other draws under other arithmetic, so its p-value is
a fresh number; `*` marks a first stage below 0.01 that the rule reran). Exit status 1 when any variant fails.
EAGLE_VARIANTS_KEEP=DIR keeps each variant's pytest output and logs there (default: a temporary folder).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def variants() -> dict[str, dict[str, str]]:
    out = {
        "baseline": {},
        # passive waits: spinning OpenMP threads on a busy 2-core box make a run ~50x slower, not other numbers
        "threads-2": {"EAGLE_TEST_THREADS": "2", "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
        "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
        "mkl-sse42": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
        "sdpa-math": {"EAGLE_TEST_SDPA": "math"},
        "no-mkldnn": {"EAGLE_TEST_MKLDNN": "0"},
    }
    if "avx512f" in cpu_flags():
        out["aten-avx512"] = {"ATEN_CPU_CAPABILITY": "avx512"}
    return out


def run(name: str, env_extra: dict[str, str], pytest_args: list[str], log: Path) -> int:
    env = {**os.environ, **env_extra, "EAGLE_TOLERANCE_LOG": str(log),
           "EAGLE_STATISTICS_LOG": str(statistics_log(log))}
    marks = "(numeric or statistical) and not slow"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", marks, "-p", "no:cacheprovider", *pytest_args]
    print(f"== {name}: {' '.join(f'{k}={v}' for k, v in env_extra.items()) or '(defaults)'}", flush=True)
    out = log.with_suffix(".out")
    with open(out, "w") as f:  # pytest's own output, for a look while it runs (EAGLE_VARIANTS_KEEP keeps it)
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, text=True).returncode
    lines = out.read_text().splitlines()
    tail = [ln for ln in lines if ln.startswith(("FAILED", "ERROR")) or " passed" in ln or " failed" in ln]
    print("\n".join(tail[-12:]) or "\n".join(lines[-30:]), flush=True)
    return code


def statistics_log(log: Path) -> Path:
    return log.with_suffix(".statistics.jsonl")


def summarise_pvalues(logs: dict[str, Path]) -> None:
    """Per statistical test, its p-value under every variant (first stage; the rerun's after a slash)."""
    table: dict[str, dict[str, str]] = defaultdict(dict)
    lowest: dict[str, float] = {}
    for name, log in logs.items():
        path = statistics_log(log)
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            cell = f"{rec['p']:.2e}"
            if rec["stage"] == "first":
                table[rec["test"]][name] = cell + ("*" if rec["p"] < 0.01 else "")
                lowest[rec["test"]] = min(lowest.get(rec["test"], 1.0), rec["p"])
            else:
                table[rec["test"]][name] = table[rec["test"]].get(name, "?") + "/" + cell
    if not table:
        return
    names = [n for n in logs if any(n in row for row in table.values())]
    print("\np-values of the statistical tests per variant (first stage; * below 0.01, then /the rerun's p):")
    print("  " + "  ".join(f"{n:>13}" for n in names) + "  test")
    for test in sorted(table, key=lambda t: lowest[t]):
        print("  " + "  ".join(f"{table[test].get(n, '-'):>13}" for n in names) + f"  {test}")


def summarise(logs: dict[str, Path]) -> None:
    worst: dict[str, tuple[float, float, float, str]] = {}  # test -> (ratio, diff, bound, variant)
    for name, log in logs.items():
        if not log.exists():
            continue
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            ratio = rec["diff"] / rec["bound"] if rec["bound"] > 0 else (0.0 if rec["diff"] == 0 else float("inf"))
            if rec["test"] not in worst or ratio > worst[rec["test"]][0]:
                worst[rec["test"]] = (ratio, rec["diff"], rec["bound"], name)
    if not worst:
        return
    print("\nlargest observed difference per test, over all variants (fraction of its rounding bound):")
    for test, (ratio, diff, bound, name) in sorted(worst.items(), key=lambda kv: -kv[1][0]):
        print(f"  {ratio:9.2e}  diff {diff:.2e}  bound {bound:.2e}  [{name}]  {test}")


def main(argv: list[str]) -> int:
    table = variants()
    only = [name for name in os.environ.get("EAGLE_VARIANTS", "").split(",") if name]
    unknown = sorted(set(only) - set(table))
    if unknown:
        print(f"EAGLE_VARIANTS names {', '.join(unknown)}: this machine offers {', '.join(table)}", file=sys.stderr)
        return 2
    table = {name: env for name, env in table.items() if not only or name in only}
    if argv[:1] == ["--list"]:
        for name, env in table.items():
            print(name, " ".join(f"{k}={v}" for k, v in env.items()))
        return 0
    failed, logs = [], {}
    keep = os.environ.get("EAGLE_VARIANTS_KEEP")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = keep or tmp_dir
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for name, env in table.items():
            logs[name] = Path(tmp) / f"{name}.jsonl"
            if run(name, env, argv, logs[name]) != 0:
                failed.append(name)
        summarise(logs)
        summarise_pvalues(logs)
    print(f"\nvariants failed: {', '.join(failed)}" if failed else "\nevery variant passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
