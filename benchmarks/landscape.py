"""A recorded landscape: the real probe result of every configuration of a small space.

Recording runs the full grid of a search space once with real probes (resumable: rows already
in the table are kept) and writes one CSV row per configuration. Replaying serves those rows
as a Runner, so search strategies can be compared over many seeds in seconds on the same
measured ground truth.

    python benchmarks/landscape.py --space cpu-demo --out benchmarks/data/cpu_demo_grid.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from autotune.config import PHASES, parse_bytes
from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest, ProbeResult, ProbeStatus
from autotune.sweep.space.search_space import SearchSpace, load_search_space
from autotune.sweep.tuner import params_key

GRPO_PHASES = ("rollout", "experience", "update")  # a step's phases without a critic


def step_phases(space: SearchSpace) -> tuple[str, ...]:
    """The phases of the grid's step: PPO's critic_update too where it trains a critic."""
    return tuple(p for p in PHASES if p != "validation") if space.trains_critic \
        else GRPO_PHASES


def figures(space: SearchSpace) -> list[str]:
    """A recorded grid's columns after its params (a GRPO grid's as they always were)."""
    return ["status", "failed_phase", "tokens_per_s", "samples_per_s", "step_s",
            "peak_mem_bytes", *(f"peak_mem_{p}_bytes" for p in step_phases(space)),
            "host_peak_rss_bytes", "device_limit_bytes", "device_capacity_bytes",
            "probe_wall_s"]


def result_row(params: dict, result: ProbeResult, columns: list[str]) -> dict:
    row = {**params, "status": result.status.value, "failed_phase": result.failed_phase or ""}
    for name in columns[2:]:
        if name.startswith("peak_mem_") and name != "peak_mem_bytes":
            phase = name[len("peak_mem_"):-len("_bytes")]
            row[name] = result.phase_peak_mem_bytes.get(phase, "")
        else:
            value = getattr(result, name)
            row[name] = "" if value is None else value
    return row


def row_result(row: dict) -> ProbeResult:
    """The ProbeResult a recorded row stands for."""
    def num(name: str, kind: type = float):
        return kind(float(row[name])) if row.get(name, "") != "" else None

    phases = {p: num(f"peak_mem_{p}_bytes", int) for p in PHASES if p != "validation"}
    return ProbeResult(
        status=ProbeStatus(row["status"]), failed_phase=row["failed_phase"] or None,
        message="" if row["status"] == "ok" else f"recorded {row['status']}",
        tokens_per_s=num("tokens_per_s"), samples_per_s=num("samples_per_s"),
        step_s=num("step_s"), peak_mem_bytes=num("peak_mem_bytes", int),
        phase_peak_mem_bytes={p: v for p, v in phases.items() if v is not None},
        host_peak_rss_bytes=num("host_peak_rss_bytes", int),
        device_limit_bytes=num("device_limit_bytes", int),
        device_capacity_bytes=num("device_capacity_bytes", int),
        probe_wall_s=num("probe_wall_s"), device_name="recorded")


def load_landscape(path: Path, space: SearchSpace) -> dict[str, ProbeResult]:
    """Recorded results keyed by params_key, typed through the space's own parsing."""
    with open(path, newline="") as handle:
        return {params_key(typed_params(space, row)): row_result(row)
                for row in csv.DictReader(handle)}


def typed_params(space: SearchSpace, row: dict) -> dict:
    """A CSV row's params as the space types them."""
    return {name: spec.values()[[str(v) for v in spec.values()].index(row[name])]
            for name, spec in space.params.items()}


class ReplayRunner:
    """A Runner that answers from a recorded landscape instead of running a probe."""

    def __init__(self, space: SearchSpace, table: dict[str, ProbeResult]) -> None:
        self.space, self.table = space, table
        self.calls: list[dict] = []

    def run(self, request: ProbeRequest, log_path: Path | None = None) -> ProbeResult:
        params = {name: getattr(request.config, name) for name in self.space.params}
        self.calls.append(params)
        return self.table[params_key(params)]

    def stop(self) -> None:
        """Replayed probes end at once: nothing to kill."""

    def close(self) -> None:
        """Nothing to release."""


