"""Every allocation and free a simulated run makes, in order, with the stream it is made on:
what the caching allocator of a real CUDA run would be asked for (`allocator.py` replays it).

Storages are seen as operators make them (a `TorchDispatchMode`), freed when they die (a
weakref finalizer), and resized where FSDP2 resizes them (its unsharded parameters are storages
it grows before compute and shrinks to nothing after: `UntypedStorage.resize_`, watched while
recording). The stream is the one current at the allocation: FSDP2 on a CPU mesh uses
`torch.cpu`'s streams, stand-ins that are still switched as on CUDA, so its all-gather outputs
show on its copy-in stream and its reduce-scatter outputs on its reduce-scatter stream.

DTensor's operators are seen as the operators on local shards they run: a dispatch mode comes
before a tensor subclass, and one that calls a DTensor operator itself sees its output but
none of the temporaries DTensor makes inside (the recorder did, and missed `loss_parallel`'s
shifted logits, their exponentials and the gradient's: two to three logits-sized tensors, 25%
of torchtitan's 70B 2-D run). So the recorder lets DTensor go first, as torch's MemTracker
does. DTensor's shape propagation (fake tensors of the global shape) is not memory and is left
out, as the tracker leaves it out. A functional collective's wait returns its input, as in
eager (a fake tensor's wait makes a copy, which no device holds).

Each event also carries a block tag, what `deepen` needs to make a deep model's trace from a
shallow one's: inside forward and backward, the transformer block running (a block's forward
pre-hook, and a hook on the gradient of its output, which fires as its backward begins);
elsewhere (materialising, the optimizer, clipping) the block of the tensors the operator reads:
a foreach operator's i-th output the block of its inputs' i-th element, any other output the
one block all its tagged inputs share. Parameters are tagged by the block that owns them once
materialised. Each allocation also gets a category at the moment it is known (parameter,
gradient, optimizer_state; else activation in forward, temp in backward and the optimizer,
inputs, other; FSDP2's unsharded parameters, the storages it resizes, are parameters as the
tracker counts them): the breakdown of a peak.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from fsdp_bench.config.gpus import CUBLAS_HANDLES, CUBLAS_WORKSPACE_SM90_BYTES
from fsdp_bench.job.measure.tracker import (
    SeesCompiledRegions,
    marked_propagation,
    propagating,
)
from fsdp_bench.memory.allocator import CachingAllocator, OutOfMemory

DEFAULT_STREAM = "default"


@dataclass
class AllocationTrace:
    """("alloc", key, bytes, stream) and ("free", key) events, in order, with their block tags
    (None: no block), the categories of the allocations and named marks (event positions)."""

    events: list[tuple[Any, ...]] = field(default_factory=list)
    tags: list[int | None] = field(default_factory=list)
    categories: dict[Any, str] = field(default_factory=dict)
    marks: dict[str, int] = field(default_factory=dict)
    sources: list[int] = field(default_factory=list)
    """For a trace `deepen` made: the shallow trace's event each event is a copy of."""

    def replay(
        self, *, expandable: bool = False, capacity_bytes: int | None = None, cublas: bool = True
    ) -> CachingAllocator:
        """The allocator after the whole trace, cuBLAS's workspaces allocated first (the first
        matmul asks for them, before the step's first activation) unless the trace has them
        (`cublas` false: a recorded history, `snapshot`). With a capacity, an allocation that
        cannot fit ends the replay (`OutOfMemory` is raised)."""
        model = CachingAllocator(expandable=expandable, capacity_bytes=capacity_bytes)
        for handle in range(CUBLAS_HANDLES if cublas else 0):
            model.malloc(("cublas workspace", handle), CUBLAS_WORKSPACE_SM90_BYTES, DEFAULT_STREAM)
        for event in self.events:
            if event[0] == "alloc":
                model.malloc(event[1], event[2], event[3])
            else:
                model.free(event[1])
        return model

    def without_host_state(self) -> AllocationTrace:
        """The trace of the accelerator's allocations under CPU offload: FSDP2 keeps the
        parameter shards, their gradients and the optimizer state in host memory, so
        neither they nor their frees reach the caching allocator. Shards are the parameters
        still alive when the trace ends (an unsharded parameter is freed once backward has
        used it)."""
        alive = {e[1] for e in self.events if e[0] == "alloc"} - {
            e[1] for e in self.events if e[0] == "free"
        }
        host = {
            key for key, category in self.categories.items()
            if category in ("gradient", "optimizer_state")
            or (category == "parameter" and key in alive)
        }  # fmt: skip
        kept = [i for i, e in enumerate(self.events) if e[1] not in host]
        return AllocationTrace(
            events=[self.events[i] for i in kept],
            tags=[self.tags[i] for i in kept] if self.tags else [],
            categories={k: v for k, v in self.categories.items() if k not in host},
        )

    def allocator_peaks(self, *, expandable: bool = False) -> tuple[int, int]:
        """(peak allocated, peak reserved) bytes of the replay: what max_memory_allocated
        (blocks as booked, cuBLAS's workspaces) and max_memory_reserved (segments) will say."""
        stats = self.replay(expandable=expandable).stats
        return stats.peak_allocated_bytes, stats.peak_reserved_bytes

    def live_peak(
        self, since: str | None = None, *, with_inputs: bool = False
    ) -> tuple[int, dict[str, int]]:
        """The most bytes alive at once from the mark `since` on (None: the whole trace), as
        requested, and what was alive then by category. Inputs are left out unless
        `with_inputs`: the tracker meets the batch only as an operand and counts it only for
        DDP (see `tracker`), and this is its figure."""
        skipped = set() if with_inputs else {"inputs"}
        start = self.marks[since] if since is not None else 0
        sizes: dict[Any, int] = {}
        live = peak = peak_at = 0
        for index, event in enumerate(self.events):
            if event[0] == "alloc":
                if self.categories.get(event[1]) in skipped:
                    continue
                sizes[event[1]] = event[2]
                live += event[2]
                if index >= start and live > peak:
                    peak, peak_at = live, index
            elif event[1] in sizes:
                live -= sizes.pop(event[1])
        return peak, self._live_by_category(peak_at, peak > 0, skipped)

    def _live_by_category(self, at: int, any_live: bool, skipped: set[str]) -> dict[str, int]:
        sizes: dict[Any, int] = {}
        for event in self.events[: at + 1] if any_live else ():
            if event[0] == "alloc":
                sizes[event[1]] = event[2]
            else:
                sizes.pop(event[1], None)
        parts: dict[str, int] = {}
        for key, num_bytes in sizes.items():
            category = self.categories.get(key, "other")
            if category not in skipped:
                parts[category] = parts.get(category, 0) + num_bytes
        return parts


