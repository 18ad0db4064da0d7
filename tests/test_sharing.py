"""Parallel probes and shared studies, driven by a scripted runner on a real Optuna storage.

Probes are scripted (scripted_runner.SlowRunner: they take a fixed time and record what ran at
once); the storages are real: SQLite, and Optuna journal files that two drivers share from two
threads. Real probes across real processes, PostgreSQL and Ray are in test_distributed.py.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import optuna
import pytest
from load import busy_processes
from optuna.trial import TrialState
from scripted_runner import ScriptedRunner, SlowRunner, StandInTracer, scripted_result

from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest
from autotune.sweep.execution.parallel import Slot
from autotune.sweep.space.params import params_key
from autotune.sweep.space.search_space import load_search_space
from autotune.sweep.study.record import tell_result
from autotune.sweep.study.settings import SweepSettings
from autotune.sweep.study.sharing import ASK_GRACE_S, WAIT, Holdings, owner_of
from autotune.sweep.tuner import Sweep

REQUEST = ProbeRequest(model="tiny-qwen2.5", device=Device("cpu"))
TWO_SLOTS = (Slot(cpu_ids=(0,), cpu_threads=1), Slot(cpu_ids=(1,), cpu_threads=1))


def settings_for(tmp_path, name="s", **changes):
    fields = {"study_name": "s", "study_dir": tmp_path / name,
              "space": load_search_space("cpu-demo"), "request": REQUEST, **changes}
    return SweepSettings(**fields)


def probed_keys(study):
    return [params_key(t.params) for t in study.get_trials(deepcopy=False)
            if t.user_attrs.get("probed")]


def test_two_slots_run_two_probes_at_once_never_the_same_config(tmp_path):
    runner = SlowRunner(delay_s=0.3)
    study = Sweep(settings_for(tmp_path, max_trials=10, slots=TWO_SLOTS), runner).run()
    assert runner.max_running == 2 and runner.concurrent_duplicates == 0
    assert set(runner.overlaps) == {("(0,)", "(1,)")}  # side by side, each on its own core
    keys = probed_keys(study)
    assert len(keys) == len(set(keys)) == 10 == len(runner.calls)
    assert not study.get_trials(states=(TrialState.RUNNING,))


def test_parallel_resume_after_an_interrupt_runs_only_what_was_cut_off(tmp_path):
    first = SlowRunner(delay_s=0.3, interrupt_on_call=4)
    with pytest.raises(KeyboardInterrupt):
        Sweep(settings_for(tmp_path, max_trials=8, slots=TWO_SLOTS), first).run()
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 's/study.db'}")
    assert not study.get_trials(states=(TrialState.RUNNING,))
    cut = [t for t in study.trials if t.user_attrs.get("status") == "interrupted"]
    assert cut and all(t.user_attrs["requeued"] for t in cut)
    done_before = set(probed_keys(study))
    second = SlowRunner(delay_s=0.1)
    study = Sweep(settings_for(tmp_path, max_trials=8, slots=TWO_SLOTS), second).run()
    names = list(load_search_space("cpu-demo").params)
    rerun = {params_key({k: c[k] for k in names}) for c in second.calls}
    assert {params_key(t.params) for t in cut} <= rerun
    keys = probed_keys(study)
    assert len(keys) == len(set(keys)) == 8 and done_before <= set(keys)


def test_a_lost_probe_is_retried_once_then_kept_as_lost(tmp_path):
    safe = load_search_space("cpu-demo").safe_params()

    def lose(config, seen):  # the safe config's node dies once; the config 'mbs 4' always
        return (config.micro_batch_size_update == safe["micro_batch_size_update"]
                and config.micro_batch_size_experience == safe["micro_batch_size_experience"]
                and config.offload_params and seen == 0) or config.micro_batch_size_update == 4
    runner = SlowRunner(delay_s=0.0, lose=lose)
    base = {**safe, "micro_batch_size_update": 4}
    study = Sweep(settings_for(tmp_path, max_trials=4, base_params=base), runner).run()
    trials = study.trials
    assert trials[0].user_attrs["status"] == "lost" and trials[0].user_attrs["requeued"]
    retries = [t for t in trials if t.user_attrs.get("origin") == "retry"]
    by_source = {t.user_attrs["requeued_from"]: t for t in retries}
    assert by_source[0].params == safe and by_source[0].user_attrs["status"] == "ok"
    base_runs = [t for t in trials if t.params == base and t.user_attrs.get("probed")]
    assert [t.user_attrs["status"] for t in base_runs] == ["lost", "lost"]  # retried once only
    assert sum(c["micro_batch_size_update"] == 4 and c["offload_params"] == safe["offload_params"]
               and c["micro_batch_size_experience"] == safe["micro_batch_size_experience"]
               and c["gradient_checkpointing"] == safe["gradient_checkpointing"]
               for c in runner.calls) == 2


def run_drivers(sweeps) -> None:
    """Run each Sweep in a thread of its own, all at once (drivers on two machines); every
    one ends within 300 s and raises nothing."""
    errors: list[BaseException] = []

    def drive(sweep) -> None:
        try:
            sweep.run()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(sweep,)) for sweep in sweeps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads) and not errors, errors


def test_two_drivers_on_one_journal_share_the_work(tmp_path):
    """Two drivers (two machines: their own results dirs) on one journal file, at once."""
    journal = str(tmp_path / "study.journal")
    runners = [SlowRunner(delay_s=0.05), SlowRunner(delay_s=0.05)]
    run_drivers([Sweep(settings_for(tmp_path, f"driver{i}", max_trials=24, storage=journal,
                                    seed=i, prune_dominated=False), runners[i])
                 for i in range(2)])
    study = optuna.load_study(study_name="s", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(journal)))
    assert all(r.calls for r in runners)  # both drivers probed
    calls = [json.dumps(c, sort_keys=True) for r in runners for c in r.calls]
    assert len(calls) == len(set(calls))  # no config run twice, by either driver
    keys = probed_keys(study)
    assert len(keys) == len(set(keys)) == len(calls)  # every probe run is recorded: none lost
    assert 24 <= len(keys) <= 25  # the budget is the study's, not each driver's
    assert not study.get_trials(states=(TrialState.RUNNING,))
    numbers = [t.number for t in study.trials]
    assert len(numbers) == len(set(numbers))


def test_a_dead_drivers_trial_is_taken_over_a_live_ones_is_waited_for(tmp_path):
    """A dead driver's probe is failed and its config run here; a live driver's probe is never
    run twice: a trial asked its config waits for it, and the sweep does not end (its --trials
    counts that probe) until the live driver has told it."""
    journal = str(tmp_path / "study.journal")
    settings = settings_for(tmp_path, max_trials=2, storage=journal, heartbeat_s=0.5)
    Sweep(settings, ScriptedRunner()).run()
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(journal))
    study = optuna.load_study(study_name="s", storage=storage)
    space = settings.space
    grid = [p for p in space.valid_grid() if params_key(p) not in set(probed_keys(study))]
    dead, live = grid[0], grid[1]
    beats = {}
    for params, beat in ((dead, time.time() - 3600), (live, time.time())):
        study.enqueue_trial(params)
        beats[params_key(params)] = trial = study.ask(space.distributions())
        trial.set_user_attr("heartbeat_at", beat)
    live_trial = beats[params_key(live)]
    study.enqueue_trial(live)  # this driver will be asked the live driver's config
    told_s = []

    def live_driver() -> None:  # beats until this driver waits on its trial, then tells it
        while not [t for t in study.get_trials(deepcopy=False)
                   if t.user_attrs.get("waiting_on") == live_trial.number]:
            live_trial.set_user_attr("heartbeat_at", time.time())
            time.sleep(0.1)
        for _ in range(10):
            live_trial.set_user_attr("heartbeat_at", time.time())
            time.sleep(0.1)
        request = dataclasses.replace(REQUEST, config=space.config_for(live))
        tell_result(study, live_trial, scripted_result(request), settings, None, probed=True)
        told_s.append(time.monotonic())

    thread = threading.Thread(target=live_driver)
    thread.start()
    runner = ScriptedRunner()
    Sweep(settings_for(tmp_path, max_trials=6, storage=journal, heartbeat_s=0.5),
          runner).run()
    ended_s = time.monotonic()
    thread.join(timeout=30)
    assert told_s and told_s[0] <= ended_s  # the sweep ended after the live probe was told
    trials = study.get_trials(deepcopy=False)
    dead_trial = next(t for t in trials if t.params == dead)
    assert dead_trial.state == TrialState.FAIL and dead_trial.user_attrs["requeued"]
    ran = [json.dumps({k: c[k] for k in dead}, sort_keys=True) for c in runner.calls]
    assert ran.count(params_key(dead)) == 1  # its config was queued again and run once
    assert params_key(live) not in ran  # waited for, never run by this driver
    waited = [t for t in trials if t.user_attrs.get("waiting_on") == live_trial.number]
    assert waited and waited[0].user_attrs["reused_from"] == live_trial.number
    assert not study.get_trials(states=(TrialState.RUNNING,))


def test_owner_waits_for_a_lower_trial_still_being_asked(tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'o.db'}")
    space = load_search_space("cpu-demo")
    half = study.ask()  # a trial another driver is still asking: no params yet
    full = study.ask(space.distributions())
    trials = study.get_trials(deepcopy=False)
    key, n = params_key(full.params), len(space.params)
    assert owner_of(trials, full.number, key, n) == WAIT
    assert owner_of(trials, full.number, key, n, now_s=time.time() + 60) is None  # died asking
    assert half.number < full.number
    holdings = Holdings(n)  # the same rule over what a driver's scan read
    holdings.scan(study, trials, mine=set(), now_s=time.time(), stale_after_s=None)
    assert holdings.owner_of(full.number, key) == WAIT
    assert holdings.owner_of(full.number, key, now_s=time.time() + 60) is None


def test_holdings_read_each_finished_trial_once_and_agree_with_owner_of(tmp_path):
    """A driver's scan after every probe reads a finished trial once (its holding never
    changes) and still names the lowest holder of each config, queued and running trials
    included, as owner_of does over the whole study."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'h.db'}")
    space = load_search_space("cpu-demo")
    n = len(space.params)
    base = space.safe_params()
    configs = [dict(base, micro_batch_size_update=m) for m in (1, 2, 1, 4, 2)]
    holdings = Holdings(n)
    statuses = ["ok", "ok", "ok", "interrupted", "gpu_oom"]
    for params, status in zip(configs, statuses, strict=True):  # finished, in order
        study.enqueue_trial(params)
        trial = study.ask(space.distributions())
        trial.set_user_attr("status", status)
        study.tell(trial, state=TrialState.FAIL)
        holdings.scan(study, study.get_trials(deepcopy=False), mine=set(), now_s=time.time(),
                      stale_after_s=None)
    queued = dict(base, micro_batch_size_update=8)
    study.enqueue_trial(queued)  # a queued trial holds its config at once
    running = study.ask(space.distributions())  # pops the queued one: running, fully asked
    study.enqueue_trial(dict(base, micro_batch_size_update=4))  # a later copy of a dropped one
    trials = study.get_trials(deepcopy=False)
    holdings.scan(study, trials, mine={running.number}, now_s=time.time(), stale_after_s=None)
    assert holdings.read == {0, 1, 2, 3, 4}  # the finished trials, each read once
    assert [t.number for t in holdings.unfinished] == [5, 6]
    assert holdings.seen == {params_key(configs[0]): 0, params_key(configs[1]): 1,
                             params_key(queued): 5, params_key(configs[3]): 6}
    later = trials[-1].number + 1  # a trial asked after all of them
    for params in (*configs, queued, dict(base, micro_batch_size_experience=16)):
        key = params_key(params)
        for number in range(later + 1):
            assert holdings.owner_of(number, key) == owner_of(trials, number, key, n), \
                (params, number)


