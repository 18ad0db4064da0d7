"""The card's peak, predicted on a CPU, against what an H200 measured: every committed phase row.

For each case of the committed GPU runs (benchmarks/results/gpu/*.json: the probes of
benchmarks/gpu_evidence.py on an H200, torch 2.11), the case's probe is traced here with fake
tensors (probe/trace.py, as the sweep's pre-screen traces it), its allocations replayed
through the caching allocator's rules (memory/allocator.py) under the settings that run had,
and the prediction is that reserved peak plus what lives outside torch (the CUDA context,
memory/outside_torch.py), taken as the median NVML-less-reserved of the OTHER cases of the
row's topology (one GPU, or a sharded run's rank: the context's two priors): no row's own
measurement enters its prediction. Each row compares:

- predicted_bytes: trace + allocator replay + outside torch, against NVML's peak;
- model_bytes: the memory model alone (memory/model.py, no trace, no GPU: its allocator
  reserve sketched by memory/sketch/step_reserve.py), with the same outside-torch term;
- the replayed reserved peak against torch's measured reserved peak, and the traced tensors
  against torch's allocated peak (where the error is, when there is one).

    python benchmarks/allocator_fidelity.py [--out DIR] [--every-iteration] [--cases a,b]
                                            [--reuse results/allocator_fidelity.json]

`--reuse` takes every trace and replay from an earlier report and recomputes the rest
(seconds, not minutes): on the committed rows the outside-torch term, the prediction and
the memory model; on the held-out rows the model, their traced figures kept whole (with the
prior they were made with; a grid the earlier report lacks is traced). For a change to the
model or the context that leaves the probe, the trace and the allocator replay as they were;
the report says whose traces it holds.

Then the held-out rows apart, grid by grid (issue 67: results/gpu/holdout.json and each
results/gpu/holdout_seed*/, configs drawn at random by benchmarks/gpu_holdout.py and
predicted before they were probed): NVML's peak against the predictions written then and
against today's code (trace and model) on the same rows.

Targets (issue 48): predicted within 5% of NVML on every row; the memory model within 10%.
Writes allocator_fidelity.{txt,json} to benchmarks/results/ (or --out). About 6 minutes on
2 cores (the 7B ranks trace in 15 to 30 s each, the VL-7B's in 107 s), and 5 more a held-out
grid (21 minutes in all on 2026-12-04).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_evidence  # noqa: E402  (the cases the committed rows are of)
import gpu_holdout  # noqa: E402  (the held-out grids)

from autotune.config import format_bytes  # noqa: E402
from autotune.memory.replay import AllocatorSettings, replay  # noqa: E402
from autotune.memory.model import estimate_memory  # noqa: E402
from autotune.memory.shape import model_shape  # noqa: E402

GPU_RESULTS = Path(__file__).resolve().parent / "results" / "gpu"
H200_CAPACITY_BYTES = 150_109_880_320  # what the committed vLLM-like rows' engine read
# The committed files and the allocator each ran under: gpu_evidence.json and _allocated
# switch expandable segments per phase as the case's knob says (the step's toggle); the
# expandable_segments run predates that toggle and set PYTORCH_CUDA_ALLOC_CONF for the
# whole process, build and rollout included.
FILES = {
    "gpu_evidence.json": None,
    "gpu_evidence_allocated.json": None,
    "gpu_evidence_expandable_segments.json": AllocatorSettings(
        expandable_segments=True, off_in_rollout=False, at_start=True),
}


def committed_rows() -> list[dict]:
    """Every ok case of the committed files, with the file it came from."""
    rows = []
    for name in FILES:
        for row in json.loads((GPU_RESULTS / name).read_text()):
            if row["status"] == "ok" and row.get("phase_allocator_peak_bytes"):
                rows.append({**row, "file": name})
    return rows


def case_of(label: str) -> tuple:
    return next(case for case in gpu_evidence.CASES if case[0] == label)


def trace_case(label: str, every_iteration: bool) -> tuple[list[tuple], dict, float]:
    """The case's probe traced here: its allocation stream, its tensors per phase, seconds."""
    import torch

    from autotune.probe.trace import trace_request
    from autotune.probe.worker import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(1)
    request = gpu_evidence.case_request(case_of(label))
    request = dataclasses.replace(request,
                                  device=request.device.with_capacity(H200_CAPACITY_BYTES))
    events: list[tuple] = []
    result = trace_request(request, 0, every_iteration=every_iteration, events=events)
    return events, result.phase_tensor_bytes, result.trace_s


