"""The sweep's loop logic, driven by a scripted runner (no torch, no subprocess).

The storage is a real Optuna SQLite database in a temporary directory; only the probe is
scripted (see scripted_runner.py). Real probes run in test_sweep_e2e.py.
"""

from __future__ import annotations

import csv
import json
import signal
import sys

import optuna
import pytest
import yaml
from optuna.trial import TrialState
from scripted_runner import (
    LIMIT_BYTES,
    ModelRunner,
    ScriptedRunner,
    StandInTracer,
    scripted_result,
)

from autotune.cli.text import format_outcome
from autotune.errors import AutotuneError, ConfigError
from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest
from autotune.sweep.driver import run_sweep
from autotune.sweep.pick.artifacts import SweepFiles, best_trial
from autotune.sweep.plan import SweepPlan
from autotune.sweep.progress import SilentProgress
from autotune.sweep.space.search_space import SearchSpace, load_search_space
from autotune.sweep.study import trial_files
from autotune.sweep.study.settings import SweepSettings
from autotune.sweep.study.storage import StudyLock
from autotune.sweep.tuner import Sweep, params_key

REQUEST = ProbeRequest(model="tiny-qwen2.5", device=Device("cpu"))


def settings_for(tmp_path, space=None, **changes):
    space = space or load_search_space("cpu-demo")
    fields = {"study_name": "s", "study_dir": tmp_path / "s", "space": space,
              "request": REQUEST, **changes}
    return SweepSettings(**fields)


def sweep(tmp_path, runner=None, **changes):
    """A sweep keeping its files as `autotune run` does (artifacts.SweepFiles)."""
    settings = settings_for(tmp_path, **changes)
    runner = runner or ScriptedRunner()
    study = Sweep(settings, runner, on_trial=SweepFiles(settings.study_dir).after_trial).run()
    return study, runner


def probed(study):
    return [t for t in study.trials if t.user_attrs.get("probed")]


def demo_grid(tmp_path, mbu=(1, 8), mbe=(2, 16), offload_optimizer=False):
    """cpu-demo's knobs and shapes with fewer choices (2 x 2 x 2 x 2 = 16 configs by default,
    the scripted OOMs at both ends: mbu=8 without checkpointing, mbe=16 without offload): the
    loop's rules show on it as on the 128 of cpu-demo, in a fraction of the trials."""
    path = tmp_path / "demo-grid.yaml"
    path.write_text(f"""
params:
  micro_batch_size_update: {{type: categorical, choices: {list(mbu)}}}
  micro_batch_size_experience: {{type: categorical, choices: {list(mbe)}}}
  gradient_checkpointing: {{type: bool}}
  offload_params: {{type: bool}}
fixed: {{rollout_batch_size: 4, rollout_n: 4, global_batch_size: 2, max_prompt_length: 64,
        max_response_length: 64, offload_optimizer: {str(offload_optimizer).lower()}}}
""")
    return load_search_space(str(path))


def test_first_trial_is_the_safe_config_then_the_base_config(tmp_path):
    base = {"micro_batch_size_update": 4, "micro_batch_size_experience": 4,
            "gradient_checkpointing": False, "offload_params": False, "offload_optimizer": False}
    study, runner = sweep(tmp_path, max_trials=3, base_params=base)
    assert study.trials[0].params == {
        "micro_batch_size_update": 1, "micro_batch_size_experience": 2,
        "gradient_checkpointing": True, "offload_params": True, "offload_optimizer": True}
    assert study.trials[0].user_attrs["origin"] == "safe"
    assert study.trials[1].params == base and study.trials[1].user_attrs["origin"] == "base"
    assert len(runner.calls) == 3


def test_sweep_to_exhaustion_probes_every_valid_config_exactly_once(tmp_path):
    # The random sampler keeps this fast; dedupe and exhaustion do not depend on the sampler
    # or on the grid's size.
    study, runner = sweep(tmp_path, space=demo_grid(tmp_path), max_trials=1000, seed=3,
                          sampler="random", prune_dominated=False)
    keys = [json.dumps({k: c[k] for k in sorted(study.trials[0].params)}, sort_keys=True)
            for c in runner.calls]
    assert len(keys) == len(set(keys)) == 16  # every config of the 2x2x2x2 grid, once
    assert any(t.user_attrs.get("reused_from") is not None for t in study.trials)
    reused = [t for t in study.trials if t.user_attrs.get("reused_from") is not None]
    for trial in reused:  # a reused trial carries the earlier trial's outcome
        earlier = study.trials[trial.user_attrs["reused_from"]]
        assert trial.params == earlier.params and trial.values == earlier.values


