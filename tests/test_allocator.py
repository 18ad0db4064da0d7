"""The caching allocator model (memory/allocator.py): each rule of PyTorch's
CUDACachingAllocator.cpp it models, checked on streams whose reserve is worked out by hand,
and the replay of a real traced step (a GPU's, traced on this CPU) against its tensors."""

from __future__ import annotations

import dataclasses

import pytest

from autotune.memory.allocator import CachingAllocator, iter_blocks, round_size, segment_size
from autotune.memory.replay import (
    ALLOC,
    EMPTY_CACHE,
    FREE,
    MARK,
    PHASE,
    RECORD,
    AllocatorSettings,
    parse_expandable,
    replay,
    smallest_cap,
)

MiB = 1 << 20


def test_requests_round_to_512_bytes_and_segments_follow_the_size_classes():
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert segment_size(100) == 2 * MiB  # small pool: a 2 MiB segment
    assert segment_size(1 * MiB) == 2 * MiB  # 1 MiB is still small (<=)
    assert segment_size(1 * MiB + 512) == 20 * MiB  # large, under 10 MiB: 20 MiB
    assert segment_size(10 * MiB) == 10 * MiB  # from 10 MiB: rounded up to 2 MiB
    assert segment_size(11 * MiB) == 12 * MiB


