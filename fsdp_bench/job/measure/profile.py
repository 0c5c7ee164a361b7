"""What a run measures besides time: collectives per step, peak memory and where a step's
time goes (`step_trace`).

Each measurement runs in its own untimed optimizer step (`profile_step`), so the timed steps
carry nothing but the training step.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_bench.config.run import RunConfig
from fsdp_bench.job.measure.allocator_peak import allocator_peak, live_bytes
from fsdp_bench.job.measure.memory_timeline import (
    COLLECTIVE_KINDS,
    MemoryTimeline,
    TimelineSampler,
    cuda_memory_history,
)
from fsdp_bench.job.measure.step_trace import StepBreakdown, trace_step
from fsdp_bench.job.measure.tracker import SeesCompiledRegions, TensorMemoryTracker
from fsdp_bench.job.training import (
    Batch,
    CompileBackend,
    make_train_step,
    optimizer_state_tensors,
)

_MATMULS = {"mm", "addmm", "bmm"}


@dataclass
class CollectiveCounts:
    """Collectives issued by one rank in one optimizer step, and the bytes of their full buffers
    (all-gather output, reduce-scatter input, all-reduce tensor: the unsharded size)."""

    all_gathers: int = 0
    all_gather_bytes: int = 0
    reduce_scatters: int = 0
    reduce_scatter_bytes: int = 0
    all_reduces: int = 0
    all_reduce_bytes: int = 0
    other: int = 0
    all_gathers_before_compute: int = 0
    """All-gathers issued before the step's first matmul: explicit prefetch raises it."""
    all_gather_sizes_bytes: list[int] = field(default_factory=list)
    """Each all-gather's output bytes, in issue order (one per group unshard)."""
    per_dimension: dict[str, dict[str, int]] = field(default_factory=dict)
    """The same counts per mesh dimension the collectives ran over ("shard", "tp",
    "replicate"; "world" for the default group, "other" for a group of no dimension), as
    {dimension: {"all_gathers": n, "all_gather_bytes": b, ...}}."""


FUNCTIONAL_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_gather_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
}
"""torch.distributed._functional_collectives by what they do (names differ by release)."""


