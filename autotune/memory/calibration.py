"""Calibration: fit the memory model's free constants to what probes measured, per phase.

memory.py splits each phase's peak into exact model states, a transient prior that grows with
the batch, and a fixed context. The states are exact (16 bytes per parameter and friends); the
other two depend on the device, the allocator and library versions. So for each phase

    measured - states = context + scale x transient

is fitted by least squares over the successful probes of one model on one device (a study
holds exactly one of each). With one probe, or probes whose transient parts hardly differ,
only the context is fitted and the prior's scale of 1 is kept. The fit is pure arithmetic and
is stored with the study as a small dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autotune.files import JsonObject, JsonValue
from autotune.memory.model import MemoryEstimate
from autotune.memory.phases import PhaseEstimate

MIN_SCALE, MAX_SCALE = 0.25, 4.0  # a fitted scale outside this is noise, not physics
MIN_SPREAD = 0.05  # transient parts must differ by 5% of their mean to fit a scale


@dataclass(frozen=True)
class PhaseFit:
    context_bytes: int
    transient_scale: float
    samples: int

    def as_dict(self) -> JsonObject:
        return {"context_bytes": self.context_bytes, "transient_scale": self.transient_scale,
                "samples": self.samples}

    @classmethod
    def from_dict(cls, data: JsonValue) -> PhaseFit:
        """From as_dict's form, read back from a study's stored attributes."""
        if not isinstance(data, Mapping):
            raise TypeError(f"a phase's calibration is a mapping, not {data!r}")
        return cls(int(_number(data["context_bytes"])), float(_number(data["transient_scale"])),
                   int(_number(data["samples"])))


def _number(value: JsonValue) -> int | float | str:
    """A stored number as int() and float() read it."""
    if isinstance(value, (int, float, str)):
        return value
    raise TypeError(f"a calibration's figure is a number, not {value!r}")


@dataclass(frozen=True)
class Calibration:
    """Fitted constants per phase; phases never measured borrow the fitted mean context."""

    phases: dict[str, PhaseFit]

    @property
    def samples(self) -> int:
        return max((fit.samples for fit in self.phases.values()), default=0)

    def split(self, name: str, phase: PhaseEstimate) -> tuple[int, int]:
        """Phase `name`'s calibrated transient and context bytes (a phase never measured
        borrows the fallback)."""
        fit = self.phases.get(name) or self.fallback()
        return int(fit.transient_scale * phase.transient_bytes), fit.context_bytes

    def phase_bytes(self, estimate: MemoryEstimate) -> dict[str, int]:
        """Each phase's calibrated peak."""
        return {name: phase.states_bytes + sum(self.split(name, phase))
                for name, phase in estimate.phases.items()}

    def peak_bytes(self, estimate: MemoryEstimate) -> int:
        return max(self.phase_bytes(estimate).values())

    def fallback(self) -> PhaseFit:
        if not self.phases:
            raise ValueError("an empty calibration has nothing to fall back on")
        contexts = [fit.context_bytes for fit in self.phases.values()]
        return PhaseFit(sum(contexts) // len(contexts), 1.0, 0)

    def as_dict(self) -> JsonObject:
        return {name: fit.as_dict() for name, fit in self.phases.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, JsonValue]) -> Calibration:
        """From as_dict's form (a phase's fit by name), as a study stores it."""
        return cls({name: PhaseFit.from_dict(fit) for name, fit in data.items()})


def fit_phase(points: list[tuple[int, int]]) -> PhaseFit:
    """Fit (transient prior, measured - states) points to context + scale x transient."""
    n = len(points)
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    spread = max(xs) - min(xs)
    scale = 1.0
    if n >= 2 and mean_x > 0 and spread >= MIN_SPREAD * mean_x:
        sxx = sum((x - mean_x) ** 2 for x in xs)
        sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
        scale = min(MAX_SCALE, max(MIN_SCALE, sxy / sxx))
    context = mean_y - scale * mean_x
    return PhaseFit(int(round(context)), round(scale, 4), n)


def fit_calibration(samples: list[tuple[MemoryEstimate, dict[str, int]]]) -> Calibration | None:
    """Fit every phase that some probe measured; None when no probe measured anything."""
    points: dict[str, list[tuple[int, int]]] = {}
    for estimate, measured in samples:
        for name, peak_bytes in measured.items():
            phase = estimate.phases.get(name)
            if phase is not None and peak_bytes:
                points.setdefault(name, []).append(
                    (phase.transient_bytes, int(peak_bytes) - phase.states_bytes))
    if not points:
        return None
    return Calibration({name: fit_phase(pts) for name, pts in points.items()})
