"""A model of PyTorch's CUDA caching allocator: what `torch.cuda.max_memory_reserved` will say
for a sequence of allocations and frees, without a GPU.

The rules, from `c10/cuda/CUDACachingAllocator.cpp` (torch 2.9-2.13; constants in
`c10/core/AllocatorConfig.h` since 2.9) and `docs/source/notes/cuda.rst`:

- Requests are rounded up to a multiple of 512 bytes (`round_size`, `kMinBlockSize`).
- Rounded requests up to 1 MiB (`kSmallSize`) go to the small pool, larger ones to the large
  pool (`get_pool`).
- A request no free block can serve makes a new segment (`get_allocation_size`): 2 MiB for the
  small pool (`kSmallBuffer`), 20 MiB for large requests under 10 MiB (`kLargeBuffer`,
  `kMinLargeAlloc`), else the request rounded up to 2 MiB (`kRoundLarge`).
- A request takes the smallest free block of its pool on its own stream that is large enough
  (`get_free_block`; ties to the lowest address): blocks freed on one stream are never reused
  on another, which is why FSDP2's all-gather and reduce-scatter buffers, allocated on their
  own streams, keep segments of their own.
- A block larger than the request is split when the remainder is at least 512 bytes (small
  pool) or more than 1 MiB (large pool); otherwise the whole block is handed out and counts as
  allocated (`should_split`).
- A freed block merges with free neighbours of its segment; segments are returned to the
  driver only by `empty_cache` or when cudaMalloc fails, after which the allocation is retried
  once (`release_cached_blocks`, counted in `num_alloc_retries`).
- With `expandable_segments:True` each (stream, pool) has one segment that maps pages as it
  grows: 2 MiB pages for the small pool, 20 MiB for the large one; it grows by the pages the
  request needs beyond a free block at its end, both pools split at 512 bytes, and reserved
  memory is the mapped pages (`Note [Expandable Segments]`).

Not modelled: `max_split_size_mb`, `roundup_power2_divisions` and `garbage_collection_threshold`
(all off by default), CUDA graphs and private pools, `record_stream` (FSDP2 and
ProcessGroupNCCL avoid it since torch 2.8, pytorch/pytorch#150398).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field

MIN_BLOCK_BYTES = 512
SMALL_REQUEST_BYTES = 1 << 20
SMALL_SEGMENT_BYTES = 2 << 20
MIN_LARGE_ALLOC_BYTES = 10 << 20
LARGE_ROUND_BYTES = 2 << 20
LARGE_SEGMENT_BYTES = 20 << 20


def round_size(num_bytes: int) -> int:
    """The request as the allocator books it: a multiple of 512 bytes, at least 512."""
    return max(MIN_BLOCK_BYTES, -(-num_bytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def segment_size(rounded_bytes: int) -> int:
    """The cudaMalloc a request no cached block can serve makes."""
    if rounded_bytes <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if rounded_bytes < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-rounded_bytes // LARGE_ROUND_BYTES) * LARGE_ROUND_BYTES


class OutOfMemory(Exception):
    """The request would take reserved memory past the capacity even with the cache freed."""


@dataclass(eq=False)
class _Block:
    segment: _Segment
    offset: int
    size: int
    free: bool = True


@dataclass(eq=False)
class _Segment:
    stream: object
    small: bool
    order: int
    """Creation order: the model's stand-in for addresses (lowest first on ties)."""
    size: int = 0
    blocks: list[_Block] = field(default_factory=list)


@dataclass
class AllocatorStats:
    """Peaks in bytes, as torch.cuda.memory_stats names them."""

    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    num_segments: int = 0
    num_alloc_retries: int = 0


