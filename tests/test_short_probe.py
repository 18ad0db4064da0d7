"""The short probe (probe/measure/unit_loops.py): which units of a loop it runs, the step it
predicts from them, and a real CPU probe's figures beside a full probe's of the same config."""

from __future__ import annotations

import pytest

from autotune.config import ProbeConfig
from autotune.hardware import Device
from autotune.probe.measure import unit_loops
from autotune.probe.measure.result import ProbeRequest, ProbeStatus, SlowFloor
from autotune.probe.measure.unit_loops import (
    UnitClock,
    UnitLoop,
    decode_blocks,
    short_schedule,
    unit_times,
    warmup_schedule,
)


def test_a_short_schedule_runs_the_first_unit_a_middle_one_the_last_and_the_odd_one():
    assert short_schedule(10) == [0, 5, 9]
    assert short_schedule(32) == [0, 16, 31]
    assert short_schedule(10, sample=3) == [0, 3, 6, 9]  # spaced evenly
    assert short_schedule(10, also=(7, 12)) == [0, 5, 7, 9]  # out of range: ignored
    assert short_schedule(4) == [0, 2, 3]
    assert short_schedule(3) == [0, 1, 2]
    assert short_schedule(2) == [0, 1]
    assert short_schedule(1) == [0]
    assert short_schedule(0) == []
    assert short_schedule(10, sample=2, tail=2, middle=False) == [0, 1, 8, 9]  # decode blocks
    assert short_schedule(3, sample=2, tail=2, middle=False) == [0, 1, 2]


@pytest.mark.parametrize("steps", [31, 63, 511, 2047])
def test_decode_blocks_estimate_a_cost_linear_in_the_context_exactly(steps):
    """A wave's decode steps in blocks, of which a short probe runs the first two and the last
    two: with a step's cost linear in the context it attends over (an HF cache's), the
    skipped blocks' estimate from the second and the second-last is their true sum."""
    sizes = decode_blocks(steps)
    assert sum(sizes) == steps and len(sizes) == min(steps, unit_loops.DECODE_BLOCKS)
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def block_s(i: int) -> float:  # 2 ms a step and 1 us a token of context (512 prompt)
        return sum(0.002 + 1e-6 * (512 + step) for step in range(starts[i], starts[i] + sizes[i]))

    ran = short_schedule(len(sizes), sample=unit_loops.DECODE_SAMPLE,
                         tail=unit_loops.DECODE_SAMPLE, middle=False)
    loop = UnitLoop("rollout", "decode", sizes, seconds={i: block_s(i) for i in ran})
    true_s = sum(block_s(i) for i in loop.skipped)
    assert loop.skipped_s() == pytest.approx(true_s, rel=0.002)
    assert unit_loops.decode_share(steps) == pytest.approx(sum(sizes[i] for i in ran) / steps)
    assert unit_loops.decode_share(steps) <= 0.26


def test_a_warmup_schedule_runs_the_first_unit_and_the_odd_one():
    assert warmup_schedule(10) == [0]
    assert warmup_schedule(10, also=(7, 12)) == [0, 7]  # out of range: ignored
    assert warmup_schedule(1) == [0]
    assert warmup_schedule(0) == []


def test_skipped_units_are_their_work_at_the_rate_of_the_units_between_first_and_last():
    loop = UnitLoop("update", "micro_batch", [2.0] * 9 + [1.0],
                    seconds={0: 9.0, 1: 2.0, 2: 2.4, 9: 1.5})  # a slow first, a short last
    assert loop.skipped == [3, 4, 5, 6, 7, 8]
    assert loop.basis() == [1, 2]
    assert loop.rates() == pytest.approx([1.0, 1.2])
    assert loop.skipped_s() == pytest.approx(12 * 1.1)  # 6 units of 2 at 1.1 s a unit of work
    assert loop.skipped_var_s2() == pytest.approx(12 ** 2 * 0.02 / 2)
    whole = UnitLoop("update", "micro_batch", [1.0, 1.0], seconds={0: 1.0, 1: 3.0})
    assert whole.skipped_s() == 0.0 and whole.basis() == [0]  # nothing between: the first


