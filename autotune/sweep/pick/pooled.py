"""Each probed config's step composed from every probe that ran its phases: the pooled figure.

A phase's time depends on the knobs its run reads, not on the knobs only another phase reads:
the update's micro-batch and checkpointing never touch the rollout, the engine's reservation
and concurrency never touch the update. PHASE_ONLY declares, per phase, the knobs no other
phase's time reads; a phase's key is then every knob of the config but those of the other
phases, the staleness (it orders the phases) and, with placement=separate, those only the other
side's GPUs read (conservative: a knob not declared keeps configs apart in every phase). Two probes
whose configs share a phase's key timed the same work there, so each config's step is the sum
over its phases of the mean phase time over every quiet probe that shares that phase's key
(contended probes only where no quiet one does; with placement=separate the phases are
composed as the pipeline runs them, config/pipeline.py), and its standard error adds
each phase's (conservative where the sides overlap):
the spread between those probes over their count, never under what the probes' own timed
steps say (their step's relative error, taken for each of its phases).

Only probes that ran every phase they timed to its end count (a probe stopped slow timed a
part); a finalist's focused repeat (focused.py) counts for the phases it timed alone. A
config is given a pooled figure only when it was probed itself: its tokens per step come from
its own probes, and a config no probe ran is never figured from the others' phases.

Pure arithmetic over (knobs, result) pairs; measurements.pooled_of reads them from a study's
probes, once for every ranking.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autotune.config import ENGINE_PHASES, SYNC_PHASE, Knobs
from autotune.config.pipeline import pacing_phases, step_seconds
from autotune.files import JsonObject
from autotune.probe.measure.result import ProbeStatus
from autotune.sweep.space.params import params_key
from autotune.sweep.study.sharing import ran_params

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

# The knobs only one phase's time reads (each loop's size, its kernel and its engine); every
# knob not here (the shapes, the batches, offload, fused log-probs, LoRA, SP, the allocator)
# is read by every phase's key.
PHASE_ONLY: dict[str, frozenset[str]] = {
    "rollout": frozenset({"gpu_memory_utilization", "kv_cache_memory_bytes", "max_num_seqs",
                          "rollout_tensor_parallel"}),
    "experience": frozenset({"micro_batch_size_experience", "max_token_len_experience"}),
    "critic_update": frozenset({"critic_micro_batch_size_update",
                                "critic_max_token_len_update",
                                "critic_gradient_checkpointing"}),
    "update": frozenset({"micro_batch_size_update", "max_token_len_update",
                         "gradient_checkpointing", "fused_optimizer", "entropy_coeff"}),
    "validation": frozenset({"val_batch_size"}),
}


# The knobs that order the step's phases, not any phase's work (config/pipeline.py: the
# sides take turns or overlap): no phase's key reads them.
STEP_ONLY = frozenset({"staleness"})
# placement=separate: the engine's GPUs run the rollout and nothing else, the trainer's GPUs
# the trained phases (probe/launch/split_sides.py, as verl's recipes place them), so what only
# one side holds or runs never times the other's phases: the trainer's offloads, log-prob
# kernels, batching and sequence parallelism never touch the engine's GPUs; the engine's kind
# and its sleep never touch the trainer's. (The weight sync runs on both: every knob reads it.)
TRAINER_SIDE_ONLY = frozenset({
    "offload_params", "offload_optimizer", "offload_ref_params", "critic_offload_params",
    "critic_offload_optimizer", "fused_logprob", "fused_logprob_kernel", "entropy_chunking",
    "entropy_metric", "old_logprob_pass", "dynamic_batching",
    "ulysses_sequence_parallel_size"})
ENGINE_SIDE_ONLY = frozenset({"rollout_engine", "enable_sleep", "sleep_level"})


def unread(phase: str, knobs: Knobs) -> frozenset[str]:
    """The knobs `phase`'s time does not read in a config of `knobs`: those only another
    phase reads, the step's order (STEP_ONLY), and with placement=separate those only the
    other side reads."""
    others = frozenset().union(STEP_ONLY, *(only for name, only in PHASE_ONLY.items()
                                            if name != phase))
    if knobs.get("placement") == "separate" and phase != SYNC_PHASE:
        others |= TRAINER_SIDE_ONLY if phase in ENGINE_PHASES else ENGINE_SIDE_ONLY
    return others


def phase_key(phase: str, knobs: Knobs) -> str:
    """What two configs must share for their `phase` to be the same work: every knob it
    reads (`unread`'s complement)."""
    others = unread(phase, knobs)
    return params_key({name: value for name, value in knobs.items() if name not in others})


def pacing_knobs(knobs: Knobs, phase_s: Mapping[str, float], tolerance: float = 0.0
                 ) -> frozenset[str]:
    """The knobs of `knobs` whose moves can change the step's seconds of a config so
    measured (`phase_s`, its phases' seconds): all but those that only phases which set
    none of it read (a split whose sides overlap: the waiting side's, config/pipeline.py
    pacing_phases, `tolerance` its noise). Colocated, every knob; a knob no measured phase
    reads (a phase the probe did not time, a trainer's log that lacks it) is kept."""
    paced = pacing_phases(phase_s, knobs.get("placement") == "separate",
                          int(knobs.get("staleness") or 0), tolerance)
    waiting = [phase for phase in phase_s if phase not in paced]

    def reads(name: str, phases: Iterable[str]) -> bool:
        return any(name not in unread(phase, knobs) for phase in phases)

    return frozenset(name for name in knobs if name in STEP_ONLY or reads(name, paced)
                     or not reads(name, waiting))


@dataclass(frozen=True)
class ProbeTimes:
    """One probe's phase times, as the pool takes them."""

    config: str  # its config's params_key
    knobs: Knobs
    phase_s: dict[str, float]  # the training phases' mean seconds per step
    step_s: float
    relative_se: float  # its step's standard error over its step (its phases' own, unknown)
    tokens_per_step: float
    contended: bool
    phase_peak_bytes: dict[str, int] = field(default_factory=dict)  # each phase's peak


@dataclass(frozen=True)
class PooledStep:
    """A probed config's step as every probe that shares its phases measured it."""

    step_s: float
    step_se_s: float
    tokens_per_s: float
    tokens_per_s_se: float
    probes: int  # probes whose phase times it rests on (its own among them)
    own_probes: int
    least_probes: int  # the probes behind its least-probed phase (how sure the sum is)
    contended: bool  # a phase rests on contended probes only (no quiet one shares it)

    def as_dict(self) -> JsonObject:
        return {"tokens_per_s": round(self.tokens_per_s, 2),
                "tokens_per_s_se": round(self.tokens_per_s_se, 2),
                "step_s": round(self.step_s, 4), "step_se_s": round(self.step_se_s, 4),
                "probes": self.probes, "own_probes": self.own_probes,
                "least_probes": self.least_probes, "contended": self.contended}


def probe_times(frozen: FrozenTrial, fixed: Knobs | None = None) -> ProbeTimes | None:
    """A trial's probe as the pool takes it, its knobs the space's `fixed` and its own; None
    for one that timed no whole step (failed, stopped slow, reused, predicted, lost)."""
    attrs, result = frozen.user_attrs, frozen.user_attrs.get("result") or {}
    phase_s, step_s, tokens_per_s = (result.get("phase_s"), result.get("step_s"),
                                     result.get("tokens_per_s"))
    if not attrs.get("probed") or not frozen.state.is_finished() or \
            result.get("status") != ProbeStatus.OK.value or not phase_s or not step_s or \
            not tokens_per_s:
        return None
    knobs = {**(fixed or {}), **ran_params(frozen)}
    timed = result.get("timed_phases") or list(phase_s)  # a focused repeat: its own
    own_s = {p: float(s) for p, s in phase_s.items() if p != "validation" and p in timed}
    return ProbeTimes(config=params_key(frozen.params), knobs=knobs, phase_s=own_s,
                      step_s=float(step_s),
                      relative_se=float(result.get("step_se_s") or 0.0)
                      / (sum(own_s.values()) or float(step_s)),
                      tokens_per_step=float(tokens_per_s) * float(step_s),
                      contended=bool(result.get("contention")),
                      phase_peak_bytes={p: int(b) for p, b in
                                        (result.get("phase_peak_mem_bytes") or {}).items()})


def phase_samples(probes: Iterable[ProbeTimes]) -> dict[tuple[str, str], list[ProbeTimes]]:
    """(phase, phase_key) -> the probes that ran that phase's work."""
    samples: dict[tuple[str, str], list[ProbeTimes]] = {}
    for probe in probes:
        for phase in probe.phase_s:
            samples.setdefault((phase, phase_key(phase, probe.knobs)), []).append(probe)
    return samples


def pooled_steps(probes: Iterable[ProbeTimes]) -> dict[str, PooledStep]:
    """Each probed config's pooled step, by its params_key."""
    probes = list(probes)
    samples = phase_samples(probes)
    own: dict[str, list[ProbeTimes]] = {}
    for probe in probes:
        own.setdefault(probe.config, []).append(probe)
    pooled = {}
    for config, mine in own.items():
        means: dict[str, float] = {}
        variance_s2, contended, least = 0.0, False, len(probes)
        used: set[int] = set()  # the probes it rests on, by id
        for phase in dict.fromkeys(p for probe in mine for p in probe.phase_s):
            shared = samples[(phase, phase_key(phase, mine[0].knobs))]
            quiet = [p for p in shared if not p.contended]
            contended = contended or not quiet
            basis = quiet or shared
            seconds = [p.phase_s[phase] for p in basis]
            mean_s = statistics.fmean(seconds)
            within_s2 = sum((s * p.relative_se) ** 2 for s, p in zip(seconds, basis,
                                                                      strict=True))
            between_s2 = statistics.variance(seconds) if len(seconds) > 1 else 0.0
            variance_s2 += max(between_s2 / len(seconds), within_s2 / len(seconds) ** 2)
            means[phase] = mean_s
            used.update(id(p) for p in basis)
            least = min(least, len(basis))
        knobs = mine[0].knobs
        step_s = step_seconds(means, knobs.get("placement") == "separate",
                              int(knobs.get("staleness") or 0))
        tokens = statistics.fmean(p.tokens_per_step for p in mine)
        se_s = math.sqrt(variance_s2)
        pooled[config] = PooledStep(step_s=step_s, step_se_s=se_s,
                                    tokens_per_s=tokens / step_s,
                                    tokens_per_s_se=tokens / step_s * se_s / step_s,
                                    probes=len(used), own_probes=len(mine),
                                    least_probes=least, contended=contended)
    return pooled
