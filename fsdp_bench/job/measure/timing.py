"""How a run is timed: warm-up, one profiled untimed step, timed repeats between barriers.

Nothing but the training step runs inside a timed repeat; every step's time is kept. Each
phase is armed on the rank's watchdog with what it may take, so a hang ends as a `timeout` note
within about launcher.collective_timeout_s.
"""

from __future__ import annotations

import gc
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_bench.config.measure import MeasureConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.job.measure.profile import StepProfile
from fsdp_bench.job.training import synchronize
from fsdp_bench.job.watchdog import Watchdog
from fsdp_bench.stats import within_target

GRACE_S = 5.0
"""Added to every phase's allowance: where the backend raises its own timeout (gloo), its
message, which names the operation, comes first."""


@dataclass
class StepMeasurements:
    """What the measurement protocol gives back for one rank of one run."""

    warmup_s: float
    first_step_s: float
    """The first warm-up step alone (compilation happens in it, `train.compile`)."""
    step_times_s: list[float]
    """This rank's seconds of every timed optimizer step, repeat after repeat."""
    profile: StepProfile
    cuda_peak_allocated_bytes: int | None
    cuda_peak_reserved_bytes: int | None
    num_alloc_retries: int | None = None
    """cudaMalloc failures the caching allocator survived by freeing its cache and retrying,
    during the timed steps: a run that fits only this way is slow for that reason."""
    num_ooms: int | None = None
    device_used_bytes: int | None = None
    """Device memory in use right after the timed steps (total - free, from the driver): the
    allocator's reserve, which has not shrunk since the peak, plus what lives outside it
    (CUDA context, NCCL buffers, cuBLAS workspaces)."""


def measure_steps(
    step: Callable[[], None],
    profile: Callable[[], StepProfile],
    run: RunConfig,
    device: torch.device,
    watchdog: Watchdog | None = None,
    timeout_s: float = 300.0,
) -> StepMeasurements:
    """Warm-up steps, one profiled untimed step, then the timed repeats with nothing else in
    them; CUDA peaks cover the timed steps only.

    The profiled step is the last warm-up step when there are enough before it, otherwise it
    comes after the timed steps. Steps before it: one for the optimizer state to exist; two
    under DDP, which reallocates its gradient buckets in the second. A warm-up or profiled
    step may take `timeout_s` (plus GRACE_S); a timed repeat, each one a target adds included,
    that plus twice the slowest warm-up step's time for each of its steps.
    """
    arm = watchdog.arm if watchdog is not None else _no_watchdog
    timeout_s += GRACE_S
    settled = 2 if run.strategy == "ddp" else 1
    profile_first = run.measure.warmup_steps > settled
    warmup_s, first_s, slowest_s = _warm_up(
        step, run.measure.warmup_steps - profile_first, device, arm, timeout_s
    )
    arm("the profiled step", timeout_s)
    profiled = profile() if profile_first else None
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    before = _allocator_counts(device)
    allowance_s = timeout_s + 2 * run.measure.timed_steps * slowest_s
    repeats = time_steps(step, run.measure, device, lambda r: arm(f"timed repeat {r}", allowance_s))
    step_times = [t for repeat in repeats for t in repeat]
    after = _allocator_counts(device)
    allocated = torch.cuda.max_memory_allocated(device) if on_cuda else None
    reserved = torch.cuda.max_memory_reserved(device) if on_cuda else None
    if profiled is None:
        arm("the profiled step", timeout_s)
        steps_taken = run.measure.warmup_steps + len(step_times)
        for _ in range(settled - steps_taken):
            step()
        profiled = profile()
    if watchdog is not None:
        watchdog.disarm()
    return StepMeasurements(
        warmup_s,
        first_s,
        step_times,
        profiled,
        allocated,
        reserved,
        num_alloc_retries=after[0] - before[0] if on_cuda else None,
        num_ooms=after[1] - before[1] if on_cuda else None,
        device_used_bytes=_device_used_bytes(device),
    )


def compile_time_s(run: RunConfig, measured: StepMeasurements) -> float | None:
    """What compilation added to the first warm-up step: its time less the median timed
    step's (None for an eager run). Includes what a first step costs in eager as well
    (optimizer state, allocator growth): small beside inductor's seconds."""
    if not run.train.compiled:
        return None
    return max(0.0, measured.first_step_s - statistics.median(measured.step_times_s))


