"""Each config's probes taken together: its figure, its spread, and the ranking built on them.

A config may be probed more than once: the finalists are probed again before the pick
(finalists.py), each repeat a trial of its own with `origin: finalist`. Everything that
ranks configs (best.yaml, `show`, the report, the confirmations, the export's candidates)
reads this module: a config's figure is its objective with its step pooled over every probe
that ran its phases (pooled.py: a config that shares its rollout with others is timed there
by all of them; one that shares nothing, or whose probes timed no phases, by the mean over
its own probes), its memory the most any of its probes held, and its noise the spread
between probes (the within-probe spread of its timed steps until one config has been probed
twice). A config one of whose probes ran out of memory or past the headroom is not feasible,
however its other probes went. A probe stopped slow adds its memory, not its rate (an upper
bound): a config probed only so is never ranked.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autotune.config import Knobs
from autotune.probe.measure.result import ProbeStatus, coefficient_of_variation
from autotune.sweep.pick.pooled import PooledStep, pooled_steps, probe_times
from autotune.sweep.space.params import params_key
from autotune.sweep.study.objective import scalar

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial

SEPARATION_Z = 2.0  # two configs differ when their means are this many standard errors apart
# The pick's tolerance: a finalist that could be at most this share above the leader (its
# difference at SEPARATION_Z standard errors) is as good a pick for the user, so the repeats
# stop once every finalist still close to the leader is within it (the within-2% target that
# the pick benchmarks score a sweep by)
PICK_TOLERANCE = 0.02
FINALIST = "finalist"  # the origin of a repeat probe


@dataclass
class Measured:
    """One config's probes: the first trial that probed it, and every probe's figures (its
    means and peak kept as probes are folded in: a sweep ranks every config after each probe)."""

    trial: FrozenTrial  # the config's first probed trial (its number names the config)
    trials: list[FrozenTrial] = field(default_factory=list)  # every probe of it, in order
    values: list[float] = field(default_factory=list)  # the objective's scalar, per probe
    tokens_per_s: list[float] = field(default_factory=list)
    feasible: bool = True
    contended: int = 0  # probes measured under contention (probe/measure/machine.py)
    mean: float = field(init=False, default=0.0)  # the objective's mean over its probes
    pooled: PooledStep | None = None  # its step pooled over the probes of its phases (set
    # by ranked())
    tokens_per_s_mean: float = field(init=False, default=0.0)
    peak_mem_bytes: int = field(init=False, default=0)  # the most any of its probes held

    def __post_init__(self) -> None:
        self.refigure()

    def refigure(self) -> None:
        """Recompute the means and the peak from the probes (after one is added)."""
        self.mean = statistics.fmean(self.values) if self.values else 0.0
        self.tokens_per_s_mean = statistics.fmean(self.tokens_per_s) \
            if self.tokens_per_s else 0.0
        self.peak_mem_bytes = max(((t.user_attrs.get("result") or {}).get("peak_mem_bytes")
                                   or 0 for t in self.trials), default=0)

    @property
    def number(self) -> int:
        return int(self.trial.number)

    @property
    def probes(self) -> int:
        return len(self.trials)

    @property
    def relative_sd(self) -> float | None:
        """Spread between its probes (two or more), else of its first probe's timed steps."""
        if len(self.values) >= 2:
            return coefficient_of_variation(self.values)
        result = self.trial.user_attrs.get("result") or {}
        return coefficient_of_variation(result.get("step_times_s") or [])

    def phase_peak_mem_bytes(self) -> dict[str, int]:
        """Each phase's most over the config's probes."""
        peaks: dict[str, int] = {}
        for t in self.trials:
            for phase, value in ((t.user_attrs.get("result") or {}).get(
                    "phase_peak_mem_bytes") or {}).items():
                peaks[phase] = max(peaks.get(phase, 0), value)
        return peaks

    @property
    def figure(self) -> float:
        """The objective the ranking reads: its mean, its tokens/s pooled (pooled.py)."""
        if self.pooled is None or not self.tokens_per_s_mean:
            return self.mean
        return self.mean * self.pooled.tokens_per_s / self.tokens_per_s_mean

    @property
    def evidence(self) -> int:
        """The probes its figure rests on: of its least-probed phase where pooled."""
        return max(1, self.pooled.least_probes if self.pooled is not None else len(self.values))

    def interval(self, relative_sd: float) -> tuple[float, float]:
        """The figure's interval at SEPARATION_Z standard errors, `relative_sd` per probe."""
        half = SEPARATION_Z * relative_sd * self.figure / math.sqrt(self.evidence)
        return self.figure - half, self.figure + half

    def difference_error(self, other: Measured, relative_sd: float) -> float:
        """The standard error of the two figures' difference, `relative_sd` per probe."""
        scale = (self.figure + other.figure) / 2
        return relative_sd * scale * math.sqrt(1 / self.evidence + 1 / other.evidence)

    def apart_from(self, other: Measured, relative_sd: float) -> bool:
        """Whether the two figures differ beyond the noise (SEPARATION_Z standard errors)."""
        return abs(self.figure - other.figure) > \
            SEPARATION_Z * self.difference_error(other, relative_sd)

    def tolerates(self, other: Measured, relative_sd: float) -> bool:
        """Whether `other` is at most PICK_TOLERANCE above this one at SEPARATION_Z standard
        errors of their difference: picking this one would lose less than that."""
        return other.figure - self.figure + SEPARATION_Z * self.difference_error(
            other, relative_sd) <= PICK_TOLERANCE * self.figure


