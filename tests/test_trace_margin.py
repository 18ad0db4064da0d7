"""The traced pre-screen's no-loss rule, held against the recorded CPU grids.

benchmarks/data holds real uncapped probes of every grid config (every phase measured) and each
config's trace (the tensors' bytes per phase). The sweep skips a config whose trace plus the
prior fixed term is past the capacity by TRACE_MARGIN; that can skip a config that fits only
where the trace overstates a measured phase peak by more than the margin. These tests fail if
the margin, the prior or the trace move so that it would, on any grid we can measure, and if
the demo grid's OOM configs stop being caught before any probe.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from autotune.memory.model import TRACE_CPU_CONTEXT_BYTES
from autotune.sweep.feasibility.traced import TRACE_MARGIN_CPU as TRACE_MARGIN

DATA = Path(__file__).parent.parent / "benchmarks" / "data"
PHASES = ("rollout", "experience", "update")
GRIDS = ["memory_grid_tiny", "memory_grid_tiny_vl", "memory_grid_tiny_w2",
         "memory_grid_tiny_vl_w2", "cpu_demo_grid"]
DEMO_CAP_BYTES = 545 << 20  # autotune/search_spaces/cpu-demo.yaml's cap, as the grid was recorded


def measured_and_traced(grid: str) -> list[tuple[dict, dict]]:
    """(recorded probe row, traced row) per config, matched on the knob columns."""
    with open(DATA / f"{grid}_traced.csv", newline="") as handle:
        traced_rows = list(csv.DictReader(handle))
    knobs = [name for name in traced_rows[0] if not name.startswith("traced_")
             and name != "trace_s"]
    traced = {tuple(row[k] for k in knobs): row for row in traced_rows}
    with open(DATA / f"{grid}.csv", newline="") as handle:
        return [(row, traced[tuple(row[k] for k in knobs)]) for row in csv.DictReader(handle)]


@pytest.mark.parametrize("grid", GRIDS)
def test_no_measured_phase_is_overstated_by_the_margin(grid):
    pairs = measured_and_traced(grid)
    assert len(pairs) >= 16
    worst = 0.0
    for row, trace in pairs:
        if row["status"] != "ok":
            continue
        for phase in PHASES:
            measured = int(row[f"peak_mem_{phase}_bytes"])
            ours = int(trace[f"traced_{phase}_bytes"]) + TRACE_CPU_CONTEXT_BYTES
            worst = max(worst, (ours - measured) / measured)
    assert worst < TRACE_MARGIN, f"{grid}: the trace overstates a phase by {worst:.1%}"


def test_the_demo_grid_is_split_at_its_cap_by_the_trace_alone():
    """Every OOM config of the demo is past the cap by the margin before any probe is
    measured; no config that fit is."""
    skipped = {"ok": 0, "gpu_oom": 0}
    for row, trace in measured_and_traced("cpu_demo_grid"):
        peak = max(int(trace[f"traced_{p}_bytes"]) for p in PHASES) + TRACE_CPU_CONTEXT_BYTES
        if peak > DEMO_CAP_BYTES * (1 + TRACE_MARGIN):
            skipped[row["status"]] += 1
    assert skipped == {"ok": 0, "gpu_oom": 23}
