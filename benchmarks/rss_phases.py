"""Run train/main.py with the peak RSS of every phase of every micro-batch recorded (`python -m benchmarks.real_shape
--phases`).

    python -m benchmarks.rss_phases OUT.jsonl train/main.py --recipe R key=value ...

A whole-run peak (VmHWM) says how much memory a run needs but not WHEN it is reached, and so not which terms of
the plan add up at that moment. This wrapper resets the kernel's high-water mark (`/proc/self/clear_refs` 5) at
each phase boundary of the training loop and writes one JSON line per phase: the micro-batch, the phase, the RSS
at its end and its own peak. Phases: `setup` (until the first batch), `forward` (features + the head's forward +
the token loss, the graph held for backward), `backward` (engine.backward: gradients into DeepSpeed's buckets),
`step` (engine.step: the optimizer; AdamW allocates its moments at the first one) and `other` (metrics, logging,
checkpoints until the next batch). It patches DeepSpeedEngine.backward / .step and the head kinds' `loss` (train/head_kinds.py) at
class level, in this process only; the trainer is otherwise unchanged.
"""
from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

from train import head_kinds

REPO = Path(__file__).resolve().parent.parent


def _kb(fields: dict, key: str) -> int:
    return int(fields[key].split()[0]) * 1024


class PhaseLog:
    """Appends {"micro", "phase", "rss", "peak"} lines; `mark(phase)` closes the phase that just ended."""

    def __init__(self, path: Path):
        self.file = open(path, "w")
        self.micro = 0
        self.reset()

    @staticmethod
    def read() -> dict:
        lines = Path("/proc/self/status").read_text().splitlines()
        return dict(line.split(":", 1) for line in lines if ":" in line)

    @staticmethod
    def reset() -> None:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS (Linux >= 4.0)

    def mark(self, phase: str) -> None:
        f = self.read()
        self.file.write(json.dumps({"micro": self.micro, "phase": phase, "rss": _kb(f, "VmRSS"),
                                    "peak": _kb(f, "VmHWM")}) + "\n")
        self.file.flush()
        self.reset()


def install(log: PhaseLog) -> None:
    # lazy: deepspeed prints its accelerator line on stdout at import; the trainer run below imports it anyway
    from deepspeed.runtime.engine import DeepSpeedEngine

    started = [False]

    def wrap_loss(cls):
        inner = cls.loss

        def loss(self, *args, **kwargs):
            log.mark("other" if started[0] else "setup")
            started[0] = True
            out = inner(self, *args, **kwargs)
            log.mark("forward")
            return out
        cls.loss = loss

    wrap_loss(head_kinds.TrainingKind)  # the one training step of every head kind
    backward, step = DeepSpeedEngine.backward, DeepSpeedEngine.step

    def probed_backward(self, *args, **kwargs):
        out = backward(self, *args, **kwargs)
        log.mark("backward")
        return out

    def probed_step(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        log.mark("step")
        log.micro += 1
        return out
    DeepSpeedEngine.backward, DeepSpeedEngine.step = probed_backward, probed_step


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rss_phases", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the JSON-lines file of phases to write")
    p.add_argument("script", help="the training script, run in this process (train/main.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args(argv)
    install(PhaseLog(Path(a.out)))
    sys.argv = [a.script, *a.args]
    runpy.run_path(a.script, run_name="__main__")


if __name__ == "__main__":
    main()
