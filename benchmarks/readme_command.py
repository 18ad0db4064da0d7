"""README command 1 (`autotune run`, the embedded default) as it runs now (short probes,
slow probes stopped early) against the same command as it ran when issue 64 was filed (the
commit before its first change, checked out in a git worktree and run with its own code: the
issue's "today's time"), and against today's code with `--full-steps --no-stop-slow` (what the
short probes and the early stop alone give, everything else the same), with short probes
without the early stop between them: each sweep's wall time, its probes and its pick, then
the picks re-measured side by side with full probes, alternating, so they are compared on one
footing rather than on the figures each sweep measured them with: their tokens/s and the
objective's tokens/s per GiB of each probe's peak (`--picks-from` re-measures the picks of a
recorded run without sweeping again).

    python benchmarks/readme_command.py [--rounds 3] [--remeasure 3] [--before-rev 56583c5]
    python benchmarks/readme_command.py --picks-from benchmarks/results/readme_command.json

Each sweep runs in a fresh results folder of its own (the command as a user types it, plus
`--results-dir` and the mode's flags), one after another on a quiet machine, the arms in a
rotated order each round, so each round's ratios are side by side; the spread over rounds is
reported (one sweep's wall moves 10-30% with the machine and the sweep's own path). Target (issue
64): the default sweep picks the same config, or one within 2% on the re-measure, in at most
half the time of the command when the issue was filed. Writes
benchmarks/results/readme_command.{txt,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
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


def pick_key(pick: dict) -> str:
    """The pick's config as today's ProbeConfig reads it: a config the before code recorded
    without a knob added since (placement, staleness) is the same config at its default, and
    is re-measured with it, not apart."""
    return json.dumps(dataclasses.asdict(ProbeConfig.from_knobs(pick["config"])),
                      sort_keys=True)


def remeasure(picks: list[dict], repeats: int) -> dict[str, list[dict[str, float]]]:
    """Each distinct picked config probed `repeats` times with full steps, in turn: each
    probe's tokens/s and peak memory."""
    runner = SubprocessRunner()
    distinct = {pick_key(pick): pick for pick in picks}
    probes: dict[str, list[dict[str, float]]] = {key: [] for key in distinct}
    for _ in range(repeats):
        for key, pick in distinct.items():
            result = runner.run(full_request(pick))
            if not result.ok or not result.peak_mem_bytes:
                raise SystemExit(f"re-measuring {key}: {result.status.value}: "
                                 f"{result.message}")
            probes[key].append({"tokens_per_s": result.tokens_per_s or 0.0,
                                "peak_mem_bytes": result.peak_mem_bytes})
    return probes


def figure(probes: list[dict[str, float]], per_gib: bool) -> float:
    """The mean tokens/s of a pick's re-measures, or the objective's tokens/s per GiB of
    each probe's peak."""
    return statistics.fmean(p["tokens_per_s"] / (p["peak_mem_bytes"] / 2**30 if per_gib else 1)
                            for p in probes)


def spread(values: list[float], digits: int = 2) -> str:
    return (f"median {statistics.median(values):.{digits}f} (range {min(values):.{digits}f}-"
            f"{max(values):.{digits}f}, n={len(values)})")


def report(rounds: list[dict[str, dict]], probes: dict[str, list[dict[str, float]]],
           before_rev: str) -> str:
    modes = list(rounds[0])
    lines = [f"README command 1 (`autotune run`): now (short probes, slow ones stopped) vs the "
             f"command when issue 64 was filed ({before_rev}'s code: before) and vs today's "
             f"code with --full-steps --no-stop-slow (full), CPU ({time.strftime('%Y-%m-%d')}); "
             f"{len(rounds)} rounds, the arms' order rotated each round",
             f"{'round':<7}{'sweep':<15}{'wall s':>8}{'trials':>8}{'slow':>6}{'pick':>6}"
             f"{'its tok/s':>11}{'re-measured (full probes): tok/s, tok/s per GiB':>50}"]
    for number, sweeps in enumerate(rounds):
        for row in sweeps.values():
            again = probes[pick_key(row)]
            lines.append(f"{number:<7}{row['mode']:<15}{row['wall_s']:>8.0f}{row['trials']:>8}"
                         f"{row['stopped_slow']:>6}{row['best_trial']:>6}"
                         f"{row['tokens_per_s']:>11.1f}{figure(again, False):>34.1f}"
                         f"{figure(again, True):>16.1f}")
    for other in (m for m in ("before", "full", "short-no-stop") if m in modes):
        walls = [r[other]["wall_s"] / r["short"]["wall_s"] for r in rounds]
        target = " (target >= 2)" if other == "before" else ""
        lines.append(f"wall {other}/short, each round: {spread(walls)}{target}")
    for other in (m for m in ("before", "full") if m in modes):
        same = sum(pick_key(r["short"]) == pick_key(r[other]) for r in rounds)
        for per_gib, what in ((True, "the objective (tokens/s per GiB)"), (False, "tokens/s")):
            ratios = [figure(probes[pick_key(r["short"])], per_gib)
                      / figure(probes[pick_key(r[other])], per_gib) for r in rounds]
            target = " (target >= 0.98)" if per_gib else ""
            lines.append(f"short's pick over {other}'s on the re-measure, {what}, each round: "
                         f"{spread(ratios, 3)}{target}")
        lines.append(f"  the same config in {same} of {len(rounds)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="sweeps of each arm")
    parser.add_argument("--remeasure", type=int, default=3,
                        help="full probes of each distinct pick")
    parser.add_argument("--modes", nargs="+", choices=list(MODES),
                        default=["before", "short", "full"])
    parser.add_argument("--before-rev", default=BEFORE_REV,
                        help="the commit whose code runs the 'before' sweep")
    parser.add_argument("--picks-from", type=Path, default=None,
                        help="re-measure the picks of a recorded run (its JSON) and rewrite "
                        "the report, running no sweep")
    args = parser.parse_args()
    if args.picks_from is not None:
        recorded = json.loads(args.picks_from.read_text())
        rounds, args.before_rev = recorded["rounds"], recorded["before_rev"]
    else:
        rounds = sweep_rounds(args)
    probes = remeasure([pick for sweeps in rounds for pick in sweeps.values()], args.remeasure)
    text = report(rounds, probes, args.before_rev)
    print(text)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "readme_command.txt").write_text(text + "\n")
    (OUT_DIR / "readme_command.json").write_text(json.dumps(
        {"rounds": rounds, "before_rev": args.before_rev, "remeasured": probes},
        indent=2) + "\n")


def sweep_rounds(args: argparse.Namespace) -> list[dict[str, dict]]:
    """`args.rounds` rounds of one sweep per mode, the modes' order rotated each round."""
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="readme-command-") as scratch, \
            checkout(args.before_rev) as before_code:
        for number in range(args.rounds):
            at = number % len(args.modes)
            sweeps = {}
            for mode in args.modes[at:] + args.modes[:at]:
                code = before_code if mode == "before" else None
                root = Path(scratch) / f"{number}-{mode}"
                sweeps[mode] = done = sweep(root, mode, code)
                print(f"round {number} {mode}: {done['wall_s']:.0f} s, {done['stopped_slow']} "
                      f"stopped slow, pick trial {done['best_trial']}", flush=True)
            rounds.append({mode: sweeps[mode] for mode in args.modes})
    return rounds


if __name__ == "__main__":
    main()
