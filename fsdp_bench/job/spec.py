"""What a job is given: its runs and where their records go. Apart from the worker so the
driver, which builds and pickles it, does not import torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_bench.config.run import RunConfig
from fsdp_bench.store import EstimatedPeaks, Flops


@dataclass(frozen=True)
class JobSpec:
    """Everything a job needs; pickled by submitit and shipped to every rank."""

    runs: tuple[RunConfig, ...]
    results_dir: str
    device: str = "auto"
    cpu_threads_per_rank: int | None = None
    collective_timeout_s: float = 300.0
    verify: bool = False
    estimates: dict[str, EstimatedPeaks] = field(default_factory=dict)
    """run_id -> the peaks estimated before launch, copied into each record."""
    flops: dict[str, Flops] = field(default_factory=dict)
    """run_id -> FLOPs per token (for MFU), found before launch."""
