"""A finalist's repeat timed where it decides: only the phases that separate it from the
finalists still close to it.

Two configs whose keys (pooled.phase_key) agree in a phase ran the same work there: the pooled
figure gives both the same mean for it, so timing that phase again cannot move one against the
other. A round of repeats therefore times, in every close finalist alike, only the phases in
which their keys are not all the same (`separating_phases`): each repeat's warm-up step runs
whole (every phase to what it holds), its timed steps only those phases
(ProbeRequest.timed_phases). Finalists that differ
only in the update's knobs (micro-batch, checkpointing) re-measure the update alone, not the
rollout: a third of README command 1's step on the H200 (14 of 43 s), most of a real run's.

What the focused probe did not time, the config's own whole probe did: `completed` takes its
untimed phases' seconds and peaks from that probe, so the repeat's step, tokens/s and objective
are a whole step's (its timed phases' seconds its own), and the trial says which phases it
timed and whose the rest are. pooled.py takes only the timed phases' seconds from it.

A phase timed alone ran 0-4% faster than the same phase in whole steps on a 2-core CPU
(benchmarks/results/focused_repeat.txt: 0.956 LoRA, 0.971 PPO, 0.985-1.002 the demo's configs;
caches and pages warm from the last run of the same phase). That is why every close finalist of
a round is timed on the same phases: the bias is common to the figures being compared, and
what remains of it in a pick's figure is a share of a share (the focused repeats among its
probes, the timed phases in its step): under 1% in those rows. Pure arithmetic over knobs and
results; the finalists (finalists.py) ask it.
"""

from __future__ import annotations

from collections.abc import Iterable

from autotune.config import Knobs
from autotune.probe.measure.result import ProbeResult, ProbeStatus
from autotune.sweep.pick.pooled import phase_key

UNTIMED_FROM = "untimed_from"  # trial attr of a focused repeat: the probe its untimed phases
# are from


def separating_phases(configs: Iterable[Knobs], phases: Iterable[str]) -> tuple[str, ...]:
    """The phases of `phases` in which `configs` do not all do the same work; () when that
    is every phase or there are fewer than two configs (whole probes)."""
    configs, phases = list(configs), [p for p in phases if p != "validation"]
    differing = tuple(p for p in phases if len({phase_key(p, knobs) for knobs in configs}) > 1)
    return differing if differing and len(differing) < len(phases) else ()


def is_whole(result: ProbeResult) -> bool:
    """A probe that timed every phase of whole steps (the basis a focused repeat completes
    from)."""
    return result.status is ProbeStatus.OK and not result.timed_phases and \
        bool(result.phase_s) and bool(result.step_s) and bool(result.tokens_per_s)


def completed(result: ProbeResult, whole: ProbeResult) -> ProbeResult:
    """A focused probe's `result` with the phases it did not time taken from `whole`, a
    probe of the same config that timed them all: their seconds in each step, their peaks
    (the most of both). Anything else (not focused, failed) is returned as it is."""
    if not result.timed_phases or result.status is not ProbeStatus.OK or \
            not is_whole(whole) or result.step_s is None:
        return result
    timed = set(result.timed_phases)
    untimed = {p: s for p, s in whole.phase_s.items() if p not in timed}
    untimed_s = sum(s for p, s in untimed.items() if p != "validation")
    step_s = result.step_s + untimed_s
    assert whole.tokens_per_s is not None and whole.step_s is not None
    tokens_per_step = whole.tokens_per_s * whole.step_s
    peaks = dict(result.phase_peak_mem_bytes)
    for phase, peak in whole.phase_peak_mem_bytes.items():
        if phase not in timed:
            peaks[phase] = max(peak, peaks.get(phase, 0))
    samples_per_s = None if whole.samples_per_s is None else \
        whole.samples_per_s * whole.step_s / step_s
    return result.replace(
        phase_s={**untimed, **{p: s for p, s in result.phase_s.items() if p in timed}},
        step_s=step_s, step_times_s=[t + untimed_s for t in result.step_times_s],
        tokens_per_s=tokens_per_step / step_s, samples_per_s=samples_per_s,
        phase_peak_mem_bytes=peaks, peak_mem_bytes=max(peaks.values(), default=None))