def test_oom_is_complete_with_constraint_and_crash_is_fail_with_log(tmp_path):
    crash = lambda c: c.micro_batch_size_update == 2 and not c.offload_params  # noqa: E731
    study, _ = sweep(tmp_path, ScriptedRunner(crash_when=crash), max_trials=1000,
                     space=demo_grid(tmp_path, mbu=(2, 8)), sampler="random")
    ooms = [t for t in probed(study) if t.user_attrs["status"] == "gpu_oom"]
    crashes = [t for t in probed(study) if t.user_attrs["status"] == "crash"]
    assert ooms and crashes
    for trial in ooms:  # the sampler learns from OOM: COMPLETE, sentinel value, infeasible
        assert trial.state == TrialState.COMPLETE and trial.values == [0.0]
        assert trial.constraints["memory"] > 0 and not trial.user_attrs["feasible"]
    for trial in crashes:
        assert trial.state == TrialState.FAIL
        assert (tmp_path / "s" / trial.user_attrs["log"]).read_text().startswith("scripted")
    for trial in probed(study):
        if trial.user_attrs["feasible"]:
            assert trial.constraints["memory"] <= 0 and trial.values[0] > 0


def test_headroom_makes_a_config_that_ran_infeasible(tmp_path):
    # mbu=4 needs 780 MiB: under the 800 MiB limit, over the 720 MiB budget of 10% headroom.
    space = SearchSpace({"micro_batch_size_update": load_search_space("cpu-demo")
                         .params["micro_batch_size_update"]},
                        {"gradient_checkpointing": False, "rollout_batch_size": 4,
                         "rollout_n": 4, "global_batch_size": 2,
                         "micro_batch_size_experience": 2})
    request = ProbeRequest(model="m", device=Device("cpu", limit_bytes=800 * 2**20))
    study, _ = sweep(tmp_path, space=space, request=request, max_trials=10)
    by_mbu = {t.params["micro_batch_size_update"]: t for t in probed(study)}
    assert by_mbu[2].user_attrs["status"] == "ok" and by_mbu[2].user_attrs["feasible"]
    over = by_mbu[4]
    assert by_mbu[8].user_attrs["status"] == "gpu_oom"
    assert over.user_attrs["status"] == "ok" and not over.user_attrs["feasible"]
    assert "over headroom in update" in over.user_attrs["reason"]
    assert best_trial(study).params["micro_batch_size_update"] == 2


def test_invalid_combination_is_recorded_and_never_run(tmp_path):
    space = SearchSpace({"micro_batch_size_update": load_search_space("grpo")
                         .params["micro_batch_size_update"]},
                        {"rollout_batch_size": 4, "rollout_n": 2, "global_batch_size": 2,
                         "micro_batch_size_experience": 2})  # mbu must divide 4
    study, runner = sweep(tmp_path, space=space, max_trials=100,
                          base_params={"micro_batch_size_update": 8})
    invalid = [t for t in study.trials if t.user_attrs.get("status") == "invalid"]
    assert invalid[0].number == 1 and invalid[0].params["micro_batch_size_update"] == 8
    assert "not divisible by micro_batch_size_update=8" in invalid[0].user_attrs["reason"]
    assert all(t.params["micro_batch_size_update"] > 4 for t in invalid)
    assert all(t.constraints["rules"] > 0 and t.state == TrialState.COMPLETE for t in invalid)
    assert sorted(c["micro_batch_size_update"] for c in runner.calls) == [1, 2, 4]


@pytest.mark.parametrize("rule, expected", [("trials", 5), ("patience", None)])
def test_stop_rules(tmp_path, rule, expected):
    if rule == "trials":
        study, runner = sweep(tmp_path, max_trials=5)
        assert len(runner.calls) == expected
    else:
        study, runner = sweep(tmp_path, patience=4, seed=1)
        values = [t.values[0] if t.user_attrs["feasible"] else 0.0 for t in probed(study)]
        best_at = max(range(len(values)), key=lambda i: (values[i], -i))
        assert len(values) - 1 - best_at == 4  # exactly `patience` probes after the best