def test_a_dead_drivers_waiting_and_half_asked_trials_are_taken_over_mid_sweep(tmp_path):
    """A driver killed while one trial waited for another's result (or while asking one) leaves
    them RUNNING; a live driver's scan fails them once their heartbeat is stale, re-queuing
    nothing: the waited-for config is its owner's, a half-asked trial has no config."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'w.db'}")
    space = load_search_space("cpu-demo")
    owner = study.ask(space.distributions())
    waiting = study.ask(space.distributions())
    waiting.set_user_attr("waiting_on", owner.number)
    half = study.ask()  # died asking: no params
    queued = dict(owner.params, micro_batch_size_update=1)
    study.enqueue_trial(queued)
    popped = study.ask()  # died asking a config popped from the queue: no params yet
    now_s = time.time()
    for trial in (owner, waiting):
        trial.set_user_attr("heartbeat_at", now_s - 60)
    n = len(space.params)
    trials = study.get_trials(deepcopy=False)
    holdings = Holdings(n)
    holdings.scan(study, trials, mine=set(), now_s=now_s - 58, stale_after_s=4.0)
    assert [t.state for t in study.get_trials()] == [TrialState.RUNNING] * 4  # all still fresh
    others_running = holdings.scan(study, study.get_trials(deepcopy=False), mine=set(),
                                   now_s=now_s + ASK_GRACE_S + 1, stale_after_s=4.0)
    assert others_running == 0
    by_number = {t.number: t for t in study.get_trials()}
    assert by_number[waiting.number].state == TrialState.FAIL
    assert by_number[waiting.number].user_attrs["status"] == "duplicate"
    assert by_number[half.number].state == TrialState.FAIL
    assert by_number[half.number].user_attrs["status"] == "abandoned"
    assert not by_number[half.number].user_attrs.get("requeued")
    assert by_number[popped.number].user_attrs["status"] == "interrupted"
    again = study.get_trials(states=(TrialState.WAITING,))
    # the probing trial's config and the popped one's are queued again; nothing else
    assert sorted(params_key(t.system_attrs["fixed_params"]) for t in again) == \
        sorted([params_key(owner.params), params_key(queued)])


def test_the_last_config_a_dead_driver_held_is_run_before_the_space_counts_as_exhausted(
        tmp_path):
    """Every config is seen, the last one only in a dead driver's RUNNING trial: the scan that
    takes it over queues it again after the study was read, and the sweep runs it instead of
    stopping with the space exhausted and the config still queued."""
    path = tmp_path / "two.yaml"
    path.write_text("params:\n  gradient_checkpointing: {type: bool}\n"
                    "fixed: {micro_batch_size_update: 1, micro_batch_size_experience: 2}\n")
    space = load_search_space(str(path))
    journal = str(tmp_path / "study.journal")
    settings = settings_for(tmp_path, space=space, max_trials=1, storage=journal,
                            heartbeat_s=0.5)
    Sweep(settings, ScriptedRunner()).run()
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(journal))
    study = optuna.load_study(study_name="s", storage=storage)
    (left,) = [p for p in space.valid_grid() if params_key(p) not in set(probed_keys(study))]
    study.enqueue_trial(left)
    dead = study.ask(space.distributions())
    # alive when the sweep starts (its resume leaves it be), dead a second later: the sweep
    # waits on it, then takes it over mid-sweep
    stale_after_s = Sweep(settings, ScriptedRunner()).stale_after_s
    dead.set_user_attr("heartbeat_at", time.time() - stale_after_s + 1.0)
    runner = ScriptedRunner()
    sweep = Sweep(dataclasses.replace(settings, max_trials=None), runner)
    sweep.run()
    assert [params_key({k: c[k] for k in left}) for c in runner.calls] == [params_key(left)]
    assert sweep.state.stop_reason == "space exhausted: all 2 valid configs tried"
    assert not study.get_trials(states=(TrialState.WAITING, TrialState.RUNNING))


class SlowTracer(StandInTracer):
    """Stands in for the trace process with a trace that takes `trace_s` and answers nothing
    (the memory model's pre-screen decides alone): what is under test is the driver's
    heartbeat while it is busy, not the trace (test_trace.py runs the real one)."""

    def __init__(self, trace_s: float) -> None:
        self.trace_s = trace_s
        self.calls = 0

    def traced_bytes(self, candidate, device):
        self.calls += 1
        time.sleep(self.trace_s)
        return None


def test_a_driver_busy_tracing_past_its_heartbeat_keeps_its_trials(tmp_path):
    """Two live drivers on one journal, a heartbeat of 0.5 s (a trial is dead after 2 s of
    silence) and traces of 3 s: the driver's heartbeat beats from a thread of its own while it
    traces, so no trial of a live driver is ever taken over and no config is probed twice
    (before: 3 of 6 trials were taken over, one config probed 3 times), beside one busy
    process per core."""
    journal = str(tmp_path / "study.journal")
    request = ProbeRequest(model="tiny-qwen2.5",
                           device=Device("cpu", 4 * 2**30, limit_bytes=500 * 2**20))
    tracers = [SlowTracer(3.0), SlowTracer(3.0)]  # past the 2 s a silent trial lives
    runners = [ScriptedRunner(), ScriptedRunner()]
    with busy_processes():  # on a loaded machine, as the outside run's was
        run_drivers([Sweep(settings_for(tmp_path, f"driver{i}", max_trials=6, storage=journal,
                                        seed=i, heartbeat_s=0.5, request=request,
                                        sampler="random"), runners[i], tracer=tracers[i])
                     for i in range(2)])
    assert all(t.calls for t in tracers), [t.calls for t in tracers]  # both traced
    study = optuna.load_study(study_name="s", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(journal)))
    taken = [t.number for t in study.trials
             if t.user_attrs.get("status") in ("interrupted", "duplicate", "abandoned")]
    assert taken == [], [(t.number, t.user_attrs) for t in study.trials if t.number in taken]
    calls = [json.dumps(c, sort_keys=True) for r in runners for c in r.calls]
    assert len(calls) == len(set(calls))  # no config probed twice
    assert not study.get_trials(states=(TrialState.RUNNING,))
