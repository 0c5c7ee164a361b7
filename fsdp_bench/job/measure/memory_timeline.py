"""Memory over one step, with the collectives on it (seed 000, sections 07 and 13: a prefetch
spike is found by laying the memory curve against the all-gathers).

Sampled in the profiled step, under torch's MemTracker: after every operator the tracked
bytes on the run's device, the module running and its phase; every c10d collective marked
where it was issued. The x axis is the operator's index in the step (not time: the step is
untimed and the tracker slows it). Kept at most `MAX_POINTS` points, each the largest of its
stretch of operators, so the peak survives exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_bench.job.measure.tracker import SeesCompiledRegions, propagating

MAX_POINTS = 400
COLLECTIVE_KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
}
"""c10d dispatcher ops by what they do. FSDP2 issues `_allgather_base_` per group unshard and
`_reduce_scatter_base_` per group reduction; DDP's reducer issues `allreduce_` per bucket."""


@dataclass
class MemoryTimeline:
    """One rank's step: `points` [operator index, bytes, "module phase"], `collectives`
    [operator index, kind], and where the peak was."""

    num_ops: int = 0
    points: list[list[Any]] = field(default_factory=list)
    collectives: list[list[Any]] = field(default_factory=list)
    peak_bytes: int = 0
    peak_at: str = ""
    """The module and phase running at the peak ("layers.1 backward"; outside every
    module: "loss" after a forward, "optimizer" after a backward)."""


class TimelineSampler(SeesCompiledRegions, TorchDispatchMode):
    """Entered inside the MemTracker, so each sample follows the tracker's own update."""

    def __init__(self, tracker: Any, device_type: str) -> None:
        super().__init__()
        self._tracker = tracker
        self._device_type = device_type
        self._samples: list[tuple[int, str]] = []
        self._collectives: list[list[Any]] = []
        self._last_phase = ""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if DTensor in types:  # sampled at the operators on local shards it runs, as tracked
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if propagating():
            return out
        if func.namespace == "c10d" and getattr(func, "_opname", None) in COLLECTIVE_KINDS:
            self._collectives.append([len(self._samples), COLLECTIVE_KINDS[func._opname]])
        self._samples.append((self._current_bytes(), self._where()))
        return out

    def _current_bytes(self) -> int:
        snapshot = self._tracker._curr_mem_snap  # get_tracker_snapshot deep-copies it
        return sum(
            per.get("Total", 0) for dev, per in snapshot.items() if dev.type == self._device_type
        )

    def _where(self) -> str:
        modules = self._tracker._mod_tracker
        names = [n for n in modules.parents if n != "Global"]
        if not names:  # outside every module: the loss after a forward, else the optimizer
            return "loss" if self._last_phase == "forward" else "optimizer"
        self._last_phase = "backward" if modules.is_bw else "forward"
        innermost = max(names, key=lambda n: n.count("."))  # "<root class>.<fqn>"
        name = innermost.split(".", 1)[1] if "." in innermost else "root"
        return f"{name} {self._last_phase}"

    def timeline(self) -> MemoryTimeline:
        held = self._tracker.held_bytes(self._device_type)  # alive all step, seen only later
        samples = [(tracked + held, where) for tracked, where in self._samples]
        if not samples:
            return MemoryTimeline()
        width = max(1, -(-len(samples) // MAX_POINTS))
        points: list[list[Any]] = []
        for start in range(0, len(samples), width):
            stretch = samples[start : start + width]
            offset = max(range(len(stretch)), key=lambda i: stretch[i][0])
            points.append([start + offset, *stretch[offset]])
        peak_bytes, peak_at = max(samples, key=lambda s: s[0])
        return MemoryTimeline(len(samples), points, self._collectives, peak_bytes, peak_at)


@contextlib.contextmanager
def cuda_memory_history(path: Path | None, device: torch.device) -> Iterator[None]:
    """On CUDA with `measure.trace`: the caching allocator's own history of the step, every
    allocation with its stack, saved as a snapshot for PyTorch's memory viewer
    (pytorch.org/memory_viz) beside the profiler's trace."""
    if path is None or device.type != "cuda":
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        yield
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