class FakeTime:
    """perf_counter for the clock, moved on by the loops' bodies."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize("outer", [4, 10])
def test_nested_loops_add_what_their_skipped_units_would_have_taken(monkeypatch, outer):
    """Mini-batches of 6 micro-batches of 1 s each and a 0.5 s optimizer step: the short
    clock's estimate, added to what ran, is the whole step's time exactly."""
    fake = FakeTime()
    monkeypatch.setattr(unit_loops, "time", fake)
    clock = UnitClock(short=True)
    ran = []
    for i in clock.iterations("update", "minibatch", [6.0] * outer):
        for j in clock.iterations("update", "micro_batch", [1.0] * 6):
            ran.append((i, j))
            fake.now += 1.0
        fake.now += 0.5
    skipped_s, variance = clock.take_skipped("update")
    assert fake.now + skipped_s == pytest.approx(outer * 6.5)
    assert variance == 0.0  # equal rates: no spread
    assert {j for _, j in ran} == {0, 3, 5}
    assert sorted({i for i, _ in ran}) == short_schedule(outer)
    loops = clock.take_loops()
    assert [loop.unit for loop in loops].count("minibatch") == 1
    times = unit_times([loops])["update"]
    assert times["micro_batch"].count == 6 and times["micro_batch"].ran == 3
    assert times["micro_batch"].loops == len(short_schedule(outer))
    assert times["minibatch"].rate_s == pytest.approx(6.5 / 6)  # per unit of work, skips in
    assert clock.take_loops() == [] and clock.take_skipped("update") == (0.0, 0.0)


def test_a_full_clock_runs_every_unit_and_estimates_nothing():
    clock = UnitClock(short=False)
    assert list(clock.iterations("rollout", "wave", [1.0] * 5)) == [0, 1, 2, 3, 4]
    assert clock.take_skipped("rollout") == (0.0, 0.0) and clock.take_loops() == []


def test_probes_are_short_unless_full_steps_is_asked_and_a_study_keeps_which():
    """`autotune probe` and `run` plan short probes (2 timed steps at least); --full-steps
    plans today's (3 at least); --timed-steps N is exactly N in both (timed_min_s 0); a
    command probe runs the trainer's own steps."""
    from autotune.sweep.plan import ProbeOptions, plan_probe

    short = plan_probe(ProbeOptions(model="tiny-qwen2.5", device="cpu"))
    full = plan_probe(ProbeOptions(model="tiny-qwen2.5", device="cpu", full_steps=True))
    exact = plan_probe(ProbeOptions(model="tiny-qwen2.5", device="cpu", timed_steps=4))
    assert short.short and (short.timed_steps, short.timed_min_s) == (2, 2.0)
    assert not full.short and (full.timed_steps, full.timed_min_s) == (3, 2.0)
    assert exact.short and (exact.timed_steps, exact.timed_min_s) == (4, 0.0)
    from autotune.probe.measure.result import TrainerCommand

    command = TrainerCommand(trainer="verl", argv=("true",), config_text="")
    assert not ProbeRequest(model="tiny-qwen2.5", command=command).short  # the trainer's steps


def test_a_steps_standard_error_is_never_under_the_noise_the_study_measured():
    """One step alone has no spread of its own; with the study's measured step spread (a
    CV) its error is that spread; two steps' error is their own, not under the spread over
    sqrt(2)."""
    assert unit_loops.mean_and_se([10.0]) == (10.0, 0.0)
    assert unit_loops.mean_and_se([10.0], within_var=0.04) == (10.0, pytest.approx(0.2))
    assert unit_loops.mean_and_se([10.0], 0.04, step_cv=0.03) == (10.0, pytest.approx(0.3))
    assert unit_loops.mean_and_se([9.9, 10.1])[1] == pytest.approx(0.1)
    assert unit_loops.mean_and_se([9.9, 10.1], step_cv=0.03)[1] == \
        pytest.approx(0.3 / 2 ** 0.5)