def settings_of(row: dict) -> AllocatorSettings:
    fixed = FILES[row["file"]]
    if fixed is not None:
        return fixed
    knobs = case_of(row["label"])[4]
    return AllocatorSettings(expandable_segments=bool(knobs.get("expandable_segments")))


def outside_of(row: dict, rows: list[dict]) -> int:
    """What the other cases' processes of the same topology held outside torch (NVML less
    reserved), median: one GPU's, or a sharded run's rank's (outside_torch.py's two priors)."""
    def sharded(r: dict) -> bool:
        return gpu_evidence.case_request(case_of(r["label"])).world_size > 1

    seen = [r["phase_peak_mem_bytes"][p] - r["phase_allocator_peak_bytes"][p]
            for r in rows if r["label"] != row["label"] and sharded(r) == sharded(row)
            for p in r["phase_peak_mem_bytes"] if p in r["phase_allocator_peak_bytes"]]
    return int(statistics.median(seen))


def model_bytes(row: dict, outside_bytes: int) -> dict[str, int]:
    """The memory model's prior for the row's run (its allocator reserve sketched under the
    run's settings), with the same outside-torch term as the prediction."""
    request = gpu_evidence.case_request(case_of(row["label"]))
    config = request.config
    if FILES[row["file"]] is not None:
        config = dataclasses.replace(config, expandable_segments=True)
    estimate = estimate_memory(model_shape(request.model), config,
                               num_gpus=request.world_size, on_gpu=True,
                               engine_capacity_bytes=H200_CAPACITY_BYTES,
                               outside_bytes=outside_bytes)
    return {phase: e.total_bytes for phase, e in estimate.phases.items()}


def measure(labels: list[str] | None, every_iteration: bool,
            reuse: dict | None = None) -> dict:
    rows = [r for r in committed_rows() if labels is None or r["label"] in labels]
    if reuse is not None:  # its replays kept; the outside-torch term and the model anew
        kept = []
        for row in rows:
            outside = outside_of(row, committed_rows())
            modelled = model_bytes(row, outside)
            kept += [{**old, "predicted_bytes": old["replayed_reserved_bytes"] + outside,
                      "outside_torch_bytes": outside, "model_bytes": modelled[old["phase"]]}
                     for old in reuse["rows"]
                     if (old["case"], old["file"]) == (row["label"], row["file"])]
        return {"rows": kept}
    traces: dict[str, tuple] = {}
    for label in dict.fromkeys(r["label"] for r in rows):
        started = time.monotonic()
        traces[label] = trace_case(label, every_iteration)
        print(f"traced {label} in {time.monotonic() - started:.0f} s "
              f"({len(traces[label][0]):,} allocations and frees)", flush=True)
    out = []
    for row in rows:
        events, tensors, trace_s = traces[row["label"]]
        replayed = replay(events, settings_of(row))
        outside = outside_of(row, committed_rows())
        modelled = model_bytes(row, outside)
        for phase, nvml in row["phase_peak_mem_bytes"].items():
            reserved = replayed.phase_reserved_bytes[phase]
            out.append({
                "case": row["label"], "file": row["file"], "phase": phase,
                "nvml_bytes": nvml, "predicted_bytes": reserved + outside,
                "model_bytes": modelled[phase],
                "reserved_bytes": row["phase_allocator_peak_bytes"][phase],
                "replayed_reserved_bytes": reserved,
                "allocated_bytes": row.get("phase_tensor_peak_bytes", {}).get(phase),
                "replayed_allocated_bytes": replayed.phase_allocated_bytes[phase],
                "traced_tensor_bytes": tensors[phase], "outside_torch_bytes": outside,
                "allocator": dataclasses.asdict(settings_of(row))})
    return {"rows": out}


