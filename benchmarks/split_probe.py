"""The split probe against its composition (issue 68): is a separate placement's step what
config/pipeline.py composes from its sides' phase times?

Real split probes of the tiny model on this CPU (probe/launch/split_sides.py: the engine's side
and the trainer's, one process each on a core of its own, a loopback link carrying the barriers
and every weight each step), a run of 4 emulated GPUs at 12 prompts x 2 responses of 32 + 32
tokens, over a grid: staleness 0 and 1, 1 and 2 engine GPUs, update micro-batch 1 and 2. Each
config is probed `--repeats` times, the configs interleaved (round by round, so a slow spell
of the machine falls on every config alike). For each probe: the step as it ran (sync to
sync, the mean of its 3 timed steps), the step composed from the same steps' phase times
(the sum at staleness 0; the slower side plus the sync at 1) and their ratio; per config the
ratio's mean and range over the repeats; and the probe's wall time.

    python benchmarks/split_probe.py [--repeats 3]

Target (issue 68): the composition within 10% of the measured step on every probe. Writes
benchmarks/results/split_probe.{txt,json}.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autotune.config import ProbeConfig
from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest, ProbeResult

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = dict(placement="separate", rollout_engine="vllm-like", kv_cache_memory_bytes=64 << 20,
              rollout_batch_size=12, rollout_n=2, global_batch_size=6,
              micro_batch_size_experience=2, max_prompt_length=32, max_response_length=32)
GRID = list(itertools.product((0, 1), (1, 2), (1, 2)))  # staleness, engine GPUs, update micro


def probe(staleness: int, engine_gpus: int, micro: int, folder: Path) -> tuple[ProbeResult,
                                                                               float]:
    config = ProbeConfig(**SHAPES, staleness=staleness, rollout_gpus=engine_gpus,
                         micro_batch_size_update=micro)
    request = ProbeRequest(model="tiny-qwen2.5", config=config, nnodes=1, gpus_per_node=4,
                           warmup_steps=1, timed_steps=3, timeout_s=600, device=Device("cpu"))
    path = folder / "request.json"
    path.write_text(request.to_json())
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "autotune.probe.worker", str(path),
                    str(folder / "result.json")], check=True, capture_output=True, timeout=900)
    wall = time.perf_counter() - started
    return ProbeResult.from_json((folder / "result.json").read_text()), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for staleness, engine_gpus, micro in GRID:
                result, wall = probe(staleness, engine_gpus, micro, Path(scratch))
                assert result.ok, result.message
                assert result.step_s and result.composed_step_s
                rows.append({"staleness": staleness, "rollout_gpus": engine_gpus,
                             "micro_batch_size_update": micro, "repeat": repeat,
                             "step_s": result.step_s, "composed_step_s": result.composed_step_s,
                             "ratio": result.composed_step_s / result.step_s,
                             "phase_s": result.phase_s, "probe_wall_s": wall,
                             "contention": result.contention})
                print(f"round {repeat + 1}: staleness {staleness}, engine {engine_gpus}, "
                      f"micro {micro}: step {result.step_s:.3f} s, composed "
                      f"{result.composed_step_s:.3f} s ({rows[-1]['ratio']:.3f})", flush=True)
    lines = [f"# split probe vs its composition, {datetime.date.today()}, "
             f"{os.cpu_count()} cores, {args.repeats} repeats interleaved",
             f"{'staleness':>9} {'engine':>6} {'micro':>5} {'step s':>8} {'composed s':>10} "
             f"{'ratio mean':>10} {'ratio range':>15} {'probe s':>8}"]
    for staleness, engine_gpus, micro in GRID:
        mine = [r for r in rows if (r["staleness"], r["rollout_gpus"],
                                    r["micro_batch_size_update"]) == (staleness, engine_gpus,
                                                                      micro)]
        ratios = [r["ratio"] for r in mine]
        lines.append(
            f"{staleness:>9} {engine_gpus:>6} {micro:>5} "
            f"{statistics.mean(r['step_s'] for r in mine):>8.3f} "
            f"{statistics.mean(r['composed_step_s'] for r in mine):>10.3f} "
            f"{statistics.mean(ratios):>10.3f} "
            f"{f'[{min(ratios):.3f}, {max(ratios):.3f}]':>15} "
            f"{statistics.mean(r['probe_wall_s'] for r in mine):>8.1f}")
    ratios = [r["ratio"] for r in rows]
    within = sum(abs(r - 1) <= 0.10 for r in ratios)
    lines += [f"all {len(rows)} probes: composed / measured {statistics.mean(ratios):.3f} "
              f"[{min(ratios):.3f}, {max(ratios):.3f}]; within 10%: {within}/{len(rows)}; "
              f"within 2%: {sum(abs(r - 1) <= 0.02 for r in ratios)}/{len(rows)}",
              f"contended probes: {sum(1 for r in rows if r['contention'])}/{len(rows)}"]
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / "split_probe.txt").write_text(text)
    (RESULTS / "split_probe.json").write_text(json.dumps(
        {"date": str(datetime.date.today()), "cores": os.cpu_count(), "rows": rows},
        indent=1) + "\n")


if __name__ == "__main__":
    main()