def _warm_up(
    step: Callable[[], None],
    steps: int,
    device: torch.device,
    arm: Callable[[str, float], None],
    timeout_s: float,
) -> tuple[float, float, float]:
    """(seconds for all warm-up steps, the first one's, the slowest one's), each step
    synchronised."""
    times_s = []
    start = time.perf_counter()
    for index in range(steps):
        arm(f"warm-up step {index + 1}", timeout_s)
        began = time.perf_counter()
        step()
        synchronize(device)
        times_s.append(time.perf_counter() - began)
    return time.perf_counter() - start, times_s[0], max(times_s)


def _device_used_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def _allocator_counts(device: torch.device) -> tuple[int, int]:
    """The caching allocator's cumulative (alloc retries, OOMs) on CUDA; zeros elsewhere."""
    if device.type != "cuda":
        return 0, 0
    stats = torch.cuda.memory_stats(device)
    return int(stats.get("num_alloc_retries", 0)), int(stats.get("num_ooms", 0))


def _no_watchdog(phase: str, allowance_s: float) -> None:
    return None


def time_steps(
    step: Callable[[], None],
    measure: MeasureConfig,
    device: torch.device,
    before_repeat: Callable[[int], None] | None = None,
) -> list[list[float]]:
    """Seconds of every timed step, per repeat (`repeat_until_tight`); ranks start each repeat
    together.

    Python's garbage collector is off meanwhile (after one collection): a collection inside a
    timed step would be timed as the step's own work, on one rank and not the others."""

    def one_repeat(index: int) -> list[float]:
        if before_repeat is not None:
            before_repeat(index)
        return time_repeat(step, measure.timed_steps, device)

    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        return repeat_until_tight(one_repeat, measure, lambda t: slowest_over_ranks(t, device))
    finally:
        if was_enabled:
            gc.enable()


def repeat_until_tight(
    time_repeat: Callable[[int], list[float]],
    measure: MeasureConfig,
    agree: Callable[[list[float]], list[float]],
) -> list[list[float]]:
    """This rank's step times per repeat: `measure.repeats` repeats, then, with a
    `target_ci_pct`, more until the 95% interval of the median step time is within the target
    (`stats.within_target`) or `measure.repeat_limit` repeats are done.

    `time_repeat(index)` times repeat `index` (from 1); `agree` turns its step times into the
    slowest rank's, the same on every rank. Every rank decides on those, so all stop after the
    same repeat: a rank that stopped while another went on would leave it waiting in a
    collective until the watchdog ends the run."""
    own: list[list[float]] = []
    slowest: list[float] = []
    target = measure.target_ci_pct
    while len(own) < measure.repeat_limit:
        times = time_repeat(len(own) + 1)
        own.append(times)
        if target is None:
            continue
        slowest += agree(times)
        if len(own) >= measure.repeats and within_target(slowest, target):
            break
    return own


def time_repeat(step: Callable[[], None], steps: int, device: torch.device) -> list[float]:
    """Seconds of each of `steps` consecutive steps, after a barrier. One clock reading at
    each boundary between steps, so the steps add up to the repeat's time.

    On CPU a step is done when `step()` returns (the optimizer waits for gloo). On CUDA the
    reading is an event recorded on the current stream between steps, read after one
    synchronisation at the end: the steps queue back to back as in training. A synchronisation
    after every step would instead let the GPU idle while the CPU starts the next step (its
    hooks, the first all-gather), a cost training does not pay and that weighs most on short
    steps. FSDP2 and DDP join their communication streams to the current stream before the
    optimizer steps, so an event after `step()` completes after all of the step's work."""
    on_cuda = device.type == "cuda"
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if on_cuda else []
    synchronize(device)
    dist.barrier()
    if not on_cuda:
        marks = [time.perf_counter()]
        for _ in range(steps):
            step()
            marks.append(time.perf_counter())
        return [end - begin for begin, end in itertools.pairwise(marks)]
    events[0].record()
    for index in range(steps):
        step()
        events[index + 1].record()
    synchronize(device)
    return [begin.elapsed_time(end) / 1e3 for begin, end in itertools.pairwise(events)]


def slowest_over_ranks(step_times_s: list[float], device: torch.device) -> list[float]:
    """Each step's time on the slowest rank, on every rank: one all-reduce of a few numbers
    between repeats, outside the timed region."""
    tensor = torch.tensor(step_times_s, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(t) for t in tensor.tolist()]
