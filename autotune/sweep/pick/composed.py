"""The untried config the study's own phase measurements say is best: proposed, never picked.

Configs share phases (pooled.py): an untried config whose every phase some probe already ran
(its phase keys) has a step the study can compose from those probes' phase times, as the pick
composes a probed config's, and a peak from the probes that held each of its phases' memory
(memory.phases.phase_knobs: the knobs that move that phase's own peak, not the update's
whose segments a later phase finds held (memory.phases.CARRIED_KNOBS): a few percent of a
phase's peak, left to the composed config's own probe; the weight sync of a split, which
declares none, is left to the feasibility rules the queued config meets like any
other, as is every peak against the device). The sweep queues the best
such config when it beats the best probed one (tuner.py, in the neighbour's probe slot): the
best rollout of one probe and the best update of another make a config no sampler may have
proposed yet. It is then probed like any other (feasibility first), and picked only on its
own probe: a composition proposes, it never decides.

The same phase measurements say which knobs' moves can change a config's objective at all
(`moving_knobs`): on a split whose sides overlap, the waiting side's knobs change neither the
step nor, unless that side holds the peak, the memory; the sweep's neighbour moves try the
others first (in placement.py's sweep, 3 of the leader's 7 last neighbours in a seed that
missed the best moved the engine's knobs while the trainer paced the step by 20 s).

Pure arithmetic over the study's probes (pooled.ProbeTimes) and the space's untried configs.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from autotune.config import Knobs, ProbeConfig
from autotune.config.pipeline import step_seconds
from autotune.memory.phases import PHASE_KNOBS, phase_knobs
from autotune.sweep.pick.pooled import ProbeTimes, pacing_knobs, phase_key, phase_samples
from autotune.sweep.study.objective import counts_memory, scalar, values_of


@dataclass(frozen=True)
class Composed:
    """An untried config as the study's probes compose it."""

    params: Knobs
    tokens_per_s: float
    peak_mem_bytes: int
    score: float  # under the sweep's objective, as objective.scalar ranks a probed trial


def memory_key(phase: str, knobs: Knobs, config: ProbeConfig) -> str:
    """What two configs must share for `phase` to hold the same memory (phase_knobs of
    `config`, the knobs' whole config)."""
    moving = phase_knobs(phase, config)
    return json.dumps([phase, {k: v for k, v in knobs.items() if k in moving}],
                      sort_keys=True, default=str)


class Composer:
    """The study's probes indexed by each phase's work and memory, to compose untried
    configs from."""

    def __init__(self, probes: Iterable[ProbeTimes], objective: str) -> None:
        probes = list(probes)
        self.objective = objective
        self.samples = phase_samples(probes)
        self.peaks: dict[str, int] = {}  # memory_key -> the most any probe held there
        for probe in probes:
            config = ProbeConfig.from_knobs(probe.knobs)
            for phase, peak in probe.phase_peak_bytes.items():
                if phase not in PHASE_KNOBS:  # the weight sync: no declaration of its own
                    continue
                key = memory_key(phase, probe.knobs, config)
                self.peaks[key] = max(self.peaks.get(key, 0), peak)

    def compose(self, params: Knobs, fixed: Knobs) -> Composed | None:
        """`params`' step and peak from the probes that ran each of its phases; None where
        one of its phases (the rollout's probes say which it runs) no probe ran, or its
        memory no probe held."""
        knobs = {**fixed, **params}
        rollout = self.samples.get(("rollout", phase_key("rollout", knobs)))
        if not rollout:
            return None
        phases = list(rollout[0].phase_s)  # the algorithm and placement are in that key
        phase_s: dict[str, float] = {}
        for phase in phases:
            shared = self.samples.get((phase, phase_key(phase, knobs)))
            if not shared:
                return None
            basis = [p for p in shared if not p.contended] or shared  # as pooled_steps
            phase_s[phase] = statistics.fmean(p.phase_s[phase] for p in basis)
        config = ProbeConfig.from_knobs(knobs)
        peak = 0
        for phase in rollout[0].phase_peak_bytes:
            if phase in PHASE_KNOBS:
                held = self.peaks.get(memory_key(phase, knobs, config))
                if held is None:  # no probe held this phase's memory
                    return None
                peak = max(peak, held)
        if not peak:
            return None
        step_s = step_seconds(phase_s, knobs.get("placement") == "separate",
                              int(knobs.get("staleness") or 0))
        tokens_per_s = statistics.fmean(p.tokens_per_step for p in rollout) / step_s
        return Composed(params=params, tokens_per_s=tokens_per_s, peak_mem_bytes=peak,
                        score=scalar(values_of(tokens_per_s, peak, self.objective),
                                     self.objective))


def best_composed(probes: Iterable[ProbeTimes], untried: Iterable[Knobs], fixed: Knobs,
                  objective: str, budget_bytes: int | None, beat: float | None
                  ) -> Composed | None:
    """The untried config the probes compose best, within `budget_bytes` (the probes'
    budget: no composition past it is proposed) and better than `beat` (the best probed
    config's score); None where none composes so."""
    composer = Composer(probes, objective)
    best: Composed | None = None
    for params in untried:
        found = composer.compose(params, fixed)
        if found is None or (budget_bytes is not None and found.peak_mem_bytes > budget_bytes):
            continue
        if (beat is None or found.score > beat) and (best is None or found.score > best.score):
            best = found
    return best


def moving_knobs(knobs: Knobs, phase_s: dict[str, float], phase_peak_bytes: dict[str, int],
                 objective: str, tolerance: float = 0.0) -> frozenset[str]:
    """The knobs of a config of `knobs`, so measured, whose one-step moves can change its
    objective: those that can change its step's seconds (pooled.pacing_knobs), and where the
    objective counts memory, those that move the peak of the phase holding its peak
    (memory.phases.phase_knobs). With a split whose sides overlap, a knob only the waiting
    side reads moves neither: the neighbour moves try the others first (tuner.py).
    `tolerance`: the sides' seconds within this share of each other both pace."""
    moving = pacing_knobs(knobs, phase_s, tolerance)
    if counts_memory(objective) and phase_peak_bytes:
        binding = max(phase_peak_bytes, key=lambda phase: phase_peak_bytes[phase])
        if binding in PHASE_KNOBS:  # the weight sync declares none
            moving |= phase_knobs(binding, ProbeConfig.from_knobs(knobs)) & knobs.keys()
    return moving
