"""The worker's training step for rank 0 on fake tensors and a fake process group: what a real
run of the configuration would allocate, tensor by tensor, without memory or a GPU
(`simulate` decides which depths to run it at and what to make of it).

Same model, same `parallelize`, same optimizer and training step: `simulate_step` measures it
with the tracker of real runs, `record_step` records every allocation tagged by block
(`alloc_trace`), which is what `deepen` works on.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_bench.config.fsdp import grouping_block_count
from fsdp_bench.config.run import RunConfig
from fsdp_bench.job.measure.profile import MemoryReport, profile_step
from fsdp_bench.job.model.zoo import ModelBundle, build_model, initialize
from fsdp_bench.job.parallel.parallelize import materialize, wrap_on_meta
from fsdp_bench.job.training import (
    build_optimizer,
    make_train_step,
    optimizer_state_tensors,
    rank_batches,
)
from fsdp_bench.memory.alloc_trace import AllocationTrace, BlockContext, recording
from fsdp_bench.memory.compiled import compiled_as, partitioned_backend
from fsdp_bench.memory.cuda_kernels import use_cuda_kernels
from fsdp_bench.memory.fake import fake_tensors, fake_world, on_fresh_thread
from fsdp_bench.memory.repeat_step import STEP, WARMUP


@dataclass
class SimulatedStep(MemoryReport):
    """The tracked step, and its allocations replayed through the caching allocator."""

    allocated_bytes: int = 0
    reserved_bytes: int = 0


@on_fresh_thread
def simulate_step(run: RunConfig, device_type: str = "cpu") -> SimulatedStep:
    """A warm-up step, then the profiled step, all on fake tensors; on CUDA their allocations
    replayed through the caching allocator model.

    Sharding happens on the meta device before fake mode (FSDP2 builds small real index
    tensors for its meshes then). DDP is simulated unwrapped (its wrapper talks to the process
    group at construction), its reducer's gradient buckets emulated (`_reduce_into_buckets`)."""
    with _simulated_model(run, device_type) as (model, bundle, device):
        cuda = device_type == "cuda"
        with fake_tensors(), recording() if cuda else contextlib.nullcontext() as recorder:
            optimizer, batches = _set_up(model, bundle, run, device, recorder)
            # A warm-up step, as the run's: the optimizer's state, and the allocator's cache as
            # a first step leaves it (creating the state up front instead, on zero gradients,
            # gave the same tensors but a reserve 4-6% higher than a real run's order).
            loss_backend = _backend(run, loss=True)
            make_train_step(model, optimizer, batches, run, compile_backend=loss_backend)()
            if recorder is not None:
                recorder.classify(optimizer_state_tensors(optimizer), "optimizer_state")
            memory = profile_step(
                model, optimizer, batches, run, break_down=False, compile_backend=loss_backend
            ).memory
            if run.fsdp.cpu_offload and run.strategy != "ddp":
                _measure_offload(memory, model, optimizer)
    if recorder is None:  # not on CUDA: no caching allocator to model
        return SimulatedStep(**vars(memory))
    trace = recorder.trace
    if run.fsdp.cpu_offload and run.strategy != "ddp":
        trace = trace.without_host_state()  # gradients not told apart here: kept, a bound
    allocated, reserved = trace.allocator_peaks(expandable=run.train.expandable_segments)
    return SimulatedStep(**vars(memory), allocated_bytes=allocated, reserved_bytes=reserved)


@dataclass
class RecordedStep:
    """A simulation's block-tagged allocations (`alloc_trace`) through set-up, a warm-up step
    and the step measured (from the mark `STEP`), untracked: what `deepen` works on."""

    trace: AllocationTrace
    offloaded: tuple[int, int] = (0, 0)
    """With CPU offload: `MemoryReport.offloaded_shard_bytes`, `offloaded_state_bytes`."""


@on_fresh_thread
def record_step(run: RunConfig, device_type: str = "cpu", *, steps: int = 2) -> RecordedStep:
    """`simulate_step`'s two steps without the tracker, every allocation recorded and tagged
    with its block, classified as the tracker would (parameters, gradients, optimizer state).
    `steps=1`: set-up and the warm-up step only, the measured step left to `repeat_step`."""
    with _simulated_model(run, device_type) as (model, bundle, device):
        context = BlockContext(bundle.blocks)
        with fake_tensors(), recording(context) as recorder:
            optimizer, batches = _set_up(model, bundle, run, device, recorder)

            spanning = _spanning_groups(model, bundle, run)

            @contextlib.contextmanager
            def phase(name: str) -> Iterator[None]:
                if name == "optimizer":  # the list not kept: zero_grad frees them
                    recorder.classify([p.grad for p in model.parameters()], "gradient")
                if name == "backward":  # a root group's parameters, unsharded in forward
                    for block, fsdp_param in spanning:
                        recorder.classify(fsdp_param.all_gather_outputs, "parameter", block)
                with context.mark(name):
                    yield

            step = make_train_step(
                model, optimizer, batches, run, mark=phase, compile_backend=_backend(run, loss=True)
            )
            recorder.mark(WARMUP)
            step()
            recorder.classify(optimizer_state_tensors(optimizer), "optimizer_state")
            recorder.mark(STEP)
            if steps == 2:
                step()
            memory = MemoryReport(0)
            if run.fsdp.cpu_offload and run.strategy != "ddp":
                _measure_offload(memory, model, optimizer)
        context.remove()
    return RecordedStep(
        recorder.trace, (memory.offloaded_shard_bytes, memory.offloaded_state_bytes)
    )