def test_a_freed_block_is_cached_and_reused_by_best_fit_with_a_split():
    allocator = CachingAllocator()
    allocator.malloc(1, 100 * MiB)
    allocator.malloc(2, 60 * MiB)
    allocator.free(1)
    assert allocator.reserved_bytes == 160 * MiB  # freed, still reserved
    allocator.malloc(3, 30 * MiB)  # the 100 MiB block fits best of the free ones: split
    assert allocator.reserved_bytes == 160 * MiB
    blocks = list(iter_blocks(allocator))
    assert [(size // MiB, used) for _, size, used in blocks] == [(30, True), (70, False),
                                                                 (60, True)]
    allocator.malloc(4, 80 * MiB)  # no free block of 80 MiB: a new segment
    assert allocator.reserved_bytes == 240 * MiB


def test_a_large_block_is_split_only_when_more_than_a_mib_would_be_left():
    allocator = CachingAllocator()
    allocator.malloc(1, 20 * MiB)
    allocator.free(1)
    allocator.malloc(2, 20 * MiB - MiB)  # 1 MiB left over: not split, all of it is taken
    assert allocator.allocated_bytes == 20 * MiB
    allocator.free(2)
    allocator.malloc(3, 12 * MiB)  # 8 MiB left: split
    assert allocator.allocated_bytes == 12 * MiB


def test_a_phase_keeps_its_requests_own_bytes_beside_the_blocks_torch_counts_allocated():
    """torch's allocated statistic counts blocks: a request rounded up to 512 bytes, and a
    cached block handed out whole where its rest would be 1 MiB or less. The replay keeps
    the requests' own bytes too (the tensors alone), so what lies between the two is the
    allocator's, as the sketches count it (memory/sketch: reserved less requested)."""
    allocator = CachingAllocator()
    allocator.malloc(1, 20 * MiB)
    allocator.free(1)
    allocator.reset_peaks()
    allocator.malloc(2, 20 * MiB - MiB)  # the cached 20 MiB block, whole
    allocator.malloc(3, 1000)
    assert allocator.peak_allocated_bytes == 20 * MiB + 1024
    assert allocator.peak_requested_bytes == 20 * MiB - MiB + 1000
    allocator.reset_peaks()
    allocator.free(2)
    assert (allocator.requested_bytes, allocator.peak_requested_bytes) == (1000, 19 * MiB + 1000)
    peaks = replay([(PHASE, "update"), (ALLOC, 1, 3 * MiB + 1, 0), (FREE, 1), (ALLOC, 2, 1000, 0),
                    (PHASE, None)]).phases["update"]
    assert (peaks.allocated_bytes, peaks.requested_bytes) == (3 * MiB + 512, 3 * MiB + 1)
    allocator = CachingAllocator()  # a block another stream used: freed once, though it
    allocator.malloc(1, 4 * MiB)  # waits for the GPU before the cache has it back (torch's
    allocator.record_stream(1, 7)  # requested_bytes keeps it until then: the replay's
    allocator.free(1)  # counts it the allocator's)
    assert (allocator.allocated_bytes, allocator.requested_bytes) == (0, 0)
    allocator.marks += 5
    allocator.malloc(2, 1000)  # takes the pending block back first
    allocator.free(1)
    assert (allocator.allocated_bytes, allocator.requested_bytes) == (1024, 1000)


def test_neighbours_merge_when_freed_and_empty_cache_returns_whole_segments_only():
    allocator = CachingAllocator()
    allocator.malloc(1, 100 * MiB)
    allocator.free(1)
    allocator.malloc(2, 40 * MiB)
    allocator.malloc(3, 40 * MiB)  # [40 used | 40 used | 20 free] in one segment
    allocator.malloc(4, 50 * MiB)  # its own segment
    allocator.free(4)
    allocator.empty_cache()  # the free 50 MiB segment goes; the split one stays
    assert allocator.reserved_bytes == 100 * MiB
    allocator.free(2)
    allocator.free(3)  # all three pieces merge back into one free 100 MiB block
    assert [(size // MiB, used) for _, size, used in iter_blocks(allocator)] == [(100, False)]
    allocator.empty_cache()
    assert allocator.reserved_bytes == 0


def test_a_stream_never_reuses_another_streams_blocks():
    allocator = CachingAllocator()
    allocator.malloc(1, 100 * MiB, stream=1)
    allocator.free(1)
    allocator.malloc(2, 100 * MiB, stream=0)
    assert allocator.reserved_bytes == 200 * MiB
    allocator.malloc(3, 100 * MiB, stream=1)
    assert allocator.reserved_bytes == 200 * MiB


def test_small_requests_share_two_mib_segments_apart_from_large_ones():
    allocator = CachingAllocator()
    for i in range(4):
        allocator.malloc(i, 512 * 1024)
    assert allocator.reserved_bytes == 2 * MiB
    allocator.malloc(10, 2 * MiB)  # large pool: its own 20 MiB segment
    assert allocator.reserved_bytes == 22 * MiB


def test_at_the_cap_the_cache_is_freed_and_the_allocation_retried():
    events = [(ALLOC, 1, 100 * MiB, 0), (FREE, 1), (ALLOC, 2, 150 * MiB, 0), (FREE, 2),
              (ALLOC, 3, 200 * MiB, 0)]
    free = replay(events)  # no cached block fits the next request: three segments
    assert free.peak_reserved_bytes == 450 * MiB and free.oom is None
    capped = replay(events, cap_bytes=250 * MiB)  # the cached 100 and 150 MiB freed for 200
    assert capped.oom is None and capped.num_alloc_retries == 1
    tight = replay(events, cap_bytes=200 * MiB)  # and the 100 MiB one for the 150 before
    assert tight.oom is None and tight.num_alloc_retries == 2
    too_small = replay(events, cap_bytes=190 * MiB)  # 200 MiB cannot fit at all
    assert too_small.oom is not None and too_small.oom.request_bytes == 200 * MiB
    assert smallest_cap(events, AllocatorSettings(), resolution_bytes=MiB) == 200 * MiB


def test_a_block_another_stream_used_is_reused_only_once_the_gpu_is_past_its_free():
    """record_stream: FSDP1's unsharded parameter (made on its all-gather stream, used on the
    default one) is cached after its free only once the GPU has run past it, taken to be
    GPU_LAG_MARKS (1) reshards behind the CPU: the next all-gather takes a segment of its
    own, the one after the next reshard but one finds the first block again."""
    gather = [(ALLOC, 1, 100 * MiB, 1), (RECORD, 1, 0), (FREE, 1), (MARK,),
              (ALLOC, 2, 100 * MiB, 1), (FREE, 2), (MARK,), (ALLOC, 3, 100 * MiB, 1)]
    deferred = replay(gather)
    assert deferred.peak_reserved_bytes == 200 * MiB and deferred.peak_allocated_bytes == 100 * MiB
    assert replay([e for e in gather if e[0] != RECORD]).peak_reserved_bytes == 100 * MiB
    own_stream = [(RECORD, 1, 1) if e[0] == RECORD else e for e in gather]
    assert replay(own_stream).peak_reserved_bytes == 100 * MiB  # torch ignores its own stream
    allocator = CachingAllocator()
    for kind, *args in gather[:5]:
        {ALLOC: allocator.malloc, FREE: allocator.free, RECORD: allocator.record_stream,
         MARK: lambda: None}[kind](*args)
    allocator.empty_cache()  # synchronises: the pending block back, then its segment freed
    assert allocator.reserved_bytes == 100 * MiB and not allocator.pending


def test_phases_start_from_an_empty_cache_with_their_own_peaks():
    events = [(PHASE, "rollout"), (ALLOC, 1, 300 * MiB, 0), (FREE, 1), (PHASE, None),
              (PHASE, "update"), (ALLOC, 2, 100 * MiB, 0), (FREE, 2), (ALLOC, 3, 50 * MiB, 0),
              (PHASE, None), (EMPTY_CACHE,)]
    result = replay(events)
    assert result.phase_reserved_bytes == {"rollout": 300 * MiB, "update": 100 * MiB}
    assert result.phase_allocated_bytes == {"rollout": 300 * MiB, "update": 100 * MiB}


def test_expandable_segments_map_only_what_the_free_tail_lacks():
    """A request no free block fits grows the stream's segment by the pages the free block at
    its end lacks (20 MiB pages in the large pool), where plain segments take a new one."""
    stream = [(ALLOC, 1, 100 * MiB, 0), (ALLOC, 2, 60 * MiB, 0), (FREE, 2),
              (ALLOC, 3, 90 * MiB, 0)]
    plain = replay(stream)
    assert plain.peak_reserved_bytes == 250 * MiB
    expandable = replay(stream, AllocatorSettings(True, at_start=True))
    assert expandable.peak_reserved_bytes == 200 * MiB  # 100 + 60, then 30 more (40 mapped)


def test_empty_cache_unmaps_free_pages_of_an_expandable_segment():
    allocator = CachingAllocator(expandable_segments=True)
    allocator.malloc(1, 100 * MiB)
    allocator.malloc(2, 100 * MiB)
    allocator.free(1)
    assert allocator.reserved_bytes == 200 * MiB
    allocator.empty_cache()  # the first 100 MiB are whole pages: unmapped
    assert allocator.reserved_bytes == 100 * MiB
    allocator.malloc(3, 50 * MiB)  # mapped again in the hole, not at the end
    assert allocator.reserved_bytes == 160 * MiB  # 3 pages of 20 MiB


def test_switched_off_expandable_segments_are_left_alone():
    """verl and the probe turn expandable segments off for the rollout: the segment's free
    blocks serve nothing until they are on again."""
    allocator = CachingAllocator(expandable_segments=True)
    allocator.malloc(1, 100 * MiB)
    allocator.free(1)
    allocator.expandable_segments = False
    allocator.malloc(2, 50 * MiB)
    assert allocator.reserved_bytes == 150 * MiB
    allocator.expandable_segments = True
    allocator.malloc(3, 50 * MiB)
    assert allocator.reserved_bytes == 150 * MiB


def test_the_allocator_settings_read_pytorch_cuda_alloc_conf():
    assert parse_expandable("expandable_segments:True") is True
    assert parse_expandable("max_split_size_mb:128,expandable_segments:True") is True
    assert parse_expandable("expandable_segments:True,expandable_segments:False") is False
    assert parse_expandable(None) is False
    verl = AllocatorSettings.from_env(None, expandable_segments=True)
    assert [verl.expandable_in(p) for p in ("build", "rollout", "update")] == \
        [False, False, True]


@pytest.mark.parametrize("model", ["tiny-qwen2.5", "tiny-qwen2.5-vl"])
def test_a_traced_gpu_step_replays_to_a_reserve_above_its_tensors(make_request, model):
    """The trace of a GPU's step (bf16, the GPU's kernels; fake tensors on this CPU) records
    its allocation stream; replayed, each phase reserves at least its live tensors, the
    smallest cap it runs under lies between its allocated and reserved peaks, and under a
    cap below the live tensors the replay runs out of memory in the phase that needs them."""
    from autotune.hardware import Device
    from autotune.probe.trace import trace_request

    request = dataclasses.replace(make_request(model=model),
                                  device=Device("cuda", capacity_bytes=80 << 30))
    events: list[tuple] = []
    traced = trace_request(request, 0, events=events)
    assert traced.allocator == {"expandable_segments": False, "off_in_rollout": True,
                                "at_start": False}
    assert set(traced.phase_reserved_bytes) == set(traced.phase_tensor_bytes)
    for phase, reserved in traced.phase_reserved_bytes.items():
        assert reserved >= traced.phase_tensor_bytes[phase]
        assert traced.phase_peak_mem_bytes[phase] == reserved  # no fixed term asked for
    assert max(traced.phase_tensor_bytes.values()) <= traced.fits_under_bytes <= \
        max(traced.phase_reserved_bytes.values()) + (64 << 20)
    binding = max(traced.phase_tensor_bytes, key=traced.phase_tensor_bytes.get)
    starved = replay(events, cap_bytes=traced.phase_tensor_bytes[binding] // 2)
    assert starved.oom is not None