def record(space: SearchSpace, out: Path, request: ProbeRequest, parallel: int) -> None:
    from autotune.runners.local import SubprocessRunner

    done = set()
    if out.exists():
        with open(out, newline="") as handle:
            done = {params_key({n: row[n] for n in space.params})
                    for row in csv.DictReader(handle)}
    todo = [p for p in space.grid()
            if params_key({k: str(v) for k, v in p.items()}) not in done]
    print(f"{len(done)} recorded, {len(todo)} to go, {parallel} at a time", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()
    runner = SubprocessRunner()
    started = time.monotonic()
    columns = [*space.params, *figures(space)]

    def one(params: dict) -> None:
        result = runner.run(ProbeRequest(**{**request.__dict__,
                                            "config": space.config_for(params)}))
        with lock:
            new = not out.exists()
            with open(out, "a", newline="") as handle:
                writer = csv.DictWriter(handle, columns)
                if new:
                    writer.writeheader()
                writer.writerow(result_row(params, result, figures(space)))
            print(f"[{time.monotonic() - started:6.0f} s] {params} -> {result.status.value} "
                  f"{result.tokens_per_s or 0:.1f} tok/s {result.peak_mem_bytes or 0} B",
                  flush=True)

    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(one, todo))


def trace_grid(space: SearchSpace, out: Path, request: ProbeRequest,
               capacity_bytes: int | None = None) -> dict[str, dict[str, int]]:
    """Every config of the grid traced (probe/trace.py: the tensors' bytes per phase, without
    the fixed term), in this process; resumable like `record`. Returns params_key -> bytes."""
    from autotune.probe.trace import trace_request

    table: dict[str, dict[str, int]] = {}
    if out.exists():
        with open(out, newline="") as handle:
            for row in csv.DictReader(handle):
                table[params_key(typed_params(space, row))] = {
                    p: int(row[f"traced_{p}_bytes"]) for p in step_phases(space)}
    columns = [*space.params, *(f"traced_{p}_bytes" for p in step_phases(space)), "trace_s"]
    todo = [p for p in space.grid() if params_key(p) not in table]
    for number, params in enumerate(todo):
        device = request.device if capacity_bytes is None \
            else request.device.with_capacity(capacity_bytes)
        result = trace_request(ProbeRequest(**{**request.__dict__, "device": device,
                                                "config": space.config_for(params)}),
                               context_bytes=0)
        row = {**params, "trace_s": round(result.trace_s, 2),
               **{f"traced_{p}_bytes": result.phase_peak_mem_bytes[p]
                  for p in step_phases(space)}}
        new = not out.exists()
        with open(out, "a", newline="") as handle:
            writer = csv.DictWriter(handle, columns)
            if new:
                writer.writeheader()
            writer.writerow(row)
        table[params_key(params)] = {p: result.phase_peak_mem_bytes[p]
                                     for p in step_phases(space)}
        print(f"traced {number + 1}/{len(todo)} in {result.trace_s:.1f} s", file=sys.stderr,
              flush=True)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--space", default="cpu-demo")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/data/cpu_demo_grid.csv"))
    parser.add_argument("--model", default="tiny-qwen2.5")
    parser.add_argument("--gpu-memory-limit", default="545MiB", help="or 'none': no cap")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per probe")
    args = parser.parse_args()
    cap = None if args.gpu_memory_limit == "none" else parse_bytes(args.gpu_memory_limit)
    request = ProbeRequest(model=args.model, device=Device("cpu", limit_bytes=cap),
                           cpu_threads=args.threads, warmup_steps=1, timed_steps=1,
                           timeout_s=300)
    record(load_search_space(args.space), args.out, request, args.parallel)


if __name__ == "__main__":
    sys.exit(main())
