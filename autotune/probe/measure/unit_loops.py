"""A phase's repeated units, which of them a probe runs, and the step's time from a sample.

Each phase of a step repeats units of one shape: the rollout its generation waves (as many
sequences as the engine holds at once), the experience its micro-batches of log-prob and value
forwards, the updates their mini-batches of micro-batches, each mini-batch ending in an
optimizer step. What the step holds is reached in the first units (the engine's pool at
wake-up, a micro-batch's activations, AdamW's state at the first optimizer step) and in the
last (what the earlier ones leave held); the units between repeat it. So a short probe runs,
of each loop, its first unit, one from its middle and its last (`short_schedule`), times
each, and adds to the phase's clock what the units it skipped would have taken: each skipped
unit's work (rows or tokens) times the time per unit of work of the sampled units between
the first and the last (`UnitLoop.basis`). A middle unit, not the second: what changes
along a loop (the units' own pace, a cache that grows) is read where it stands for the
loop's mean (docs/probe-and-engine.md). A wave's decode steps run their first blocks and
their last (`DECODE_SAMPLE`: a cost that grows with the context averages out between the
second and the second-last). A loop inside a loop (micro-batches inside a mini-batch, a
wave's blocks of decode steps inside the wave) adds its skipped units' estimate to the unit
it runs in, so an outer unit's time is what it would have taken whole. What a probe does
outside the loops (waking the engine, the offload transfers, the optimizer steps of the
mini-batches it runs) it runs every step, and times.

A short probe's warm-up step runs each loop's first unit only (`warmup_schedule`, with any
unit whose shape the others lack, and the last where the step's peak needs it: the update's
mini-batches and micro-batches, `warm_last`, step/update.py): what a warm-up is for happens
there (AdamW's state made at the first optimizer step, every phase run once with it held,
each shape's first run), and the timed steps run the rest of their sample with the step
settled.

A full probe runs every unit and estimates nothing. Pure arithmetic and the clock (UnitClock)
the probe's meter keeps (meter.py); no torch.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

SHORT_SAMPLE = 2  # a short probe runs two of a loop's units before its last: first, middle
DECODE_BLOCKS = 16  # a wave's decode steps, as a short probe's units: this many blocks ...
DECODE_SAMPLE = 2  # ... of which it runs the first two and the last two
# a short probe's warm-up runs the last unit of the update's loops (mini-batches and their
# micro-batches, actor and critic) too: a full step's update peak on a GPU holds a later
# mini-batch's gradients beside AdamW's state (step/update.py); the time model charges it
UPDATE_WARMS_LAST = True


def short_schedule(count: int, also: Iterable[int] = (), sample: int = SHORT_SAMPLE,
                   tail: int = 1, middle: bool = True) -> list[int]:
    """The units a short probe runs of a loop of `count`, in order: `sample` of them before
    the last `tail` (the first, and the rest spaced evenly through the loop: unit
    count * k // sample for k = 1 .. sample - 1; `middle` False: the ones after the first),
    the last `tail`, and `also` (a unit whose shape the others lack)."""
    if count <= 0:
        return []
    head = {count * k // sample for k in range(sample)} if middle and sample > 1 else \
        set(range(min(sample, count)))
    return sorted({*head, *range(max(0, count - tail), count),
                   *(i for i in also if 0 <= i < count)})


def decode_blocks(steps: int, blocks: int = DECODE_BLOCKS) -> list[int]:
    """A wave's `steps` decode steps as consecutive blocks (the steps in each, in order),
    `blocks` of them at most, the larger first. A short probe runs the first DECODE_SAMPLE
    blocks and the last DECODE_SAMPLE: a step's cost grows with the context it attends over
    (an HF cache) or not (a static one), so the blocks it estimates the others from (the
    second and the second-last, `UnitLoop.basis`) stand as far before the wave's middle
    step as after it, and a cost linear in the context averages to the skipped ones'. Each
    block is one timed unit (one synchronize on a GPU, not one a step)."""
    if steps <= 0:
        return []
    parts = min(blocks, steps)
    size, more = divmod(steps, parts)
    return [size + 1] * more + [size] * (parts - more)


def decode_share(steps: int) -> float:
    """The share of a wave's decode steps a short probe's timed step runs."""
    sizes = decode_blocks(steps)
    ran = short_schedule(len(sizes), sample=DECODE_SAMPLE, tail=DECODE_SAMPLE, middle=False)
    return sum(sizes[i] for i in ran) / steps if steps else 1.0


def warmup_schedule(count: int, also: Iterable[int] = ()) -> list[int]:
    """The units a short probe's warm-up step runs of a loop of `count`: the first, and
    `also` (a unit whose shape the others lack)."""
    if count <= 0:
        return []
    return sorted({0, *(i for i in also if 0 <= i < count)})


@dataclass
class UnitLoop:
    """One loop of a phase as a probe ran it: each unit's work, and the seconds of those it
    ran (with the estimates of any loop inside them)."""

    phase: str
    unit: str
    work: Sequence[float]  # each unit's rows or tokens, in loop order
    seconds: dict[int, float] = field(default_factory=dict)  # the units run, by index
    inner_s: float = 0.0  # what loops inside the current unit estimated for their skips

    @property
    def count(self) -> int:
        return len(self.work)

    @property
    def skipped(self) -> list[int]:
        return [i for i in range(self.count) if i not in self.seconds]

    def basis(self) -> list[int]:
        """The run units the skipped ones are estimated from: those between the first and the
        last (the first may carry what happens once, the last may be a smaller remainder);
        else every run unit but a last one, else the last."""
        ran = sorted(self.seconds)
        last = self.count - 1
        between = [i for i in ran if i not in (0, last)]
        return between or [i for i in ran if i != last] or ran

    def rates(self) -> list[float]:
        """Seconds per unit of work of the basis units."""
        return [self.seconds[i] / self.work[i] for i in self.basis() if self.work[i] > 0]

    def skipped_s(self) -> float:
        """What the skipped units would have taken: their work at the basis units' rate."""
        work = sum(self.work[i] for i in self.skipped)
        rates = self.rates()
        return work * statistics.fmean(rates) if work and rates else 0.0

    def skipped_var_s2(self) -> float:
        """The variance of `skipped_s`: the skipped work squared times the variance of the
        basis rates' mean (0 from fewer than two rates: a step's repeat measures it then)."""
        work = sum(self.work[i] for i in self.skipped)
        rates = self.rates()
        if not work or len(rates) < 2:
            return 0.0
        return work ** 2 * statistics.variance(rates) / len(rates)


class UnitClock:
    """The unit loops of the step running now: which units run, their seconds, and what the
    skipped ones add to each phase (a short probe), or every unit, untimed (a full one)."""

    def __init__(self, short: bool, sync: Callable[[], None] = lambda: None) -> None:
        self.short = short
        self.warming = False  # a short probe's warm-up step: each loop's first unit (warm_last)
        self.sync = sync  # a GPU's synchronize: a unit's kernels end inside its time
        self.open: list[UnitLoop] = []  # the loops running now, outermost first
        self.closed: list[UnitLoop] = []  # the loops ended since `take_loops`
        self.skipped_s: dict[str, float] = {}  # per phase, since `take_skipped`
        self.skipped_var_s2: dict[str, float] = {}

    def iterations(self, phase: str, unit: str, work: Sequence[float], also: Iterable[int] = (),
                   sample: int = SHORT_SAMPLE, tail: int = 1,
                   middle: bool = True, warm_last: bool = False) -> Iterator[int]:
        """The indices of a loop's units to run, in order; each unit's time is what passes
        until the next index is asked for."""
        if not self.short:
            yield from range(len(work))
            return
        loop = UnitLoop(phase, unit, list(work))
        self.open.append(loop)
        try:
            warm_also = (*also, len(work) - 1) if warm_last else tuple(also)
            schedule = warmup_schedule(len(work), warm_also) if self.warming else \
                short_schedule(len(work), also, sample, tail, middle)
            for index in schedule:
                loop.inner_s = 0.0
                started = time.perf_counter()
                yield index
                self.sync()
                loop.seconds[index] = time.perf_counter() - started + loop.inner_s
        finally:
            self.open.remove(loop)
        estimate = loop.skipped_s()
        if self.open:  # the unit this loop ran in would have taken that much longer
            self.open[-1].inner_s += estimate
        self.skipped_s[phase] = self.skipped_s.get(phase, 0.0) + estimate
        self.skipped_var_s2[phase] = self.skipped_var_s2.get(phase, 0.0) + loop.skipped_var_s2()
        self.closed.append(loop)

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """Work a whole loop would not do (a cache grown in one go for the skipped units that
        grow it, before the next one runs): left out of the units it runs in and of its
        phase's time."""
        if not (self.short and self.open):
            yield
            return
        self.sync()
        started = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            elapsed = time.perf_counter() - started
            for loop in self.open:
                loop.inner_s -= elapsed
            phase = self.open[-1].phase
            self.skipped_s[phase] = self.skipped_s.get(phase, 0.0) - elapsed

    def take_skipped(self, phase: str) -> tuple[float, float]:
        """Seconds the phase's skipped units would have taken, and that estimate's variance."""
        return self.skipped_s.pop(phase, 0.0), self.skipped_var_s2.pop(phase, 0.0)

    def take_loops(self) -> list[UnitLoop]:
        """The loops ended since the last call."""
        loops, self.closed = self.closed, []
        return loops


@dataclass(frozen=True)
class UnitTimes:
    """One unit kind of one phase over a probe's timed steps: its loops' size, how many of
    their units ran, and the seconds per unit of work measured."""

    count: float  # units in one loop (mean over the loops run)
    ran: float  # units run of one loop (all of them in a full probe)
    loops: float  # loops run a step (micro-batch loops: one per mini-batch run)
    rate_s: float  # mean seconds per unit of work (rows or tokens) of the basis units
    rate_sd_s: float  # their standard deviation (0 from one)
    samples: int  # basis units timed, over the timed steps

    def as_dict(self) -> dict[str, float]:
        return {"count": self.count, "ran": self.ran, "loops": self.loops,
                "rate_s": self.rate_s, "rate_sd_s": self.rate_sd_s, "samples": self.samples}


def unit_times(steps: Sequence[Sequence[UnitLoop]]) -> dict[str, dict[str, UnitTimes]]:
    """The loops of a probe's timed steps (a list of loops each) by phase and unit."""
    grouped: dict[tuple[str, str], list[UnitLoop]] = {}
    for loops in steps:
        for loop in loops:
            grouped.setdefault((loop.phase, loop.unit), []).append(loop)
    out: dict[str, dict[str, UnitTimes]] = {}
    for (phase, unit), same in grouped.items():
        rates = [rate for loop in same for rate in loop.rates()]
        out.setdefault(phase, {})[unit] = UnitTimes(
            count=statistics.fmean(loop.count for loop in same),
            ran=statistics.fmean(len(loop.seconds) for loop in same),
            loops=len(same) / max(1, len(steps)),
            rate_s=statistics.fmean(rates) if rates else 0.0,
            rate_sd_s=statistics.stdev(rates) if len(rates) > 1 else 0.0,
            samples=len(rates))
    return out


def mean_and_se(values: Sequence[float], within_var: float = 0.0,
                step_cv: float | None = None) -> tuple[float, float]:
    """The mean of `values` (each step's predicted seconds) and its standard error: the spread
    between them over sqrt(n), or where one value alone, the estimates' own variance; never
    under `step_cv` (one step's spread measured elsewhere on this machine, as a fraction of
    the step) times the mean over sqrt(n)."""
    mean = statistics.fmean(values)
    floor = (step_cv or 0.0) * mean / math.sqrt(len(values))
    if len(values) > 1:
        return mean, max(statistics.stdev(values) / math.sqrt(len(values)), floor)
    return mean, max(math.sqrt(within_var), floor)
