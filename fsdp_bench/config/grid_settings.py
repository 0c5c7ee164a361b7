"""Settings of a whole grid rather than of one run: the memory budget the runs are judged
on, and how `fsdp-bench search` samples the grid. No torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fsdp_bench.config.gpus import GpuName
from fsdp_bench.config.schema import at_least, bad_value

SamplerName = Literal["additive", "tpe", "random", "grid", "gp"]
"""The optuna samplers `search.sampler` allows."""


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """A per-rank memory budget: runs predicted not to fit (the low end of their interval
    over it) are recorded, not launched."""

    budget_gib: float | None = None
    """Memory one rank may use (a GPU's capacity, say 80); None: no pruning."""
    margin_gib: float = 0.0
    """Kept free below the budget, beyond what the estimate's interval covers."""
    overhead_gib: float | None = None
    """Device memory outside the caching allocator per rank (CUDA context, NCCL buffers),
    added to the estimated reserved memory to give device-used; None: calibrated from the
    measured CUDA runs in the results folder, else the default model (`memory.device_memory`).
    On CPU, added to the tensors."""
    gpu: GpuName | None = None
    """The GPU the runs will get (A100, H100, H100-NVL, H200, GH200, B200, L40S): the CUDA
    context, cuBLAS's workspace and NVLS buffers differ by kind (`config.gpus`). None:
    unknown, and their intervals cover every kind; measured runs of the folder on other GPUs
    do not correct its estimates once it is set."""

    def __post_init__(self) -> None:
        for key in ("budget_gib", "overhead_gib"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise bad_value(key, value, "expected a number > 0 (GiB)")
        if not self.margin_gib >= 0:
            raise bad_value("margin_gib", self.margin_gib, "expected a number >= 0 (GiB)")


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """`fsdp-bench search`: optuna samples the grid's axes instead of enumerating them."""

    metric: str = "tokens_per_s"
    """A numeric results column to optimise (tokens_per_s, mfu, step_time_s, ...)."""
    direction: Literal["maximize", "minimize"] = "maximize"
    trials: int = 20
    """Runs the search launches (a rerun with more continues it); points answered without a
    launch (predicted over budget, recorded already, excluded) do not count."""
    parallel: int = 1
    """Trials in flight at once on the launcher."""
    sampler: SamplerName | None = None
    """None: `additive` with one objective, `tpe` with two (`sampler_name`)."""
    seed: int | None = None
    multi_objective: bool = False
    """Optimise the metric and peak memory together; report the Pareto front."""
    confirm_top_k: int = 3
    """After the trials, measure the k best feasible configurations again, interleaved, and
    name the winner with its interval (or a tie): one trial each is a single sample, and the
    best of many noisy samples is biased towards luck. 0: no confirmation. Only with the
    metric tokens_per_s and one objective (the interval is of tokens/s)."""
    confirm_rounds: int = 3
    """Passes of the confirmation job over its runs (`measure.rounds`): each candidate is
    timed this many times, alternating with the others of its shape (world size, nodes)."""

    @property
    def sampler_name(self) -> SamplerName:
        """The sampler the search uses: additive found the fastest fitting point most often
        on the replay tables (README, search); it ranks one metric, so two objectives get TPE."""
        if self.sampler is not None:
            return self.sampler
        return "tpe" if self.multi_objective else "additive"

    def __post_init__(self) -> None:
        at_least(self, "trials", 1)
        at_least(self, "parallel", 1)
        at_least(self, "confirm_top_k", 0)
        at_least(self, "confirm_rounds", 2)
