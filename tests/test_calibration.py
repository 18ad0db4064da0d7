"""Calibration: the memory model's free constants fitted to measured peaks, per phase."""

from __future__ import annotations

import pytest

from autotune.config import ProbeConfig
from autotune.memory.calibration import Calibration, PhaseFit, fit_calibration, fit_phase
from autotune.memory.model import estimate_memory
from autotune.memory.shape import model_shape

MiB = 2**20
TINY = model_shape("tiny-qwen2.5")


def synthetic(config: ProbeConfig, context: int, scale: float) -> tuple:
    """A 'measurement' that follows the model with known constants."""
    est = estimate_memory(TINY, config, on_gpu=False)
    measured = {name: p.states_bytes + context + int(scale * p.transient_bytes)
                for name, p in est.phases.items()}
    return est, measured


def test_fit_recovers_known_constants_and_predicts_unseen_configs():
    configs = [ProbeConfig(micro_batch_size_update=m, micro_batch_size_experience=2 * m)
               for m in (1, 2, 4)]
    cal = fit_calibration([synthetic(c, 300 * MiB, 0.6) for c in configs])
    for phase in ("experience", "update"):  # the phases these configs move
        fit = cal.phases[phase]
        assert abs(fit.context_bytes - 300 * MiB) < 64 and fit.transient_scale == 0.6
    # the rollout never moved: the prior's scale is kept, the context absorbs the rest
    assert cal.phases["rollout"].transient_scale == 1.0
    unseen = ProbeConfig(micro_batch_size_update=8, micro_batch_size_experience=16,
                         gradient_checkpointing=True)
    est, measured = synthetic(unseen, 300 * MiB, 0.6)
    for phase, value in cal.phase_bytes(est).items():
        assert abs(value - measured[phase]) <= 64
    assert cal.samples == 3


def test_one_probe_fits_the_context_only_and_keeps_the_prior_scale():
    est, measured = synthetic(ProbeConfig(), 123 * MiB, 0.5)
    cal = fit_calibration([(est, measured)])
    update = cal.phases["update"]
    assert update.transient_scale == 1.0  # nothing to fit a slope on
    assert cal.phase_bytes(est)["update"] == measured["update"]  # exact at the sample


def test_scale_is_clamped_and_nothing_measured_gives_none():
    fit = fit_phase([(100, 0), (200, 10_000)])  # slope 100: noise, not physics
    assert fit.transient_scale == 4.0
    assert fit_calibration([]) is None


def test_round_trip_and_fallback_for_an_unmeasured_phase():
    cal = Calibration({"update": PhaseFit(200 * MiB, 0.8, 4),
                       "rollout": PhaseFit(100 * MiB, 1.2, 4)})
    assert Calibration.from_dict(cal.as_dict()) == cal
    est = estimate_memory(TINY, ProbeConfig(val_batch_size=2), on_gpu=False)
    validation = est.phases["validation"]
    assert cal.phase_bytes(est)["validation"] == (validation.states_bytes + 150 * MiB
                                                  + validation.transient_bytes)
    with pytest.raises(ValueError):
        Calibration({}).fallback()
