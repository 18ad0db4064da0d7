"""A sweep on a machine someone else is using: does it still pick the quiet machine's config?

The README's demo sweep (`autotune run`: tiny-qwen2.5 on the CPU, the cpu-demo space, its
545 MiB cap, 12 probes and 3 finalists) runs twice with the same seed: once on a quiet machine,
once with a competing load started by this script (one busy process per core but one, each
bounded) for the first half of the quiet sweep's wall time. Then:

- which probes of the loaded sweep were flagged as contended (trials.csv, column contention),
  against the probes that ran while the load did;
- whether the loaded sweep picked the quiet sweep's config; if not, both picks are probed again
  on the quiet machine, interleaved (REMEASURE times each), and the loaded pick must be within
  2% of the quiet pick's objective (tokens/s per GiB of peak memory).

    python benchmarks/loaded_sweep.py [--remeasure 3]

Writes benchmarks/results/loaded_sweep.{txt,json}.
"""

from __future__ import annotations

import argparse
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

OUT = Path(__file__).parent / "results"
WITHIN = 0.02
SPIN = ("import sys, time\nend = time.time() + float(sys.argv[1])\n"
        "while time.time() < end: pass\n")


def sweep(results: Path, load_s: float = 0.0) -> dict:
    """The demo sweep into `results`, with `load_s` seconds of competing load at its start;
    its wall time, its pick and its trials."""
    busy = [subprocess.Popen([sys.executable, "-c", SPIN, str(load_s)])
            for _ in range(max(1, (os.cpu_count() or 2) - 1))] if load_s else []
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "autotune", "run", "--results-dir",
                           str(results)], capture_output=True, text=True, timeout=7200)
    wall_s = time.time() - started
    for proc in busy:
        proc.kill()
        proc.wait()
    if done.returncode:
        raise SystemExit(f"the sweep failed:\n{done.stderr[-3000:]}")
    study = next(results.iterdir())
    best = yaml.safe_load((study / "best.yaml").read_text())
    with open(study / "trials.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row["status"] == "ok"]
    return {"wall_s": wall_s, "load_s": load_s, "started": started, "best": best,
            "rows": rows, "study": study}


def ran_during_load(run: dict) -> list[str]:
    """The probed trials of `run` that started before its load ended (from study.db)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=run["study"].name,
                              storage=f"sqlite:///{run['study'] / 'study.db'}")
    load_end = run["started"] + run["load_s"]
    return [str(t.number) for t in study.get_trials(deepcopy=False)
            if t.user_attrs.get("probed") and t.datetime_start is not None
            and t.datetime_start.timestamp() < load_end]


def remeasure(config: dict, times: int) -> list[dict]:
    """`autotune probe` of the demo's model, cap and `config`, `times` times."""
    args = [arg for key, value in config.items() for arg in ("--set", f"{key}={value}")]
    runs = []
    for _ in range(times):
        done = subprocess.run([sys.executable, "-m", "autotune", "probe", "--model",
                               "tiny-qwen2.5", "--device", "cpu", "--gpu-memory-limit",
                               "545MiB", "--json", *args], capture_output=True, text=True,
                              timeout=1800)
        runs.append(json.loads(done.stdout))
    return runs


def objective(run: dict) -> float:
    return run["tokens_per_s"] / (run["peak_mem_bytes"] / 2**30) if run.get("tokens_per_s") \
        else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--remeasure", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        quiet = sweep(Path(tmp) / "quiet")
        loaded = sweep(Path(tmp) / "loaded", load_s=quiet["wall_s"] / 2)
        picks = {name: {k: run["best"]["config"][k] for k in run["best"]["searched"]}
                 for name, run in (("quiet", quiet), ("loaded", loaded))}
        same = picks["quiet"] == picks["loaded"]
        measured: dict[str, list[dict]] = {"quiet": [], "loaded": []}
        if not same:
            for _ in range(args.remeasure):  # interleaved, one probe of each at a time
                for name in measured:
                    measured[name] += remeasure(picks[name], 1)
        during = ran_during_load(loaded)  # reads study.db: before the folder goes
    flagged = [row for row in loaded["rows"] if row["contention"]]
    quiet_flagged = [row for row in quiet["rows"] if row["contention"]]
    lines = [f"a sweep under a competing load against the same sweep on a quiet machine "
             f"({os.cpu_count()} cores), {time.strftime('%Y-%m-%d')}: the README's demo "
             "(tiny-qwen2.5, cpu-demo, 12 probes + 3 finalists, seed 0)",
             f"quiet sweep: {quiet['wall_s'] / 60:.1f} min, picked trial "
             f"{quiet['best']['trial']}: {picks['quiet']}",
             f"loaded sweep: {loaded['wall_s'] / 60:.1f} min, {len(os.sched_getaffinity(0)) - 1}"
             f" busy process(es) for its first {loaded['load_s'] / 60:.1f} min; picked trial "
             f"{loaded['best']['trial']}: {picks['loaded']}",
             f"probes flagged as contended: {len(flagged)} of {len(loaded['rows'])} in the "
             f"loaded sweep ({', '.join(r['number'] for r in flagged) or 'none'}); probes "
             f"that ran while the load did: {', '.join(during) or 'none'}; "
             f"{len(quiet_flagged)} of {len(quiet['rows'])} flagged in the quiet sweep"]
    document = {"quiet": {k: v for k, v in quiet.items() if k not in ("rows", "study")},
                "loaded": {k: v for k, v in loaded.items() if k not in ("rows", "study")},
                "picks": picks, "same_pick": same,
                "flagged": [r["number"] for r in flagged], "ran_during_load": during,
                "flagged_quiet": [r["number"] for r in quiet_flagged],
                "loaded_rows": [{k: r[k] for k in ("number", "origin", "tokens_per_s",
                                                   "step_cv", "contention")}
                                for r in loaded["rows"]],
                "remeasured": measured}
    if same:
        lines.append("the loaded sweep picked the quiet sweep's config: met")
    else:
        means = {name: statistics.fmean(objective(r) for r in runs)
                 for name, runs in measured.items()}
        ratio = means["loaded"] / means["quiet"]
        document["remeasured_ratio"] = ratio
        lines.append(f"picks differ; re-measured quietly, {args.remeasure} interleaved probes "
                     f"each: loaded pick / quiet pick = {ratio:.3f} (target >= "
                     f"{1 - WITHIN:.2f}: {'met' if ratio >= 1 - WITHIN else 'MISSED'})")
    text = "\n".join(lines)
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "loaded_sweep.txt").write_text(text + "\n")
    (OUT / "loaded_sweep.json").write_text(json.dumps(document, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
