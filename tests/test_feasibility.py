"""Dominance over measured OOMs: which configs must run out of memory without running."""

from __future__ import annotations

from autotune.feasibility import Feasibility, at_least_as_demanding, reason_for

BASE = {"micro_batch_size_update": 4, "micro_batch_size_experience": 8,
        "gradient_checkpointing": False, "offload_params": False, "offload_optimizer": True,
        "global_batch_size": 4}


def with_(**changes):
    return {**BASE, **changes}


def test_device_dominance_follows_memory_direction():
    assert at_least_as_demanding(BASE, BASE)
    assert at_least_as_demanding(with_(micro_batch_size_update=8), BASE)
    assert at_least_as_demanding(with_(offload_optimizer=False), BASE)  # less offload: more
    assert not at_least_as_demanding(with_(gradient_checkpointing=True), BASE)
    assert not at_least_as_demanding(with_(micro_batch_size_experience=4,
                                           micro_batch_size_update=16), BASE)
    assert not at_least_as_demanding(with_(global_batch_size=8), BASE)  # no monotone effect


def test_host_dominance_flips_the_offload_axes():
    assert at_least_as_demanding(with_(offload_params=True), BASE, host=True)
    assert not at_least_as_demanding(with_(offload_optimizer=False), BASE, host=True)
    assert at_least_as_demanding(with_(offload_params=True, micro_batch_size_update=8), BASE,
                                 host=True)


def test_only_gpu_and_host_oom_are_learned():
    feasibility = Feasibility()
    feasibility.record(3, BASE, "cache_oom")  # two-sided in the engine's share: never used
    feasibility.record(4, BASE, "crash")
    assert feasibility.predicted_oom(with_(micro_batch_size_update=8)) is None
    feasibility.record(5, BASE, "gpu_oom", "update")
    known = feasibility.predicted_oom(with_(micro_batch_size_update=8))
    assert known is not None and known.trial_number == 5
    assert reason_for(known) == ("predicted gpu_oom: needs at least the device memory of "
                                 "trial 5 (gpu_oom in update)")
    assert feasibility.predicted_oom(with_(micro_batch_size_update=2)) is None


def test_host_oom_predicts_more_offload_not_less():
    feasibility = Feasibility()
    feasibility.record(1, BASE, "host_oom")
    assert feasibility.predicted_oom(with_(offload_params=True)) is not None
    assert feasibility.predicted_oom(with_(offload_optimizer=False)) is None
