"""What runs on every rank of a job, with torch and submitit only: the models, their
parallelisation (FSDP2 or DDP), the timed training step, what a run measures (collectives,
memory, timing, MFU), the parity check, the rendezvous and the worker that ties them up."""

from __future__ import annotations

from fsdp_bench.job.models import ModelBundle, build_model
from fsdp_bench.job.worker import JobSpec, run_job

__all__ = ["JobSpec", "ModelBundle", "build_model", "run_job"]
