"""Memory estimates for a grid's runs: analytic and simulated side by side, cached by run id,
computed in parallel, and judged against the memory budget.

The simulated figure is what pruning trusts; the analytic one explains it term by term.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fsdp_bench import __version__
from fsdp_bench.config.run import MemoryConfig, RunConfig
from fsdp_bench.memory.analytic import analytic_estimate
from fsdp_bench.store import GIB, EstimatedPeaks, ResultStore, write_atomic


@dataclass
class RunEstimate:
    """Predicted peak tensor memory of one rank (GiB), by both estimators."""

    run_id: str
    estimated_peak_gib: float | None
    """The simulated estimate: the worker's own step on fake tensors."""
    breakdown_gib: dict[str, float] = field(default_factory=dict)
    method: str = ""
    analytic_peak_gib: float | None = None
    analytic_terms_gib: dict[str, float] = field(default_factory=dict)
    analytic_lower_bound_gib: float | None = None
    """The seed's bound before activations: steady state + largest group + prefetch."""
    wall_s: float = 0.0
    error: str = ""
    """Why the simulation failed (the run is then neither pruned nor compared)."""
    version: str = __version__

    @property
    def peaks(self) -> EstimatedPeaks:
        return EstimatedPeaks(self.estimated_peak_gib, self.analytic_peak_gib)


def estimate_run(run: RunConfig) -> RunEstimate:
    """Both estimates of one run (runs in a pool worker)."""
    from fsdp_bench.memory.simulate import simulate  # torch: only in the process that simulates

    analytic = analytic_estimate(run) if not run.model.is_user_model else None
    estimate = RunEstimate(
        run_id=run.run_id,
        estimated_peak_gib=None,
        analytic_peak_gib=analytic.peak_bytes / GIB if analytic else None,
        analytic_terms_gib={k: v / GIB for k, v in analytic.terms.items()} if analytic else {},
        analytic_lower_bound_gib=analytic.lower_bound_bytes / GIB if analytic else None,
    )
    try:
        simulated = simulate(run)
    except Exception as err:  # an estimate that fails is reported, not fatal
        estimate.error = "".join(traceback.format_exception_only(type(err), err)).strip()
        return estimate
    estimate.estimated_peak_gib = simulated.peak_bytes / GIB
    estimate.breakdown_gib = {k: v / GIB for k, v in simulated.breakdown_bytes.items()}
    estimate.method = simulated.method
    estimate.wall_s = simulated.wall_s
    return estimate


def estimate_runs(
    runs: list[RunConfig],
    cache_dir: Path | None,
    *,
    workers: int | None = None,
    on_estimate: Callable[[RunEstimate], None] | None = None,
) -> dict[str, RunEstimate]:
    """Estimates of every run, from the cache where present, else simulated in parallel."""
    found: dict[str, RunEstimate] = {}
    missing = []
    for run in runs:
        cached = _read_cache(cache_dir, run.run_id)
        if cached is not None:
            found[run.run_id] = cached
        else:
            missing.append(run)
    for estimate in _compute(missing, workers):
        found[estimate.run_id] = estimate
        if cache_dir is not None and not estimate.error:
            write_atomic(cache_dir / f"{estimate.run_id}.json", json.dumps(asdict(estimate)))
        if on_estimate is not None:
            on_estimate(estimate)
    return found


def _compute(runs: list[RunConfig], workers: int | None) -> Any:
    if len(runs) <= 1:  # not worth a process start
        yield from (estimate_run(run) for run in runs)
        return
    count = min(workers or os.cpu_count() or 1, len(runs))
    context = multiprocessing.get_context("spawn")  # never fork a process that imported torch
    with ProcessPoolExecutor(max_workers=count, mp_context=context) as pool:
        futures = [pool.submit(estimate_run, run) for run in runs]
        for future in as_completed(futures):
            yield future.result()


def _read_cache(cache_dir: Path | None, run_id: str) -> RunEstimate | None:
    if cache_dir is None:
        return None
    path = cache_dir / f"{run_id}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("version") != __version__:  # the estimator may have changed
        return None
    try:
        return RunEstimate(**data)
    except TypeError:  # written by a version whose fields differ: estimate again
        return None


@dataclass(frozen=True)
class Overhead:
    gib: float
    source: str


def overhead(memory: MemoryConfig, store: ResultStore | None) -> Overhead:
    """Memory outside tensors: as configured, else calibrated on measured CUDA runs.

    Calibration: the median of (peak reserved - simulated estimate) over the folder's CUDA
    runs, i.e. what the allocator reserved beyond the tensors the estimate predicts. CUDA
    context and NCCL buffers are outside the allocator: set overhead_gib for those.
    """
    if memory.overhead_gib is not None:
        return Overhead(memory.overhead_gib, "configured")
    gaps = []
    for result in store.results() if store is not None else []:
        if result.status == "ok" and result.peak_reserved_gib and result.estimated_peak_gib:
            gaps.append(result.peak_reserved_gib - result.estimated_peak_gib)
    if gaps:
        return Overhead(max(0.0, statistics.median(gaps)), f"calibrated on {len(gaps)} CUDA runs")
    return Overhead(0.0, "none (no measured CUDA runs; set memory.overhead_gib)")


def predicted_oom(estimate: RunEstimate, memory: MemoryConfig, extra: Overhead) -> str:
    """Why the run cannot fit the budget, or '' when it fits (or cannot be judged)."""
    if memory.budget_gib is None or estimate.estimated_peak_gib is None:
        return ""
    total = estimate.estimated_peak_gib + extra.gib
    if total + memory.margin_gib <= memory.budget_gib:
        return ""
    return (
        f"predicted_oom: estimate {estimate.estimated_peak_gib:.2f} GiB + overhead {extra.gib:.2f} "
        f"+ margin {memory.margin_gib:.2f} > budget {memory.budget_gib:.2f} GiB per rank"
    )
