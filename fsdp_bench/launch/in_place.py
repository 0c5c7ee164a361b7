"""`fsdp-bench run`: measure a grid inside processes someone else started (torchrun on each
node, srun in an allocation), with the worker, records and failure notes of a sweep.

Every rank reads the grid and takes the runs of its shape (world size and nodes). Rank 0
decides the rest and tells the others, as only it writes to the results folder: it holds
the folder's lock, turns what an earlier incarnation left in flight into records (a rank's
note of an OOM or an error, after torchrun restarted the group), and lists what is left to
measure. There is no driver here to cancel a stuck job: each rank's watchdog ends a hang
(`launcher.collective_timeout_s`) and torchrun's restarts, or the next invocation, go on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from fsdp_bench.config.grid import SweepSpec, expand
from fsdp_bench.config.grid_settings import MemoryConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.errors import ConfigError, ResultsError
from fsdp_bench.job.failures import handle_scheduler_signals
from fsdp_bench.job.rendezvous import RankInfo, pick_device, rank_info
from fsdp_bench.job.spec import JobSpec
from fsdp_bench.job.worker import init_job_group, run_job
from fsdp_bench.launch.verdicts import classify_failure, read_notes, unmeasured_record
from fsdp_bench.memory.calibration import calibration
from fsdp_bench.memory.estimate import cached_estimates, target_device
from fsdp_bench.memory.model_check import run_flops
from fsdp_bench.store import EstimatedPeaks, ResultStore, now_iso

LOCK_NAME = "run.lock"
_EXPLAINED = ("oom", "error", "timeout")


@dataclass(frozen=True)
class InPlaceOptions:
    results_dir: Path
    verify: bool = False
    only: tuple[str, ...] = ()
    """Run ids to measure (default: every run of this shape)."""


@dataclass(frozen=True)
class InPlaceOutcome:
    rank: int
    run_ids: list[str]
    """Every run of this group's shape, recorded now or before."""


def run_in_place(spec: SweepSpec, options: InPlaceOptions) -> InPlaceOutcome:
    """Measure this process group's share of the grid (what is not recorded yet)."""
    info = rank_info()
    runs = _runs_of_shape(spec, info, options.only)
    store = ResultStore(options.results_dir)
    launcher = spec.launcher
    device_type = target_device(launcher)
    for run in runs:
        run.check_device(device_type)
    estimates: dict[str, EstimatedPeaks] = {}
    if info.rank == 0:  # the one that writes the records
        store.root.mkdir(parents=True, exist_ok=True)
        store.save_grid(spec.source)
        estimates = _cached_estimates(runs, store, device_type, spec.memory)
    job = JobSpec(
        runs=tuple(runs),
        results_dir=str(store.root.resolve()),
        device=launcher.job_device,
        cpu_threads_per_rank=launcher.cpu_threads_per_rank,
        collective_timeout_s=launcher.collective_timeout_s,
        verify=options.verify,
        flops=run_flops(runs, in_this_process=True),
        estimates=estimates,
    )
    # The group is needed to agree on the lock and the runs: made here, kept by the worker.
    handle_scheduler_signals()
    init_job_group(job, info, pick_device(launcher.job_device, info.local_rank), store)
    decision: list[str | list[str] | None] = [None]
    if info.rank == 0:
        decision = [_take_lock(store.root) or _reconcile(runs, store, info, estimates)]
    dist.broadcast_object_list(decision, src=0)
    if isinstance(decision[0], str):
        dist.destroy_process_group()
        raise ResultsError(decision[0])
    todo = set(decision[0] or [])
    try:
        run_job(dataclasses.replace(job, runs=tuple(r for r in runs if r.run_id in todo)), info)
    finally:
        if info.rank == 0:
            (store.root / LOCK_NAME).unlink(missing_ok=True)
    return InPlaceOutcome(info.rank, [r.run_id for r in runs])


def _runs_of_shape(spec: SweepSpec, info: RankInfo, only: tuple[str, ...]) -> list[RunConfig]:
    """The grid's runs this group can measure; rank 0 says in one line what it leaves."""
    runs = [r for r in expand(spec).runs if not only or r.run_id in only]
    unknown = sorted(set(only) - {r.run_id for r in runs})
    if unknown:
        raise ConfigError(f"--only: run ids not in the grid: {', '.join(unknown)}")
    mine = [r for r in runs if (r.world_size, r.nodes) == (info.world_size, info.num_nodes)]
    if info.rank == 0:
        others: dict[tuple[int, int], int] = {}
        for run in runs:
            if run not in mine:
                others[(run.world_size, run.nodes)] = others.get((run.world_size, run.nodes), 0) + 1
        for (world_size, nodes), count in sorted(others.items()):
            print(f"fsdp-bench run: {count} runs need world size {world_size} on {nodes} "
                  "node(s): not run here", flush=True)  # fmt: skip
        print(f"fsdp-bench run: {len(mine)} runs at world size {info.world_size} on "
              f"{info.num_nodes} node(s), started by {info.launcher}", flush=True)  # fmt: skip
    return mine


