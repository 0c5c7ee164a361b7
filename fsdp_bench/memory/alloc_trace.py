"""Every allocation and free a simulated run makes, in order, with the stream it is made on:
what the caching allocator of a real CUDA run would be asked for (`allocator.py` replays it).

Storages are seen as operators make them (a `TorchDispatchMode`), freed when they die (a
weakref finalizer), and resized where FSDP2 resizes them (its unsharded parameters are storages
it grows before compute and shrinks to nothing after: `UntypedStorage.resize_`, watched while
recording). The stream is the one current at the allocation: FSDP2 on a CPU mesh uses
`torch.cpu`'s streams, stand-ins that are still switched as on CUDA, so its all-gather outputs
show on its copy-in stream and its reduce-scatter outputs on its reduce-scatter stream. DTensor's
shape propagation (fake tensors of the global shape) is not memory and is left out, as the
tracker leaves it out.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from fsdp_bench.job.tracker import marked_propagation, propagating
from fsdp_bench.memory.allocator import CachingAllocator, OutOfMemory

DEFAULT_STREAM = "default"

CUBLAS_WORKSPACE_BYTES = 32 << 20
"""cuBLAS's workspace on Hopper and later (sm90+: `:4096:8`, 32 MiB; 8 MiB + 128 KiB before),
allocated through the caching allocator once per (handle, stream) and kept
(aten/src/ATen/cuda/CublasHandlePool.cpp, docs/source/notes/cuda.rst)."""
CUBLAS_HANDLES = 2
"""Handles are per thread: the main thread's (forward, optimizer) and autograd's device
thread's (backward), both on the default stream."""


@dataclass
class AllocationTrace:
    """("alloc", key, bytes, stream) and ("free", key) events, in order."""

    events: list[tuple[Any, ...]] = field(default_factory=list)

    def replay(
        self, *, expandable: bool = False, capacity_bytes: int | None = None
    ) -> CachingAllocator:
        """The allocator after the whole trace, cuBLAS's workspaces allocated first (the first
        matmul asks for them, before the step's first activation). With a capacity, an
        allocation that cannot fit ends the replay (`OutOfMemory` is raised)."""
        model = CachingAllocator(expandable=expandable, capacity_bytes=capacity_bytes)
        for handle in range(CUBLAS_HANDLES):
            model.malloc(("cublas workspace", handle), CUBLAS_WORKSPACE_BYTES, DEFAULT_STREAM)
        for event in self.events:
            if event[0] == "alloc":
                model.malloc(event[1], event[2], event[3])
            else:
                model.free(event[1])
        return model

    @property
    def live_peak_bytes(self) -> int:
        """The most bytes alive at once, as requested (no rounding, no workspaces)."""
        live = peak = 0
        sizes: dict[Any, int] = {}
        for event in self.events:
            if event[0] == "alloc":
                sizes[event[1]] = event[2]
                live += event[2]
                peak = max(peak, live)
            else:
                live -= sizes.pop(event[1])
        return peak


class _Recorder(TorchDispatchMode):
    def __init__(self, trace: AllocationTrace) -> None:
        super().__init__()
        self.trace = trace
        self._token: Any = WeakIdKeyDictionary()
        """Storage -> its token: one per storage for its life."""
        self._key: dict[int, int | None] = {}
        """Token -> the key of the storage's allocation now (None: resized to nothing)."""
        self._streams: dict[int, str] = {id(torch.cpu.current_stream()): DEFAULT_STREAM}
        self._next = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if propagating() and DTensor not in types:
            return out
        for tensor in tree_leaves(out):
            if isinstance(tensor, DTensor):  # its local shard, made out of this mode's sight
                tensor = tensor._local_tensor
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage not in self._token:
                    self._register(storage)
        return out

    def _stream(self) -> str:
        stream = torch.cpu.current_stream()
        return self._streams.setdefault(id(stream), f"stream {len(self._streams)}")

    def _register(self, storage: Any) -> None:
        token = self._next
        self._next += 1
        self._token[storage] = token
        self._key[token] = None
        self._allocate(token, storage.nbytes())
        weakref.finalize(storage, self._free, token)

    def _allocate(self, token: int, num_bytes: int) -> None:
        if num_bytes > 0:
            key = self._next
            self._next += 1
            self._key[token] = key
            self.trace.events.append(("alloc", key, num_bytes, self._stream()))

    def _free(self, token: int) -> None:
        key = self._key.pop(token, None)
        if key is not None:
            self.trace.events.append(("free", key))

    def resized(self, storage: Any, num_bytes: int) -> None:
        """A storage resized (FSDP2's unsharded parameters): freed at its old size, allocated
        at its new one."""
        if storage not in self._token:
            self._register(storage)
            return
        token = self._token[storage]
        self._free(token)
        self._key[token] = None
        self._allocate(token, num_bytes)


@contextlib.contextmanager
def recording(enabled: bool = True) -> Iterator[AllocationTrace]:
    """Record the allocations made inside (enter it inside the fake mode); not `enabled`, an
    empty trace at no cost."""
    trace = AllocationTrace()
    if not enabled:
        yield trace
        return
    recorder = _Recorder(trace)
    resize = torch.UntypedStorage.resize_

    def watched_resize(storage: Any, size: int) -> Any:
        result = resize(storage, size)
        recorder.resized(storage, storage.nbytes())
        return result

    torch.UntypedStorage.resize_ = watched_resize  # type: ignore[method-assign,assignment]
    try:
        with marked_propagation(), recorder:
            yield trace
    finally:
        torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]


__all__ = ["AllocationTrace", "OutOfMemory", "recording"]
