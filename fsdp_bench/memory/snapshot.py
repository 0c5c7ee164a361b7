"""A recorded CUDA allocator history as the allocator model's input: the test of the model
against the real allocator (`torch.cuda.memory._record_memory_history`, then `_snapshot()`).

The history lists every request the process made (`alloc`, `free_completed`, with its stream
and block size) and every segment the allocator mapped or returned (`segment_alloc`,
`segment_free`, `segment_map` and `segment_unmap` with expandable segments). The requests,
replayed through `allocator.CachingAllocator`, must reserve what the segment events say the
real one reserved; only what the model decides (segment sizes, splits, reuse per stream) can
make them differ. `benchmarks/gpu_check.py` records one on a GPU.
"""

from __future__ import annotations

from typing import Any

from fsdp_bench.memory.alloc_trace import AllocationTrace

_GROWS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def trace_of(snapshot: dict[str, Any], device: int = 0) -> AllocationTrace:
    """The requests of one device's history, in order, keyed by address (a block freed and
    allocated again at the same address is a new allocation)."""
    trace = AllocationTrace()
    live: dict[int, int] = {}
    for number, entry in enumerate(snapshot["device_traces"][device]):
        action, address = entry["action"], entry["addr"]
        if action == "alloc":
            live[address] = number
            trace.events.append(("alloc", number, entry["size"], entry["stream"]))
        elif action == "free_completed" and address in live:
            trace.events.append(("free", live.pop(address)))
    return trace


def reserved_peak_bytes(snapshot: dict[str, Any], device: int = 0) -> int:
    """The real allocator's peak reserved memory over the history, from its segment events."""
    reserved = peak = 0
    for entry in snapshot["device_traces"][device]:
        reserved += _GROWS.get(entry["action"], 0) * entry["size"]
        peak = max(peak, reserved)
    return peak


def slim(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The history without stack frames or segment states: what the test reads, small enough
    to commit."""
    keep = ("action", "addr", "size", "stream")
    return {
        "device_traces": [
            [{k: entry[k] for k in keep} for entry in device]
            for device in snapshot["device_traces"]
        ]
    }