def test_every_run_starts_one_probe_then_stops_at_its_timeout(tmp_path):
    """--timeout stops new probes, but each run settles one trial first (as Optuna's
    study.optimize(timeout=) runs one): a resume whose opening outlasts a short timeout
    still makes progress, and a run that found nothing says it can go on."""
    study, runner = sweep(tmp_path, timeout_s=1e-9)
    assert len(runner.calls) == 1 and study.trials[0].user_attrs["origin"] == "safe"
    resumed, again = sweep(tmp_path, timeout_s=1e-9)
    assert len(again.calls) == 1 and params_key(again.calls[0]) != params_key(runner.calls[0])
    assert len(probed(resumed)) == 2

    crashing = settings_for(tmp_path / "c", timeout_s=1e-9, finalists=0)
    outcome = run_sweep(SweepPlan(crashing, ScriptedRunner(crash_when=lambda config: True),
                                  None, ()))
    assert outcome.exit_code == 1 and outcome.budget_stop is not None
    assert outcome.budget_stop.reason == "reached --timeout 0 s"
    why = format_outcome(outcome, crashing, "")[1]
    assert why.startswith("no feasible configuration yet (stopped: reached --timeout 0 s)")
    assert "resumes" in why and "widen the space" not in why


def test_resume_continues_without_running_anything_twice(tmp_path):
    first, runner1 = sweep(tmp_path, max_trials=6, seed=5)
    before = {t.number: (t.params, t.values) for t in first.trials}
    second, runner2 = sweep(tmp_path, max_trials=12, seed=5)
    assert len(runner1.calls) == 6 and len(runner2.calls) == 6
    for number, (params, values) in before.items():
        assert (second.trials[number].params, second.trials[number].values) == (params, values)
    keys = [params_key(c) for c in runner1.calls + runner2.calls]
    assert len(keys) == len(set(keys))


def test_resume_requeues_a_trial_left_running_and_completes_a_saved_one(tmp_path):
    settings = settings_for(tmp_path, max_trials=2)
    study, _ = sweep(tmp_path, max_trials=2)
    space = settings.space
    # A killed driver: one trial RUNNING with no result, one RUNNING whose result was saved.
    lost = study.ask(space.distributions())
    saved = study.ask(space.distributions())
    result = scripted_result(ProbeRequest(model="m", config=space.config_for(saved.params)))
    trial_files.result_path(settings.study_dir, saved.number).write_text(result.to_json())
    resumed, runner = sweep(tmp_path, max_trials=4)
    lost_trial, saved_trial = resumed.trials[lost.number], resumed.trials[saved.number]
    assert lost_trial.state == TrialState.FAIL
    assert lost_trial.user_attrs["status"] == "interrupted"
    assert saved_trial.state == TrialState.COMPLETE and saved_trial.user_attrs["probed"]
    requeued = [t for t in resumed.trials if t.user_attrs.get("requeued_from") == lost.number]
    assert len(requeued) == 1 and requeued[0].params == lost.params
    assert params_key(saved.params) not in {params_key(c) for c in runner.calls}
    assert len(probed(resumed)) == 4


def test_interrupt_during_a_probe_requeues_it(tmp_path):
    first = ScriptedRunner(interrupt_on_call=3)
    with pytest.raises(KeyboardInterrupt):
        sweep(tmp_path, first, max_trials=5)
    names = list(load_search_space("cpu-demo").params)
    lost = {k: first.calls[2][k] for k in names}
    resumed, runner = sweep(tmp_path, max_trials=5)
    interrupted = [t for t in resumed.trials if t.user_attrs.get("status") == "interrupted"]
    assert [t.params for t in interrupted] == [lost]
    assert {k: runner.calls[0][k] for k in names} == lost  # the queued config runs first
    assert len(probed(resumed)) == 5


