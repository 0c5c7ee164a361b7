"""Where and how jobs run (`LauncherConfig`): the local machine or a Slurm cluster.

Never part of a run's identity, except through `ranks_per_node`, which decides how many nodes
a run of a given world size spans when the run does not say.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from fsdp_bench.config.schema import at_least, bad_value

# Slurm names (partitions, accounts, QOS, features) and sbatch/srun arguments reach the
# scheduler quoted, but a value that could only be a typo or an injection is refused up front.
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.,:+-]+$")
_SLURM_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.,:+&|\[\]*()-]+$")
_SLURM_MEMORY = re.compile(r"^[0-9]+[KMGT]?$")
_SBATCH_OPTION = re.compile(r"^[a-z][a-z0-9-]*$")
_SAFE_ARGUMENT = re.compile(r"^[A-Za-z0-9_.,:=+/@%&|\[\]*()-]+$")
_SLURM_ONLY = (
    "cluster",
    "partition",
    "account",
    "qos",
    "constraint",
    "gpus_per_node",
    "processes_per_node",
    "cpus_per_task",
    "mem",
    "exclusive",
    "setup",
    "sbatch_extra",
    "srun_extra",
    "max_array_size",
    "requeue_limit",
)


@dataclass(frozen=True, kw_only=True)
class LauncherConfig:
    """Where and how jobs run; never part of a run's identity."""

    kind: Literal["local", "slurm"] = "local"
    cluster: str | None = None
    """Slurm: a profile, slurm/clusters/<cluster>.yaml, whose settings this section extends."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: locally, CUDA when available (one GPU per local rank, NCCL), else CPU (gloo); on
    Slurm, CUDA exactly when gpus_per_node asks for GPUs (a node's GPUs are only usable where
    the job requested them)."""
    cpu_threads_per_rank: int | None = None
    """torch threads per rank on CPU; None: the CPUs Slurm gave the task, else the machine's
    cores divided among the ranks on it."""
    collective_timeout_s: float = 300.0
    """A collective that waits longer fails the run as `timeout` (process-group timeout)."""
    run_timeout_s: float = 1800.0
    """Wall time one run may take before its job is stopped and the run recorded `timeout`."""
    timeout_min: float = 600.0
    """Wall time of one job (Slurm --time): several runs share a job."""
    max_runs_per_job: int | None = None
    """Runs of one shape per job; None spreads them over max_jobs_in_flight jobs (all in one
    job locally), so start-up is paid once per job while the slots stay busy."""
    max_jobs_in_flight: int | None = None
    """Jobs queued or running at once; None: 1 locally (timings must not share a machine),
    16 on Slurm."""
    poll_interval_s: float | None = None
    """How often the driver looks at its jobs; None: 0.2 s locally, 2 s on Slurm."""
    # Slurm only
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    """Node features, e.g. `h100&ib`."""
    gpus_per_node: int = 0
    processes_per_node: int | None = None
    """Ranks per node; None: gpus_per_node (1 on CPU nodes). A run of world size W gets
    W / processes_per_node nodes (one node with W ranks when W is smaller)."""
    cpus_per_task: int | None = None
    mem: str | None = None
    """Memory per node, e.g. `480G`; `0` asks for all of it."""
    exclusive: bool = False
    setup: tuple[str, ...] = ()
    """Shell lines run before the job's ranks start (module loads, exports), as written."""
    sbatch_extra: dict[str, Any] = field(default_factory=dict)
    """More #SBATCH options: {option: value}, e.g. {reservation: big, mail-type: FAIL}."""
    srun_extra: tuple[str, ...] = ()
    """More srun arguments, e.g. [--cpu-bind=cores]."""
    max_array_size: int | None = None
    """Largest job array to submit; None asks the cluster (MaxArraySize)."""
    requeue_limit: int = 2
    """Times a run interrupted by preemption or node failure goes back to the queue."""

    def __post_init__(self) -> None:
        for key in ("collective_timeout_s", "run_timeout_s", "timeout_min"):
            if not getattr(self, key) > 0:
                raise bad_value(key, getattr(self, key), "expected a number > 0")
        if self.poll_interval_s is not None and not self.poll_interval_s > 0:
            raise bad_value("poll_interval_s", self.poll_interval_s, "expected a number > 0")
        for key in (
            "cpu_threads_per_rank",
            "max_runs_per_job",
            "max_jobs_in_flight",
            "processes_per_node",
            "cpus_per_task",
            "max_array_size",
        ):
            if getattr(self, key) is not None:
                at_least(self, key, 1)
        at_least(self, "gpus_per_node", 0)
        at_least(self, "requeue_limit", 0)
        if self.kind == "local":
            for key in _SLURM_ONLY:
                if getattr(self, key) != _default(LauncherConfig, key):
                    raise bad_value(
                        key, getattr(self, key), "a Slurm setting: it needs launcher.kind: slurm"
                    )
            return
        self._check_slurm_values()
        self._check_slurm_gpus()

    def _check_slurm_gpus(self) -> None:
        """One GPU per rank, requested from Slurm: without --gpus-per-node a cluster that
        enforces GRES gives the job none, and it would run on CPU without a word."""
        if self.device == "cuda" and self.gpus_per_node == 0:
            raise bad_value(
                "gpus_per_node",
                0,
                "device: cuda on Slurm needs the GPUs requested: set gpus_per_node "
                "(one rank per GPU), or device: cpu",
            )
        ranks = self.processes_per_node
        if self.gpus_per_node and ranks is not None and ranks > self.gpus_per_node:
            raise bad_value(
                "processes_per_node",
                ranks,
                f"at most gpus_per_node ({self.gpus_per_node}): one rank per GPU",
            )

    @property
    def job_device(self) -> str:
        """The device jobs are told to use: on Slurm, `auto` is decided here, by whether GPUs
        are requested; locally each rank decides by what it sees."""
        if self.kind == "slurm" and self.device == "auto":
            return "cuda" if self.gpus_per_node else "cpu"
        return self.device

    def _check_slurm_values(self) -> None:
        for key in ("partition", "account", "qos"):
            value = getattr(self, key)
            if value is not None and not _SLURM_NAME.match(value):
                raise bad_value(key, value, "expected letters, digits and _ . , : + - only")
        if self.constraint is not None and not _SLURM_CONSTRAINT.match(self.constraint):
            raise bad_value(
                "constraint", self.constraint, "expected Slurm features joined by & | ,"
            )
        if self.mem is not None and not _SLURM_MEMORY.match(self.mem):
            raise bad_value("mem", self.mem, "expected a size such as 480G, 64000M or 0")
        for option, value in self.sbatch_extra.items():
            where = f"sbatch_extra.{option}"
            if not isinstance(option, str) or not _SBATCH_OPTION.match(option):
                raise bad_value(where, option, "expected an sbatch option name, e.g. mail-type")
            if not isinstance(value, (str, int, bool)) or (
                isinstance(value, str) and not _SAFE_ARGUMENT.match(value)
            ):
                raise bad_value(where, value, "expected a plain value (no spaces or shell syntax)")
        for index, argument in enumerate(self.srun_extra):
            if not _SAFE_ARGUMENT.match(argument):
                raise bad_value(
                    f"srun_extra[{index}]",
                    argument,
                    "expected one argument, e.g. --cpu-bind=cores",
                )
        for index, line in enumerate(self.setup):
            if "\n" in line or "\x00" in line:
                raise bad_value(f"setup[{index}]", line, "expected one shell line per list item")

    @property
    def jobs_in_flight(self) -> int:
        if self.max_jobs_in_flight is not None:
            return self.max_jobs_in_flight
        return 1 if self.kind == "local" else 16

    @property
    def poll_s(self) -> float:
        if self.poll_interval_s is not None:
            return self.poll_interval_s
        return 0.2 if self.kind == "local" else 2.0

    def ranks_per_node(self, world_size: int) -> int | None:
        """Processes per node for a run of `world_size` that did not choose (None: one node)."""
        if self.kind == "local":
            return None
        per_node = self.processes_per_node or self.gpus_per_node or 1
        return min(per_node, world_size)


def _default(cls: type, name: str) -> Any:
    spec = cls.__dataclass_fields__[name]  # type: ignore[attr-defined]
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