def _take_lock(root: Path) -> str | None:
    """None when this process now holds the folder's lock; else why it cannot. A lock whose
    process is gone from this host (a restarted group's old rank 0) is taken over."""
    path = root / LOCK_NAME
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "since": now_iso()}
    for _ in range(2):
        try:
            with path.open("x") as handle:
                json.dump(mine, handle)
            return None
        except FileExistsError:
            try:
                held = json.loads(path.read_text())
            except (OSError, ValueError):
                held = {}
            if held.get("host") == mine["host"] and not _alive(int(held.get("pid", -1))):
                path.unlink(missing_ok=True)
                continue
            return (
                f"{root} is in use by another fsdp-bench run (host {held.get('host')}, pid "
                f"{held.get('pid')}, since {held.get('since')}): one invocation per results "
                f"folder at a time; if that process is gone, remove {path}"
            )
    return f"could not take the lock {path}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def _cached_estimates(
    runs: list[RunConfig], store: ResultStore, device_type: str, memory: MemoryConfig
) -> dict[str, EstimatedPeaks]:
    """Runs are not estimated here, where the allocation's time is for measuring: the records
    take the estimates `fsdp-bench estimate` left in the folder for this device, and rank 0
    says how many."""
    found = cached_estimates(runs, store.root / "estimates", device_type)
    if len(found) < len(runs):
        print(f"fsdp-bench run: {len(found)} of {len(runs)} runs have a memory estimate for "
              f"{device_type} in {store.root}; to add the others, run 'fsdp-bench estimate "
              f"GRID --results {store.root}' before launching (on a machine without GPUs, "
              "with launcher.device: cuda in the grid)", flush=True)  # fmt: skip
    known = calibration(memory, store)
    by_id = {run.run_id: run for run in runs}
    return {run_id: e.peaks(known, by_id[run_id], memory) for run_id, e in found.items()}


def _reconcile(
    runs: list[RunConfig], store: ResultStore, info: RankInfo, estimates: dict[str, EstimatedPeaks]
) -> list[str]:
    """What an earlier incarnation left in flight becomes a record when a rank said why (an
    OOM, an error, a timeout) or when torchrun restarted the group under it; an interrupted
    run is measured again. The run ids to measure."""
    todo = []
    for run in runs:
        if store.has(run.run_id):
            continue
        inflight = store.inflight(run.run_id)
        notes = read_notes(inflight) if inflight.exists() else []
        status = reason = ""
        if any(n["class"] in _EXPLAINED for n in notes):
            verdict = classify_failure(notes, "", "")
            status, reason = verdict.status, verdict.reason
        elif _restarted_under(inflight, info):
            seen = ", ".join(f"rank {n['rank']}: {n['class']}" for n in notes) or "no notes"
            status = "error"
            reason = (
                f"a rank ended without a report and torchrun restarted the group ({seen}; "
                "a crash, or a kill such as the host's OOM killer: see torchrun's log)"
            )
        if status:
            provenance = {"job_id": info.job_id, "attempt": info.attempt}
            peaks = estimates.get(run.run_id)
            store.record(unmeasured_record(run, status, reason, provenance, peaks))
            print(f"fsdp-bench run: {run.run_id} {status}: {reason}", flush=True)
        else:
            todo.append(run.run_id)
        shutil.rmtree(inflight, ignore_errors=True)
    return todo


def _restarted_under(inflight: Path, info: RankInfo) -> bool:
    """Whether an earlier attempt of this same torchrun invocation started the run. torchrun
    restarts a group after one of its workers failed, so a rank of this run ended, and had it
    said why there would be a note: measured again, it would crash every attempt until
    `--max-restarts` ran out, and the runs after it would never be measured. (Interruptions
    end the invocation instead: its next one, or a requeued srun step, measures again.)"""
    if info.launcher != "torchrun":
        return False
    try:
        started = json.loads((inflight / "started.json").read_text())
    except (OSError, ValueError):
        return False
    return started.get("job_id") == info.job_id and started.get("attempt", 0) < info.attempt