class CollectiveCounter(SeesCompiledRegions, TorchDispatchMode):
    """Counts the collectives a step issues (exact and repeatable): c10d's as they pass
    through the dispatcher (FSDP2's all-gathers and reduce-scatters, DDP's all-reduces), and
    the functional ones as they are called. DTensor issues those from inside its own
    operators (the all-reduce that makes gradient clipping's partial norm whole), where no
    dispatch mode sees them, so their Python functions are watched while counting."""

    def __init__(self, dimensions: Mapping[tuple[int, ...], str] | None = None) -> None:
        """`dimensions`: the ranks of this rank's groups -> mesh dimension names
        (`group_dimensions`)."""
        super().__init__()
        self.counts = CollectiveCounts()
        self._dimensions = dict(dimensions or {})
        self._computing = False
        self._watched: dict[str, Any] = {}

    def __enter__(self) -> CollectiveCounter:
        import torch.distributed._functional_collectives as funcol

        for name, kind in FUNCTIONAL_COLLECTIVES.items():
            original = getattr(funcol, name, None)
            if original is not None:
                self._watched[name] = original
                setattr(funcol, name, self._watch(original, kind))
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        import torch.distributed._functional_collectives as funcol

        super().__exit__(*args)
        for name, original in self._watched.items():
            setattr(funcol, name, original)
        self._watched.clear()

    def _watch(self, collective: Any, kind: str) -> Any:
        import torch.distributed._functional_collectives as funcol

        signature = inspect.signature(collective)

        def watched(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = collective(tensor, *args, **kwargs)
            group: Any = signature.bind(tensor, *args, **kwargs).arguments.get("group")
            found = None
            # no group, or one of an earlier fake world (a memory simulation: DTensor kept a
            # mesh of the same shape from it): counted as "other"
            with contextlib.suppress(RuntimeError, ValueError):
                found = _resolve_process_group(funcol._resolve_group_name(group))
            self._count(kind, _nbytes(out if kind == "all_gather" else tensor), _ranks(found))
            return out

        return watched

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func.namespace == "c10d":
            kind = COLLECTIVE_KINDS.get(func._opname)
            # (output, input, ...): the full buffer is the output of an all-gather, the input
            # of a reduce-scatter, the tensor of an all-reduce
            size = _nbytes(args[1] if kind == "reduce_scatter" else args[0])
            self._count(kind, size, _ranks(_process_group(args)))
        elif not self._computing and getattr(func, "_opname", None) in _MATMULS:
            self._computing = True
            self.counts.all_gathers_before_compute = self.counts.all_gathers
        return func(*args, **(kwargs or {}))

    def _count(self, kind: str | None, num_bytes: int, ranks: tuple[int, ...] = ()) -> None:
        c = self.counts
        dimension = self._dimensions.get(ranks, "other")
        per = c.per_dimension.setdefault(dimension, {})
        number, size = COUNT_FIELDS.get(kind or "", ("other", None))
        per[number] = per.get(number, 0) + 1
        if size is not None:
            per[size] = per.get(size, 0) + num_bytes
        if kind == "all_gather":
            c.all_gathers += 1
            c.all_gather_bytes += num_bytes
            c.all_gather_sizes_bytes.append(num_bytes)
        elif kind == "reduce_scatter":
            c.reduce_scatters += 1
            c.reduce_scatter_bytes += num_bytes
        elif kind == "all_reduce":
            c.all_reduces += 1
            c.all_reduce_bytes += num_bytes
        else:
            c.other += 1


COUNT_FIELDS = {
    "all_gather": ("all_gathers", "all_gather_bytes"),
    "reduce_scatter": ("reduce_scatters", "reduce_scatter_bytes"),
    "all_reduce": ("all_reduces", "all_reduce_bytes"),
}
"""A collective's kind -> (its count's field, its bytes' field) in `CollectiveCounts`."""


def group_dimensions(mesh: DeviceMesh | None) -> dict[tuple[int, ...], str]:
    """The ranks of this rank's group along each dimension of `mesh` -> its name ("world"
    for all ranks, when no dimension spans them). By ranks, not by group: meshes of one job
    that share a dimension's ranks may each hold a group of their own for it."""
    found = {_ranks(dist.group.WORLD): "world"} if dist.is_initialized() else {}
    if mesh is not None:
        for name in mesh.mesh_dim_names or ():
            found[_ranks(mesh.get_group(name))] = name
    return found


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(sorted(dist.get_process_group_ranks(group))) if group is not None else ()


def _process_group(args: tuple[Any, ...]) -> Any:
    """The process group among a c10d operator's arguments (there a script object)."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject) and arg._type().qualified_name().endswith(
            "ProcessGroup"
        ):
            return dist.ProcessGroup.unbox(arg)
    return None


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


@dataclass
class MemoryReport:
    """Peak of tracked tensor memory in one step, with the breakdown at the moment of the peak
    (parameter, gradient, optimizer_state, activation, temp, buffer, other)."""

    peak_bytes: int
    breakdown_bytes: dict[str, int] = field(default_factory=dict)
    module_peak_bytes: dict[str, int] = field(default_factory=dict)
    """Peak while each module ran: `<fqn> forward` / `<fqn> backward` -> bytes (last
    micro-batch). The step's peak is the largest of these moments (or of the optimizer's)."""
    host_peak_bytes: int = 0
    """On an accelerator: the peak of tensors in host memory (CPU-offloaded shards, gradients
    and optimizer state), kept apart from the device's peak, which is what a budget limits."""
    offloaded_shard_bytes: int = 0
    offloaded_state_bytes: int = 0
    """Simulated with CPU offload on one CPU: the parameter shards (as many gradient shards)
    and the optimizer state that a GPU run keeps in host memory, still counted in the peak."""
    allocator_peak_bytes: int | None = None
    """A real compiled run on the CPU: its peak at the allocator (`allocator_peak`), inductor's
    buffers included, which the tracker does not see."""


@dataclass
class StepProfile:
    counts: CollectiveCounts
    memory: MemoryReport
    breakdown: StepBreakdown | None = None
    timeline: MemoryTimeline | None = None


