"""A GPU-sized landscape for the search: every config of benchmarks/spaces/gpu-landscape.yaml
(8 knobs, 2,304 configs) for qwen2.5-7b and qwen2.5-vl-7b on 8 x 80 GB and 8 x 40 GB GPUs,
each config's memory from the trace and its time from the time model
(autotune/estimates/throughput.py).

Memory. Each phase's peak on rank 0 of 8 is the probe's own step traced under fake tensors
(probe/trace.py: every tensor, exactly, for this torch and transformers) plus the fixed term
an H200 held beyond the traced tensors in that phase for that model (benchmarks/results/gpu:
the CUDA context and the caching allocator's slack). A phase's traced tensors move only
with the knobs memory.phases.PHASE_KNOBS lists for it (the segments the first update leaves
held, memory.phases.CARRIED_KNOBS, are the allocator's: in the fixed term; the engine
sleeps, so its share of the GPU moves the rollout alone), so the traces are taken per
phase: a design of whole-step traces covers every phase's knob combination (the
rollout's on each GPU size, the others' on either), and a config's row puts the three
phases together. `check` traces whole configs
at random and compares them with the composed rows byte for byte, and the fixed term with
the trace's own allocator replay of each design config where a row holds it (rows traced
since 2026-12-02; the landscape reads the tensors + the fixed term on every row, so that
rows traced before and after the replay existed make one landscape). Traces are cached in
benchmarks/data/gpu_landscape_traces.csv (resumable: a config traced is never traced again,
and a change to PHASE_KNOBS traces only the combinations no trace holds yet).

A config is OOM in the first phase whose peak passes the GPU (rollout, experience, update, as
a step runs them); a config whose engine cannot hold one KV block is cache_oom in rollout,
as the probe reports it. Its probe time is the time of the phases it ran.

    python benchmarks/gpu_landscape.py trace [--jobs 2]   # ~1 h on 2 cores, resumable
    python benchmarks/gpu_landscape.py check [--configs 4]
    python benchmarks/gpu_landscape.py build              # each landscape as a CSV, to look at
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).parent))

from landscape import figures  # noqa: E402

from autotune.estimates.throughput import Hardware  # noqa: E402
from autotune.hardware import Device  # noqa: E402
from autotune.memory.phases import PHASE_KNOBS  # noqa: E402
from autotune.memory.shape import model_shape  # noqa: E402
from autotune.probe.measure.result import ProbeRequest, ProbeResult, ProbeStatus  # noqa: E402
from autotune.sweep.space.params import params_key  # noqa: E402
from autotune.sweep.space.search_space import SearchSpace, load_search_space  # noqa: E402

if TYPE_CHECKING:
    from autotune.estimates.throughput import TimeModel

HERE = Path(__file__).parent
SPACE_FILE = HERE / "spaces" / "gpu-landscape.yaml"
TRACES = HERE / "data" / "gpu_landscape_traces.csv"
MODELS = ("qwen2.5-7b", "qwen2.5-vl-7b")
GPUS = {"8x80GB": 80 << 30, "8x40GB": 40 << 30}  # H100 80 GB and A100 40 GB: one GPU's bytes
WORLD = 8
STEP_PHASES = ("rollout", "experience", "update")  # GRPO, as a step runs them
GiB = 1 << 30
# What an H200 held beyond the traced tensors, per phase (NVML's peak less the traced peak,
# benchmarks/results/gpu/gpu_evidence.txt: "7b rank0/8 ckpt" and "vl-7b rank0/8")
FIXED_TERM_BYTES = {
    "qwen2.5-7b": {"rollout": 1.21 * GiB, "experience": 3.82 * GiB, "update": 11.94 * GiB},
    "qwen2.5-vl-7b": {"rollout": 1.37 * GiB, "experience": 4.34 * GiB,
                      "update": 12.04 * GiB},
}
CHECK_TOLERANCE_BYTES = 1 << 20  # composed vs whole: an integer tensor may differ, not a layer
# traced_*: the live tensors' peak + the CUDA context, what FIXED_TERM_BYTES was measured
# beyond; reserved_*: the trace's allocator replay + the context (probe/trace.py's
# phase_peak_mem_bytes on a GPU), kept beside it and compared by `check` (rows traced
# before 2026-12-02 hold none)
COLUMNS = ["model", "gpu", "kind", "status", "message", "trace_s",
           *(f"traced_{p}_bytes" for p in STEP_PHASES),
           *(f"reserved_{p}_bytes" for p in STEP_PHASES)]


def space() -> SearchSpace:
    """The landscape's space, for a run of WORLD GPUs (what rollout TP must divide)."""
    return dataclasses.replace(load_search_space(str(SPACE_FILE)), world_size=WORLD)


