"""PyTorch's CUDA caching allocator, replayed: what a GPU reserves for a stream of allocations.

What decides a CUDA OOM is what the card holds, and torch holds more than its live tensors:
the caching allocator keeps freed blocks in segments it got from cudaMalloc and hands them to
later requests that fit. A block can only serve its own stream's requests; a large freed
block split for a smaller request leaves a remainder that a larger request cannot use; so a
phase whose transient tensors change size (logits, gathered FSDP units, per-stream buffers)
reserves more than its allocated peak. This module is the allocator's state and rules
(CachingAllocator: malloc, free, empty_cache, record_stream); replay.py feeds it a recorded
stream of allocations and frees (probe/trace.py records one for the probe's step) and reads
the reserved peak per phase, the allocated peak, and whether the stream fits under a cap
(the allocator frees its cached segments and retries before it raises).

The rules follow c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.9 to 2.11; the functions are
named where each rule is modelled):

- `round_size`: a request is rounded up to a multiple of 512 bytes (kMinBlockSize);
  `roundup_power2_divisions` is not modelled (off by default).
- `get_pool`: requests up to 1 MiB (kSmallSize) come from the small pool, the rest from
  the large pool; both are keyed by stream, so a stream's free blocks serve only it.
- `get_allocation_size`: a new segment is 2 MiB (kSmallBuffer) for a small request, 20 MiB
  (kLargeBuffer) for one under 10 MiB (kMinLargeAlloc), else the request rounded up to
  2 MiB (kRoundLarge).
- `get_free_block`: best fit, the smallest free block of the stream's pool at least the
  request's size (ties by address); `max_split_size_mb` is not modelled (unlimited by
  default).
- `should_split`: a found block is split when the rest is at least 512 bytes in the small
  pool (and, with expandable segments, in the large one), more than 1 MiB in the large pool.
  torch's allocated statistic counts the block, a rest not split off included; the replay
  keeps the requests' own bytes too (as torch's `requested_bytes`, but dropped at the free,
  also of a block another stream used, which the allocator still holds: the allocator's).
- `free_block` / `try_merge_blocks`: a freed block merges with free neighbours of its
  segment and stays cached; segments go back to CUDA only in `release_cached_blocks`
  (`torch.cuda.empty_cache()`, or the OOM path).
- `malloc`: no fitting free block, then a new segment (`alloc_block`); past the cap,
  `release_cached_blocks` frees every unsplit cached segment and the allocation is retried
  once (`num_alloc_retries`); past the cap again, OutOfMemoryError.
- expandable segments (`expandable_segments:True`): one virtual segment per stream and pool,
  mapped in 2 MiB (small) or 20 MiB (large) pages as it grows (`try_allocate_expandable_block`,
  `map_block`): a request no free block fits maps only what the free block at the segment's
  end lacks; `release_cached_blocks` unmaps every whole free page (`unmap_block`). When the
  setting is switched off while such segments exist (verl and the probe toggle it per phase),
  their free blocks are skipped (`get_free_block`'s "expandable segments has been turned off"
  branch).

- `record_stream` / `insert_events` / `process_events`: a block freed after another stream
  used it (FSDP1 records its unsharded flat parameters and gradients so) is cached only
  once the GPU has run past the free; `malloc` first takes back those it has. When the GPU
  gets there is a matter of timing the CPU cannot see: the GPU is taken GPU_LAG_MARKS
  reshards (MARK events) behind the CPU. `release_cached_blocks` synchronises and takes
  them all back first. FSDP2 records no stream (it keeps such buffers alive itself).

Not modelled: CUDA graphs' private pools, and the garbage collection threshold (off by
default). Pure Python, no torch: `autotune estimate` and the sweep's pre-screen call it.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

MIN_BLOCK_BYTES = 512  # kMinBlockSize: every request is rounded up to a multiple
SMALL_REQUEST_BYTES = 1 << 20  # kSmallSize: at most this comes from the small pool
SMALL_SEGMENT_BYTES = 2 << 20  # kSmallBuffer: a small pool's segment (and expandable page)
LARGE_SEGMENT_BYTES = 20 << 20  # kLargeBuffer: a segment for a request under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge: larger segments are rounded up to this
# How far the GPU runs behind the CPU, in FSDP1 reshards: a block freed after reshard k and
# used on another stream is reusable once the CPU has passed reshard k + 2. FSDP1's rate
# limiter bounds the lag at 2 (an all-gather waits for the free two reshards back); 1 put
# torch's reserved peak within 3% on 22 of 24 trained phases of 10 FSDP1 ranks on an H200
# (0: 10 of 24, all under, to -9.5%; 2: 16 of 24, to +6.9%), benchmarks/results/gpu/holdout*.
GPU_LAG_MARKS = 1


class AllocatorOOM(Exception):
    """The stream does not fit under the cap even after the cached segments were freed."""

    def __init__(self, phase: str | None, request_bytes: int, reserved_bytes: int,
                 allocated_bytes: int, cap_bytes: int) -> None:
        self.phase, self.request_bytes = phase, request_bytes
        self.reserved_bytes, self.allocated_bytes = reserved_bytes, allocated_bytes
        self.cap_bytes = cap_bytes
        super().__init__(f"tried to allocate {request_bytes} bytes in {phase} with "
                         f"{allocated_bytes} allocated and {reserved_bytes} reserved of a "
                         f"{cap_bytes}-byte cap")


def round_size(size: int) -> int:
    """`round_size`: the bytes a request of `size` takes."""
    if size < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    return -(-size // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def is_small(size: int) -> bool:
    """`get_pool`: whether a rounded request comes from the small pool."""
    return size <= SMALL_REQUEST_BYTES


def segment_size(size: int) -> int:
    """`get_allocation_size`: the cudaMalloc a rounded request no free block fits makes."""
    if size <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


class _Block:
    __slots__ = ("addr", "size", "stream", "small", "allocated", "mapped", "prev", "next",
                 "expandable", "used_elsewhere", "requested")

    def __init__(self, addr: int, size: int, stream: int, small: bool,
                 expandable: bool = False, mapped: bool = True) -> None:
        self.addr, self.size, self.stream, self.small = addr, size, stream, small
        self.allocated, self.mapped, self.expandable = False, mapped, expandable
        self.used_elsewhere = False  # record_stream on another stream since it was handed out
        self.requested = 0  # the bytes its allocation asked for (block->requested_size)
        self.prev: _Block | None = None
        self.next: _Block | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.stream, self.size, self.addr)


class _Pool:
    """Free mapped blocks of one pool (small or large), ordered as BlockComparatorSize:
    stream, then size, then address."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: dict[tuple[int, int, int], _Block] = {}

    def add(self, block: _Block) -> None:
        key = block.key
        bisect.insort(self.keys, key)
        self.blocks[key] = block

    def remove(self, block: _Block) -> None:
        key = block.key
        index = bisect.bisect_left(self.keys, key)
        del self.keys[index]
        del self.blocks[key]

    def best_fit(self, stream: int, size: int, expandable_on: bool) -> _Block | None:
        """`get_free_block`: the smallest free block of `stream` of at least `size`; blocks
        of expandable segments only while the setting is on."""
        index = bisect.bisect_left(self.keys, (stream, size, -1))
        while index < len(self.keys):
            key = self.keys[index]
            if key[0] != stream:
                return None
            block = self.blocks[key]
            if not block.expandable:
                return block
            if expandable_on:  # a block with unmapped room after it counts as that large:
                # one that cannot grow is taken first
                while index + 1 < len(self.keys) and self.keys[index + 1][0] == stream:
                    following = self.blocks[self.keys[index + 1]]
                    if not following.expandable or \
                            _expandable_size(following) >= _expandable_size(block):
                        break
                    index += 1
                    block = following
                return block
            index += 1
        return None


