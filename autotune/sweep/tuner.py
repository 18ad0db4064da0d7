"""The sweep: Optuna ask/tell over real probes, side by side, OOM-aware, resumable.

The driver alone talks to Optuna; probes run in the runner, one per slot (parallel.py), each
on a thread of its own that only waits for the runner. Each trial is asked for params from the
search space, then: a config another trial owns reuses that trial's result, or waits for it
(never probed twice, also across drivers: sharing.py); one that breaks a rule is recorded as
invalid without running; one proven infeasible is recorded as predicted; anything else is
probed, its result saved beside its log, then told (objective.py says how). Pending trials are
RUNNING in the study, so TPE's constant liar keeps parallel asks apart. A probe lost with its
node is retried once. A killed driver leaves its trials RUNNING; the next run completes each
from its saved result, or fails it and queues its params again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from autotune.config import Knobs, describe_params
from autotune.errors import ConfigError
from autotune.files import write_text_atomic
from autotune.probe.measure.result import ProbeResult, ProbeStatus
from autotune.runners import Runner
from autotune.sweep.execution import interrupts
from autotune.sweep.execution.parallel import ProbePool
from autotune.sweep.feasibility.dominance import Dominance
from autotune.sweep.feasibility.frontier import Frontier
from autotune.sweep.feasibility.prescreen import Prescreen
from autotune.sweep.feasibility.screen import Feasibility
from autotune.sweep.feasibility.trace_cache import TRACES_FILE, TraceCache
from autotune.sweep.feasibility.traced import SubprocessTracer, Tracer
from autotune.sweep.pick.composed import best_composed, moving_knobs
from autotune.sweep.pick.measurements import SEPARATION_Z, Measured, study_fixed
from autotune.sweep.pick.pooled import probe_times
from autotune.sweep.progress import Progress, SilentProgress, SweepState
from autotune.sweep.space.params import params_key
from autotune.sweep.space.search_space import Candidate
from autotune.sweep.study import trial_files
from autotune.sweep.study.heartbeat import HEARTBEAT_ATTR, Heartbeat
from autotune.sweep.study.objective import OBJECTIVES
from autotune.sweep.study.record import tell_given_up, tell_result, tell_reused
from autotune.sweep.study.settings import SAMPLERS, SweepSettings
from autotune.sweep.study.sharing import (
    STALE_AFTER_HEARTBEATS,
    WAIT,
    Holdings,
    holds_config,
    is_asked,
    is_stale,
    owner_of,
    take_over,
    trial_by_number,
)
from autotune.sweep.study.storage import StudyLock, open_study
from autotune.sweep.tally import Tally

if TYPE_CHECKING:
    from concurrent.futures import Future

    from optuna import Study, Trial
    from optuna.trial import FrozenTrial

STUCK_AFTER_ASKS = 8  # asks in a row that probe nothing new before an unexplored config is queued
NEIGHBOUR_EVERY = 3  # after the startup probes, every second probe a neighbour of the best
MAX_ASKS_WITHOUT_PROBE = 200  # a space too large to list whose sampler only repeats itself


@dataclass(frozen=True)
class Stop:
    """Why a sweep stops: `budget`, the option whose budget (--trials, --timeout,
    --patience) ended it with configs left to try; `counts_others` when it waits for other
    drivers' probes."""

    reason: str
    counts_others: bool
    budget: str | None = None


@dataclass
class Pending:
    """A trial asked and not yet told: probing in a slot, waiting for its owner, or ready."""

    trial: Trial
    params: Knobs
    owner: int | None = None  # the trial whose result this one waits for