def test_a_short_probe_starts_from_one_timed_step_once_the_study_measured_its_noise():
    """NOISE_PROBES quiet probes' step spreads make the study's noise; after them a short
    probe starts from one timed step carrying that noise (its root mean square). Before them,
    and always for a full probe, a command probe, a split probe (its sides time exactly their
    steps in lockstep) and an exact --timed-steps, the request is left as it is."""
    from autotune.probe.measure.result import TrainerCommand
    from autotune.sweep.tally import NOISE_PROBES, with_step_noise

    short = ProbeRequest(model="tiny-qwen2.5", timed_steps=2, timed_min_s=2.0)
    cvs = [0.03, 0.04, 0.0]
    assert len(cvs) == NOISE_PROBES
    assert with_step_noise(short, cvs[:-1]) == short
    settled = with_step_noise(short, cvs)
    assert settled.timed_steps == 1
    assert settled.step_cv_prior == pytest.approx((0.0025 / 3) ** 0.5)
    command = TrainerCommand(trainer="verl", argv=("true",), config_text="")
    split = ProbeConfig(placement="separate", rollout_gpus=1, rollout_engine="vllm-like")
    for left in (ProbeRequest(model="tiny-qwen2.5", full_steps=True, timed_min_s=2.0),
                 ProbeRequest(model="tiny-qwen2.5", command=command, timed_min_s=2.0),
                 ProbeRequest(model="tiny-qwen2.5", config=split, gpus_per_node=2,
                              timed_steps=2, timed_min_s=2.0),
                 ProbeRequest(model="tiny-qwen2.5", timed_steps=2, timed_min_s=0.0)):
        assert with_step_noise(left, cvs) == left


def test_the_studys_step_noise_leaves_out_a_transient_probe():
    """A probe whose steps read far apart while the rest agree (a machine minutes after its
    start) is left out of the study's noise; the root mean square of the others stands, and
    with fewer than three probes every one counts."""
    from autotune.sweep.tally import step_noise

    assert step_noise([]) is None
    assert step_noise([0.45, 0.03]) == pytest.approx(((0.45 ** 2 + 0.03 ** 2) / 2) ** 0.5)
    assert step_noise([0.45, 0.03, 0.04, 0.02]) == pytest.approx(
        ((0.03 ** 2 + 0.04 ** 2 + 0.02 ** 2) / 3) ** 0.5)
    spread = [0.02, 0.05, 0.01, 0.04]  # no outlier: all of them
    assert step_noise(spread) == pytest.approx((sum(v * v for v in spread) / 4) ** 0.5)


CONFIG = ProbeConfig(rollout_batch_size=8, rollout_n=4, global_batch_size=4,
                     micro_batch_size_update=1, micro_batch_size_experience=2,
                     max_prompt_length=32, max_response_length=32, rollout_engine="hf",
                     max_num_seqs=4)
SMALL = ProbeConfig(rollout_batch_size=4, rollout_n=2, global_batch_size=2,
                    micro_batch_size_update=2, micro_batch_size_experience=4,
                    max_prompt_length=32, max_response_length=16, rollout_engine="hf")


