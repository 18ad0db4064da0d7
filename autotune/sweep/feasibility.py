"""Never probe a config that must run out of memory: dominance over measured OOMs.

Peak device memory is monotone along known axes (config.MEMORY_DIRECTION): larger
micro-batches, batch sizes, rollout_n and lengths need more; gradient checkpointing and
offload need less. So once config A has run out of device memory in phase P, any config B at
least as demanding as A on every axis that moves P's peak (memory.PHASE_KNOBS: the update
does not care about the log-prob micro-batch, the log-prob forwards not about checkpointing)
must too, and is recorded as a predicted OOM without running.

Host RAM runs the other way on the offload axes: offload moves tensors into host memory. A
config that offloads at least what a host-OOM config offloaded, and is at least as demanding
on every other axis, is predicted to exhaust host RAM too.

Cache OOM (the rollout engine's KV-cache reservation) is two-sided in the engine's memory
share and is never used for dominance.

Pre-screen: once MIN_CALIBRATION_PROBES probes have succeeded, the memory model (memory.py),
calibrated on them (calibration.py), estimates every candidate; one whose estimate exceeds the
device's capacity by more than PRESCREEN_MARGIN is recorded as a predicted OOM too. Before
that, only the exact part is used: a config whose model states alone exceed the capacity
(a 7B actor with Adam on one 80 GB GPU) cannot fit whatever the activations.
The margin is set from benchmarks/memory_accuracy.py: out of sample (fitted on 6 random probes,
scored on the rest, 200 draws on three real CPU grids), the calibrated estimate overstated a
config's measured peak by at most 21.1% (99th percentile 7.3%); with 4 probes it was worse.
So the pre-screen waits for 6 probes and skips only past 1.25 x capacity.

Traced pre-screen (traced.py): where the probe's step can be traced with fake tensors, a
candidate the memory model puts near the wall is traced before it runs, from the first trial
on; one whose traced peak (the tensors, exact, plus a small fixed term) exceeds the capacity
by more than traced.TRACE_MARGIN is a predicted OOM. The tensors being exact, only the fixed
term can be wrong, and it is what a process holds beyond its tensors, not a share of them:
over every phase of the CPU grids (W = 1 and 2, text and vision; benchmarks/trace_accuracy.py)
it was 258 to 304 MiB, so the traced peak with the prior (264 MiB) overstated a measured one
by at most 6 MiB, 1.1% of the demo's cap; the margin is 2%. On a GPU the caching allocator's
rounding only adds to the tensors; the prior context (1 GiB) is a guess until a GPU measures
it (benchmarks/gpu_evidence.py), and the sweep's first traced probes refit it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autotune.config import MEMORY_DIRECTION, format_bytes
from autotune.errors import AutotuneError
from autotune.hardware import gpu_capacity_bytes
from autotune.memory.calibration import Calibration, fit_calibration
from autotune.memory.model import PHASE_KNOBS, MemoryEstimate, estimate_memory, model_shape
from autotune.sweep.traced import TRACE_FROM, TRACE_MARGIN, SubprocessTracer

OFFLOAD_KNOBS = ("offload_params", "offload_optimizer")
MIN_CALIBRATION_PROBES = 6
PRESCREEN_MARGIN = 0.25


@dataclass(frozen=True)
class KnownOOM:
    """A measured OOM that later configs are compared with."""

    trial_number: int
    params: dict[str, Any]
    status: str  # gpu_oom | host_oom
    failed_phase: str | None


def _ordered(value: Any) -> float:
    return -1.0 if value is None else float(value)


def at_least_as_demanding(candidate: dict[str, Any], known: dict[str, Any],
                          host: bool = False, phase: str | None = None,
                          directions: dict[str, int] | None = None) -> bool:
    """Whether `candidate` needs at least the memory `known` needed, on every axis.

    Device memory (host=False) follows MEMORY_DIRECTION; host memory (host=True) flips the
    offload axes. Knobs without a monotone effect must be equal. Both configs must share the
    same knob names (those of one search space; fixed knobs are equal by construction).
    With `phase` (where `known` ran out of device memory), only the knobs that move that
    phase's peak (memory.PHASE_KNOBS) are compared: the candidate reaches that phase and
    needs at least as much there. `directions` adds the directions a search space declares
    for a trainer's own keys.
    """
    directions = directions or MEMORY_DIRECTION
    for name, known_value in known.items():
        if phase in PHASE_KNOBS and name not in PHASE_KNOBS[phase]:
            continue
        value = candidate[name]
        direction = directions.get(name, 0)
        if host and name in OFFLOAD_KNOBS:
            direction = -direction
        if direction > 0 and _ordered(value) < _ordered(known_value):
            return False
        if direction < 0 and _ordered(value) > _ordered(known_value):
            return False
        if direction == 0 and value != known_value:
            return False
    return True


@dataclass(frozen=True)
class Prediction:
    """Why a config is known to run out of memory without running it."""

    status: str  # gpu_oom | host_oom
    reason: str
    failed_phase: str | None
    source: str  # dominance | estimate | trace


def engine_capacity_bytes(request: Any, device_bytes: int | None) -> int:
    """What a vllm-like engine takes its share of, as the probe sees it: the device limit,
    else the device; 0 when neither is known (no reservation counted, nothing pruned on one)."""
    if not device_bytes:
        return request.gpu_memory_limit_bytes or 0
    return request.device_limit_bytes(device_bytes) or device_bytes


def estimate_args(request: Any) -> dict[str, Any]:
    """The memory model's arguments for a request's probes: one GPU's share of the batches,
    model states FSDP-sharded over the run's W ranks, the compute dtype's width."""
    on_gpu = request.device != "cpu"
    return {"num_gpus": request.world_size, "state_shards": request.world_size,
            "on_gpu": on_gpu,
            "compute_bytes": {"bf16": 2, "fp32": 4}.get(request.dtype) or (2 if on_gpu else 4)}


class Feasibility:
    """What the sweep knows about where the memory wall is: measured OOMs, and the memory
    model calibrated on measured peaks."""

    def __init__(self, dominance: bool = True,
                 estimator: Callable[[dict[str, Any]], MemoryEstimate] | None = None,
                 prescreen: bool = True, margin: float = PRESCREEN_MARGIN) -> None:
        self.dominance, self.estimator, self.margin = dominance, estimator, margin
        self.prescreen = prescreen  # off: the estimator still calibrates, never skips
        self.estimate_args: dict[str, Any] = {}
        self.known: list[KnownOOM] = []
        self.samples: list[tuple[MemoryEstimate, dict[str, int]]] = []
        self.calibration: Calibration | None = None
        self.capacity_bytes: int | None = None
        self.directions: dict[str, int] | None = None  # the space's, trainer keys included
        self.tracer: SubprocessTracer | None = None  # traced.py, when the step can be traced

    @classmethod
    def for_request(cls, request: Any, config_for: Callable[[dict[str, Any]], Any],
                    dominance: bool = True, prescreen: bool = True) -> Feasibility:
        """With the memory model of the request's model, unless it cannot read its config."""
        try:
            shape = model_shape(request.model, request.model_path)
        except AutotuneError:
            return cls(dominance, None, prescreen)
        on_gpu = request.device != "cpu"
        args = estimate_args(request)
        here = gpu_capacity_bytes() if on_gpu else None  # until a probe reports its device

        def estimate(params: dict[str, Any]) -> MemoryEstimate:
            return estimate_memory(shape, config_for(params), **args,
                                   engine_capacity_bytes=engine_capacity_bytes(
                                       request, feasibility.capacity_bytes or here))

        feasibility = cls(dominance, estimate, prescreen)
        feasibility.estimate_args = args
        # known before any probe: the cap in force, else this machine's GPU (a probe's own
        # report replaces it)
        feasibility.capacity_bytes = (request.device_limit_bytes(here) or here) if here \
            else request.gpu_memory_limit_bytes
        return feasibility

    def calibration_record(self, device_name: str | None) -> dict[str, Any]:
        """The calibration as stored with the study (and read by `autotune estimate --study`)."""
        calibration = self.calibration
        assert calibration is not None
        trace = self.tracer.summary() if self.tracer is not None else None
        return {"device": device_name, "probes": calibration.samples, **self.estimate_args,
                "phases": calibration.as_dict(),
                "trace": trace}  # with the traces' fixed term, once fitted

    def record(self, trial_number: int, params: dict[str, Any], status: str,
               failed_phase: str | None = None, phase_peak_mem_bytes: dict[str, int] | None
               = None, capacity_bytes: int | None = None) -> None:
        """Learn from a measured probe: OOMs for dominance, full peaks for calibration."""
        self.capacity_bytes = capacity_bytes or self.capacity_bytes
        if status in ("gpu_oom", "host_oom") and params:
            self.known.append(KnownOOM(trial_number, dict(params), status, failed_phase))
        if status == "ok" and phase_peak_mem_bytes and self.estimator is not None:
            self.samples.append((self.estimator(params), dict(phase_peak_mem_bytes)))
            self.calibration = fit_calibration(self.samples)
        if status == "ok" and phase_peak_mem_bytes and self.tracer is not None:
            self.tracer.learn(params, phase_peak_mem_bytes)

    def _traced(self, params: dict[str, Any], estimate: MemoryEstimate,
                capacity: int) -> Prediction | None:
        """The traced pre-screen: trace a candidate near the wall; skip it past the margin."""
        if self.tracer is None:
            return None
        modelled = self.calibration.peak_bytes(estimate) if self.calibration \
            else estimate.peak_bytes
        if modelled < TRACE_FROM * capacity:
            return None
        traced = self.tracer.traced_bytes(params, capacity)
        if traced is None:
            return None
        phase = max(traced, key=lambda name: traced[name])
        if traced[phase] <= capacity * (1 + TRACE_MARGIN):
            return None
        return Prediction("gpu_oom", f"predicted gpu_oom: the traced step needs "
                          f"{format_bytes(traced[phase])} in {phase}, more than "
                          f"{1 + TRACE_MARGIN:.2f} x the {format_bytes(capacity)} the device "
                          "has", phase, "trace")

    def predicted_oom(self, params: dict[str, Any]) -> KnownOOM | None:
        """The measured OOM that proves `params` cannot fit, or None."""
        for known in self.known:
            host = known.status == "host_oom"  # host RSS is the whole process: every axis
            phase = None if host else known.failed_phase
            if at_least_as_demanding(params, known.params, host=host, phase=phase,
                                     directions=self.directions):
                return known
        return None

    def predict(self, params: dict[str, Any], measure: bool = False) -> Prediction | None:
        """Why `params` must run out of memory, or None when it may fit. `measure`: the config
        is to be measured unless proven (a measured OOM, model states past the device): the
        safe config, whose OOM ends the sweep, is never skipped on a trace or a fit."""
        known = self.predicted_oom(params) if self.dominance else None
        if known is not None:
            return Prediction(known.status, reason_for(known), known.failed_phase, "dominance")
        capacity = self.capacity_bytes
        if not self.prescreen or self.estimator is None or capacity is None:
            return None
        estimate = self.estimator(params)
        states = {name: p.states_bytes for name, p in estimate.phases.items()}
        phase = max(states, key=lambda name: states[name])
        if states[phase] > capacity:
            return Prediction("gpu_oom", f"predicted gpu_oom: model states alone need "
                              f"{format_bytes(states[phase])} in {phase}, more than the "
                              f"{format_bytes(capacity)} the device has", phase, "estimate")
        if measure:
            return None
        traced = self._traced(params, estimate, capacity)
        if traced is not None:
            return traced
        if self.calibration is None or len(self.samples) < MIN_CALIBRATION_PROBES:
            return None
        calibrated = self.calibration.phase_bytes(estimate)
        phase = max(calibrated, key=lambda name: calibrated[name])
        if calibrated[phase] > capacity * (1 + self.margin):
            return Prediction("gpu_oom", f"predicted gpu_oom: the calibrated memory model "
                              f"puts {phase} at {format_bytes(calibrated[phase])}, more than "
                              f"{1 + self.margin:.2f} x the {format_bytes(capacity)} the device "
                              f"has", phase, "estimate")
        return None


def reason_for(known: KnownOOM) -> str:
    what = "device" if known.status == "gpu_oom" else "host"
    where = f" in {known.failed_phase}" if known.failed_phase else ""
    return (f"predicted {known.status}: needs at least the {what} memory of trial "
            f"{known.trial_number} ({known.status}{where})")
