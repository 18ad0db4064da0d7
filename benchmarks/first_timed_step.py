"""The short probe's first timed step over the ones after it, per phase, under each heap setting.

A whole short probe's first timed step runs slow on this CPU (docs/benchmarks.md, the short
probe's section); the cause found was the probe's heap setting (MALLOC_MMAP_THRESHOLD_ at
256 KiB, runners/local.py): each step maps and faults its blocks of 256 KiB to 1 MiB afresh,
and the first one more. This measures it so, side by side: for each setting a process builds
one short-probe case (short_probe.py's CASES; by default `grpo W4 emulated`, the row whose
first step ran slowest), warms it up as the probe does, runs STEPS short steps, and reports
per phase the first timed step over the median of the ones after it. The settings alternate,
one build at a time, BUILDS builds each; the figure is the median over the builds with its
range.

    python benchmarks/first_timed_step.py [--builds 10] [--case "grpo W4 emulated"]

Writes benchmarks/results/first_timed_step.{txt,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).parent / "results"
STEPS = 6  # timed steps a build runs: the first, and five to take the median of
SETTINGS = {  # name: glibc's malloc environment for the probe's process (None: unset)
    "256 KiB (the probe's)": str(256 << 10),
    "1 MiB": str(1 << 20),
    "glibc's default": None,
}


def one_build(case: str) -> dict[str, list[float]]:
    """In this process: build the case, warm it up as the probe does, run STEPS short
    steps; each phase's seconds per step."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    import short_probe

    from autotune.probe.measure.meter import MemoryMeter
    from autotune.probe.step.training import TrainingProbe

    model, config, request, _ = short_probe.CASES[case]
    meter = MemoryMeter(torch.device("cpu"), short=True)
    meter.start()
    try:
        probe = TrainingProbe(short_probe.request_for(model, config, request, full=False), meter)
        probe.build()
        meter.clock.warming = True
        probe.step()
        meter.clock.warming = False
        seconds: dict[str, list[float]] = {}
        for _ in range(STEPS):
            for phase, spent in probe.step().items():
                seconds.setdefault(phase, []).append(spent)
        return seconds
    finally:
        meter.stop()


def build_in_child(case: str, threshold: str | None) -> dict[str, list[float]]:
    """one_build in a fresh process under the heap setting (glibc reads it at start)."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = threshold
    done = subprocess.run([sys.executable, __file__, "--child", case], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_over_later(seconds: list[float]) -> float:
    return seconds[0] / statistics.median(seconds[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builds", type=int, default=10)
    parser.add_argument("--case", default="grpo W4 emulated")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(one_build(args.child)))
        return
    started = time.monotonic()
    ratios: dict[str, dict[str, list[float]]] = {name: {} for name in SETTINGS}
    steps: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for build in range(args.builds):
        for name, threshold in SETTINGS.items():
            seconds = build_in_child(args.case, threshold)
            for phase, spent in seconds.items():
                ratios[name].setdefault(phase, []).append(first_over_later(spent))
            totals = [sum(step) for step in zip(*seconds.values(), strict=True)]
            steps[name].append(statistics.median(totals[1:]))
            print(f"build {build + 1}/{args.builds} {name}: " + ", ".join(
                f"{p} {ratios[name][p][-1]:.3f}" for p in ratios[name]), flush=True)
    minutes = (time.monotonic() - started) / 60
    phases = list(next(iter(ratios.values())))
    lines = [f"first_timed_step on cpu, {time.strftime('%Y-%m-%d')}, {minutes:.1f} min",
             "benchmark: python benchmarks/first_timed_step.py"
             + (f" --builds {args.builds}" if args.builds != 10 else ""),
             f"case: {args.case} (short_probe.py), {args.builds} builds a setting, alternating;"
             f" a build: the probe's warm-up, then {STEPS} short steps",
             "", "first timed step over the median of the later ones, per phase: median over the"
             " builds [min, max]; a later step's seconds, median", "",
             f"{'heap (MALLOC_MMAP_THRESHOLD_)':28}"
             + "".join(f"{p:>26}" for p in phases) + f"{'later step s':>14}"]
    for name in SETTINGS:
        cells = []
        for phase in phases:
            values = ratios[name][phase]
            cells.append(f"{statistics.median(values):.3f} [{min(values):.3f}, "
                         f"{max(values):.3f}]")
        lines.append(f"{name:28}" + "".join(f"{c:>26}" for c in cells)
                     + f"{statistics.median(steps[name]):>14.3f}")
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "first_timed_step.txt").write_text(text)
    (OUT / "first_timed_step.json").write_text(json.dumps(
        {"case": args.case, "builds": args.builds, "steps": STEPS, "minutes": round(minutes, 1),
         "settings": {name: {"mmap_threshold": threshold,
                             "first_over_later": ratios[name],
                             "later_step_s": steps[name]}
                      for name, threshold in SETTINGS.items()}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
