"""How a trial is written into the study: a probe's result, a result reused, a give-up.

How a trial is told decides what the sampler learns (objective.py scores it): an OOM is
COMPLETE with a sentinel value and a positive constraint, a crash is FAIL, a reused trial
carries the earlier trial's outcome. Every trial also gets user attrs that say what happened
(status, probed, predicted, feasible, reason, the result's figures, its log).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.config import Knobs, format_bytes
from autotune.files import JsonObject
from autotune.probe.measure.result import ProbeResult
from autotune.sweep.study import trial_files
from autotune.sweep.study.heartbeat import HEARTBEAT_ATTR
from autotune.sweep.study.objective import score
from autotune.sweep.study.settings import SweepSettings

if TYPE_CHECKING:
    from optuna import Study, Trial
    from optuna.trial import FrozenTrial

# attrs of an earlier trial that describe that trial's own run, not its config's outcome
OWN_ATTRS = ("origin", "requeued_from", HEARTBEAT_ATTR, "waiting_on", "requeued")


def result_attrs(result: ProbeResult) -> JsonObject:
    """A result as stored in the trial's user attrs (the output tail stays in the log)."""
    data = result.to_dict()
    data.pop("stderr_tail", None)
    return data


def tell_result(study: Study, trial: Trial, result: ProbeResult, settings: SweepSettings,
                capacity_bytes: int | None, probed: bool, predicted: bool = False) -> str:
    """Tell a probe's result (or a predicted or invalid one) under the sweep's objective and
    headroom; the one-line outcome for the progress view."""
    from optuna.trial import TrialState

    verdict = score(result, settings.objective, settings.headroom, capacity_bytes)
    log = trial_files.log_path(settings.study_dir, trial.number)
    attrs: JsonObject = {
             "status": result.status.value, "probed": probed, "predicted": predicted,
             "feasible": verdict.feasible,
             "reason": result.message if predicted else verdict.reason,
             "budget_bytes": verdict.budget_bytes,
             "binding_phase": verdict.binding_phase,
             "log": str(log.relative_to(settings.study_dir)) if log.exists() else None,
             "result": result_attrs(result)}
    for k, v in attrs.items():
        trial.set_user_attr(k, v)
    for k, v in verdict.constraints.items():
        trial.set_constraint(k, v)
    if verdict.state == "fail":
        study.tell(trial, state=TrialState.FAIL)
    else:
        study.tell(trial, list(verdict.values or ()))
    if verdict.feasible and result.ok:
        return (f"ok, {result.tokens_per_s:,.1f} tok/s, peak "
                f"{format_bytes(result.peak_mem_bytes)} of "
                f"{format_bytes(verdict.budget_bytes)}")
    return verdict.reason


def tell_reused(study: Study, trial: Trial, earlier: FrozenTrial) -> None:
    """Tell `trial` the outcome of the earlier trial that holds the same config."""
    from optuna.trial import TrialState

    for k, v in earlier.user_attrs.items():
        if k not in OWN_ATTRS:
            trial.set_user_attr(k, v)
    trial.set_user_attr("probed", False)
    trial.set_user_attr("reused_from", earlier.number)
    for k, v in earlier.constraints.items():
        trial.set_constraint(k, v)
    if earlier.state == TrialState.COMPLETE:
        study.tell(trial, list(earlier.values))
    else:
        study.tell(trial, state=TrialState.FAIL)


def tell_given_up(study: Study, trial: Trial, params: Knobs, status: str,
                  requeue: bool) -> None:
    """Fail a trial the driver will not finish (`interrupted`, or `duplicate` when another
    trial holds its config); a re-queued config runs again as a new trial."""
    from optuna.trial import TrialState

    trial.set_user_attr("status", status)
    trial.set_user_attr("reason", "the driver stopped before its result")
    if requeue:
        trial.set_user_attr("requeued", True)
    study.tell(trial, state=TrialState.FAIL)
    if requeue:
        study.enqueue_trial(params, user_attrs={"origin": "requeued",
                                                "requeued_from": trial.number})
