"""Slurm: submit jobs (arrays of same-shape jobs) through submitit, and read their states.

One `squeue` call per poll tells which jobs are alive; `sacct` gives the final state of the
ones that ended (TIMEOUT, CANCELLED, OUT_OF_MEMORY, NODE_FAIL, PREEMPTED, ...), which the
driver turns into the run's record.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import JobPaths

from fsdp_bench.config.launcher import LauncherConfig
from fsdp_bench.errors import LaunchError, one_line
from fsdp_bench.job.spec import JobSpec
from fsdp_bench.launch.base import tail

COMMAND_TIMEOUT_S = 60


@dataclass
class SlurmJob:
    job_id: str
    """`123`, or `123_4` for task 4 of an array."""
    folder: Path

    def cancel(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run(["scancel", self.job_id], timeout=COMMAND_TIMEOUT_S, check=False)

    def log_tail(self, rank: int, lines: int = 20) -> str:
        return tail(JobPaths(self.folder, self.job_id, rank).stderr, lines)


class SlurmLauncher:
    """Jobs on a Slurm cluster: a run of world size W gets W / processes_per_node nodes."""

    kind = "slurm"

    def __init__(self, config: LauncherConfig, jobs_dir: Path) -> None:
        self.config = config
        self.folder = (jobs_dir / "submitit").absolute()
        self.max_jobs_in_flight = config.jobs_in_flight
        self._max_array: int | None = config.max_array_size

    def check(self, world_size: int, nodes: int) -> None:
        """sbatch must exist; the request itself is checked by Slurm at submission."""
        try:
            subprocess.run(
                ["sbatch", "--version"], capture_output=True, timeout=COMMAND_TIMEOUT_S, check=True
            )
        except (OSError, subprocess.SubprocessError) as err:
            raise LaunchError(f"launcher.kind slurm: cannot run sbatch ({err})") from None

    @property
    def max_array_size(self) -> int:
        if self._max_array is None:
            self._max_array = cluster_max_array_size()
        return self._max_array

    def submit(self, specs: list[JobSpec]) -> list[SlurmJob]:
        """Jobs of one shape; several go out as one job array (callers split at max_array_size)."""
        from fsdp_bench.job.worker import run_job  # torch: only where a job is submitted

        executor = self.executor(specs[0])
        try:
            if len(specs) == 1:
                handles = [executor.submit(run_job, specs[0])]
            else:
                executor.update_parameters(array_parallelism=len(specs))
                handles = executor.map_array(run_job, specs)
        except Exception as err:  # submitit raises plain exceptions with sbatch's message
            raise LaunchError(f"sbatch refused the job: {one_line(err)}") from None
        return [SlurmJob(job_id=str(h.job_id), folder=self.folder) for h in handles]

    def executor(self, spec: JobSpec) -> submitit.SlurmExecutor:
        """A submitit executor with every launcher setting for this job's shape."""
        run = spec.runs[0]
        c = self.config
        executor = submitit.SlurmExecutor(folder=self.folder, max_num_timeout=0)
        extra: dict[str, Any] = {"requeue": True, **c.sbatch_extra}
        parameters: dict[str, Any] = {
            "job_name": f"fsdp-bench-w{run.world_size}",
            "nodes": run.nodes,
            "ntasks_per_node": run.world_size // run.nodes,
            "time": max(1, round(c.timeout_min)),
            "additional_parameters": extra,
        }
        optional = {
            "partition": c.partition,
            "account": c.account,
            "qos": c.qos,
            "constraint": c.constraint,
            "cpus_per_task": c.cpus_per_task,
            "mem": c.mem,
            "exclusive": c.exclusive or None,
            "gpus_per_node": c.gpus_per_node or None,
            "setup": list(c.setup) or None,
            "srun_args": list(c.srun_extra) or None,
        }
        parameters.update({k: v for k, v in optional.items() if v is not None})
        executor.update_parameters(**parameters)
        return executor

    def sbatch_script(self, spec: JobSpec) -> str:
        """The batch script a job of this shape is submitted with (for review and tests)."""
        executor = self.executor(spec)
        return executor._make_submission_file_text(executor._submitit_command_str, "<uid>")

    def reattach(self, job_id: str) -> SlurmJob:
        return SlurmJob(job_id=job_id, folder=self.folder)

    def poll(self, jobs: list[SlurmJob]) -> dict[str, str]:
        """Each job's state: a squeue state while alive, the sacct state once ended."""
        if not jobs:
            return {}
        alive = squeue_states()
        states = {j.job_id: alive[j.job_id] for j in jobs if j.job_id in alive}
        ended = [j.job_id for j in jobs if j.job_id not in states]
        if ended:
            final = sacct_states(ended)
            # sacct can lag behind squeue by a few seconds: UNKNOWN until it answers.
            states.update({job_id: final.get(job_id, "UNKNOWN") for job_id in ended})
        return states


def squeue_states() -> dict[str, str]:
    """Alive jobs of this user: id -> state (array tasks one by one)."""
    output = _run(["squeue", "--me", "--noheader", "--array", "--format=%i|%T"])
    states = {}
    for line in output.splitlines():
        job_id, _, state = line.strip().partition("|")
        if job_id:
            states[job_id] = state
    return states


def sacct_states(job_ids: list[str]) -> dict[str, str]:
    """Final (or current) accounting state of jobs, e.g. CANCELLED, TIMEOUT, NODE_FAIL."""
    output = _run(
        ["sacct", "--noheader", "--parsable2", "--allocations", "--format=JobID,State",
         f"--jobs={','.join(job_ids)}"]
    )  # fmt: skip
    states = {}
    for line in output.splitlines():
        job_id, _, state = line.partition("|")
        if job_id:
            states[job_id] = state.split()[0] if state else "UNKNOWN"  # "CANCELLED by 0"
    return states


def cluster_max_array_size() -> int:
    """MaxArraySize from `scontrol show config` (Slurm's default is 1001)."""
    output = _run(["scontrol", "show", "config"])
    match = re.search(r"^MaxArraySize\s*=\s*(\d+)", output, re.MULTILINE)
    return int(match.group(1)) if match else 1001


def _run(command: list[str]) -> str:
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError) as err:
        raise LaunchError(f"{command[0]} failed: {err}") from None
    if done.returncode != 0:
        raise LaunchError(f"{' '.join(command[:2])} failed: {done.stderr.strip()[-500:]}")
    return done.stdout