def describe(report: dict) -> list[str]:
    lines = [f"{'case':<22}{'file':<12}{'phase':<14}{'NVML':>11}{'predicted':>11}{'err':>7}"
             f"{'model':>11}{'err':>7}   {'reserved':>9} {'replayed':>9}{'err':>7}"]
    for r in report["rows"]:
        nvml = r["nvml_bytes"]

        def err(value: int, of: int = nvml) -> str:
            return f"{(value - of) / of:+.1%}"

        lines.append(f"{r['case']:<22}{r['file'][12:-5] or 'main':<12}{r['phase']:<14}"
                     f"{format_bytes(nvml):>11}{format_bytes(r['predicted_bytes']):>11}"
                     f"{err(r['predicted_bytes']):>7}{format_bytes(r['model_bytes']):>11}"
                     f"{err(r['model_bytes']):>7}   {format_bytes(r['reserved_bytes']):>9} "
                     f"{format_bytes(r['replayed_reserved_bytes']):>9}"
                     f"{err(r['replayed_reserved_bytes'], r['reserved_bytes']):>7}")
    predicted = [(r["predicted_bytes"] - r["nvml_bytes"]) / r["nvml_bytes"]
                 for r in report["rows"]]
    modelled = [(r["model_bytes"] - r["nvml_bytes"]) / r["nvml_bytes"] for r in report["rows"]]
    within = sum(abs(e) <= 0.05 for e in predicted)
    lines += ["", f"{len(predicted)} rows. Predicted (trace + allocator + outside torch) "
              f"against NVML: {min(predicted):+.1%} to {max(predicted):+.1%}, "
              f"median |error| {statistics.median(abs(e) for e in predicted):.1%}, "
              f"{within} of {len(predicted)} within 5%.",
              f"Memory model alone: {min(modelled):+.1%} to {max(modelled):+.1%}, "
              f"{sum(abs(e) <= 0.10 for e in modelled)} of {len(modelled)} within 10%."]
    return lines


# a held-out row's trace today, per phase: the prediction (replayed reserve and the
# outside-torch prior), the live tensors, and the replayed allocated peak (torch's)
TRACED_HELD_OUT = {"phase_peak_mem_bytes": "traced_bytes",
                   "phase_tensor_bytes": "traced_tensor_bytes",
                   "phase_allocated_bytes": "replayed_allocated_bytes"}