def is_probe(frozen: FrozenTrial) -> bool:
    """A trial that ran a probe of its own (not reused, not predicted) and was told."""
    return bool(frozen.user_attrs.get("probed")) and frozen.state.is_finished() and \
        frozen.user_attrs.get("status") is not None


def fold(configs: dict[str, Measured], frozen: FrozenTrial, objective: str) -> None:
    """Add one trial to `configs` if it is a probe that says something of its config (by_config
    folds every trial of a study through here; a sweep's files fold each new one once)."""
    attrs, result = frozen.user_attrs, frozen.user_attrs.get("result") or {}
    if not is_probe(frozen) or attrs.get("status") in ("lost", "killed"):  # a probe lost
        return  # with its node, or killed from outside, says nothing about the config
    key = params_key(frozen.params)
    earlier = configs.get(key)
    if earlier is not None and frozen.number < earlier.trials[-1].number:
        del configs[key]  # told after a later probe of its config: fold them in trial order
        for trial in sorted([*earlier.trials, frozen], key=lambda t: t.number):
            fold(configs, trial, objective)
        return
    measured = configs.setdefault(key, Measured(frozen))
    measured.trials.append(frozen)
    if attrs.get("status") == ProbeStatus.SLOW.value:  # its memory counts; its rate is only
        measured.feasible = measured.feasible and bool(attrs.get("feasible"))  # a bound
    elif not (attrs.get("feasible") and frozen.state.name == "COMPLETE" and frozen.values):
        measured.feasible = False
    else:
        measured.values.append(scalar(frozen.values, objective))
        measured.tokens_per_s.append(result.get("tokens_per_s") or 0.0)
        measured.contended += bool(result.get("contention"))
    measured.refigure()


def study_objective(study: Study) -> str:
    return str(study.user_attrs.get("identity", {}).get("objective", "throughput_per_memory"))


def by_config(study: Study) -> dict[str, Measured]:
    """Every probed config, keyed by its params, with all its probes."""
    objective = study_objective(study)
    configs: dict[str, Measured] = {}
    for frozen in study.get_trials(deepcopy=False):
        fold(configs, frozen, objective)
    return configs


def ranked(study: Study, configs: Mapping[str, Measured] | None = None) -> list[Measured]:
    """Feasible configs, the best figure first (pooled over the probes of their phases), the
    earliest probed on ties (`configs`: the study's by_config, when the caller holds it)."""
    return rank(by_config(study) if configs is None else configs, study_fixed(study))


def rank(configs: Mapping[str, Measured], fixed: Knobs) -> list[Measured]:
    """`configs`' feasible ones, the best figure first, as ranked() orders a study's (`fixed`:
    the space's fixed knobs, study_fixed)."""
    pooled = pooled_of(configs, fixed)
    feasible = [m for m in configs.values() if m.feasible and m.values]
    for m in feasible:
        m.pooled = pooled.get(params_key(m.trial.params))
    return sorted(feasible, key=lambda m: (-m.figure, m.number))


def pooled_of(configs: Mapping[str, Measured], fixed: Knobs) -> dict[str, PooledStep]:
    """Each probed config's step pooled over every probe of `configs` (pooled.py), by key;
    `fixed`: the space's fixed knobs (study_fixed), which the step's composition reads too
    (a space that fixes placement=separate)."""
    return pooled_steps(times for m in configs.values() for frozen in m.trials
                        if (times := probe_times(frozen, fixed)) is not None)


def study_fixed(study: Study | None) -> Knobs:
    """The knobs the study's space held fixed (storage.py records them); none known for a
    caller that ranks its configs without their study."""
    if study is None:
        return {}
    return dict((study.user_attrs.get("search_space") or {}).get("fixed") or {})


def pooled_relative_sd(configs: list[Measured]) -> float | None:
    """The spread of one probe, pooled over configs probed at least twice (relative to each
    config's mean); None when none was."""
    squares, freedom = 0.0, 0
    for m in configs:
        if len(m.values) >= 2 and m.mean > 0:
            squares += sum((v / m.mean - 1.0) ** 2 for v in m.values)
            freedom += len(m.values) - 1
    return math.sqrt(squares / freedom) if freedom else None


def noise(configs: list[Measured]) -> float:
    """One probe's relative spread as the finalists show it: pooled between their probes,
    never below the largest spread of one probe's timed steps over their count (a second
    probe of a config costs as much as its first; until there is one, that is all we know)."""
    within = [cv / math.sqrt(max(1, len(
        (m.trial.user_attrs.get("result") or {}).get("step_times_s") or [])))
        for m in configs if (cv := m.relative_sd) is not None and len(m.values) < 2]
    pooled = pooled_relative_sd(configs)
    return max([pooled or 0.0, *within])