class CachingAllocator:
    """Allocations and frees in, allocated and reserved bytes out (one device).

    `capacity_bytes`: the memory the allocator may reserve (the card's, less what lives
    outside it); a segment that would pass it first makes the allocator free every cached
    segment that is wholly free and retry, then raises `OutOfMemory`. None: unbounded."""

    def __init__(self, *, expandable: bool = False, capacity_bytes: int | None = None) -> None:
        self.expandable = expandable
        self.capacity_bytes = capacity_bytes
        self.stats = AllocatorStats()
        self._segments: list[_Segment] = []
        self._free: dict[tuple[object, bool], list[tuple[int, int, int, _Block]]] = {}
        """Each (stream, pool)'s free blocks, sorted as best fit picks them: by size, then
        segment and offset (the lowest address)."""
        self._live: dict[object, _Block] = {}
        self._order = 0

    def malloc(self, key: object, num_bytes: int, stream: object = "default") -> None:
        """Allocate `num_bytes` on `stream`; `key` names the allocation for its `free`."""
        if key in self._live:
            raise ValueError(f"allocation {key!r} is live already")
        size = round_size(num_bytes)
        small = size <= SMALL_REQUEST_BYTES
        block = self._best_fit(stream, small, size)
        if block is not None:
            self._unlist(block)
        else:
            block = self._grow(stream, small, size)
        self._take(block, size)
        self._live[key] = block
        self.stats.allocated_bytes += block.size
        self.stats.peak_allocated_bytes = max(
            self.stats.peak_allocated_bytes, self.stats.allocated_bytes
        )

    def free(self, key: object) -> None:
        block = self._live.pop(key)
        self.stats.allocated_bytes -= block.size
        block.free = True
        blocks = block.segment.blocks
        index = blocks.index(block)
        for neighbour in (index + 1, index - 1):  # the next first: `index` stays valid
            if 0 <= neighbour < len(blocks) and blocks[neighbour].free:
                other = blocks[neighbour]
                self._unlist(other)
                first, second = (block, other) if neighbour > index else (other, block)
                first.size += second.size
                blocks.remove(second)
                block = first
        self._list(block)

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache`: segments that are wholly free go back to the driver (an
        expandable segment unmaps its free tail)."""
        for segment in list(self._segments):
            tail = segment.blocks[-1] if segment.blocks else None
            if len(segment.blocks) == 1 and segment.blocks[0].free:
                self._release(segment)
            elif self.expandable and tail is not None and tail.free:
                page = SMALL_SEGMENT_BYTES if segment.small else LARGE_SEGMENT_BYTES
                unmapped = tail.size // page * page
                if unmapped and unmapped == tail.size:
                    self._unlist(tail)
                    segment.blocks.remove(tail)
                elif unmapped:
                    self._unlist(tail)
                    tail.size -= unmapped
                    self._list(tail)
                segment.size -= unmapped
                self.stats.reserved_bytes -= unmapped

    def _best_fit(self, stream: object, small: bool, size: int) -> _Block | None:
        pool = self._free.get((stream, small), [])
        index = bisect_left(pool, (size,))
        return pool[index][3] if index < len(pool) else None

    def _grow(self, stream: object, small: bool, size: int) -> _Block:
        """A new segment (or, expandable, more pages of the stream's one), retried once with
        the cache freed when it would pass the capacity."""
        for retry in (False, True):
            if retry:
                self.empty_cache()
                self.stats.num_alloc_retries += 1
            needed = self._growth_bytes(stream, small, size)
            capacity = self.capacity_bytes
            if capacity is None or self.stats.reserved_bytes + needed <= capacity:
                return self._map(stream, small, needed)
        raise OutOfMemory(
            f"{size} bytes on top of {self.stats.reserved_bytes} reserved pass the capacity "
            f"of {self.capacity_bytes} bytes"
        )

    def _stream_segment(self, stream: object, small: bool) -> _Segment | None:
        return next((s for s in self._segments if (s.stream, s.small) == (stream, small)), None)

    def _growth_bytes(self, stream: object, small: bool, size: int) -> int:
        if not self.expandable:
            return segment_size(size)
        page = SMALL_SEGMENT_BYTES if small else LARGE_SEGMENT_BYTES
        segment = self._stream_segment(stream, small)
        tail = segment.blocks[-1] if segment and segment.blocks else None
        free_tail = tail.size if tail is not None and tail.free else 0
        return -(-(size - free_tail) // page) * page

    def _map(self, stream: object, small: bool, num_bytes: int) -> _Block:
        self.stats.reserved_bytes += num_bytes
        self.stats.peak_reserved_bytes = max(
            self.stats.peak_reserved_bytes, self.stats.reserved_bytes
        )
        segment = self._stream_segment(stream, small) if self.expandable else None
        if segment is None:
            self._order += 1
            segment = _Segment(stream, small, self._order)
            self._segments.append(segment)
            self.stats.num_segments += 1
        tail = segment.blocks[-1] if segment.blocks else None
        if tail is not None and tail.free:
            self._unlist(tail)
            tail.size += num_bytes
            block = tail
        else:
            block = _Block(segment, segment.size, num_bytes)
            segment.blocks.append(block)
        segment.size += num_bytes
        return block

    def _take(self, block: _Block, size: int) -> None:
        """Hand `block` (free, not listed) out for `size` bytes, split when the allocator would
        split it."""
        remaining = block.size - size
        splits = remaining >= MIN_BLOCK_BYTES
        if not (block.segment.small or self.expandable):
            splits = remaining > SMALL_REQUEST_BYTES
        if splits:
            rest = _Block(block.segment, block.offset + size, remaining)
            block.size = size
            blocks = block.segment.blocks
            blocks.insert(blocks.index(block) + 1, rest)
            self._list(rest)
        block.free = False

    def _release(self, segment: _Segment) -> None:
        for block in segment.blocks:
            self._unlist(block)
        self._segments.remove(segment)
        self.stats.reserved_bytes -= segment.size

    def _list(self, block: _Block) -> None:
        pool = self._free.setdefault((block.segment.stream, block.segment.small), [])
        insort(pool, (block.size, block.segment.order, block.offset, block))

    def _unlist(self, block: _Block) -> None:
        """Take a listed free block off its list (before its size changes)."""
        pool = self._free[(block.segment.stream, block.segment.small)]
        index = bisect_left(pool, (block.size, block.segment.order, block.offset))
        if pool[index][3] is not block:
            raise AssertionError("allocator model: a free block is not listed")
        del pool[index]
