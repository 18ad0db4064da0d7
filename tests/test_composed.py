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
