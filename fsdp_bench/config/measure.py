"""How a run is measured (`MeasureConfig`): warm-up, timed steps, and how many repeats of them.

Never part of what a configuration is (two folders measured differently still match), but part
of the run id when set: a run measured another way is another record.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_bench.config.schema import at_least, bad_value
from fsdp_bench.errors import CombinationError


@dataclass(frozen=True, kw_only=True)
class MeasureConfig:
    warmup_steps: int = 2
    """Untimed optimizer steps before the timed ones (lazy init, allocator, caches); the last
    one also counts collectives and tracks memory. At least 1: the first step initialises
    NCCL communicators, cuBLAS handles and FSDP2's lazy state, which must not be timed."""
    timed_steps: int = 5
    """Optimizer steps per timed repeat; every step's time is kept (the slowest rank's)."""
    repeats: int = 3
    """Timed repeats (at least, with a target); step time is the median over all their
    steps, with its 95% interval (`fsdp_bench.stats`)."""
    target_ci_pct: float | None = None
    """Time more repeats until the interval's half-width is within this percentage of the
    median (e.g. 2), or `max_repeats` is reached. None: exactly `repeats`, so that a job's
    wall time stays what its runs' steps make it."""
    max_repeats: int | None = None
    """With a target: the most repeats a run may take; None: three times `repeats`."""
    rounds: int = 1
    """Passes over a job's runs: each pass builds, warms up and times every run once (all
    runs, then all again), and a run's record pools the step times of all its passes. A
    slow drift of the machine then hits every configuration alike; each pass pays the run's
    setup and warm-up again."""
    trace: bool = False
    """Keep the profiled step's torch.profiler trace per rank under `traces/<run_id>/` in
    the results folder (Chrome trace format, opens in Perfetto); the breakdown it gives
    (forward, backward, optimizer, exposed communication) is recorded either way."""
    checkpoint: bool = False
    """After the timed steps (first pass only), save the sharded model and optimizer state
    with Distributed Checkpoint and load it back: `checkpoint_save_s`, `checkpoint_load_s`,
    `checkpoint_bytes` (`fsdp_bench.job.measure.checkpoint_cost`)."""
    checkpoint_dir: str | None = None
    """Where the checkpoint files go (a cluster's parallel file system, say), one folder per
    run; None: `checkpoints/` in the results folder."""
    keep_checkpoint: bool = False
    """Leave the files in place (they are removed after the load by default)."""

    def __post_init__(self) -> None:
        at_least(self, "warmup_steps", 1)
        at_least(self, "timed_steps", 1)
        at_least(self, "repeats", 1)
        at_least(self, "rounds", 1)
        target = self.target_ci_pct
        if target is not None and not target > 0:
            raise bad_value("target_ci_pct", target, "expected a number > 0 (percent) or null")
        for name in ("checkpoint_dir", "keep_checkpoint"):
            if getattr(self, name) not in (None, False) and not self.checkpoint:
                raise CombinationError(
                    name, getattr(self, name), "needs measure.checkpoint: true (it is false)"
                )
        if self.max_repeats is not None and self.max_repeats < self.repeats:
            raise CombinationError(
                "max_repeats",
                self.max_repeats,
                f"expected an integer >= repeats ({self.repeats}) or null (3 x repeats)",
            )

    @property
    def repeat_limit(self) -> int:
        """The most repeats a run takes: `repeats` without a target."""
        if self.target_ci_pct is None:
            return self.repeats
        return self.max_repeats if self.max_repeats is not None else 3 * self.repeats
