"""What decides an OOM on a GPU: the device's memory, not the tensors. Three figures per rank
from one estimate, and the budget judged on the last:

    allocated    the tensors, as the caching allocator books them (rounded, unsplit blocks),
                 with cuBLAS's workspaces: torch.cuda.max_memory_allocated
    reserved     the allocator's segments (`allocator.py` replays the simulation's allocations,
                 per stream): torch.cuda.max_memory_reserved
    device-used  reserved + what lives outside the allocator: the CUDA context and loaded
                 kernels, NCCL's buffers per communicator: what the card holds (total - free)

Outside the allocator, each term has a default model (below, with its sources); measured CUDA
runs in the results folder replace them (`Calibration`), and `memory.overhead_gib` overrides
them. Every prediction says where each term came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_bench.config.grid_settings import MemoryConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.store import EstimatedPeaks, ResultStore

CUDA_CONTEXT_GIB = 0.75
"""The CUDA context with lazily loaded kernel modules (CUDA >= 11.7, torch's default), once a
training step has loaded its kernels (cuBLAS, attention, NCCL's). Measured on an H200 (torch
2.11+cu130, driver 580; benchmarks/results/2026-12-04-h200-gpu-check.md): 0.61 GiB right after
the first tensor, and device-used minus peak reserved during the steps of 8 world-size-1 runs
1.29-1.31 GiB, of which NCCL's default group 0.545: about 0.75. Elsewhere 287 MB right after
the first tensor (pytorch/pytorch#86509), "around 400MB" (pytorch/pytorch#109888)."""

NCCL_COMMUNICATOR_GIB = 0.55
"""Device memory of one NCCL communicator: per channel, a ring's two connections each hold the
Simple (4 MiB, NCCL_BUFFSIZE), LL128 (~4.7 MiB) and LL (0.5 MiB) protocol buffers, ~10 MiB once
rounded to cuMem granularity (NCCL src/init.cc, src/include/device.h), and NCCL uses 16-32
channels between NVLink-connected GPUs: 0.3-0.6 GiB; measured 544-688 MB per process group on
4 A100s (an NVIDIA/nccl issue), and 0.545 GiB for the default group of ONE rank on an H200
(NCCL 2.28.9, after its first all-reduce: the GPU check's environment part). NVLS buffers
(H100/H200 NVSwitch nodes, ~0.25 GiB more) and tree connections are not counted. Created on
first use of a connection (NCCL_RUNTIME_CONNECT=1)."""

RESERVE_QUANTILE = 0.5
"""Measured reserved over estimated reserved: the median of the folder's CUDA runs."""
OUTSIDE_QUANTILE = 0.9
"""Measured device-used minus reserved: a high quantile, since it is a margin against OOM and
half the runs above it would be half the runs the budget lets through wrongly."""


def communicators(run: RunConfig) -> list[int]:
    """The sizes of the NCCL communicators a rank of the run's job uses: the default group
    (the job's own collectives; FSDP's 1-D mesh and DDP use it too), HSDP's shard and
    replicate groups, and the post-forward mesh of an integer `reshard_after_forward`
    (one per job). The default group counts at any size (one rank's held 0.545 GiB on an
    H200); further groups of one rank issue no collectives and are left out."""
    sizes = [run.world_size]
    shard = run.shard_group_size
    if run.strategy == "hsdp" or run.tp_size > 1:  # a group per dimension of the mesh
        sizes += reversed(run.mesh_shape)
    reshard = run.fsdp.reshard_after_forward
    if run.strategy != "ddp" and type(reshard) is int and 1 < reshard < shard:
        sizes.append(reshard)
    return sizes[:1] + [size for size in sizes[1:] if size > 1]


def outside_terms_gib(run: RunConfig, device_type: str) -> dict[str, float]:
    """The default model of device memory outside the allocator, by term (none on CPU)."""
    if device_type != "cuda":
        return {}
    return {
        "cuda_context": CUDA_CONTEXT_GIB,
        "nccl": NCCL_COMMUNICATOR_GIB * len(communicators(run)),
    }


@dataclass(frozen=True)
class Calibration:
    """What measured CUDA runs of the folder say about the terms the tensors do not show.

    `reserve_ratios`: measured peak reserved over the estimated reserved, per (device name,
    compiled or not): the estimate follows eager execution, and inductor's fusion frees
    intermediates, so compiled runs have ratios of their own; `outside_gaps_gib`: device
    memory in use at the end of the timed steps minus peak reserved, per (device name, world
    size). The run may land on any device measured: the largest value over devices is
    taken."""

    configured_outside_gib: float | None = None
    reserve_ratios: dict[tuple[str, bool], list[float]] = field(default_factory=dict)
    outside_gaps_gib: dict[tuple[str, int], list[float]] = field(default_factory=dict)

    @property
    def measured_compiled(self) -> bool:
        """Compiled CUDA runs have been measured: their own reserve ratio corrects the eager
        estimate, which is then no longer only an upper bound."""
        return any(compiled for _, compiled in self.reserve_ratios)

    def reserve_factor(self, compiled: bool = False) -> tuple[float, str]:
        ratios = [r for (_, kind), r in self.reserve_ratios.items() if kind == compiled]
        if not ratios:
            if compiled:
                return 1.0, "eager allocator model: an upper bound for a compiled run"
            return 1.0, "allocator model"
        factor = max(_quantile(r, RESERVE_QUANTILE) for r in ratios)
        count = sum(len(r) for r in ratios)
        kind = "compiled " if compiled else ""
        return factor, f"allocator model x {factor:.3f}, calibrated on {count} {kind}CUDA runs"

    def outside(self, world_size: int, default_gib: float) -> tuple[float, str]:
        if self.configured_outside_gib is not None:
            return self.configured_outside_gib, "configured (memory.overhead_gib)"
        here = {k: v for k, v in self.outside_gaps_gib.items() if k[1] == world_size}
        chosen = here or self.outside_gaps_gib
        if not chosen:
            return default_gib, "default model"
        by_device: dict[str, list[float]] = {}
        for (device, _), gaps in chosen.items():
            by_device.setdefault(device, []).extend(gaps)
        worst = max(_quantile(gaps, OUTSIDE_QUANTILE) for gaps in by_device.values())
        count = sum(len(g) for g in chosen.values())
        where = f"world size {world_size}" if here else "all world sizes"
        return max(0.0, worst), (
            f"calibrated: p{OUTSIDE_QUANTILE * 100:.0f} over {count} CUDA runs "
            f"({', '.join(sorted(by_device))}; {where})"
        )


def calibration(memory: MemoryConfig, store: ResultStore | None) -> Calibration:
    """The folder's measured CUDA runs, read once (see Calibration)."""
    ratios: dict[tuple[str, bool], list[float]] = {}
    gaps: dict[tuple[str, int], list[float]] = {}
    for result in store.results() if store is not None else []:
        if result.status != "ok" or not result.peak_reserved_gib:
            continue
        device = str(result.provenance.get("device_name", ""))
        compiled = result.config.get("train", {}).get("compile", "none") != "none"
        if result.estimated_reserved_gib:
            ratios.setdefault((device, compiled), []).append(
                result.peak_reserved_gib / result.estimated_reserved_gib
            )
        if result.device_used_peak_gib:
            key = (device, int(result.config["world_size"]))
            gaps.setdefault(key, []).append(result.device_used_peak_gib - result.peak_reserved_gib)
    return Calibration(memory.overhead_gib, ratios, gaps)


@dataclass(frozen=True)
class Prediction:
    """One rank's predicted memory (GiB): the three figures, the terms that make the last one
    and where each came from."""

    tensors_gib: float | None
    allocated_gib: float | None = None
    reserved_gib: float | None = None
    device_used_gib: float | None = None
    terms_gib: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    upper_bound: bool = False
    """A compiled run judged on the eager estimate before any compiled run was measured."""

    @property
    def peaks(self) -> dict[str, float | None]:
        return {
            "estimated_allocated_gib": self.allocated_gib,
            "estimated_reserved_gib": self.reserved_gib,
            "estimated_device_used_gib": self.device_used_gib,
        }


def predict(
    tensors_gib: float | None,
    allocated_gib: float | None,
    reserved_gib: float | None,
    outside_default_gib: dict[str, float],
    world_size: int,
    known: Calibration,
    compiled: bool = False,
) -> Prediction:
    """The figures from an estimate's tensors and allocator replay (None on CPU, where
    device-used is the tensors plus a configured overhead). For a `compiled` run the eager
    figures are an upper bound until compiled runs are measured in the folder."""
    if tensors_gib is None:
        return Prediction(None)
    if reserved_gib is None or allocated_gib is None:  # a CPU run: no allocator to model
        extra = known.configured_outside_gib
        if extra is None:
            return Prediction(tensors_gib, None, None, tensors_gib, {"tensors": tensors_gib})
        terms = {"tensors": tensors_gib, "outside": extra}
        sources = {"outside": "configured (memory.overhead_gib)"}
        return Prediction(tensors_gib, None, None, tensors_gib + extra, terms, sources, compiled)
    factor, reserve_source = known.reserve_factor(compiled)
    reserved = reserved_gib * factor
    outside, outside_source = known.outside(world_size, sum(outside_default_gib.values()))
    terms = {"tensors": tensors_gib, "allocator": reserved - tensors_gib}
    if outside_source == "default model":
        terms.update(outside_default_gib)
    else:
        terms["outside"] = outside
    return Prediction(
        tensors_gib,
        allocated_gib,
        reserved,
        reserved + outside,
        terms,
        {"reserved": reserve_source, "outside": outside_source},
        compiled and not known.measured_compiled,
    )


def predicted_oom(prediction: Prediction, memory: MemoryConfig) -> str:
    """Why the run cannot fit the budget, naming the terms, or '' when it fits (or cannot be
    judged)."""
    used = prediction.device_used_gib
    if memory.budget_gib is None or used is None:
        return ""
    if prediction.upper_bound and not memory.prune_compiled:
        return ""  # eager memory overstates a compiled run's: measure it instead
    if used + memory.margin_gib <= memory.budget_gib:
        return ""
    parts = " + ".join(f"{name} {value:.2f}" for name, value in prediction.terms_gib.items())
    sources = "; ".join(f"{k}: {v}" for k, v in prediction.sources.items())
    return (
        f"predicted_oom: device-used {used:.2f} GiB ({parts}; {sources}) + margin "
        f"{memory.margin_gib:.2f} > budget {memory.budget_gib:.2f} GiB per rank"
    )


def peaks(
    prediction: Prediction, estimated_peak_gib: float | None, analytic_peak_gib: float | None
) -> EstimatedPeaks:
    """What a run's record keeps of its estimate."""
    return EstimatedPeaks(estimated_peak_gib, analytic_peak_gib, **prediction.peaks)


def _quantile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default), without numpy."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