def phase_key_knobs(grid: SearchSpace) -> dict[str, tuple[str, ...]]:
    """The space's knobs that move each phase's peak (memory.phases.PHASE_KNOBS); the
    engine sleeps after its rollout, so its share of the GPU moves the rollout alone."""
    return {phase: tuple(name for name in grid.params if name in PHASE_KNOBS[phase] and (
        phase == "rollout" or name != "gpu_memory_utilization")) for phase in STEP_PHASES}


def phase_key(phase: str, params: dict, knobs: dict[str, tuple[str, ...]]) -> str:
    return json.dumps([phase, {name: params[name] for name in knobs[phase]}], sort_keys=True)


def covering_design(grid: SearchSpace, needed: dict[str, set[str]] | None = None
                    ) -> list[dict]:
    """Whole configs whose traces hold every phase's knob combination in `needed` (all of
    the grid's when None): one per rollout combination, each carrying an update and an
    experience combination not yet covered (matched on the knobs they share), more only
    where some are left over."""
    knobs = phase_key_knobs(grid)
    configs = list(grid.grid())
    if needed is None:
        needed = {phase: {phase_key(phase, c, knobs) for c in configs} for phase in STEP_PHASES}
    needed = {phase: set(keys) for phase, keys in needed.items()}
    chosen: list[dict] = []
    for config in configs:  # the grid's order: the first config of each rollout combination
        keys = {phase: phase_key(phase, config, knobs) for phase in STEP_PHASES}
        if keys["rollout"] not in needed["rollout"]:
            continue
        # of the configs sharing this rollout combination, the one covering the most
        best = max((c for c in configs
                    if phase_key("rollout", c, knobs) == keys["rollout"]),
                   key=lambda c: sum(phase_key(p, c, knobs) in needed[p]
                                     for p in STEP_PHASES))
        chosen.append(best)
        for phase in STEP_PHASES:
            needed[phase].discard(phase_key(phase, best, knobs))
    while any(needed.values()):
        best = max(configs, key=lambda c: sum(phase_key(p, c, knobs) in needed[p]
                                              for p in STEP_PHASES))
        chosen.append(best)
        for phase in STEP_PHASES:
            needed[phase].discard(phase_key(phase, best, knobs))
    return chosen


def design_jobs(grid: SearchSpace, traces: dict) -> list[tuple[str, str, dict]]:
    """The design's traces still to take: per model, the phase combinations no design trace
    holds yet (the rollout's per GPU, the others' from either GPU's), covered GPU by GPU,
    the larger first (a trace whose engine cannot start holds no other phase). A fresh
    cache gets the whole design on each GPU; a change to PHASE_KNOBS, only the new keys."""
    knobs = phase_key_knobs(grid)
    configs = list(grid.grid())
    every = {phase: {phase_key(phase, c, knobs) for c in configs} for phase in STEP_PHASES}
    jobs = []
    for model in MODELS:
        held: dict[tuple[str, str], set[str]] = {}
        for (m, gpu, kind, _), row in traces.items():
            if m != model or kind != "design":
                continue
            for phase in STEP_PHASES:
                if row["status"] == "ok" or phase == "rollout":
                    where = gpu if phase == "rollout" else ""
                    held.setdefault((phase, where), set()).add(
                        phase_key(phase, row["params"], knobs))
        for gpu in sorted(GPUS, key=GPUS.__getitem__, reverse=True):
            needed = {phase: every[phase] - held.get((phase, gpu if phase == "rollout"
                                                      else ""), set())
                      for phase in STEP_PHASES}
            for params in covering_design(grid, needed):
                jobs.append((model, gpu, params))
                for phase in STEP_PHASES[1:]:
                    held.setdefault((phase, ""), set()).add(phase_key(phase, params, knobs))
    return jobs


