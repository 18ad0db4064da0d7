"""The pooled figure (sweep/pick/pooled.py): a config's step from every probe that ran its
phases. Pure arithmetic on made-up phase times; the real CPU sweep's pooled best is checked in
test_sweep_e2e.py."""

from __future__ import annotations

import math

import pytest

from autotune.sweep.pick.pooled import PHASE_ONLY, ProbeTimes, phase_key, pooled_steps
from autotune.sweep.space.params import params_key

BASE = {"micro_batch_size_update": 2, "micro_batch_size_experience": 4,
        "gradient_checkpointing": True, "offload_params": False, "gpu_memory_utilization": 0.5}


def probe(phase_s, relative_se=0.0, contended=False, tokens=1000.0, **knobs):
    config = {**BASE, **knobs}
    return ProbeTimes(config=params_key(config), knobs=config, phase_s=phase_s,
                      step_s=sum(phase_s.values()), relative_se=relative_se,
                      tokens_per_step=tokens, contended=contended)


def test_a_phase_is_shared_by_configs_that_differ_only_in_another_phases_knobs():
    assert phase_key("rollout", BASE) == phase_key("rollout", {**BASE,
                                                                "micro_batch_size_update": 8})
    assert phase_key("update", BASE) != phase_key("update", {**BASE,
                                                              "micro_batch_size_update": 8})
    assert phase_key("update", BASE) == phase_key("update", {**BASE,
                                                              "gpu_memory_utilization": 0.8})
    # a knob no phase owns alone (offload moves every phase's transfers) keeps them apart
    for phase in PHASE_ONLY:
        assert phase_key(phase, BASE) != phase_key(phase, {**BASE, "offload_params": True})


def test_each_phase_is_the_mean_of_every_probe_that_ran_it():
    a = probe({"rollout": 10.0, "experience": 4.0, "update": 6.0})
    b = probe({"rollout": 12.0, "experience": 5.0, "update": 3.0}, micro_batch_size_update=8)
    c = probe({"rollout": 20.0, "experience": 4.0, "update": 6.0}, offload_params=True)
    pooled = pooled_steps([a, b, c])
    # a and b share the rollout and the experience (the update's micro-batch is the update's)
    assert pooled[a.config].step_s == pytest.approx(11.0 + 4.5 + 6.0)
    assert pooled[b.config].step_s == pytest.approx(11.0 + 4.5 + 3.0)
    assert pooled[a.config].probes == 2 and pooled[a.config].own_probes == 1
    assert pooled[c.config].step_s == pytest.approx(30.0) and pooled[c.config].probes == 1
    assert pooled[a.config].tokens_per_s == pytest.approx(1000.0 / 21.5)
    # the rollout's spread between the two probes: sd 1.414 over sqrt 2 = 1.0 s, the
    # experience's 0.5 s; the update's single probe says nothing of its spread (se 0 here)
    assert pooled[a.config].step_se_s == pytest.approx(math.sqrt(1.0 + 0.25))
    assert pooled[a.config].tokens_per_s_se == pytest.approx(
        1000.0 / 21.5 * math.sqrt(1.25) / 21.5)


def test_a_phase_probed_once_keeps_its_probes_own_error():
    alone = probe({"rollout": 10.0, "update": 10.0}, relative_se=0.05)
    pooled = pooled_steps([alone])[alone.config]
    assert pooled.step_s == pytest.approx(20.0)
    assert pooled.step_se_s == pytest.approx(math.sqrt(0.5 ** 2 + 0.5 ** 2))
    # two probes that agree exactly are never more certain than their own steps say
    again = probe({"rollout": 10.0, "update": 10.0}, relative_se=0.05)
    twice = pooled_steps([alone, again])[alone.config]
    assert twice.step_se_s == pytest.approx(math.sqrt(2 * (0.5 ** 2 + 0.5 ** 2)) / 2)
    assert twice.own_probes == 2


def test_contended_times_count_only_where_no_quiet_probe_ran_the_phase():
    quiet = probe({"rollout": 10.0, "update": 5.0})
    busy = probe({"rollout": 30.0, "update": 9.0}, contended=True, micro_batch_size_update=8)
    pooled = pooled_steps([quiet, busy])
    assert pooled[quiet.config].step_s == pytest.approx(15.0)  # the busy rollout left out
    assert not pooled[quiet.config].contended
    assert pooled[busy.config].step_s == pytest.approx(10.0 + 9.0)  # its update: busy only
    assert pooled[busy.config].contended


