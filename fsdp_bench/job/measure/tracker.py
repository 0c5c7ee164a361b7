"""torch's MemTracker, made to count the same on every torch release we run on, and to count
memory held from before the step once.

DTensor finds each operator's output shape by running it on fake tensors of the global
(unsharded) shape (`ShardingPropagator._propagate_tensor_meta_non_cached`). On torch 2.11
MemTracker counted those tensors as allocations: an FSDP2 AdamW step showed the moments of
Llama-3-1B at their unsharded size, 15.9 GB at 8 ranks instead of 1.2, in the estimator (whose
fake mode the propagation reuses) and in real runs alike. torch 2.13 leaves them out
(pytorch/pytorch#183970 skips operators of a nested fake mode); here they are left out on every
release by marking the propagation itself. This and `post_forward_mesh` are the places that
reach into torch's private modules; a release that renames the method only loses the mark.

Memory allocated before the step and held through it, that no module or optimizer holds (DDP's
gradient buckets, the input batch), is first seen as an operand (the reducer writing a gradient
into its bucket with `mul.out`). MemTracker counts it then as if the operator had allocated it,
from that moment on: DDP's buckets as backward temporaries, so adding the buckets as well
counted them twice (the DDP baseline's tracked peak read 15% high on the small preset). For
DDP such storages are left out of the tracker's moments and reported apart, as `held_bytes`,
to be added to every moment.

ModTracker, inside MemTracker, hooks every module's inputs and outputs in autograd and drops
the handles. A hook's closure holds the autograd nodes it is registered on: a cycle through
C++ that Python's collector cannot see, which kept each run's whole graph alive and, through
its gradient accumulators, every parameter (on an H200 the second of two Llama-3-1B runs in
one job began with the first's 4.6 GiB of parameters still allocated). The tracker keeps the
handles and removes the hooks when it exits.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed._tools import mod_tracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

_PROPAGATE = "_propagate_tensor_meta_non_cached"
_inside = threading.local()


def propagating() -> bool:
    """Inside DTensor's shape propagation (`marked_propagation`) or `unseen`: tensors that
    no device ever holds."""
    return getattr(_inside, "depth", 0) > 0


@contextlib.contextmanager
def unseen() -> Iterator[None]:
    """Within: `propagating()` holds (nests). For tensors made only to know a shape: DTensor's
    global ones, and the intermediates inductor fuses away (`memory.compiled`)."""
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        _inside.depth -= 1


def _marked(propagate: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(propagate)
    def marked(*args: Any, **kwargs: Any) -> Any:
        with unseen():
            return propagate(*args, **kwargs)

    return marked


@contextlib.contextmanager
def marked_propagation() -> Iterator[None]:
    """Within: `propagating()` holds while DTensor propagates shapes (nests)."""
    unmarked = getattr(ShardingPropagator, _PROPAGATE, None)
    if unmarked is not None:
        setattr(ShardingPropagator, _PROPAGATE, _marked(unmarked))
    try:
        yield
    finally:
        if unmarked is not None:
            setattr(ShardingPropagator, _PROPAGATE, unmarked)


@contextlib.contextmanager
def _kept_grad_hooks() -> Iterator[None]:
    """Within: the autograd hooks ModTracker registers are kept; on leaving, all removed (see
    the module docstring). Leave only after the backward they serve has run."""
    register = mod_tracker.register_multi_grad_hook
    handles: list[Any] = []

    def keeping(*args: Any, **kwargs: Any) -> Any:
        handle = register(*args, **kwargs)
        handles.append(handle)
        return handle

    mod_tracker.register_multi_grad_hook = keeping
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = register
        for handle in handles:
            handle.remove()


class SeesCompiledRegions:
    """For our dispatch modes (the tracker, the collective counter, the timeline sampler, the
    estimate's recorder): a compiled region runs compiled while they watch, not eagerly
    (dynamo's default under a dispatch mode). Under fake tensors its graphs run as operators
    they see (`memory.compiled`); in a real run inductor's kernels allocate where no mode sees
    them, and a compiled CPU run's peak comes from the allocator (`allocator_peak`). A
    compiled checkpointed region's random operators (`run_and_save_rng_state`, a higher-order
    operator) pass through them as any operator."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class TensorMemoryTracker(SeesCompiledRegions, MemTracker):
    """MemTracker that does not count DTensor's shape propagation, and counts memory held from
    before the step apart (see the module docstring)."""

    def __init__(self, *, held_apart: bool = False) -> None:
        """`held_apart`: for DDP. Not under FSDP2, whose unsharded parameters also predate the
        step but are storages it resizes (freed and refilled) within it."""
        super().__init__()
        self._held_apart = held_apart
        self._held: Any = WeakIdKeyDictionary()
        """Storage -> (device type, bytes) of the memory held from before the step."""

    def held_bytes(self, device_type: str) -> int:
        """Bytes on `device_type` held from before the step that no module or optimizer holds."""
        return sum(size for kind, size in self._held.values() if kind == device_type)

    def __enter__(self) -> TensorMemoryTracker:
        self._marking = marked_propagation()
        self._marking.__enter__()
        self._hooks = _kept_grad_hooks()
        self._hooks.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        self._hooks.__exit__(None, None, None)
        self._marking.__exit__(None, None, None)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if propagating() and DTensor not in types:
            return func(*args, **(kwargs or {}))
        if self._held_apart:  # an operand the tracker never saw was allocated before the step
            for tensor in tree_leaves((args, kwargs)):
                if isinstance(tensor, torch.Tensor) and not isinstance(tensor, DTensor):
                    storage = tensor.untyped_storage()
                    if storage not in self._WINFO and storage not in self._held:
                        self._held[storage] = (tensor.device.type, storage.nbytes())
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _is_held(self, t: torch.Tensor) -> bool:
        return bool(self._held) and t.untyped_storage() in self._held

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        """How MemTracker counts an operator's output: not memory held from before."""
        if not self._is_held(t):
            super()._track(reftype, t)

    def _update_and_maybe_create_winfos(self, t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """How MemTracker counts parameters, gradients and optimizer state: not memory held
        from before (DDP's gradients are views of its buckets)."""
        if self._is_held(t):
            return set()
        return super()._update_and_maybe_create_winfos(t, *args, **kwargs)
