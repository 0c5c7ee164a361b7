"""The caching allocator model (`memory.allocator`) on sequences whose reserved memory follows
from the documented rules (c10/cuda/CUDACachingAllocator.cpp): rounding, the two pools and
their segment sizes, splitting, per-stream caching, coalescing, expandable segments and the
free-and-retry at the capacity; then against recorded allocator histories (a hand-built one
until a GPU-recorded one is committed), and the simulated trace's streams and workspaces."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.run import DataConfig, RunConfig
from fsdp_bench.memory.alloc_trace import DEFAULT_STREAM
from fsdp_bench.memory.allocator import CachingAllocator, OutOfMemory, round_size
from fsdp_bench.memory.fake_step import record_step
from fsdp_bench.memory.snapshot import reserved_peak_bytes, slim, trace_of

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


SNAPSHOTS = sorted((Path(__file__).parent / "data" / "snapshots").glob("*.json"))


def _fragmenting_history() -> dict[str, Any]:
    """A history in the format of `torch.cuda.memory._snapshot()`, written by hand from the
    documented rules (the 38 MiB case above): 12 MiB twice, the first freed, then 14 MiB,
    which its block cannot hold. No history recorded on a GPU is committed yet
    (tests/data/snapshots/ is empty until benchmarks/gpu_check.py runs on one): until then
    this checks the reading of the format, not the model against the real allocator."""
    entries = [
        ("segment_alloc", 1, 12 * MIB), ("alloc", 1, 12 * MIB),
        ("segment_alloc", 2, 12 * MIB), ("alloc", 2, 12 * MIB),
        ("free_requested", 1, 12 * MIB), ("free_completed", 1, 12 * MIB),
        ("segment_alloc", 3, 14 * MIB), ("alloc", 3, 14 * MIB),
        ("free_requested", 2, 12 * MIB), ("free_completed", 2, 12 * MIB),
        ("alloc", 2, 12 * MIB),  # the freed block again: a new allocation at the same address
    ]  # fmt: skip
    return {"device_traces": [[{"action": a, "addr": addr << 30, "size": size, "stream": 0}
                               for a, addr, size in entries]]}  # fmt: skip


@pytest.mark.parametrize(
    "history",
    [_fragmenting_history, *SNAPSHOTS],
    ids=lambda h: h.name if isinstance(h, Path) else "hand-built",
)
def test_a_recorded_history_replays_to_the_reserved_memory_it_recorded(history: Any) -> None:
    snapshot = json.loads(history.read_text()) if isinstance(history, Path) else history()
    measured = reserved_peak_bytes(snapshot)
    replayed = trace_of(snapshot).replay(cublas=False).stats
    assert replayed.peak_reserved_bytes == measured
    assert slim(snapshot) == slim(slim(snapshot))  # what a committed one keeps


def test_streams_and_cublas_workspaces_reach_the_replay() -> None:
    """A CUDA run's simulated trace: FSDP2's all-gather outputs on its copy-in stream, the
    reduce-scatter outputs (gradient shards) on another, and the replay books cuBLAS's two
    workspaces. Recording every allocation on the default stream, or dropping the
    workspaces, would change the figures this checks."""
    run = RunConfig(world_size=4, model=ModelConfig(name="tiny"), data=DataConfig(seq_len=64),
                    fsdp=FsdpConfig(mixed_precision="bf16"))  # fmt: skip
    trace = record_step(run, "cuda").trace
    streams: dict[str, set[str]] = {}
    for event in trace.events:
        if event[0] == "alloc":
            streams.setdefault(trace.categories.get(event[1], "other"), set()).add(event[3])
    assert streams["gradient"] and DEFAULT_STREAM not in streams["gradient"]
    assert streams["activation"] - {DEFAULT_STREAM} - streams["gradient"]  # the all-gathers
    allocated, reserved = trace.allocator_peaks()
    tensors, _ = trace.live_peak()
    assert allocated - tensors >= 2 * 32 * MIB
    one_stream = dataclasses.replace(trace, events=[
        (*e[:3], DEFAULT_STREAM) if e[0] == "alloc" else e for e in trace.events
    ])  # fmt: skip
    assert one_stream.allocator_peaks()[1] < reserved  # each stream caches its own blocks
