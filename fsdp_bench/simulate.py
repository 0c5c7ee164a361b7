"""The simulated estimate: the worker's own code for rank 0, at the target world size, on fake
tensors and a fake process group, measured by the same memory tracker as a real run.

Same model, same `parallelize`, same optimizer and training step, same `profile_step`: what a
real run would allocate, tensor by tensor, without memory or a GPU. Not modelled: what lives
outside tensors (CUDA context, NCCL buffers, allocator fragmentation); that is the overhead
term of the budget (`MemoryConfig.overhead_gib`).

Large models are simulated with a few blocks and extrapolated: every per-rank category is
affine in the number of identical blocks (shards, gradients, optimizer state and saved
activations grow with it; the root group, the prefetch buffer and the logits do not), so two
small simulations give the slope and intercept.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import init_device_mesh

from fsdp_bench.config import RunConfig, grouping_block_count
from fsdp_bench.fake import fake_tensors, fake_world
from fsdp_bench.fsdp import materialize, shard
from fsdp_bench.metrics import MemoryReport, add_ddp_buckets, profile_step
from fsdp_bench.models import build_model, init_weights
from fsdp_bench.training import build_optimizer, make_train_step, rank_batches


@dataclass(frozen=True)
class SimulatedEstimate:
    peak_bytes: int
    breakdown_bytes: dict[str, int]
    method: str
    """`full`, or `extrapolated from N and M blocks`."""
    wall_s: float


def simulate(run: RunConfig, *, extrapolate: bool = True) -> SimulatedEstimate:
    """Peak tracked memory of rank 0 of `run`, without running it."""
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete")
    start = time.perf_counter()
    layers = _extrapolation_layers(run) if extrapolate else None
    if layers is None:
        report = simulate_step(run)
        return SimulatedEstimate(
            report.peak_bytes, report.breakdown_bytes, "full", time.perf_counter() - start
        )
    small, large = layers
    a, b = (simulate_step(_with_layers(run, n)) for n in layers)
    target = run.model.shape.n_layers

    def line(at_small: int, at_large: int) -> int:
        slope = (at_large - at_small) / (large - small)
        return round(at_small + slope * (target - small))

    peak = line(a.peak_bytes, b.peak_bytes)
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
    return SimulatedEstimate(peak, breakdown, method, time.perf_counter() - start)


def simulate_step(run: RunConfig) -> MemoryReport:
    """One warm-up step (optimizer state), then the profiled step, all on fake tensors.

    Sharding happens on the meta device before fake mode (FSDP2 builds small real index
    tensors for its meshes then). DDP is simulated unwrapped (its wrapper talks to the process
    group at construction) plus its gradient buckets: flat copies of every gradient, allocated
    at construction and alive all along."""
    with fake_world(run.world_size):
        names = ("replicate", "shard") if len(run.mesh_shape) == 2 else ("shard",)
        mesh = init_device_mesh("cpu", run.mesh_shape, mesh_dim_names=names)
        device = torch.device("cpu")
        torch.manual_seed(run.data.seed)
        bundle = build_model(run.model)
        model, _ = shard(bundle, run, mesh, device)
        with fake_tensors():
            materialize(model, device)
            init_weights(model)
            optimizer = build_optimizer(model, run)
            batches = rank_batches(run, 0, bundle.vocab_size, device)
            make_train_step(model, optimizer, batches, run)()
            memory = profile_step(model, optimizer, batches, run).memory
    if run.strategy == "ddp":
        add_ddp_buckets(memory, model)
    return memory


def _extrapolation_layers(run: RunConfig) -> tuple[int, int] | None:
    """Two small block counts that behave like the full model, or None to simulate it all."""
    if run.model.is_user_model:
        return None
    target = run.model.shape.n_layers
    per_group = grouping_block_count(str(run.fsdp.grouping)) or 1
    depth = 0 if run.fsdp.prefetch == "implicit" else int(run.fsdp.prefetch)
    small = per_group * max(2, depth + 1)
    large = small + per_group
    if small + large > target or target % per_group:  # as cheap to simulate it all
        return None
    return small, large


def _with_layers(run: RunConfig, n_layers: int) -> RunConfig:
    model = dataclasses.replace(run.model, n_layers=n_layers)
    return dataclasses.replace(run, model=model)