def request_for(grid: SearchSpace, model: str, capacity_bytes: int, params: dict
                ) -> ProbeRequest:
    return ProbeRequest(model=model, config=grid.config_for(params),
                        device=Device("cuda", capacity_bytes=capacity_bytes),
                        gpus_per_node=WORLD)


def trace_one(model: str, gpu: str, params: dict) -> dict:
    """One whole-step trace as rank 0 of 8 (in a worker process: torch loads once)."""
    import torch

    from autotune.probe.measure.oom import classify_exception
    from autotune.probe.trace import trace_request
    from autotune.probe.worker import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(1)
    started = time.perf_counter()
    row = {"model": model, "gpu": gpu, **params}
    try:
        result = trace_request(request_for(space(), model, GPUS[gpu], params), 0)
    except Exception as exc:  # the engine cannot start, say: the probe would report it so
        status, message = classify_exception(exc)
        return {**row, "status": status.value, "message": message,
                "trace_s": round(time.perf_counter() - started, 1)}
    return {**row, "status": "ok", "message": "", "trace_s": round(result.trace_s, 1),
            **{f"traced_{p}_bytes": result.phase_tensor_bytes[p] + result.context_bytes
               for p in STEP_PHASES},
            **{f"reserved_{p}_bytes": result.phase_peak_mem_bytes[p] for p in STEP_PHASES}}


def read_traces(grid: SearchSpace) -> dict[tuple[str, str, str, str], dict]:
    """(model, gpu, kind, params_key) -> the row, typed."""
    if not TRACES.exists():
        return {}
    table = {}
    with open(TRACES, newline="") as handle:
        for row in csv.DictReader(handle):
            params = {name: spec.values()[[str(v) for v in spec.values()].index(row[name])]
                      for name, spec in grid.params.items()}
            table[(row["model"], row["gpu"], row["kind"], params_key(params))] = {
                **row, "params": params}
    return table


def append_row(row: dict, grid: SearchSpace) -> None:
    columns = [*COLUMNS[:3], *grid.params, *COLUMNS[3:]]
    new = not TRACES.exists()
    TRACES.parent.mkdir(parents=True, exist_ok=True)
    with open(TRACES, "a", newline="") as handle:
        writer = csv.DictWriter(handle, columns, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow(row)


def jobs_to_trace(grid: SearchSpace, kind: str, count: int, seed: int) -> list[tuple]:
    if kind == "design":
        return design_jobs(grid, read_traces(grid))
    pick = random.Random(seed)
    configs = list(grid.grid())
    return [(model, gpu, pick.choice(configs)) for model in MODELS for gpu in GPUS
            for _ in range(count)]


def run_traces(kind: str, jobs: int, count: int = 0, seed: int = 0) -> None:
    grid = space()
    done = read_traces(grid)
    todo = [(m, g, p) for m, g, p in jobs_to_trace(grid, kind, count, seed)
            if (m, g, kind, params_key(p)) not in done]
    print(f"{kind}: {len(todo)} traces to go, {jobs} at a time", flush=True)
    started = time.monotonic()
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(trace_one, *job) for job in todo]
        for number, future in enumerate(as_completed(futures), 1):
            row = {**future.result(), "kind": kind}
            append_row(row, grid)
            print(f"[{time.monotonic() - started:6.0f} s] {number}/{len(todo)} {row['model']} "
                  f"{row['gpu']} {row['status']} {row['trace_s']} s", flush=True)


