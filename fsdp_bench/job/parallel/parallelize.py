"""Apply a run's parallelism to a meta-device model: FSDP2 (fully_shard) or the DDP baseline.

The FSDP2 path is the usual one (torchtitan's order): float8 linears, tensor parallelism and
activation checkpointing first, then `fully_shard` on each group bottom-up, the root last,
explicit prefetch wired between groups, and only then the parameters are materialised shard
by shard (seed 000, sections 04-11).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.nn.parallel import DistributedDataParallel

from fsdp_bench.config.fsdp import FsdpConfig, grouping_block_count
from fsdp_bench.config.run import RunConfig, TrainConfig
from fsdp_bench.errors import ConfigError
from fsdp_bench.job.model.zoo import ModelBundle, initialize
from fsdp_bench.job.parallel.activation_checkpointing import apply_checkpointing
from fsdp_bench.job.parallel.float8 import convert_to_float8, gather_float8_as_bytes
from fsdp_bench.job.parallel.post_forward_mesh import shared_post_forward_meshes
from fsdp_bench.job.parallel.tensor_parallel import apply_tensor_parallel


@dataclass
class Group:
    """One fully_shard call: its modules (by qualified name) and what it all-gathers."""

    names: list[str]
    modules: list[nn.Module] = field(repr=False)
    num_params: int = 0
    unsharded_bytes: int = 0


@dataclass
class ShardPlan:
    """The groups of a sharded model, root last; the seed's 'largest unsharded group'."""

    groups: list[Group]

    @property
    def largest_group_bytes(self) -> int:
        return max((g.unsharded_bytes for g in self.groups), default=0)

    @property
    def num_groups(self) -> int:
        return len(self.groups)


def parallelize(
    bundle: ModelBundle, run: RunConfig, mesh: DeviceMesh, device: torch.device
) -> tuple[nn.Module, ShardPlan]:
    """Turn the meta-device model into a trainable, materialised, parallel model."""
    model, plan = wrap_on_meta(bundle, run, mesh, device, compile_backend="inductor")
    materialize(model, device, params_on_host=run.fsdp.cpu_offload)
    initialize(bundle, model)
    if run.strategy == "ddp":
        # Stock DDP as users run it: the C++ reducer (its all-reduces pass through the
        # dispatcher, where the profiled step counts them) and gradients kept as views of
        # its buckets, so they are not held twice.
        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )
        return ddp, plan
    return model, plan


def wrap_on_meta(
    bundle: ModelBundle,
    run: RunConfig,
    mesh: DeviceMesh,
    device: torch.device,
    compile_backend: Any = None,
    target_device_type: str | None = None,
) -> tuple[nn.Module, ShardPlan]:
    """Float8 linears (emulated when the run is on the CPU: `target_device_type`, by default
    `device`'s), tensor parallelism, activation checkpointing, torch.compile of
    `train.compile`'s scope with `compile_backend` (None: not compiled; the memory simulation
    passes its own, `memory.compiled`) and fully_shard, still on the meta
    device (no memory yet), in torchtitan's order. With TP, `mesh` is (shard, tp):
    fully_shard takes its shard dimension."""
    if run.train.float8 != "none":
        convert_to_float8(
            bundle.module,
            bundle.blocks,
            run.train.float8,
            run.fsdp.float8_all_gather,
            target_device_type or device.type,
        )
    if run.tp_size > 1:
        apply_tensor_parallel(bundle, mesh["tp"], run.tp_sequence_parallel, run.train.float8)
        mesh = mesh[run.mesh_dim_names[:-1]]  # (replicate,) shard: FSDP2's (HSDP's) mesh
    bundle = apply_checkpointing(bundle, run.fsdp.activation_checkpointing)
    model = bundle.module
    if compile_backend is not None:
        _compile(bundle, run.train, compile_backend)
    match run.strategy:
        case "fsdp" | "hsdp":  # a 2-D mesh (replicate, shard) makes fully_shard HSDP
            plan = plan_groups(bundle, str(run.fsdp.grouping))
            _measure_groups(plan, model, run.fsdp, run.shard_group_size)
            _fully_shard_groups(plan, model, run.fsdp, mesh, device)
            if run.fsdp.float8_all_gather and dist.get_backend(mesh.get_group(-1)) == "gloo":
                gather_float8_as_bytes(model)
        case "ddp":
            plan = ShardPlan([_root_group(model)])
            _measure_groups(plan, model, run.fsdp, 1)
        case _:
            raise ConfigError(f"strategy: {run.strategy!r} is not supported")
    return model, plan


