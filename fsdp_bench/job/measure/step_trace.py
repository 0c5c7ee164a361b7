"""Where a step's time goes: one untimed optimizer step under `torch.profiler`, its phases
marked, read back as forward / backward / optimizer time and as communication, the part of it
no compute covered (exposed) and the all-gathers' achieved bandwidth.

Phases on CUDA are timed by CUDA events recorded on the current stream at each phase's
start and end (`PhaseClock`): the profiler's ranges are the CPU's, and on CUDA the CPU only
launches (backward's kernels come from autograd's device thread, outside the main thread's
range). On CPU the phases are the marks' own ranges on the main thread.

Communication is the backends' own work events: on CUDA the NCCL kernels on the device
timeline, against every other kernel as compute (device-side user annotations, such as the
`FSDP::*`, `nccl:*` and `Optimizer.step#...` ranges, are spans over kernels, not kernels: they
are left out); on CPU the c10d backend's work (gloo's `gloo:*` events, from enqueue to
completion) against the operators the rank's main thread ran. On CPU + gloo nothing computes
while the main thread waits for a collective, so what overlaps is at most what gloo's threads
did while the main thread worked on: in practice exposed is nearly all of it (the README says
so); on GPUs the split is the point (seed 000, section 05: the fraction of communication
hidden by compute).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_bench.config.run import RunConfig
from fsdp_bench.job.measure.intervals import Interval, length, uncovered, union
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
    annotation: bool = False
    """A user annotation (record_function range), not work of its own."""


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


def _marked(events: Iterable[TimelineEvent], phase: str) -> list[Interval]:
    name = MARK_PREFIX + phase
    return [(e.start_us, e.end_us) for e in events if e.name == name and not e.on_device]


def breakdown(
    events: list[TimelineEvent], on_cuda: bool, phase_s: dict[str, float] | None = None
) -> StepBreakdown:
    """The step's phases and communication from its events (pure: tests hand it events).

    Phases are `phase_s` where given (on CUDA: `PhaseClock.seconds`, which has "step" too),
    else the CPU-side ranges of the step's marks; communication on CUDA from NCCL kernels
    against every other kernel, on CPU from the backend's work events against the main
    thread's operators."""
    comm, compute = _comm_and_compute(events, on_cuda)
    comm_spans = [(e.start_us, e.end_us) for e in comm]
    gathers = [
        (e.start_us, e.end_us)
        for e in sorted(comm, key=lambda e: e.start_us)
        if _ALL_GATHER.search(e.name)
    ]
    if phase_s is None:
        marks = {phase: _marked(events, phase) for phase in PHASES}
        step = union(i for spans in marks.values() for i in spans)
        phase_s = {phase: length(spans) / 1e6 for phase, spans in marks.items()}
        phase_s["step"] = (step[-1][1] - step[0][0]) / 1e6 if step else 0.0
    return StepBreakdown(
        step_s=phase_s["step"],
        forward_s=phase_s["forward"],
        backward_s=phase_s["backward"],
        optimizer_s=phase_s["optimizer"],
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
        kernels = [e for e in events if e.on_device and not e.annotation]
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
                          e.device_type != DeviceType.CPU,
                          bool(getattr(e, "is_user_annotation", False)))
            for e in profiler.events()
        ]  # fmt: skip
    return [
        TimelineEvent(e.name(), e.start_ns() / 1e3, e.end_ns() / 1e3, e.start_thread_id(),
                      e.device_type() != DeviceType.CPU, e.is_user_annotation())
        for e in raw()
    ]  # fmt: skip


_DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
_ANNOTATION_CATEGORIES = {"user_annotation", "gpu_user_annotation"}


def timeline_from_trace(path: Path) -> list[TimelineEvent]:
    """The events of a kept trace (`trace_file`, Chrome trace format as torch.profiler
    exports it), so that a step can be broken down again from its file: what the profiler
    gave live, read from the events' categories (`cat`) instead."""
    events = []
    for e in json.loads(path.read_text())["traceEvents"]:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        category = e.get("cat", "")
        thread = e.get("tid", 0)
        events.append(
            TimelineEvent(
                name=e.get("name", ""),
                start_us=float(e["ts"]),
                end_us=float(e["ts"]) + float(e["dur"]),
                thread=thread if isinstance(thread, int) else hash(thread),
                on_device=category in _DEVICE_CATEGORIES,
                annotation=category in _ANNOTATION_CATEGORIES,
            )
        )
    return events


def trace_file(run: RunConfig, results: Path, rank: int) -> Path | None:
    """Where a rank's trace goes with measure.trace (`traces/<run_id>/rank<r>.json` in the
    results folder); None without."""
    if not run.measure.trace:
        return None
    return results / "traces" / run.run_id / f"rank{rank}.json"


def _mark(phase: str) -> Any:
    return torch.profiler.record_function(MARK_PREFIX + phase)


@dataclass
class PhaseClock:
    """Marks each phase of a step (a `Mark`) and times it on the device: an event recorded on
    the current stream at its start and at its end. The step's kernels run on that stream in
    launch order, and FSDP2 and DDP make it wait for their communication streams before
    backward returns, so an interval spans the device work of its phase. Read after a
    synchronisation. `make_event` makes a timing event (`torch.cuda.Event`; tests pass their
    own)."""

    make_event: Callable[[], Any]
    spans: list[tuple[str, Any, Any]] = field(default_factory=list)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start, end = self.make_event(), self.make_event()
        with _mark(phase):  # the range stays in the trace, for people reading it
            start.record()
            try:
                yield
            finally:
                end.record()
        self.spans.append((phase, start, end))

    def seconds(self) -> dict[str, float]:
        """Each phase's seconds (all its spans, e.g. every micro-batch's forward) and the
        whole step's, from the first start to the last end."""
        found = dict.fromkeys(PHASES, 0.0)
        for phase, start, end in self.spans:
            found[phase] += start.elapsed_time(end) / 1e3  # milliseconds
        found["step"] = self.spans[0][1].elapsed_time(self.spans[-1][2]) / 1e3
        return found


def trace_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[Batch],
    run: RunConfig,
    trace_path: Path | None = None,
) -> StepBreakdown:
    """One untimed step under the profiler, its phases marked (on CUDA, timed by events);
    the trace written to `trace_path` (Chrome trace format, opens in Perfetto) when given."""
    from torch.profiler import ProfilerActivity, profile

    device = batches[0][0].device
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    clock = PhaseClock(lambda: torch.cuda.Event(enable_timing=True)) if on_cuda else None
    step = make_train_step(model, optimizer, batches, run, mark=clock or _mark)
    synchronize(device)
    with profile(activities=activities) as profiler:
        step()
        synchronize(device)
    if trace_path is not None:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(trace_path))
    return breakdown(timeline(profiler), on_cuda, clock.seconds() if clock else None)
