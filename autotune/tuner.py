"""The sweep: Optuna ask/tell over real probes, OOM-aware, resumable.

The driver alone talks to Optuna. Each trial is asked for params from the search space, then:
a combination seen before reuses its result (never probed twice); one that breaks a rule is
recorded as invalid without running; anything else is probed by the runner, its result saved
beside its log, then told (objective.py says how). A killed driver leaves at most one trial
RUNNING; the next run with the same study completes it from its saved result, or marks it
failed and queues its params again.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune import __version__
from autotune.config import format_bytes
from autotune.errors import ConfigError
from autotune.feasibility import Feasibility
from autotune.objective import OBJECTIVES, directions, objective_names, scalar, score
from autotune.progress import Progress, SilentProgress, SweepState
from autotune.report import describe
from autotune.result import ProbeRequest, ProbeResult, ProbeStatus, write_text_atomic
from autotune.runners import Runner
from autotune.search_space import SearchSpace
from autotune.storage import StudyLock, use_wal

SAMPLERS = ("tpe", "random")
STUCK_AFTER_ASKS = 8  # asks in a row that probe nothing new before an unexplored config is queued
MAX_ASKS_WITHOUT_PROBE = 200  # a space too large to list whose sampler only repeats itself


@dataclass(frozen=True)
class SweepSettings:
    """Everything that defines a sweep; the study stores what must not change on resume."""

    study_name: str
    study_dir: Path  # results/<study>/
    space: SearchSpace
    request: ProbeRequest  # the template: model, device, limits; config replaced per trial
    objective: str = "throughput_per_memory"
    headroom: float = 0.10
    max_trials: int | None = None  # probes run in the study, resumed runs included
    timeout_s: float | None = None  # no new probe starts after this many seconds of this run
    patience: int | None = None  # stop after this many probes without a better feasible one
    seed: int = 0
    sampler: str = "tpe"
    n_startup_trials: int = 5
    base_params: dict[str, Any] | None = None  # queued after the safe config (--base-config)
    prune_dominated: bool = True  # record configs a measured OOM proves infeasible, unrun
    prescreen: bool = True  # also those the calibrated memory model puts well past capacity
    storage_url: str | None = None  # default: sqlite in study_dir
    trainer: str | None = None  # "easyr1 on 1x8 GPUs": its rules decide which configs are valid

    def identity(self) -> dict[str, Any]:
        """What a resumed study must share with the run that created it: anything that changes
        what a probe measures or what counts as feasible (not GPU ids, threads or timeouts)."""
        request = self.request
        return {"model": request.model, "model_path": request.model_path,
                "objective": self.objective, "headroom": self.headroom,
                "search_space_hash": self.space.space_hash, "device": request.device,
                "gpu_memory_limit_bytes": request.gpu_memory_limit_bytes,
                "reserve_gpu_memory_bytes": request.reserve_gpu_memory_bytes,
                "host_memory_limit_bytes": request.host_memory_limit_bytes,
                "dtype": request.dtype, "warmup_steps": request.warmup_steps,
                "timed_steps": request.timed_steps, "trainer": self.trainer}


def params_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)


def result_attrs(result: ProbeResult) -> dict[str, Any]:
    """A result as stored in the trial's user attrs (the output tail stays in the log)."""
    data = json.loads(result.to_json())
    data.pop("stderr_tail", None)
    return data