def plan_groups(bundle: ModelBundle, grouping: str) -> ShardPlan:
    """The fully_shard groups for a grouping, tied parameters kept inside one group."""
    model = bundle.module
    names = {id(m): n for n, m in model.named_modules()}
    units: list[list[nn.Module]]
    if grouping == "root":
        units = []
    elif grouping == "block":
        units = [[b] for b in bundle.blocks]
    elif (k := grouping_block_count(grouping)) is not None:
        units = [bundle.blocks[i : i + k] for i in range(0, len(bundle.blocks), k)]
    elif grouping == "linear":
        units = [[m] for m in model.modules() if _is_linear(m)]
    elif grouping.startswith("modules:"):
        units = [[m] for m in _match_patterns(model, grouping[len("modules:") :].split(","))]
    else:
        raise ConfigError(f"fsdp.grouping: {grouping!r} is not supported")
    units = _merge_tied(model, units)
    groups = [Group(names=[names[id(m)] for m in unit], modules=unit) for unit in units]
    return ShardPlan([*groups, _root_group(model)])


def _is_linear(module: nn.Module) -> bool:
    """nn.Linear, or transformers' Conv1D (GPT-2's linear layers, weight transposed)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _root_group(model: nn.Module) -> Group:
    return Group(names=[""], modules=[model])


def _match_patterns(model: nn.Module, patterns: list[str]) -> list[nn.Module]:
    named = [(n, m) for n, m in model.named_modules() if n]
    matched: list[nn.Module] = []
    for pattern in patterns:
        hits = [m for n, m in named if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            examples = ", ".join(n for n, _ in named[:8])
            raise ConfigError(
                f"fsdp.grouping: pattern {pattern!r} matches no module; module names look like: "
                f"{examples}, ..."
            )
        matched += [m for m in hits if all(m is not seen for seen in matched)]
    return matched


def _merge_tied(model: nn.Module, units: list[list[nn.Module]]) -> list[list[nn.Module]]:
    """Put the modules sharing a parameter (tied embedding and LM head) into one group.

    FSDP2 needs a shared parameter managed by exactly one group; otherwise the first forward
    fails ("shared with a parameter already managed by another FSDP group").
    """
    names = {id(m): n for n, m in model.named_modules()}
    holders: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(module)
    units = [list(u) for u in units]
    for modules in holders.values():
        owners = {_owner(units, names, m) for m in modules}
        if len(owners) < 2:
            continue
        inner = sorted(o for o in owners if o is not None)
        merged = [m for o in inner for m in units[o]]
        merged += [m for m in modules if _owner(units, names, m) is None]
        keep = [u for i, u in enumerate(units) if i not in owners]
        at = inner[0] if inner else len(keep)
        units = [*keep[:at], merged, *keep[at:]]
    return units


def _owner(units: list[list[nn.Module]], names: dict[int, str], module: nn.Module) -> int | None:
    """Index of the innermost group containing `module`, None when only the root does."""
    name = names[id(module)]
    best: tuple[int, int] | None = None
    for index, unit in enumerate(units):
        for top in unit:
            prefix = names[id(top)]
            inside = name == prefix or name.startswith(prefix + ".")
            if inside and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def _measure_groups(plan: ShardPlan, model: nn.Module, cfg: FsdpConfig, shard_size: int) -> None:
    """Each group's own parameters and the bytes its all-gather produces (dim-0 padded)."""
    claimed: set[int] = set()
    itemsize = 2 if cfg.mixed_precision == "bf16" else None
    for group in plan.groups:  # non-root groups first: the root keeps what they leave
        params = []
        for module in group.modules:
            for param in module.parameters():
                if id(param) not in claimed:
                    claimed.add(id(param))
                    params.append(param)
        group.num_params = sum(p.numel() for p in params)
        group.unsharded_bytes = sum(
            _padded_numel(p, shard_size) * (itemsize or p.element_size()) for p in params
        )


