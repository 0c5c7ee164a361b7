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
they grew there; runs alike but for their world size share one check (`simulate_alike`).
Where it does not hold, the whole model's step is simulated under the tracker.

The shallow simulation runs the warm-up step only: the measured step is the warm-up step
repeated without the optimizer's state (`repeat_step`), which each run that checks itself
first finds true of its deeper simulation, run for two steps. With a period of one block a
run that checks itself simulates one step of 3 blocks and two of 4; one whose check is shared,
one step of 3 blocks.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

from fsdp_bench.config.fsdp import checkpointed_every, grouping_block_count
from fsdp_bench.config.run import RunConfig
from fsdp_bench.memory.alloc_trace import AllocationTrace
from fsdp_bench.memory.deepen import (
    CannotDeepen,
    ShallowTrace,
    grown,
    growth_per_period,
    structure,
)
from fsdp_bench.memory.fake_step import RecordedStep, record_step, simulate_step
from fsdp_bench.memory.repeat_step import STEP, repeat_step, repeats


@dataclass(frozen=True)
class SimulatedEstimate:
    peak_bytes: int
    breakdown_bytes: dict[str, int]
    method: str
    """`full`, or `deepened from N blocks (checked at M)` (`M, K ranks`: the check of a run
    alike but for its world size, K ranks, stands for this one)."""
    wall_s: float
    host_bytes: int = 0
    """With CPU offload: what stays in host memory (shards, gradients, optimizer state),
    not part of `peak_bytes`, which is the accelerator's."""
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    """The caching allocator's peaks (`allocator.py`) for the run's allocations on CUDA:
    what max_memory_allocated (blocks as booked, cuBLAS's workspaces) and
    max_memory_reserved (segments) will say."""


def simulate(run: RunConfig, *, device_type: str = "cpu", deepen: bool = True) -> SimulatedEstimate:
    """Peak tracked memory of rank 0 of `run` on `device_type` (cuda or cpu), without
    running it: the tensors are the CPU's, fake, but the model is built as for that device.
    `deepen=False`: the whole model under the tracker, the reference the others meet."""
    if deepen:
        return simulate_alike([run], device_type=device_type)[0]
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete")
    return _whole(run, device_type, time.perf_counter())


def simulate_alike(runs: list[RunConfig], *, device_type: str = "cpu") -> list[SimulatedEstimate]:
    """`simulate` for runs alike but for their world size (`alike_key`), in order: the
    one-period check is made for the first run only. Another run's shallow trace must have the
    first's structure and deepen into the same events (the same copies of the same
    allocations, only sizes of shards differ); where a size grew with the blocks in the
    check (a root group's all-gather, DDP's buckets) or with CPU offload, each run checks
    itself."""
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete")
    checked: _Checked | None = None
    refused = False
    out = []
    for run in runs:
        start = time.perf_counter()
        plans = _deepenings(run)
        estimate = None
        if plans and not refused:
            try:
                estimate, checked = _deepened(run, device_type, plans, checked, start)
            except CannotDeepen:
                refused = True  # the others' traces are alike: trace them whole too
        out.append(estimate or _whole(run, device_type, start))
    return out


def _whole(run: RunConfig, device_type: str, start: float) -> SimulatedEstimate:
    """The whole model's step under the tracker (the allocator's figures from its recorded
    allocations): the reference the others meet, and the estimate where a trace cannot be
    deepened."""
    report = simulate_step(run, device_type)
    return _on_device(
        report.peak_bytes,
        report.breakdown_bytes,
        "full",
        time.perf_counter() - start,
        (report.offloaded_shard_bytes, report.offloaded_state_bytes),
        (report.allocated_bytes, report.reserved_bytes),
    )


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

    @property
    def checked_at(self) -> int:
        return self.blocks + self.period

    def analysed(self, trace: AllocationTrace) -> ShallowTrace:
        """A `blocks`-block trace ready to be deepened by this plan."""
        return ShallowTrace(trace, self.blocks, self.template_start, self.period)


