"""Executors that start jobs (every rank runs `worker.run_job`) and report their states.

Local and cluster execution differ here and in `slurm.py`, nowhere else: the driver in
`sweep.py` submits `JobSpec`s and polls `SubmittedJob`s without knowing where they run.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import submitit

from fsdp_bench.errors import ConfigError
from fsdp_bench.launcher_config import LauncherConfig
from fsdp_bench.worker import JobSpec, run_job


class SubmittedJob(Protocol):
    job_id: str

    def cancel(self) -> None: ...

    def log_tail(self, rank: int, lines: int = 20) -> str: ...


class Launcher(Protocol):
    kind: str
    max_jobs_in_flight: int

    @property
    def max_array_size(self) -> int:
        """Most jobs one submission may hold (a job array)."""

    def check(self, world_size: int, nodes: int) -> None:
        """Reject a shape this launcher cannot run, before anything is submitted."""

    def submit(self, specs: list[JobSpec]) -> list[Any]:
        """Submit jobs of one shape (one job array where the launcher has them)."""

    def reattach(self, job_id: str) -> Any:
        """A handle on a job submitted by an earlier driver."""

    def poll(self, jobs: list[Any]) -> dict[str, str]:
        """State of each job: alive ones in ALIVE_STATES, ended ones their final state."""


# Job states in which a job still holds or waits for resources: squeue's, and RUNNING for
# local jobs (which end as ENDED).
ALIVE_STATES = frozenset(
    {
        "PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "COMPLETING",
        "CONFIGURING", "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED",
        "RESV_DEL_HOLD",
    }
)  # fmt: skip


@dataclass
class LocalJob:
    """A job on this machine: submitit's local controller process and its tasks (one per rank)."""

    job_id: str
    folder: Path
    handle: Any = None
    """submitit's LocalJob when this driver submitted it; None after a driver restart."""

    def alive(self) -> bool:
        if self.handle is not None:
            return not self.handle.done()
        return _controller_running(int(self.job_id), self.folder)

    def cancel(self) -> None:
        """SIGINT to the controller: it interrupts, then kills, every task."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(self.job_id), signal.SIGINT)

    def log_tail(self, rank: int, lines: int = 20) -> str:
        return tail(self.folder / f"{self.job_id}_{rank}_log.err", lines)


class LocalLauncher:
    """Runs each job on this machine with one process per rank (CPU + gloo, or GPUs + NCCL).

    One job at a time by default: jobs timed side by side on one machine measure each other.
    """

    kind = "local"
    max_array_size = 1

    def __init__(self, config: LauncherConfig, jobs_dir: Path) -> None:
        self.config = config
        self.folder = (jobs_dir / "submitit").absolute()
        self.max_jobs_in_flight = config.jobs_in_flight

    def check(self, world_size: int, nodes: int) -> None:
        if nodes != 1:
            raise ConfigError(
                f"processes_per_node: a run of {world_size} processes over {nodes} nodes needs "
                "a cluster; the local launcher runs on one node (set launcher.kind: slurm)"
            )
        if self._uses_cuda():
            import torch

            available = torch.cuda.device_count()
            if world_size > available:
                raise ConfigError(
                    f"world_size: {world_size} is not allowed; this machine has {available} GPUs "
                    "(one rank per GPU)"
                )

    def submit(self, specs: list[JobSpec]) -> list[LocalJob]:
        return [self._submit_one(spec) for spec in specs]

    def _submit_one(self, spec: JobSpec) -> LocalJob:
        world_size = spec.runs[0].world_size
        executor = submitit.LocalExecutor(folder=self.folder)
        executor.update_parameters(
            tasks_per_node=world_size,
            nodes=1,
            timeout_min=self.config.timeout_min,
            gpus_per_node=world_size if self._uses_cuda() else 0,
        )
        handle = executor.submit(run_job, spec)
        return LocalJob(job_id=str(handle.job_id), folder=self.folder, handle=handle)

    def reattach(self, job_id: str) -> LocalJob:
        return LocalJob(job_id=job_id, folder=self.folder)

    def poll(self, jobs: list[LocalJob]) -> dict[str, str]:
        return {job.job_id: "RUNNING" if job.alive() else "ENDED" for job in jobs}

    def _uses_cuda(self) -> bool:
        if self.config.device == "cuda":
            return True
        if self.config.device == "cpu":
            return False
        import torch

        return torch.cuda.is_available()


def make_launcher(config: LauncherConfig, jobs_dir: Path) -> Launcher:
    match config.kind:
        case "local":
            return LocalLauncher(config, jobs_dir)
        case "slurm":
            from fsdp_bench.slurm import SlurmLauncher

            return SlurmLauncher(config, jobs_dir)
        case _:
            raise ConfigError(f"launcher.kind: {config.kind!r} is not supported")


def _controller_running(pid: int, folder: Path) -> bool:
    """Is `pid` a live submitit controller of our folder (not a recycled pid, not a zombie)?"""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"submitit.local._local" in cmdline and str(folder).encode() in cmdline


def tail(path: Path, lines: int) -> str:
    """The last lines of a log file ('' when it does not exist)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
