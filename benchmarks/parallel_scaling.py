"""Parallel probes on one machine: the same fixed sweep with 1 and with 2 probes at a time.

Runs `autotune run` for real (subprocess probes of tiny-qwen2.5 on the CPU) over the 6
configurations of benchmarks/spaces/parallel-scaling.yaml, each probed once, with one thread
per probe so that two parallel probes, each pinned to its own core, do not fight: first one
probe at a time, then two. For reference it also runs one probe at a time with 2 threads (one
probe using both cores), which is what a user without --parallel gets. Prints the wall times
and their ratio and writes benchmarks/results/parallel_scaling.txt (and JSON beside it).

    python benchmarks/parallel_scaling.py

Target: 2 parallel probes finish the sweep >= 1.6x faster than 1 at a time (same threads per
probe) on a 2-core machine.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT_DIR = Path(__file__).parent / "results"
SPACE = Path(__file__).parent / "spaces" / "parallel-scaling.yaml"
CONFIGS = 6


def sweep(results_dir: Path, name: str, parallel: int, threads: int) -> dict:
    """Run the fixed sweep once; its wall time and what it probed."""
    command = [sys.executable, "-m", "autotune", "run", "--model", "tiny-qwen2.5",
               "--device", "cpu", "--space", str(SPACE), "--trials", str(CONFIGS),
               "--sampler", "random", "--no-prune", "--no-prescreen", "--timed-steps", "2",
               "--warmup-steps", "1", "--threads", str(threads), "--parallel", str(parallel),
               "--study", name, "--results-dir", str(results_dir)]
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall_s = time.perf_counter() - started
    with open(results_dir / name / "trials.csv", newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r["status"] == "ok"]
    return {"parallel": parallel, "threads_per_probe": threads, "wall_s": wall_s,
            "probes": len(rows),
            "configs": sorted((r["micro_batch_size_update"], r["gradient_checkpointing"])
                              for r in rows),
            "mean_tokens_per_s": sum(float(r["tokens_per_s"]) for r in rows) / len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    runs = []
    with tempfile.TemporaryDirectory(prefix="autotune-scaling-") as tmp:
        for name, parallel, threads in (("serial", 1, 1), ("parallel", 2, 1),
                                        ("serial-2-threads", 1, 2)):
            print(f"{name}: {CONFIGS} probes, {parallel} at a time, {threads} thread(s) each",
                  flush=True)
            runs.append({"name": name, **sweep(Path(tmp), name, parallel, threads)})
            print(f"  {runs[-1]['wall_s']:.1f} s", flush=True)
    serial, parallel, serial2 = runs
    assert serial["configs"] == parallel["configs"] == serial2["configs"], "different sweeps"
    speedup = serial["wall_s"] / parallel["wall_s"]
    vs_two_threads = serial2["wall_s"] / parallel["wall_s"]
    lines = [f"parallel_scaling: the same {CONFIGS}-config sweep of tiny-qwen2.5 on {cores} "
             f"CPU cores ({time.strftime('%Y-%m-%d')})",
             f"{'run':<18}{'at once':>8}{'threads':>9}{'wall s':>9}{'mean tok/s':>12}"]
    for run in runs:
        lines.append(f"{run['name']:<18}{run['parallel']:>8}{run['threads_per_probe']:>9}"
                     f"{run['wall_s']:>9.1f}{run['mean_tokens_per_s']:>12.1f}")
    lines += [f"speed-up, 2 at a time vs 1 at a time (1 thread each): {speedup:.2f}x "
              f"(target >= 1.6x)",
              f"2 at a time (1 thread each) vs 1 at a time with 2 threads: {vs_two_threads:.2f}x"]
    text = "\n".join(lines)
    print(text)
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "parallel_scaling.txt").write_text(text + "\n")
    (OUT_DIR / "parallel_scaling.json").write_text(json.dumps(
        {"cores": cores, "runs": runs, "speedup": speedup,
         "speedup_vs_two_threads": vs_two_threads}, indent=2) + "\n")


if __name__ == "__main__":
    main()
