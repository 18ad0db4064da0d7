"""The traced estimate (probe/trace.py) against measured peaks, cold: no calibration.

Each grid config is traced (the probe's own step under fake tensors, rank 0 of W) and the
trace's per-phase peak plus the fixed term (memory.model.TRACE_CPU_CONTEXT_BYTES) is compared
with the real, uncapped CPU probe's measured peak for that phase; memory.py's prior is scored
beside it on the same rows. The grids are recorded by benchmarks/landscape.py:

    tiny-qwen2.5     W=1  spaces/memory-grid.yaml        64 configs
    tiny-qwen2.5-vl  W=1  spaces/memory-grid-vl.yaml     32 configs
    tiny-qwen2.5     W=2  spaces/memory-grid-w2.yaml     16 configs (2 real ranks, gloo)
    tiny-qwen2.5-vl  W=2  spaces/memory-grid-vl-w2.yaml  16 configs (2 real ranks, gloo)
    tiny-qwen2.5     W=1  spaces/memory-grid-ppo.yaml    16 configs (PPO: a critic)
    tiny-qwen2.5     W=2  spaces/memory-grid-ppo-w2.yaml 16 configs (PPO, 2 real ranks)

Then qwen2.5-7b and qwen2.5-vl-7b are traced as rank 0 of 8 GPUs (bf16, the vllm-like engine,
`autotune estimate`'s defaults) and timed, beside memory.py's figures.

    python benchmarks/trace_accuracy.py [--record] [--no-large]

`--record` probes the missing rows of the W = 2 grids (two real ranks each, one probe at a
time: about 12 min on 2 cores) and of the PPO grids; the other W = 1 grids are
memory_accuracy.py's (`--record` there).

Targets: median absolute error <= 3% per grid, cold; each 7B trace within 180 s.
Traces are cached next to the grids (benchmarks/data/*_traced.csv).
Writes benchmarks/results/trace_accuracy.{txt,json}.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from landscape import record, trace_grid, typed_params  # noqa: E402

from autotune.config import ProbeConfig  # noqa: E402
from autotune.hardware import Device
from autotune.memory.model import (  # noqa: E402
    TRACE_CPU_CONTEXT_BYTES,
    TRACE_GPU_CONTEXT_BYTES,
    estimate_memory,
)
from autotune.memory.shape import model_shape  # noqa: E402
from autotune.probe.measure.result import ProbeRequest  # noqa: E402
from autotune.sweep.space.params import params_key  # noqa: E402
from autotune.sweep.space.search_space import load_search_space  # noqa: E402

HERE = Path(__file__).parent
DATA, OUT = HERE / "data", HERE / "results"
GRIDS = [("tiny-qwen2.5", 1, "memory-grid", "memory_grid_tiny"),
         ("tiny-qwen2.5-vl", 1, "memory-grid-vl", "memory_grid_tiny_vl"),
         ("tiny-qwen2.5", 2, "memory-grid-w2", "memory_grid_tiny_w2"),
         ("tiny-qwen2.5-vl", 2, "memory-grid-vl-w2", "memory_grid_tiny_vl_w2"),
         ("tiny-qwen2.5", 1, "memory-grid-ppo", "memory_grid_tiny_ppo"),
         ("tiny-qwen2.5", 2, "memory-grid-ppo-w2", "memory_grid_tiny_ppo_w2")]
RECORDED_HERE = ("memory-grid-w2", "memory-grid-vl-w2", "memory-grid-ppo", "memory-grid-ppo-w2")
PHASES = ("rollout", "experience", "critic_update", "update")  # critic_update: PPO only
LARGE = [("qwen2.5-7b", {}), ("qwen2.5-vl-7b", {"image_size_px": 448, "max_prompt_length": 512})]
LARGE_GPUS, LARGE_CAPACITY = 8, 80 << 30


def grid_errors(model: str, world: int, space_name: str, data: str) -> dict:
    space = load_search_space(str(HERE / "spaces" / f"{space_name}.yaml"))
    request = ProbeRequest(model=model, device=Device("cpu"), gpus_per_node=world,
                           emulated=world > 1)
    traced = trace_grid(space, DATA / f"{data}_traced.csv", request)
    shape = model_shape(model)
    rows = {"traced": [], "model": []}
    with open(DATA / f"{data}.csv", newline="") as handle:
        for row in csv.DictReader(handle):
            if row["status"] != "ok":
                continue
            params = typed_params(space, row)
            estimate = estimate_memory(shape, space.config_for(params), num_gpus=world,
                                       on_gpu=False)
            for phase in PHASES:
                if not row.get(f"peak_mem_{phase}_bytes"):
                    continue  # no critic in GRPO
                measured = int(row[f"peak_mem_{phase}_bytes"])
                ours = traced[params_key(params)][phase] + TRACE_CPU_CONTEXT_BYTES
                rows["traced"].append((ours - measured) / measured)
                rows["model"].append((estimate.phases[phase].total_bytes - measured) / measured)
    return {name: {"median_abs": statistics.median(abs(e) for e in errs),
                   "max_over": max(errs), "max_under": -min(errs), "phase_peaks": len(errs)}
            for name, errs in rows.items()}


def large_trace(model: str, extra: dict) -> dict:
    from autotune.probe.trace import trace_request

    world = LARGE_GPUS
    config = ProbeConfig(rollout_batch_size=8 * world, global_batch_size=4 * world,
                         rollout_engine="vllm-like", **extra)
    request = ProbeRequest(model=model, device=Device("cuda", LARGE_CAPACITY), config=config,
                           gpus_per_node=world, emulated=True)
    started = time.perf_counter()
    result = trace_request(request, TRACE_GPU_CONTEXT_BYTES)
    wall_s = time.perf_counter() - started
    estimate = estimate_memory(model_shape(model), config, num_gpus=world, on_gpu=True,
                               engine_capacity_bytes=LARGE_CAPACITY)
    return {"model": model, "world_size": world, "wall_s": wall_s,
            "traced": result.phase_peak_mem_bytes,
            "memory_model": {p: e.total_bytes for p, e in estimate.phases.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-large", action="store_true", help="skip the 7B traces")
    parser.add_argument("--record", action="store_true",
                        help="probe the W = 2 grids' rows not yet recorded (about 12 min)")
    args = parser.parse_args()
    if args.record:
        for model, world, space_name, data in GRIDS:
            if space_name in RECORDED_HERE:
                request = ProbeRequest(model=model, device=Device("cpu"), cpu_threads=1,
                                       gpus_per_node=world, warmup_steps=1, timed_steps=1,
                                       timeout_s=300)
                record(load_search_space(str(HERE / "spaces" / f"{space_name}.yaml")),
                       DATA / f"{data}.csv", request, parallel=1)
    report = {"context_bytes": TRACE_CPU_CONTEXT_BYTES, "grids": {}, "large": []}
    lines = ["traced estimate vs measured peak per phase: real uncapped CPU probes, cold (no "
             f"calibration), fixed term {TRACE_CPU_CONTEXT_BYTES >> 20} MiB; memory.py's prior "
             "beside it", "",
             f"{'grid':<20}{'W':>3}{'phase peaks':>13}{'traced':>8}{'max over':>10}"
             f"{'max under':>11}{'memory.py':>11}"]
    for model, world, space_name, data in GRIDS:
        if not (DATA / f"{data}.csv").exists():
            print(f"skipped {data}: not recorded", file=sys.stderr)
            continue
        scores = grid_errors(model, world, space_name, data)
        report["grids"][f"{model} W={world}"] = scores
        t, m = scores["traced"], scores["model"]
        lines.append(f"{model:<20}{world:>3}{t['phase_peaks']:>13}{t['median_abs']:>8.1%}"
                     f"{t['max_over']:>10.1%}{t['max_under']:>11.1%}{m['median_abs']:>11.1%}")
    met = all(g["traced"]["median_abs"] <= 0.03 for g in report["grids"].values())
    lines += ["", "columns: median absolute error over every measured phase peak; the largest "
                  "overstatement and understatement; memory.py's median with its prior",
              f"median abs error <= 3% cold on every grid: {'met' if met else 'MISSED'}"]
    if not args.no_large:
        lines += ["", f"large models traced on this CPU as rank 0 of {LARGE_GPUS} GPUs "
                      f"({LARGE_CAPACITY >> 30} GiB each, bf16, vllm-like engine), GiB:",
                  f"{'model':<16}{'trace s':>9}{'phase':>12}{'traced':>9}{'memory.py':>11}"
                  f"{'difference':>12}"]
        for model, extra in LARGE:
            large = large_trace(model, extra)
            report["large"].append(large)
            for number, phase in enumerate(large["traced"]):
                traced, modelled = large["traced"][phase], large["memory_model"][phase]
                head = f"{model:<16}{large['wall_s']:>9.1f}" if number == 0 else " " * 25
                lines.append(f"{head}{phase:>12}{traced / 2**30:>9.2f}"
                             f"{modelled / 2**30:>11.2f}{(modelled - traced) / traced:>+12.1%}")
        fast = all(large["wall_s"] <= 180 for large in report["large"])
        lines.append(f"each 7B trace within 180 s: {'met' if fast else 'MISSED'}")
    text = "\n".join(lines)
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "trace_accuracy.txt").write_text(text + "\n")
    (OUT / "trace_accuracy.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