def test_a_queued_config_is_run_before_the_space_counts_as_exhausted(tmp_path):
    """The last config left is the one a stop cut off: queued again, it holds its config, but
    it was never tried. The resumed sweep runs it, then says the space is exhausted."""
    path = tmp_path / "two.yaml"
    path.write_text("params:\n  gradient_checkpointing: {type: bool}\n"
                    "fixed: {micro_batch_size_update: 1, micro_batch_size_experience: 2}\n")
    space = load_search_space(str(path))
    with pytest.raises(KeyboardInterrupt):
        sweep(tmp_path, ScriptedRunner(interrupt_on_call=2), space=space)
    runner = ScriptedRunner()
    resuming = Sweep(settings_for(tmp_path, space=space), runner)
    resumed = resuming.run()
    assert len(runner.calls) == 1
    assert sorted(params_key(t.params) for t in probed(resumed)) == sorted(
        params_key({"gradient_checkpointing": gc}) for gc in (False, True))
    assert resuming.state.stop_reason == "space exhausted: all 2 valid configs tried"
    assert not [t for t in resumed.trials if t.state == TrialState.WAITING]


class DropsACtrlC(SilentProgress):
    """After `after` trials, a Ctrl-C lands in code that drops it: raised inside a __del__
    (as in a sqlalchemy connection's cleanup, or logging's at-fork hook), so Python prints
    "Exception ignored" and the code around goes on."""

    def __init__(self, after: int) -> None:
        self.after, self.finished_trials = after, 0

    def trial_finished(self, state, line) -> None:
        self.finished_trials += 1
        if self.finished_trials == self.after:
            class Cleanup:
                def __del__(self):
                    signal.getsignal(signal.SIGINT)(signal.SIGINT, None)

            Cleanup()  # dropped at once: its __del__ raises KeyboardInterrupt, swallowed


def test_a_ctrl_c_that_cleanup_code_drops_still_stops_the_sweep(tmp_path, monkeypatch):
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(
        type(unraisable.exc_value).__name__))
    settings = settings_for(tmp_path, max_trials=8)
    runner = ScriptedRunner()
    try:
        outcome = run_sweep(SweepPlan(settings, runner, None, ()), DropsACtrlC(after=2))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, before)
    assert dropped.count("KeyboardInterrupt") == 1  # Python did drop it where it landed
    assert outcome.interrupted
    assert len(runner.calls) == 2 and len(probed(outcome.study)) == 2  # none started after
    resumed = run_sweep(SweepPlan(settings, ScriptedRunner(), None, ()))
    assert not resumed.interrupted and len(probed(resumed.study)) == 8



POOL_CLEANUP_CUT = """
import sys
import sqlalchemy
from autotune.sweep.execution.interrupts import no_interrupt_tracebacks
if sys.argv[1] == "quiet":
    no_interrupt_tracebacks("sqlalchemy.pool")
engine = sqlalchemy.create_engine("sqlite://")
error = {"interrupt": KeyboardInterrupt, "error": RuntimeError}[sys.argv[2]]
@sqlalchemy.event.listens_for(engine, "reset")
def reset(dbapi_connection, record, state):
    raise error("cut")
connection = engine.connect()
try:
    connection.close()
except KeyboardInterrupt:
    print("raised on")
"""


@pytest.mark.parametrize(("mode", "cut", "traceback", "raised"), [
    ("loud", "interrupt", True, True), ("quiet", "interrupt", False, True),
    ("quiet", "error", True, False)])
