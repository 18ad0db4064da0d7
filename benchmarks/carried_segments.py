"""How much of each committed phase's reserve the segments carried from earlier phases make.

The memory model's allocator term (memory/sketch) laid each phase out on its own until
2026-12-04: the tensors the phase finds, packed in the order they were made, then the
phase's own allocations and frees. A GPU runs the step as a whole: a phase finds the
segments the earlier phases cut, with the tensors that outlived them inside (AdamW's states,
made at the first optimizer step among the freed segments of the transients, and cuBLAS's
workspace; docs/memory-and-trace.md). The sketch now lays the run's first update out before
the later phases (step_reserve.first_update). This splits the trace's replay of each
committed case (benchmarks/allocator_fidelity.py's rows) the same two ways:

- with its history: the stream replayed whole (memory/replay.py), as allocator_fidelity
  predicts the card;
- phase-local: for each phase, a fresh allocator (the phase's allocator settings) holding
  only the tensors live at the phase's start, allocated in the order they were made, then
  the phase's own events; the sketch's assumption.

carried = the reserved peak with history less the phase-local one (both the most over the
step's occurrences of the phase). Each row then reads the memory model alone (as
allocator_fidelity computes it) against NVML, and its sketched reserve beyond the tensors
against the whole replay's and the phase-local one's: which of the two the sketch follows
(issue 67's item 2).

    python benchmarks/carried_segments.py [--out DIR] [--cases a,b] [--reuse JSON]

Writes carried_segments.{txt,json} to benchmarks/results/ (or --out); the JSON also holds
each row's traced tensors and the model's sketched allocator term. Traces each committed
case once (4 minutes on 2 cores, 2026-12-04); --reuse takes the traced figures of an earlier
run's JSON and recomputes the model's (seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import allocator_fidelity  # noqa: E402  (the committed rows, their traces and model figures)

from autotune.memory.model import estimate_memory  # noqa: E402
from autotune.memory.replay import (  # noqa: E402
    ALLOC,
    FREE,
    PHASE,
    RECORD,
    AllocatorSettings,
    replay,
)
from autotune.memory.shape import model_shape  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 1 << 30


def phase_local_reserved(events: Sequence[tuple], settings: AllocatorSettings
                         ) -> dict[str, int]:
    """Each phase's reserved peak replayed on its own: replay() of a stream that makes the
    tensors live at the phase's start again (in the order they were made, recorded on the
    streams they were) and then runs the phase's events, in a fresh allocator. The most
    over the phase's occurrences."""
    live: dict[int, tuple[int, int]] = {}  # allocation id -> (bytes, stream), in order made
    recorded: dict[int, list[int]] = {}  # a live id -> the streams record_stream named
    peaks: dict[str, int] = {}
    own: list[tuple] | None = None  # the phase's stream while one runs
    for event in events:
        kind = event[0]
        if kind == PHASE and event[1] is not None:
            own = [event] + [(ALLOC, alloc_id, size, stream)
                             for alloc_id, (size, stream) in live.items()]
            own += [(RECORD, alloc_id, other) for alloc_id, streams in recorded.items()
                    for other in streams]
            continue
        if own is not None:
            own.append(event)
            if kind == PHASE:  # its end
                name = own[0][1]
                reserved = replay(own, settings).phase_reserved_bytes[name]
                peaks[name] = max(peaks.get(name, 0), reserved)
                own = None
        if kind == ALLOC:
            live[event[1]] = (event[2], event[3])
            recorded.pop(event[1], None)
        elif kind == FREE:
            live.pop(event[1], None)
            recorded.pop(event[1], None)
        elif kind == RECORD:
            recorded.setdefault(event[1], []).append(event[2])
    return peaks


def sketch_bytes(row: dict) -> dict[str, int]:
    """The memory model's sketched allocator term per phase for the row's run (its
    `allocator_reserve` part), as allocator_fidelity.model_bytes sets the run up."""
    request = allocator_fidelity.gpu_evidence.case_request(
        allocator_fidelity.case_of(row["label"]))
    config = request.config
    if allocator_fidelity.FILES[row["file"]] is not None:
        config = dataclasses.replace(config, expandable_segments=True)
    estimate = estimate_memory(model_shape(request.model), config,
                               num_gpus=request.world_size, on_gpu=True,
                               engine_capacity_bytes=allocator_fidelity.H200_CAPACITY_BYTES)
    return {phase: e.parts.get("allocator_reserve", 0) for phase, e in estimate.phases.items()}


