"""Where a step's time goes: one untimed optimizer step under `torch.profiler`, its phases
marked, read back as forward / backward / optimizer time and as communication, the part of it
no compute covered (exposed) and the all-gathers' achieved bandwidth.

Communication is the backends' own work events: on CUDA the NCCL kernels on the device
timeline, against every other kernel as compute; on CPU the c10d backend's work (gloo's
`gloo:*` events, from enqueue to completion) against the operators the rank's main thread
ran. On CPU + gloo nothing computes while the main thread waits for a collective, so what
overlaps is at most what gloo's threads did while the main thread worked on: in practice
exposed is nearly all of it (the README says so); on GPUs the split is the point (seed 000,
section 05: the fraction of communication hidden by compute).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_bench.config.run import RunConfig
from fsdp_bench.job.intervals import Interval, length, uncovered, union
from fsdp_bench.job.training import Batch, make_train_step, synchronize

PHASES = ("forward", "backward", "optimizer")
MARK_PREFIX = "fsdp_bench."
_CPU_COMM = re.compile(r"^(gloo|nccl|mpi|ucc|xccl):")
_DEVICE_COMM = re.compile(r"nccl", re.IGNORECASE)
_ALL_GATHER = re.compile(r"all_?gather", re.IGNORECASE)


@dataclass(frozen=True)
class TimelineEvent:
    """One profiler event, reduced to what the breakdown reads (microseconds)."""

    name: str
    start_us: float
    end_us: float
    thread: int
    on_device: bool


@dataclass
class StepBreakdown:
    """One rank's profiled step, in seconds."""

    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    comm_s: float
    exposed_comm_s: float
    all_gather_s: list[float]
    """Each all-gather's duration, in issue order."""
    all_gather_exposed_s: list[float]
    """Of each, the time no compute ran beside it (the root's one all-gather before any
    compute: all of it)."""

    @property
    def comm_hidden_pct(self) -> float | None:
        if self.comm_s <= 0:
            return None
        return 100.0 * (1 - self.exposed_comm_s / self.comm_s)


def _marked(events: Iterable[TimelineEvent], phase: str, on_device: bool) -> list[Interval]:
    name = MARK_PREFIX + phase
    return [(e.start_us, e.end_us) for e in events if e.name == name and e.on_device == on_device]


def breakdown(events: list[TimelineEvent], on_cuda: bool) -> StepBreakdown:
    """The step's phases and communication from its events (pure: tests hand it events).

    Phases come from the step's marks (on CUDA their device-side ranges when the profiler
    gives them, else the CPU side); communication on CUDA from NCCL kernels against every
    other kernel, on CPU from the backend's work events against the main thread's operators.
    """
    phases = {phase: _marked(events, phase, on_device=True) if on_cuda else [] for phase in PHASES}
    for phase in PHASES:
        if not phases[phase]:
            phases[phase] = _marked(events, phase, on_device=False)
    comm, compute = _comm_and_compute(events, on_cuda)
    comm_spans = [(e.start_us, e.end_us) for e in comm]
    gathers = [
        (e.start_us, e.end_us)
        for e in sorted(comm, key=lambda e: e.start_us)
        if _ALL_GATHER.search(e.name)
    ]
    step = union(i for spans in phases.values() for i in spans)
    return StepBreakdown(
        step_s=(step[-1][1] - step[0][0]) / 1e6 if step else 0.0,
        forward_s=length(phases["forward"]) / 1e6,
        backward_s=length(phases["backward"]) / 1e6,
        optimizer_s=length(phases["optimizer"]) / 1e6,
        comm_s=length(comm_spans) / 1e6,
        exposed_comm_s=uncovered(comm_spans, compute) / 1e6,
        all_gather_s=[(end - start) / 1e6 for start, end in gathers],
        all_gather_exposed_s=[uncovered([span], compute) / 1e6 for span in gathers],
    )


def _comm_and_compute(
    events: list[TimelineEvent], on_cuda: bool
) -> tuple[list[TimelineEvent], list[Interval]]:
    """The collectives' events, and the intervals of compute they may hide behind."""
    if on_cuda:
        kernels = [e for e in events if e.on_device and not e.name.startswith(MARK_PREFIX)]
        comm = [e for e in kernels if _DEVICE_COMM.search(e.name)]
        compute = [(e.start_us, e.end_us) for e in kernels if not _DEVICE_COMM.search(e.name)]
        return comm, compute
    main = _main_thread(events)
    comm = [e for e in events if not e.on_device and _CPU_COMM.match(e.name)]
    operators = [e for e in events if e.thread == main and e.name.startswith("aten::")]
    return comm, [(e.start_us, e.end_us) for e in operators]


def _main_thread(events: list[TimelineEvent]) -> int:
    """The thread that ran the step's forward marks (the rank's Python thread)."""
    for e in events:
        if e.name == MARK_PREFIX + "forward" and not e.on_device:
            return e.thread
    return events[0].thread if events else 0


def timeline(profiler: Any) -> list[TimelineEvent]:
    """The profiler's events as TimelineEvents (device-side ones flagged). From the raw
    results where torch has them: `profiler.events()` builds a Python object tree costing
    0.3-0.5 s for the tiny model's 5,000 events, the raw list 5 ms."""
    from torch.autograd import DeviceType

    raw = getattr(getattr(profiler.profiler, "kineto_results", None), "events", None)
    if raw is None:
        return [
            TimelineEvent(e.name, e.time_range.start, e.time_range.end, e.thread,
                          e.device_type != DeviceType.CPU)
            for e in profiler.events()
        ]  # fmt: skip
    return [
        TimelineEvent(e.name(), e.start_ns() / 1e3, e.end_ns() / 1e3, e.start_thread_id(),
                      e.device_type() != DeviceType.CPU)
        for e in raw()
    ]  # fmt: skip


def trace_file(run: RunConfig, results: Path, rank: int) -> Path | None:
    """Where a rank's trace goes with measure.trace (`traces/<run_id>/rank<r>.json` in the
    results folder); None without."""
    if not run.measure.trace:
        return None
    return results / "traces" / run.run_id / f"rank{rank}.json"


def _mark(phase: str) -> Any:
    return torch.profiler.record_function(MARK_PREFIX + phase)


def trace_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[Batch],
    run: RunConfig,
    trace_path: Path | None = None,
) -> StepBreakdown:
    """One untimed step under the profiler, its phases marked; the trace written to
    `trace_path` (Chrome trace format, opens in Perfetto) when given."""
    from torch.profiler import ProfilerActivity, profile

    device = batches[0][0].device
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    step = make_train_step(model, optimizer, batches, run, mark=_mark)
    synchronize(device)
    with profile(activities=activities) as profiler:
        step()
        synchronize(device)
    if trace_path is not None:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(trace_path))
    return breakdown(timeline(profiler), on_cuda)