def held_out(grid: Path, workers: int, reuse: dict | None = None) -> dict:
    """One grid's rows (benchmarks/gpu_holdout.py's holdout.json), apart from the rows
    above: per phase NVML's peak against the predictions written before the probe (the
    trace and the memory model, each with the outside-torch prior) and against today's code
    on the same rows (the traces of `reuse`, an earlier report's, where given). Rows not
    held out (README command 1's, issue 67's row) are marked."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    predictions, probed = gpu_holdout.probed_rows(grid)
    rows = [row for row, result in probed if result["status"] == "ok"]
    earlier = next((g for g in (reuse or {}).get("held_out", [])
                    if g["seed"] == predictions["seed"]), None)
    if earlier is not None and all(field in old for old in earlier["rows"]
                                   if old["status"] == "ok" for field in TRACED_HELD_OUT.values()):
        traced_now = {r["label"]: {
            key: {old["phase"]: old[field] for old in earlier["rows"]
                  if old["case"] == r["label"] and old["status"] == "ok"}
            for key, field in TRACED_HELD_OUT.items()} for r in rows}
    else:  # no earlier report, or a grid it lacks (or a figure of it): traced now
        with ProcessPoolExecutor(max_workers=workers,
                                 mp_context=get_context("spawn")) as pool:
            traced_now = dict(zip((r["label"] for r in rows),
                                  pool.map(gpu_holdout.trace_row, rows), strict=True))
    out = []
    for row, result in probed:
        if result["status"] != "ok":
            out.append({"case": row["label"], "status": result["status"],
                        "held_out": row.get("held_out", False)})
            continue
        now = {key: traced_now[row["label"]].get(key) or {} for key in TRACED_HELD_OUT}
        now_model = gpu_holdout.model_prediction(row)
        before_traced = row["predicted"]["traced"].get("phase_peak_mem_bytes") or {}
        for phase, figures in result["phases"].items():
            out.append({"case": row["label"], "status": "ok", "phase": phase,
                        "held_out": row.get("held_out", False),
                        "nvml_bytes": figures["nvml_bytes"],
                        "traced_before_bytes": before_traced.get(phase),
                        "model_before_bytes": row["predicted"]["model_bytes"].get(phase),
                        "model_bytes": now_model.get(phase),
                        **{field: now[key].get(phase)
                           for key, field in TRACED_HELD_OUT.items()}})
    return {"grid": str(grid.relative_to(GPU_RESULTS.parents[2])), "seed": predictions["seed"],
            "predicted": predictions["date"], "rows": out}


def describe_held_out(report: dict) -> list[str]:
    lines = [f"held-out rows ({report['grid']}/holdout.json: seed {report['seed']}, "
             f"predicted {report['predicted']} before the probes; * = not held out)",
             f"{'case':<26}{'phase':<14}{'NVML':>11}  {'before: traced':>15}{'model':>8}"
             f"  {'now: traced':>12}{'model':>8}"]

    def err(value: int | None, of: int) -> str:
        return "-" if value is None else f"{(value - of) / of:+.1%}"

    for r in report["rows"]:
        mark = "" if r["held_out"] else " *"
        if r["status"] != "ok":
            lines.append(f"{r['case'] + mark:<26}{r['status']}")
            continue
        nvml = r["nvml_bytes"]
        lines.append(f"{r['case'] + mark:<26}{r['phase']:<14}{format_bytes(nvml):>11}  "
                     f"{err(r['traced_before_bytes'], nvml):>15}"
                     f"{err(r['model_before_bytes'], nvml):>8}  "
                     f"{err(r['traced_bytes'], nvml):>12}{err(r['model_bytes'], nvml):>8}")
    held = [r for r in report["rows"] if r["held_out"] and r["status"] == "ok"]
    for when in ("before", "now"):
        suffix = "_before_bytes" if when == "before" else "_bytes"
        traced = [(r["traced" + suffix] - r["nvml_bytes"]) / r["nvml_bytes"]
                  for r in held if r["traced" + suffix] is not None]
        model = [(r["model" + suffix] - r["nvml_bytes"]) / r["nvml_bytes"]
                 for r in held if r["model" + suffix] is not None]
        if traced and model:
            lines.append(
                f"held out, {when}: traced {min(traced):+.1%} to {max(traced):+.1%}, "
                f"{sum(abs(e) <= 0.05 for e in traced)} of {len(traced)} phases within 5%; "
                f"model {min(model):+.1%} to {max(model):+.1%}, "
                f"{sum(abs(e) <= 0.10 for e in model)} of {len(model)} within 10% "
                f"({sum(e > 0 for e in model)} over, {sum(e < 0 for e in model)} under)")
    return lines


def traced_on(path: Path, report: dict) -> str:
    """When an earlier report's traces were made: as it says, or its text's header date."""
    if report.get("traces_from") or report.get("traced_on"):
        return report.get("traces_from") or report["traced_on"]
    text = path.with_suffix(".txt")
    header = text.read_text().splitlines()[0].split(", ") if text.exists() else []
    return header[1] if len(header) > 1 else "at an unknown date"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--every-iteration", action="store_true",
                        help="trace every iteration of every loop, as the probe ran them "
                             "(slower; the sweep's traces run the first and the last)")
    parser.add_argument("--cases", default="", help="comma-separated case labels")
    parser.add_argument("--workers", type=int, default=2, help="held-out traces at a time")
    parser.add_argument("--reuse", type=Path, default=None,
                        help="an earlier report whose traces and replays to keep: the "
                             "outside-torch term and the model are recomputed")
    args = parser.parse_args()
    started = time.monotonic()
    labels = args.cases.split(",") if args.cases else None
    reuse = json.loads(args.reuse.read_text()) if args.reuse else None
    report = measure(labels, args.every_iteration, reuse)
    if labels is None and not args.every_iteration:
        report["held_out"] = [held_out(grid, args.workers, reuse)
                              for grid in gpu_holdout.committed_grids()]
    if reuse is not None:
        report["traces_from"] = traced_on(args.reuse, reuse)
    else:
        report["traced_on"] = time.strftime("%Y-%m-%d")
    lines = [f"allocator_fidelity on {platform.processor() or 'cpu'}, "
             f"{time.strftime('%Y-%m-%d')}, {(time.monotonic() - started) / 60:.1f} min",
             "benchmark: python benchmarks/allocator_fidelity.py"
             + (" --every-iteration" if args.every_iteration else "")
             + (f" --reuse {args.reuse.name}: traces and replays from its run "
                f"(traced {report['traces_from']}), the memory model recomputed"
                if reuse is not None else ""),
             "rows: the committed H200 runs (benchmarks/results/gpu/), predicted here on the "
             "CPU", "", *describe(report),
             *(line for grid in report.get("held_out", [])
               for line in ("", *describe_held_out(grid)))]
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_every_iteration" if args.every_iteration else ""
    (out / f"allocator_fidelity{suffix}.txt").write_text("\n".join(lines) + "\n")
    (out / f"allocator_fidelity{suffix}.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