def test_a_ctrl_c_in_a_pool_cleanup_stops_without_its_traceback(mode, cut, traceback, raised):
    """A Ctrl-C that lands while sqlalchemy returns a connection to its pool is logged with its
    traceback ("Exception during reset or similar", once in 31 Ctrl-Cs of an outside run) and
    raised on. The command drops that record (the stop is said in one line) and keeps every
    other: a real pool, its reset cut by the event sqlalchemy runs there."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", POOL_CLEANUP_CUT, mode, cut],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ("Exception during reset" in done.stderr) == traceback, done.stderr
    assert ("raised on" in done.stdout) == raised

def test_changed_space_or_objective_is_refused(tmp_path):
    sweep(tmp_path, max_trials=1)
    other = load_search_space("cpu-demo").with_fixed({"max_response_length": 32})
    with pytest.raises(ConfigError, match="search_space_hash"):
        sweep(tmp_path, space=other, max_trials=2)
    with pytest.raises(ConfigError, match="objective"):
        sweep(tmp_path, objective="throughput", max_trials=2)
    smaller = ProbeRequest(model="tiny-qwen2.5", device=Device("cpu", limit_bytes=2**29))
    with pytest.raises(ConfigError, match="gpu_memory_limit_bytes was None, now 536870912"):
        sweep(tmp_path, request=smaller, max_trials=2)
    sweep(tmp_path, request=ProbeRequest(model="tiny-qwen2.5", device=Device("cpu"), cpu_threads=1,
                                         timeout_s=60), max_trials=2)  # these may change


def test_one_driver_per_study(tmp_path):
    (tmp_path / "s").mkdir()
    with StudyLock(tmp_path / "s"):
        with pytest.raises(AutotuneError, match="being run by another autotune"):
            sweep(tmp_path, max_trials=1)


def test_artifacts_agree_with_the_storage(tmp_path):
    study, _ = sweep(tmp_path, max_trials=12, seed=2)
    best = yaml.safe_load((tmp_path / "s" / "best.yaml").read_text())
    rows = list(csv.DictReader(open(tmp_path / "s" / "trials.csv")))
    assert len(rows) == len(study.trials)
    row = rows[best["trial"]]
    assert row["feasible"] == "True" and row["status"] == "ok"
    assert float(row["tokens_per_s"]) == best["measured"]["tokens_per_s"]
    assert int(row["peak_mem_bytes"]) == best["measured"]["peak_mem_bytes"]
    assert best["measured"]["peak_mem_bytes"] <= best["measured"]["budget_bytes"]
    for name in best["searched"]:
        assert str(best["config"][name]) == row[name]
    feasible = [t for t in probed(study) if t.user_attrs["feasible"]]
    assert best["trial"] == max(feasible, key=lambda t: t.values[0]).number
    assert best["provenance"]["search_space_hash"] == load_search_space("cpu-demo").space_hash


def test_pareto_objective_has_two_directions_and_a_front(tmp_path):
    study, _ = sweep(tmp_path, objective="pareto", max_trials=15)
    assert len(study.directions) == 2
    front = {t.number for t in study.best_trials}  # Optuna's own front of feasible trials
    best = yaml.safe_load((tmp_path / "s" / "best.yaml").read_text())
    assert set(best["pareto_front"]) <= front | {t.number for t in study.trials
                                                 if t.user_attrs.get("reused_from")}
    assert best["trial"] in front


def test_oom_sentinel_for_pareto_is_the_capacity(tmp_path):
    study, _ = sweep(tmp_path, objective="pareto", max_trials=15)
    oom = [t for t in probed(study) if t.user_attrs["status"] == "gpu_oom"]
    assert oom and all(t.values == [0.0, LIMIT_BYTES / 2**30] for t in oom)


def test_study_is_a_plain_optuna_study(tmp_path):
    sweep(tmp_path, max_trials=3)
    loaded = optuna.load_study(study_name="s",
                               storage=f"sqlite:///{tmp_path / 's' / 'study.db'}")
    assert len(loaded.trials) >= 3 and loaded.user_attrs["identity"]["model"] == "tiny-qwen2.5"


def test_configs_a_measured_oom_dominates_are_predicted_not_run(tmp_path):
    space = demo_grid(tmp_path, mbu=(1, 4, 8))
    study, runner = sweep(tmp_path, space=space, max_trials=1000, seed=3, sampler="random",
                          prescreen=False)
    predicted = [t for t in study.trials
                 if t.user_attrs.get("predicted") and t.user_attrs.get("reused_from") is None]
    measured_oom = [t for t in probed(study) if t.user_attrs["status"] == "gpu_oom"]
    assert predicted and measured_oom
    run_keys = {params_key({k: c[k] for k in study.trials[0].params}) for c in runner.calls}
    # run, predicted as a trial, or left when nothing left could fit: never a feasible one
    for params in space.valid_grid():
        if params_key(params) not in run_keys:
            truth = scripted_result(ProbeRequest(model="m", config=space.config_for(params)))
            assert truth.status.is_oom, params
    for trial in predicted:
        assert params_key(trial.params) not in run_keys
        assert trial.state == TrialState.COMPLETE and trial.constraints["memory"] > 0
        source = study.trials[int(trial.user_attrs["reason"].split("trial ")[1].split()[0])]
        assert source.user_attrs["status"] == "gpu_oom" and source.user_attrs["probed"]
        truth = scripted_result(ProbeRequest(model="m", config=space.config_for(trial.params)))
        assert truth.status.is_oom  # the scripted memory is monotone: nothing feasible is lost
    rows = list(csv.DictReader(open(tmp_path / "s" / "trials.csv")))
    assert sum(r["predicted"] == "True" and r["reused_from"] == "" for r in rows) == len(predicted)


@pytest.mark.parametrize("prescreen", [True, False])
def test_calibrated_estimate_prescreens_configs_far_past_capacity(tmp_path, prescreen):
    from autotune.sweep.feasibility.prescreen import MIN_CALIBRATION_PROBES, PRESCREEN_MARGIN

    space = load_search_space("cpu-demo")  # the pre-screen needs its spread of peaks
    probe = ModelRunner(limit_bytes=1)
    peaks = sorted(max(probe.phase_bytes(space.config_for(p)).values()) for p in space.grid())
    # a quarter of the grid fits; a sixth is past the pre-screen's margin
    runner = ModelRunner(limit_bytes=peaks[len(peaks) // 4])
    study, _ = sweep(tmp_path, runner, space=space, max_trials=1000, seed=1,
                     sampler="random", prune_dominated=False, prescreen=prescreen)
    by_estimate = [t for t in study.trials if t.user_attrs.get("predicted_by") == "estimate"
                   and t.user_attrs.get("reused_from") is None]
    calibration = study.user_attrs["memory_calibration"]
    assert calibration["probes"] >= MIN_CALIBRATION_PROBES and calibration["on_gpu"] is False
    assert set(calibration["phases"]) == {"rollout", "experience", "update"}
    grid = len(space.valid_grid())
    if not prescreen:
        assert not by_estimate and len(runner.calls) == grid
        return
    assert by_estimate and len(runner.calls) + len(by_estimate) <= grid
    run_keys = {params_key({k: c[k] for k in space.params}) for c in runner.calls}
    for params in space.valid_grid():  # what never ran is far past capacity, never near
        if params_key(params) not in run_keys:
            peak = max(runner.phase_bytes(space.config_for(params)).values())
            assert peak > runner.limit_bytes * (1 + PRESCREEN_MARGIN) * 0.99
    for trial in by_estimate:
        peak = max(runner.phase_bytes(space.config_for(trial.params)).values())
        assert peak > runner.limit_bytes * (1 + PRESCREEN_MARGIN) * 0.99  # far past, never near
        assert "calibrated memory model" in trial.user_attrs["reason"]
        assert trial.constraints["memory"] > 0


def test_a_trainers_rules_keep_the_sweep_to_configs_it_accepts(tmp_path):
    from autotune.config import Topology
    from autotune.trainers.verl import VERL

    topology = Topology(1, 8)  # 16 responses over 8 GPUs: 1 per GPU per mini-batch of 2 prompts
    space = load_search_space("cpu-demo").with_rules(
        lambda config: VERL.check(config, topology))
    study, runner = sweep(tmp_path, ModelRunner(limit_bytes=2**40), space=space,
                          max_trials=1000, sampler="random", trainer="verl on 1x8 GPUs")
    assert runner.calls and all(c["micro_batch_size_update"] == 1 for c in runner.calls)
    assert len(runner.calls) == 32  # mbu=1 x 4 mbe x 8 saver combinations, all accepted
    invalid = [t for t in study.trials if t.user_attrs.get("status") == "invalid"
               and t.user_attrs.get("reused_from") is None]
    assert invalid and all("ppo_micro_batch_size_per_gpu" in t.user_attrs["reason"]
                           for t in invalid)
    assert study.user_attrs["identity"]["trainer"] == "verl on 1x8 GPUs"


def test_when_the_safe_config_runs_out_of_memory_the_sweep_stops_at_once(tmp_path):
    """Nothing in the space can fit: one probe, no spinning through predicted and reused
    trials past the budget (issue 12: 201 trials for --trials 2)."""
    # a cap below every scripted phase
    request = ProbeRequest(model="tiny-qwen2.5", device=Device("cpu", limit_bytes=200 * 2**20))
    runner = ScriptedRunner()
    settings = settings_for(tmp_path, max_trials=2, request=request)
    sweeper = Sweep(settings, runner)
    study = sweeper.run()
    assert len(runner.calls) == 1 and len(study.trials) <= 2
    assert sweeper.state.stop_reason.startswith("nothing in the space can fit: its safe config")
    assert "larger device" in sweeper.state.stop_reason


def test_when_nothing_left_could_fit_the_sweep_stops_without_spinning(tmp_path):
    """Only a handful of configs fit; once they are probed and the rest is predicted, the
    sweep stops instead of asking until MAX_ASKS_WITHOUT_PROBE."""
    request = ProbeRequest(model="tiny-qwen2.5",
                           device=Device("cpu", limit_bytes=380 * 2**20))
    runner = ScriptedRunner()
    sweeper = Sweep(settings_for(tmp_path, max_trials=100, seed=2, request=request), runner)
    study = sweeper.run()
    reason = sweeper.state.stop_reason
    assert reason.startswith("nothing left that could fit"), reason
    assert len(runner.calls) <= 12 and len(study.trials) < 60, len(study.trials)
    feasible = [t for t in study.trials if t.user_attrs.get("feasible")]
    assert feasible  # what fits was found before stopping


def test_tracing_that_turns_itself_off_is_said_once(tmp_path):
    """The trace process dies at the first trace (a stand-in tracer: the real process's
    failures are in test_trace.py): the sweep says so in one line and goes on."""
    import io

    from autotune.sweep.progress import PlainProgress

    class DyingTracer(StandInTracer):
        def traced_bytes(self, params, device):
            self.unavailable = "the trace process failed: Killed"
            return None

    stream = io.StringIO()
    request = ProbeRequest(model="tiny-qwen2.5",
                           device=Device("cpu", 4 * 2**30, limit_bytes=500 * 2**20))
    settings = settings_for(tmp_path, max_trials=4, request=request)
    Sweep(settings, ScriptedRunner(), PlainProgress(stream), tracer=DyingTracer()).run()
    said = [line for line in stream.getvalue().splitlines() if "tracing off" in line]
    assert len(said) == 1, stream.getvalue()
    assert "the trace process failed: Killed" in said[0]


def test_a_running_sweep_appends_trials_csv_and_rewrites_best_yaml_only_when_it_changes(
        tmp_path):
    """SweepFiles: the first call writes trials.csv whole, later ones append the rows of the
    trials finished since (the header once); best.yaml is left alone while what it says holds;
    a new driver (a resumed sweep) rewrites trials.csv once from the storage, so a row cut by
    a killed driver is neither kept nor duplicated."""
    settings = settings_for(tmp_path, max_trials=6, seed=1, sampler="random")
    files = SweepFiles(settings.study_dir)
    texts: list[str] = []
    inodes: set[int] = set()  # an atomic rewrite is a new file; an append, the same one

    def after_trial(study):
        files.after_trial(study)
        texts.append((settings.study_dir / "trials.csv").read_text())
        inodes.add((settings.study_dir / "trials.csv").stat().st_ino)

    study = Sweep(settings, ScriptedRunner(), on_trial=after_trial).run()
    assert len(texts) >= 6 and len(inodes) == 1
    assert all(later.startswith(earlier)
               for earlier, later in zip(texts, texts[1:], strict=False))
    assert texts[-1].count("number,state,") == 1
    rows = list(csv.DictReader(open(settings.study_dir / "trials.csv")))
    assert [int(r["number"]) for r in rows] == [t.number for t in study.trials]
    best = settings.study_dir / "best.yaml"
    stamp = best.stat().st_mtime_ns
    assert files.after_trial(study) == best and not files.best_changed
    assert best.stat().st_mtime_ns == stamp  # nothing changed: not rewritten
    # a driver killed mid-append left a cut row; the next driver resumes the study
    with open(settings.study_dir / "trials.csv", "a") as handle:
        handle.write("6,complete,ok,Fa")
    resumed = settings_for(tmp_path, max_trials=9, seed=2, sampler="random")
    resumed_files = SweepFiles(resumed.study_dir)
    study = Sweep(resumed, ScriptedRunner(), on_trial=resumed_files.after_trial).run()
    rows = list(csv.DictReader(open(settings.study_dir / "trials.csv")))
    assert [int(r["number"]) for r in rows] == [t.number for t in study.trials]
    assert len(study.trials) > 6


def test_the_pareto_front_is_every_config_nothing_beats_on_both(tmp_path):
    """pareto_front's one pass by memory keeps exactly the configs no other config beats on
    tokens/s and memory together (ties on both kept), checked against every pair."""
    import random

    from autotune.sweep.pick.artifacts import pareto_front
    from autotune.sweep.pick.measurements import Measured

    rng = random.Random(0)
    for _ in range(200):
        configs = {}
        for number in range(rng.randint(1, 12)):
            trial = optuna.trial.create_trial(
                params={}, distributions={}, value=1.0,
                user_attrs={"result": {"peak_mem_bytes": rng.choice([1, 2, 3, 4]) * 2**20}})
            trial.number = number
            configs[str(number)] = Measured(trial, [trial], [rng.random()],
                                            [float(rng.choice([10, 20, 30]))])
        points = [(m.trial.number, m.tokens_per_s_mean, m.peak_mem_bytes)
                  for m in configs.values()]
        beaten = {n for n, tps, mem in points for _, o_tps, o_mem in points
                  if o_tps >= tps and o_mem <= mem and (o_tps > tps or o_mem < mem)}
        expected = sorted((mem, n) for n, _, mem in points if n not in beaten)
        assert [t.number for t in pareto_front(None, configs)] == [n for _, n in expected]


def test_tracing_weighs_its_cost_on_the_traces_after_the_first():
    """The first trace pays the trace process's one-time imports (9 s against 4-5 s for the
    next ones on a slow 2-core machine, beside an 18 s probe): it alone never turns tracing
    off; the traces after it decide."""
    from autotune.sweep.feasibility.traced import TRACE_COST_SHARE, SubprocessTracer

    tracer = SubprocessTracer(lambda candidate, device: None, on_gpu=False, probe_wall_s=[18.0])
    tracer.trace_cost_s = [9.5]
    tracer.weigh_cost()
    assert tracer.unavailable is None
    tracer.trace_cost_s = [9.5, 4.5, 5.0]
    tracer.weigh_cost()
    assert tracer.unavailable is None
    tracer.trace_cost_s.append(18.0 * TRACE_COST_SHARE + 10)
    tracer.trace_cost_s.append(18.0 * TRACE_COST_SHARE + 10)
    tracer.weigh_cost()
    assert tracer.unavailable is not None and "a trace takes" in tracer.unavailable


def test_a_sweep_traces_only_the_configs_it_asks_about(tmp_path):
    """The check after each probe ("may anything untried still fit?") starts no trace: a trace
    only adds OOMs, so the other rules answer it. It used to trace a random untried config or
    two after every probe (README command 1's sweep: 24 traces for 17 probes, 11 to 13 without
    them; 2 s a trace on a CPU, a 7B's 30-155 s on a GPU), configs the sweep never asked
    about. A stand-in tracer exact to the scripted device (the real trace process is in
    test_trace.py) records what it traced."""
    space = load_search_space("cpu-demo")
    model = ModelRunner(limit_bytes=1)
    peaks = sorted(max(model.phase_bytes(space.config_for(p)).values()) for p in space.grid())
    limit = peaks[len(peaks) // 2]  # half the grid fits: most configs sit near the wall
    runner = ModelRunner(limit_bytes=limit)

    class ExactTracer(StandInTracer):
        def __init__(self):
            self.traced: list[str] = []

        def traced_bytes(self, candidate, device):
            if candidate.key not in self.traced:
                self.traced.append(candidate.key)
            return runner.phase_bytes(candidate.config)

        def answered(self, candidate):
            return candidate.key in self.traced

    tracer = ExactTracer()
    request = ProbeRequest(model="tiny-qwen2.5", device=Device("cpu", limit_bytes=limit))
    settings = settings_for(tmp_path, max_trials=6, seed=3, sampler="random", request=request)
    study = Sweep(settings, runner, tracer=tracer).run()
    asked = {space.candidate({k: t.params[k] for k in space.params}).key for t in study.trials}
    assert len(runner.calls) == 6 and tracer.traced  # the sweep traced, and probed 6
    assert set(tracer.traced) <= asked, set(tracer.traced) - asked
    by_trace = [t for t in study.trials if t.user_attrs.get("predicted_by") == "trace"]
    assert by_trace  # the traces still skip what the scripted device cannot hold
