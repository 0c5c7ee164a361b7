"""Sharding on a fake process group of 8 ranks: what FSDP2 builds, without running a step."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Shard, distribute_tensor

from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.job.measure.tracker import TensorMemoryTracker
from fsdp_bench.job.model.zoo import build_model
from fsdp_bench.job.parallel.parallelize import wrap_on_meta
from fsdp_bench.memory.fake import fake_tensors, fake_world


def test_an_int_reshard_shares_one_post_forward_mesh_per_job() -> None:
    """pytorch/pytorch#153302: FSDP2 alone builds a mesh (new process groups) per group."""
    run = RunConfig(world_size=8, fsdp=FsdpConfig(reshard_after_forward=2))
    created = []
    with fake_world(8):
        mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("shard",))
        for _ in range(2):  # two runs of one job
            before = len(dist.distributed_c10d._world.pg_map)
            model, plan = wrap_on_meta(build_model(run.model), run, mesh, torch.device("cpu"))
            infos = {
                id(group.post_forward_mesh_info)
                for module in model.modules()
                if isinstance(module, FSDPModule)
                for group in param_groups(module)
            }
            assert plan.num_groups == 5 and len(infos) == 1
            created.append(len(dist.distributed_c10d._world.pg_map) - before)
    assert created == [2, 0]  # the 2-D post-forward mesh's two groups, once


def param_groups(module: FSDPModule) -> list[Any]:
    """A module's FSDP2 parameter groups: a list in torch 2.13, one or None in 2.11."""
    state = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


def test_dtensor_shape_propagation_is_not_counted_as_memory() -> None:
    """DTensor runs each new operator once on fake tensors of the global shape to learn its
    output's; torch 2.11's MemTracker counted them (an FSDP2 AdamW step's moments at their
    unsharded size). Only the shards, 1/8 of the global tensor here, may count."""
    shard_bytes = 256 * 384 * 4
    with fake_world(8):
        mesh = init_device_mesh("cpu", (8,))
        with fake_tensors():
            x = distribute_tensor(torch.empty(8 * 256, 384), mesh, [Shard(0)])
            tracker = TensorMemoryTracker()
            with tracker:
                y = torch.sqrt(x) * 3  # shapes no earlier test propagated: not cached
                total = torch._foreach_add([x, y], 1.0)
                del y, total
    peak = sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    assert peak <= 4 * shard_bytes, f"{peak} bytes: the global {8 * shard_bytes} was counted"
