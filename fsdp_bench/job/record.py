"""One run's record from every rank's measurements: rank 0 gathers them and writes the record.

Step time is the slowest rank's per timed step (a step ends when the last rank ends it), and
the run's step time their median, with its 95% interval (`fsdp_bench.stats`); memory is the
largest rank's; collectives and group sizes are rank 0's (all ranks issue the same).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import platform
import statistics
import subprocess
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fsdp_bench._version import __version__
from fsdp_bench.config.run import RunConfig
from fsdp_bench.config.schema import to_plain
from fsdp_bench.job.measure.flops import peak_flops
from fsdp_bench.job.measure.load import LoadSample, record_fields
from fsdp_bench.job.measure.step_trace import StepBreakdown
from fsdp_bench.job.rendezvous import RankInfo
from fsdp_bench.job.training import fp32_matmul_precision
from fsdp_bench.stats import TimeSummary, summarize_times
from fsdp_bench.store import GIB, EstimatedPeaks, Flops, RunResult, now_iso


@dataclass
class RankOutcome:
    """One rank's measurements of one run, gathered on rank 0 to make the record."""

    hostname: str
    step_times_s: list[float]
    """This rank's seconds of every timed step, in order (all ranks time as many)."""
    tracked_peak_bytes: int
    """On the run's device (a GPU's own, with CPU offload the host share is apart)."""
    breakdown_bytes: dict[str, int]
    counts: dict[str, Any]
    """CollectiveCounts as a dict."""
    largest_group_bytes: int
    num_groups: int
    num_params: int
    setup_s: float
    warmup_s: float
    compile_s: float | None = None
    cuda_peak_allocated_bytes: int | None = None
    cuda_peak_reserved_bytes: int | None = None
    cpu_allocator_peak_bytes: int | None = None
    """A compiled run on the CPU: the peak at the allocator (`allocator_peak`)."""
    allocated_at_start_bytes: int | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    device_used_bytes: int | None = None
    device_used_at_init_bytes: int | None = None
    """The job's, before any model (`worker.JobContext`)."""
    host_peak_bytes: int = 0
    device_index: int | None = None
    sdpa_backend: str | None = None
    parity: dict[str, Any] | None = None
    steps_per_round: list[int] | None = None
    """How many of step_times_s each pass (`measure.rounds`) timed, in order; None: one."""
    load: list[LoadSample] = field(default_factory=list)
    """The machine before the model was built and after the timed steps, every pass's."""
    checkpoint: dict[str, Any] | None = None
    """`checkpoint.CheckpointCost` as a dict (first pass, with measure.checkpoint)."""
    breakdown: dict[str, Any] | None = None
    """`step_trace.StepBreakdown` as a dict: the profiled step's phases and communication."""
    timeline: dict[str, Any] | None = None
    """`memory_timeline.MemoryTimeline` as a dict: memory over the tracked step."""


def pool_passes(passes: list[RankOutcome]) -> RankOutcome:
    """One rank's passes over a run (`measure.rounds`) as one outcome: every pass's step
    times in order, the worst memory and allocator figures, the first pass's parity check;
    what a pass costs to start (setup, warm-up) is one pass's, the slowest."""
    last = passes[-1]
    if len(passes) == 1:
        return last

    def worst(name: str) -> int | None:
        values = [getattr(p, name) for p in passes if getattr(p, name) is not None]
        return max(values) if values else None

    def total(name: str) -> int | None:
        values = [getattr(p, name) for p in passes if getattr(p, name) is not None]
        return sum(values) if values else None

    peak = max(passes, key=lambda p: p.tracked_peak_bytes)
    return dataclasses.replace(
        last,
        step_times_s=[t for p in passes for t in p.step_times_s],
        steps_per_round=[len(p.step_times_s) for p in passes],
        tracked_peak_bytes=peak.tracked_peak_bytes,
        breakdown_bytes=peak.breakdown_bytes,
        host_peak_bytes=max(p.host_peak_bytes for p in passes),
        setup_s=max(p.setup_s for p in passes),
        warmup_s=max(p.warmup_s for p in passes),
        compile_s=passes[0].compile_s,  # later passes may find inductor's cache warm
        cuda_peak_allocated_bytes=worst("cuda_peak_allocated_bytes"),
        cuda_peak_reserved_bytes=worst("cuda_peak_reserved_bytes"),
        cpu_allocator_peak_bytes=worst("cpu_allocator_peak_bytes"),
        allocated_at_start_bytes=worst("allocated_at_start_bytes"),
        device_used_bytes=worst("device_used_bytes"),
        num_alloc_retries=total("num_alloc_retries"),
        num_ooms=total("num_ooms"),
        parity=passes[0].parity,
        checkpoint=passes[0].checkpoint,
        load=[s for p in passes for s in p.load],
    )


