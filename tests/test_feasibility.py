"""The feasibility rules: dominance over measured OOMs and the memory model's pre-screen, which
configs must run out of memory without running."""

from __future__ import annotations

from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest
from autotune.sweep.feasibility.dominance import Dominance, at_least_as_demanding
from autotune.sweep.feasibility.prescreen import Prescreen
from autotune.sweep.feasibility.screen import Feasibility
from autotune.sweep.space.search_space import SearchSpace

BASE = {"micro_batch_size_update": 4, "micro_batch_size_experience": 8,
        "gradient_checkpointing": False, "offload_params": False, "offload_optimizer": True,
        "global_batch_size": 4}


def with_(**changes):
    return {**BASE, **changes}


def candidate(params):
    """A trial's candidate in a space that fixes nothing: the config its params make."""
    return SearchSpace({}).candidate(params)


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


def dominance_only() -> Feasibility:
    return Feasibility(Device("cpu"), Dominance())


def test_only_gpu_and_host_oom_are_learned():
    feasibility = dominance_only()
    # cache_oom: two-sided in the engine's share, never used
    feasibility.record(3, candidate(BASE), "cache_oom")
    feasibility.record(4, candidate(BASE), "crash")
    # a trial's own word, not a probe's status
    feasibility.record(5, candidate(BASE), "interrupted")
    assert feasibility.predict(candidate(with_(micro_batch_size_update=8))) is None
    feasibility.record(6, candidate(BASE), "gpu_oom", "update")
    prediction = feasibility.predict(candidate(with_(micro_batch_size_update=8)))
    assert prediction is not None and prediction.source == "dominance"
    assert prediction.reason == ("predicted gpu_oom: needs at least the device memory of "
                                 "trial 6 (gpu_oom in update)")
    assert feasibility.predict(candidate(with_(micro_batch_size_update=2))) is None
    assert Feasibility(Device("cpu")).predict(candidate(with_(micro_batch_size_update=8))) is None


def test_host_oom_predicts_more_offload_not_less():
    feasibility = dominance_only()
    feasibility.record(1, candidate(BASE), "host_oom")
    assert feasibility.predict(candidate(with_(offload_params=True))) is not None
    assert feasibility.predict(candidate(with_(offload_optimizer=False))) is None


def test_an_oom_in_one_phase_ignores_the_knobs_that_do_not_move_that_phase():
    feasibility = dominance_only()
    feasibility.record(2, candidate(BASE), "gpu_oom", "experience")
    # the log-prob forward does not care about the update's micro-batch or checkpointing
    other = with_(micro_batch_size_update=1, gradient_checkpointing=True)
    assert feasibility.predict(candidate(other)) is not None
    # on a GPU it finds the segments the first update's blocks cut held in the caching
    # allocator (memory.carried_knobs), which have no order: only an equal update proves
    on_gpu = Feasibility(Device("cuda", 80 * 10**9), Dominance(on_gpu=True))
    on_gpu.record(2, candidate(BASE), "gpu_oom", "experience")
    for update in ({"micro_batch_size_update": 1, "gradient_checkpointing": True},
                   {"micro_batch_size_update": 8}):
        assert on_gpu.predict(candidate(with_(micro_batch_size_experience=16,
                                              **update))) is None
    assert on_gpu.predict(candidate(with_(micro_batch_size_experience=16))) is not None
    # but the reference waiting on the host (offload_params) is there for its own pass only
    assert feasibility.predict(candidate(with_(offload_params=True))) is None
    assert feasibility.predict(candidate(with_(micro_batch_size_experience=4))) is None
    assert feasibility.predict(candidate(with_(micro_batch_size_experience=16,
                                               offload_optimizer=False))) is not None
    # an OOM in the update says nothing about a smaller update micro-batch
    update = dominance_only()
    update.record(3, candidate(BASE), "gpu_oom", "update")
    assert update.predict(candidate(with_(micro_batch_size_experience=64))) is not None
    assert update.predict(candidate(with_(micro_batch_size_update=2))) is None


def prescreened(model: str, device: Device) -> Feasibility:
    """The estimate pre-screen of `model`'s probes on `device`, alone."""
    request = ProbeRequest(model=model, device=device)
    prescreen = Prescreen.for_request(request)
    return Feasibility(device, prescreen=prescreen)


def test_model_states_alone_past_capacity_are_predicted_before_any_calibration():
    feasibility = prescreened("qwen2.5-7b", Device("cuda", 80 * 10**9))
    prediction = feasibility.predict(candidate({"micro_batch_size_update": 1}))
    assert prediction is not None and prediction.source == "estimate"
    assert "model states alone need" in prediction.reason and prediction.failed_phase == "update"
    assert prescreened("qwen2.5-0.5b", Device("cuda", 80 * 10**9)).predict(candidate(
        {"micro_batch_size_update": 1})) is None
    # the capacity is what a probe may use: a cap on a larger device counts, not the device
    capped = prescreened("qwen2.5-0.5b", Device("cuda", 80 * 10**9, limit_bytes=4 * 10**9))
    assert capped.predict(candidate({"micro_batch_size_update": 1})) is not None


def test_calibrated_prescreen_skips_only_well_past_capacity():
    from autotune.config import ProbeConfig
    from autotune.memory.model import estimate_memory
    from autotune.memory.shape import model_shape
    from autotune.sweep.feasibility.prescreen import MIN_CALIBRATION_PROBES, PRESCREEN_MARGIN

    shape = model_shape("tiny-qwen2.5")

    def measured(params):  # the prior itself, with a 250 MiB context: a perfect model
        estimate = estimate_memory(shape, ProbeConfig(**params), on_gpu=False)
        return {name: p.states_bytes + 250 * 2**20 + p.transient_bytes
                for name, p in estimate.phases.items()}

    capacity = int(1.05 * max(measured({"micro_batch_size_update": 4}).values()))
    feasibility = prescreened("tiny-qwen2.5", Device("cpu", 2**40, limit_bytes=capacity))
    huge = {"micro_batch_size_update": 64, "micro_batch_size_experience": 8,
            "global_batch_size": 16, "rollout_n": 4, "rollout_batch_size": 16}
    for i, micro in enumerate([1, 2, 4, 1, 2, 4, 8][:MIN_CALIBRATION_PROBES]):
        assert feasibility.predict(candidate(huge)) is None  # not trusted before enough probes
        params = {"micro_batch_size_update": micro}
        feasibility.record(i, candidate(params), "ok", None, measured(params), 2**40)
    prediction = feasibility.predict(candidate(huge))
    assert prediction is not None and "calibrated memory model" in prediction.reason
    peak = max(measured(huge).values())
    assert peak > capacity * (1 + PRESCREEN_MARGIN)
    assert feasibility.predict(candidate({"micro_batch_size_update": 2})) is None
    assert feasibility.calibration_record("cpu")["probes"] == MIN_CALIBRATION_PROBES
