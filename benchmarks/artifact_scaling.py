"""Whether a sweep's cost per trial stays flat as its study grows: a 500-trial scripted sweep.

The real driver (sweep/driver.py run_sweep: the loop, the SQLite storage, the files it keeps
after every probe: trials.csv, best.yaml) runs a random search over
benchmarks/spaces/artifact-scaling.yaml (about 520,000 configs, so repeats are rare) against
the scripted runner of tests/scripted_runner.py: no probe process, each probe's answer a
formula, so what is timed is the sweep's own work per trial. A trial's time is the time
between two consecutive probes, in wall-clock and in this process's CPU time (which other
work on a shared machine does not inflate). Printed: the median time per trial of the first
50 and of the last 50 trials (the median: other work shows as spikes), and their ratio.

Target: the wall-clock ratio within 1.2 (work per trial that grows with the study makes a sweep of
hundreds of trials quadratic).

    python benchmarks/artifact_scaling.py [--trials 500] [--window 50]

Writes benchmarks/results/artifact_scaling.txt (dated).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "tests"))

from scripted_runner import ScriptedRunner  # noqa: E402

from autotune.hardware import Device  # noqa: E402
from autotune.probe.measure.result import ProbeRequest, ProbeResult  # noqa: E402
from autotune.sweep.driver import run_sweep  # noqa: E402
from autotune.sweep.plan import SweepPlan  # noqa: E402
from autotune.sweep.space.search_space import load_search_space  # noqa: E402
from autotune.sweep.study.settings import SweepSettings  # noqa: E402

SPACE = ROOT / "spaces" / "artifact-scaling.yaml"
OUT = ROOT / "results" / "artifact_scaling.txt"
TARGET_RATIO = 1.2


class TimedRunner(ScriptedRunner):
    """The scripted runner, noting when each probe starts: wall-clock and this process's CPU
    time."""

    def __init__(self) -> None:
        super().__init__()
        self.started_at: list[tuple[float, float]] = []

    def run(self, request: ProbeRequest, log_path: Path | None = None) -> ProbeResult:
        self.started_at.append((time.perf_counter(), time.process_time()))
        return super().run(request, log_path)


def per_trial(stamps: list[float], window: int) -> tuple[float, float]:
    """The median time between two probes over the first and the last `window` trials."""
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return statistics.median(gaps[:window]), statistics.median(gaps[-window:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=500)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--label", default="", help="what was measured (e.g. a commit)")
    args = parser.parse_args()
    runner = TimedRunner()
    with tempfile.TemporaryDirectory(prefix="artifact-scaling-") as tmp:
        settings = SweepSettings(
            study_name="scaling", study_dir=Path(tmp) / "scaling",
            space=load_search_space(str(SPACE)),
            request=ProbeRequest(model="tiny-qwen2.5", device=Device("cpu")),
            max_trials=args.trials, sampler="random", prune_dominated=False, prescreen=False)
        started = time.perf_counter()
        outcome = run_sweep(SweepPlan(settings, runner, None, ()))
        wall_s = time.perf_counter() - started
        rows = sum(1 for _ in open(settings.study_dir / "trials.csv")) - 1
        assert outcome.study is not None and rows == len(outcome.study.trials), rows
    wall = per_trial([wall for wall, _ in runner.started_at], args.window)
    cpu = per_trial([cpu for _, cpu in runner.started_at], args.window)
    lines = [
        f"artifact_scaling {time.strftime('%Y-%m-%d %H:%M:%S %Z')} {args.label}".rstrip(),
        f"a {len(runner.calls)}-probe scripted sweep (random sampler, SQLite, trials.csv and "
        f"best.yaml kept after every probe; {rows} trials in the study), {wall_s:.1f} s in all",
    ]
    for name, (first, last) in (("wall-clock", wall), ("CPU time", cpu)):
        lines.append(f"median {name} per trial: first {args.window} {first * 1000:.2f} ms, "
                     f"last {args.window} {last * 1000:.2f} ms, ratio {last / first:.2f} "
                     f"(target within {TARGET_RATIO})")
    print("\n".join(lines))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "a") as handle:
        handle.write("\n".join(lines) + "\n\n")
    return 0 if wall[1] / wall[0] <= TARGET_RATIO else 1


if __name__ == "__main__":
    raise SystemExit(main())
