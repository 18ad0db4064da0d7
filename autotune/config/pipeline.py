"""A step's seconds from its phases' seconds, by where the engine runs (issue 68).

Colocated, every GPU runs every phase in turn (verl's and EasyR1's hybrid engine, TRL's
colocate mode): the step is the sum of its phases, the weight sync inside the rollout's
wake-up.

Separate, the engine's GPUs run the rollout (ENGINE_PHASES) and the trainer's GPUs the
trained phases (the log-prob passes, the critic's update, the update); the actor's weights go
from the trainer to the engine once a step (`sync_s`). How the two sides meet is the staleness
(docs/research/placement.md):

- staleness 0: the trainer waits for each rollout and the engine for each update and sync
  (TRL's server mode: `sync_weights` before each generation): rollout, trained phases and
  sync one after another;
- staleness >= 1: the rollout of the next step runs while this one trains (verl's
  one-step-off `fit_step`: generate(next) beside train, then `update_weights`; its fully
  async trainer with a bounded lag): the slower side, then the sync. A larger bound buffers
  more steps but in a steady state runs at the same pace (it absorbs differences between
  steps, which mean times do not show).

Pure arithmetic; the probe's figures, the pooled ones and the benchmarks' time models all
compose a step here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autotune.config.schema import ENGINE_PHASES, SYNC_PHASE


@dataclass(frozen=True)
class PipelineStep:
    """One step of a separate placement: each side's seconds, the sync's and the staleness."""

    engine_s: float
    trainer_s: float
    sync_s: float
    staleness: int

    @property
    def overlapped(self) -> bool:
        return self.staleness >= 1

    @property
    def step_s(self) -> float:
        if self.overlapped:
            return max(self.engine_s, self.trainer_s) + self.sync_s
        return self.engine_s + self.trainer_s + self.sync_s

    @property
    def waiting_side(self) -> str:
        """The side that idles each step: overlapped, the faster one; else both take turns
        (each waits for the other's whole phase)."""
        if not self.overlapped:
            return "both"
        return "trainer" if self.engine_s > self.trainer_s else "engine"

    @property
    def idle_s(self) -> float:
        """Seconds a step the waiting side's GPUs idle (overlapped: the gap between the
        sides; taking turns: each side idles while the other runs, here the engine's)."""
        if self.overlapped:
            return abs(self.engine_s - self.trainer_s)
        return self.trainer_s + self.sync_s


def pipeline_step(phase_s: Mapping[str, float], staleness: int,
                  sync_s: float | None = None) -> PipelineStep:
    """A separate placement's step from each phase's seconds on its own side's GPUs; the
    sync's are `sync_s`, else phase_s's SYNC_PHASE (none: 0)."""
    sync = phase_s.get(SYNC_PHASE, 0.0) if sync_s is None else sync_s
    if sync < 0 or staleness < 0:
        raise ValueError(f"sync_s={sync} and staleness={staleness} must be at least 0")
    engine = sum(s for phase, s in phase_s.items() if phase in ENGINE_PHASES)
    trainer = sum(s for phase, s in phase_s.items()
                  if phase not in ENGINE_PHASES and phase != SYNC_PHASE)
    return PipelineStep(engine, trainer, sync, staleness)


def step_seconds(phase_s: Mapping[str, float], separate: bool, staleness: int = 0,
                 sync_s: float | None = None) -> float:
    """One step's seconds: colocated, the phases' sum; separate, pipeline_step's."""
    if not separate:
        return sum(phase_s.values())
    return pipeline_step(phase_s, staleness, sync_s).step_s


def pacing_phases(phase_s: Mapping[str, float], separate: bool, staleness: int = 0,
                  tolerance: float = 0.0) -> frozenset[str]:
    """The phases of `phase_s` whose seconds set the step: colocated or taking turns, every
    one; overlapped (staleness >= 1), the slower side's and the sync (the faster side's
    seconds only set how long it waits; both sides where they are within `tolerance`, a
    share of the slower one's seconds: the measurement's noise)."""
    if not separate or staleness < 1:
        return frozenset(phase_s)
    step = pipeline_step(phase_s, staleness)
    slower_s = max(step.engine_s, step.trainer_s)
    sides = {side for side, s in (("engine", step.engine_s), ("trainer", step.trainer_s))
             if s >= (1.0 - tolerance) * slower_s}
    return frozenset(phase for phase in phase_s if phase == SYNC_PHASE or
                     ("engine" if phase in ENGINE_PHASES else "trainer") in sides)