def composed(traces: dict, grid: SearchSpace, model: str, gpu: str
             ) -> dict[str, dict[str, int | str]]:
    """params_key -> each phase's traced bytes (or the failure of the trace that holds its
    rollout), from the design's traces: the rollout's from this GPU's, the other phases' from
    either GPU's (the engine sleeps: they are the same to the byte, `check` counts them; a
    trace whose engine cannot start on the smaller GPU holds no other phase)."""
    knobs = phase_key_knobs(grid)
    parts: dict[str, dict] = {}
    for (m, g, kind, _), row in traces.items():
        if m != model or kind != "design":
            continue
        for phase in STEP_PHASES:
            if phase == "rollout" and g != gpu:  # the GPU's size moves the engine's share
                continue
            key = phase_key(phase, row["params"], knobs)
            if row["status"] == "ok":
                parts.setdefault(key, int(row[f"traced_{phase}_bytes"]))
            elif phase == "rollout":
                parts.setdefault(key, row["status"])
    table = {}
    for params in grid.grid():
        phases = {phase: parts.get(phase_key(phase, params, knobs)) for phase in STEP_PHASES}
        if isinstance(phases["rollout"], str):  # the engine did not start: nothing else ran
            phases = {"rollout": phases["rollout"]}
        table[params_key(params)] = phases
    return table


def landscape_row(model: str, gpu: str, params: dict, phases: dict, times: TimeModel,
                  grid: SearchSpace) -> ProbeResult:
    """What a probe of `params` would report: the first phase past the GPU fails it."""
    capacity = GPUS[gpu]
    config = grid.config_for(params)
    phase_s = times.phase_seconds(config, model_shape(model), Hardware.of(capacity, WORLD))
    ran_s, peaks = 0.0, {}
    for phase in STEP_PHASES:
        traced = phases.get(phase)
        if traced is None or isinstance(traced, str):
            status = ProbeStatus(traced) if traced else ProbeStatus.CRASH
            return failed(status, phase, peaks, times.PROBE_START_S + ran_s, capacity)
        peak = int(traced + FIXED_TERM_BYTES[model][phase])
        peaks[phase] = peak
        ran_s += phase_s[phase]
        if peak > capacity:
            return failed(ProbeStatus.GPU_OOM, phase, peaks, times.PROBE_START_S + ran_s,
                          capacity)
    step_s = sum(phase_s.values())
    tokens = times.step_tokens(config)
    return ProbeResult(
        status=ProbeStatus.OK, tokens_per_s=tokens / step_s / WORLD,
        samples_per_s=config.rollout_batch_size * config.rollout_n / step_s, step_s=step_s,
        phase_s=dict(phase_s), peak_mem_bytes=max(peaks.values()), phase_peak_mem_bytes=peaks,
        device_limit_bytes=capacity, device_capacity_bytes=capacity,
        probe_wall_s=times.probe_wall_s(step_s), device_name=gpu)


def failed(status: ProbeStatus, phase: str, peaks: dict, wall_s: float, capacity: int
           ) -> ProbeResult:
    """A probe that ran out in `phase` after `wall_s` (its start and the phases before)."""
    return ProbeResult(status=status, failed_phase=phase, message=f"landscape {status.value}",
                       phase_peak_mem_bytes=dict(peaks), device_limit_bytes=capacity,
                       device_capacity_bytes=capacity,
                       probe_wall_s=wall_s, device_name="landscape")


def landscape_path(model: str, gpu: str) -> Path:
    return HERE / "data" / f"gpu_landscape_{model}_{gpu}.csv"  # not committed: `build`


def landscape(model: str, gpu: str, grid: SearchSpace | None = None,
              traces: dict | None = None) -> dict[str, ProbeResult]:
    """params_key -> what a probe of it reports, for every config: built from the cached
    traces and the time model in about a second (the table is not stored)."""
    from autotune.estimates.throughput import TimeModel

    grid = grid or space()
    traces = read_traces(grid) if traces is None else traces
    table = composed(traces, grid, model, gpu)
    missing = sum(None in phases.values() for phases in table.values())
    if missing:
        raise SystemExit(f"{model} {gpu}: {missing} configs lack a trace; run "
                         "`python benchmarks/gpu_landscape.py trace`")
    times = TimeModel.calibrated()
    return {params_key(params): landscape_row(model, gpu, params, table[params_key(params)],
                                              times, grid) for params in grid.grid()}


