"""Where the memory model alone leans on the held-out H200 grids (issue 67 item 2): per phase,
the model's tensors against torch's allocated peak and its allocator reserve against torch's
reserved less allocated, each as a share of NVML's peak.

    python benchmarks/model_lean.py [--out benchmarks/results]

Reads each held-out grid (results/gpu/holdout*/: the predictions' configs and the probes'
`phase_tensor_peak_bytes`, `phase_allocator_peak_bytes` and NVML figures) and runs today's
memory model (memory/model.py) on each held-out row. cuBLAS's workspaces (two of 32 MiB, in
torch's allocated peak on the GPU) are counted with the tensors on both sides: the model
puts them in `allocator_reserve`. Rows not held out (README's) are left out. Seconds on a
CPU. Writes model_lean.{txt,json}.
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
from autotune.memory.workspaces import CUBLAS_WORKSPACES_BYTES  # noqa: E402


def phases() -> list[dict]:
    """One entry per held-out phase probed ok: the model's and the card's split."""
    out = []
    for grid in gpu_holdout.committed_grids():
        for row, probe in gpu_holdout.probed_rows(grid)[1]:
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
                if phase not in estimate.phases or allocated is None or reserved is None:
                    continue
                part = estimate.phases[phase]
                reserve = part.parts.get("allocator_reserve", 0) - CUBLAS_WORKSPACES_BYTES
                tensors = part.total_bytes - reserve
                out.append({"grid": grid.name, "case": row["label"], "phase": phase,
                            "nvml_bytes": figures["nvml_bytes"],
                            "tensors_error_bytes": tensors - allocated,
                            "reserve_error_bytes": reserve - (reserved - allocated),
                            "total_error_bytes": part.total_bytes + outside
                            - figures["nvml_bytes"]})
    return out


def describe(rows: list[dict]) -> list[str]:
    lines = [f"held-out phases: {len(rows)}"]
    for key, name in (("tensors_error_bytes", "tensors vs torch's allocated"),
                      ("reserve_error_bytes", "reserve vs torch's reserved less allocated"),
                      ("total_error_bytes", "the model alone vs NVML")):
        share = [r[key] / r["nvml_bytes"] for r in rows]
        quartiles = statistics.quantiles(share, n=4)
        lines.append(f"{name}: median {statistics.median(share):+.2%} of NVML "
                     f"({statistics.median(r[key] for r in rows) / 2**20:+.0f} MiB), "
                     f"quartiles {quartiles[0]:+.2%}, {quartiles[2]:+.2%}; "
                     f"{sum(s > 0 for s in share)} over, {sum(s < 0 for s in share)} under")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    rows = phases()
    lines = ["model_lean: the memory model alone on the held-out H200 grids, split "
             "(python benchmarks/model_lean.py)", *describe(rows)]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model_lean.txt").write_text("\n".join(lines) + "\n")
    (args.out / "model_lean.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
