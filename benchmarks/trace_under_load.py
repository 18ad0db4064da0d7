"""The trace against the CPU probe's measured peak, on a quiet and on a loaded machine.

Two unit tests hold the trace to the probe per phase (tests/test_logprob.py's fused log-prob
pair, tests/test_ppo.py's PPO step). An outside run of the suite beside other work (load 6 to
12 on 2 cores) failed both: 3.3% against a 3% limit, -7.2% against 7%. The trace is fake
tensors (the same bytes every run); the probe's peak is the kernel's RSS high-water mark of a
real step, which moves with how glibc's heap and torch's threads fall under contention. This
measures that spread: each config is traced once and probed REPEATS times quiet, then REPEATS
times beside one busy process per core (each bounded), and the per-phase error of the trace
against each probe is reported. The tests' tolerances are read from the loaded spread.

    python benchmarks/trace_under_load.py [--repeats 3]

Writes benchmarks/results/trace_under_load.{txt,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))

from conftest import small_request  # noqa: E402

from autotune.memory.model import TRACE_CPU_CONTEXT_BYTES  # noqa: E402
from autotune.probe.trace import trace_request  # noqa: E402
from autotune.runners.local import SubprocessRunner  # noqa: E402

OUT = HERE / "results"
SPIN = "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end: pass\n"
BUSY_S = 1800.0  # a busy process's longest life, should this script die

LOGPROB = {"rollout_batch_size": 2, "rollout_n": 4, "global_batch_size": 2,
           "max_prompt_length": 256, "max_response_length": 128, "micro_batch_size_update": 4,
           "micro_batch_size_experience": 8, "cpu_threads": None, "warmup_steps": 1}
PPO = {"algorithm": "ppo", "rollout_n": 1, "rollout_batch_size": 8, "global_batch_size": 4,
       "micro_batch_size_update": 2, "micro_batch_size_experience": 4,
       "critic_micro_batch_size_update": 4, "warmup_steps": 1}
CASES = {  # the tests' own requests (test_logprob.py, test_ppo.py)
    "logprob unfused": {**LOGPROB, "fused_logprob": False},
    "logprob fused": {**LOGPROB, "fused_logprob": True},
    "ppo": PPO,
}


def errors(case: str, traced: dict[str, int]) -> dict[str, float]:
    """One probe of `case`: the trace's error against its peak, per phase (a fraction)."""
    measured = SubprocessRunner().run(small_request(**CASES[case]))
    if not measured.ok:
        raise SystemExit(f"{case}: the probe failed: {measured.message}")
    return {phase: traced[phase] / peak - 1 for phase, peak in
            measured.phase_peak_mem_bytes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    traced = {case: trace_request(small_request(**knobs), TRACE_CPU_CONTEXT_BYTES)
              .phase_peak_mem_bytes for case, knobs in CASES.items()}
    rows: dict[str, dict[str, dict[str, list[float]]]] = {}
    started = time.monotonic()
    for load in ("quiet", "loaded"):
        busy = [subprocess.Popen([sys.executable, "-c", SPIN, str(BUSY_S)])
                for _ in range(os.cpu_count() or 1)] if load == "loaded" else []
        try:
            for repeat in range(args.repeats):
                for case in CASES:
                    for phase, error in errors(case, traced[case]).items():
                        rows.setdefault(case, {}).setdefault(phase, {}).setdefault(
                            load, []).append(error)
                    print(f"[{time.monotonic() - started:5.0f} s] {load} {repeat + 1}/"
                          f"{args.repeats} {case}", flush=True)
        finally:
            for proc in busy:
                proc.kill()
                proc.wait()
    lines = [f"trace_under_load ({date.today()}, {os.cpu_count()} cores; busy: one spinning "
             f"process per core; {args.repeats} probes per config and load)",
             "trace error against the probe's RSS peak, per phase: min / max (every probe)", ""]
    worst = {"quiet": 0.0, "loaded": 0.0}
    for case, phases in rows.items():
        for phase, by_load in phases.items():
            cells = []
            for load, values in by_load.items():
                worst[load] = max(worst[load], max(abs(v) for v in values))
                cells.append(f"{load} {min(values):+.1%} .. {max(values):+.1%}")
            lines.append(f"  {case:16s} {phase:14s} " + "   ".join(cells))
    lines += ["", f"largest |error|: quiet {worst['quiet']:.1%}, loaded {worst['loaded']:.1%}"]
    text = "\n".join(lines)
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "trace_under_load.txt").write_text(text + "\n")
    (OUT / "trace_under_load.json").write_text(json.dumps(
        {"date": str(date.today()), "cores": os.cpu_count(), "repeats": args.repeats,
         "errors": rows, "largest_abs_error": worst}, indent=1) + "\n")


if __name__ == "__main__":
    main()
