"""Numbers a tuner can trust: each probe's spread and the machine's state beside it, the
finalists probed again before the pick, and the rule that picked, all where a user reads them.

The sweep test runs real probes of the tiny model on the CPU; the contention test runs a real
probe beside real busy processes; the rule tests tell a real (in-memory) Optuna study.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import optuna
import pytest
import yaml

from autotune.probe.measure.machine import MachineState
from autotune.runners.local import SubprocessRunner
from autotune.sweep.pick.finalists import decide, standing
from autotune.sweep.pick.measurements import by_config, ranked

SPACE = """
params:
  micro_batch_size_update: {type: categorical, choices: [1, 2]}
  gradient_checkpointing: {type: bool}
fixed: {rollout_batch_size: 4, rollout_n: 2, global_batch_size: 2, max_prompt_length: 32,
        max_response_length: 16, micro_batch_size_experience: 4}
"""


@pytest.mark.slow
def test_a_sweep_probes_its_finalists_again_and_says_how_it_picked(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    out = subprocess.run(
        [sys.executable, "-m", "autotune", "run", "--model", "tiny-qwen2.5", "--device", "cpu",
         "--space", str(space), "--study", "f", "--results-dir", str(tmp_path / "results"),
         "--threads", "2", "--warmup-steps", "0", "--timed-steps", "3", "--trials", "3",
         "--no-trace", "--no-stop-slow", "--finalists", "2"], capture_output=True, text=True,
        timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    study_dir = tmp_path / "results" / "f"
    study = optuna.load_study(study_name="f", storage=f"sqlite:///{study_dir / 'study.db'}")
    trials = study.get_trials(deepcopy=False)
    repeats = [t for t in trials if t.user_attrs.get("origin") == "finalist"]
    # the two finalists probed again (at least one more probe each), as trials of the study
    # holding their config, with logs of their own. The finalists are the best two by their
    # mean as it stands: a repeat can drop one below the third config, which is then a
    # finalist and probed again too (the noise the repeats are there for; seen on a loaded
    # machine), so the best two at the end were all repeated, and maybe one more
    repeated = {t.user_attrs["repeat_of"] for t in repeats}
    finalists = ranked(study)[:2]
    assert len(finalists) == 2 and {m.number for m in finalists} <= repeated
    # and only finalists were: each repeat's config was among the best two just before it,
    # or before an earlier repeat of its round (a round probes the finalists it began with)
    replay = optuna.create_study(directions=study.directions)
    for key, value in study.user_attrs.items():
        replay.set_user_attr(key, value)
    been_finalists: set[int] = set()
    for trial in sorted(trials, key=lambda t: t.number):
        if trial.user_attrs.get("origin") == "finalist":
            been_finalists |= {m.number for m in ranked(replay)[:2]}
            assert trial.user_attrs["repeat_of"] in been_finalists, trial.number
        replay.add_trial(trial)
    for repeat in repeats:
        owner = trials[repeat.user_attrs["repeat_of"]]
        assert repeat.params == owner.params and repeat.user_attrs["probed"]
        assert (study_dir / repeat.user_attrs["log"]).exists()
        assert len(repeat.user_attrs["result"]["step_times_s"]) == 3
        # the space's knobs are the update's alone: every other phase is the same work in
        # every finalist, so a repeat times the update and takes the rest from its config's
        # whole probe (sweep/pick/focused.py)
        assert repeat.user_attrs["result"]["timed_phases"] == ["update"]
        whole = trials[repeat.user_attrs["untimed_from"]]
        assert whole.params == owner.params and not whole.user_attrs["result"]["timed_phases"]
        assert set(repeat.user_attrs["result"]["phase_s"]) == \
            set(whole.user_attrs["result"]["phase_s"])
        assert repeat.user_attrs["result"]["phase_s"]["rollout"] == \
            whole.user_attrs["result"]["phase_s"]["rollout"]
    assert all(m.probes >= 2 for m in finalists)
    assert "finalist trial" in out.stderr and "timing update" in out.stderr
    best = yaml.safe_load((study_dir / "best.yaml").read_text())
    # the default objective, tokens/s per GiB, counts memory in the figure: the leader stands
    assert "counts memory already" in best["pick"]["rule"] and best["pick"]["why"]
    assert best["trial"] == ranked(study)[0].number
    chosen = by_config(study)[next(k for k, m in by_config(study).items()
                                   if m.number == best["trial"])]
    assert best["measured"]["probes"] == chosen.probes >= 2
    assert best["measured"]["tokens_per_s"] == pytest.approx(chosen.tokens_per_s_mean)
    rows = list(csv.DictReader(open(study_dir / "trials.csv")))
    assert {"step_cv", "contention", "timed_steps", "repeat_of"} <= set(rows[0])
    assert all(r["timed_steps"] == "3" and r["step_cv"] for r in rows if r["status"] == "ok")
    assert sum(r["origin"] == "finalist" for r in rows) == len(repeats)
    shown = subprocess.run([sys.executable, "-m", "autotune", "show", "--study", "f",
                            "--results-dir", str(tmp_path / "results")],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "finalists (each probed up to 3 times" in shown.stdout
    assert f"picked trial {best['trial']}" in shown.stdout
    assert "(update timed)" in shown.stdout  # the repeats, as focused probes
    page = (study_dir / "report.html").read_text()  # written by `run`
    assert "<h2>Finalists</h2>" in page and f"Picked trial {best['trial']}" in page


def busy_processes(count: int, cores: list[int]) -> list[subprocess.Popen]:
    """`count` processes spinning on `cores` (bounded: they end by themselves after 300 s)."""
    spin = ("import os, sys, time; os.sched_setaffinity(0, {int(c) for c in "
            "sys.argv[1].split(',')}); end = time.time() + 300\nwhile time.time() < end: pass")
    return [subprocess.Popen([sys.executable, "-c", spin, ",".join(map(str, cores))])
            for _ in range(count)]


@pytest.mark.slow
def test_a_probe_beside_busy_processes_is_flagged(make_request):
    """A real probe pinned to one core, with busy processes on the machine's other cores
    (half the machine: every core but the probe's on a 2-core box)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores: one for the probe, one for the load")
    probe_core, others = cores[0], cores[1:]
    busy = busy_processes(max(1, len(os.sched_getaffinity(0)) // 2), others)
    try:
        result = SubprocessRunner().run(make_request(cpu_ids=(probe_core,), cpu_threads=1,
                                                     timed_steps=3))
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    assert result.ok, result.message
    assert len(result.step_times_s) == 3 and result.step_cv is not None
    assert result.machine["others_cpu_cores"] >= 0.5
    assert result.contention is not None and "other processes used" in result.contention


def test_the_contention_rule():
    def state(others: float, cpus: int = 16, threads: int = 16, gpu: int | None = None):
        return MachineState(1.0, cpus, threads, others, 0.0, gpu_other_processes=gpu)

    assert state(0.1).contention() is None
    assert state(0.6, cpus=2, threads=2).contention() is not None  # half a core of two
    assert state(3.0, threads=1).contention() is None  # 16 cores, the probe uses one
    assert state(4.0, threads=1).contention() is not None  # a quarter of the machine
    assert state(0.7, cpus=4, threads=4).contention() is not None  # no idle core left
    assert state(0.0, gpu=1).contention() == "1 other process(es) on the GPU"


def told(study, params, tokens_per_s, peak_gib, status="ok", feasible=True, repeat_of=None):
    """One probe's trial as the sweep tells it (throughput objective)."""
    attrs = {"status": status, "probed": True, "feasible": feasible,
             "result": {"tokens_per_s": tokens_per_s, "peak_mem_bytes": int(peak_gib * 2**30),
                        "phase_peak_mem_bytes": {"update": int(peak_gib * 2**30)},
                        "step_times_s": [1.0, 1.01, 0.99]}}
    if repeat_of is not None:
        attrs.update(origin="finalist", repeat_of=repeat_of)
    dist = {"m": optuna.distributions.CategoricalDistribution([1, 2, 4])}
    study.add_trial(optuna.trial.create_trial(
        params={"m": params}, distributions=dist, user_attrs=attrs,
        values=[tokens_per_s if feasible else 0.0]))


def study_of(*probes):
    study = optuna.create_study(direction="maximize")
    study.set_user_attr("identity", {"objective": "throughput"})
    for probe in probes:
        told(study, *probe[:3], **(probe[3] if len(probe) > 3 else {}))
    return study


def test_the_pick_is_the_best_mean_when_it_stands_apart():
    study = study_of((1, 100.0, 10), (2, 90.0, 8), (1, 101.0, 10, {"repeat_of": 0}),
                     (2, 91.0, 8, {"repeat_of": 1}), (1, 99.0, 10, {"repeat_of": 0}))
    record = decide(study, 2)
    assert record["chosen"] == 0 and "apart" in record["why"]
    assert [e["trial"] for e in record["entries"]] == [0, 1]
    low, high = record["entries"][0]["tokens_per_s_interval"]
    assert low < 100.0 < high


def test_finalists_within_the_noise_go_to_the_lower_peak_memory():
    study = study_of((1, 100.0, 10), (2, 97.0, 8), (1, 110.0, 10, {"repeat_of": 0}),
                     (2, 88.0, 8, {"repeat_of": 1}))
    spread, close = standing(ranked(study)[:2])
    assert spread > 0.05 and len(close) == 2  # the repeats spread by more than the gap
    record = decide(study, 2)
    assert record["chosen"] == 1 and "lowest peak memory" in record["why"]


def test_per_gib_finalists_within_the_noise_keep_the_leader():
    """The probes of the test above, the objective tokens/s per GiB (the trials' values are
    its figure): memory counts in the figure already, so the leader stands where the
    throughput objective takes the lower-memory finalist."""
    study = study_of((1, 100.0, 10), (2, 97.0, 8), (1, 110.0, 10, {"repeat_of": 0}),
                     (2, 88.0, 8, {"repeat_of": 1}))
    study.set_user_attr("identity", {"objective": "throughput_per_memory"})
    spread, close = standing(ranked(study)[:2])
    assert len(close) == 2 and ranked(study)[0].number == 0  # not apart; 0 leads, at more
    record = decide(study, 2)  # memory than 1
    assert record["chosen"] == 0 and "counts memory already" in record["rule"]
    assert "within the noise" in record["why"]


def test_a_finalist_whose_repeat_runs_out_of_memory_is_out():
    study = study_of((1, 100.0, 10), (2, 90.0, 8),
                     (1, 0.0, 10, {"repeat_of": 0, "status": "gpu_oom", "feasible": False}))
    assert [m.number for m in ranked(study)] == [1]
    assert decide(study, 2)["chosen"] == 1


def test_finalists_killed_mid_round_resume_without_running_anything_twice(tmp_path):
    """A Ctrl-C during the second repeat: the first is in the study; the next run probes
    only what is left, and a repeat whose result was written before the kill is read back,
    not probed again (the scripted runner stands in for the probe: this is the driver)."""
    from scripted_runner import ScriptedRunner

    from autotune.probe.measure.result import ProbeRequest
    from autotune.sweep.pick.finalists import remeasure, repeat_log_path
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.study.settings import SweepSettings
    from autotune.sweep.tuner import Sweep

    settings = SweepSettings(study_name="s", study_dir=tmp_path / "s",
                             space=load_search_space("cpu-demo"),
                             request=ProbeRequest(model="tiny-qwen2.5"), max_trials=6,
                             finalists=3)
    study = Sweep(settings, ScriptedRunner()).run()
    top = ranked(study)[:3]
    with pytest.raises(KeyboardInterrupt):
        remeasure(study, settings, ScriptedRunner(interrupt_on_call=2), 3, None)
    repeats = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("repeat_of")
               is not None]
    assert [t.user_attrs["repeat_of"] for t in repeats] == [top[0].number]
    # the third finalist's repeat finished, its driver died before adding it
    left = ScriptedRunner()
    saved = repeat_log_path(settings.study_dir, top[2].number, 2)
    saved.with_suffix(".result.json").write_text(
        left.run(settings.request_for(settings.space.candidate(top[2].trial.params))).to_json())
    left.calls.clear()
    remeasure(study, settings, left, 3, None)
    again = [t.user_attrs["repeat_of"] for t in study.get_trials(deepcopy=False)
             if t.user_attrs.get("repeat_of") is not None]
    assert sorted(again) == sorted(m.number for m in top)  # one repeat each, no more: the
    assert len(left.calls) == 1  # scripted figures have no noise, so one round settles it
    assert study.user_attrs["finalists"]["chosen"] == top[0].number


def test_a_config_first_lost_with_its_node_is_named_by_the_probe_that_counted():
    """A probe lost with its node (Ray) and retried: the config's first trial is the retry,
    whose values the best.yaml reads (a lost trial has none)."""
    study = study_of((1, 0.0, 10, {"status": "lost", "feasible": False}), (1, 100.0, 10),
                     (2, 90.0, 8))
    top = ranked(study)
    assert [m.number for m in top] == [1, 2] and top[0].trial.values == [100.0]


def test_the_repeats_stop_once_no_close_finalist_could_beat_the_leader_by_the_tolerance():
    """Leader 100 and 101, the other 99.5 and 100: not apart (a 0.75 gap under two standard
    errors of it, 1.1), yet at two standard errors the other is at most 0.4 above the
    leader, under PICK_TOLERANCE: more repeats could change the pick by less than the user's
    2%.
    Twice the spread (100 and 104, 99 and 103) leaves it open: 4.8 above at most."""
    from autotune.sweep.pick.finalists import tolerated
    from autotune.sweep.pick.measurements import PICK_TOLERANCE

    quiet = study_of((1, 100.0, 10), (2, 99.5, 10), (1, 101.0, 10, {"repeat_of": 0}),
                     (2, 100.0, 10, {"repeat_of": 1}))
    quiet.set_user_attr("identity", {"objective": "throughput_per_memory"})
    spread, close = standing(ranked(quiet)[:2])
    assert len(close) == 2 and tolerated(close, spread)
    assert f"more than {PICK_TOLERANCE:.0%} above the leader" in decide(quiet, 2)["why"]
    noisy = study_of((1, 100.0, 10), (2, 99.0, 10), (1, 104.0, 10, {"repeat_of": 0}),
                     (2, 103.0, 10, {"repeat_of": 1}))
    spread, close = standing(ranked(noisy)[:2])
    assert len(close) == 2 and not tolerated(close, spread)
    assert not tolerated(close[:1], spread)  # the leader alone: nothing to tolerate
    once = study_of((1, 100.0, 10), (2, 99.0, 10))  # one probe each: the noise is unknown
    assert not tolerated(standing(ranked(once)[:2])[1], 0.0)


@pytest.mark.parametrize("noise, most_probes", [(0.002, 2), (0.04, 3)])
def test_a_quiet_machines_finalists_stop_after_one_round_and_a_noisy_ones_go_on(
        tmp_path, noise, most_probes):
    """Every config as fast and as large (the scripted probe's figures made equal): on a
    quiet machine (repeats within 0.2%) the finalists stop after one round of repeats, every
    one within the tolerance of the leader; at 4% they go on to MAX_PROBES."""
    from scripted_runner import ScriptedRunner

    from autotune.probe.measure.result import ProbeRequest
    from autotune.sweep.pick.finalists import MAX_PROBES, remeasure
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.study.settings import SweepSettings
    from autotune.sweep.tuner import Sweep

    class Equal(ScriptedRunner):
        def run(self, request, log_path=None):
            result = super().run(request, log_path)
            n = len(self.calls)
            factor = 1 + 0.0001 * n if repeats is None else \
                1 + noise * (1 if len(repeats) % 2 else -1)
            if repeats is not None:
                repeats.append(n)
            phases = {phase: 400 * 2**20 for phase in result.phase_peak_mem_bytes}
            return result.replace(tokens_per_s=100.0 * factor, peak_mem_bytes=400 * 2**20,
                                  phase_peak_mem_bytes=phases)

    repeats: list[int] | None = None
    settings = SweepSettings(study_name="s", study_dir=tmp_path / "s",
                             space=load_search_space("cpu-demo"),
                             request=ProbeRequest(model="tiny-qwen2.5"), max_trials=6,
                             finalists=3)
    study = Sweep(settings, Equal()).run()
    repeats = []
    remeasure(study, settings, Equal(), 3, None)
    finalists = ranked(study)[:3]
    assert len(finalists) == 3 and max(m.probes for m in finalists) == most_probes
    assert min(m.probes for m in finalists) >= 2 and most_probes <= MAX_PROBES
    why = study.user_attrs["finalists"]["why"]
    assert ("repeats stopped there" in why) == (most_probes == 2), why