@dataclass(frozen=True)
class RunContext:
    """What the record says about where and when the run happened."""

    device: torch.device
    info: RankInfo
    started_at: str
    wall_s: float
    peaks: EstimatedPeaks
    flops: Flops = field(default_factory=Flops)


def gather_result(run: RunConfig, outcome: RankOutcome, where: RunContext) -> RunResult | None:
    """All ranks send their outcome to rank 0, which builds the record (others get None)."""
    outcomes: list[RankOutcome | None] = [None] * where.info.world_size
    dist.all_gather_object(outcomes, outcome)
    if where.info.rank != 0:
        return None
    ranks = [o for o in outcomes if o is not None]
    return build_result(run, ranks, where, provenance(where, ranks))


def build_result(
    run: RunConfig, ranks: list[RankOutcome], where: RunContext, about: dict[str, Any]
) -> RunResult:
    """The record of a run that finished, from every rank's outcome (plain data, no torch)."""
    first = ranks[0]
    parity = first.parity
    return RunResult(
        run_id=run.run_id,
        status="ok",
        config=to_plain(run),
        reason=_problems(parity, first.checkpoint),
        **_throughput(run, ranks, where, str(about["device_name"])),
        **_memory(ranks, where.device.type == "cuda"),
        sdpa_backend=first.sdpa_backend,
        **where.peaks._asdict(),
        **_collectives(first),
        **_breakdown(first),
        memory_timeline=first.timeline,
        memory_peak_at=first.timeline["peak_at"] if first.timeline else None,
        **_parity(parity),
        **_checkpoint(ranks),
        **record_fields([s for o in ranks for s in o.load]),
        setup_s=max(o.setup_s for o in ranks),
        warmup_s=max(o.warmup_s for o in ranks),
        compile_s=max((o.compile_s for o in ranks if o.compile_s is not None), default=None),
        wall_s=where.wall_s,
        provenance=about,
    )


def _throughput(
    run: RunConfig, ranks: list[RankOutcome], where: RunContext, device_name: str
) -> dict[str, Any]:
    steps = len(ranks[0].step_times_s)
    slowest = [max(o.step_times_s[i] for o in ranks) for i in range(steps)]
    times = summarize_times(slowest)
    tokens_per_s = run.tokens_per_step / times.median_s
    flops_per_token = where.flops.flops_per_token
    tf32 = run.train.fp32_matmul == "tf32"
    on_cuda = where.device.type == "cuda"
    float8 = run.train.float8 != "none"  # against the bf16 peak, as torchtitan states it
    precision = "bf16" if float8 else run.fsdp.mixed_precision
    peak = peak_flops(device_name, precision, tf32) if on_cuda else None
    mfu = None
    if peak and flops_per_token:
        mfu = flops_per_token * tokens_per_s / run.world_size / peak.flop_s
    return {
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_rank": tokens_per_s / run.world_size,
        **_intervals(run, times),
        "step_time_s": times.median_s,
        "step_time_min_s": times.min_s,
        "step_time_max_s": times.max_s,
        "step_time_spread_pct": times.spread_pct,
        "step_times_s": slowest,
        "round_step_time_s": _round_medians(slowest, ranks[0].steps_per_round),
        "timed_repeats": steps // run.measure.timed_steps,
        "mfu": mfu,
        **where.flops._asdict(),
        "peak_flops_source": (
            f"{peak.source}{' (a float8 run, against the bf16 peak)' if float8 else ''}"
            if peak
            else None
        ),
        "timed_s": sum(slowest),
    }


