"""The simulated estimate: the worker's own code for rank 0, at the target world size, on fake
tensors and a fake process group, measured by the same memory tracker as a real run.

Same model, same `parallelize`, same optimizer and training step, same `profile_step`: what a
real run would allocate, tensor by tensor, without memory or a GPU. For a CUDA run the
allocations are also recorded in order, with their streams (`alloc_trace`), and replayed
through the caching allocator model (`allocator`): allocated and reserved memory. What lives
outside the allocator is `device_memory`'s.

Large models' tensors are simulated with a few blocks and extrapolated: every per-rank category
is affine in the number of identical blocks (shards, gradients, optimizer state and saved
activations grow with it; the root group, the prefetch buffer and the logits do not), so two
small simulations give the slope and intercept. The allocator's figures are not affine (a new
segment comes whenever the cached ones stop fitting): they are recorded over the whole model,
in two steps without the tracker.
"""

from __future__ import annotations

import dataclasses
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fsdp_bench.config.run import RunConfig, grouping_block_count
from fsdp_bench.job.measure import MemoryReport, profile_step
from fsdp_bench.job.models import build_model, initialize
from fsdp_bench.job.parallelize import materialize, wrap_on_meta
from fsdp_bench.job.training import build_optimizer, make_train_step, rank_batches
from fsdp_bench.memory.alloc_trace import recording
from fsdp_bench.memory.fake import fake_tensors, fake_world


@dataclass(frozen=True)
class SimulatedEstimate:
    peak_bytes: int
    breakdown_bytes: dict[str, int]
    method: str
    """`full`, or `extrapolated from N and M blocks`."""
    wall_s: float
    host_bytes: int = 0
    """With CPU offload: what stays in host memory (shards, gradients, optimizer state),
    not part of `peak_bytes`, which is the accelerator's."""
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    """The caching allocator's peaks (`allocator.py`) for the run's allocations on CUDA:
    what max_memory_allocated (blocks as booked, cuBLAS's workspaces) and
    max_memory_reserved (segments) will say."""


@dataclass
class SimulatedStep(MemoryReport):
    """The tracked step, and its allocations replayed through the caching allocator."""

    allocated_bytes: int = 0
    reserved_bytes: int = 0


def simulate(
    run: RunConfig, *, device_type: str = "cpu", extrapolate: bool = True
) -> SimulatedEstimate:
    """Peak tracked memory of rank 0 of `run` on `device_type` (cuda or cpu), without
    running it: the tensors are the CPU's, fake, but the model is built as for that device."""
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete")
    start = time.perf_counter()
    points = _settled_line(run, device_type) if extrapolate else None
    if points is None:
        report = simulate_step(run, device_type)
        return _on_device(
            report.peak_bytes,
            report.breakdown_bytes,
            "full",
            time.perf_counter() - start,
            (report.offloaded_shard_bytes, report.offloaded_state_bytes),
            (report.allocated_bytes, report.reserved_bytes),
        )
    (small, a), (large, b) = points
    target = _num_layers(run) or 0

    def line(at_small: int, at_large: int) -> int:
        slope = (at_large - at_small) / (large - small)
        return round(at_small + slope * (target - small))

    # Every moment of the step grows linearly with the blocks, but the largest one at the
    # target size need not be the largest in the small models: take the largest line.
    moments_a, moments_b = _moments(a, small), _moments(b, large)
    peak = max(
        [line(a.peak_bytes, b.peak_bytes)]
        + [line(moments_a[k], moments_b[k]) for k in moments_a.keys() & moments_b.keys()]
    )
    categories = a.breakdown_bytes.keys() | b.breakdown_bytes.keys()
    breakdown = {
        c: line(a.breakdown_bytes.get(c, 0), b.breakdown_bytes.get(c, 0)) for c in categories
    }
    method = f"extrapolated from {small} and {large} blocks"
    if min(breakdown.values(), default=0) < 0 or abs(sum(breakdown.values()) - peak) > peak / 100:
        # The peak came at another moment of the step in the two small models: the total
        # still grows by one block's worth, but its parts do not; scale the larger model's.
        scale = peak / max(b.peak_bytes, 1)
        breakdown = {c: round(v * scale) for c, v in b.breakdown_bytes.items()}
        method += f" (parts: the {large}-block model's, scaled)"
    offloaded = (
        line(a.offloaded_shard_bytes, b.offloaded_shard_bytes),
        line(a.offloaded_state_bytes, b.offloaded_state_bytes),
    )
    # The allocator's figures are not straight lines in the blocks (a segment is added
    # whenever the cached ones no longer fit, every 10-12 blocks of Llama-2-7B): they come from
    # the whole model's allocations, recorded in steps without the tracker.
    allocator = (0, 0)
    if device_type == "cuda":
        whole = simulate_step(run, device_type, tracked=False)
        allocator = (whole.allocated_bytes, whole.reserved_bytes)
    return _on_device(peak, breakdown, method, time.perf_counter() - start, offloaded, allocator)


