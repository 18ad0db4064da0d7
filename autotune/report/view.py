"""What the report shows, read once from a study: plain values, no plotly.

Every trial gets one outcome a reader can tell apart on the page: it fits; it ran but went over
the headroom budget; it ran out of memory (measured); it was predicted to (never run); the
trainer's rules refused it (invalid); or it failed otherwise (crash, timeout). Reused copies of
an earlier trial and trials still running are left out: they say nothing new.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import TYPE_CHECKING

from autotune.config import (
    DEFAULT_HEADROOM,
    KNOB_NAMES,
    PHASES,
    Knobs,
    ProbeConfig,
    budget_bytes,
    describe_engine,
    format_bytes,
)
from autotune.files import JsonObject
from autotune.hardware import usable_bytes
from autotune.probe.measure.result import ProbeRequest, ProbeStatus, study_probes_text
from autotune.sweep.pick.artifacts import best_trial, pareto_front, ranked_feasible
from autotune.sweep.pick.finalists import FinalistsRecord, current_record
from autotune.sweep.pick.measurements import by_config
from autotune.sweep.space.params import params_key
from autotune.sweep.study.sharing import ran_params

if TYPE_CHECKING:
    from optuna import Study
    from optuna.distributions import BaseDistribution
    from optuna.trial import FrozenTrial

OUTCOMES = ("fits", "stopped slow", "over headroom", "oom", "predicted oom", "invalid",
            "failed")


@dataclasses.dataclass(frozen=True)
class TrialView:
    number: int
    params: Knobs
    outcome: str  # one of OUTCOMES
    status: str  # the probe's own status (ok, gpu_oom, crash, ...)
    origin: str  # safe | base | sampler | retry | unexplored ...
    reason: str
    tokens_per_s: float | None
    peak_mem_bytes: int | None
    phase_peak_mem_bytes: dict[str, int]
    failed_phase: str | None
    started: datetime | None
    completed: datetime | None
    distributions: dict[str, BaseDistribution]


@dataclasses.dataclass(frozen=True)
class StudyView:
    name: str
    identity: JsonObject
    request: JsonObject  # the probe request as the study stored it
    parsed_request: ProbeRequest | None  # the same, read; None: another version's
    command: JsonObject | None
    searched: list[str]
    fixed: Knobs
    trials: list[TrialView]  # in trial order
    best: int | None
    start: int | None
    start_kind: str  # what the starting config is, for people
    front: list[int]  # Pareto front, by peak memory
    ranked: list[int]  # feasible probed trials, best first
    capacity_bytes: int | None  # what a probe could use: the cap, else the device
    device_capacity_bytes: int | None  # the device's own memory
    budget_bytes: int | None
    headroom: float  # the share of the device the budget keeps free
    device_name: str | None
    calibration: JsonObject | None
    reused: int
    versions: dict[str, str]  # what the probes ran with (vLLM's, where the real engine ran)
    finalists: FinalistsRecord | None = None  # the pick among the finalists (finalists.py)
    best_figures: tuple[float, int] | None = None  # the best config's mean tokens/s over its
    # probes and the most peak memory any of them held (measurements.py)
    contended: int = 0  # probes measured while other processes took the machine

    def trial(self, number: int) -> TrialView:
        return next(t for t in self.trials if t.number == number)

    def config_of(self, trial: TrialView) -> ProbeConfig:
        """The trial's full config: the request's, with the space's fixed knobs and its
        params (only for a study whose request could be read)."""
        assert self.parsed_request is not None
        changes = {**self.fixed, **trial.params}
        return self.parsed_request.config.replace(
            **{name: changes[name] for name in KNOB_NAMES if name in changes})

    @property
    def memory_unit(self) -> tuple[int, str]:
        """How the plots count memory: MiB for a small device (the CPU demo's cap), else GiB."""
        largest = self.capacity_bytes or max((t.peak_mem_bytes or 0 for t in self.trials),
                                             default=0)
        return (2**20, "MiB") if largest < 4 * 2**30 else (2**30, "GiB")

    def count(self, outcome: str) -> int:
        return sum(t.outcome == outcome for t in self.trials)


def outcome_of(attrs: JsonObject) -> str:
    stored = attrs.get("status")
    status = ProbeStatus.of(stored if isinstance(stored, str) else None)
    oom = status is not None and status.is_oom
    if attrs.get("predicted"):
        return "predicted oom" if oom else "invalid"
    if status is ProbeStatus.INVALID:
        return "invalid"
    if status is ProbeStatus.OK:
        return "fits" if attrs.get("feasible") else "over headroom"
    if status is ProbeStatus.SLOW:
        return "stopped slow" if attrs.get("feasible") else "over headroom"
    return "oom" if oom else "failed"


def trial_view(frozen: FrozenTrial) -> TrialView:
    attrs = frozen.user_attrs
    result = attrs.get("result") or {}
    return TrialView(
        number=frozen.number, params=ran_params(frozen), outcome=outcome_of(attrs),
        status=attrs.get("status", ""), origin=attrs.get("origin", "sampler"),
        reason=attrs.get("reason") or "", tokens_per_s=result.get("tokens_per_s"),
        peak_mem_bytes=result.get("peak_mem_bytes"),
        phase_peak_mem_bytes={p: int(v) for p, v in
                              (result.get("phase_peak_mem_bytes") or {}).items() if v},
        failed_phase=result.get("failed_phase"), started=frozen.datetime_start,
        completed=frozen.datetime_complete, distributions=dict(frozen.distributions))


def starting_trial(trials: list[TrialView], identity: JsonObject) -> tuple[int | None, str]:
    """The config the sweep started from, and what it is: the user's --base-config, the
    trainer's own config, or the sweep's safest first config."""
    for origin, kind in (("base", "your --base-config"),
                         ("safe", "the trainer's starting config" if identity.get("trainer")
                          else "the sweep's first (safest) config")):
        found = next((t for t in trials if t.origin == origin), None)
        if found is not None:
            return found.number, kind
    return None, ""


def stored_request(stored: JsonObject) -> ProbeRequest | None:
    """The study's probe request, read; None when it is another version's."""
    try:
        return ProbeRequest.from_dict(stored)
    except (TypeError, KeyError, ValueError):
        return None


def count_of(identity: JsonObject, key: str) -> int:
    """A count the study's identity holds (nnodes, gpus_per_node); 1 when it holds none."""
    value = identity.get(key, 1)
    return value if isinstance(value, int) else 1


def read_study(study: Study) -> StudyView:
    """The report's view of a study as it stands."""
    attrs = study.user_attrs
    frozen = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("status")]
    reused = sum(t.user_attrs.get("reused_from") is not None for t in frozen)
    trials = [trial_view(t) for t in frozen if t.user_attrs.get("reused_from") is None]
    results = [t.user_attrs.get("result") or {} for t in frozen]
    reported = next((r for r in results if r.get("device_capacity_bytes")), {})
    device_capacity = reported.get("device_capacity_bytes")
    capacity = usable_bytes(device_capacity, reported.get("device_limit_bytes"))
    budget = next((t.user_attrs["budget_bytes"] for t in frozen
                   if t.user_attrs.get("budget_bytes")), None)
    identity = attrs.get("identity", {})
    headroom = identity.get("headroom", DEFAULT_HEADROOM)
    if budget is None and capacity:
        budget = budget_bytes(capacity, headroom)
    start, start_kind = starting_trial(trials, identity)
    best = best_trial(study)
    space = attrs.get("search_space", {})
    request = attrs.get("request", {})
    return StudyView(
        name=study.study_name, identity=identity, request=request,
        parsed_request=stored_request(request), command=attrs.get("command"),
        searched=list(space.get("params", {})),
        fixed=dict(space.get("fixed", {})), trials=trials,
        best=best.number if best is not None else None, start=start, start_kind=start_kind,
        front=[t.number for t in pareto_front(study)],
        ranked=[t.number for t in ranked_feasible(study)], capacity_bytes=capacity,
        device_capacity_bytes=device_capacity,
        budget_bytes=budget, headroom=headroom,
        device_name=next((r["device_name"] for r in results if r.get("device_name")), None),
        calibration=attrs.get("memory_calibration"), reused=reused,
        versions=next((r["versions"] for r in results if (r.get("versions") or {}).get("vllm")),
                      next((r["versions"] for r in results if r.get("versions")), {})),
        finalists=current_record(study), best_figures=config_figures(study, best),
        contended=sum(bool(r.get("contention")) for r in results))


