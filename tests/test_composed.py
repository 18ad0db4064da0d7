"""The composed proposal (sweep/pick/composed.py): an untried config made of phases other
probes ran, queued when it beats the best probed one. Pure arithmetic on made-up probes; the
real sweep queues it in the neighbour's slot (test_tuner.py)."""

from __future__ import annotations

import pytest

from autotune.sweep.pick.composed import Composer, best_composed
from autotune.sweep.pick.pooled import ProbeTimes
from autotune.sweep.space.params import params_key

GiB = 1 << 30
BASE = {"micro_batch_size_update": 2, "gradient_checkpointing": True,
        "gpu_memory_utilization": 0.5, "rollout_engine": "vllm-like"}


def probe(rollout_s, update_s, rollout_gib, update_gib, tokens=1200.0, contended=False,
          **knobs):
    config = {**BASE, **knobs}
    return ProbeTimes(config=params_key(config), knobs=config,
                      phase_s={"rollout": rollout_s, "update": update_s},
                      step_s=rollout_s + update_s, relative_se=0.0, tokens_per_step=tokens,
                      contended=contended,
                      phase_peak_bytes={"rollout": rollout_gib * GiB,
                                        "update": update_gib * GiB})


# a fast rollout at the larger engine share, a fast update at the larger micro-batch: each
# probed beside the other phase's slow setting, never together
A = probe(10.0, 30.0, 40, 30)
B = probe(5.0, 30.0, 60, 30, gpu_memory_utilization=0.8)
C = probe(10.0, 10.0, 40, 50, micro_batch_size_update=8)
BOTH = {**BASE, "gpu_memory_utilization": 0.8, "micro_batch_size_update": 8}


def test_an_untried_config_is_composed_from_the_probes_that_ran_its_phases():
    composed = Composer([A, B, C], "throughput").compose(BOTH, {})
    assert composed is not None
    assert composed.tokens_per_s == pytest.approx(1200.0 / (5.0 + 10.0))  # B's rollout, C's
    assert composed.peak_mem_bytes == 60 * GiB  # B's rollout holds the most (update)
    per_gib = Composer([A, B, C], "throughput_per_memory").compose(BOTH, {})
    assert per_gib is not None and per_gib.score == pytest.approx(1200.0 / 15.0 / 60)


def test_a_phase_no_probe_ran_composes_nothing():
    assert Composer([A, B], "throughput").compose(BOTH, {}) is None  # no update at mbu 8
    # checkpointing off: the update's work and its memory are another phase's key
    assert Composer([A, B, C], "throughput").compose(
        {**BOTH, "gradient_checkpointing": False}, {}) is None


def test_an_engine_that_does_not_sleep_keeps_its_share_in_the_updates_memory():
    """The update's memory key holds the engine's share only where the engine stays awake
    through it (memory.phases.phase_knobs): awake, C's update at 0.5 is not BOTH's at 0.8."""
    awake = {"enable_sleep": False}
    probes = [probe(10.0, 30.0, 40, 30, **awake), probe(5.0, 30.0, 60, 30, **awake,
                                                        gpu_memory_utilization=0.8),
              probe(10.0, 10.0, 40, 50, **awake, micro_batch_size_update=8)]
    assert Composer(probes, "throughput").compose({**BOTH, **awake}, {}) is None


def test_the_best_composition_must_beat_the_best_probe_and_fit_the_budget():
    untried = [BOTH, {**BASE, "micro_batch_size_update": 8, "gradient_checkpointing": False}]
    best = best_composed([A, B, C], untried, {}, "throughput", 64 * GiB, beat=1200.0 / 20.0)
    assert best is not None and best.params == BOTH
    assert best_composed([A, B, C], untried, {}, "throughput", 55 * GiB, None) is None
    assert best_composed([A, B, C], untried, {}, "throughput", None, beat=100.0) is None
    # contended probes stand only where no quiet one ran the phase
    slow = probe(50.0, 30.0, 60, 30, contended=True, gpu_memory_utilization=0.8)
    again = best_composed([A, B, slow, C], untried, {}, "throughput", None, None)
    assert again is not None and again.tokens_per_s == pytest.approx(1200.0 / 15.0)


class PhaseRunner:
    """A device whose phase times are set by each phase's own knobs (the experience by its
    micro-batch, the update by its micro-batch and checkpointing, offload slowing every phase)
    and whose memory is the memory model's: the composition is then exact, so a composed
    config's own probe measures what the composer said."""

    def __init__(self) -> None:
        from scripted_runner import ModelRunner

        self.memory = ModelRunner(limit_bytes=1 << 40)
        self.calls: list[dict] = []

    def run(self, request, log_path=None):
        from autotune.probe.measure.result import ProbeResult, ProbeStatus

        config = request.config
        self.calls.append(config.as_dict())
        slow = 2.0 if config.offload_params else 1.0
        phase_s = {"rollout": 3.0 * slow,
                   "experience": (1.0 + 8.0 / config.micro_batch_size_experience) * slow,
                   "update": (1.0 + 8.0 / config.micro_batch_size_update
                              + (2.0 if config.gradient_checkpointing else 0.0)) * slow}
        step_s = sum(phase_s.values())
        peaks = self.memory.phase_bytes(config)
        return ProbeResult(status=ProbeStatus.OK, tokens_per_s=1000.0 / step_s,
                           samples_per_s=1.0, step_s=step_s, phase_s=phase_s,
                           peak_mem_bytes=max(peaks.values()), phase_peak_mem_bytes=peaks,
                           device_name="model", device_capacity_bytes=1 << 40,
                           probe_wall_s=step_s)

    def stop(self) -> None:
        """Nothing runs outside this call."""

    def close(self) -> None:
        """Nothing to release."""


def test_a_real_sweep_probes_the_composition_of_its_probes_phases(tmp_path):
    """A TPE sweep over cpu-demo queues composed configs in the neighbour's slot: each one
    untried when queued, every phase of it run by an earlier probe, and its own probe
    measuring the step the composition predicted (the runner's phases are exact)."""
    import optuna

    from autotune.hardware import Device
    from autotune.probe.measure.result import ProbeRequest
    from autotune.sweep.pick.pooled import phase_key, probe_times
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.study.settings import SweepSettings
    from autotune.sweep.tuner import Sweep

    settings = SweepSettings(study_name="s", study_dir=tmp_path / "s",
                             space=load_search_space("cpu-demo"),
                             request=ProbeRequest(model="tiny-qwen2.5", device=Device("cpu")),
                             max_trials=24, seed=3, objective="throughput", finalists=0,
                             trace=False)
    Sweep(settings, PhaseRunner()).run()
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 's' / 'study.db'}")
    probed = [t for t in study.trials if t.user_attrs.get("probed")]
    composed = [t for t in probed if t.user_attrs.get("origin") == "composed"]
    assert composed, [t.user_attrs.get("origin") for t in probed]
    fixed = dict(study.user_attrs["search_space"]["fixed"])
    for trial in composed:
        earlier = [probe_times(t, fixed) for t in probed if t.number < trial.number]
        mine = probe_times(trial, fixed)
        assert mine is not None and mine.config not in {e.config for e in earlier}
        for phase in mine.phase_s:  # each phase was some earlier probe's, at the same time
            shared = [e for e in earlier
                      if phase_key(phase, e.knobs) == phase_key(phase, mine.knobs)]
            assert shared and shared[0].phase_s[phase] == pytest.approx(mine.phase_s[phase])
        better = max(t.values[0] for t in probed if t.number < trial.number)
        assert trial.values[0] > better  # queued because it beat the best probed config