class BlockContext:
    """Which block is running, from hooks on the model's blocks, while a phase mark says
    forward or backward (`phase`): what `_Recorder` tags events made there with. Forward moves
    on to the next block as a block returns, so what comes before the first block (the
    embedding, block 0's all-gather) is block 0's, and what comes after the last (the head, the
    loss, and their backward, which begins backward) is tagged as one block further."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.phase: str | None = None
        self.block: int | None = None
        self._head = len(blocks) if blocks else None
        self._handles = []
        # Outside dynamo: in a compiled block (`train.compile`) the hooks' side effects would
        # break the block's graph, and the block would run eagerly in the simulation alone.
        for index, block in enumerate(blocks):
            entering, on_output = self._entering(index), self._on_output(index)
            self._handles.append(block.register_forward_pre_hook(torch._dynamo.disable(entering)))
            self._handles.append(block.register_forward_hook(torch._dynamo.disable(on_output)))

    @property
    def current(self) -> int | None:
        return self.block if self.phase in ("forward", "backward") else None

    def _entering(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.block = index

        return hook

    def _on_output(self, index: int) -> Any:
        def backward_begins(grad: torch.Tensor) -> None:
            self.block = index

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.phase == "forward":  # not in backward's recomputation
                self.block = index + 1
            for tensor in tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(backward_begins)
                    return

        return hook

    @contextlib.contextmanager
    def mark(self, phase: str) -> Iterator[None]:
        """A `training.Mark`: the step's phases (forward, backward, optimizer)."""
        start = {"forward": 0 if self._head else None, "backward": self._head}
        self.phase, self.block = phase, start.get(phase)
        try:
            yield
        finally:
            self.phase, self.block = None, None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class _Recorder(SeesCompiledRegions, TorchDispatchMode):
    def __init__(self, trace: AllocationTrace, context: BlockContext | None) -> None:
        super().__init__()
        self.trace = trace
        self.context = context
        self._token: Any = WeakIdKeyDictionary()
        """Storage -> its token: one per storage for its life."""
        self._key: dict[int, int | None] = {}
        """Token -> the key of the storage's allocation now (None: resized to nothing)."""
        self._tag: dict[int, int | None] = {}
        """Token -> its block tag."""
        self._event: dict[int, int] = {}
        """Key -> the position of its allocation event."""
        self._streams: dict[int, str] = {id(torch.cpu.current_stream()): DEFAULT_STREAM}
        self._next = 0
        self.closed = False

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if DTensor in types:
            return NotImplemented
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return args[0]  # as in eager, not a fake copy
        out = func(*args, **(kwargs or {}))
        if propagating():
            return out
        block = self.context.current if self.context is not None else None
        if isinstance(out, (list, tuple)) and block is None:  # foreach: element by element
            lists = [a for a in args if isinstance(a, (list, tuple)) and len(a) == len(out)]
            for index, element in enumerate(out):
                inputs = lists[0][index] if lists else ()
                self._register_outputs(element, self._common_tag(inputs))
        else:
            self._register_outputs(out, block if block is not None else self._common_tag(args))
        return out

    def _register_outputs(self, out: Any, tag: int | None) -> None:
        for tensor in tree_leaves(out):
            for storage in self._storages(tensor):
                if storage not in self._token:
                    self._register(storage, tag)

    def _common_tag(self, inputs: Any) -> int | None:
        """The block of the tensors among `inputs`, if they are of one block."""
        found = set()
        for tensor in tree_leaves(inputs):
            for storage in self._storages(tensor):
                if storage in self._token:
                    tag = self._tag.get(self._token[storage])
                    if tag is not None:
                        found.add(tag)
        return found.pop() if len(found) == 1 else None

    @staticmethod
    def _storages(tensor: Any) -> list[Any]:
        """The storages that hold `tensor`'s memory: a wrapper subclass's are its inner
        tensors' (a DTensor's local shard; torchao's float8 weights and their float8 casts),
        the wrapper's own has no memory of its own: counted, it doubled every float8
        weight, its gradient and optimizer state."""
        if not isinstance(tensor, torch.Tensor):
            return []
        if is_traceable_wrapper_subclass(tensor):
            inner, _ = tensor.__tensor_flatten__()
            return [s for name in inner for s in _Recorder._storages(getattr(tensor, name))]
        return [tensor.untyped_storage()]

    def _stream(self) -> str:
        stream = torch.cpu.current_stream()
        return self._streams.setdefault(id(stream), f"stream {len(self._streams)}")

    def _register(self, storage: Any, tag: int | None) -> None:
        token = self._next
        self._next += 1
        self._token[storage] = token
        self._key[token] = None
        self._tag[token] = tag
        self._allocate(token, storage.nbytes())
        weakref.finalize(storage, self._free, token)

    def _allocate(self, token: int, num_bytes: int) -> None:
        if num_bytes > 0:
            key = self._next
            self._next += 1
            self._key[token] = key
            block = self.context.current if self.context is not None else None
            self._event[key] = len(self.trace.events)
            self.trace.events.append(("alloc", key, num_bytes, self._stream()))
            self.trace.tags.append(block if block is not None else self._tag[token])
            phase = self.context.phase if self.context is not None else None
            category = {"forward": "activation", "backward": "temp", "optimizer": "temp"}
            self.trace.categories[key] = category.get(phase or "", "other")

    def _free(self, token: int) -> None:
        if self.closed:  # after recording: the model torn down, not the step
            return
        key = self._key.pop(token, None)
        tag = self._tag.pop(token, None)
        if key is not None:
            block = self.context.current if self.context is not None else None
            self.trace.events.append(("free", key))
            self.trace.tags.append(block if block is not None else tag)

    def resized(self, storage: Any, num_bytes: int) -> None:
        """A storage resized (FSDP2's unsharded parameters): freed at its old size, allocated
        at its new one, a parameter."""
        if storage not in self._token:
            self._register(storage, None)
        else:
            token = self._token[storage]
            tag = self._tag[token]
            previous = self._key[token]  # made by an operator (the first unshard's empty)
            if previous is not None:
                self.trace.categories[previous] = "parameter"
            self._free(token)
            self._key[token] = None
            self._tag[token] = tag
            self._allocate(token, num_bytes)
        key = self._key[self._token[storage]]
        if key is not None:  # what the tracker counts them as
            self.trace.categories[key] = "parameter"

    def classify(self, tensors: Any, category: str, tag: int | None = None) -> None:
        """Name the allocations of `tensors`' storages (as alive now) `category`; with `tag`,
        also tag them with that block (parameters once materialised)."""
        for tensor in tree_leaves(tensors):
            for storage in self._storages(tensor):
                token = self._token.get(storage)
                key = None if token is None else self._key.get(token)
                if token is None or key is None:
                    continue
                self.trace.categories[key] = category
                if tag is not None:
                    self._tag[token] = tag
                    self.trace.tags[self._event[key]] = tag

    def mark(self, name: str) -> None:
        self.trace.marks[name] = len(self.trace.events)


@contextlib.contextmanager
def recording(context: BlockContext | None = None) -> Iterator[_Recorder]:
    """Record the allocations made inside (enter it inside the fake mode), tagged by the
    blocks `context` follows."""
    trace = AllocationTrace()
    recorder = _Recorder(trace, context)
    resize = torch.UntypedStorage.resize_

    def watched_resize(storage: Any, size: int) -> Any:
        result = resize(storage, size)
        recorder.resized(storage, storage.nbytes())
        return result

    torch.UntypedStorage.resize_ = watched_resize  # type: ignore[method-assign,assignment]
    try:
        with marked_propagation(), recorder:
            yield recorder
    finally:
        torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]
        recorder.closed = True


__all__ = ["AllocationTrace", "BlockContext", "OutOfMemory", "recording"]
