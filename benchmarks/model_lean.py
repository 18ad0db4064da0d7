"""Where the memory model alone leans on the held-out H200 grids (issue 67 item 2): per phase,
the model's tensors against the trace's and its allocator term against what torch reserved
beyond those tensors, each as a share of NVML's peak.

    python benchmarks/model_lean.py [--out benchmarks/results]

Reads each held-out grid (results/gpu/holdout*/: the predictions' configs and the probes'
torch and NVML figures) and allocator_fidelity.json (today's trace of each row: its live
tensors and its replayed allocated peak), and runs today's memory model (memory/model.py)
on each held-out row. Torch's allocated peak is not the tensors: the caching allocator
rounds each request and hands out a cached block whole where its rest would be 1 MiB or less
(CUDACachingAllocator's `should_split`), and cuBLAS's workspaces are allocations too; the
trace's replay has both, so the split is drawn at the trace's tensors, and the replay's
allocated peak is held to torch's (`allocated` line). Rows not held out (README's) are left
out. Seconds on a CPU. Writes model_lean.{txt,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpu_holdout  # noqa: E402

from autotune.config import ProbeConfig  # noqa: E402
from autotune.memory.model import estimate_memory  # noqa: E402
from autotune.memory.shape import model_shape  # noqa: E402

FIDELITY = HERE / "results" / "allocator_fidelity.json"


def traced(fidelity: Path) -> dict[tuple[int, str, str], dict]:
    """Today's trace of each held-out phase (allocator_fidelity.json), by (seed, case, phase)."""
    report = json.loads(fidelity.read_text())
    return {(grid["seed"], r["case"], r["phase"]): r
            for grid in report["held_out"] for r in grid["rows"] if r["status"] == "ok"}


def phases(fidelity: Path = FIDELITY) -> list[dict]:
    """One entry per held-out phase probed ok and traced: the model's and the card's split."""
    out = []
    trace = traced(fidelity)
    for grid in gpu_holdout.committed_grids():
        predictions, probed = gpu_holdout.probed_rows(grid)
        for row, probe in probed:
            if not row.get("held_out") or probe.get("status") != "ok":
                continue
            estimate = estimate_memory(model_shape(row["model"]), ProbeConfig(**row["knobs"]),
                                       num_gpus=row["world"], on_gpu=True,
                                       engine_capacity_bytes=gpu_holdout.H200_CAPACITY_BYTES,
                                       outside_bytes=0)
            outside = gpu_holdout.outside_bytes(row)
            for phase, figures in probe["phases"].items():
                allocated = probe["phase_tensor_peak_bytes"].get(phase)
                reserved = probe["phase_allocator_peak_bytes"].get(phase)
                now = trace.get((predictions["seed"], row["label"], phase), {})
                tensors_traced = now.get("traced_tensor_bytes")
                replayed = now.get("replayed_allocated_bytes")
                if phase not in estimate.phases or allocated is None or reserved is None \
                        or tensors_traced is None or replayed is None:
                    continue
                part = estimate.phases[phase]
                reserve = part.parts.get("allocator_reserve", 0)
                out.append({"grid": grid.name, "case": row["label"], "phase": phase,
                            "nvml_bytes": figures["nvml_bytes"],
                            "tensors_error_bytes": part.total_bytes - reserve - tensors_traced,
                            "allocator_error_bytes": reserve - (reserved - tensors_traced),
                            "replay_allocated_error_bytes": replayed - allocated,
                            "total_error_bytes": part.total_bytes + outside
                            - figures["nvml_bytes"]})
    return out


def describe(rows: list[dict]) -> list[str]:
    lines = [f"held-out phases: {len(rows)}"]
    for key, name in (("replay_allocated_error_bytes",
                       "the trace's replayed allocated peak vs torch's"),
                      ("tensors_error_bytes", "the model's tensors vs the trace's"),
                      ("allocator_error_bytes",
                       "the model's allocator term vs torch's reserved less the trace's tensors"),
                      ("total_error_bytes", "the model alone vs NVML")):
        share = [r[key] / r["nvml_bytes"] for r in rows]
        quartiles = statistics.quantiles(share, n=4)
        lines.append(f"{name}: median {statistics.median(share):+.2%} of NVML "
                     f"({statistics.median(r[key] for r in rows) / 2**20:+.0f} MiB), "
                     f"quartiles {quartiles[0]:+.2%}, {quartiles[2]:+.2%}; "
                     f"{sum(s > 0 for s in share)} over, {sum(s < 0 for s in share)} under; "
                     f"largest {max(abs(r[key]) for r in rows) / 2**20:.0f} MiB")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--fidelity", type=Path, default=FIDELITY,
                        help="the allocator_fidelity.json whose traces to read")
    args = parser.parse_args()
    rows = phases(args.fidelity)
    lines = ["model_lean: the memory model alone on the held-out H200 grids, split "
             "(python benchmarks/model_lean.py)", *describe(rows)]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model_lean.txt").write_text("\n".join(lines) + "\n")
    (args.out / "model_lean.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
