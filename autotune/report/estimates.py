"""The memory model beside what the probes measured, for the report.

The model is the sweep's own (memory/model.py with the arguments the pre-screen used), so the
page shows the estimate the sweep pruned with: its prior constants before calibration, and the
calibration the study stored (fitted on these same probes, so "after" is in-sample: it says
how well the model's shape fits this device, not how it predicts a new config).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from autotune.memory.calibration import Calibration
from autotune.memory.model import MemoryEstimate
from autotune.report.view import StudyView, TrialView
from autotune.sweep.feasibility.prescreen import memory_estimator


@dataclasses.dataclass(frozen=True)
class PhaseParts:
    """One phase of one config as the model splits it (calibrated when the study has a
    calibration), and what the probe measured there."""

    states_bytes: int
    transient_bytes: int
    context_bytes: int
    prior_bytes: int  # the uncalibrated estimate
    measured_bytes: int | None

    @property
    def total_bytes(self) -> int:
        return self.states_bytes + self.transient_bytes + self.context_bytes


def estimator(view: StudyView) -> Callable[[TrialView], MemoryEstimate] | None:
    """The model's estimate of a trial's config, or None when the study's model cannot be read
    (a trainer's checkpoint the model does not know) or its request is from another version."""
    request = view.parsed_request
    if request is None:
        return None
    device = request.device.with_capacity(view.device_capacity_bytes)
    model = memory_estimator(dataclasses.replace(request, device=device))
    if model is None:
        return None
    return lambda trial: model(view.config_of(trial))


def calibration_of(view: StudyView) -> Calibration | None:
    phases = view.calibration.get("phases") if view.calibration else None
    if not phases or not isinstance(phases, dict):
        return None
    return Calibration.from_dict(phases)


def phase_parts(view: StudyView, trials: list[TrialView]) -> dict[int, dict[str, PhaseParts]]:
    """Each trial's phases split as the model sees them; {} without a model."""
    estimate = estimator(view)
    if estimate is None:
        return {}
    calibration = calibration_of(view)
    out: dict[int, dict[str, PhaseParts]] = {}
    for trial in trials:
        try:
            phases = estimate(trial).phases
        except (TypeError, ValueError):  # a config this version's model cannot take
            continue
        parts = {}
        for name, phase in phases.items():
            transient, context = phase.transient_bytes, phase.context_bytes
            if calibration is not None:
                transient, context = calibration.split(name, phase)
            parts[name] = PhaseParts(phase.states_bytes, transient, context, phase.total_bytes,
                                     trial.phase_peak_mem_bytes.get(name))
        out[trial.number] = parts
    return out


def median_error(pairs: list[tuple[int, int]]) -> float | None:
    """Median of |estimate - measured| / measured over (estimate, measured) pairs."""
    errors = sorted(abs(est - got) / got for est, got in pairs if got)
    if not errors:
        return None
    middle = len(errors) // 2
    return errors[middle] if len(errors) % 2 else (errors[middle - 1] + errors[middle]) / 2
