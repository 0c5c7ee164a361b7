"""torch's MemTracker, made to count the same on every torch release we run on.

DTensor finds each operator's output shape by running it on fake tensors of the global
(unsharded) shape (`ShardingPropagator._propagate_tensor_meta_non_cached`). On torch 2.11
MemTracker counted those tensors as allocations: an FSDP2 AdamW step showed the moments of
Llama-3-1B at their unsharded size, 15.9 GB at 8 ranks instead of 1.2, in the estimator (whose
fake mode the propagation reuses) and in real runs alike. torch 2.13 leaves them out
(pytorch/pytorch#183970 skips operators of a nested fake mode); here they are left out on every
release by marking the propagation itself. This and `post_forward_mesh` are the places that
reach into torch's private modules; a release that renames the method only loses the mark.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator

_PROPAGATE = "_propagate_tensor_meta_non_cached"
_inside = threading.local()


def _propagating() -> bool:
    return getattr(_inside, "depth", 0) > 0


def _marked(propagate: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(propagate)
    def marked(*args: Any, **kwargs: Any) -> Any:
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return propagate(*args, **kwargs)
        finally:
            _inside.depth -= 1

    return marked


class TensorMemoryTracker(MemTracker):
    """MemTracker that does not count DTensor's shape propagation (see the module docstring)."""

    def __enter__(self) -> TensorMemoryTracker:
        self._unmarked = getattr(ShardingPropagator, _PROPAGATE, None)
        if self._unmarked is not None:
            setattr(ShardingPropagator, _PROPAGATE, _marked(self._unmarked))
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        if self._unmarked is not None:
            setattr(ShardingPropagator, _PROPAGATE, self._unmarked)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if _propagating() and DTensor not in types:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)