def _round_medians(slowest: list[float], steps_per_round: list[int] | None) -> list[float] | None:
    """Each pass's median step time (slowest rank), in pass order: a drift of the machine
    shows as a trend; None for a run measured in one pass."""
    if not steps_per_round:
        return None
    bounds = list(itertools.accumulate(steps_per_round, initial=0))
    return [statistics.median(slowest[a:b]) for a, b in itertools.pairwise(bounds)]


def _intervals(run: RunConfig, times: TimeSummary) -> dict[str, Any]:
    """The median step time's 95% interval and the tokens/s it bounds (a longer step is
    fewer tokens/s); whether it met measure.target_ci_pct (None without a target)."""
    low, high = times.ci_low_s, times.ci_high_s
    target = run.measure.target_ci_pct
    return {
        "tokens_per_s_ci_low": run.tokens_per_step / high if high else None,
        "tokens_per_s_ci_high": run.tokens_per_step / low if low else None,
        "step_time_ci_low_s": low,
        "step_time_ci_high_s": high,
        "ci_converged": None if target is None else times.within(target),
    }


def _memory(ranks: list[RankOutcome], on_cuda: bool) -> dict[str, Any]:
    worst = max(ranks, key=lambda o: o.tracked_peak_bytes)
    tracked = worst.tracked_peak_bytes
    allocated = max(o.cuda_peak_allocated_bytes or 0 for o in ranks)
    reserved = max(o.cuda_peak_reserved_bytes or 0 for o in ranks)
    at_start = max(o.allocated_at_start_bytes or 0 for o in ranks)
    at_allocator = [o.cpu_allocator_peak_bytes for o in ranks if o.cpu_allocator_peak_bytes]
    if on_cuda:
        peak, source = allocated, "cuda_max_memory_allocated"
    elif at_allocator:  # compiled: inductor's buffers are not tensors the tracker sees
        peak, source = max(at_allocator), "cpu_allocator"
    else:
        peak, source = tracked, "tracked_tensors"
    return {
        "peak_memory_gib": peak / GIB,
        "peak_reserved_gib": reserved / GIB if on_cuda else None,
        "tracked_peak_gib": tracked / GIB,
        "host_peak_gib": max(o.host_peak_bytes for o in ranks) / GIB if on_cuda else None,
        "memory_breakdown_gib": {k: v / GIB for k, v in worst.breakdown_bytes.items()},
        "peak_memory_source": source,
        "allocated_at_start_gib": at_start / GIB if on_cuda else None,
        "device_used_peak_gib": (
            max(o.device_used_bytes or 0 for o in ranks) / GIB if on_cuda else None
        ),
        "device_used_at_init_gib": (
            max(o.device_used_at_init_bytes or 0 for o in ranks) / GIB if on_cuda else None
        ),
        "num_alloc_retries": sum(o.num_alloc_retries or 0 for o in ranks) if on_cuda else None,
        "num_ooms": sum(o.num_ooms or 0 for o in ranks) if on_cuda else None,
    }


def _collectives(first: RankOutcome) -> dict[str, Any]:
    counts = first.counts
    return {
        "all_gathers_per_step": counts["all_gathers"],
        "all_gather_bytes_per_step": counts["all_gather_bytes"],
        "reduce_scatters_per_step": counts["reduce_scatters"],
        "reduce_scatter_bytes_per_step": counts["reduce_scatter_bytes"],
        "all_reduces_per_step": counts["all_reduces"],
        "all_reduce_bytes_per_step": counts["all_reduce_bytes"],
        "all_gathers_before_compute": counts["all_gathers_before_compute"],
        "collectives_per_dimension": counts.get("per_dimension") or None,
        "largest_group_bytes": first.largest_group_bytes,
        "num_groups": first.num_groups,
        "num_params": first.num_params,
    }


