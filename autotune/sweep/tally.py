"""What a study's finished trials add up to: counts, the best so far, what memory taught.

Every finished trial is folded in exactly once, whichever driver finished it: the sweep reads
the study after each step and folds what is new (trials another driver finished included), so
the stop rules (--trials, --patience) and the feasibility pruning see the whole study.

Two bests, for two uses. The best single recording (`best_scalar`) is what the progress view
shows and what --patience counts improvements of. The leader (`leader()`: the best config by
its figure pooled over every probe of its phases, measurements.rank, as the pick ranks) is
what the search decides on: the config the neighbour moves explore around, the figure a
composed proposal must beat, the incumbent a slow probe is held to. Under noise the best
recording is the luckiest draw (on the VL-7B landscape at 10% noise the default sweep
centred on it picked within 2% of the best in 29 of 40 seeds, centred on the leader in 34:
benchmarks/results/pick_under_noise_leader.txt).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import TYPE_CHECKING, cast

from autotune.config import Knobs, describe_params, format_bytes
from autotune.probe.measure.result import (
    ProbeRequest,
    ProbeStatus,
    SlowFloor,
    coefficient_of_variation,
)
from autotune.sweep.feasibility.screen import Feasibility
from autotune.sweep.pick.measurements import FINALIST, Measured, rank
from autotune.sweep.pick.measurements import fold as fold_measured
from autotune.sweep.progress import SweepState
from autotune.sweep.space.search_space import SearchSpace
from autotune.sweep.study.objective import scalar, slow_floor
from autotune.sweep.study.sharing import NO_RESULT_STATUSES

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

NOISE_PROBES = 3  # quiet probes of two timed steps or more before their spread is the study's
OUTLIER_TIMES_MEDIAN = 3.0  # a probe's step spread this many times the median's is not the noise


class Tally:
    """Counts for the progress view, the best feasible trial, probes since it improved; each
    probe taught to the feasibility rules as its candidate in `space`."""

    def __init__(self, state: SweepState, feasibility: Feasibility, objective: str,
                 space: SearchSpace) -> None:
        self.state, self.feasibility, self.objective = state, feasibility, objective
        self.space = space
        self.accounted: set[int] = set()  # trial numbers already folded in
        self.best_scalar: float | None = None  # the best feasible probe's recording
        self.configs: dict[str, Measured] = {}  # every probed config, its probes together
        self.ranking: list[Measured] | None = None  # rank(configs), until the next probe
        self.step_cvs: list[float] = []  # each quiet probe's step-to-step spread
        self.since_improvement = 0  # probes since the best improved (--patience)

    def fold(self, frozen: FrozenTrial) -> None:
        if frozen.number not in self.accounted and frozen.state.is_finished():
            self.accounted.add(frozen.number)
            self.account(frozen)

    def account(self, frozen: FrozenTrial) -> None:
        """Fold one finished trial into the counts and the best so far."""
        from optuna.trial import TrialState

        attrs = frozen.user_attrs
        status = attrs.get("status")
        if frozen.state not in (TrialState.COMPLETE, TrialState.FAIL) or \
                status in NO_RESULT_STATUSES:
            return
        fold_measured(self.configs, frozen, self.objective)  # a probe of its config
        self.ranking = None
        if status in ("lost", "killed"):  # says nothing about the config
            self.state.counts[status] += 1
            return
        if not attrs.get("probed"):
            predicted = attrs.get("predicted") and attrs.get("reused_from") is None
            self.state.counts["predicted" if predicted else "skipped"] += 1
            return
        result = attrs.get("result") or {}
        self.feasibility.record(frozen.number, self.space.candidate(frozen.params), status,
                                result.get("failed_phase"), result.get("phase_peak_mem_bytes"),
                                result.get("device_capacity_bytes"),
                                result.get("phase_allocator_peak_bytes"))
        if attrs.get("origin") == FINALIST:  # a finalist probed again: no new config
            return
        self.state.probes += 1
        if result.get("probe_wall_s"):
            self.state.probe_wall_s.append(result["probe_wall_s"])
        if status in ("ok", "slow"):
            self.state.counts[status] += 1
        elif ProbeStatus(status).is_oom:
            self.state.counts["oom"] += 1
        else:
            self.state.counts["failed"] += 1
        cv = coefficient_of_variation(result.get("step_times_s") or [])
        if status == "ok" and cv is not None and not result.get("contention"):
            self.step_cvs.append(cv)
        value = scalar(frozen.values, self.objective) \
            if status == "ok" and attrs.get("feasible") and frozen.values else None
        if value is not None and (self.best_scalar is None or value > self.best_scalar):
            self.best_scalar = value
            self.since_improvement = 0
            self.state.best = (f"trial {frozen.number}: {describe_params(frozen.params)}, "
                               f"{result['tokens_per_s']:,.1f} tok/s, peak "
                               f"{format_bytes(result['peak_mem_bytes'])}")
        else:
            self.since_improvement += 1

    def step_cv(self) -> float | None:
        """One timed step's spread on this machine, as the study measured it (`step_noise`);
        None before any quiet probe."""
        return step_noise(self.step_cvs)

    def leader(self) -> Measured | None:
        """The best feasible config by its pooled figure (measurements.rank, the pick's
        ranking); None before one."""
        if self.ranking is None:
            # every fixed value, the trainer's keys too, as the pick's study_fixed reads them
            self.ranking = rank(self.configs, cast(Knobs, dict(self.space.fixed)))
        return self.ranking[0] if self.ranking else None

    def stop_below(self) -> SlowFloor | None:
        """The floor a new probe may stop slow under: the leader's figure less the noise
        (`step_cv`)."""
        leader = self.leader()
        return slow_floor(self.objective, leader.figure if leader else None,
                          leader.number if leader else None, self.step_cv())

    def with_study_noise(self, request: ProbeRequest) -> ProbeRequest:
        """`request` as the study's measured noise lets it run (`with_step_noise`)."""
        return with_step_noise(request, self.step_cvs)