def test_a_separate_placements_pooled_step_is_its_pipelines():
    """placement=separate: the engine's rollout and the trainer's phases overlap at staleness
    1 (the slower side and the sync), take turns at 0: pooled as the pipeline runs them, not
    summed."""
    split = {"placement": "separate", "rollout_gpus": 4}
    phases = {"rollout": 30.0, "experience": 8.0, "update": 14.0, "weight_sync": 0.5}
    overlapped = probe(phases, staleness=1, **split)
    turns = probe(phases, staleness=0, **split)
    pooled = pooled_steps([overlapped, turns])
    assert pooled[overlapped.config].step_s == pytest.approx(30.5)
    assert pooled[turns.config].step_s == pytest.approx(52.5)
    assert pooled[overlapped.config].tokens_per_s == pytest.approx(1000.0 / 30.5)


def test_a_probes_knobs_include_the_spaces_fixed_ones():
    """A space that fixes placement=separate searches only the split's other knobs: the pool
    reads the fixed placement too, or a staleness-1 config's step would be summed (the pick
    then preferred configs that take turns, at about half the throughput)."""
    import optuna

    from autotune.sweep.pick.pooled import probe_times

    phases = {"rollout": 30.0, "experience": 8.0, "update": 14.0, "weight_sync": 0.5}
    trial = optuna.trial.create_trial(
        params={"staleness": 1}, value=1.0,
        distributions={"staleness": optuna.distributions.CategoricalDistribution([0, 1])},
        user_attrs={"probed": True, "result": {"status": "ok", "phase_s": phases,
                                               "step_s": 30.5, "tokens_per_s": 100.0}})
    fixed = {"placement": "separate", "rollout_gpus": 4}
    assert pooled_steps([probe_times(trial, fixed)])[params_key({"staleness": 1})].step_s \
        == pytest.approx(30.5)
    assert pooled_steps([probe_times(trial)])[params_key({"staleness": 1})].step_s \
        == pytest.approx(52.5)  # without them: the phases summed


def test_the_staleness_and_the_other_sides_knobs_never_part_a_split_configs_phases():
    """The staleness orders the phases, it times none; with placement=separate the engine's
    rollout is shared by configs that differ in the trainer's offload or kernels, and the
    trained phases by configs that differ in the engine's kind; the weight sync, run by both
    sides, by neither; colocated, offload still parts every phase (its transfers are there)."""
    split = {**BASE, "placement": "separate", "rollout_gpus": 4, "staleness": 1}
    for phase in ("rollout", "experience", "update", "weight_sync"):
        assert phase_key(phase, split) == phase_key(phase, {**split, "staleness": 2})
    offloaded = {**split, "offload_params": True, "fused_logprob": True}
    assert phase_key("rollout", split) == phase_key("rollout", offloaded)
    assert phase_key("update", split) != phase_key("update", offloaded)
    assert phase_key("weight_sync", split) != phase_key("weight_sync", offloaded)
    assert phase_key("update", split) == phase_key("update", {**split, "enable_sleep": False})
    assert phase_key("rollout", split) != phase_key("rollout", {**split, "enable_sleep": False})
    assert phase_key("rollout", split) != phase_key("rollout", {**split, "rollout_gpus": 2})
    colocated = {**BASE, "placement": "colocated"}
    assert phase_key("rollout", colocated) != phase_key("rollout", {**colocated,
                                                                    "offload_params": True})
    a = probe({"rollout": 10.0, "update": 30.0, "weight_sync": 1.0}, **split)
    b = probe({"rollout": 14.0, "update": 20.0, "weight_sync": 1.0}, **offloaded)
    pooled = pooled_steps([a, b])  # staleness 1: the slower side plus the sync
    assert pooled[a.config].step_s == pytest.approx(max(12.0, 30.0) + 1.0)
    assert pooled[b.config].step_s == pytest.approx(max(12.0, 20.0) + 1.0)
