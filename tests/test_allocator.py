"""The caching allocator model (`memory.allocator`) on sequences whose reserved memory follows
from the documented rules (c10/cuda/CUDACachingAllocator.cpp): rounding, the two pools and
their segment sizes, splitting, per-stream caching, coalescing, expandable segments and the
free-and-retry at the capacity."""

from __future__ import annotations

import pytest

from fsdp_bench.memory.allocator import CachingAllocator, OutOfMemory, round_size

KIB, MIB = 1 << 10, 1 << 20


def test_requests_round_to_512_bytes_and_small_ones_share_2_mib_segments() -> None:
    model = CachingAllocator()
    model.malloc("one byte", 1)
    assert (model.stats.allocated_bytes, model.stats.reserved_bytes) == (512, 2 * MIB)
    assert round_size(513) == 1024 and round_size(1024) == 1024
    model.free("one byte")
    for index in range(4):  # 4 x 512 KiB fill one small segment (split at >= 512 bytes)
        model.malloc(index, 512 * KIB)
    assert model.stats.reserved_bytes == 2 * MIB and model.stats.num_segments == 1
    model.malloc(4, 512 * KIB)
    assert model.stats.reserved_bytes == 4 * MIB


def test_large_requests_under_10_mib_share_20_mib_segments_larger_ones_round_to_2_mib() -> None:
    model = CachingAllocator()
    model.malloc("a", 3 * MIB)
    model.malloc("b", 3 * MIB)  # the first segment's 17 MiB rest was split off and serves it
    assert model.stats.reserved_bytes == 20 * MIB
    model.malloc("c", 15 * MIB)  # over the 14 MiB left: a segment of its own, 2 MiB-rounded
    assert model.stats.reserved_bytes == 36 * MIB  # 16 MiB; the 1 MiB rest is not split off
    assert model.stats.allocated_bytes == (3 + 3 + 16) * MIB


def test_a_block_freed_on_one_stream_is_not_reused_on_another() -> None:
    """FSDP2's all-gather output on its copy-in stream, the next request on the default one."""
    model = CachingAllocator()
    model.malloc("gathered", 12 * MIB, stream="all_gather")
    model.free("gathered")
    model.malloc("activation", 12 * MIB, stream="default")
    assert model.stats.reserved_bytes == 24 * MIB
    model.malloc("next gathered", 12 * MIB, stream="all_gather")
    assert model.stats.reserved_bytes == 24 * MIB  # its own stream's cached block


def test_fragmentation_and_coalescing() -> None:
    model = CachingAllocator()
    model.malloc("a", 12 * MIB)
    model.malloc("b", 12 * MIB)
    model.free("a")
    model.malloc("c", 14 * MIB)  # a's 12 MiB block is too small: 38 reserved for 26 live
    assert (model.stats.allocated_bytes, model.stats.reserved_bytes) == (26 * MIB, 38 * MIB)
    other = CachingAllocator()
    other.malloc("x", 4 * MIB)
    other.malloc("y", 4 * MIB)  # both in one 20 MiB segment, a 12 MiB rest
    other.free("x")
    other.free("y")  # merges with x and with the rest: one free 20 MiB block again
    other.malloc("z", 18 * MIB)
    assert other.stats.reserved_bytes == 20 * MIB and other.stats.num_segments == 1


def test_expandable_segments_grow_by_pages_beyond_their_free_tail() -> None:
    model = CachingAllocator(expandable=True)
    model.malloc("a", 30 * MIB)  # two 20 MiB pages of the large pool's one segment
    assert model.stats.reserved_bytes == 40 * MIB
    model.malloc("b", 5 * MIB)  # the 10 MiB free tail serves it
    assert model.stats.reserved_bytes == 40 * MIB
    model.malloc("c", 12 * MIB)  # 5 MiB free at the end, 7 more: one page
    assert model.stats.reserved_bytes == 60 * MIB and model.stats.num_segments == 1
    model.malloc("s", 100)  # the small pool's own segment, 2 MiB pages
    assert model.stats.reserved_bytes == 62 * MIB
    fragmented = CachingAllocator(expandable=True)  # the native allocator's 38 MiB case
    fragmented.malloc("a", 12 * MIB)
    fragmented.malloc("b", 12 * MIB)
    fragmented.free("a")
    fragmented.malloc("c", 14 * MIB)
    assert fragmented.stats.reserved_bytes == 40 * MIB  # pages of 20 MiB: no new segment
    for key in ("a", "b", "c", "s"):
        model.free(key)
    model.empty_cache()  # whole free pages go back
    assert model.stats.reserved_bytes == 0


def test_at_the_capacity_the_cache_is_freed_and_the_request_retried_once() -> None:
    model = CachingAllocator(capacity_bytes=30 * MIB)
    model.malloc("a", 12 * MIB)
    model.free("a")
    model.malloc("b", 20 * MIB)  # 12 cached + 20 > 30: a's segment released, then it fits
    assert model.stats.num_alloc_retries == 1 and model.stats.reserved_bytes == 20 * MIB
    with pytest.raises(OutOfMemory):
        model.malloc("c", 12 * MIB)
    assert model.stats.peak_reserved_bytes == 20 * MIB
