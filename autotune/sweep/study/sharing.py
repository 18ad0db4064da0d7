"""How drivers share one study: who owns a config, which running trials are dead.

Several drivers may run one study at once (`--storage` shared by two machines, or a restart
while another driver runs). They never talk to each other: everything is read from the study's
trials in Optuna's storage, so the storage is the one arbiter.

- A trial *holds* its config when it is running (probing it, or waiting for another trial's
  result), or finished with a result that stands. Interrupted trials were re-queued, lost ones
  retried, duplicates deferred to another trial: they hold nothing.
- The lowest-numbered trial holding a config owns it; any later trial with the same params
  waits for the owner's result and reuses it instead of probing. A queued trial holds its
  params from the moment it is queued, since it may be popped after later trials started.
  Trial numbers come from the storage, so two drivers that sample the same config at the same
  moment agree on who runs it.
  An owner is only decided once every lower-numbered trial has finished being asked (its params
  are all written), so a slower ask can never slip under a trial that has started probing.
- A driver writes a heartbeat into each trial it is running. A running trial whose heartbeat is
  older than `stale_after_s` belongs to a dead driver: whoever notices first fails it (the
  storage lets exactly one driver move it out of RUNNING) and re-queues its params.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from autotune.config import Knobs
from autotune.sweep.space.params import params_key
from autotune.sweep.study.heartbeat import HEARTBEAT_ATTR

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial

ASK_GRACE_S = 30.0  # a trial still being asked after this long belongs to a driver that died
HEARTBEAT_S = 10.0  # default seconds between heartbeats of a running trial
STALE_AFTER_HEARTBEATS = 4  # heartbeats missed before a running trial is declared dead
# a finished trial with one of these statuses has no result: re-queued after a cut, deferred to
# another trial with its config, or abandoned by a driver that died asking it
NO_RESULT_STATUSES = (None, "interrupted", "duplicate", "abandoned")
WAIT = -1  # owner_of: a lower-numbered trial is still being asked; ask again shortly


def trial_params(frozen: FrozenTrial) -> Knobs:
    """A trial's params; for a queued (WAITING) trial, the params it was queued with."""
    if frozen.state.name == "WAITING":
        return dict(frozen.system_attrs.get("fixed_params") or {})
    return frozen.params


def held_key(frozen: FrozenTrial, keys: dict[int, str] | None = None) -> str:
    """params_key of the config a trial holds; `keys` (a driver's, by trial number) keeps those
    of finished trials, whose params never change, so that a read of a study of n trials
    does not encode n configs again."""
    if keys is not None and frozen.number in keys:
        return keys[frozen.number]
    key = params_key(trial_params(frozen))
    if keys is not None and frozen.state.is_finished():
        keys[frozen.number] = key
    return key


def ran_params(frozen: FrozenTrial) -> Knobs:
    """A trial's params as its probe ran them: the target trainer's ties applied (a TRL
    trial's log-prob micro-batch is its update micro-batch, whatever was sampled), as the
    tuner recorded them (the trial's `tied` attr)."""
    return {**frozen.params, **frozen.user_attrs.get("tied", {})}


def trial_by_number(study: Study, number: int) -> FrozenTrial:
    """One trial read from the storage (study.trials would read them all)."""
    storage = study._storage
    return storage.get_trial(storage.get_trial_id_from_study_id_trial_number(study._study_id,
                                                                             number))


def last_sign_of_life_s(frozen: FrozenTrial) -> float:
    beat = frozen.user_attrs.get(HEARTBEAT_ATTR)
    if beat is not None:
        return float(beat)
    started = frozen.datetime_start
    return started.timestamp() if started is not None else 0.0


def is_running(frozen: FrozenTrial) -> bool:
    return frozen.state.name == "RUNNING"


def is_asked(frozen: FrozenTrial, n_params: int) -> bool:
    """All of the trial's params are written (a running trial is asked param by param)."""
    return len(frozen.params) >= n_params


def holds_config(frozen: FrozenTrial, n_params: int) -> bool:
    """Whether this trial holds its config: queued with it, running it, waiting for it, or a
    standing result. A queued trial holds its config from the moment it is queued, so a trial
    asked later with the same params waits for it instead of racing it (the state by name:
    this runs for every trial a driver reads, and needs no import of optuna)."""
    state = frozen.state.name
    if state == "WAITING":
        return bool(trial_params(frozen))
    if state == "RUNNING":
        return bool(frozen.params) and is_asked(frozen, n_params)
    if state not in ("COMPLETE", "FAIL"):
        return False
    attrs = frozen.user_attrs
    return attrs.get("status") not in NO_RESULT_STATUSES and \
        not attrs.get("requeued")


def owner_of(trials: Iterable[FrozenTrial], number: int, key: str, n_params: int,
             now_s: float | None = None, keys: dict[int, str] | None = None) -> int | None:
    """The trial that owns the config `key` for trial `number`: the lowest-numbered lower trial
    holding it; None when `number` owns it itself; WAIT while a lower trial is being asked
    (`keys`: see held_key)."""
    now_s = time.time() if now_s is None else now_s
    owner = None
    for frozen in trials:
        if frozen.number >= number:
            continue
        if is_running(frozen) and not is_asked(frozen, n_params) and \
                now_s - last_sign_of_life_s(frozen) < ASK_GRACE_S:
            return WAIT
        if (owner is None or frozen.number < owner) and holds_config(frozen, n_params) and \
                held_key(frozen, keys) == key:
            owner = frozen.number
    return owner


