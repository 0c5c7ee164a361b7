"""The one place that touches torch's private fake-distribution helpers.

A fake process group hallucinates collectives for one rank of a world of any size, and
FakeTensorMode gives tensors shapes and dtypes but no storage: together they run the real
FSDP2 code for rank 0 of, say, 1,024 ranks on a laptop. Both live in private torch modules
(`torch.testing._internal`, `torch._subclasses`); if an upstream release moves them, this
file is what changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["fake_tensors", "fake_world", "on_fresh_thread"]

P = ParamSpec("P")
T = TypeVar("T")


def fake_tensors() -> FakeTensorMode:
    """Tensors without storage. Real inputs are allowed: FSDP2 builds small device-mesh index
    tensors while sharding (an int reshard_after_forward makes a sub-mesh)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake default process group of `world_size` ranks in which this process is `rank`."""
    # Importing the module registers the "fake" backend with torch.distributed.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world: a process group already exists in this process")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def on_fresh_thread(function: Callable[P, T]) -> Callable[P, T]:
    """`function`, each call run on a thread of its own, its exception raised in the caller.

    For what builds a fake world: successive fake worlds in one process build device meshes
    that compare equal (same ranks, layout and names), and torch keeps per-thread state keyed
    by them: an HSDP x TP simulation after a TP one was handed the earlier world's process
    groups and gathered the sequence over a group of one rank. A thread's state ends with
    it."""

    @functools.wraps(function)
    def on_thread(*args: P.args, **kwargs: P.kwargs) -> T:
        with ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(function, *args, **kwargs).result()

    return on_thread
