"""The length headroom of a study's configs, by its calibrated memory model.

A probe runs every response at `max_response_length`; how much longer responses may grow
before the config runs out of memory comes from the memory model the sweep calibrated on its
own probes (memory/length.py bisects it), anchored on what the probe of the config itself
measured where there is one: each phase's modelled peak plus the gap, at the probed length,
between the probe's measurement and the model. Read by best.yaml, `show`, the report and the
exports' header.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autotune.config import ProbeConfig
from autotune.errors import AutotuneError
from autotune.files import JsonObject
from autotune.memory.calibration import Calibration
from autotune.memory.length import LengthHeadroom, at_length, length_headroom
from autotune.memory.model import ModelArgs, allocator_reserve, estimate_memory
from autotune.memory.shape import ModelShape, model_shape
from autotune.probe.measure.result import ProbeRequest
from autotune.sweep.feasibility.prescreen import memory_model_args

if TYPE_CHECKING:
    from optuna import Study


@dataclass(frozen=True)
class StudyModel:
    """A study's memory model: its model's shape, the probes' arguments, its calibration."""

    shape: ModelShape
    args: ModelArgs
    calibration: Calibration | None
    source: str  # for people: what the estimate stands on

    @classmethod
    def of(cls, attrs: JsonObject, device_capacity_bytes: int | None) -> StudyModel | None:
        """From a study's stored request and calibration; None when its model cannot be read
        (a trainer's checkpoint the model does not know) or its request is another version's."""
        try:
            request = ProbeRequest.from_json(json.dumps(attrs.get("request") or {}))
            shape = model_shape(request.model, request.model_path)
        except (TypeError, KeyError, ValueError, AutotuneError):
            return None
        if device_capacity_bytes:
            request = dataclasses.replace(
                request, device=request.device.with_capacity(device_capacity_bytes))
        stored = attrs.get("memory_calibration")
        stored = stored if isinstance(stored, dict) else {}
        phases = stored.get("phases")
        calibration = Calibration.from_dict(phases) if isinstance(phases, dict) and phases \
            else None
        source = (f"memory model calibrated on {stored.get('probes')} probes"
                  if calibration else "memory model, prior constants")
        return cls(shape, memory_model_args(request), calibration, source)

    def phase_peaks(self, config: ProbeConfig) -> dict[str, int]:
        estimate = estimate_memory(self.shape, config, **self.args)
        if self.calibration is not None:
            return self.calibration.phase_bytes(estimate)
        return {name: phase.total_bytes for name, phase in estimate.phases.items()}

    def anchored(self, config: ProbeConfig, measured: dict[str, int] | None
                 ) -> Callable[[ProbeConfig], dict[str, int]]:
        """Peaks at other lengths: the model's, moved by the probe's own error at its length."""
        held: ModelArgs = {**self.args,
                           "reserve_bytes": allocator_reserve(self.shape, config, **self.args)}
        model = dataclasses.replace(self, args=held)  # the allocator's reserve held
        if not measured:
            return model.phase_peaks
        here = model.phase_peaks(config)
        gap = {phase: measured[phase] - here[phase] for phase in here if phase in measured}

        def peaks(other: ProbeConfig) -> dict[str, int]:
            return {phase: value + gap.get(phase, 0)
                    for phase, value in model.phase_peaks(other).items()}
        return peaks

    def headroom(self, config: ProbeConfig, budget_bytes: int,
                 measured: dict[str, int] | None = None) -> LengthHeadroom:
        return length_headroom(config, self.anchored(config, measured), budget_bytes,
                               self.shape.context_tokens, self.args["num_gpus"])

    def curve(self, config: ProbeConfig, lengths: list[int],
              measured: dict[str, int] | None = None) -> list[int]:
        """The peak (the largest phase) at each response length."""
        peaks = self.anchored(config, measured)
        return [max(peaks(at_length(config, tokens)).values()) for tokens in lengths]


def study_model(study: Study) -> StudyModel | None:
    """The memory model of an Optuna study's probes (the device as its probes reported it)."""
    capacity = next((t.user_attrs["result"].get("device_capacity_bytes")
                     for t in study.get_trials(deepcopy=False)
                     if (t.user_attrs.get("result") or {}).get("device_capacity_bytes")), None)
    return StudyModel.of(study.user_attrs, capacity)
