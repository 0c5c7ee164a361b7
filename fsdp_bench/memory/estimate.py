"""Memory estimates for a grid's runs: analytic and simulated side by side, cached by run id,
computed in parallel; `device_memory` turns them into the figures the budget is judged on.

The simulated figures are what pruning trusts; the analytic one explains the tensors term by
term.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fsdp_bench._version import __version__
from fsdp_bench.config.grid_settings import MemoryConfig
from fsdp_bench.config.launcher import LauncherConfig
from fsdp_bench.config.run import RunConfig, alike_key
from fsdp_bench.memory.analytic import analytic_estimate
from fsdp_bench.memory.calibration import Calibration
from fsdp_bench.memory.device_memory import outside_terms_gib
from fsdp_bench.memory.model_check import source_digests
from fsdp_bench.memory.pool import in_subprocesses
from fsdp_bench.memory.prediction import Prediction, predict, record_peaks
from fsdp_bench.store import GIB, EstimatedPeaks, write_atomic

CACHE_VERSION = f"{__version__}/estimator-18"
"""Cached estimates are used only by the version that made them; the suffix counts changes of
the estimator within a release (2: CPU offload's host share apart; 3: DDP's gradients in its
buckets; 4: the model built for the run's device; 5: the caching allocator's figures; 6: the
practitioners' settings; 7: deep models' traces made from shallow ones; 10: tensor
parallelism, and a trace deepened where a rotary table had the size of a post-forward shard;
11: one step simulated, the second made from it, which the figures of the example grids
showed unchanged; 12: RMSNorm as CUDA's fused kernel keeps it, the torch version kept; 14:
each fake world on a thread of its own, float8 with tensor parallelism; 15: the compiled loss,
inductor's fusion of it modelled; 16: compiled blocks with tensor parallelism from the
partition, unless whole blocks are checkpointed; 17: a loss compiled on CUDA also simulated
eager, its interval's high end; 18: the temporaries DTensor makes inside its operators, such
as loss_parallel's, recorded, and the analytic figure's tensor-parallel terms to match)."""


def target_device(launcher: LauncherConfig) -> str:
    """The device type (cuda or cpu) a grid's runs will run on, which the estimate builds its
    models for: launcher.device, or for auto what the jobs will pick (on Slurm: GPUs
    requested or not; locally: whether this machine has CUDA; CUDA is not initialised)."""
    device = launcher.job_device
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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
    estimated_host_gib: float = 0.0
    """With CPU offload: the host memory the shards and optimizer state take (the estimate
    itself is the accelerator's share)."""
    analytic_lower_bound_gib: float | None = None
    """The seed's bound before activations: steady state + largest group + prefetch."""
    wall_s: float = 0.0
    error: str = ""
    """Why the simulation failed (the run is then neither pruned nor compared)."""
    model_source: str = ""
    """A user model's source digest when estimated: an edited model is estimated again."""
    device_type: str = "cpu"
    """The device the run was estimated for (`target_device`)."""
    estimated_allocated_gib: float | None = None
    estimated_reserved_gib: float | None = None
    """On CUDA: the caching allocator's peaks for the simulation's allocations (`allocator`)."""
    outside_terms_gib: dict[str, float] = field(default_factory=dict)
    """On CUDA: the default model of memory outside the allocator (`device_memory`)."""
    eager_loss_allocated_gib: float | None = None
    eager_loss_reserved_gib: float | None = None
    """On CUDA with train.compile_loss: the allocator's peaks with the loss eager, the high
    end of what the compiled loss may hold (`error_model.COMPILED_LOSS`)."""
    world_size: int = 1
    compiled: bool = False
    """train.compile or train.compile_loss is set: simulated from the partitioned graphs
    (`memory.compiled`)."""
    torch_version: str = ""
    """The torch the step was simulated with: what the real run is taken to use."""
    version: str = CACHE_VERSION

    @property
    def records_streams(self) -> bool:
        """Before torch 2.8 ProcessGroupNCCL recorded collectives' streams (`error_model`)."""
        major, _, rest = self.torch_version.partition(".")
        minor = rest.split(".")[0]
        return bool(major.isdigit() and minor.isdigit() and (int(major), int(minor)) < (2, 8))

    def predict(self, known: Calibration, run: RunConfig) -> Prediction:
        """The three figures with the folder's correction, and their intervals."""
        return predict(
            run,
            self.estimated_peak_gib,
            self.estimated_allocated_gib,
            self.estimated_reserved_gib,
            self.outside_terms_gib,
            known,
            records_streams=self.records_streams,
            eager_loss_gib=self.eager_loss_gib,
        )

    @property
    def eager_loss_gib(self) -> tuple[float, float] | None:
        """(allocated, reserved) with the loss eager, where simulated."""
        allocated, reserved = self.eager_loss_allocated_gib, self.eager_loss_reserved_gib
        return None if allocated is None or reserved is None else (allocated, reserved)

    def peaks(self, known: Calibration, run: RunConfig, memory: MemoryConfig) -> EstimatedPeaks:
        """What the run's record keeps of its estimate (`prediction.record_peaks`)."""
        raw = self.predict(known.uncorrected, run)
        decided = self.predict(known, run)
        return record_peaks(raw, decided, memory, self.estimated_peak_gib, self.analytic_peak_gib)


def estimate_run(run: RunConfig, device_type: str = "cpu") -> RunEstimate:
    """Both estimates of one run on `device_type` (runs in a pool worker)."""
    return estimate_alike([run], device_type)[0]


def estimate_alike(runs: list[RunConfig], device_type: str = "cpu") -> list[RunEstimate]:
    """`estimate_run` of runs alike but for their world size (`alike_key`), which share a
    simulation's check (`simulate_alike`); one that fails is estimated apart, to say which."""
    import torch

    from fsdp_bench.memory.simulate import (  # torch: only where it simulates
        SimulatedEstimate,
        simulate_alike,
    )

    estimates = [_analytic(run, device_type) for run in runs]
    # A loss compiled on a GPU is simulated with inductor's fusion as measured on CPU, not on
    # a GPU: the same steps with the loss eager, which it does not exceed, bound it.
    bound_loss = device_type == "cuda" and runs[0].train.compile_loss  # alike: all or none
    try:
        simulated = simulate_alike(runs, device_type=device_type)
        eager_loss: list[SimulatedEstimate | None] = [None] * len(runs)
        if bound_loss:
            eager_loss = [*simulate_alike([_loss_eager(r) for r in runs], device_type=device_type)]
    except Exception as err:  # an estimate that fails is reported, not fatal
        if len(runs) > 1:
            return [estimate_run(run, device_type) for run in runs]
        estimates[0].error = "".join(traceback.format_exception_only(type(err), err)).strip()
        return estimates
    for estimate, sim, eager in zip(estimates, simulated, eager_loss, strict=True):
        estimate.estimated_peak_gib = sim.peak_bytes / GIB
        if device_type == "cuda":
            estimate.estimated_allocated_gib = sim.allocated_bytes / GIB
            estimate.estimated_reserved_gib = sim.reserved_bytes / GIB
        if eager is not None:
            estimate.eager_loss_allocated_gib = eager.allocated_bytes / GIB
            estimate.eager_loss_reserved_gib = eager.reserved_bytes / GIB
        estimate.breakdown_gib = {k: v / GIB for k, v in sim.breakdown_bytes.items()}
        estimate.method = sim.method
        estimate.estimated_host_gib = sim.host_bytes / GIB
        estimate.wall_s = sim.wall_s
        estimate.torch_version = torch.__version__
    return estimates


def _loss_eager(run: RunConfig) -> RunConfig:
    return dataclasses.replace(run, train=dataclasses.replace(run.train, compile_loss=False))


def _analytic(run: RunConfig, device_type: str) -> RunEstimate:
    """A run's estimate before its simulation: the analytic figures and what lives outside
    the allocator."""
    analytic = analytic_estimate(run) if not run.model.is_user_model else None
    return RunEstimate(
        run_id=run.run_id,
        device_type=device_type,
        world_size=run.world_size,
        compiled=run.train.compiled,
        outside_terms_gib=outside_terms_gib(run, device_type),
        estimated_peak_gib=None,
        analytic_peak_gib=analytic.peak_bytes / GIB if analytic else None,
        analytic_terms_gib={k: v / GIB for k, v in analytic.terms.items()} if analytic else {},
        analytic_lower_bound_gib=analytic.lower_bound_bytes / GIB if analytic else None,
    )


def estimate_runs(
    runs: list[RunConfig],
    cache_dir: Path | None,
    *,
    device_type: str = "cpu",
    on_estimate: Callable[[RunEstimate], None] | None = None,
) -> dict[str, RunEstimate]:
    """Estimates of every run on `device_type` (`target_device`), from the cache where
    present, else simulated in parallel."""
    digests = source_digests(runs)  # the files as they are when estimated
    found = cached_estimates(runs, cache_dir, device_type, digests)
    missing = [run for run in runs if run.run_id not in found]
    name_of = {run.run_id: run.model.name for run in missing}
    for estimate in _compute(missing, device_type):
        estimate.model_source = digests[name_of[estimate.run_id]]
        found[estimate.run_id] = estimate
        if cache_dir is not None and not estimate.error:
            write_atomic(cache_dir / f"{estimate.run_id}.json", json.dumps(asdict(estimate)))
        if on_estimate is not None:
            on_estimate(estimate)
    return found


def cached_estimates(
    runs: list[RunConfig],
    cache_dir: Path | None,
    device_type: str,
    digests: dict[str, str] | None = None,
) -> dict[str, RunEstimate]:
    """The estimates of `runs` found in the cache that are still valid: made by this estimator
    for `device_type`, of the user's model as it is now (`digests`: `source_digests(runs)`,
    if already read)."""
    digests = source_digests(runs) if digests is None else digests
    found = {}
    for run in runs:
        cached = _read_cache(cache_dir, run.run_id)
        if (
            cached is not None
            and cached.device_type == device_type
            and cached.model_source == digests[run.model.name]
        ):
            found[run.run_id] = cached
    return found


def _compute(runs: list[RunConfig], device_type: str) -> Iterator[RunEstimate]:
    """Runs alike but for their world size together, the largest groups first; a user's
    models in fresh processes, which import their code as it is now."""
    estimate = functools.partial(estimate_alike, device_type=device_type)  # picklable
    for user_code in (False, True):
        groups: dict[str, list[RunConfig]] = {}
        for run in runs:
            if run.model.is_user_model == user_code:
                groups.setdefault(alike_key(run), []).append(run)
        items = sorted(groups.values(), key=len, reverse=True)
        for _, estimates in in_subprocesses(estimate, items, user_code=user_code):
            yield from estimates


def _read_cache(cache_dir: Path | None, run_id: str) -> RunEstimate | None:
    if cache_dir is None:
        return None
    path = cache_dir / f"{run_id}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("version") != CACHE_VERSION:  # the estimator may have changed
        return None
    try:
        return RunEstimate(**data)
    except TypeError:  # written by a version whose fields differ: estimate again
        return None
