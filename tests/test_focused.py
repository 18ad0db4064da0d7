"""A finalist's repeat timed where it decides (sweep/pick/focused.py): only the phases that
separate it from the close finalists, the rest of its step from its config's whole probe. The
rules on made-up knobs and results; a real focused CPU probe; the real sweep's focused repeats
are checked in test_finalists.py."""

from __future__ import annotations

import dataclasses

import pytest

from autotune.config import ProbeConfig
from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest, ProbeResult, ProbeStatus
from autotune.sweep.pick.focused import completed, is_whole, separating_phases
from autotune.sweep.pick.pooled import ProbeTimes, pooled_steps

BASE = {"micro_batch_size_update": 2, "micro_batch_size_experience": 4,
        "gradient_checkpointing": True, "offload_params": False, "gpu_memory_utilization": 0.5}
PHASES = ("rollout", "experience", "update")
MiB = 2**20


def test_a_round_times_the_phases_where_its_finalists_do_not_all_do_the_same_work():
    mbu8 = {**BASE, "micro_batch_size_update": 8}
    mbe8 = {**BASE, "micro_batch_size_experience": 8}
    assert separating_phases([BASE, mbu8], PHASES) == ("update",)
    assert separating_phases([BASE, mbu8, {**mbu8, "gradient_checkpointing": False}],
                             PHASES) == ("update",)
    assert separating_phases([BASE, mbu8, mbe8], PHASES) == ("experience", "update")
    assert separating_phases([BASE, {**BASE, "gpu_memory_utilization": 0.7}],
                             [*PHASES, "validation"]) == ("rollout",)
    # offload moves every phase's transfers: nothing is shared, the repeats are whole
    assert separating_phases([BASE, {**BASE, "offload_params": True}], PHASES) == ()
    assert separating_phases([BASE], PHASES) == ()  # no rival: whole


def whole_result(**changes) -> ProbeResult:
    return ProbeResult(status=ProbeStatus.OK, tokens_per_s=1000.0, samples_per_s=10.0,
                       step_s=10.0, step_se_s=0.1,
                       phase_s={"rollout": 5.0, "experience": 2.0, "update": 3.0},
                       step_times_s=[9.9, 10.1],
                       phase_peak_mem_bytes={"rollout": 300 * MiB, "experience": 400 * MiB,
                                             "update": 500 * MiB},
                       peak_mem_bytes=500 * MiB).replace(**changes)


def test_a_focused_result_is_completed_from_its_configs_whole_probe():
    whole = whole_result()
    focused = ProbeResult(status=ProbeStatus.OK, tokens_per_s=9999.0, step_s=2.0,
                          step_se_s=0.02, phase_s={"update": 2.0}, step_times_s=[1.9, 2.1],
                          phase_peak_mem_bytes={"rollout": 250 * MiB,
                                                "experience": 410 * MiB, "update": 490 * MiB},
                          peak_mem_bytes=490 * MiB, timed_phases=["update"])
    assert is_whole(whole) and not is_whole(focused)
    done = completed(focused, whole)
    assert done.step_s == pytest.approx(9.0)  # its own update, the whole probe's others
    assert done.phase_s == {"rollout": 5.0, "experience": 2.0, "update": 2.0}
    assert done.step_times_s == pytest.approx([8.9, 9.1])
    assert done.tokens_per_s == pytest.approx(10_000.0 / 9.0)  # a step's tokens: the same
    assert done.samples_per_s == pytest.approx(100.0 / 9.0)
    assert done.step_se_s == 0.02 and done.timed_phases == ["update"]
    # its warm-up reached the untimed phases' peaks only as a first step does: the most of
    # both; the timed phase's peak is its own
    assert done.phase_peak_mem_bytes == {"rollout": 300 * MiB, "experience": 410 * MiB,
                                         "update": 490 * MiB}
    assert done.peak_mem_bytes == 490 * MiB
    # a whole result, a failed one, or no whole probe to complete from: unchanged
    assert completed(whole, whole) is whole
    oom = ProbeResult(status=ProbeStatus.GPU_OOM, timed_phases=["update"])
    assert completed(oom, whole) is oom
    assert completed(focused, focused) is focused


