"""What a sweep maximises, and how each probe outcome is told to Optuna.

Objectives:
- throughput_per_memory (default): tokens/s / peak GiB, maximised;
- throughput: tokens/s, maximised;
- pareto: tokens/s maximised and peak GiB minimised, two objectives.

A configuration is feasible when every phase's peak device memory stays within the budget,
(1 - headroom) x the memory the probe could use (the limit in force, or the device's capacity).
OOM outcomes are told as COMPLETE with sentinel values and a positive `memory` constraint, so
TPE, GP and NSGA-II all learn where the wall is; samplers ignore FAIL trials, which is kept for
crashes and timeouts. A probe stopped slow (ProbeStatus.SLOW: what it timed already put
it under the best config by more than the noise, `slow_floor`) is COMPLETE with the most its
measured part allows: the sampler learns it is worse, and the pick never takes it
(sweep/pick/measurements.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from autotune.config import PHASES, budget_bytes, format_bytes
from autotune.probe.measure.result import ProbeResult, ProbeStatus, SlowFloor

OBJECTIVES = ("throughput_per_memory", "throughput", "pareto")
OOM_CONSTRAINT = 1.0  # the `memory` constraint of an OOM: as bad as 2x the budget
INVALID_CONSTRAINT = 1.0  # the `rules` constraint of a config that breaks a trainer rule
UNKNOWN_CAPACITY_GIB = 1024.0  # pareto's memory sentinel when no capacity was ever measured
SLOW_MARGIN_MIN = 0.10  # a probe stops slow only 10% or more under the best's figure ...
SLOW_MARGIN_Z = 2.0  # ... and this many of the measured step-to-step spreads
SLOW_MARGIN_MAX = 0.5  # a noisier machine than that: stop only under half the best's figure


Direction = Literal["maximize", "minimize"]  # an Optuna study direction


def directions(objective: str) -> list[Direction]:
    """Optuna study directions for an objective."""
    return ["maximize", "minimize"] if objective == "pareto" else ["maximize"]


def objective_names(objective: str) -> list[str]:
    if objective == "pareto":
        return ["tokens_per_s", "peak_mem_gib"]
    return ["tokens_per_s_per_gib" if objective == "throughput_per_memory" else "tokens_per_s"]


@dataclass(frozen=True)
class Score:
    """A probe outcome as Optuna is told it, and why."""

    state: str  # complete | fail
    values: tuple[float, ...] | None  # None for fail
    constraints: dict[str, float]  # <= 0 feasible
    feasible: bool
    reason: str  # one line; empty for a feasible config
    budget_bytes: int | None = None
    binding_phase: str | None = None  # the phase closest to (or over) the budget


def counts_memory(objective: str) -> bool:
    """Whether the objective's figure counts peak memory (tokens/s per GiB; pareto's ranking,
    the same figure), not tokens/s alone."""
    return objective != "throughput"


def values_of(tokens_per_s: float, peak_mem_bytes: int, objective: str) -> tuple[float, ...]:
    peak_gib = peak_mem_bytes / 2**30
    if objective == "throughput":
        return (tokens_per_s,)
    if objective == "pareto":
        return (tokens_per_s, peak_gib)
    return (tokens_per_s / peak_gib,)


def sentinel_values(objective: str, capacity: int | None) -> tuple[float, ...]:
    """Values for a config that did not fit: worse than any feasible config's."""
    if objective == "pareto":
        return (0.0, capacity / 2**30 if capacity else UNKNOWN_CAPACITY_GIB)
    return (0.0,)


def score(result: ProbeResult, objective: str, headroom: float,
          fallback_capacity: int | None = None) -> Score:
    """How one probe result is told to Optuna under `objective` and `headroom`."""
    capacity = result.usable_bytes or fallback_capacity
    budget = budget_bytes(capacity, headroom)
    if result.status is ProbeStatus.INVALID:
        return Score("complete", sentinel_values(objective, capacity),
                     {"memory": 0.0, "rules": INVALID_CONSTRAINT}, False,
                     f"invalid: {result.message}", budget)
    if result.status.is_oom:
        where = f" in {result.failed_phase}" if result.failed_phase else ""
        return Score("complete", sentinel_values(objective, capacity),
                     {"memory": OOM_CONSTRAINT, "rules": 0.0}, False,
                     f"{result.status.value}{where}", budget, result.failed_phase)
    if not result.status.reached_peaks or result.tokens_per_s is None or \
            not result.peak_mem_bytes:
        return Score("fail", None, {}, False, f"{result.status.value}: {result.message}",
                     budget, result.failed_phase)
    values = values_of(result.tokens_per_s, result.peak_mem_bytes, objective)
    phases = result.phase_peak_mem_bytes or {"step": result.peak_mem_bytes}
    binding = max(phases, key=lambda p: (phases[p], -PHASES.index(p) if p in PHASES else 0))
    if budget is None:
        return Score("complete", values, {"memory": 0.0, "rules": 0.0}, True,
                     f"slow: {result.message}" if result.status is ProbeStatus.SLOW else "",
                     None, binding)
    overshoot = phases[binding] / budget - 1.0
    if result.status is ProbeStatus.SLOW:  # its memory as measured; its rate at most that
        return Score("complete", values, {"memory": overshoot, "rules": 0.0}, overshoot <= 0,
                     f"slow: {result.message}", budget, binding)
    if overshoot > 0:
        reason = (f"over headroom in {binding}: {format_bytes(phases[binding])} > budget "
                  f"{format_bytes(budget)} ({headroom:.0%} headroom)")
        return Score("complete", values, {"memory": overshoot, "rules": 0.0}, False, reason,
                     budget, binding)
    return Score("complete", values, {"memory": overshoot, "rules": 0.0}, True, "", budget,
                 binding)


def slow_floor(objective: str, best_value: float | None, best_trial: int | None,
               step_cv: float | None) -> SlowFloor | None:
    """The floor under which a probe stops slow: the best feasible config's figure less the
    noise (SLOW_MARGIN_Z step-to-step spreads, SLOW_MARGIN_MIN at least). None while nothing
    fits, or for pareto (a slow config may still hold the least memory)."""
    if objective == "pareto" or best_value is None or best_trial is None or best_value <= 0:
        return None
    margin = min(SLOW_MARGIN_MAX, max(SLOW_MARGIN_MIN, SLOW_MARGIN_Z * (step_cv or 0.0)))
    return SlowFloor(tokens_per_s=best_value * (1.0 - margin),
                     per_gib=objective == "throughput_per_memory", incumbent=best_trial,
                     margin=margin)


def scalar(values: tuple[float, ...] | list[float], objective: str) -> float:
    """One number to rank trials by, higher is better (pareto: tokens/s per GiB)."""
    if objective == "pareto":
        return values[0] / values[1] if values[1] > 0 else 0.0
    return values[0]
