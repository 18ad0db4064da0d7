"""The pre-screen's traces: a candidate's probe step traced with fake tensors (probe/trace.py),
in a trace process of the sweep's own, cached by config.

A trace counts every tensor the probe's step would allocate, per phase, on one rank; the
sweep adds the fixed term (memory.model's prior for the device; once probes have measured a
phase, the least any of them held beyond its trace in that phase) and skips a candidate whose
traced peak is past the capacity by more than TRACE_MARGIN, from the first trial on. The
tensors being exact (on a GPU within 1.2% of torch's allocated peak,
benchmarks/results/gpu), only the fixed term can be wrong, and it is what a process holds
beyond its tensors, not a share of them: the CUDA context and the caching allocator's slack,
which on a GPU differs by phase (0.1 GiB in a 7B rank's rollout, 11 GiB in its update), so
each phase learns its own; the least, not the median, so a config that holds less than the
probes seen is not skipped. The margin is set from benchmarks/trace_accuracy.py
(docs/benchmarks.md). Only
candidates the memory model puts near the wall are traced (TRACE_FROM): far from it a trace
could not change the decision. A trace must also cost less than the probe it may save: once
both are timed, tracing stops when the median trace (its own time: the process starts once)
takes more than TRACE_COST_SHARE of the median probe's wall time. A trace that fails (a model
the trace cannot follow), or a trace process that dies, turns tracing off too. Either way the
reason is kept with the study's calibration and the arithmetic pre-screen goes on. Imports no
torch: the traces run in one process started at the first and kept for the next (torch and
transformers load once), which ends with the sweep, at the end of its input, or with the
driver when it dies (its parent-death signal).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import IO, Any, Protocol

from autotune.config import format_bytes
from autotune.hardware import Device
from autotune.memory.model import TRACE_CPU_CONTEXT_BYTES, TRACE_GPU_CONTEXT_BYTES
from autotune.probe.process_tag import die_with_parent
from autotune.probe.result import ProbeRequest
from autotune.sweep.prescreen import Prediction
from autotune.sweep.sharing import params_key

TRACE_FROM = 0.6  # trace a candidate only when memory.py puts it past this share of capacity
TRACE_MARGIN = 0.02  # skip past capacity x (1 + margin): only the fixed term can be wrong
TRACE_COST_SHARE = 0.5  # trace while a trace takes at most this share of a probe's wall time
TRACE_TIMEOUT_S = 900.0


class Tracer(Protocol):
    """Traces of candidates for the traced pre-screen: SubprocessTracer, or a recorded table
    (benchmarks/search_efficiency.py)."""

    unavailable: str | None  # why tracing is off for this sweep, once it is

    def traced_bytes(self, params: dict[str, Any], device: Device) -> dict[str, int] | None:
        """Per-phase traced bytes of `params`, the fixed term included; None when unavailable."""
        ...

    def failure(self, params: dict[str, Any]) -> tuple[str, str] | None:
        """(status, message) when the trace of `params` ran out of memory itself (the engine
        could not start), else None."""
        ...

    def learn(self, params: dict[str, Any], phase_peak_mem_bytes: dict[str, int],
              device: Device) -> None:
        """A probe measured `params` on `device`: what it held beyond its trace."""
        ...

    def summary(self) -> dict[str, Any]:
        """What tracing did, as stored with the study's calibration."""
        ...

    def close(self) -> None:
        """End whatever the tracer runs."""
        ...


def traced_prediction(tracer: Tracer, params: dict[str, Any], modelled_bytes: int,
                      device: Device) -> Prediction | None:
    """The traced pre-screen: a candidate the memory model puts near the wall
    (`modelled_bytes` past TRACE_FROM of what the probe may use) is traced, and predicted to
    run out of device memory when its traced peak is past that by more than TRACE_MARGIN."""
    capacity = device.usable_bytes
    if capacity is None or modelled_bytes < TRACE_FROM * capacity:
        return None
    traced = tracer.traced_bytes(params, device)
    if traced is None:
        failure = tracer.failure(params)
        return None if failure is None else Prediction(
            failure[0], f"predicted {failure[0]}: the traced step fails as the probe would: "
            f"{failure[1]}", "build", "trace")
    phase = max(traced, key=lambda name: traced[name])
    if traced[phase] <= capacity * (1 + TRACE_MARGIN):
        return None
    return Prediction("gpu_oom", f"predicted gpu_oom: the traced step needs "
                      f"{format_bytes(traced[phase])} in {phase}, more than "
                      f"{1 + TRACE_MARGIN:.2f} x the {format_bytes(capacity)} the device has",
                      phase, "trace")