def test_a_focused_repeat_counts_only_for_the_phases_it_timed():
    def times(phase_s, config="a", relative_se=0.0):
        knobs = {**BASE, "micro_batch_size_update": 2 if config == "a" else 8}
        return ProbeTimes(config=config, knobs=knobs, phase_s=phase_s, step_s=10.0,
                          relative_se=relative_se, tokens_per_step=1000.0, contended=False)

    a = times({"rollout": 5.0, "experience": 2.0, "update": 3.0})
    b = times({"rollout": 7.0, "experience": 2.0, "update": 1.0}, config="b")
    a_again = times({"update": 4.0})  # a focused repeat of a: the update alone
    pooled = pooled_steps([a, b, a_again])
    assert pooled["a"].step_s == pytest.approx(6.0 + 2.0 + 3.5)
    assert pooled["b"].step_s == pytest.approx(6.0 + 2.0 + 1.0)
    assert pooled["a"].own_probes == 2 and pooled["a"].least_probes == 2


def test_a_stored_focused_repeat_gives_the_pool_its_timed_phases_alone():
    """pooled.probe_times reads a trial's stored result: the completed repeat holds the whole
    probe's untimed seconds, which must not count twice."""
    import optuna

    from autotune.sweep.pick.pooled import probe_times
    from autotune.sweep.study.record import result_attrs

    focused = completed(ProbeResult(status=ProbeStatus.OK, tokens_per_s=1.0, step_s=2.0,
                                    step_se_s=0.2, phase_s={"update": 2.0},
                                    timed_phases=["update"]), whole_result())
    trial = optuna.trial.create_trial(
        params={"micro_batch_size_update": 2},
        distributions={"micro_batch_size_update": optuna.distributions.CategoricalDistribution(
            [2, 8])},
        value=1.0, user_attrs={"probed": True, "result": result_attrs(focused)})
    taken = probe_times(trial)
    assert taken is not None and taken.phase_s == {"update": 2.0}
    assert taken.relative_se == pytest.approx(0.1)  # its error over what it timed
    assert taken.tokens_per_step == pytest.approx(10_000.0)


@pytest.mark.slow
def test_a_focused_cpu_probe_times_its_phases_alone_at_their_peaks():
    """A real probe with timed_phases=(update,): one whole warm-up step (even when asked for
    none), then timed steps of the update alone, each at the update's peak as a whole
    probe's (the rollout and experience before it are not run again)."""
    from autotune.runners.local import SubprocessRunner

    config = ProbeConfig(rollout_batch_size=4, rollout_n=2, global_batch_size=2,
                         micro_batch_size_update=2, micro_batch_size_experience=4,
                         max_prompt_length=32, max_response_length=16)
    request = ProbeRequest(model="tiny-qwen2.5", config=config, device=Device("cpu"),
                           timed_steps=2)
    runner = SubprocessRunner()
    whole = runner.run(request)
    focused = runner.run(dataclasses.replace(request, warmup_steps=0, timed_phases=("update",)))
    assert whole.ok and focused.ok, (whole.message, focused.message)
    assert focused.timed_phases == ["update"] and set(focused.phase_s) == {"update"}
    assert set(focused.units) == {"update"}  # the timed steps' loops: the update's alone
    assert len(focused.step_times_s) >= 2
    assert focused.step_s == pytest.approx(focused.phase_s["update"])
    # every phase ran (the warm-up), the update after a whole step: at its whole peak
    assert set(focused.phase_peak_mem_bytes) == set(whole.phase_peak_mem_bytes)
    assert focused.phase_peak_mem_bytes["update"] == pytest.approx(
        whole.phase_peak_mem_bytes["update"], rel=0.03)
    done = completed(focused, whole)
    assert set(done.phase_s) == set(whole.phase_s)
    assert done.step_s == pytest.approx(whole.step_s - whole.phase_s["update"]
                                        + focused.phase_s["update"])
