"""The pre-screen's traces: a candidate's probe step traced with fake tensors (probe/trace.py),
each in a process of its own, cached by config.

A trace counts every tensor the probe's step would allocate, per phase, on one rank; the
sweep adds the fixed term (memory.model's prior for the device, then the median of what
measured probes held beyond their trace) and skips a candidate whose traced peak is past the
capacity by more than TRACE_MARGIN, from the first trial on (feasibility.py). Only
candidates the memory model puts near the wall are traced (TRACE_FROM): far from it a trace
could not change the decision. A trace must also cost less than the probe it may save: once
both are timed, tracing stops when a trace's wall time (its process start included) passes
TRACE_COST_SHARE of the median probe's (a tiny model on a CPU probes as fast as it traces; a
7B probe on a GPU takes minutes, its trace about one). A trace that fails (a model the trace
cannot follow) turns tracing off too. Either way the reason is kept with the study's
calibration and the arithmetic pre-screen goes on. Imports no torch: the trace runs in its own
process.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.memory.model import TRACE_CPU_CONTEXT_BYTES, TRACE_GPU_CONTEXT_BYTES
from autotune.probe.result import ProbeRequest
from autotune.sweep.sharing import params_key

TRACE_FROM = 0.6  # trace a candidate only when memory.py puts it past this share of capacity
TRACE_MARGIN = 0.02  # skip past capacity x (1 + margin): see feasibility.py
TRACE_COST_SHARE = 0.5  # trace while a trace takes at most this share of a probe's wall time
TRACE_TIMEOUT_S = 900.0


class SubprocessTracer:
    """Traces of candidates (the tensors' bytes per phase, no fixed term), cached by config."""

    def __init__(self, request_for: Callable[[dict[str, Any]], ProbeRequest],
                 on_gpu: bool, probe_wall_s: list[float] | None = None) -> None:
        self.request_for = request_for
        self.probe_wall_s = probe_wall_s if probe_wall_s is not None else []  # the sweep's
        self.prior_context_bytes = TRACE_GPU_CONTEXT_BYTES if on_gpu else \
            TRACE_CPU_CONTEXT_BYTES
        self.traces: dict[str, dict[str, int]] = {}
        self.residuals: list[int] = []  # measured minus traced, per phase of each probe
        self.unavailable: str | None = None  # why tracing is off for this sweep
        self.trace_wall_s: list[float] = []  # each trace process, start to end

    def summary(self) -> dict[str, Any]:
        """What tracing did in this sweep, as stored with the calibration."""
        return {"traces": len(self.trace_wall_s), "trace_wall_s": round(sum(self.trace_wall_s), 1),
                "context_bytes": self.context_bytes if self.residuals else None,
                "off": self.unavailable}

    def weigh_cost(self) -> None:
        """Stop tracing once a trace costs more than TRACE_COST_SHARE of a probe."""
        if self.unavailable is None and self.trace_wall_s and self.probe_wall_s:
            trace_s, probe_s = statistics.median(self.trace_wall_s), \
                statistics.median(self.probe_wall_s)
            if trace_s > TRACE_COST_SHARE * probe_s:
                self.unavailable = (f"a trace takes {trace_s:.0f} s, a probe {probe_s:.0f} s: "
                                    "tracing would cost more than the probes it could save")

    @property
    def context_bytes(self) -> int:
        """The fixed term: the prior, then the median of what probes held beyond the trace."""
        return int(statistics.median(self.residuals)) if self.residuals else \
            self.prior_context_bytes

    def traced_bytes(self, params: dict[str, Any], capacity_bytes: int | None
                     ) -> dict[str, int] | None:
        """Per-phase traced bytes of `params`, with the fixed term; None when unavailable."""
        key = params_key(params)
        self.weigh_cost()
        if key not in self.traces and self.unavailable is None:
            traced = self._run(self.request_for(params), capacity_bytes)
            if traced is not None:
                self.traces[key] = traced
        live = self.traces.get(key)
        if live is None:
            return None
        return {phase: value + self.context_bytes for phase, value in live.items()}

    def learn(self, params: dict[str, Any], phase_peak_mem_bytes: dict[str, int]) -> None:
        """A probe measured `params`: what it held beyond its trace fits the fixed term."""
        live = self.traces.get(params_key(params))
        if live is not None:
            self.residuals += [phase_peak_mem_bytes[p] - live[p] for p in live
                               if p in phase_peak_mem_bytes]

    def _run(self, request: ProbeRequest, capacity_bytes: int | None) -> dict[str, int] | None:
        with tempfile.TemporaryDirectory(prefix="autotune-trace-") as folder:
            request_path, result_path = Path(folder) / "request.json", Path(folder) / "out"
            request_path.write_text(request.to_json())
            argv = [sys.executable, "-m", "autotune.probe.trace", str(request_path),
                    str(result_path), "0", str(capacity_bytes or 0)]
            started_s = time.monotonic()
            try:
                done = subprocess.run(argv, capture_output=True, text=True,
                                      timeout=TRACE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.unavailable = f"a trace took over {TRACE_TIMEOUT_S:.0f} s"
                return None
            finally:
                self.trace_wall_s.append(time.monotonic() - started_s)
            if not result_path.exists():
                tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
                self.unavailable = f"the trace process failed: {tail[:200]}"
                return None
            result = json.loads(result_path.read_text())
        if "error" in result:
            self.unavailable = f"the trace cannot follow this model or config: {result['error']}"
            return None
        return {phase: int(value) for phase, value in result["phase_peak_mem_bytes"].items()}