@pytest.mark.slow
def test_a_short_cpu_probe_samples_units_and_holds_a_full_probes_peaks():
    """A short probe runs some of each loop's units and predicts the rest; its phase peaks
    are a full probe's (the units it skips hold what the ones it runs hold). Its time is held
    to full steps by benchmarks/short_probe.py, not here."""
    from autotune.runners.local import SubprocessRunner

    runner = SubprocessRunner()

    def probe(full: bool, stop_below: SlowFloor | None = None):
        result = runner.run(ProbeRequest(model="tiny-qwen2.5", config=CONFIG,
                                         device=Device("cpu"), timed_steps=2, full_steps=full,
                                         stop_below=stop_below))
        assert result.status.reached_peaks, result.message
        return result

    short, full = probe(False), probe(True)
    assert short.probe_mode == "short" and full.probe_mode == "full" and full.units == {}
    micro = short.units["update"]["micro_batch"]
    assert micro["count"] == 16 and micro["ran"] == 3  # 16 responses a mini-batch, 1 each
    assert short.units["rollout"]["wave"]["count"] == 8  # 32 responses, 4 at a time
    assert short.units["rollout"]["wave"]["ran"] == 3
    assert short.step_se_s is not None and short.step_se_s > 0
    assert short.timed_wall_s < sum(short.step_times_s)  # it ran less than it predicts
    for phase, peak in full.phase_peak_mem_bytes.items():
        assert short.phase_peak_mem_bytes[phase] == pytest.approx(peak, rel=0.03), phase
    # a floor no probe can reach: it stops at its first chance, every phase at its peak (the
    # second step's phases hold the first update's AdamW state: 15% more in the experience)
    stopped = probe(False, SlowFloor(tokens_per_s=1e12, per_gib=False, incumbent=0, margin=0.1))
    if stopped.contention:  # timed while the machine was busy: the rule is to run on
        assert stopped.ok, stopped.message
        return
    assert stopped.status is ProbeStatus.SLOW and "after update of timed step 1" in \
        stopped.message
    for phase, peak in full.phase_peak_mem_bytes.items():
        assert stopped.phase_peak_mem_bytes[phase] == pytest.approx(peak, rel=0.03), phase


@pytest.mark.slow
def test_a_short_probes_warmup_runs_each_loops_first_unit_the_updates_last_and_two_decode_steps():
    """The warm-up step of a short probe (its clock warming) runs of each loop of units its
    first alone (the update's mini-batches and micro-batches their last too: a full step's
    reserve on a GPU depends on it, step/update.py), and of a wave's decode steps the first
    and the last (the cache grown to the last's length in between); the step after it,
    timed, runs its sample of each loop and of each wave's blocks of decode steps the first
    two and the last two. A full probe's clock runs every unit whatever it is told."""
    import torch

    from autotune.probe.measure.meter import MemoryMeter
    from autotune.probe.step.training import TrainingProbe

    request = ProbeRequest(model="tiny-qwen2.5", config=CONFIG, device=Device("cpu"),
                           cpu_threads=2)
    for short in (True, False):
        probe = TrainingProbe(request, MemoryMeter(torch.device("cpu"), short=short))
        probe.build()
        decodes: list[int] = []  # the engine's forwards of one token: its decode steps

        def count_decode(_, args, kwargs, decodes=decodes):
            ids = kwargs.get("input_ids")
            if ids is not None and ids.shape[-1] == 1:
                decodes.append(1)

        probe.engine.model.register_forward_pre_hook(count_decode, with_kwargs=True)
        runs = []
        for warming in (True, False):
            probe.meter.clock.warming = warming
            decodes.clear()
            probe.step()
            loops = {(loop.phase, loop.unit): sorted(loop.seconds)
                     for loop in probe.step_loops[-1]}
            runs.append((loops, len(decodes)))
        (warm, warm_decodes), (timed, timed_decodes) = runs
        if not short:  # a full clock keeps no loops: every unit ran, none was estimated
            assert warm == timed == {} and warm_decodes == timed_decodes == 8 * 31
            continue
        assert warm[("rollout", "wave")] == [0, 7]  # 8 waves of 4: the first, the last full
        # two mini-batches of 16 micro-batches: the first and the last of each (it was the
        # first alone of both)
        assert warm[("update", "micro_batch")] == [0, 15] and \
            warm[("update", "minibatch")] == [0, 1]
        assert warm[("experience", "old_log_prob")] == [0]  # 16 micro-batches of 2
        assert timed[("experience", "old_log_prob")] == [0, 8, 15]  # first, middle, last
        assert timed[("rollout", "wave")] == [0, 4, 7] and \
            timed[("update", "micro_batch")] == [0, 8, 15]
        assert warm_decodes == 2 * 2  # two waves, each its first and last decode step
        assert warm[("rollout", "decode")] == [0, 15]  # its first block and its last
        # 32 response tokens: the prefill's and 31 steps, in 16 blocks (15 of 2, 1 of 1)
        assert decode_blocks(31) == [2] * 15 + [1]
        assert timed[("rollout", "decode")] == [0, 1, 14, 15]
        assert timed_decodes == 3 * (2 + 2 + 2 + 1)


