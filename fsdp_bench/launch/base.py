"""What the driver needs from a launcher, whatever runs the jobs: submit, poll, cancel, logs.

`local.py` and `slurm.py` are the two implementations; they differ there and nowhere else.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from fsdp_bench.job.spec import JobSpec


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
