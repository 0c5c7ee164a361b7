"""Which runs share a job: one shape (world size, nodes) per job, spread over the job slots."""

from __future__ import annotations

from fsdp_bench.config.launcher import LauncherConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.memory.estimate import target_device


def pack_runs(runs: list[RunConfig], launcher: LauncherConfig) -> list[list[RunConfig]]:
    """Runs of one shape (world size, nodes) share jobs, in first-appearance order.

    With launcher.max_runs_per_job unset, each shape's runs are spread evenly over the jobs
    that may be in flight: locally (one job at a time) all of them share one job.

    On CUDA each DDP run has a job of its own: its reducer's buckets stay allocated after the
    run is released (seen on an H200 with torch 2.11: 14.26 MiB after a DDP run of `small`,
    its fp32 parameters' size, allocated by the reducer's bucket rebuild; not on CPU), and a
    later run of the job would begin with them and count them in its peak."""
    alone = target_device(launcher) == "cuda"
    by_shape: dict[tuple[int, int], list[RunConfig]] = {}
    packs = []
    for run in runs:
        if alone and run.strategy == "ddp":
            packs.append([run])
        else:
            by_shape.setdefault(job_shape([run]), []).append(run)
    for same in by_shape.values():
        size = launcher.max_runs_per_job or -(-len(same) // launcher.jobs_in_flight)
        packs += [same[i : i + size] for i in range(0, len(same), size)]
    return packs


def job_shape(runs: list[RunConfig]) -> tuple[int, int]:
    return runs[0].world_size, runs[0].nodes