def config_figures(study: Study, trial: FrozenTrial | None) -> tuple[float, int] | None:
    """A config's mean tokens/s over its probes and the most peak memory any of them held."""
    if trial is None:
        return None
    measured = by_config(study).get(params_key(trial.params))
    if measured is None or not measured.tokens_per_s:
        return None
    return measured.tokens_per_s_mean, measured.peak_mem_bytes


PROBED_OUTCOMES = ("fits", "stopped slow", "over headroom", "oom", "failed")  # a probe ran


def headline(view: StudyView) -> dict[str, str]:
    """The facts at the top of the page, as label -> text."""
    identity = view.identity
    nnodes, gpus = count_of(identity, "nnodes"), count_of(identity, "gpus_per_node")
    world = nnodes * gpus
    if view.command:
        probe = (f"runs of your {view.command['trainer']} launch line, "
                 f"{view.command['steps']} steps each")
    else:
        parsed = view.parsed_request
        placements = [view.config_of(t).placement for t in view.trials
                      if t.outcome in PROBED_OUTCOMES] if parsed is not None else []
        algorithm = parsed.config.algorithm.upper() if parsed is not None else "GRPO"
        ranks = study_probes_text(world, bool(identity.get("emulated")), placements)
        probe = f"built-in {algorithm} step, {ranks}"
    probed = [t for t in view.trials if t.outcome in PROBED_OUTCOMES]
    wall_s = sum((t.completed - t.started).total_seconds() for t in probed
                 if t.started and t.completed)
    budget = "unknown (no probe reported its device)"
    if view.capacity_bytes:
        budget = (f"{format_bytes(view.budget_bytes)} of {format_bytes(view.capacity_bytes)} "
                  f"per device ({view.headroom:.0%} headroom kept free)")
    config = view.request.get("config")
    engine = view.fixed.get("rollout_engine",
                            config.get("rollout_engine") if isinstance(config, dict) else None)
    engines = sorted({str(t.params.get("rollout_engine", engine))
                      for t in view.trials if not view.command} - {"None"})
    rollout = {"rollout": "; ".join(describe_engine(e, view.versions) for e in engines)} \
        if engines else {}
    return {
        "model": str(identity.get("model")) + (f" ({identity['model_path']})"
                                               if identity.get("model_path") else ""),
        "device": view.device_name or str(identity.get("device")),
        "topology": f"{nnodes} node{'s' if nnodes > 1 else ''} x {gpus} GPU"
                    f"{'s' if gpus > 1 else ''}" + (f", as {identity['trainer']}"
                                                    if identity.get("trainer") else ""),
        "probe": probe,
        **rollout,
        "memory budget": budget,
        "objective": str(identity.get("objective")),
        "trials": (f"{len(probed)} probed ({view.count('fits')} fit, "
                   f"{view.count('stopped slow')} stopped slow, "
                   f"{view.count('over headroom')} over headroom, {view.count('oom')} OOM, "
                   f"{view.count('failed')} failed), {view.count('predicted oom')} predicted "
                   f"OOM and {view.count('invalid')} invalid never run, {view.reused} reused; "
                   f"{wall_s / 60:.1f} min of probing"
                   + (f"; {view.contended} probe(s) measured under contention (other "
                      "processes took the machine: their tokens/s measure those too)"
                      if view.contended else "")),
    }


def phases_of(view: StudyView) -> list[str]:
    """The step's phases some probe measured, in step order."""
    seen = {p for t in view.trials for p in t.phase_peak_mem_bytes}
    return [p for p in PHASES if p in seen]