def _split(block: _Block, size: int, mapped: bool) -> _Block:
    """`block` keeps its first `size` bytes (the low addresses, as torch splits); the rest
    becomes the next block of the segment, returned (free; `mapped` or not)."""
    rest = _Block(block.addr + size, block.size - size, block.stream, block.small,
                  block.expandable, mapped)
    rest.prev, rest.next = block, block.next
    if block.next is not None:
        block.next.prev = rest
    block.next = rest
    block.size = size
    return rest


def _expandable_size(block: _Block) -> int:
    """A free expandable block's size with the unmapped range after it (`get_free_block`)."""
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped
                         else 0)


class CachingAllocator:
    """The caching allocator's state: segments, cached blocks, reserved and allocated bytes.

    `cap_bytes` is what torch may reserve (the device's free memory, or
    `set_per_process_memory_fraction`'s share of it); None: unbounded."""

    def __init__(self, cap_bytes: int | None = None, expandable_segments: bool = False) -> None:
        self.cap_bytes = cap_bytes
        self.expandable_segments = expandable_segments
        self.pools = {True: _Pool(), False: _Pool()}  # by is_small
        self.live: dict[int, _Block] = {}  # allocation id -> its block
        self.reserved_bytes = self.allocated_bytes = self.requested_bytes = 0
        self.peak_reserved_bytes = self.peak_allocated_bytes = self.peak_requested_bytes = 0
        self.num_alloc_retries = 0
        self.phase: str | None = None
        self._next_addr = 1 << 40  # segment addresses: any increasing numbers
        self._segments: dict[int, _Block] = {}  # plain segments' first block, by address
        # expandable segments: the unmapped ranges of each (stream, small)'s, by address
        self._unmapped: dict[tuple[int, bool], list[_Block]] = {}
        # freed after another stream used them, each with the marks passed at its free
        self.pending: deque[tuple[int, _Block]] = deque()
        self.marks = 0  # marked points the CPU has passed (FSDP1's reshards)

    # -- the public calls: torch's malloc, free and empty_cache ------------------------------

    def malloc(self, alloc_id: int, size: int, stream: int = 0) -> None:
        if size <= 0:
            return
        self._process_events()
        asked, size = size, round_size(size)
        small = is_small(size)
        pool = self.pools[small]
        block = pool.best_fit(stream, size, self.expandable_segments)
        if block is not None:
            pool.remove(block)
        else:
            block = self._new_block(size, stream, small)
            if block is None:  # past the cap: free the cache and retry once
                self.num_alloc_retries += 1
                self.empty_cache()
                block = self._new_block(size, stream, small)
            if block is None:
                raise AllocatorOOM(self.phase, size, self.reserved_bytes,
                                   self.allocated_bytes, self.cap_bytes or 0)
        if self._should_split(block, size):
            pool.add(_split(block, size, mapped=True))
        block.allocated = True
        self.live[alloc_id] = block
        self.allocated_bytes += block.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        block.requested = asked
        self.requested_bytes += asked
        self.peak_requested_bytes = max(self.peak_requested_bytes, self.requested_bytes)

    def record_stream(self, alloc_id: int, stream: int) -> None:
        """`Tensor.record_stream`: the live block is used on `stream` too (ignored for its
        own stream, as torch does)."""
        block = self.live.get(alloc_id)
        if block is not None and stream != block.stream:
            block.used_elsewhere = True

    def free(self, alloc_id: int) -> None:
        block = self.live.pop(alloc_id, None)
        if block is None:
            return
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        if block.used_elsewhere:  # insert_events: cached only once the other stream passes
            block.used_elsewhere = False
            self.pending.append((self.marks, block))
            return
        self._free_block(block)

    def _process_events(self) -> None:
        """`process_events`: a freed block another stream used comes back once the GPU has
        run past its free, the GPU taken GPU_LAG_MARKS marked points (FSDP1's reshards)
        behind the CPU."""
        while self.pending and self.pending[0][0] < self.marks - GPU_LAG_MARKS:
            self._free_block(self.pending.popleft()[1])

    def _free_block(self, block: _Block) -> None:
        block.allocated = False
        pool = self.pools[block.small]
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated and \
                    neighbour.mapped == block.mapped and neighbour.mapped:
                pool.remove(neighbour)
                self._merge(block, neighbour)
        if block.prev is None and not block.expandable:
            self._segments[block.addr] = block  # it may have taken its segment's first place
        pool.add(block)

    def empty_cache(self) -> None:
        """`release_cached_blocks`: every free unsplit segment back to CUDA; every whole free
        page of an expandable segment unmapped."""
        while self.pending:  # synchronize_and_free_events
            self._free_block(self.pending.popleft()[1])
        for pool in self.pools.values():
            for block in [pool.blocks[key] for key in pool.keys]:
                if block.expandable:
                    self._unmap(block, pool)
                elif block.prev is None and block.next is None:
                    pool.remove(block)
                    del self._segments[block.addr]
                    self.reserved_bytes -= block.size

    def reset_peaks(self) -> None:
        """torch.cuda.reset_peak_memory_stats: the peaks start again from now."""
        self.peak_reserved_bytes, self.peak_allocated_bytes, self.peak_requested_bytes = (
            self.reserved_bytes, self.allocated_bytes, self.requested_bytes)

    # -- segments ---------------------------------------------------------------------------

    def _fits(self, more_bytes: int) -> bool:
        return self.cap_bytes is None or self.reserved_bytes + more_bytes <= self.cap_bytes

    def _grow(self, num_bytes: int) -> None:
        self.reserved_bytes += num_bytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)

    def _new_block(self, size: int, stream: int, small: bool) -> _Block | None:
        if self.expandable_segments:
            return self._expand(size, stream, small)
        alloc = segment_size(size)
        if not self._fits(alloc):
            return None
        block = _Block(self._next_addr, alloc, stream, small)
        self._next_addr += alloc + (1 << 30)
        self._segments[block.addr] = block
        self._grow(alloc)
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        rest = block.size - size
        if block.small or self.expandable_segments:
            return rest >= MIN_BLOCK_BYTES
        return rest > SMALL_REQUEST_BYTES

    @staticmethod
    def _merge(block: _Block, neighbour: _Block) -> None:
        """`try_merge_blocks`: `neighbour` (free, adjacent) folded into `block`."""
        if neighbour is block.prev:
            block.addr = neighbour.addr
            block.prev = neighbour.prev
            if block.prev is not None:
                block.prev.next = block
        else:
            block.next = neighbour.next
            if block.next is not None:
                block.next.prev = block
        block.size += neighbour.size

    # -- expandable segments ----------------------------------------------------------------

    def _expand(self, size: int, stream: int, small: bool) -> _Block | None:
        """`try_allocate_expandable_block`: the lowest unmapped range of the stream's segment
        that, with the free blocks around it, has room for `size` bytes
        (`find_expandable_block`), mapped page by page (`map_block`) only where it is not
        mapped already, and merged into one block."""
        candidate = self._expandable_candidate(size, stream, small)
        page = SMALL_SEGMENT_BYTES if small else LARGE_SEGMENT_BYTES
        need = 0  # bytes to map: what the free blocks on the way lack, in whole pages
        block: _Block | None = candidate
        have = 0
        while have < size and block is not None:
            if not block.mapped:
                need += min(block.size, -(-(size - have) // page) * page)
            have += block.size
            block = block.next
        if not self._fits(need):
            return None
        pool = self.pools[small]
        if candidate.mapped:
            pool.remove(candidate)
        else:
            candidate = self._map(candidate, min(candidate.size, size), page)
        while candidate.size < size:
            following = candidate.next
            assert following is not None
            if following.mapped:  # a free block between unmapped ranges
                pool.remove(following)
            else:
                following = self._map(following, min(following.size, size - candidate.size),
                                      page)
            self._merge(candidate, following)
        return candidate

    def _expandable_candidate(self, size: int, stream: int, small: bool) -> _Block:
        """`find_expandable_block`: from the lowest-address unmapped block of the stream's
        segment (or the free block just before it), the first with room for `size`; a new
        segment (all address space, nothing mapped) when the stream has none."""
        for hole in self._unmapped.setdefault((stream, small), []):
            start = hole.prev if hole.prev is not None and not hole.prev.allocated and \
                hole.prev.mapped else hole
            room = 0
            walk: _Block | None = start
            while room < size and walk is not None and not walk.allocated:
                room += walk.size
                walk = walk.next
            if room >= size:
                return start
        base = -(-self._next_addr // LARGE_SEGMENT_BYTES) * LARGE_SEGMENT_BYTES  # page-aligned
        hole = _Block(base, 1 << 50, stream, small, expandable=True, mapped=False)
        self._next_addr = base + (1 << 50) + (1 << 30)
        self._add_unmapped(hole)
        return hole

    def _add_unmapped(self, hole: _Block) -> None:
        holes = self._unmapped.setdefault((hole.stream, hole.small), [])
        holes.insert(bisect.bisect_left([h.addr for h in holes], hole.addr), hole)

    def _map(self, hole: _Block, size: int, page: int) -> _Block:
        """`map_block`: the first whole pages of an unmapped block covering `size` bytes
        become a mapped (not yet pooled) block; the rest stays unmapped."""
        mapped_bytes = min(hole.size, -(-size // page) * page)
        self._unmapped[(hole.stream, hole.small)].remove(hole)
        if mapped_bytes < hole.size:
            self._add_unmapped(_split(hole, mapped_bytes, mapped=False))
        hole.mapped = True
        self._grow(mapped_bytes)
        return hole

    def _unmap(self, block: _Block, pool: _Pool) -> None:
        """`unmap_block`: the whole pages inside a free expandable block go back; the
        partial pages at its ends stay mapped as free blocks; the unmapped range joins
        unmapped neighbours."""
        page = SMALL_SEGMENT_BYTES if block.small else LARGE_SEGMENT_BYTES
        start = -(-block.addr // page) * page
        end = (block.addr + block.size) // page * page
        if end <= start:
            return
        pool.remove(block)
        pieces: list[_Block] = []
        if start > block.addr:
            pieces.append(_Block(block.addr, start - block.addr, block.stream, block.small,
                                 True))
        hole = _Block(start, end - start, block.stream, block.small, True, mapped=False)
        pieces.append(hole)
        if block.addr + block.size > end:
            pieces.append(_Block(end, block.addr + block.size - end, block.stream,
                                 block.small, True))
        prev = block.prev
        for piece in pieces:
            piece.prev = prev
            if prev is not None:
                prev.next = piece
            prev = piece
        last = pieces[-1]
        last.next = block.next
        if block.next is not None:
            block.next.prev = last
        self.reserved_bytes -= end - start
        for piece in pieces:
            if piece.mapped:
                pool.add(piece)
        holes = self._unmapped.setdefault((block.stream, block.small), [])
        for neighbour in (hole.prev, hole.next):
            if neighbour is not None and not neighbour.mapped:
                holes.remove(neighbour)
                self._merge(hole, neighbour)
        self._add_unmapped(hole)


def iter_blocks(allocator: CachingAllocator) -> Iterator[tuple[int, int, bool]]:
    """(address, bytes, allocated) of every mapped block of plain segments, in address
    order: the segment map a snapshot draws (tests compare it with the rules)."""
    for addr in sorted(allocator._segments):
        block: _Block | None = allocator._segments[addr]
        while block is not None:
            yield block.addr, block.size, block.allocated
            block = block.next
