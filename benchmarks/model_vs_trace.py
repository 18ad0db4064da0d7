"""The memory model against the trace, on GPU-scale configs drawn at random, on this CPU.

The trace (probe/trace.py: the probe's step under fake tensors, its allocations replayed
through the caching allocator) is within 5% of an H200's NVML peak on every committed row
(allocator_fidelity.py); the memory model alone (memory/model.py: arithmetic plus
step_reserve.py's sketch of the allocator) is what `estimate` answers without a trace and what
the sweep's pre-screen starts from. The GPU rows are few (43 committed, 39 held out) and a
GPU is rarely lent, so this holds the model to the trace on many more configs: N rows drawn
from gpu_holdout.py's declared distribution (registry models 0.5B to 7B and a VL model, W
1 to 8 emulated, lengths, responses per prompt, every memory knob; seeded, the seed
printed), each traced here, and per phase:

- total: the model's peak against the trace's (both with the same outside-torch prior);
- tensors: the model's less its allocator term, against the traced tensors' peak;
- reserve: the model's allocator term (step_reserve.py) against the replay's reserved peak less
  the traced tensors (what the allocator held beyond them).

So a miss says which of the two terms it is in. The traced tensors are within about 1% of
torch's allocated peak on the H200 rows, the replay within about 1% of its reserve.

    python benchmarks/model_vs_trace.py [--n 24] [--seed 11] [--workers 2] [--reuse FILE]

`--reuse` takes the traces of a previous run's JSON for rows of the same config (to try a
change to the model in seconds; a committed run traces afresh). Writes
benchmarks/results/model_vs_trace.{json,txt}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import date
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import gpu_holdout  # noqa: E402

from autotune.config import ProbeConfig  # noqa: E402
from autotune.memory.model import estimate_memory  # noqa: E402
from autotune.memory.shape import model_shape  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 2**30


def model_parts(row: dict) -> dict[str, dict[str, int]]:
    """Per phase the model's total (with the outside-torch prior), its allocator term and
    its tensors (the total less that term and the fixed per-process one)."""
    config = ProbeConfig(**row["knobs"])
    estimate = estimate_memory(model_shape(row["model"]), config, num_gpus=row["world"],
                               on_gpu=True,
                               engine_capacity_bytes=gpu_holdout.H200_CAPACITY_BYTES,
                               outside_bytes=gpu_holdout.outside_bytes(row))
    out = {}
    for phase, e in estimate.phases.items():
        reserve = e.parts.get("allocator_reserve", 0)
        out[phase] = {"total": e.total_bytes, "reserve": reserve,
                      "tensors": e.total_bytes - e.context_bytes - reserve}
    return out


def compare(row: dict, traced: dict) -> list[dict]:
    """One row's phases: the model's three figures against the trace's."""
    if "error" in traced:
        return [{"case": row["label"], "error": traced["error"]}]
    model = model_parts(row)
    outside = gpu_holdout.outside_bytes(row)
    out = []
    for phase, total in traced["phase_peak_mem_bytes"].items():
        if phase not in model:
            continue
        tensors = traced["phase_tensor_bytes"][phase]
        replayed = traced["phase_reserved_bytes"].get(phase, tensors)
        out.append({"case": row["label"], "phase": phase,
                    "traced_bytes": total, "model_bytes": model[phase]["total"],
                    "traced_tensor_bytes": tensors,
                    "model_tensor_bytes": model[phase]["tensors"],
                    "replayed_reserve_bytes": max(0, replayed - tensors),
                    "model_reserve_bytes": model[phase]["reserve"],
                    "outside_bytes": outside})
    return out


def error(of: int, against: int) -> float:
    return (of - against) / against if against else 0.0


