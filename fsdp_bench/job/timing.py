"""How a run is timed: warm-up, one profiled untimed step, timed repeats between barriers.

Nothing but the training step runs inside a timed repeat. Each phase is armed on the rank's
watchdog with what it may take, so a hang ends as a `timeout` note within about
launcher.collective_timeout_s.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_bench.config.run import RunConfig
from fsdp_bench.job.measure import StepProfile
from fsdp_bench.job.watchdog import Watchdog

GRACE_S = 5.0
"""Added to every phase's allowance: where the backend raises its own timeout (gloo), its
message, which names the operation, comes first."""


@dataclass
class StepMeasurements:
    """What the measurement protocol gives back for one rank of one run."""

    warmup_s: float
    step_times_s: list[float]
    """Seconds per optimizer step, one entry per timed repeat."""
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
    step may take `timeout_s` (plus GRACE_S); a timed repeat that plus twice the slowest
    warm-up step's time for each of its steps.
    """
    arm = watchdog.arm if watchdog is not None else _no_watchdog
    timeout_s += GRACE_S
    settled = 2 if run.strategy == "ddp" else 1
    profile_first = run.measure.warmup_steps > settled
    warmup_s, slowest_s = _warm_up(
        step, run.measure.warmup_steps - profile_first, device, arm, timeout_s
    )
    arm("the profiled step", timeout_s)
    profiled = profile() if profile_first else None
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    before = _allocator_counts(device)
    steps = run.measure.timed_steps
    allowance_s = timeout_s + 2 * steps * slowest_s
    step_times = time_steps(
        step, run.measure.repeats, steps, device, lambda r: arm(f"timed repeat {r}", allowance_s)
    )
    after = _allocator_counts(device)
    allocated = torch.cuda.max_memory_allocated(device) if on_cuda else None
    reserved = torch.cuda.max_memory_reserved(device) if on_cuda else None
    if profiled is None:
        arm("the profiled step", timeout_s)
        steps_taken = run.measure.warmup_steps + run.measure.repeats * steps
        for _ in range(settled - steps_taken):
            step()
        profiled = profile()
    if watchdog is not None:
        watchdog.disarm()
    return StepMeasurements(
        warmup_s,
        step_times,
        profiled,
        allocated,
        reserved,
        num_alloc_retries=after[0] - before[0] if on_cuda else None,
        num_ooms=after[1] - before[1] if on_cuda else None,
        device_used_bytes=_device_used_bytes(device),
    )


def _warm_up(
    step: Callable[[], None],
    steps: int,
    device: torch.device,
    arm: Callable[[str, float], None],
    timeout_s: float,
) -> tuple[float, float]:
    """(seconds for all warm-up steps, the slowest one's), each step synchronised."""
    slowest_s = 0.0
    start = time.perf_counter()
    for index in range(steps):
        arm(f"warm-up step {index + 1}", timeout_s)
        began = time.perf_counter()
        step()
        synchronize(device)
        slowest_s = max(slowest_s, time.perf_counter() - began)
    return time.perf_counter() - start, slowest_s


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
    repeats: int,
    steps: int,
    device: torch.device,
    before_repeat: Callable[[int], None] | None = None,
) -> list[float]:
    """Seconds per optimizer step for each repeat; ranks start each repeat together.

    Python's garbage collector is off meanwhile (after one collection): a collection inside a
    timed step would be timed as the step's own work, on one rank and not the others."""
    times = []
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for repeat in range(repeats):
            if before_repeat is not None:
                before_repeat(repeat + 1)
            synchronize(device)
            dist.barrier()
            begin = time.perf_counter()
            for _ in range(steps):
                step()
            synchronize(device)
            times.append((time.perf_counter() - begin) / steps)
    finally:
        if was_enabled:
            gc.enable()
    return times


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class TimeSummary:
    """Per-step wall time over repeats: median and spread (seconds)."""

    median_s: float
    min_s: float
    max_s: float

    @property
    def spread_pct(self) -> float:
        """(max - min) / median, in percent: how much to trust a ranking by this time."""
        return 100.0 * (self.max_s - self.min_s) / self.median_s if self.median_s else 0.0


def summarize_times(step_times_s: list[float]) -> TimeSummary:
    return TimeSummary(
        median_s=statistics.median(step_times_s), min_s=min(step_times_s), max_s=max(step_times_s)
    )