class Sweep:
    """Runs one study to a stop: --trials, --timeout, --patience or an exhausted space."""

    def __init__(self, settings: SweepSettings, runner: Runner,
                 progress: Progress | None = None,
                 on_trial: Callable[[Any], None] | None = None) -> None:
        if settings.objective not in OBJECTIVES:
            raise ConfigError(
                f"--objective {settings.objective!r}: valid: {', '.join(OBJECTIVES)}")
        if settings.sampler not in SAMPLERS:
            raise ConfigError(f"sampler {settings.sampler!r}: valid: {', '.join(SAMPLERS)}")
        self.settings, self.runner = settings, runner
        self.progress = progress or SilentProgress()
        self.on_trial = on_trial  # called with the study after every told trial (artifacts)
        self.space = settings.space
        self.state = SweepState(settings.study_name, settings.max_trials, settings.timeout_s)
        self.rng = random.Random(settings.seed)
        self.seen: dict[str, int] = {}  # params_key -> number of the trial holding its result
        self.valid_keys = None
        grid = self.space.valid_grid()
        if grid is not None:
            self.valid_keys = {params_key(p) for p in grid}
        self.best_scalar: float | None = None
        self.since_improvement = 0
        self.capacity_bytes: int | None = None
        self.stuck_asks = 0  # asks in a row that probed nothing
        self.feasibility = Feasibility.for_request(settings.request, self.space.config_for,
                                                   settings.prune_dominated, settings.prescreen)

    # -- study -----------------------------------------------------------------------------

    def open_study(self) -> Any:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        settings = self.settings
        settings.study_dir.mkdir(parents=True, exist_ok=True)
        (settings.study_dir / "logs").mkdir(exist_ok=True)
        storage = settings.storage_url
        if storage is None:
            db_path = settings.study_dir / "study.db"
            use_wal(db_path)
            storage = f"sqlite:///{db_path}"
        if settings.sampler == "random":
            sampler = optuna.samplers.RandomSampler(seed=settings.seed)
        else:
            sampler = optuna.samplers.TPESampler(
                seed=settings.seed, n_startup_trials=settings.n_startup_trials)
        study = optuna.create_study(
            study_name=settings.study_name, storage=storage, sampler=sampler,
            directions=directions(settings.objective), load_if_exists=True)
        identity = settings.identity()
        stored = study.user_attrs.get("identity")
        if stored is None:
            study.set_user_attr("identity", identity)
            study.set_user_attr("objective_names", objective_names(settings.objective))
            study.set_user_attr("search_space", {
                "source": self.space.source, "hash": self.space.space_hash,
                "params": {k: v.as_dict() for k, v in self.space.params.items()},
                "fixed": self.space.fixed})
            study.set_user_attr("request", json.loads(settings.request.to_json()))
            study.set_user_attr("autotune_version", __version__)
            study.set_user_attr("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        else:
            changed = [f"{k} was {stored.get(k)!r}, now {v!r}" for k, v in identity.items()
                       if stored.get(k) != v]
            if changed:
                raise ConfigError(
                    f"study {settings.study_name} in {settings.study_dir} was started with a "
                    f"different setup ({'; '.join(changed)}); resume it with the original "
                    "search space and options, or pick a new --study")
        return study

    def resume(self, study: Any) -> None:
        """Finish or re-queue trials a killed driver left RUNNING; learn what is done."""
        import optuna
        from optuna.trial import TrialState

        for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            trial = optuna.Trial(study, frozen._trial_id)
            saved = self.result_path(frozen.number)
            if saved.exists() and frozen.params:
                result = ProbeResult.from_json(saved.read_text())
                self.tell(study, trial, frozen.params, result, probed=True)
                continue
            trial.set_user_attr("status", "interrupted")
            trial.set_user_attr("reason", "the driver stopped while this trial ran")
            study.tell(trial, state=TrialState.FAIL)
            if frozen.params:
                study.enqueue_trial(frozen.params, user_attrs={
                    "origin": "requeued", "requeued_from": frozen.number})
        for frozen in study.get_trials(deepcopy=False):
            self.account(frozen)
        if not study.trials:
            study.enqueue_trial(self.space.safe_params(), user_attrs={"origin": "safe"})
            base = self.settings.base_params
            if base and params_key(base) != params_key(self.space.safe_params()):
                study.enqueue_trial(base, user_attrs={"origin": "base"})

    def account(self, frozen: Any) -> None:
        """Fold one finished trial into the counts, the dedupe table and the best so far."""
        from optuna.trial import TrialState

        attrs = frozen.user_attrs
        status = attrs.get("status")
        if frozen.state not in (TrialState.COMPLETE, TrialState.FAIL) or \
                status in (None, "interrupted"):
            return
        if frozen.params:
            self.seen.setdefault(params_key(frozen.params), frozen.number)
        if not attrs.get("probed"):
            predicted = attrs.get("predicted") and attrs.get("reused_from") is None
            self.state.counts["predicted" if predicted else "skipped"] += 1
            return
        self.state.probes += 1
        result = attrs.get("result") or {}
        capacity = result.get("device_limit_bytes") or result.get("device_capacity_bytes")
        self.feasibility.record(frozen.number, frozen.params, status, result.get("failed_phase"),
                                result.get("phase_peak_mem_bytes"), capacity)
        if result.get("probe_wall_s"):
            self.state.probe_wall_s.append(result["probe_wall_s"])
        if status == "ok":
            self.state.counts["ok"] += 1
        elif ProbeStatus(status).is_oom:
            self.state.counts["oom"] += 1
        else:
            self.state.counts["failed"] += 1
        self.capacity_bytes = self.capacity_bytes or capacity
        value = scalar(frozen.values, self.settings.objective) \
            if attrs.get("feasible") and frozen.values else None
        if value is not None and (self.best_scalar is None or value > self.best_scalar):
            self.best_scalar = value
            self.since_improvement = 0
            self.state.best = (f"trial {frozen.number}: {describe(frozen.params)}, "
                               f"{result['tokens_per_s']:,.1f} tok/s, peak "
                               f"{format_bytes(result['peak_mem_bytes'])}")
        else:
            self.since_improvement += 1

    def result_path(self, number: int) -> Path:
        return self.settings.study_dir / "logs" / f"trial-{number:05d}.result.json"

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> Any:
        self.settings.study_dir.mkdir(parents=True, exist_ok=True)
        with StudyLock(self.settings.study_dir):
            study = self.open_study()
            self.resume(study)
            self.progress.started(self.state)
            try:
                while (reason := self.stop_reason()) is None:
                    self.step(study)
                self.state.stop_reason = reason
            finally:
                self.progress.finished(self.state)
            return study

    def stop_reason(self) -> str | None:
        s, state = self.settings, self.state
        if s.max_trials is not None and state.probes >= s.max_trials:
            return f"reached --trials {s.max_trials}"
        if s.timeout_s is not None and time.monotonic() - state.started_s >= s.timeout_s:
            return f"reached --timeout {s.timeout_s:.0f} s"
        if s.patience is not None and self.since_improvement >= s.patience:
            return f"no better config in the last {s.patience} probes (--patience)"
        if self.valid_keys is not None and self.valid_keys <= self.seen.keys():
            return f"space exhausted: all {len(self.valid_keys)} valid configs tried"
        if self.stuck_asks >= MAX_ASKS_WITHOUT_PROBE:
            return f"the sampler proposed only known or invalid configs {self.stuck_asks} times"
        return None

    def step(self, study: Any) -> None:
        """Ask one trial and settle it: reuse, invalid, or a real probe."""
        from optuna.trial import TrialState

        if self.stuck_asks and self.stuck_asks % STUCK_AFTER_ASKS == 0:
            self.queue_unexplored(study)
        trial = study.ask(self.space.distributions())
        params = dict(trial.params)
        key = params_key(params)
        self.state.current, self.state.current_number = params, trial.number
        earlier = self.seen.get(key)
        if earlier is not None:
            frozen = study.get_trials(deepcopy=False)[earlier]
            for k, v in frozen.user_attrs.items():
                if k not in ("origin", "requeued_from"):
                    trial.set_user_attr(k, v)
            trial.set_user_attr("probed", False)
            trial.set_user_attr("reused_from", earlier)
            for k, v in frozen.constraints.items():
                trial.set_constraint(k, v)
            if frozen.state == TrialState.COMPLETE:
                study.tell(trial, list(frozen.values))
            else:
                study.tell(trial, state=TrialState.FAIL)
            self.stuck_asks += 1
            self.finish(study, trial.number, f"same as trial {earlier}, result reused")
            return
        problems = self.space.problems_for(params)
        if problems:
            result = ProbeResult(status=ProbeStatus.INVALID, message="; ".join(problems))
            self.tell(study, trial, params, result, probed=False)
            self.stuck_asks += 1
            self.finish(study, trial.number, f"invalid, not run: {problems[0]}")
            return
        prediction = self.feasibility.predict(params)
        if prediction is not None:
            result = ProbeResult(status=ProbeStatus(prediction.status),
                                 message=prediction.reason, failed_phase=prediction.failed_phase)
            trial.set_user_attr("predicted_by", prediction.source)
            self.tell(study, trial, params, result, probed=False, predicted=True)
            self.stuck_asks += 1
            self.finish(study, trial.number, f"not run, {prediction.reason}")
            return
        self.stuck_asks = 0
        self.progress.trial_started(self.state, f"trial {trial.number}: {describe(params)}")
        request = dataclasses.replace(self.settings.request,
                                      config=self.space.config_for(params))
        log_path = self.settings.study_dir / "logs" / f"trial-{trial.number:05d}.log"
        try:
            result = self.runner.run(request, log_path)
        except BaseException:
            # Ctrl-C or SIGTERM while probing: the runner killed the probe; run it next time.
            trial.set_user_attr("status", "interrupted")
            study.tell(trial, state=TrialState.FAIL)
            study.enqueue_trial(params, user_attrs={"origin": "requeued",
                                                    "requeued_from": trial.number})
            raise
        write_text_atomic(self.result_path(trial.number), result.to_json())
        line = self.tell(study, trial, params, result, probed=True)
        self.finish(study, trial.number, line)
        if result.ok and self.feasibility.calibration is not None:
            study.set_user_attr("memory_calibration",
                                self.feasibility.calibration_record(result.device_name))

    def tell(self, study: Any, trial: Any, params: dict[str, Any], result: ProbeResult,
             probed: bool, predicted: bool = False) -> str:
        from optuna.trial import TrialState

        verdict = score(result, self.settings.objective, self.settings.headroom,
                        self.capacity_bytes)
        log = self.settings.study_dir / "logs" / f"trial-{trial.number:05d}.log"
        attrs = {"status": result.status.value, "probed": probed, "predicted": predicted,
                 "feasible": verdict.feasible,
                 "reason": result.message if predicted else verdict.reason,
                 "budget_bytes": verdict.budget_bytes,
                 "binding_phase": verdict.binding_phase,
                 "log": str(log.relative_to(self.settings.study_dir)) if log.exists() else None,
                 "result": result_attrs(result)}
        for k, v in attrs.items():
            trial.set_user_attr(k, v)
        for k, v in verdict.constraints.items():
            trial.set_constraint(k, v)
        if verdict.state == "fail":
            study.tell(trial, state=TrialState.FAIL)
        else:
            study.tell(trial, list(verdict.values))
        if verdict.feasible:
            return (f"ok, {result.tokens_per_s:,.1f} tok/s, peak "
                    f"{format_bytes(result.peak_mem_bytes)} of "
                    f"{format_bytes(verdict.budget_bytes)}")
        return verdict.reason

    def finish(self, study: Any, number: int, line: str) -> None:
        frozen = study.get_trials(deepcopy=False)[number]
        self.account(frozen)
        self.state.current = None
        if self.on_trial is not None:
            self.on_trial(study)
        self.progress.trial_finished(self.state, f"trial {number}: {line}")

    def queue_unexplored(self, study: Any) -> None:
        """The sampler keeps proposing known configs: queue one nobody has tried."""
        if self.valid_keys is None:
            return
        left = sorted(self.valid_keys - self.seen.keys())
        if left:
            study.enqueue_trial(json.loads(self.rng.choice(left)),
                                user_attrs={"origin": "unexplored"})
