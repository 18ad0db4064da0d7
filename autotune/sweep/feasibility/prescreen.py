"""The arithmetic pre-screen: the memory model of the sweep's model, calibrated on its probes,
skips configs that cannot fit before they run.

Before any probe only the exact part is used: a config whose model states alone exceed the
device's capacity (a 7B actor with AdamW on one 80 GB GPU) cannot fit whatever its
activations. Once MIN_CALIBRATION_PROBES probes have succeeded, the memory model
(memory/model.py), calibrated on them (memory/calibration.py), estimates every candidate; one
whose estimate exceeds the capacity by more than PRESCREEN_MARGIN is a predicted OOM too. The
margin and the wait are set from benchmarks/memory_accuracy.py (docs/benchmarks.md): the
calibrated estimate's worst overstatement out of sample stays below the margin on every
recorded grid, and fitted on fewer probes it was worse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from autotune.config import ProbeConfig, compute_bytes, format_bytes
from autotune.errors import AutotuneError
from autotune.files import JsonObject
from autotune.hardware import Device
from autotune.memory.calibration import Calibration, fit_calibration
from autotune.memory.host import NodeRun, node_host
from autotune.memory.model import MemoryEstimate, ModelArgs, estimate_memory
from autotune.memory.roles import estimate_placement
from autotune.memory.shape import ModelShape, model_shape
from autotune.probe.measure.result import ProbeRequest

MIN_CALIBRATION_PROBES = 6
PRESCREEN_MARGIN = 0.25


@dataclass(frozen=True)
class Prediction:
    """Why a config is known to run out of memory without running it."""

    status: str  # gpu_oom | host_oom
    reason: str
    failed_phase: str | None
    source: str  # dominance | estimate | trace


def memory_model_args(request: ProbeRequest) -> ModelArgs:
    """The memory model's arguments for a request's probes: one GPU's share of the batches,
    model states FSDP-sharded over the run's W ranks, the compute dtype's width, and the memory
    a vllm-like engine reserves its share of (what the probe may use; 0 while unknown)."""
    on_gpu = request.device.on_gpu
    return {"num_gpus": request.world_size, "state_shards": request.world_size,
            "on_gpu": on_gpu, "compute_bytes": compute_bytes(request.dtype, on_gpu),
            "engine_capacity_bytes": request.device.usable_bytes or 0}


def memory_estimator(request: ProbeRequest) -> Callable[[ProbeConfig], MemoryEstimate] | None:
    """The memory model's estimate of a config probed as `request` is, or None when the
    request's model cannot be read (a trainer's checkpoint the model does not know)."""
    try:
        shape = model_shape(request.model, request.model_path)
    except AutotuneError:
        return None
    return lambda config: model_estimate(shape, config, request)


def model_estimate(shape: ModelShape, config: ProbeConfig, request: ProbeRequest
                   ) -> MemoryEstimate:
    """The memory model's estimate of `config` probed as `request` is: colocated, one GPU's
    phases; separate, each phase on its role's GPU (memory/roles.py), as a split probe
    reports them."""
    args = memory_model_args(request)
    if not config.separate:
        return estimate_memory(shape, config, **args)
    return estimate_placement(shape, config, request.world_size, config.rollout_gpus,
                              args["engine_capacity_bytes"], args["on_gpu"],
                              args["compute_bytes"]).by_phase


class Prescreen:
    """The memory model of a sweep's probes, calibrated on them, and what it rules out: each
    asked of a trial's ProbeConfig (the search space's candidate)."""

    def __init__(self, shape: ModelShape, request: ProbeRequest, skip: bool = True,
                 margin: float = PRESCREEN_MARGIN, node_host_bytes: int | None = None,
                 node_trainer: str | None = None) -> None:
        self.shape, self.request = shape, request
        self.skip = skip  # off (--no-prescreen): it still calibrates, never skips
        self.margin = margin
        self.node_host_bytes = node_host_bytes  # the node's RAM (None: no host verdict)
        self.node_run = NodeRun(request.gpus_per_node, request.world_size,
                                request.device.on_gpu,
                                memory_model_args(request)["compute_bytes"], node_trainer)
        self.samples: list[tuple[MemoryEstimate, dict[str, int]]] = []
        self.calibration: Calibration | None = None

    @classmethod
    def for_request(cls, request: ProbeRequest, skip: bool = True,
                    node_host_bytes: int | None = None,
                    node_trainer: str | None = None) -> Prescreen | None:
        """The pre-screen of `request`'s model, or None when its config cannot be read."""
        try:
            shape = model_shape(request.model, request.model_path)
        except AutotuneError:
            return None
        return cls(shape, request, skip, node_host_bytes=node_host_bytes,
                   node_trainer=node_trainer)

    def host_past(self, config: ProbeConfig) -> Prediction | None:
        """The node's host memory (memory/host.py) past where its OOM killer acts: every
        rank on the node with what it holds on the host, from the trainers' own terms."""
        if self.node_host_bytes is None:
            return None
        host = node_host(self.shape, config, self.node_run, self.node_host_bytes)
        if not host.host_oom:
            return None
        return Prediction("host_oom", f"predicted host_oom: the node's host memory reaches "
                          f"{format_bytes(host.peak_bytes)} at {host.binding_phase}, past the "
                          f"{format_bytes(host.kill_bytes)} where {host.killer} acts",
                          None, "estimate")

    def estimate(self, config: ProbeConfig, device: Device) -> MemoryEstimate:
        """The uncalibrated estimate of a trial's config on `device` as the sweep knows it."""
        return model_estimate(self.shape, config, dataclasses.replace(self.request,
                                                                      device=device))

    def record(self, config: ProbeConfig, phase_peak_mem_bytes: dict[str, int],
               device: Device) -> None:
        """A probe of `config` fitted: refit the calibration with its measured peaks."""
        self.samples.append((self.estimate(config, device), dict(phase_peak_mem_bytes)))
        self.calibration = fit_calibration(self.samples)

    def modelled_bytes(self, estimate: MemoryEstimate) -> int:
        """The estimate's peak, calibrated once there is a calibration."""
        return self.calibration.peak_bytes(estimate) if self.calibration else \
            estimate.peak_bytes

    def states_past(self, estimate: MemoryEstimate, capacity_bytes: int) -> Prediction | None:
        """The exact part: model states alone past the capacity in some phase."""
        states = {name: p.states_bytes for name, p in estimate.phases.items()}
        phase = max(states, key=lambda name: states[name])
        if states[phase] <= capacity_bytes:
            return None
        return Prediction("gpu_oom", f"predicted gpu_oom: model states alone need "
                          f"{format_bytes(states[phase])} in {phase}, more than the "
                          f"{format_bytes(capacity_bytes)} the device has", phase, "estimate")

    def calibrated_past(self, estimate: MemoryEstimate,
                        capacity_bytes: int) -> Prediction | None:
        """The calibrated estimate past the capacity by more than the margin (only once
        MIN_CALIBRATION_PROBES probes have fitted it)."""
        if self.calibration is None or len(self.samples) < MIN_CALIBRATION_PROBES:
            return None
        calibrated = self.calibration.phase_bytes(estimate)
        phase = max(calibrated, key=lambda name: calibrated[name])
        if calibrated[phase] <= capacity_bytes * (1 + self.margin):
            return None
        return Prediction("gpu_oom", f"predicted gpu_oom: the calibrated memory model puts "
                          f"{phase} at {format_bytes(calibrated[phase])}, more than "
                          f"{1 + self.margin:.2f} x the {format_bytes(capacity_bytes)} the "
                          "device has", phase, "estimate")

    def calibration_record(self, device_name: str | None,
                           trace: JsonObject | None) -> JsonObject:
        """The calibration as stored with the study (read by `autotune estimate --study`),
        with what tracing did, once fitted."""
        assert self.calibration is not None
        args = memory_model_args(self.request)
        return {"device": device_name, "probes": self.calibration.samples,
                "num_gpus": args["num_gpus"], "state_shards": args["state_shards"],
                "on_gpu": args["on_gpu"], "compute_bytes": args["compute_bytes"],
                "phases": self.calibration.as_dict(), "trace": trace}