class SubprocessTracer:
    """Traces of candidates (the tensors' bytes per phase, no fixed term), cached by config."""

    def __init__(self, request_for: Callable[[dict[str, Any], Device], ProbeRequest],
                 on_gpu: bool, probe_wall_s: list[float] | None = None,
                 on_trace: Callable[[dict[str, Any] | None], None] | None = None) -> None:
        self.request_for = request_for  # a candidate's probe on the device as now known
        self.on_trace = on_trace  # told the candidate a trace starts on, then None at its end
        self.probe_wall_s = probe_wall_s if probe_wall_s is not None else []  # the sweep's
        self.prior_context_bytes = TRACE_GPU_CONTEXT_BYTES if on_gpu else \
            TRACE_CPU_CONTEXT_BYTES
        self.traces: dict[str, dict[str, int]] = {}
        self.failures: dict[str, tuple[str, str]] = {}  # traces that ran out of memory
        self.residuals: dict[str, list[int]] = {}  # per phase: each probe's measured - traced
        self.unavailable: str | None = None  # why tracing is off for this sweep
        self.trace_wall_s: list[float] = []  # each trace, asked to answered
        self.trace_cost_s: list[float] = []  # each trace itself: the process starts once
        self._process: subprocess.Popen[str] | None = None  # the trace process, once started
        self._stderr: IO[str] | None = None  # where it writes what went wrong

    def summary(self) -> dict[str, Any]:
        """What tracing did in this sweep, as stored with the calibration."""
        return {"traces": len(self.trace_wall_s), "trace_wall_s": round(sum(self.trace_wall_s), 1),
                "phase_context_bytes": {phase: self.context_bytes(phase)
                                        for phase in self.residuals} or None,
                "off": self.unavailable}

    def weigh_cost(self) -> None:
        """Stop tracing once a trace costs more than TRACE_COST_SHARE of a probe."""
        if self.unavailable is None and self.trace_cost_s and self.probe_wall_s:
            trace_s, probe_s = statistics.median(self.trace_cost_s), \
                statistics.median(self.probe_wall_s)
            if trace_s > TRACE_COST_SHARE * probe_s:
                self.unavailable = (f"a trace takes {trace_s:.0f} s, a probe {probe_s:.0f} s: "
                                    "tracing would cost more than the probes it could save")

    def context_bytes(self, phase: str) -> int:
        """The phase's fixed term: the prior, then the least a probe held beyond its trace in
        that phase."""
        seen = self.residuals.get(phase)
        return min(seen) if seen else self.prior_context_bytes

    def traced_bytes(self, params: dict[str, Any], device: Device) -> dict[str, int] | None:
        """Per-phase traced bytes of `params` on `device`, with the fixed term; None when
        unavailable."""
        key = params_key(params)
        self.weigh_cost()
        if key not in self.traces and key not in self.failures and self.unavailable is None:
            if self.on_trace is not None:
                self.on_trace(params)
            try:
                traced = self._run(self.request_for(params, device))
            finally:
                if self.on_trace is not None:
                    self.on_trace(None)
            if isinstance(traced, tuple):
                self.failures[key] = traced
            elif traced is not None:
                self.traces[key] = traced
        live = self.traces.get(key)
        if live is None:
            return None
        return {phase: value + self.context_bytes(phase) for phase, value in live.items()}

    def failure(self, params: dict[str, Any]) -> tuple[str, str] | None:
        """(status, message) of a trace that ran out of memory as the probe would (a KV pool
        past the device: the engine does not start), else None."""
        return self.failures.get(params_key(params))

    def learn(self, params: dict[str, Any], phase_peak_mem_bytes: dict[str, int],
              device: Device) -> None:
        """A probe measured `params`: what it held beyond its trace, per phase, fits that
        phase's fixed term. A config probed before it was traced (the safe config, the first
        probe, is never traced to be skipped) is traced now: without it the prior term stood
        until a traced config was probed, and on a GPU the prior (1 GiB) is a tenth of a 7B
        update's (benchmarks/results/search_efficiency_gpu.txt)."""
        key = params_key(params)
        if key not in self.traces and key not in self.failures:
            self.traced_bytes(params, device)
        live = self.traces.get(key) or {}
        for phase in live:
            if phase in phase_peak_mem_bytes:
                self.residuals.setdefault(phase, []).append(
                    phase_peak_mem_bytes[phase] - live[phase])

    def _run(self, request: ProbeRequest) -> dict[str, int] | tuple[str, str] | None:
        """The tensors' bytes per phase; (status, message) where the trace ran out of memory
        as the probe would; None when tracing is off (the reason in `unavailable`)."""
        started_s = time.monotonic()
        try:
            result = self._ask(request)
        finally:
            self.trace_wall_s.append(time.monotonic() - started_s)
        if result is None:
            return None
        if "oom" in result:  # not a model the trace cannot follow: a config that cannot run
            return result["oom"], result["message"]
        if "error" in result:
            self.unavailable = f"the trace cannot follow this model or config: {result['error']}"
            return None
        self.trace_cost_s.append(float(result["trace_s"]))
        return {phase: int(value) for phase, value in result["phase_peak_mem_bytes"].items()}

    def _ask(self, request: ProbeRequest) -> dict[str, Any] | None:
        """One trace from the trace process (started on the first); None, with the reason in
        `unavailable`, when it died or ran past TRACE_TIMEOUT_S (then it is killed)."""
        if self._process is None:
            self._stderr = tempfile.TemporaryFile("w+")
            driver_pid = os.getpid()
            self._process = subprocess.Popen(
                [sys.executable, "-m", "autotune.probe.trace"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                preexec_fn=lambda: die_with_parent(driver_pid))
        process = self._process
        assert process.stdin is not None and process.stdout is not None
        line, ended = "", False  # ended: its output closed, it died
        try:
            process.stdin.write(request.to_json(indent=None) + "\n")
            process.stdin.flush()
            ready, _, _ = select.select([process.stdout], [], [], TRACE_TIMEOUT_S)
            if ready:
                line = process.stdout.readline()
                ended = not line
        except BrokenPipeError:
            ended = True
        if line:
            return json.loads(line)
        if not ended:
            self.unavailable = f"a trace took over {TRACE_TIMEOUT_S:.0f} s"
            process.kill()
        elif self._stderr is not None:
            self._stderr.seek(0)
            tail = (self._stderr.read().strip().splitlines() or ["no output"])[-1]
            self.unavailable = f"the trace process failed: {tail[:200]}"
        self.close()
        return None

    def close(self) -> None:
        """End the trace process (at the end of its input; killed if it is mid-trace)."""
        process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(OSError):
                if process.stdin is not None:
                    process.stdin.close()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