def build() -> None:
    """Each landscape as a CSV (landscape.py's columns) in benchmarks/data/, to look at."""
    from landscape import result_row

    from autotune.estimates.throughput import TimeModel

    grid = space()
    traces = read_traces(grid)
    print(TimeModel.calibrated().describe())
    for model, gpu in itertools.product(MODELS, GPUS):
        table = landscape(model, gpu, grid, traces)
        path = landscape_path(model, gpu)
        statuses: dict[str, int] = {}
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, [*grid.params, *figures(grid)])
            writer.writeheader()
            for params in grid.grid():
                result = table[params_key(params)]
                statuses[result.status.value] = statuses.get(result.status.value, 0) + 1
                writer.writerow(result_row(params, result, figures(grid)))
        print(f"{path.name}: {statuses}")


def check(count: int, seed: int, jobs: int) -> int:
    """Whole configs traced at random against the rows composed from the design: equal."""
    run_traces("check", jobs, count, seed)
    grid = space()
    traces = read_traces(grid)
    unequal = total = largest = 0
    for (model, gpu, kind, key), row in traces.items():
        if kind != "check":
            continue
        phases = composed(traces, grid, model, gpu)[key]
        for phase in STEP_PHASES:
            if row["status"] != "ok" and phase != "rollout":
                continue
            whole = row["status"] if row["status"] != "ok" else \
                int(row[f"traced_{phase}_bytes"])
            part = phases.get(phase)
            total += 1
            if part != whole:
                unequal += 1
                largest = max(largest, abs(part - whole) if isinstance(part, int) and
                              isinstance(whole, int) else CHECK_TOLERANCE_BYTES + 1)
    lines = [f"gpu_landscape check, {time.strftime('%Y-%m-%d')}: {total} phases of "
             f"{count} random whole configs per model and GPU, traced whole and composed from "
             "the design's per-phase traces",
             f"composed vs whole traces: {total - unequal} of {total} phases equal to the byte, "
             f"the largest difference {largest} bytes (tolerance {CHECK_TOLERANCE_BYTES})"]
    pairs = unequal_pairs = 0  # the design's configs traced on both GPUs: the other phases
    for (model, gpu, kind, key), row in traces.items():
        other = traces.get((model, "8x80GB", kind, key))
        if gpu == "8x80GB" or kind != "design" or row["status"] != "ok" or \
                other is None or other["status"] != "ok":
            continue
        for phase in ("experience", "update"):
            pairs += 1
            unequal_pairs += row[f"traced_{phase}_bytes"] != other[f"traced_{phase}_bytes"]
    lines.append(f"experience and update traced on 8x40GB and 8x80GB: {pairs - unequal_pairs} "
                 f"of {pairs} equal to the byte")
    lines.extend(fixed_term_vs_replay(traces))
    print("\n".join(lines))
    (HERE / "results" / "gpu_landscape_check.txt").write_text("\n".join(lines) + "\n")
    return 1 if largest > CHECK_TOLERANCE_BYTES or unequal_pairs else 0


def fixed_term_vs_replay(traces: dict) -> list[str]:
    """How far the landscape's peaks (traced tensors + context + FIXED_TERM_BYTES, one
    figure a model and phase) are from the trace's own allocator replay of each config
    (reserved_* + context), on the design rows that hold both: what a landscape built on
    the replay would move."""
    lines = []
    for model in MODELS:
        for phase in STEP_PHASES:
            ratios = sorted(
                (int(row[f"traced_{phase}_bytes"]) + FIXED_TERM_BYTES[model][phase])
                / int(row[f"reserved_{phase}_bytes"]) - 1
                for (m, _, kind, _), row in traces.items()
                if m == model and kind == "design" and row["status"] == "ok"
                and row.get(f"reserved_{phase}_bytes"))
            if ratios:
                lines.append(
                    f"{model} {phase}: traced + fixed term vs the replay on {len(ratios)} "
                    f"design traces: median {ratios[len(ratios) // 2]:+.1%}, "
                    f"{ratios[0]:+.1%} .. {ratios[-1]:+.1%}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("trace", "check", "build"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--configs", type=int, default=2, help="check: per model and GPU")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.what == "trace":
        run_traces("design", args.jobs)
    elif args.what == "check":
        return check(args.configs, args.seed, args.jobs)
    else:
        build()
    return 0


if __name__ == "__main__":
    sys.exit(main())