def with_step_noise(request: ProbeRequest, step_cvs: list[float]) -> ProbeRequest:
    """A short probe of a study whose quiet probes measured their steps' spread (`step_cvs`,
    NOISE_PROBES of them at least): it starts from one timed step and adds steps while that
    spread over sqrt(n) (or its own, when larger) is past its target (training.py
    `wants_more`), so a second step runs only where one step's noise would decide (the
    sweep's probes, and the finalists' whole repeats: the driver passes it). Full
    probes, command probes, split probes (placement=separate: both sides run whole steps in
    lockstep, exactly their count, probe/launch/split_sides.py) and --timed-steps (an exact
    count: timed_min_s 0) as they are."""
    if not request.short or request.config.separate or request.timed_min_s <= 0 or \
            len(step_cvs) < NOISE_PROBES:
        return request
    return dataclasses.replace(request, timed_steps=1, step_cv_prior=step_noise(step_cvs))


def step_noise(step_cvs: list[float]) -> float | None:
    """One timed step's spread as the quiet probes' step-to-step coefficients of variation
    measure it: their root mean square, leaving out a probe's more than OUTLIER_TIMES_MEDIAN
    times their median (from three on). A transient is not the machine's noise: on a CPU
    machine minutes after its start the first probes' two steps read 16-57% apart, the same
    probes later 0.4-2% (docs/benchmarks.md), and one such probe in the root mean square
    would widen every later one-step probe's interval and stop none slow. Steps drawn from
    one normal noise leave out about 4% of probes (a two-step spread past 3 times its
    median). None for none."""
    if not step_cvs:
        return None
    kept = step_cvs
    if len(step_cvs) >= 3:
        limit = OUTLIER_TIMES_MEDIAN * statistics.median(step_cvs)
        kept = [cv for cv in step_cvs if cv <= limit]
    return math.sqrt(statistics.fmean(cv * cv for cv in kept))