@contextlib.contextmanager
def _simulated_model(
    run: RunConfig, device_type: str
) -> Iterator[tuple[nn.Module, ModelBundle, torch.device]]:
    """Rank 0's model of `run`, built for `device_type` and sharded on the meta device, in a
    fake world of the run's size, its norms allocating as on `device_type` (`cuda_kernels`)."""
    with fake_world(run.world_size):
        mesh = init_device_mesh("cpu", run.mesh_shape, mesh_dim_names=run.mesh_dim_names)
        device = torch.device("cpu")
        torch.manual_seed(run.data.seed)
        bundle = build_model(run.model, device_type)
        use_cuda_kernels(bundle.module, device_type)
        model, _ = wrap_on_meta(
            bundle,
            run,
            mesh,
            device,
            compile_backend=_backend(run),
            target_device_type=device_type,
        )
        yield model, _outermost_blocks(model, bundle, run), device


def _backend(run: RunConfig, *, loss: bool = False) -> Any:
    """What compiles the run's compiled pieces here (the loss's with inductor's fusion): the
    partitioned graphs run as operators (`memory.compiled`), or nothing (eager: not compiled,
    or compiled with tensor parallelism, estimated as eager)."""
    return partitioned_backend(fused=loss) if compiled_as(run) == "partition" else None


def _outermost_blocks(model: nn.Module, bundle: ModelBundle, run: RunConfig) -> ModelBundle:
    """Compiled: the bundle with each checkpointed block as its wrapper, the module compiled,
    so that the block hooks of `alloc_trace.BlockContext` sit outside the checkpointed region
    (inside it dynamo cannot trace their side effects and runs the whole block eagerly)."""
    if compiled_as(run) != "partition":
        return bundle
    wrappers = {
        id(module._checkpoint_wrapped_module): module
        for module in model.modules()
        if isinstance(module, CheckpointWrapper)
    }
    return dataclasses.replace(bundle, blocks=[wrappers.get(id(b), b) for b in bundle.blocks])


def _set_up(
    model: nn.Module,
    bundle: ModelBundle,
    run: RunConfig,
    device: torch.device,
    recorder: Any = None,
) -> tuple[torch.optim.Optimizer, list[Any]]:
    """Parameters materialised and initialised, the optimizer, the rank's batches (and DDP's
    buckets), inside the fake mode; with a recorder, each named for what it is."""
    materialize(model, device)
    initialize(bundle, model)
    if recorder is not None:
        in_blocks: set[int] = set()
        for index, block in enumerate(bundle.blocks):
            params = list(block.parameters())
            in_blocks.update(id(p) for p in params)
            recorder.classify(params, "parameter", tag=index)
        recorder.classify([p for p in model.parameters() if id(p) not in in_blocks], "parameter")
    optimizer = build_optimizer(model, run)
    batches = rank_batches(run, 0, bundle.vocab_size, device)
    if recorder is not None:
        recorder.classify(batches, "inputs")
    if run.strategy == "ddp":
        _reduce_into_buckets(model, run)
    return optimizer, batches


def _spanning_groups(model: nn.Module, bundle: ModelBundle, run: RunConfig) -> list[Any]:
    """(block, FSDP parameter) for each parameter of a block in an FSDP group of more blocks
    than `fsdp.grouping` puts together (the root group of `grouping: root`). Their unsharded
    storages are made at once, before the first block, and tagged with it; once alive (forward
    does not reshard a root group) each is tagged with its own block, which makes the copy-out
    a sweep over the blocks that `deepen` can repeat."""
    if run.strategy == "ddp":
        return []
    block_of = {id(m): index for index, block in enumerate(bundle.blocks) for m in block.modules()}
    per_group = grouping_block_count(str(run.fsdp.grouping)) or 1
    found = []
    for module in model.modules():
        group = (
            module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        )
        if group is None:
            continue
        owners = [block_of.get(id(p._module_info.module)) for p in group.fsdp_params]
        if len({b for b in owners if b is not None}) > per_group:
            found += [
                (b, p) for b, p in zip(owners, group.fsdp_params, strict=True) if b is not None
            ]
    return found


def _reduce_into_buckets(model: nn.Module, run: RunConfig) -> None:
    """What DDP's reducer does to memory (gradient_as_bucket_view): flat buckets of every
    gradient, made at construction and held from before the step; each gradient, once
    accumulated in a micro-batch that synchronises, written into its view of a bucket and
    replaced by that view. Under `grad_sync: last` the micro-batches before the last keep
    their gradients apart, as `no_sync` does."""
    params = [p for p in model.parameters() if p.requires_grad]
    buckets = {
        dtype: torch.empty(sum(p.numel() for p in params if p.dtype == dtype), dtype=dtype)
        for dtype in {p.dtype for p in params}
    }
    every = run.train.accumulation_steps if run.train.grad_sync == "last" else 1
    offsets = dict.fromkeys(buckets, 0)
    for param in params:
        start, offsets[param.dtype] = offsets[param.dtype], offsets[param.dtype] + param.numel()
        calls = [0]

        def into_bucket(param: Any, start: int = start, calls: list[int] = calls) -> None:
            calls[0] += 1
            if calls[0] % every == 0:
                view = buckets[param.dtype].narrow(0, start, param.numel()).view_as(param)
                view.copy_(param.grad)
                param.grad = view

        param.register_post_accumulate_grad_hook(into_bucket)


def _measure_offload(memory: MemoryReport, model: nn.Module, optimizer: Any) -> None:
    """What CPUOffloadPolicy keeps in host memory: each rank's parameter shards, as many
    bytes of gradient shards, and the optimizer state."""
    memory.offloaded_shard_bytes = sum(
        _local(p).numel() * p.element_size() for p in model.parameters()
    )
    memory.offloaded_state_bytes = sum(
        _local(value).numel() * value.element_size() for value in optimizer_state_tensors(optimizer)
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
