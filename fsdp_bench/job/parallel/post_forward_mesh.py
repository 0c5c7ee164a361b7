"""One post-forward mesh per sharding mesh and reshard size, instead of one per fully_shard call.

With `reshard_after_forward` an int, FSDP2 builds a new DeviceMesh, and so new process groups,
for every fully_shard call (pytorch/pytorch#153302): on NCCL each is a communicator of its
own, about 1 GB outside the allocator, and NVSwitch multicast slots run out on H200 long
before a 33-group Llama is sharded. Every group reshards to the same ranks, so one mesh can
serve them all: while `shared_post_forward_meshes()` is active, FSDP2's builder is asked once
per (mesh, size) and its answer reused. This is the one place that reaches into FSDP2's
private modules; if an upstream release moves the builder, this file is what changes.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

_BUILDER = _fsdp_init._get_post_forward_mesh_info
# id(sharding mesh) -> (a weak reference to it, {reshard size: post-forward mesh info}); the
# weak reference tells a live mesh from a new one that got the id of a collected one.
_CACHE: dict[int, tuple[weakref.ref[Any], dict[int, Any]]] = {}


def _shared(reshard_after_forward: bool | int, mesh_info: Any) -> Any:
    if isinstance(reshard_after_forward, bool):
        return _BUILDER(reshard_after_forward, mesh_info)
    mesh = mesh_info.mesh
    entry = _CACHE.get(id(mesh))
    if entry is None or entry[0]() is not mesh:
        entry = (weakref.ref(mesh), {})
        _CACHE[id(mesh)] = entry
    by_size = entry[1]
    if reshard_after_forward not in by_size:
        by_size[reshard_after_forward] = _BUILDER(reshard_after_forward, mesh_info)
    return by_size[reshard_after_forward]


@contextmanager
def shared_post_forward_meshes() -> Iterator[None]:
    """fully_shard calls inside share their post-forward meshes (see the module docstring)."""
    _fsdp_init._get_post_forward_mesh_info = _shared
    _fully_shard._get_post_forward_mesh_info = _shared
    try:
        yield
    finally:
        _fsdp_init._get_post_forward_mesh_info = _BUILDER
        _fully_shard._get_post_forward_mesh_info = _BUILDER