@pytest.mark.slow
def test_a_probe_timed_under_contention_is_never_stopped_slow():
    """Another process takes a core: the probe's steps are not its own pace, so even a floor
    no probe reaches does not stop it; it runs its steps and its result says it was busy."""
    import math
    import os
    import subprocess
    import sys

    from autotune.runners.local import SubprocessRunner

    # enough busy cores to contend on any machine (a quarter of its cores, half a core at least)
    busy_cores = max(1, math.ceil(0.25 * (os.cpu_count() or 1)) + 1)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(busy_cores)]
    try:
        result = SubprocessRunner().run(ProbeRequest(  # one thread: the other core is busy
            model="tiny-qwen2.5", config=SMALL, device=Device("cpu"), timed_steps=2,
            cpu_threads=1, stop_below=SlowFloor(1e12, per_gib=False, incumbent=0, margin=0.1)))
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert result.ok and result.contention, (result.status, result.message)
    assert len(result.step_times_s) >= 2


def test_the_slow_floor_is_the_best_less_the_noise_and_a_slow_probe_is_never_ranked():
    import optuna
    from optuna.distributions import CategoricalDistribution

    from autotune.sweep.pick.measurements import fold, ranked
    from autotune.sweep.study.objective import slow_floor

    assert slow_floor("pareto", 100.0, 3, 0.01) is None  # a slow config may hold least memory
    assert slow_floor("throughput", None, None, None) is None  # nothing fits yet
    quiet = slow_floor("throughput_per_memory", 100.0, 3, 0.01)
    assert quiet is not None and quiet.per_gib and quiet.incumbent == 3
    assert (quiet.margin, quiet.tokens_per_s) == (0.1, pytest.approx(90.0))  # the 10% floor
    assert quiet.floor_tokens_per_s(2 * 2**30) == pytest.approx(180.0)  # per GiB of its peak
    noisy = slow_floor("throughput", 100.0, 3, 0.08)
    assert noisy.margin == pytest.approx(0.16) and not noisy.per_gib
    assert slow_floor("throughput", 100.0, 3, 0.9).margin == 0.5

    def trial(number, status, tokens_per_s, knob):
        frozen = optuna.trial.create_trial(
            params={"mbu": knob}, distributions={"mbu": CategoricalDistribution([1, 2])},
            values=[tokens_per_s],
            user_attrs={"probed": True, "status": status, "feasible": True,
                        "result": {"tokens_per_s": tokens_per_s, "peak_mem_bytes": 2**30}})
        frozen.number = number
        return frozen

    configs = {}
    for frozen in (trial(0, "ok", 100.0, 1), trial(1, "slow", 80.0, 2)):
        fold(configs, frozen, "throughput")
    assert [m.number for m in ranked(None, configs)] == [0]  # its bound is not a figure
    assert len(configs) == 2  # its memory is still the config's


