"""The pre-screen's traces: a candidate's probe step traced with fake tensors (probe/trace.py),
in a trace process of the sweep's own, cached by config.

A trace records every allocation and free the probe's step would make on one rank, in order and
with its stream; on a GPU the trace process replays them through the CUDA caching allocator's rules
(memory/allocator.py), so what it returns per phase is torch's reserved peak, not the live tensors,
and the smallest cap torch could run the step under (the allocator frees its cache and retries
before it raises). The sweep adds what the process holds outside torch (memory/outside_torch.py:
the CUDA context, NCCL's buffers): the prior until a probe reports, then what its probes measured
of it, NVML less torch's reserved peak (every probe reads both). A candidate is predicted to run
out of memory when even the smallest cap it could run under, plus that term, is past the capacity
by more than the device's margin (trace_margin). On a CPU device there is no caching allocator to
replay: the trace is the live tensors and the fixed term is what a probe held beyond its trace, the
least seen per phase (the interpreter and glibc's heap).

The margins are the measured errors: on a GPU the replayed prediction's largest overstatement of
NVML's peak over the committed H200 rows (benchmarks/allocator_fidelity.py), on a CPU the trace's
over the recorded grids, so a config that fits is not skipped for the error. Only candidates the
memory model puts near the wall are traced (TRACE_FROM): far from it a trace could not change the
decision. A trace must also cost less than the probe it may save: once a probe and two traces
are timed, tracing stops when the median trace after the first (its own time: the process starts
once, and the first trace pays its one-time imports) takes more than TRACE_COST_SHARE of the
median probe's wall time. A trace that fails (a model the trace cannot
follow), or a trace process that dies, turns tracing off too. Either way the reason is kept with
the study's calibration and the arithmetic pre-screen goes on. Imports no torch: the traces run in
one process started at the first and kept for the next (torch and transformers load once), which
ends when tracing turns off or with the sweep (at the end of its input), or with the driver when
it dies (its parent-death signal); a Ctrl-C while it forks is raised once the fork is done
(interrupts_held). A trace never shares a running probe's cores: it runs pinned to a free
slot's cores (parallel.py), and while every slot runs a probe it is put off (counted as
deferred).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import IO, Any, Literal, Protocol, TypedDict

from autotune.config import Knobs, format_bytes
from autotune.files import JsonObject
from autotune.hardware import Device
from autotune.memory.model import TRACE_CPU_CONTEXT_BYTES
from autotune.memory.outside_torch import outside_torch
from autotune.probe.measure.result import ProbeRequest
from autotune.process_tag import die_with_parent
from autotune.sweep.execution.interrupts import interrupts_held
from autotune.sweep.feasibility.prescreen import Prediction
from autotune.sweep.feasibility.trace_cache import TraceCache
from autotune.sweep.space.search_space import Candidate

TRACE_FROM = 0.6  # trace a candidate the memory model puts past this share of the capacity
# Skip past capacity x (1 + margin): the margin guards against skipping a config that fits,
# so it is the trace's largest overstatement of a measured peak on the device, rounded up.
# A GPU: the replay (plus what lives outside torch) overstated NVML's peak by +1.7% at most
# over the 43 committed H200 phase rows and by +4.1% over the 103 held-out ones, configs drawn
# at random (benchmarks/results/allocator_fidelity.json: a 7B FSDP1 rank's update), and one
# percent more for a card not measured (3% from the committed rows alone until 2026-12-04,
# +1.9% then). Its understatements cost a probe, never a config. A CPU: the tensors
# plus the fitted fixed term overstated a recorded grid's phase by 1.8% at most
# (benchmarks/trace_accuracy.py; tests/test_trace_margin.py holds it).
TRACE_MARGIN_GPU = 0.06
TRACE_MARGIN_CPU = 0.02
TRACE_COST_SHARE = 0.5  # trace while a trace takes at most this share of a probe's wall time
TRACE_TIMEOUT_S = 900.0


class TraceAnswer(TypedDict, total=False):
    """One line of the trace process (probe/trace.py's serve): a TraceResult's fields, or an
    engine that cannot start as in its probe (oom, message), or what it cannot follow (error)."""

    phase_peak_mem_bytes: dict[str, int]
    trace_s: float
    fits_under_bytes: int | None
    oom: str
    message: str
    error: str


class Tracer(Protocol):
    """Traces of candidates for the traced pre-screen: SubprocessTracer, or a recorded table
    (benchmarks/search_efficiency.py)."""

    unavailable: str | None  # why tracing is off for this sweep, once it is

    def traced_bytes(self, candidate: Candidate, device: Device) -> dict[str, int] | None:
        """Per-phase traced bytes of `candidate`, the fixed term included; None when
        unavailable."""
        ...

    def fits_under_bytes(self, candidate: Candidate, device: Device) -> int | None:
        """The least device memory the traced step runs in (on a GPU: the smallest cap
        torch's allocator runs it under, plus what lives outside torch); None when
        unavailable."""
        ...

    def answered(self, candidate: Candidate) -> bool:
        """Whether `candidate`'s trace is known without running one now (traced or failed
        in this sweep, or tracing off)."""
        ...

    def failure(self, candidate: Candidate) -> tuple[str, str] | None:
        """(status, message) when the trace of `candidate` ran out of memory itself (the
        engine could not start), else None."""
        ...

    def learn(self, candidate: Candidate, phase_peak_mem_bytes: dict[str, int],
              device: Device, phase_reserved_bytes: dict[str, int] | None = None) -> None:
        """A probe measured `candidate` on `device`: its peaks, and on a GPU torch's reserved
        peaks beside them (what it held outside torch)."""
        ...

    def summary(self) -> JsonObject:
        """What tracing did, as stored with the study's calibration."""
        ...

    def close(self) -> None:
        """End whatever the tracer runs."""
        ...


def traced_prediction(tracer: Tracer, candidate: Candidate, modelled_bytes: int,
                      device: Device) -> Prediction | None:
    """The traced pre-screen: a candidate the memory model puts near the wall
    (`modelled_bytes` past TRACE_FROM of what the probe may use) is traced, and predicted to
    run out of device memory when its traced peak is past that by more than its margin."""
    capacity = device.usable_bytes
    if capacity is None or modelled_bytes < TRACE_FROM * capacity \
            or candidate.config.separate:  # the trace runs the colocated step only
        return None
    traced = tracer.traced_bytes(candidate, device)
    if traced is None:
        failure = tracer.failure(candidate)
        return None if failure is None else Prediction(
            failure[0], f"predicted {failure[0]}: the traced step fails as the probe would: "
            f"{failure[1]}", "build", "trace")
    phase = max(traced, key=lambda name: traced[name])
    needs = tracer.fits_under_bytes(candidate, device) or traced[phase]
    margin = trace_margin(device)
    if needs <= capacity * (1 + margin):
        return None
    at_least = "" if needs == traced[phase] else \
        f", and runs under no cap below {format_bytes(needs)}"
    return Prediction("gpu_oom", f"predicted gpu_oom: the traced step needs "
                      f"{format_bytes(traced[phase])} in {phase}{at_least}, more than "
                      f"{1 + margin:.2f} x the {format_bytes(capacity)} the device has",
                      phase, "trace")


def trace_margin(device: Device) -> float:
    """How far past the capacity a traced peak must be to skip its config, on `device`."""
    return TRACE_MARGIN_GPU if device.on_gpu else TRACE_MARGIN_CPU


class SubprocessTracer:
    """Traces of candidates (torch's bytes per phase: the replayed reserve on a GPU, the
    tensors on a CPU; no fixed term), cached by config (the candidate's key)."""

    def __init__(self, request_for: Callable[[Candidate, Device], ProbeRequest],
                 on_gpu: bool, probe_wall_s: list[float] | None = None,
                 on_trace: Callable[[Knobs | None], None] | None = None,
                 free_cores: Callable[[], tuple[int, ...] | None | Literal[False]] | None = None,
                 cache: TraceCache | None = None) -> None:
        self.request_for = request_for  # a candidate's probe on the device as now known
        self.free_cores = free_cores  # the cores no probe holds now: a free slot's ids, None
        # for no pinning (no probe runs beside), False while every slot runs a probe
        self.on_trace = on_trace  # told the params a trace starts on, then None at its end
        self.probe_wall_s = probe_wall_s if probe_wall_s is not None else []  # the sweep's
        self.on_gpu = on_gpu
        self.cache = cache  # answers of earlier runs of the study (None: none kept)
        self.prior_context_bytes = TRACE_CPU_CONTEXT_BYTES  # a CPU's, before a probe
        self.traces: dict[str, dict[str, int]] = {}
        self.fits_under: dict[str, int] = {}  # GPU: the smallest cap torch runs it under
        self.outside: dict[str, int] = {}  # GPU: the prior outside torch, per config
        self.failures: dict[str, tuple[str, str]] = {}  # traces that ran out of memory
        self.residuals: dict[str, list[int]] = {}  # CPU, per phase: measured - traced
        self.outside_measured: list[int] = []  # GPU: each probe's NVML less its reserved
        self.unavailable: str | None = None  # why tracing is off for this sweep
        self.trace_wall_s: list[float] = []  # each trace, asked to answered
        self.trace_cost_s: list[float] = []  # each trace itself: the process starts once
        self.deferred = 0  # traces put off because every slot's cores ran a probe
        self._process: subprocess.Popen[str] | None = None  # the trace process, once started
        self._mid_trace = False  # a trace asked, not answered (its process may be starting)
        self._stderr: IO[str] | None = None  # where it writes what went wrong

    def summary(self) -> JsonObject:
        """What tracing did in this sweep, as stored with the calibration."""
        return {"traces": len(self.trace_wall_s), "trace_wall_s": round(sum(self.trace_wall_s), 1),
                "deferred": self.deferred,
                "phase_context_bytes": {phase: self.context_bytes(phase)
                                        for phase in self.residuals} or None,
                "outside_torch_bytes": min(self.outside_measured)
                if self.outside_measured else None,
                "off": self.unavailable}

    def weigh_cost(self) -> None:
        """Stop tracing once a trace costs more than TRACE_COST_SHARE of a probe. The first
        trace carries what the trace process does once (the model's modeling import, the
        fake mode's first dispatches: about half of it on a CPU), so the traces after it
        decide, from the second on."""
        if self.unavailable is None and len(self.trace_cost_s) > 1 and self.probe_wall_s:
            trace_s, probe_s = statistics.median(self.trace_cost_s[1:]), \
                statistics.median(self.probe_wall_s)
            if trace_s > TRACE_COST_SHARE * probe_s:
                self.unavailable = (f"a trace takes {trace_s:.0f} s, a probe {probe_s:.0f} s: "
                                    "tracing would cost more than the probes it could save")

    def context_bytes(self, phase: str, key: str | None = None) -> int:
        """The fixed term added to a trace: on a GPU what lives outside torch (the least its
        probes measured, before them the prior for the config `key`'s topology); on a CPU
        the least a probe held beyond its trace in `phase`, before any the prior."""
        if self.on_gpu:
            if self.outside_measured:
                return min(self.outside_measured)
            return self.outside.get(key or "", outside_torch().total_bytes)
        seen = self.residuals.get(phase)
        return min(seen) if seen else self.prior_context_bytes

    def traced_bytes(self, candidate: Candidate, device: Device) -> dict[str, int] | None:
        """Per-phase traced bytes of `candidate` on `device`, with the fixed term; None when
        unavailable."""
        key = candidate.key
        self.weigh_cost()
        if self.unavailable is not None:
            self.close()  # tracing is off: its idle process (torch loaded) goes now
        if key not in self.traces and key not in self.failures and self.unavailable is None:
            request = self.request_for(candidate, device)
            self.outside[key] = self.outside_prior(request)
            known = self.cache.get(request) if self.cache is not None else None  # traced
            # before, by this study's earlier runs
            cores = self.free_cores() if self.free_cores is not None and known is None \
                else None
            if cores is False:  # never beside a running probe on its cores: later, or the
                self.deferred += 1  # memory model's pre-screen alone for this candidate
                return None
            if known is not None:
                traced = self._answer(known, key)
            else:
                if self.on_trace is not None:
                    self.on_trace(candidate.params)
                try:
                    traced = self._run(dataclasses.replace(request, cpu_ids=tuple(cores))
                                       if cores else request, key)
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
        return {phase: value + self.context_bytes(phase, key) for phase, value in live.items()}

    @staticmethod
    def outside_prior(request: ProbeRequest) -> int:
        """What a GPU probe of `request` holds outside torch, before any probe measured it:
        the CUDA context, and NCCL's buffers for its real ranks."""
        return outside_torch(request.world_size, request.emulated,
                             request.config.rollout_tensor_parallel).total_bytes

    def fits_under_bytes(self, candidate: Candidate, device: Device) -> int | None:
        """The least device memory the traced step runs in: the smallest cap torch's
        allocator runs it under plus what lives outside torch (a GPU); None on a CPU or
        untraced."""
        key = candidate.key
        if self.traces.get(key) is None or key not in self.fits_under:
            return None
        return self.fits_under[key] + self.context_bytes("", key)

    def answered(self, candidate: Candidate) -> bool:
        return candidate.key in self.traces or candidate.key in self.failures or \
            self.unavailable is not None

    def failure(self, candidate: Candidate) -> tuple[str, str] | None:
        """(status, message) of a trace that ran out of memory as the probe would (a KV pool
        past the device: the engine does not start), else None."""
        return self.failures.get(candidate.key)

    def learn(self, candidate: Candidate, phase_peak_mem_bytes: dict[str, int],
              device: Device, phase_reserved_bytes: dict[str, int] | None = None) -> None:
        """A probe measured `candidate`. On a GPU, what it held outside torch is its NVML peak
        less torch's reserved peak, both its own (no trace needed). On a CPU, what it held
        beyond its trace, per phase, fits that phase's fixed term; a config probed before it
        was traced (the safe config, the first probe, is never traced to be skipped) is
        traced now."""
        if self.on_gpu:
            outside = [phase_peak_mem_bytes[p] - reserved
                       for p, reserved in (phase_reserved_bytes or {}).items()
                       if p in phase_peak_mem_bytes and reserved]
            if outside:
                self.outside_measured.append(max(0, min(outside)))
            return
        key = candidate.key
        if key not in self.traces and key not in self.failures:
            self.traced_bytes(candidate, device)
        live = self.traces.get(key) or {}
        for phase in live:
            if phase in phase_peak_mem_bytes:
                self.residuals.setdefault(phase, []).append(
                    phase_peak_mem_bytes[phase] - live[phase])

    def _run(self, request: ProbeRequest, key: str) -> dict[str, int] | tuple[str, str] | None:
        """Torch's bytes per phase; (status, message) where the trace ran out of memory as
        the probe would; None when tracing is off (the reason in `unavailable`)."""
        started_s = time.monotonic()
        try:
            result = self._ask(request)
        finally:
            self.trace_wall_s.append(time.monotonic() - started_s)
        if result is None:
            return None
        if "error" not in result and self.cache is not None:
            self.cache.put(request, dict(result))
        if "trace_s" in result:
            self.trace_cost_s.append(float(result["trace_s"]))
        return self._answer(result, key)

    def _answer(self, result: TraceAnswer | dict[str, Any], key: str
                ) -> dict[str, int] | tuple[str, str] | None:
        """A trace process's answer for the config `key`, as `_run` returns it."""
        if "oom" in result:  # not a model the trace cannot follow: a config that cannot run
            return result["oom"], result["message"]
        if "error" in result:
            self.unavailable = f"the trace cannot follow this model or config: {result['error']}"
            self.close()  # tracing is off: its idle process goes now, not with the sweep
            return None
        fits_under = result.get("fits_under_bytes")
        if fits_under is not None:
            self.fits_under[key] = int(fits_under)
        return {phase: int(value) for phase, value in result["phase_peak_mem_bytes"].items()}

    def _ask(self, request: ProbeRequest) -> TraceAnswer | None:
        """One trace from the trace process (started on the first); None, with the reason in
        `unavailable`, when it died or ran past TRACE_TIMEOUT_S (then it is killed)."""
        self._mid_trace = True  # from here a stop kills the process: one still importing
        if self._process is None:  # torch would read the end of its input only seconds later
            self._stderr = tempfile.TemporaryFile("w+")
            driver_pid = os.getpid()
            with interrupts_held():  # a Ctrl-C mid-fork is raised after it, not lost in it
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
        except BaseException:  # Ctrl-C or SIGTERM mid-trace: the trace is killed, not awaited
            self.close()
            raise
        self._mid_trace = False
        if line:
            answer: TraceAnswer = json.loads(line)
            return answer
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
        """End the trace process: at the end of its input when idle, killed at once when it
        is mid-trace (an interrupted sweep stops now, not after the trace or a timeout)."""
        process, self._process = self._process, None
        if process is not None:
            if self._mid_trace:
                process.kill()
                self._mid_trace = False
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
