"""A compiled CPU run's peak, counted where memory is taken: the CPU allocator.

Inductor's kernels make their buffers without passing through the dispatcher, so no
dispatch mode (the tracker) sees them, nor the tensors a compiled region saves for backward.
torch.profiler's memory events come from the allocator itself, every allocation and free made
while it runs, whatever made them: the peak of their running sum, above the bytes alive when
the step began, is the step's peak. It shares nothing with the tracker or with the estimate's
simulation, which is what makes it a check on them. A block alive before the profiler started
is not known to it when freed (its free is not reported): the step frees none (gradients are
released at its end, `training.make_train_step`), so the figure is not raised by it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["AllocatorPeak", "allocator_peak", "live_bytes"]


@dataclass
class AllocatorPeak:
    bytes_above_start: int = 0


@contextlib.contextmanager
def allocator_peak() -> Iterator[AllocatorPeak]:
    """The highest the CPU allocator's running total rose inside, above where it began."""
    found = AllocatorPeak()
    quiet = logging.getLogger("torch.profiler")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            yield found
    finally:
        quiet.setLevel(level)
    events = [e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
    running = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        running += event.nbytes()
        found.bytes_above_start = max(found.bytes_above_start, running)


def live_bytes(tensors: Iterable[object]) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors by their local shards)."""
    seen: dict[int, int] = {}
    pending = [t for t in tree_leaves(list(tensors)) if isinstance(t, torch.Tensor)]
    while pending:
        tensor = pending.pop()
        if isinstance(tensor, DTensor):
            pending.append(tensor.to_local())
        elif is_traceable_wrapper_subclass(tensor):  # float8 weights: their inner tensors
            pending += [getattr(tensor, name) for name in tensor.__tensor_flatten__()[0]]
        elif tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
