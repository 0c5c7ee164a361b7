"""The simulated estimate: the worker's own step for rank 0, at the target world size, on fake
tensors and a fake process group (`fake_step`), measured by the same memory tracker as a real
run or read from its recorded allocations. For a CUDA run the
allocations are also recorded in order, with their streams (`alloc_trace`), and replayed
through the caching allocator model (`allocator`): allocated and reserved memory. What lives
outside the allocator is `device_memory`'s.

A large model is simulated with a few blocks and deepened (`deepen`): the shallow model's
allocations, tagged by block, with a middle period of blocks repeated up to the model's depth,
give the deep model's trace allocation for allocation, and every figure (the tensors' peak and
its breakdown, the allocator's) comes from it. Whether the repetition holds is checked for
each run: the trace deepened by one period must be the simulated one of that depth, in order
and stream, sizes that hold every block (a root group's all-gather, DDP's buckets) growing as
they grew there. Where it does not hold, every per-rank category is taken as affine in the
blocks (two small tracked simulations give slope and intercept) and the allocator's figures
come from the whole model's allocations, recorded in two untracked steps.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
import warnings
from dataclasses import dataclass

from fsdp_bench.config.run import RunConfig, checkpointed_every, grouping_block_count
from fsdp_bench.job.measure import MemoryReport
from fsdp_bench.memory.deepen import CannotDeepen, deepen, grown, growth_per_period
from fsdp_bench.memory.fake_step import SimulatedStep, record_step, simulate_step


@dataclass(frozen=True)
class SimulatedEstimate:
    peak_bytes: int
    breakdown_bytes: dict[str, int]
    method: str
    """`full`, `deepened from N blocks (checked at M)` or `extrapolated from N and M blocks`."""
    wall_s: float
    host_bytes: int = 0
    """With CPU offload: what stays in host memory (shards, gradients, optimizer state),
    not part of `peak_bytes`, which is the accelerator's."""
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    """The caching allocator's peaks (`allocator.py`) for the run's allocations on CUDA:
    what max_memory_allocated (blocks as booked, cuBLAS's workspaces) and
    max_memory_reserved (segments) will say."""


def simulate(
    run: RunConfig, *, device_type: str = "cpu", extrapolate: bool = True
) -> SimulatedEstimate:
    """Peak tracked memory of rank 0 of `run` on `device_type` (cuda or cpu), without
    running it: the tensors are the CPU's, fake, but the model is built as for that device."""
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete")
    start = time.perf_counter()
    plan = _deepening(run) if extrapolate else None
    if plan is not None:
        try:
            return _deepened(run, device_type, plan, start)
        except CannotDeepen:
            pass  # the trace is not a repetition of its template: the lines below
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
    whole = record_step(run, device_type).trace if device_type == "cuda" else None
    allocator = whole.allocator_peaks(expandable=run.train.expandable_segments) if whole else (0, 0)
    return _on_device(peak, breakdown, method, time.perf_counter() - start, offloaded, allocator)


@dataclass(frozen=True)
class _Deepening:
    """Simulate `blocks`, check against `blocks + period`, then make `target` (`deepen`)."""

    blocks: int
    template_start: int
    period: int
    target: int

    @property
    def template(self) -> tuple[int, int]:
        return self.template_start, self.period


def _deepening(run: RunConfig) -> _Deepening | None:
    """How a deep model's trace is made from a shallow one's; None: not a model whose depth can
    change, or one too shallow to gain from it.

    The template is a period of blocks that are alike: `period` blocks make one FSDP group
    (blocks:K) and one round of every_N checkpointing. The first blocks (as many periods as
    the prefetch depth) and the last ones are not alike and are kept around it."""
    target = _num_layers(run)  # None for a user's module
    if target is None:
        return None
    per_group = grouping_block_count(str(run.fsdp.grouping)) or 1
    every = checkpointed_every(run.fsdp.activation_checkpointing) or 1
    period = math.lcm(per_group, every)
    depth = 0 if run.fsdp.prefetch == "implicit" else int(run.fsdp.prefetch)
    margin = period * max(1, depth)
    left = margin + period  # the first blocks, then a period like the template
    blocks = left + period + margin
    if target % period or target <= blocks + period:
        return None
    return _Deepening(blocks, left, period, target)


def _deepened(
    run: RunConfig, device_type: str, plan: _Deepening, start: float
) -> SimulatedEstimate:
    """The estimate from a `plan.blocks`-block simulation, deepened to the model's depth, once
    the same deepening by one period has reproduced a simulated trace, allocation for
    allocation (sizes that hold every block grown as they grew in that period)."""
    small = record_step(_with_layers(run, plan.blocks), device_type)
    check = record_step(_with_layers(run, plan.blocks + plan.period), device_type)
    made = deepen(small.trace, plan.blocks, plan.blocks + plan.period, *plan.template)
    growth = growth_per_period(made, check.trace)
    deep = deepen(small.trace, plan.blocks, plan.target, *plan.template)
    deep = grown(deep, growth, (plan.target - plan.blocks) // plan.period)
    peak, breakdown = deep.live_peak("step", with_inputs=run.strategy == "ddp")
    cuda = device_type == "cuda"
    allocator = deep.allocator_peaks(expandable=run.train.expandable_segments) if cuda else (0, 0)
    periods = (plan.target - plan.blocks) // plan.period
    (shard_a, state_a), (shard_b, state_b) = small.offloaded, check.offloaded
    offloaded = (shard_a + (shard_b - shard_a) * periods, state_a + (state_b - state_a) * periods)
    method = f"deepened from {plan.blocks} blocks (checked at {plan.blocks + plan.period})"
    wall_s = time.perf_counter() - start
    return _on_device(peak, breakdown, method, wall_s, offloaded, allocator)


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
