"""The local launcher: each job runs on this machine, one process per rank, through submitit."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit

from fsdp_bench.config.launcher import LauncherConfig
from fsdp_bench.errors import ConfigError
from fsdp_bench.job.spec import JobSpec
from fsdp_bench.launch.base import tail
from fsdp_bench.memory.estimate import target_device


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
            if self.max_jobs_in_flight > 1:  # every local job's ranks take GPUs 0..W-1
                raise ConfigError(
                    f"launcher.max_jobs_in_flight (or search.parallel): "
                    f"{self.max_jobs_in_flight} is not allowed; local GPU jobs would share "
                    "GPUs 0.. and time each other: 1, or a Slurm cluster"
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
        from fsdp_bench.job.worker import run_job  # torch: only where a job is submitted

        with interruptible_children(), _output_to(self.folder / "controllers.log"):
            handle = executor.submit(run_job, spec)
        return LocalJob(job_id=str(handle.job_id), folder=self.folder, handle=handle)

    def reattach(self, job_id: str) -> LocalJob:
        return LocalJob(job_id=job_id, folder=self.folder)

    def poll(self, jobs: list[LocalJob]) -> dict[str, str]:
        return {job.job_id: "RUNNING" if job.alive() else "ENDED" for job in jobs}

    def other_jobs(self) -> list[int]:
        """Local jobs of other results folders running on this machine (their controllers'
        pids): not waited for (another user's sweep may run for hours), but said, since runs
        timed beside them are slower and recorded `contended`."""
        found = []
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"submitit.local._local" in cmdline and str(self.folder).encode() not in cmdline:
                found.append(int(entry.name))
        return sorted(found)

    def _uses_cuda(self) -> bool:
        return target_device(self.config) == "cuda"


@contextlib.contextmanager
def interruptible_children() -> Iterator[None]:
    """Processes started inside take SIGINT as Python does by default, also when this one
    ignores it (started with nohup or `&` from a script: the shell sets SIGINT to ignored, and
    children inherit that). Cancelling a local job is SIGINT to its controller; ignored, a
    hung rank would run until launcher.run_timeout_s."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """Processes started inside write their stdout and stderr to `path`: submitit's local
    controller says nothing a user needs on the terminal, and when a Ctrl-C (or a cancel)
    interrupts it, it prints a traceback there, past the sweep's own one line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with path.open("ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)


def _controller_running(pid: int, folder: Path) -> bool:
    """Is `pid` a live submitit controller of our folder (not a recycled pid, not a zombie)?"""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"submitit.local._local" in cmdline and str(folder).encode() in cmdline