def _deepenings(run: RunConfig) -> list[_Deepening]:
    """How a deep model's trace can be made from a shallow one's, the shallowest first; none
    for a model whose depth cannot change, or one too shallow to gain from it.

    The template is a period of blocks that are alike: `period` blocks make one FSDP group
    (blocks:K) and one round of every_N checkpointing. The first blocks (as many periods as
    the prefetch depth) and the last ones are not alike and are kept around it. Where a block
    frees what the block two before it made (its input, kept by the block without
    checkpointing; an explicit prefetch's all-gather), the template needs a period like it
    before it: the second plan; which one holds, the one-period check says."""
    target = _num_layers(run)  # None for a user's module
    if target is None:
        return []
    per_group = grouping_block_count(str(run.fsdp.grouping)) or 1
    every = checkpointed_every(run.fsdp.activation_checkpointing) or 1
    period = math.lcm(per_group, every)
    depth = 0 if run.fsdp.prefetch == "implicit" else int(run.fsdp.prefetch)
    margin = period * max(1, depth)
    shallow = _Deepening(margin + period + margin, margin, period, target)
    spaced = _Deepening(shallow.blocks + period, margin + period, period, target)
    if target % period or target <= spaced.checked_at:
        return []
    return [shallow, spaced]


@dataclass(frozen=True)
class _Checked:
    """What a run's one-period check showed, for the runs alike but for world size."""

    world_size: int
    plan: _Deepening
    one_step: bool
    """Its measured step was its warm-up step repeated (`repeat_step`): the others simulate
    one step."""
    shallow: list[tuple[Any, ...]]
    """The shallow trace's `structure`, and the one deepened by one period, with which
    shallow event each of its events copies."""
    made: list[tuple[Any, ...]]
    sources: list[int]


@dataclass
class _Check:
    """A run's own one-period check: the plan that held, its shallow simulation and the one a
    period deeper, the shallow trace deepened by that period, and how sizes grew in it."""

    plan: _Deepening
    small: RecordedStep
    shallow: ShallowTrace
    deeper: RecordedStep
    made: AllocationTrace
    growth: dict[int, int]
    one_step: bool

    def offloaded(self) -> tuple[int, int]:
        """With CPU offload, the host's shards and optimizer state at the model's depth: they
        grow by the same bytes each period."""
        periods = (self.plan.target - self.plan.blocks) // self.plan.period
        (shard_a, state_a), (shard_b, state_b) = self.small.offloaded, self.deeper.offloaded
        return shard_a + (shard_b - shard_a) * periods, state_a + (state_b - state_a) * periods

    def for_alike(self, world_size: int) -> _Checked:
        return _Checked(
            world_size, self.plan, self.one_step, structure(self.small.trace),
            structure(self.made), self.made.sources,
        )  # fmt: skip


def _checked(run: RunConfig, device_type: str, plans: list[_Deepening]) -> _Check:
    """The first plan whose shallow trace, deepened by one period, is the simulated trace of
    that depth, allocation for allocation (sizes that hold every block grown as they grew).
    The second plan's shallow depth is the first's check: the simulations are shared. The
    shallow simulation runs one step where the deeper one's second step repeats its first."""
    first, spaced = plans
    deeper = record_step(_with_layers(run, first.checked_at), device_type)
    one_step = repeats(deeper.trace)
    small = _recorded(run, first.blocks, device_type, one_step)
    try:
        shallow = first.analysed(small.trace)
        made = shallow.deepened(first.checked_at)
        growth = growth_per_period(made, deeper.trace)
        return _Check(first, small, shallow, deeper, made, growth, one_step)
    except CannotDeepen:
        check = record_step(_with_layers(run, spaced.checked_at), device_type)
        shallow = spaced.analysed(deeper.trace)
        made = shallow.deepened(spaced.checked_at)
        growth = growth_per_period(made, check.trace)
        return _Check(spaced, deeper, shallow, check, made, growth, one_step)


def _shared(run: RunConfig, device_type: str, checked: _Checked) -> ShallowTrace | None:
    """`run`'s shallow trace by `checked`'s plan, if it deepens by one period into the same
    events as `checked`'s did: that check stands for it."""
    plan = checked.plan
    small = _recorded(run, plan.blocks, device_type, checked.one_step)
    try:
        shallow = plan.analysed(small.trace)
        made = shallow.deepened(plan.checked_at)
    except CannotDeepen:
        return None
    mine = (structure(small.trace), structure(made), made.sources)
    return shallow if mine == (checked.shallow, checked.made, checked.sources) else None


