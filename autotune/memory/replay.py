"""A recorded stream of allocations replayed through the caching allocator (allocator.py).

probe/trace.py records the probe's step as a stream of events; the memory sketches
(memory/sketch) lay one out from a config's shapes. replay() runs it through
CachingAllocator as the probe's meter sees a GPU: each phase starts from `empty_cache()`
and a peak reset, so the result holds each phase's reserved, allocated and requested
peaks, as torch.cuda's statistics read them, and, under a cap, the OOM torch would raise.
smallest_cap() bisects the cap a stream needs. AllocatorSettings says which phases run
with expandable segments (verl switches them off around the engine's wake-up).

Pure Python, no torch, as allocator.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from autotune.memory.allocator import AllocatorOOM, CachingAllocator

ALLOC, FREE, PHASE, EMPTY_CACHE, SETTINGS, RECORD, MARK = "a", "f", "p", "e", "s", "r", "m"


@dataclass
class PhasePeaks:
    """One phase's peaks, as torch.cuda's peak statistics read them after a reset."""

    reserved_bytes: int = 0
    allocated_bytes: int = 0
    requested_bytes: int = 0  # the requests' own bytes at their peak (no rounding, no rest)


@dataclass
class ReplayResult:
    """What the replayed stream reserved, per phase and at most, and whether it fit."""

    phases: dict[str, PhasePeaks] = field(default_factory=dict)
    peak_reserved_bytes: int = 0  # over the whole stream, start-up included
    peak_allocated_bytes: int = 0
    num_alloc_retries: int = 0  # the cache freed to make room under the cap
    oom: AllocatorOOM | None = None

    @property
    def phase_reserved_bytes(self) -> dict[str, int]:
        return {name: peaks.reserved_bytes for name, peaks in self.phases.items()}

    @property
    def phase_allocated_bytes(self) -> dict[str, int]:
        return {name: peaks.allocated_bytes for name, peaks in self.phases.items()}


@dataclass(frozen=True)
class AllocatorSettings:
    """The allocator's settings a run trains under: `expandable_segments` in the training
    phases, off in the rollout when `off_in_rollout` (verl turns them off around the engine's
    wake-up and on again after, and so does the probe's step), and at start-up (the build)
    as the process's PYTORCH_CUDA_ALLOC_CONF says."""

    expandable_segments: bool = False
    off_in_rollout: bool = True
    at_start: bool = False  # expandable segments at start-up, before the first phase

    def expandable_in(self, phase: str | None) -> bool:
        if phase is None or phase == "build":
            return self.at_start
        return self.expandable_segments and not (self.off_in_rollout and phase == "rollout")

    @classmethod
    def from_env(cls, alloc_conf: str | None, expandable_segments: bool,
                 off_in_rollout: bool = True) -> AllocatorSettings:
        """The settings of a process started with PYTORCH_CUDA_ALLOC_CONF `alloc_conf` whose
        step switches expandable segments per phase as the knob says."""
        return cls(expandable_segments, off_in_rollout, parse_expandable(alloc_conf))


def parse_expandable(alloc_conf: str | None) -> bool:
    """Whether PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) turns expandable segments on:
    comma-separated key:value pairs, the last one saying."""
    on = False
    for item in (alloc_conf or "").split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            on = value.strip().lower() == "true"
    return on


def replay(events: Iterable[tuple], settings: AllocatorSettings = AllocatorSettings(),
           cap_bytes: int | None = None) -> ReplayResult:
    """Replay a recorded stream through the allocator: its reserved and allocated peaks per
    phase (each phase begins with `empty_cache()` and a peak reset, as the probe's meter
    does), and, with `cap_bytes`, whether it fits under that cap.

    Events: (ALLOC, id, bytes, stream), (FREE, id), (PHASE, name) at a phase's start,
    (PHASE, None) at its end, (EMPTY_CACHE,), (RECORD, id, stream) for `record_stream`,
    (MARK,) where FSDP1 reshards a unit.
    """
    allocator = CachingAllocator(cap_bytes, settings.at_start)
    result = ReplayResult()
    for event in events:
        kind = event[0]
        if kind == ALLOC:
            try:
                allocator.malloc(event[1], event[2], event[3])
            except AllocatorOOM as oom:
                result.oom = oom
                break
            result.peak_allocated_bytes = max(result.peak_allocated_bytes,
                                              allocator.allocated_bytes)
        elif kind == FREE:
            allocator.free(event[1])
        elif kind == RECORD:
            allocator.record_stream(event[1], event[2])
        elif kind == MARK:
            allocator.marks += 1
        elif kind == PHASE:
            name = event[1]
            if name is not None:
                allocator.expandable_segments = settings.expandable_in(name)
            allocator.empty_cache()
            if name is None:
                phase = allocator.phase
                if phase is not None:
                    peaks = result.phases.setdefault(phase, PhasePeaks())
                    peaks.reserved_bytes, peaks.allocated_bytes, peaks.requested_bytes = (
                        max(peaks.reserved_bytes, allocator.peak_reserved_bytes),
                        max(peaks.allocated_bytes, allocator.peak_allocated_bytes),
                        max(peaks.requested_bytes, allocator.peak_requested_bytes))
            else:
                allocator.reset_peaks()
            allocator.phase = name
        elif kind == EMPTY_CACHE:
            allocator.empty_cache()
        result.peak_reserved_bytes = max(result.peak_reserved_bytes,
                                         allocator.peak_reserved_bytes)
    result.num_alloc_retries = allocator.num_alloc_retries
    return result


def smallest_cap(events: list[tuple], settings: AllocatorSettings,
                 resolution_bytes: int = 64 << 20) -> int:
    """The smallest cap (what torch may reserve, to `resolution_bytes`) under which the
    stream runs without an OOM: between the allocated peak (no caching could do with less)
    and the uncapped reserved peak (it never needs more), bisected; under it the allocator
    frees its cache and retries where the uncapped run would have grown."""
    free = replay(events, settings)
    low, high = free.peak_allocated_bytes, free.peak_reserved_bytes
    if replay(events, settings, cap_bytes=low).oom is None:
        return low
    while high - low > resolution_bytes:
        middle = (low + high) // 2
        fits = replay(events, settings, cap_bytes=middle).oom is None
        low, high = (low, middle) if fits else (middle, high)
    return high