def is_stale(frozen: FrozenTrial, now_s: float, stale_after_s: float) -> bool:
    return is_running(frozen) and now_s - last_sign_of_life_s(frozen) > stale_after_s


def taken_params(frozen: FrozenTrial, asked: bool) -> Knobs:
    """The config a dead driver's trial held: its params, or for a half-asked trial popped from
    the queue, the config it was queued with."""
    return frozen.params if asked else dict(frozen.system_attrs.get("fixed_params") or {})


def requeues(frozen: FrozenTrial, asked: bool) -> bool:
    """Whether taking the trial over queues its config again (a waiting trial's config is its
    owner's business; a trial that died being asked has none)."""
    return bool(taken_params(frozen, asked)) and "waiting_on" not in frozen.user_attrs


def take_over(study: Study, frozen: FrozenTrial, reason: str, asked: bool = True) -> bool:
    """Fail a running trial a dead driver left behind and re-queue its config (a waiting trial's
    config is its owner's business; a trial that died being asked has none, unless it was
    popped from the queue with one). True when this driver won the race to do it."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    storage, trial_id = study._storage, frozen._trial_id
    waiting = "waiting_on" in frozen.user_attrs
    params = taken_params(frozen, asked)
    requeue = requeues(frozen, asked)
    status = "duplicate" if waiting else "interrupted" if asked or params else "abandoned"
    try:
        storage.set_trial_user_attr(trial_id, "status", status)
        storage.set_trial_user_attr(trial_id, "reason", reason)
        if requeue:
            storage.set_trial_user_attr(trial_id, "requeued", True)
        if not storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
            return False
    except UpdateFinishedTrialError:
        return False  # another driver finished or took it over first
    if requeue:
        study.enqueue_trial(params, user_attrs={"origin": "requeued",
                                                "requeued_from": frozen.number})
    return True


class Holdings:
    """Which trial holds each config, read from the study a driver sees, and how many probes
    other drivers run. A finished trial's holding never changes (Optuna refuses to change a
    finished trial), so each is read once; queued and running trials are read at every scan.
    A scan costs the study's unfinished trials, not its whole length: an overnight sweep of
    hundreds of trials reads the study after every probe."""

    def __init__(self, n_params: int) -> None:
        self.n_params = n_params
        self.finished: dict[str, int] = {}  # params_key -> the lowest finished trial holding it
        self.read: set[int] = set()  # the finished trials folded into `finished`
        self.unfinished: list[FrozenTrial] = []  # queued and running, as the last scan read them
        self.seen: dict[str, int] = {}  # params_key -> the lowest trial holding it
        self.queued = 0  # trials queued (WAITING) as the last scan read them: not yet tried

    def scan(self, study: Study, trials: Sequence[FrozenTrial], mine: set[int], now_s: float,
             stale_after_s: float | None) -> int:
        """Read the study: which trial holds each config (`seen`); returns how many probes
        other drivers are running. With `stale_after_s` (a shared study), trials of dead
        drivers are taken over on the way."""
        unfinished = []
        for frozen in trials:
            if frozen.number in self.read:
                continue
            if frozen.state.is_finished():
                self.read.add(frozen.number)
                if holds_config(frozen, self.n_params):
                    _hold(self.finished, held_key(frozen), frozen.number)
            else:
                unfinished.append(frozen)
        seen = dict(self.finished)
        others_running = taken_over = 0
        for frozen in unfinished:
            if holds_config(frozen, self.n_params):
                _hold(seen, held_key(frozen), frozen.number)
            if frozen.number in mine or not is_running(frozen):
                continue
            asked = is_asked(frozen, self.n_params)
            # a trial another driver waits in or is still asking is beaten like a probing one;
            # left RUNNING by a dead driver, it would stay so for good: it is taken over, never
            # counted
            if stale_after_s is not None and is_stale(
                    frozen, now_s, stale_after_s if asked else max(stale_after_s, ASK_GRACE_S)):
                take_over(study, frozen, "its driver stopped sending heartbeats", asked)
                # queued again (here, or by the driver that won the race) after `trials` was
                # read: counted as queued, or its config would count as tried
                taken_over += requeues(frozen, asked)
            elif asked and frozen.user_attrs.get("waiting_on") is None:
                others_running += 1
        self.seen, self.unfinished = seen, unfinished
        self.queued = taken_over + sum(frozen.state.name == "WAITING" for frozen in unfinished)
        return others_running

    def owner_of(self, number: int, key: str, now_s: float | None = None) -> int | None:
        """owner_of over the trials the last scan read (a driver alone on its study: nothing
        was told since): the module's rule over the unfinished ones, beside the lowest
        finished holder."""
        unfinished = owner_of(self.unfinished, number, key, self.n_params, now_s)
        if unfinished == WAIT:
            return WAIT
        lower = [n for n in (self.finished.get(key), unfinished) if n is not None and n < number]
        return min(lower, default=None)


def _hold(holders: dict[str, int], key: str, number: int) -> None:
    """Note that trial `number` holds `key`: the lowest-numbered holder is kept."""
    if number < holders.get(key, number + 1):
        holders[key] = number