def profile_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[Batch],
    run: RunConfig,
    trace_path: Path | None = None,
    break_down: bool = True,
    mesh: DeviceMesh | None = None,
    compile_backend: CompileBackend = "inductor",
) -> StepProfile:
    """One untimed optimizer step under the memory tracker and the collective counter, then
    (`break_down`) one under torch.profiler (`step_trace`; its trace kept at `trace_path`).
    Collectives are counted per dimension of `mesh` too; a compiled loss is compiled with
    `compile_backend` (the memory simulation's own, under fake tensors).
    With `break_down` the tracked step also samples the memory timeline (`memory_timeline`;
    on CUDA with a trace path, the allocator's history is saved beside the trace).

    Memory is the tensor-level peak in steady state (the model must have stepped already, so
    that optimizer state exists), from torch's MemTracker (as `tracker` counts it alike on every
    torch release), which follows every storage (including FSDP2's resized unsharded
    parameters) without touching FSDP's hooks. Not FSDPMemTracker: it re-registers FSDP's
    forward hooks per module, which changes the schedule of list-form groups (`blocks:K`, a
    tied embedding and head): 9 all-gathers instead of 5 for blocks:2 on the tiny model. Where
    both apply they agree to the byte. The tracker treats a second root forward as a new
    iteration; its per-module statistics are cleared between micro-batches (the peak
    survives).
    """
    tracker = TensorMemoryTracker(held_apart=run.strategy == "ddp")
    tracker.track_external(model, optimizer)
    step = make_train_step(
        model, optimizer, batches, run, tracker.reset_mod_stats, compile_backend=compile_backend
    )
    counter = CollectiveCounter(group_dimensions(mesh))
    device = batches[0][0].device
    sampler = TimelineSampler(tracker, device.type) if break_down else None
    history = trace_path.with_name(f"{trace_path.stem}_memory.pickle") if trace_path else None
    recording = cuda_memory_history(history if break_down else None, device)
    at_allocator = _compiled_on_cpu(run, device)
    with (
        allocator_peak() if at_allocator else contextlib.nullcontext() as allocator,
        recording,
        tracker,
        counter,
        sampler or contextlib.nullcontext(),
    ):
        step()
    memory = _snapshot(tracker, device.type)
    held = tracker.held_bytes(device.type)  # alive through the step: at every moment
    if allocator is not None:  # what the module and optimizer hold, and DDP's buckets
        before = live_bytes(_held_through_step(model, optimizer, batches)) + held
        memory.allocator_peak_bytes = before + allocator.bytes_above_start
    if held:
        memory.peak_bytes += held
        memory.breakdown_bytes["held_before_step"] = held
        memory.module_peak_bytes = {k: v + held for k, v in memory.module_peak_bytes.items()}
    if sampler is None:
        return StepProfile(counter.counts, memory)
    breakdown = trace_step(model, optimizer, batches, run, trace_path)
    return StepProfile(counter.counts, memory, breakdown, sampler.timeline())


def _compiled_on_cpu(run: RunConfig, device: torch.device) -> bool:
    """A real compiled run on the CPU: its peak is taken at the allocator (`allocator_peak`).
    Not under fake tensors (the estimate's simulation runs the compiled graphs as operators
    the tracker sees, `memory.compiled`)."""
    from torch._guards import detect_fake_mode

    return run.train.compiled and device.type == "cpu" and detect_fake_mode() is None


def _held_through_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Batch]
) -> list[Any]:
    """What is alive when a step begins and through it: parameters, buffers, optimizer state,
    the batches (gradients are released at the end of the step before)."""
    return [*model.parameters(), *model.buffers(), *optimizer_state_tensors(optimizer), *batches]


def _module_peak_bytes(tracker: Any, device_type: str) -> dict[str, int]:
    from torch.distributed._tools.mem_tracker import _ModState

    peaks: dict[str, int] = {}
    for stats in tracker.memory_tracking.values():
        for label, state in (("forward", _ModState.PEAK_FW), ("backward", _ModState.PEAK_BW)):
            totals = [
                sum(v["Total"] for d, v in snapshot.items() if d.type == device_type)
                for snapshot in stats.snapshots.get(state, [])
            ]
            if totals:
                peaks[f"{stats.mod_fqn} {label}"] = max(totals)
    return peaks


def _snapshot(tracker: Any, device_type: str) -> MemoryReport:
    """The peak on the run's device (what its memory must hold) and, apart, on the host."""
    snapshot: dict[Any, int] = {}
    host = 0
    for device, per_device in tracker.get_tracker_snapshot("peak").items():
        if device.type != device_type:
            host += per_device.get("Total", 0) if device.type == "cpu" else 0
            continue
        for key, value in per_device.items():
            name = key if isinstance(key, str) else key.value
            snapshot[name] = snapshot.get(name, 0) + value
    total = snapshot.pop("Total", sum(snapshot.values()))
    breakdown = {_category(name): value for name, value in snapshot.items() if value}
    return MemoryReport(total, breakdown, _module_peak_bytes(tracker, device_type), host)


def _category(name: str) -> str:
    """'Sharded Param' -> 'sharded_param', 'OptState' -> 'optimizer_state'."""
    lowered = name.lower().replace(" ", "_")
    return {"optstate": "optimizer_state", "act": "activation", "inp": "inputs"}.get(
        lowered, lowered
    )


def profile_once(
    profiles: dict[str, StepProfile],
    run_id: str,
    profile: Callable[[], StepProfile],
    step: Callable[[], None],
) -> Callable[[], StepProfile]:
    """The profiled step of a run's first pass (`measure.rounds`), kept in `profiles`; in its
    later passes a plain step in its place (the same number of steps), answered with the
    first pass's profile: it is the same, and costs more than the step."""

    def once() -> StepProfile:
        if run_id not in profiles:
            profiles[run_id] = profile()
        else:
            step()
        return profiles[run_id]

    return once
