"""README command 1 (`autotune run`, the embedded default) as it runs now (short probes,
slow probes stopped early) against the sweep as it ran before issue 64 (`--full-steps
--no-stop-slow`), and short probes without the early stop between them: each sweep's wall
time, its probes and its pick, then the default's and the baseline's picks re-measured side by
side with full probes, alternating, so the two picks are compared on one footing rather than
on the figures each sweep measured them with.

    python benchmarks/readme_command.py [--remeasure 3]

Each sweep runs in a fresh results folder of its own (the command as a user types it, plus
`--results-dir` and the mode's flags), the default first. Target (issue 64): the default
sweep picks the same config, or one within 2% on the re-measure, in at most half the
baseline's wall time. Writes benchmarks/results/readme_command.{txt,json}.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from autotune.config import ProbeConfig
from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest
from autotune.runners.local import SubprocessRunner

OUT_DIR = Path(__file__).parent / "results"
AUTOTUNE = [sys.executable, "-m", "autotune"]


MODES = {"short": [],  # the command as it runs now
         "short-no-stop": ["--no-stop-slow"],  # short probes, every one run to its end
         "full": ["--full-steps", "--no-stop-slow"]}  # the sweep before issue 64


def sweep(root: Path, mode: str) -> dict:
    """One `autotune run` in `root`: its wall time, its trials and its best.yaml."""
    argv = [*AUTOTUNE, "run", "--results-dir", str(root), *MODES[mode]]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall_s = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    (best_path,) = root.glob("*/best.yaml")
    best = yaml.safe_load(best_path.read_text())
    with open(best_path.parent / "trials.csv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    slow = sum(row["status"] == "slow" and not row["reused_from"] for row in rows)
    return {"mode": mode, "wall_s": wall_s, "trials": len(rows), "stopped_slow": slow,
            "best_trial": best["trial"], "config": best["config"],
            "model": best["provenance"].get("model", "tiny-qwen2.5"),
            "capacity_bytes": best["measured"]["capacity_bytes"],
            "tokens_per_s": best["measured"]["tokens_per_s"],
            "log": done.stderr.strip().splitlines()}


def full_request(pick: dict) -> ProbeRequest:
    return ProbeRequest(model=pick["model"], config=ProbeConfig.from_knobs(pick["config"]),
                        device=Device("cpu", limit_bytes=pick["capacity_bytes"]),
                        timeout_s=900.0, warmup_steps=1, timed_steps=3, timed_min_s=2.0,
                        full_steps=True)


def remeasure(picks: dict[str, dict], repeats: int) -> dict[str, list[float]]:
    """Each pick probed `repeats` times with full steps, the two alternating."""
    runner = SubprocessRunner()
    tokens: dict[str, list[float]] = {mode: [] for mode in picks}
    for _ in range(repeats):
        for mode, pick in picks.items():
            result = runner.run(full_request(pick))
            if not result.ok:
                raise SystemExit(f"re-measuring the {mode} pick: {result.status.value}: "
                                 f"{result.message}")
            tokens[mode].append(result.tokens_per_s or 0.0)
    return tokens


def report(sweeps: dict[str, dict], tokens: dict[str, list[float]]) -> str:
    short, full = sweeps["short"], sweeps["full"]
    same = short["config"] == full["config"]
    ratio = statistics.fmean(tokens["short"]) / statistics.fmean(tokens["full"])
    lines = [f"README command 1 (`autotune run`): now (short probes, slow ones stopped) vs "
             f"--full-steps --no-stop-slow (before issue 64), CPU ({time.strftime('%Y-%m-%d')})",
             f"{'sweep':<15}{'wall s':>8}{'trials':>8}{'slow':>6}{'pick':>6}{'its tok/s':>11}"
             f"{'re-measured tok/s (full probes)':>34}"]
    for row in sweeps.values():
        again = ", ".join(f"{t:.1f}" for t in tokens.get(row["mode"], []))
        lines.append(f"{row['mode']:<15}{row['wall_s']:>8.0f}{row['trials']:>8}"
                     f"{row['stopped_slow']:>6}{row['best_trial']:>6}"
                     f"{row['tokens_per_s']:>11.1f}{again:>34}")
    lines += [f"wall full/short: {full['wall_s'] / short['wall_s']:.2f} (target >= 2); "
              f"full/short-no-stop: "
              f"{full['wall_s'] / sweeps['short-no-stop']['wall_s']:.2f}",
              f"the same config picked: {'yes' if same else 'no'}; short's pick over full's "
              f"on the re-measure: {ratio:.3f} (target >= 0.98)"]
    if not same:
        differs = {k: (short["config"][k], full["config"].get(k)) for k in short["config"]
                   if short["config"][k] != full["config"].get(k)}
        lines.append(f"the picks differ in: {differs}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--remeasure", type=int, default=3, help="full probes of each pick")
    args = parser.parse_args()
    sweeps = {}
    with tempfile.TemporaryDirectory(prefix="readme-command-") as scratch:
        for mode in MODES:
            sweeps[mode] = done = sweep(Path(scratch) / mode, mode)
            print(f"{mode}: {done['wall_s']:.0f} s, {done['stopped_slow']} stopped slow, pick "
                  f"trial {done['best_trial']}", flush=True)
    tokens = remeasure({"short": sweeps["short"], "full": sweeps["full"]}, args.remeasure)
    text = report(sweeps, tokens)
    print(text)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "readme_command.txt").write_text(text + "\n")
    (OUT_DIR / "readme_command.json").write_text(json.dumps(
        {**sweeps, "remeasured_tokens_per_s": tokens}, indent=2) + "\n")


if __name__ == "__main__":
    main()