def measure(labels: list[str] | None) -> list[dict]:
    """Every committed row: NVML, the model alone (and its sketched allocator term), the
    traced tensors, the replay with history and phase-local."""
    every = allocator_fidelity.committed_rows()
    rows = [r for r in every if labels is None or r["label"] in labels]
    out = []
    for label in dict.fromkeys(r["label"] for r in rows):
        started = time.monotonic()
        events, tensors, _ = allocator_fidelity.trace_case(label, False)
        print(f"traced {label} in {time.monotonic() - started:.0f} s", flush=True)
        for row in [r for r in rows if r["label"] == label]:
            settings = allocator_fidelity.settings_of(row)
            whole = replay(events, settings).phase_reserved_bytes
            local = phase_local_reserved(events, settings)
            modelled = allocator_fidelity.model_bytes(
                row, allocator_fidelity.outside_of(row, every))
            sketched = sketch_bytes(row)
            for phase, nvml in row["phase_peak_mem_bytes"].items():
                out.append({"case": label, "file": row["file"], "phase": phase,
                            "nvml_bytes": nvml, "model_bytes": modelled[phase],
                            "sketch_bytes": sketched[phase],
                            "traced_tensor_bytes": tensors[phase],
                            "replayed_reserved_bytes": whole[phase],
                            "phase_local_reserved_bytes": local[phase],
                            "carried_bytes": whole[phase] - local[phase]})
    return out


def remodel(rows: list[dict]) -> list[dict]:
    """An earlier run's rows with the model's figures (its total, its sketched term)
    recomputed by today's model; the traced and replayed ones as they were."""
    every = allocator_fidelity.committed_rows()
    by_case = {(r["label"], r["file"]): r for r in every}
    out = []
    for row in rows:
        committed = by_case[row["case"], row["file"]]
        modelled = allocator_fidelity.model_bytes(
            committed, allocator_fidelity.outside_of(committed, every))
        out.append({**row, "model_bytes": modelled[row["phase"]],
                    "sketch_bytes": sketch_bytes(committed)[row["phase"]]})
    return out


def signed(value: float) -> str:
    return f"{100 * value:+.1f}%"


def summary(rows: list[dict], key: str, label: str) -> str:
    errors = [(r[key] - r["nvml_bytes"]) / r["nvml_bytes"] for r in rows]
    over = sum(e > 0 for e in errors)
    return (f"{label}: median {signed(statistics.median(errors))}, "
            f"{signed(min(errors))} to {signed(max(errors))}, {over} over / "
            f"{len(errors) - over} under, {sum(abs(e) <= 0.05 for e in errors)} of "
            f"{len(errors)} within 5%")


def describe(rows: list[dict]) -> list[str]:
    lines = ["reserve beyond the traced tensors, GiB: the model's sketch, the phase-local replay's "
             "and the whole replay's", "",
             f"{'case':24s} {'file':36s} {'phase':14s} {'NVML':>9s} {'model':>7s} "
             f"{'sketch':>7s} {'local':>7s} {'whole':>7s} {'carried':>9s} {'sketch-whole':>12s}"]
    for r in rows:
        nvml, tensors = r["nvml_bytes"], r["traced_tensor_bytes"]
        whole = r["replayed_reserved_bytes"] - tensors
        lines.append(f"{r['case'][:24]:24s} {r['file'][:36]:36s} {r['phase']:14s} "
                     f"{nvml / GIB:7.2f} G {signed((r['model_bytes'] - nvml) / nvml):>7s} "
                     f"{r['sketch_bytes'] / GIB:7.2f} "
                     f"{(r['phase_local_reserved_bytes'] - tensors) / GIB:7.2f} "
                     f"{whole / GIB:7.2f} "
                     f"{r['carried_bytes'] / GIB:+7.2f} G "
                     f"{(r['sketch_bytes'] - whole) / GIB:+10.2f} G")
    carried = [r["carried_bytes"] / GIB for r in rows]
    lines += ["",
              f"carried (replay with history less phase-local): median "
              f"{statistics.median(carried):+.2f} GiB, {min(carried):+.2f} to "
              f"{max(carried):+.2f} GiB",
              gap(rows, "replayed_reserved_bytes", "whole replay's"),
              gap(rows, "phase_local_reserved_bytes", "phase-local replay's"),
              summary(rows, "model_bytes", "memory model alone against NVML")]
    return lines


def gap(rows: list[dict], key: str, label: str) -> str:
    """The sketched reserve beyond the tensors less a replay's, in GiB: median, range, and
    within 0.25 GiB."""
    gaps = [(r["sketch_bytes"] - (r[key] - r["traced_tensor_bytes"])) / GIB for r in rows]
    return (f"the sketch less the {label} reserve: median {statistics.median(gaps):+.2f} "
            f"GiB, {min(gaps):+.2f} to {max(gaps):+.2f}, "
            f"{sum(abs(g) <= 0.25 for g in gaps)} of {len(gaps)} within 0.25 GiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--cases", default="", help="comma-separated case labels")
    parser.add_argument("--reuse", type=Path, default=None,
                        help="an earlier run's JSON: its traced figures, the model's anew")
    args = parser.parse_args()
    started = time.monotonic()
    if args.reuse is not None:
        rows = remodel(json.loads(args.reuse.read_text())["rows"])
    else:
        rows = measure([c for c in args.cases.split(",") if c] or None)
    lines = [f"carried_segments on {platform.machine()} cpu, {time.strftime('%Y-%m-%d')}, "
             f"{(time.monotonic() - started) / 60:.1f} min",
             "benchmark: python benchmarks/carried_segments.py"
             + (f" --reuse {args.reuse.name}: its traced figures, the model's anew"
                if args.reuse else ""), ""] + describe(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "carried_segments.txt").write_text("\n".join(lines) + "\n")
    (args.out / "carried_segments.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