def _on_device(
    peak: int,
    breakdown: dict[str, int],
    method: str,
    wall_s: float,
    offloaded: tuple[int, int],
    allocator: tuple[int, int],
) -> SimulatedEstimate:
    """The estimate of the accelerator's memory. With CPU offload the simulation's one
    device held the host's share too: the device's tensors are `device_share`'s, and the
    allocator's figures are scaled down with them (its reserve over tensors kept as a
    ratio: the host tensors' own allocations are not split off the trace)."""
    allocated, reserved = allocator
    if not any(offloaded):
        return SimulatedEstimate(peak, breakdown, method, wall_s, 0, allocated, reserved)
    device_peak, breakdown, host = device_share(peak, breakdown, *offloaded)
    scale = device_peak / max(peak, 1)
    return SimulatedEstimate(
        device_peak, breakdown, method, wall_s, host, round(allocated * scale),
        round(reserved * scale),
    )  # fmt: skip


# Extrapolation is trusted once two consecutive slopes agree this closely, measured by what
# their difference would change at the target size.
SETTLED = 0.002
MAX_SMALL_MODELS = 6


def _settled_line(run: RunConfig, device_type: str) -> tuple[tuple[int, SimulatedStep], ...] | None:
    """Two small block counts on the straight part of peak(blocks), simulated; None: simulate
    the whole model (user models, uneven groups, or no straight part found cheaply).

    The first few blocks can still change which moment of the step is the peak (70B: the
    logits' gradient overtakes between 2 and 3 blocks), so slopes are compared until two
    consecutive ones agree."""
    target = _num_layers(run)
    if target is None:
        return None
    per_group = grouping_block_count(str(run.fsdp.grouping)) or 1
    depth = 0 if run.fsdp.prefetch == "implicit" else int(run.fsdp.prefetch)
    if target % per_group:
        return None
    counts = [per_group * n for n in range(max(2, depth + 1), target // per_group)]
    if sum(counts[:3]) > target:  # three small models would cost more than the whole one
        return None
    points: list[tuple[int, SimulatedStep]] = []
    spent = 0
    for count in counts[:MAX_SMALL_MODELS]:
        spent += count
        if spent > target:
            return None
        points.append((count, simulate_step(_with_layers(run, count), device_type)))
        if len(points) >= 3:
            (n0, p0), (n1, p1), (n2, p2) = points[-3:]
            slope_a = (p1.peak_bytes - p0.peak_bytes) / (n1 - n0)
            slope_b = (p2.peak_bytes - p1.peak_bytes) / (n2 - n1)
            if abs(slope_b - slope_a) * (target - n2) <= SETTLED * p2.peak_bytes:
                return points[-2], points[-1]
    return None


def simulate_step(
    run: RunConfig, device_type: str = "cpu", *, tracked: bool = True
) -> SimulatedStep:
    """A warm-up step, then the profiled step, all on fake tensors, their allocations replayed
    through the caching allocator model. Not `tracked`: a plain second step, the allocator's
    figures only (the tracker costs most of a simulation's time).

    Sharding happens on the meta device before fake mode (FSDP2 builds small real index
    tensors for its meshes then). DDP is simulated unwrapped (its wrapper talks to the process
    group at construction), its reducer's gradient buckets emulated (`_reduce_into_buckets`)."""
    with fake_world(run.world_size):
        names = ("replicate", "shard") if len(run.mesh_shape) == 2 else ("shard",)
        mesh = init_device_mesh("cpu", run.mesh_shape, mesh_dim_names=names)
        device = torch.device("cpu")
        torch.manual_seed(run.data.seed)
        bundle = build_model(run.model, device_type)
        model, _ = wrap_on_meta(bundle, run, mesh, device)
        with fake_tensors(), recording(enabled=device_type == "cuda") as trace:
            materialize(model, device)
            initialize(bundle, model)
            optimizer = build_optimizer(model, run)
            batches = rank_batches(run, 0, bundle.vocab_size, device)
            if run.strategy == "ddp":
                _reduce_into_buckets(model, run)
            # A warm-up step, as the run's: the optimizer's state, and the allocator's cache as
            # a first step leaves it (creating the state up front instead, on zero gradients,
            # gave the same tensors but a reserve 4-6% higher than a real run's order).
            step = make_train_step(model, optimizer, batches, run)
            step()
            if tracked:
                memory = profile_step(model, optimizer, batches, run, break_down=False).memory
            else:
                step()
                memory = MemoryReport(trace.live_peak_bytes)
            if run.fsdp.cpu_offload and run.strategy != "ddp":
                _measure_offload(memory, model, optimizer)
    if not trace.events:  # not on CUDA: no caching allocator to model
        return SimulatedStep(**vars(memory))
    allocator = trace.replay(expandable=run.train.expandable_segments).stats
    return SimulatedStep(
        **vars(memory),
        allocated_bytes=allocator.peak_allocated_bytes,
        reserved_bytes=allocator.peak_reserved_bytes,
    )


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
        _local(value).numel() * value.element_size()
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    )


def device_share(
    peak: int, breakdown: dict[str, int], shard_bytes: int, state_bytes: int
) -> tuple[int, dict[str, int], int]:
    """(device peak, its breakdown, host bytes) of a CPU-offload run simulated on one CPU.

    At the peak the device holds what is not host-resident: unsharded parameters and
    gradients in flight, activations, temporaries; the gradient shards leave it only as far
    as they exist at the peak."""
    parts = dict(breakdown)
    params = min(shard_bytes, parts.get("parameter", 0))
    grads = min(shard_bytes, parts.get("gradient", 0))
    moved = params + grads + parts.pop("optimizer_state", 0)
    parts["parameter"] = parts.get("parameter", 0) - params
    parts["gradient"] = parts.get("gradient", 0) - grads
    return peak - moved, parts, 2 * shard_bytes + state_bytes


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _moments(report: MemoryReport, n_layers: int) -> dict[str, int]:
    """Module peaks under names that mean the same moment whatever the block count: the first
    and the last block (the middle ones lie between them), and the modules outside blocks."""
    moments = {}
    for key, value in report.module_peak_bytes.items():
        match = re.search(r"\.(?:layers|h|blocks)\.(\d+)(?=[. ])", key)  # GPT-2: .h.N
        if match:
            index = int(match.group(1))
            if index not in (0, n_layers - 1):
                continue
            where = "first" if index == 0 else "last"
            key = key[: match.start(1)] + where + key[match.end(1) :]
        moments[key] = value
    return moments


def _num_layers(run: RunConfig) -> int | None:
    """The model's block count, where a copy with another count can be made (presets,
    transformers configs); None for import-path models."""
    if run.model.is_hf_model:
        from fsdp_bench.job.hf import num_hidden_layers

        return num_hidden_layers(run.model)
    return None if run.model.is_user_model else run.model.shape.n_layers


def _with_layers(run: RunConfig, n_layers: int) -> RunConfig:
    if run.model.is_hf_model:
        overrides = {**run.model.hf_overrides, "num_hidden_layers": n_layers}
        model = dataclasses.replace(run.model, hf_overrides=overrides)
    else:
        model = dataclasses.replace(run.model, n_layers=n_layers)
    return dataclasses.replace(run, model=model)
