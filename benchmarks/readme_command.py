"""README command 1 (`autotune run`, the embedded default) as it runs now (short probes,
slow probes stopped early) against the same command as it ran when issue 64 was filed (the
commit before its first change, checked out in a git worktree and run with its own code: the
issue's "today's time"), and against today's code with `--full-steps --no-stop-slow` (what the
short probes and the early stop alone give, everything else the same), with short probes
without the early stop between them: each sweep's wall time, its probes and its pick, then
the picks re-measured side by side with full probes, alternating, so they are compared on one
footing rather than on the figures each sweep measured them with.

    python benchmarks/readme_command.py [--remeasure 3] [--before-rev 56583c5]

Each sweep runs in a fresh results folder of its own (the command as a user types it, plus
`--results-dir` and the mode's flags), one after another on a quiet machine. Target (issue
64): the default sweep picks the same config, or one within 2% on the re-measure, in at most
half the time of the command when the issue was filed. Writes
benchmarks/results/readme_command.{txt,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
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


BEFORE_REV = "56583c5"  # main when issue 64 was filed: the parent of its first change, dd22288
MODES = {"before": [],  # the command as it ran then, with that commit's code
         "short": [],  # the command as it runs now
         "short-no-stop": ["--no-stop-slow"],  # short probes, every one run to its end
         "full": ["--full-steps", "--no-stop-slow"]}  # today's code with whole steps


@contextlib.contextmanager
def checkout(rev: str):
    """A git worktree of `rev` (this repository's), removed afterwards."""
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="readme-command-rev-") as scratch:
        tree = Path(scratch) / "tree"
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-q", str(tree),
                        rev], check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)],
                           check=False)


def sweep(root: Path, mode: str, code: Path | None = None) -> dict:
    """One `autotune run` in `root` (with the code under `code`, where given: that tree's
    autotune package first on the path): its wall time, its trials and its best.yaml."""
    argv = [*AUTOTUNE, "run", "--results-dir", str(root), *MODES[mode]]
    env = {**os.environ, "PYTHONPATH": str(code)} if code is not None else None
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env,
                          cwd=code)
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


def report(sweeps: dict[str, dict], tokens: dict[str, list[float]], before_rev: str) -> str:
    short, full, before = sweeps["short"], sweeps["full"], sweeps["before"]
    lines = [f"README command 1 (`autotune run`): now (short probes, slow ones stopped) vs the "
             f"command when issue 64 was filed ({before_rev}'s code: before) and vs today's "
             f"code with --full-steps --no-stop-slow (full), CPU ({time.strftime('%Y-%m-%d')}), "
             "one sweep each, in this order",
             f"{'sweep':<15}{'wall s':>8}{'trials':>8}{'slow':>6}{'pick':>6}{'its tok/s':>11}"
             f"{'re-measured tok/s (full probes)':>34}"]
    for row in sweeps.values():
        again = ", ".join(f"{t:.1f}" for t in tokens.get(row["mode"], []))
        lines.append(f"{row['mode']:<15}{row['wall_s']:>8.0f}{row['trials']:>8}"
                     f"{row['stopped_slow']:>6}{row['best_trial']:>6}"
                     f"{row['tokens_per_s']:>11.1f}{again:>34}")
    lines.append(f"wall before/short: {before['wall_s'] / short['wall_s']:.2f} (target >= 2); "
                 f"full/short: {full['wall_s'] / short['wall_s']:.2f}; full/short-no-stop: "
                 f"{full['wall_s'] / sweeps['short-no-stop']['wall_s']:.2f}")
    for other in ("before", "full"):
        same = short["config"] == sweeps[other]["config"]
        ratio = statistics.fmean(tokens["short"]) / statistics.fmean(tokens[other])
        lines.append(f"against {other}: the same config picked: {'yes' if same else 'no'}; "
                     f"short's pick over {other}'s on the re-measure: {ratio:.3f} "
                     "(target >= 0.98)")
        if not same:
            differs = {k: (short["config"][k], sweeps[other]["config"].get(k))
                       for k in short["config"]
                       if short["config"][k] != sweeps[other]["config"].get(k)}
            lines.append(f"  the picks differ in: {differs}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--remeasure", type=int, default=3, help="full probes of each pick")
    parser.add_argument("--before-rev", default=BEFORE_REV,
                        help="the commit whose code runs the 'before' sweep")
    args = parser.parse_args()
    sweeps = {}
    with tempfile.TemporaryDirectory(prefix="readme-command-") as scratch, \
            checkout(args.before_rev) as before_code:
        for mode in MODES:
            code = before_code if mode == "before" else None
            sweeps[mode] = done = sweep(Path(scratch) / mode, mode, code)
            print(f"{mode}: {done['wall_s']:.0f} s, {done['stopped_slow']} stopped slow, pick "
                  f"trial {done['best_trial']}", flush=True)
    tokens = remeasure({mode: sweeps[mode] for mode in ("short", "full", "before")},
                       args.remeasure)
    text = report(sweeps, tokens, args.before_rev)
    print(text)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "readme_command.txt").write_text(text + "\n")
    (OUT_DIR / "readme_command.json").write_text(json.dumps(
        {**sweeps, "before_rev": args.before_rev, "remeasured_tokens_per_s": tokens},
        indent=2) + "\n")


if __name__ == "__main__":
    main()