@pytest.mark.slow
def test_a_real_sweep_stops_probes_that_measure_themselves_under_the_best(tmp_path):
    """Real CPU probes: the safe config (1 sequence a generation wave), then the fastest as
    the base (16, one wave), then 2 a wave (8 waves): its step runs at about 0.7 of the
    fastest's rate (measured 614 against 898 tok/s), past the floor (the best less 10%, or
    twice the measured step spread when the machine is noisier). It stops once its peaks are
    reached (within its first timed step: a whole step ran before it), is recorded `slow` with
    the memory it measured, and is never picked; trials.csv and `show` say so. On a machine so
    noisy that the floor falls under its rate, it must run on: the rule, not a fixed outcome."""
    import csv

    import yaml

    from autotune.cli.text import format_study
    from autotune.runners.local import SubprocessRunner
    from autotune.sweep.pick.artifacts import SweepFiles, best_trial
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.study import trial_files
    from autotune.sweep.study.settings import SweepSettings
    from autotune.sweep.tuner import Sweep

    fixed = {"rollout_batch_size": 4, "rollout_n": 4, "global_batch_size": 2,
             "micro_batch_size_update": 8, "micro_batch_size_experience": 4,
             "max_prompt_length": 32, "max_response_length": 32, "rollout_engine": "hf"}
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"params": {"max_num_seqs": {
        "type": "categorical", "choices": [1, 2, 16]}}, "fixed": fixed}))
    request = ProbeRequest(model="tiny-qwen2.5", device=Device("cpu"), cpu_threads=2,
                           warmup_steps=1, timed_steps=2, timeout_s=300.0)
    settings = SweepSettings(study_name="s", study_dir=tmp_path / "s",
                             space=load_search_space(str(path)), request=request,
                             objective="throughput", max_trials=3, sampler="random",
                             stop_slow=True, base_params={"max_num_seqs": 16})
    study = Sweep(settings, SubprocessRunner(),
                  on_trial=SweepFiles(settings.study_dir).after_trial).run()
    trials = {t.params["max_num_seqs"]: t for t in study.trials if t.user_attrs.get("probed")}
    assert trials[1].user_attrs["status"] == "ok"  # the first: nothing to compare with
    fastest = trials[16]
    assert fastest.user_attrs["status"] == "ok"
    attrs = trials[2].user_attrs
    result = attrs["result"]
    if result["contention"]:  # timed while the machine was busy: the rule is to run on
        assert attrs["status"] == "ok"
        return
    # the floor the sweep gave this probe, as its request file has it
    floor = ProbeRequest.from_json(trial_files.request_path(
        settings.study_dir, trials[2].number).read_text()).stop_below
    assert floor is not None and floor.incumbent == fastest.number
    if attrs["status"] == "ok":  # ran on: only where the noise let the floor fall near its
        # rate: a wide margin (steps 10%+ apart), or an incumbent timed slow by a loaded
        # machine that the watch did not flag (a fresh clone's suite beside other work: 2
        # a wave at 204 tok/s over a floor of 117); the rule stops on a partial step's rate,
        # a bound above the whole step's, hence the 10% below the floor it may end at
        assert floor.margin > 0.2 or result["tokens_per_s"] >= 0.9 * floor.tokens_per_s, \
            (floor, result["tokens_per_s"])
        return
    assert attrs["status"] == "slow", attrs["reason"]
    assert f"trial {fastest.number}'s figure" in attrs["reason"]
    assert result["tokens_per_s"] < 0.9 * fastest.user_attrs["result"]["tokens_per_s"]
    assert result["step_times_s"] == []  # stopped within its first timed step
    assert set(result["phase_peak_mem_bytes"]) == {"rollout", "experience", "update"}
    assert best_trial(study).number == fastest.number
    rows = list(csv.DictReader((tmp_path / "s" / "trials.csv").open()))
    assert sorted(row["status"] for row in rows if not row["reused_from"]) == \
        ["ok", "ok", "slow"]
    assert " slow " in format_study(study)


