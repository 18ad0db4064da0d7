"""How the CPU probe's heap setting moves what it measures: glibc's malloc settings, side by side.

On a CPU the probe's device memory is the process's anonymous RSS (probe/measure/meter.py).
Blocks at or above MALLOC_MMAP_THRESHOLD_ come from mmap and go back to the OS when freed;
smaller ones stay in malloc's arenas, where a freed block is reused only by one that fits, so a
phase's RSS peak carries what the allocation pattern left fragmented, not only the live
tensors. The tiny models' tensors are mostly under 1 MiB (FSDP halves them again), so this
matters here.
MALLOC_ARENA_MAX caps the arenas: by default a thread that finds the main arena locked gets
one of its own (up to 8 per core), and what is freed into one is reused only from it.

Each setting runs the same real probes, alternating, R times each: W = 1 and W = 2 (two real
gloo ranks) configs of tiny-qwen2.5. Per setting it reports the step time, how far repeated
probes of one config disagree (per phase peak, max - min), and how far measured peaks sit
from the trace (probe/trace.py: the live tensors, exact): the spread of (measured - traced)
over every phase of every config is what no fixed term can absorb.

    python benchmarks/cpu_heap.py [--repeats 3]

Writes benchmarks/results/cpu_heap.{txt,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from autotune.config import ProbeConfig
from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest

OUT = Path(__file__).parent / "results"
SETTINGS = {  # name: the glibc malloc environment a probe runs under
    "1 MiB": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    "256 KiB": {"MALLOC_MMAP_THRESHOLD_": str(256 << 10)},
    "256 KiB, 1 arena": {"MALLOC_MMAP_THRESHOLD_": str(256 << 10), "MALLOC_ARENA_MAX": "1"},
}
BASE = {"rollout_batch_size": 4, "rollout_n": 4, "global_batch_size": 2,
        "max_prompt_length": 64, "max_response_length": 128}
CONFIGS = [  # (ranks, knobs)
    (1, {"micro_batch_size_update": 4, "micro_batch_size_experience": 8,
         "gradient_checkpointing": False, "offload_params": False}),
    (1, {"micro_batch_size_update": 1, "micro_batch_size_experience": 2,
         "gradient_checkpointing": True, "offload_params": True}),
    (2, {"micro_batch_size_update": 4, "micro_batch_size_experience": 8,
         "gradient_checkpointing": False, "offload_params": False}),
    (2, {"micro_batch_size_update": 1, "micro_batch_size_experience": 8,
         "gradient_checkpointing": True, "offload_params": True}),
]
PHASE_NAMES = ("rollout", "experience", "update")  # GRPO: no critic


def probe(world: int, knobs: dict, heap_env: dict[str, str]) -> dict:
    """One real probe through the CLI (its own process tree) under a heap setting."""
    argv = [sys.executable, "-c", "from autotune.cli.main import main; main()", "probe",
            "--model", "tiny-qwen2.5", "--device", "cpu", "--threads", "1",
            "--gpus-per-node", str(world), "--json"]
    if world > 1:
        argv += ["--ranks", "real"]
    for name, value in {**BASE, **knobs}.items():
        argv += ["--set", f"{name}={str(value).lower()}"]
    env = {**os.environ, **heap_env}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    result = json.loads(done.stdout)
    if result["status"] != "ok":
        raise SystemExit(f"probe failed: {result['status']} {result.get('message', '')}")
    return {"step_s": result["step_s"], **{p: result["phase_peak_mem_bytes"][p]
                                           for p in PHASE_NAMES}}


def traced(world: int, knobs: dict) -> dict[str, int]:
    from autotune.probe.trace import trace_request

    config = dataclasses.replace(ProbeConfig(), **BASE, **knobs)
    request = ProbeRequest(model="tiny-qwen2.5", device=Device("cpu"), gpus_per_node=world,
                           emulated=world > 1, config=config)
    return trace_request(request, context_bytes=0).phase_peak_mem_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[list[dict]]] = {name: [[] for _ in CONFIGS] for name in SETTINGS}
    for repeat in range(args.repeats):
        for number, (world, knobs) in enumerate(CONFIGS):
            for name, heap_env in SETTINGS.items():  # alternating: same conditions
                runs[name][number].append(probe(world, knobs, heap_env))
                print(f"repeat {repeat + 1}/{args.repeats} config {number + 1} {name}: "
                      f"{runs[name][number][-1]}", file=sys.stderr, flush=True)
    traces = [traced(world, knobs) for world, knobs in CONFIGS]
    report: dict = {"repeats": args.repeats, "configs": CONFIGS, "environments": SETTINGS,
                    "settings": {}}
    for name in SETTINGS:
        step_s, disagree, residual, step_ratio = [], [], [], []
        for number, results in enumerate(runs[name]):
            step_s += [r["step_s"] for r in results]
            step_ratio += [r["step_s"] / base["step_s"]  # paired with the same repeat's
                           for r, base in zip(results, runs["1 MiB"][number], strict=True)]
            for phase in PHASE_NAMES:
                peaks = [r[phase] for r in results]
                disagree.append(max(peaks) - min(peaks))
                residual.append(statistics.median(peaks) - traces[number][phase])
        report["settings"][name] = {
            "step_s_median": statistics.median(step_s),
            "step_ratio_to_1mib": sorted(step_ratio),
            "repeat_spread_max_bytes": max(disagree),
            "repeat_spread_median_bytes": statistics.median(disagree),
            "residual_min_bytes": min(residual), "residual_max_bytes": max(residual),
            "residual_median_bytes": statistics.median(residual)}
    lines = [f"the CPU probe's heap: glibc malloc settings side by side, {len(CONFIGS)} "
             f"tiny-qwen2.5 configs (W = 1 and 2), {args.repeats} alternating repeats each",
             "", f"{'setting':<18}{'step s':>8}{'repeat spread MiB':>19}"
             f"{'measured - traced MiB':>23}{'spread':>8}",
             f"{'':<18}{'median':>8}{'median':>10}{'max':>9}{'min':>11}{'median':>7}{'max':>5}"]
    for name, s in report["settings"].items():
        lines.append(f"{name:<18}{s['step_s_median']:>8.2f}"
                     f"{s['repeat_spread_median_bytes'] / 2**20:>10.1f}"
                     f"{s['repeat_spread_max_bytes'] / 2**20:>9.1f}"
                     f"{s['residual_min_bytes'] / 2**20:>11.0f}"
                     f"{s['residual_median_bytes'] / 2**20:>7.0f}"
                     f"{s['residual_max_bytes'] / 2**20:>5.0f}"
                     f"{(s['residual_max_bytes'] - s['residual_min_bytes']) / 2**20:>8.0f}")
    lines += ["", "repeat spread: max - min of one config's phase peak over the repeats; "
                  "measured - traced: what a fixed term must cover, over every phase and config",
              "step time against the same config and repeat under 1 MiB (median, min-max):"]
    for name, s in list(report["settings"].items())[1:]:
        ratios = s["step_ratio_to_1mib"]
        lines.append(f"  {name}: {statistics.median(ratios):.2f}x "
                     f"({ratios[0]:.2f}-{ratios[-1]:.2f})")
    text = "\n".join(lines)
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "cpu_heap.txt").write_text(text + "\n")
    (OUT / "cpu_heap.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