def _recorded(run: RunConfig, blocks: int, device_type: str, one_step: bool) -> RecordedStep:
    """The `blocks`-block simulation of `run`'s two steps; with `one_step`, the second made
    from the first (`repeat_step`)."""
    if not one_step:
        return record_step(_with_layers(run, blocks), device_type)
    recorded = record_step(_with_layers(run, blocks), device_type, steps=1)
    return dataclasses.replace(recorded, trace=repeat_step(recorded.trace))


def _deepened(
    run: RunConfig,
    device_type: str,
    plans: list[_Deepening],
    checked: _Checked | None,
    start: float,
) -> tuple[SimulatedEstimate, _Checked | None]:
    """The estimate from a shallow simulation deepened to the model's depth, once the same
    deepening by one period has reproduced a simulated trace (`_checked`). `checked`: a run
    alike but for its world size passed that check with no size growing; if this run's
    trace deepens by one period into the same events, the check stands for it (`_shared`).
    Returns the estimate and the check that later alike runs may use."""
    shallow = _shared(run, device_type, checked) if checked is not None else None
    if shallow is not None and checked is not None:
        plan, growth = checked.plan, {}
        offloaded = (0, 0)  # checks are not shared under CPU offload
        at = f"{plan.checked_at}, {checked.world_size} ranks"
    else:
        own = _checked(run, device_type, plans)
        plan, shallow, growth, offloaded = own.plan, own.shallow, own.growth, own.offloaded()
        at = str(plan.checked_at)
        alike = not growth and not run.fsdp.cpu_offload
        checked = own.for_alike(run.world_size) if alike else None
    periods = (plan.target - plan.blocks) // plan.period
    deep = grown(shallow.deepened(plan.target), growth, periods)
    peak, breakdown = deep.live_peak(STEP, with_inputs=run.strategy == "ddp")
    allocator = _allocator_peaks(deep, run) if device_type == "cuda" else (0, 0)
    method = f"deepened from {plan.blocks} blocks (checked at {at})"
    wall_s = time.perf_counter() - start
    return _on_device(peak, breakdown, method, wall_s, offloaded, allocator), checked


def _allocator_peaks(trace: AllocationTrace, run: RunConfig) -> tuple[int, int]:
    """The caching allocator's peaks for the run's trace; under CPU offload, of what stays
    on the accelerator (`AllocationTrace.without_host_state`)."""
    if run.fsdp.cpu_offload and run.strategy != "ddp":
        trace = trace.without_host_state()
    return trace.allocator_peaks(expandable=run.train.expandable_segments)


def _on_device(
    peak: int,
    breakdown: dict[str, int],
    method: str,
    wall_s: float,
    offloaded: tuple[int, int],
    allocator: tuple[int, int],
) -> SimulatedEstimate:
    """The estimate of the accelerator's memory. With CPU offload the simulation's one
    device held the host's share too: the device's tensors are `device_share`'s (the
    allocator's figures were replayed without the host's share already)."""
    allocated, reserved = allocator
    if not any(offloaded):
        return SimulatedEstimate(peak, breakdown, method, wall_s, 0, allocated, reserved)
    device_peak, breakdown, host = device_share(peak, breakdown, *offloaded)
    return SimulatedEstimate(device_peak, breakdown, method, wall_s, host, allocated, reserved)


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


def _num_layers(run: RunConfig) -> int | None:
    """The model's block count, where a copy with another count can be made (presets,
    transformers configs); None for import-path models."""
    if run.model.is_hf_model:
        from fsdp_bench.job.model.hf import num_hidden_layers

        return num_hidden_layers(run.model)
    return None if run.model.is_user_model else run.model.shape.n_layers


def _with_layers(run: RunConfig, n_layers: int) -> RunConfig:
    if run.model.is_hf_model:
        overrides = {**run.model.hf_overrides, "num_hidden_layers": n_layers}
        model = dataclasses.replace(run.model, hf_overrides=overrides)
    else:
        model = dataclasses.replace(run.model, n_layers=n_layers)
    return dataclasses.replace(run, model=model)