def measure(n: int, seed: int, workers: int, reuse: Path | None) -> dict:
    rows = gpu_holdout.draw_rows(n, seed)
    kept: dict[str, dict] = {}
    if reuse is not None:
        previous = json.loads(reuse.read_text())
        kept = {json.dumps([r["model"], r["world"], r["knobs"]], sort_keys=True): r["traced"]
                for r in previous["rows"]}
    key = {row["label"]: json.dumps([row["model"], row["world"], row["knobs"]],
                                    sort_keys=True) for row in rows}
    todo = [row for row in rows if key[row["label"]] not in kept]
    print(f"drew {n} rows with seed {seed}; tracing {len(todo)} ({workers} at a time)",
          flush=True)
    started = time.monotonic()
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        for row, traced in zip(todo, pool.map(gpu_holdout.trace_row, todo), strict=True):
            kept[key[row["label"]]] = traced
            print(f"  traced {row['label']} in {traced.get('trace_s', '-')} s", flush=True)
    out_rows = [{**{k: row[k] for k in ("label", "model", "world", "knobs")},
                 "traced": kept[key[row["label"]]]} for row in rows]
    phases = [entry for row in out_rows for entry in compare(row, row["traced"])]
    return {"seed": seed, "n": n, "date": date.today().isoformat(),
            "trace_s": round(time.monotonic() - started), "reused": len(rows) - len(todo),
            "rows": out_rows,
            "phases": phases}


def describe(report: dict) -> list[str]:
    lines = [f"memory model vs trace on {report['n']} configs drawn from gpu_holdout.py's "
             f"distribution (seed {report['seed']}), {report['date']}; H200 capacity, "
             f"predicted on this CPU",
             "benchmark: python benchmarks/model_vs_trace.py"
             + (f" --reuse: {report['reused']} of {report['n']} configs' traces from the "
                "previous run, the model recomputed" if report.get("reused") else ""),
             "",
             f"{'case':24}{'phase':15}{'traced':>10}{'model':>10}{'err':>8}"
             f"{'tensors':>10}{'err':>8}{'reserve':>9}{'model':>9}"]
    ok = [p for p in report["phases"] if "error" not in p]
    for p in report["phases"]:
        if "error" in p:
            lines.append(f"{p['case']:24}trace failed: {p['error']}")
            continue
        lines.append(
            f"{p['case']:24}{p['phase']:15}{p['traced_bytes'] / GIB:9.2f}G"
            f"{p['model_bytes'] / GIB:9.2f}G{error(p['model_bytes'], p['traced_bytes']):+8.1%}"
            f"{p['traced_tensor_bytes'] / GIB:9.2f}G"
            f"{error(p['model_tensor_bytes'], p['traced_tensor_bytes']):+8.1%}"
            f"{p['replayed_reserve_bytes'] / GIB:8.2f}G{p['model_reserve_bytes'] / GIB:8.2f}G")
    if not ok:
        return lines
    total = [error(p["model_bytes"], p["traced_bytes"]) for p in ok]
    tensors = [error(p["model_tensor_bytes"], p["traced_tensor_bytes"]) for p in ok]
    reserve_gap = [(p["model_reserve_bytes"] - p["replayed_reserve_bytes"]) / p["traced_bytes"]
                   for p in ok]
    lines += ["",
              "columns: traced = trace + allocator replay + outside torch; model = memory model "
              "alone, same outside term; tensors = traced tensors' peak against the model's less "
              "its allocator term; reserve = replayed reserve beyond the tensors, and the "
              "model's (step_reserve.py's sketch)",
              f"{len(ok)} phases of {len({p['case'] for p in ok})} configs "
              f"({sum('error' in p for p in report['phases'])} traces failed)",
              f"model total vs trace: {min(total):+.1%} to {max(total):+.1%}, median |error| "
              f"{statistics.median(abs(e) for e in total):.1%}, within 5%: "
              f"{sum(abs(e) <= 0.05 for e in total)}, within 10%: "
              f"{sum(abs(e) <= 0.10 for e in total)}; over {sum(e > 0 for e in total)}, "
              f"under {sum(e < 0 for e in total)}",
              f"tensors: {min(tensors):+.1%} to {max(tensors):+.1%}, median |error| "
              f"{statistics.median(abs(e) for e in tensors):.1%}; within 5%: "
              f"{sum(abs(e) <= 0.05 for e in tensors)}",
              f"allocator term less the replayed reserve, over the traced total: "
              f"{min(reserve_gap):+.1%} to {max(reserve_gap):+.1%}, median "
              f"{statistics.median(reserve_gap):+.1%}"]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=24)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reuse", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    report = measure(args.n, args.seed, args.workers, args.reuse)
    text = "\n".join(describe(report))
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model_vs_trace.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "model_vs_trace.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