@pytest.mark.slow
def test_a_real_sweep_times_one_step_where_the_studys_noise_settles_it(tmp_path):
    """Real CPU probes: the first quiet probes run two timed steps or more and measure the
    machine's step spread; the probes after them start from one timed step with that spread
    in their request (the --timed-steps rule untouched), and report a standard error never
    under it; so do the finalists' repeats, which the driver runs after the sweep. Each probe
    is held to its request: the request files are the sweep's own."""
    import yaml

    from autotune.cli.text import format_study
    from autotune.runners.local import SubprocessRunner
    from autotune.sweep.driver import run_sweep
    from autotune.sweep.pick.finalists import repeat_log_path
    from autotune.sweep.plan import SweepPlan
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.study import trial_files
    from autotune.sweep.study.settings import SweepSettings
    from autotune.sweep.tally import NOISE_PROBES

    fixed = {"rollout_batch_size": 4, "rollout_n": 2, "global_batch_size": 2,
             "micro_batch_size_experience": 4, "max_prompt_length": 32,
             "micro_batch_size_update": 2, "rollout_engine": "hf"}
    path = tmp_path / "space.yaml"  # a shape knob: any two configs differ in every phase,
    path.write_text(yaml.safe_dump({"params": {  # so the finalists' repeats are whole
        "max_response_length": {"type": "categorical", "choices": [8, 12, 16, 20, 24, 28]}},
        "fixed": fixed}))
    request = ProbeRequest(model="tiny-qwen2.5", device=Device("cpu"), cpu_threads=2,
                           warmup_steps=1, timed_steps=2, timed_min_s=2.0, timeout_s=300.0)
    settings = SweepSettings(study_name="s", study_dir=tmp_path / "s",
                             space=load_search_space(str(path)), request=request,
                             objective="throughput", max_trials=NOISE_PROBES + 2,
                             sampler="random", finalists=2)
    study = run_sweep(SweepPlan(settings, SubprocessRunner(), None, ())).study
    assert study is not None
    probed = sorted((t for t in study.trials if t.user_attrs.get("probed")
                     and t.user_attrs.get("origin") != "finalist"), key=lambda t: t.number)
    assert len(probed) == NOISE_PROBES + 2
    quiet_before = 0  # quiet probes of two steps or more before each one
    for trial in probed:
        asked = ProbeRequest.from_json(trial_files.request_path(
            settings.study_dir, trial.number).read_text())
        result = trial.user_attrs["result"]
        assert result["status"] == "ok", result
        if quiet_before < NOISE_PROBES:
            assert (asked.timed_steps, asked.step_cv_prior) == (2, None)
        else:
            assert asked.timed_steps == 1 and asked.step_cv_prior is not None
            assert result["step_se_s"] >= asked.step_cv_prior * result["step_s"] / \
                len(result["step_times_s"]) ** 0.5 * (1 - 1e-9)
        steps = result["step_times_s"]
        if len(steps) >= 2 and not result["contention"]:
            quiet_before += 1
    measured = quiet_before >= NOISE_PROBES  # a loaded machine flags every probe contended:
    repeats = [t for t in study.trials if t.user_attrs.get("origin") == "finalist"]  # no noise
    assert len(repeats) >= 2
    for trial in repeats:
        config = trial.user_attrs["repeat_of"]
        count = 1 + sum(t.user_attrs.get("repeat_of") == config for t in study.trials
                        if t.number <= trial.number)
        asked = ProbeRequest.from_json(repeat_log_path(
            settings.study_dir, config, count).with_suffix(".request.json").read_text())
        assert not asked.timed_phases, trial.number
        if not measured:  # the study measured no noise: the repeats run as the first probes
            assert (asked.timed_steps, asked.step_cv_prior) == (2, None), trial.number
            continue
        assert asked.timed_steps == 1 and asked.step_cv_prior is not None, trial.number
        result = trial.user_attrs["result"]
        assert result["step_se_s"] >= asked.step_cv_prior * result["step_s"] / \
            len(result["step_times_s"]) ** 0.5 * (1 - 1e-9)
    once = [t.number for t in probed if len(t.user_attrs["result"]["step_times_s"]) == 1]
    rows = {line.split()[0]: line for line in format_study(study).splitlines()
            if line.split() and line.split()[0].isdigit()}
    for number in once:  # `show` says it was timed once, not a spread it never measured
        assert "1 step" in rows[str(number)], rows