def _padded_numel(param: torch.Tensor, shard_size: int) -> int:
    if param.dim() == 0:
        return shard_size
    rows = -(-param.shape[0] // shard_size) * shard_size
    return rows * (param.numel() // max(param.shape[0], 1))


def mixed_precision_policy(cfg: FsdpConfig) -> MixedPrecisionPolicy:
    """Compute and all-gathers in bf16 (`mixed_precision`; a no-op for parameters stored in
    bf16), gradients reduced in `reduce_dtype`: FSDP2 casts them to it for the
    reduce-scatter and back to the parameters' dtype after."""
    bf16, fp32 = torch.bfloat16, torch.float32
    return MixedPrecisionPolicy(
        param_dtype=bf16 if cfg.mixed_precision == "bf16" else None,
        reduce_dtype=bf16 if cfg.reduce_dtype == "bf16" else fp32,
        cast_forward_inputs=cfg.cast_forward_inputs,
    )


def _fully_shard_groups(
    plan: ShardPlan, model: nn.Module, cfg: FsdpConfig, mesh: DeviceMesh, device: torch.device
) -> None:
    policy = cfg.reshard_after_forward
    reshard = policy if isinstance(policy, (bool, int)) else None  # None: FSDP2's default
    mp = mixed_precision_policy(cfg)
    pin = cfg.offload_pin_memory and device.type == "cuda"  # pinning needs an accelerator
    offload = CPUOffloadPolicy(pin_memory=pin) if cfg.cpu_offload else OffloadPolicy()
    depth = {id(m): len(n.split(".")) for n, m in model.named_modules()}
    inner = plan.groups[:-1]
    last = inner[-1] if inner else None  # in forward order: the first backward computes
    with shared_post_forward_meshes():  # an int reshard: one mesh for all groups, per job
        for group in sorted(inner, key=lambda g: -max(depth[id(m)] for m in g.modules)):
            target = group.modules if len(group.modules) > 1 else group.modules[0]
            fully_shard(
                target,
                mesh=mesh,
                reshard_after_forward=group is not last if policy == "all_but_last" else reshard,
                mp_policy=mp,
                offload_policy=offload,
            )
        fully_shard(
            model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload
        )
    if cfg.prefetch != "implicit":
        _wire_prefetch([g.modules[0] for g in inner], cfg.prefetch)
    _set_communication(model, cfg)


def _set_communication(model: nn.Module, cfg: FsdpConfig) -> None:
    """FSDP2's communication settings past fully_shard's arguments, on every group."""
    assert isinstance(model, FSDPModule)
    if cfg.reduce_scatter_buffers != 1:
        model.set_reduce_scatter_max_input_buffers(cfg.reduce_scatter_buffers)
    if cfg.separate_reduce_scatter_group:
        model.set_separate_reduce_scatter_group(True)
    for module in model.modules():  # these two set one module's groups only
        if isinstance(module, FSDPModule):
            if cfg.comm_buffers_from_process_group:
                module.set_allocate_memory_from_process_group_for_comm(True)
            if cfg.symm_mem:
                module.set_symm_mem_for_comm()


def _wire_prefetch(ordered: list[nn.Module], depth: int) -> None:
    """Explicit prefetch: each group issues the all-gathers of the next `depth` groups."""
    fsdp_modules: list[FSDPModule] = [m for m in ordered if isinstance(m, FSDPModule)]
    for i, module in enumerate(fsdp_modules):
        following = fsdp_modules[i + 1 : i + 1 + depth]
        preceding = fsdp_modules[max(0, i - depth) : i][::-1]
        if following:
            module.set_modules_to_forward_prefetch(following)
        if preceding:
            module.set_modules_to_backward_prefetch(preceding)


def _compile(bundle: ModelBundle, train: TrainConfig, backend: Any) -> None:
    """In place (`Module.compile`), so the modules keep their names and identities for the
    fully_shard groups; compilation itself happens in the first step.

    Dynamo's caches are cleared first, also for a compiled loss alone (`training.build_loss`):
    runs of one job share a process, and a run would otherwise reuse an earlier run's graphs
    (its compile cost unmeasured). Blocks share one code object, and a block that guards on
    its own index (transformers' `layer_idx`) is compiled once per block: the recompile limit
    is raised to allow every block, and hitting it is an error, never dynamo's silent
    fallback to eager for the remaining blocks."""
    modules = {"none": [], "block": bundle.blocks, "model": [bundle.module]}[train.compile]
    if not modules and not train.compile_loss:
        return
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = max(8, len(bundle.blocks) + 8)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    for module in modules:
        module.compile(backend=backend)


def materialize(module: nn.Module, device: torch.device, params_on_host: bool = False) -> None:
    """Allocate the parameters on `device` (on the host with `params_on_host`: FSDP2's CPU
    offload requires its shards there before the first forward, as torchtitan materialises
    them), tied ones still tied; buffers keep their values, on `device`, where they compute.

    FSDP2 keeps shared parameters shared through `to_empty`; a plain module does not. Buffers
    were built for real (`models.parameters_on_meta`): `to_empty` would leave them garbage."""
    buffers = [
        (owner, name, buffer)
        for owner in module.modules()
        for name, buffer in owner.named_buffers(recurse=False)
        if buffer.device.type != "meta"
    ]
    params_device = torch.device("cpu") if params_on_host else device
    if isinstance(module, FSDPModule):
        module.to_empty(device=params_device)
    else:
        _to_empty_keeping_ties(module, params_device)
    for owner, name, buffer in buffers:
        owner._buffers[name] = buffer.to(device, copy=True)


def _to_empty_keeping_ties(module: nn.Module, device: torch.device) -> None:
    first_holder: dict[int, tuple[nn.Module, str]] = {}
    ties: list[tuple[nn.Module, str, nn.Module, str]] = []
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            if id(param) in first_holder:
                ties.append((sub, name, *first_holder[id(param)]))
            else:
                first_holder[id(param)] = (sub, name)
    module.to_empty(device=device)
    for sub, name, owner, owner_name in ties:
        setattr(sub, name, getattr(owner, owner_name))