def _breakdown(first: RankOutcome) -> dict[str, Any]:
    """Rank 0's profiled step: phases, communication, and the all-gathers' achieved
    bandwidth (output bytes over duration, each and together)."""
    if not first.breakdown:
        return {}
    found = StepBreakdown(**first.breakdown)
    sizes: list[int] = first.counts.get("all_gather_sizes_bytes", [])
    times = found.all_gather_s
    together_s = sum(times)
    per_group = None
    if len(sizes) == len(times) and all(t > 0 for t in times):
        per_group = [size / t / 1e9 for size, t in zip(sizes, times, strict=True)]
    return {
        "profiled_step_s": found.step_s,
        "forward_s": found.forward_s,
        "backward_s": found.backward_s,
        "optimizer_s": found.optimizer_s,
        "comm_s": found.comm_s,
        "exposed_comm_s": found.exposed_comm_s,
        "comm_hidden_pct": found.comm_hidden_pct,
        "all_gather_gb_s": sum(sizes) / together_s / 1e9 if sizes and together_s > 0 else None,
        "all_gather_group_gb_s": per_group,
        "all_gather_s": times,
        "all_gather_exposed_s": found.all_gather_exposed_s,
    }


def _parity(parity: dict[str, Any] | None) -> dict[str, Any]:
    if not parity:
        return {}
    return {
        "parity_ok": parity["ok"],
        "parity_grad_max_abs_diff": parity["grad_max_abs_diff"],
        "parity_param_max_abs_diff": parity["param_max_abs_diff"],
        "parity_scope": parity["scope"],
        "parity_fp32_matmul": parity.get("fp32_matmul_precision") or None,
    }


def _problems(parity: dict[str, Any] | None, checkpoint: dict[str, Any] | None) -> str:
    """What the checks found wrong in a run that still measured ok ("" when nothing)."""
    found = [parity["detail"]] if parity and not parity["ok"] else []
    if checkpoint and checkpoint.get("detail"):
        found.append(checkpoint["detail"])
    return "; ".join(found)


def _checkpoint(ranks: list[RankOutcome]) -> dict[str, Any]:
    """The slowest rank's save and load (each ends when the last rank's does)."""
    costs = [o.checkpoint for o in ranks if o.checkpoint]
    if not costs:
        return {}
    first = costs[0]
    timed = "save_s" in first
    return {
        "checkpoint_save_s": max(c["save_s"] for c in costs) if timed else None,
        "checkpoint_load_s": max(c["load_s"] for c in costs) if timed else None,
        "checkpoint_bytes": first.get("num_bytes"),
        "checkpoint_dir": first["folder"] if first.get("kept") else None,
        "checkpoint_restore_ok": first.get("restore_ok"),
        "checkpoint_reshard_ok": first.get("reshard_ok"),
    }


def provenance(where: RunContext, ranks: list[RankOutcome]) -> dict[str, Any]:
    on_cuda = where.device.type == "cuda"
    return {
        "hostnames": sorted({o.hostname for o in ranks}),
        "device": where.device.type,
        "device_name": device_name(where.device),
        "backend": dist.get_backend(),
        "num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "fsdp_bench_version": __version__,
        "python_version": platform.python_version(),
        "job_id": where.info.job_id,
        "attempt": where.info.attempt,
        "launcher": where.info.launcher,
        "started_at": where.started_at,
        "finished_at": now_iso(),
        "device_indices": [o.device_index for o in ranks],
        "cuda_version": torch.version.cuda if on_cuda else None,
        "nccl_version": nccl_version() if on_cuda else None,
        "driver_version": driver_version() if on_cuda else None,
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "fp32_matmul_precision": fp32_matmul_precision(),
    }


@functools.cache
def nccl_version() -> str | None:
    try:
        return ".".join(str(part) for part in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        return None


@functools.cache
def driver_version() -> str | None:
    """The NVIDIA driver, from nvidia-smi (torch does not expose it); asked once a process,
    not once a run."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.splitlines()[0].strip() if done.stdout.strip() else None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()