class Sweep:
    """Runs one study to a stop: --trials, --timeout, --patience or an exhausted space."""

    def __init__(self, settings: SweepSettings, runner: Runner,
                 progress: Progress | None = None,
                 on_trial: Callable[[Study], object] | None = None,
                 tracer: Tracer | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if settings.objective not in OBJECTIVES:
            raise ConfigError(
                f"--objective {settings.objective!r}: valid: {', '.join(OBJECTIVES)}")
        if settings.sampler not in SAMPLERS:
            raise ConfigError(f"sampler {settings.sampler!r}: valid: {', '.join(SAMPLERS)}")
        self.settings, self.runner = settings, runner
        self.progress = progress or SilentProgress()
        self.on_trial = on_trial  # called with the study after every told trial (artifacts)
        self.space = settings.space
        self.n_params = len(self.space.params)
        self.clock, self.started_s = clock, clock()  # what --timeout counts: the wall clock
        # (a replay counts its probes' device time); the progress view keeps the wall clock
        self.state = SweepState(settings.study_name, settings.max_trials, settings.timeout_s,
                                slots=len(settings.slots))
        self.holdings = Holdings(self.n_params)  # which trial holds each config
        self.keys: dict[int, str] = {}  # finished trials' params_key (sharing.held_key)
        self.stuck_asks = 0  # asks in a row that probed nothing
        self.neighbour_at = -1  # the probe count a neighbour was last queued at
        self.feasibility = self.feasibility_rules(tracer)
        self.frontier = Frontier(self.space, self.feasibility, settings.seed)
        self.nothing_fits: str | None = None  # why nothing left could fit, once known
        self.tracing_stopped = False  # said that tracing turned itself off
        self.tally = Tally(self.state, self.feasibility, settings.objective, self.space)
        self.pool: ProbePool[Pending] = ProbePool(runner, list(settings.slots))  # probing now
        self.waiting: dict[int, Pending] = {}  # trial number -> a trial waiting for its owner
        self.ready: list[Pending] = []  # trials whose owner died: to probe at the next free slot
        self.others_running = 0  # probes other drivers run in this study now
        self.said_waiting = False  # said the sweep waits for other drivers' probes to end
        self.stopped: Stop | None = None  # why the loop ended (None: interrupted or running)
        self.steps_here = 0  # trials this run settled or started (one before --timeout)
        self.shared = False  # set by run(): other drivers may share the storage
        self.stale_after_s = settings.heartbeat_s * STALE_AFTER_HEARTBEATS
        self.heartbeat: Heartbeat | None = None  # shared storage: our trials' heartbeats
        self.trials: list[FrozenTrial] = []  # the study's trials as refresh() last read them
        self.study: Study | None = None  # the Optuna study, once opened
        self.where = ""  # where it lives: the SQLite file, journal or database URL

    def feasibility_rules(self, tracer: Tracer | None) -> Feasibility:
        """The rules that skip what must not fit, as the settings turn them on: dominance,
        the memory model's pre-screen, and traces of the built-in step (weighed against the
        probes' time; `tracer` stands in for the trace process)."""
        settings = self.settings
        request = settings.request
        dominance = Dominance(self.space.directions, self.space.batches_by_tokens,
                              request.device.on_gpu) if settings.prune_dominated else None
        prescreen = Prescreen.for_request(request, settings.prescreen,
                                          settings.node_host_bytes, settings.node_trainer)
        if prescreen is None or not settings.prescreen:
            tracer = None
        elif tracer is None and settings.trace and settings.command is None:
            tracer = SubprocessTracer(
                lambda candidate, device: dataclasses.replace(settings.request_for(candidate),
                                                              device=device),
                request.device.on_gpu, self.state.probe_wall_s, on_trace=self.tracing,
                free_cores=self.free_cores,
                cache=TraceCache(settings.study_dir / TRACES_FILE))
        return Feasibility(request.device, dominance, prescreen, tracer)

    def free_cores(self) -> tuple[int, ...] | None | Literal[False]:
        """Where a trace may run now: a free slot's cores (None: that slot is not pinned, and
        no probe runs beside it unpinned), False while every slot runs a probe."""
        slot = self.pool.free_slot()
        return False if slot is None else slot.cpu_ids

    def say_if_tracing_stopped(self) -> None:
        """Tracing turned itself off (its process died, a trace timed out, a config it cannot
        follow, traces costlier than probes): said once, in one line."""
        tracer = self.feasibility.tracer
        if tracer is not None and tracer.unavailable and not self.tracing_stopped:
            self.tracing_stopped = True
            self.progress.note(self.state, f"tracing off: {tracer.unavailable}; the memory "
                               "model's pre-screen goes on")

    def tracing(self, params: Knobs | None) -> None:
        """The tracer starts (params) or ends (None) a trace: shown, as a probe is."""
        self.state.tracing = params
        if params is not None:
            self.progress.trace_started(self.state, describe_params(params))

    # -- study -----------------------------------------------------------------------------

    def resume(self, study: Study) -> None:
        """Finish or re-queue trials a dead driver left RUNNING; learn what is done. On a
        shared storage only trials whose heartbeat stopped are dead; the rest run elsewhere."""
        import optuna
        from optuna.trial import TrialState

        now_s = time.time()
        study_dir = self.settings.study_dir
        for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if self.shared and not is_stale(frozen, now_s, self.stale_after_s):
                continue
            result = None
            if is_asked(frozen, self.n_params) and frozen.params and \
                    frozen.user_attrs.get("waiting_on") is None:
                config = self.space.config_for(frozen.params)
                result = trial_files.read_saved_result(study_dir, frozen.number, config)
            if result is not None:  # the probe finished; its driver died before telling it
                with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                    self.tell(study, optuna.Trial(study, frozen._trial_id), result,
                              probed=True)
                continue
            trial_files.remove_partial_files(study_dir, frozen.number)
            take_over(study, frozen, "the driver stopped while this trial ran",
                      is_asked(frozen, self.n_params))
        self.refresh(study)
        if not study.trials:
            study.enqueue_trial(self.space.safe_params(), user_attrs={"origin": "safe"})
            base = self.settings.base_params
            if base and params_key(base) != params_key(self.space.safe_params()):
                study.enqueue_trial(base, user_attrs={"origin": "base"})

    def refresh(self, study: Study) -> None:
        """Read the study: fold in trials finished here or by other drivers, note what every
        trial holds, keep our running trials' heartbeats fresh, take over dead drivers' trials,
        and settle trials waiting for an owner that has finished."""
        trials = self.trials = study.get_trials(deepcopy=False)
        now_s = time.time()
        for frozen in trials:
            self.tally.fold(frozen)
        mine = {p.trial.number for p in self.pending()}
        self.others_running = self.holdings.scan(study, trials, mine, now_s,
                                                 self.stale_after_s if self.shared else None)
        if self.heartbeat is not None:  # beaten from its thread, whatever the loop does
            self.heartbeat.hold(p.trial for p in self.pending())
        for number, pending in list(self.waiting.items()):
            self.settle_waiting(study, trials, number, pending)

    def settle_waiting(self, study: Study, trials: list[FrozenTrial], number: int,
                       pending: Pending) -> None:
        import optuna

        assert pending.owner is not None
        owner = trials[pending.owner]
        if not owner.state.is_finished():
            return
        if holds_config(owner, self.n_params):
            del self.waiting[number]
            self.reuse(study, pending.trial, owner)
            return
        new_owner = owner_of(trials, number, params_key(pending.params), self.n_params,
                             keys=self.keys)
        if new_owner == WAIT:
            return
        pending.owner = new_owner
        try:
            pending.trial.set_user_attr("waiting_on", new_owner)
        except optuna.exceptions.UpdateFinishedTrialError:  # taken over while this driver
            del self.waiting[number]  # was blocked past its heartbeat: the config is
            return  # its owner's business
        if new_owner is None:  # the owner died without a result: this trial probes it
            del self.waiting[number]
            self.ready.append(pending)

    def pending(self) -> list[Pending]:
        return [*self.pool.tags(), *self.waiting.values(), *self.ready]

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> Study:
        study_dir = self.settings.study_dir
        new = not study_dir.exists()  # a new study that cannot open leaves nothing behind
        with contextlib.ExitStack() as held:
            try:
                study_dir.mkdir(parents=True, exist_ok=True)  # one driver writes its files,
                lock = held.enter_context(  # whatever the storage
                    StudyLock(study_dir, shared=self.settings.storage is not None))
                study, opened = open_study(self.settings)
                lock.claim()
            except BaseException:
                if new:
                    shutil.rmtree(study_dir, ignore_errors=True)
                raise
            self.shared, self.study, self.where = opened.shared, study, opened.where
            if self.shared:
                self.heartbeat = Heartbeat(opened.storage, self.settings.heartbeat_s)
                held.callback(self.heartbeat.stop)
                self.heartbeat.start()
            self.resume(study)
            self.progress.started(self.state)
            if (unreachable := interrupts.unreachable_note()) is not None:
                self.progress.note(self.state, unreachable)
            try:
                self.loop(study)
            except BaseException:
                self.abandon(study)  # Ctrl-C, SIGTERM or a broken runner: nothing half-told
                raise
            finally:
                self.pool.close()
                self.feasibility.close()
                if self.on_trial is not None:
                    with contextlib.suppress(Exception):  # never mask why the sweep stopped
                        self.on_trial(study)
                self.progress.finished(self.state)
            return study

    def loop(self, study: Study) -> None:
        while True:
            interrupts.raise_if_interrupted()  # at least once a second (the wait below)
            self.settle_probes(study)
            self.refresh(study)
            stop = self.stop_reason()
            if stop is None and self.nothing_fits is None and \
                    self.frontier.learned_something():  # a sweep that stops anyway (--trials
                self.nothing_fits = self.frontier.nothing_fits(  # reached) traces nothing more
                    self.holdings.seen, self.trials)
                stop = self.stop_reason()
            if stop is None and not self.pool.full():
                self.step(study)
                continue
            if stop is not None and not self.pool:
                if not (stop.counts_others and self.others_running):
                    self.state.stop_reason, self.stopped = stop.reason, stop
                    self.release(study)
                    return
                for pending in self.ready:  # never probed here now: queued again for whoever
                    self.give_up(study, pending, "interrupted", requeue=True)  # goes on, so
                self.ready = []  # two stopping drivers never wait on each other's
                if not self.said_waiting:
                    self.said_waiting = True
                    self.progress.note(self.state, f"{stop.reason}; waiting for the "
                                       f"{self.others_running} probe(s) other drivers run")
            self.pool.wait(timeout_s=min(1.0, self.settings.heartbeat_s))

    def stop_reason(self) -> Stop | None:
        """Why the sweep stops now, if it does. A stop that counts other drivers' running
        probes waits for them: a probe whose driver died is taken over once its heartbeat is
        stale and run here, so the study never ends with a trial left RUNNING."""
        s, state = self.settings, self.state
        if self.nothing_fits is not None:
            return Stop(self.nothing_fits, counts_others=False)
        started = state.probes + len(self.pool) + self.others_running
        if s.max_trials is not None and started >= s.max_trials:
            return Stop(f"reached --trials {s.max_trials}", counts_others=True,
                        budget="--trials")
        if s.timeout_s is not None and self.steps_here and \
                self.clock() - self.started_s >= s.timeout_s:  # every run makes progress:
            return Stop(f"reached --timeout {s.timeout_s:.0f} s",  # one trial, as Optuna's
                        counts_others=False, budget="--timeout")  # study.optimize(timeout=)
            # runs one however long opening and resuming the study took
        if s.patience is not None and self.tally.since_improvement >= s.patience:
            return Stop(f"no better config in the last {s.patience} probes (--patience)",
                        counts_others=False, budget="--patience")
        valid_keys = self.frontier.valid_keys
        # a queued trial holds its config but has not tried it (a probe a stop cut off, queued
        # again): it is asked and run before the space counts as exhausted
        if valid_keys is not None and valid_keys <= self.holdings.seen.keys() and \
                not self.ready and not self.holdings.queued:
            return Stop(f"space exhausted: all {len(valid_keys)} valid configs tried",
                        counts_others=True)
        if self.stuck_asks >= MAX_ASKS_WITHOUT_PROBE:
            return Stop(f"the sampler proposed only known or invalid configs {self.stuck_asks} "
                        "times", counts_others=False)
        return None

    def step(self, study: Study) -> None:
        """Start one probe, or ask one trial and settle it: reuse, wait, invalid, predicted."""
        self.steps_here += 1
        if self.ready:
            self.submit(self.ready.pop(0))
            return
        if self.stuck_asks and self.stuck_asks % STUCK_AFTER_ASKS == 0:
            self.queue_unexplored(study)
            if self.nothing_fits is not None:
                return
        self.queue_neighbour(study)
        trial = study.ask(self.space.distributions())
        if self.heartbeat is not None:  # alive while it is traced (which may take a while)
            trial.set_user_attr(HEARTBEAT_ATTR, time.time())
            self.heartbeat.add(trial)
        params = dict(trial.params)
        try:
            owner = self.owner(study, trial.number, params_key(params))
        except BaseException:  # Ctrl-C: queued again as the sweep stops (release), never
            self.ready.insert(0, Pending(trial, params))  # left RUNNING
            raise
        if owner is not None:
            self.stuck_asks += 1
            frozen = trial_by_number(study, owner)
            if frozen.state.is_finished():
                self.reuse(study, trial, frozen)
                return
            trial.set_user_attr("waiting_on", owner)
            self.waiting[trial.number] = Pending(trial, params, owner=owner)
            return
        candidate = self.space.candidate(params)  # its config, made once
        if candidate.tied:  # the values the probe runs, shown wherever the trial is
            trial.set_user_attr("tied", candidate.tied)
        problems = candidate.problems
        if problems:
            result = ProbeResult(status=ProbeStatus.INVALID, message="; ".join(problems))
            self.tell(study, trial, result, probed=False)
            self.stuck_asks += 1
            self.finish(study, trial.number, f"invalid, not run: {problems[0]}")
            return
        try:  # the safe config is measured: its OOM ends it
            prediction = self.feasibility.predict(
                candidate, measure=candidate.key == params_key(self.space.safe_params()))
        except BaseException:  # Ctrl-C mid-trace: queued again as the sweep stops (release)
            self.ready.insert(0, Pending(trial, params))
            raise
        self.say_if_tracing_stopped()
        if prediction is not None:
            result = ProbeResult(status=ProbeStatus(prediction.status),
                                 message=prediction.reason, failed_phase=prediction.failed_phase)
            trial.set_user_attr("predicted_by", prediction.source)
            self.tell(study, trial, result, probed=False, predicted=True)
            self.stuck_asks += 1
            self.finish(study, trial.number, f"not run, {prediction.reason}")
            return
        self.stuck_asks = 0
        self.submit(Pending(trial, params), candidate)

    def owner(self, study: Study, number: int, key: str) -> int | None:
        """The trial that owns this config, once every lower trial is fully asked. Alone on
        the study, the trials read at the top of this loop turn are current: nothing was told
        since; with other drivers the storage is read again."""
        while True:
            owner = owner_of(study.get_trials(deepcopy=False), number, key, self.n_params,
                             keys=self.keys) if self.shared else \
                self.holdings.owner_of(number, key)
            if owner != WAIT:
                return owner
            time.sleep(0.05)  # another driver is between writing two params of a trial

    def submit(self, pending: Pending, candidate: Candidate | None = None) -> None:
        """Start the trial's probe on a free slot (`candidate`: its config, as the ask made
        it; else made here)."""
        try:  # a Ctrl-C code dropped since the loop last looked: no probe starts after it
            interrupts.raise_if_interrupted()
        except KeyboardInterrupt:
            self.ready.insert(0, pending)  # queued again as the sweep stops (release)
            raise
        number = pending.trial.number
        candidate = candidate or self.space.candidate(pending.params)
        request = self.tally.with_study_noise(self.settings.request_for(candidate))
        if self.settings.stop_slow and request.command is None:
            request = dataclasses.replace(request, stop_below=self.tally.stop_below())
        log_path = trial_files.log_path(self.settings.study_dir, number)
        slot = self.pool.start(request, log_path, pending)
        self.state.running[number] = candidate.ran
        where = f" on {slot.describe()}" if len(self.pool.slots) > 1 else ""
        self.progress.trial_started(self.state,
                                    f"trial {number}{where}: {describe_params(candidate.ran)}")

    def settle_probes(self, study: Study, done: set[Future[ProbeResult]] | None = None) -> None:
        """Tell every finished probe; one that says nothing about its config (lost with its
        node, killed from outside) is queued once more."""
        from optuna.exceptions import UpdateFinishedTrialError

        for pending, result in self.pool.finished(only=done):
            trial, params, number = pending.trial, pending.params, pending.trial.number
            self.state.running.pop(number, None)
            write_text_atomic(trial_files.result_path(self.settings.study_dir, number),
                              result.to_json())
            again = trial.user_attrs.get("origin") in ("retry", "lost-retry")
            retry = result.status.says_nothing and not again
            try:
                if retry:
                    trial.set_user_attr("requeued", True)
                line = self.tell(study, trial, result, probed=True)
                if result.status.says_nothing and again:
                    line += "; the second time: not run again in this sweep"
            except UpdateFinishedTrialError:
                line = ("another driver took this trial over (no heartbeat) and queued it "
                        "again; this result stays in logs/ only")
                retry = False
            if retry:
                study.enqueue_trial(params, user_attrs={"origin": "retry",
                                                        "requeued_from": number})
                line += "; queued once more"
            self.finish(study, number, line)
            calibration = self.feasibility.calibration_record(result.device_name)
            if result.status.reached_peaks and calibration is not None:
                study.set_user_attr("memory_calibration", calibration)

    def tell(self, study: Study, trial: Trial, result: ProbeResult, probed: bool,
             predicted: bool = False) -> str:
        return tell_result(study, trial, result, self.settings,
                           self.feasibility.capacity_bytes, probed, predicted)

    def reuse(self, study: Study, trial: Trial, earlier: FrozenTrial) -> None:
        import optuna

        try:
            tell_reused(study, trial, earlier)
        except optuna.exceptions.UpdateFinishedTrialError:  # another driver took it over
            return  # while this one was blocked past its heartbeat: nothing to tell
        self.finish(study, trial.number, f"same as trial {earlier.number}, result reused")

    def give_up(self, study: Study, pending: Pending, status: str, requeue: bool) -> None:
        with contextlib.suppress(Exception):  # another driver may have taken it over
            tell_given_up(study, pending.trial, pending.params, status, requeue)
        self.state.running.pop(pending.trial.number, None)

    def finish(self, study: Study, number: int, line: str) -> None:
        frozen = trial_by_number(study, number)
        self.tally.fold(frozen)
        if self.on_trial is not None and frozen.user_attrs.get("probed"):
            self.on_trial(study)  # after every probe, and once when the sweep stops
        self.progress.trial_finished(self.state, f"trial {number}: {line}")

    def release(self, study: Study) -> None:
        """At a stop: trials that never got to probe go back to the queue; those waiting for
        another driver's probe leave the config to it."""
        for pending in self.ready:
            self.give_up(study, pending, "interrupted", requeue=True)
        for pending in self.waiting.values():
            self.give_up(study, pending, "duplicate", requeue=False)
        self.ready, self.waiting = [], {}

    def abandon(self, study: Study) -> None:
        """The driver is stopping mid-sweep: keep probes that finished, kill the rest and
        queue their configs again, so the next run redoes exactly those."""
        ended, cut = self.pool.stop()
        with contextlib.suppress(Exception):
            self.settle_probes(study, ended)
        for pending in cut:
            self.give_up(study, pending, "interrupted", requeue=True)
        self.release(study)

    def queue_neighbour(self, study: Study) -> None:
        """TPE's sweeps: every NEIGHBOUR_EVERY-th probe after the sampler's startup probes is
        the untried config the study's probes compose better than the leader (the best
        config by its pooled figure, tally.py; pick/composed.py), or where none does an
        untried neighbour of the leader (frontier.py; one that moves a knob that can change
        its objective first, `moving`: on a split whose trainer paces the step, not the
        engine's knobs), queued for the next ask; once per probe slot, so a config predicted
        to OOM hands the slot to the sampler."""
        started = self.state.probes + len(self.pool)
        if self.settings.sampler != "tpe" or started < self.settings.n_startup_trials or \
                started % NEIGHBOUR_EVERY != NEIGHBOUR_EVERY - 1 or \
                self.neighbour_at == started:
            return
        leader = self.tally.leader()
        if leader is None:
            return
        self.neighbour_at = started
        composed = self.composed(leader.figure)
        if composed is not None:
            study.enqueue_trial(composed, user_attrs={"origin": "composed"})
            return
        params = self.frontier.neighbour(dict(leader.trial.params), self.holdings.seen,
                                         self.moving(leader))
        if params is not None:
            study.enqueue_trial(params, user_attrs={"origin": "neighbour"})

    def moving(self, leader: Measured) -> frozenset[str] | None:
        """The knobs whose moves can change the leader's objective, from its first probe's
        phases (pick/composed.py moving_knobs; a split's sides within the study's noise
        both pace); None where that probe timed none."""
        result = leader.trial.user_attrs.get("result") or {}
        if not result.get("phase_s"):
            return None
        knobs = {**study_fixed(self.study), **leader.trial.params}
        return moving_knobs(knobs, result["phase_s"], leader.phase_peak_mem_bytes(),
                            self.settings.objective,
                            SEPARATION_Z * (self.tally.step_cv() or 0.0))

    def composed(self, beat: float) -> Knobs | None:
        """The untried valid config the study's probes compose better than `beat` (the
        leader's figure; sweep/pick/composed.py: each phase from the probes that ran it), if
        the feasibility rules leave it open; None where none does."""
        fixed = study_fixed(self.study)  # as the pick's pooled figure reads them
        probes = [times for frozen in self.trials if (times := probe_times(frozen, fixed))]
        budgets = [b for frozen in self.trials
                   if isinstance(b := frozen.user_attrs.get("budget_bytes"), int)]
        untried = (self.frontier.params_of(key)
                   for key in self.frontier.untried(self.holdings.seen))
        found = best_composed(probes, untried, fixed, self.settings.objective,
                              min(budgets) if budgets else None, beat)
        if found is None:
            return None
        candidate = self.space.candidate(found.params)
        if candidate.problems or self.feasibility.predict(candidate) is not None:
            return None
        return found.params

    def queue_unexplored(self, study: Study) -> None:
        """The sampler keeps proposing known configs: queue an untried one that may fit, or
        stop when none is left that could."""
        params = self.frontier.pick_untried(self.holdings.seen)
        if params is not None:
            study.enqueue_trial(params, user_attrs={"origin": "unexplored"})
        else:
            self.nothing_fits = self.frontier.nothing_fits(self.holdings.seen, self.trials)
