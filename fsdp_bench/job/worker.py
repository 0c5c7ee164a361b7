"""The code every rank of a job runs: set up once, then execute the job's runs one by one.

A job holds runs of the same shape (world size and nodes), so process start, `import torch`
and the process group are paid once per job, not once per run. Between runs everything a run
built is released and peak statistics are reset, so a run measures the same alone or after
others.

When a rank fails, it writes a note saying why (OOM, error, collective timeout) and ends its
process: the rest of the job cannot trust a process group with a collective left half done,
and a fresh process is the only clean slate after an OOM. The driver turns the notes into the
run's record and starts the remaining runs in a new job.

Imports: torch and submitit only (no optuna, pandas or seaborn), so what runs on a node is light.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_bench.config.run import RunConfig
from fsdp_bench.job.measure import measure_steps, profile_step
from fsdp_bench.job.models import build_model
from fsdp_bench.job.parallelize import parallelize
from fsdp_bench.job.parity import check_parity
from fsdp_bench.job.record import RankOutcome, RunContext, gather_result
from fsdp_bench.job.rendezvous import (
    RankInfo,
    barrier_and_destroy,
    hostname,
    init_process_group,
    pick_device,
    rank_info,
)
from fsdp_bench.job.training import build_optimizer, make_train_step, rank_batches
from fsdp_bench.store import EstimatedPeaks, ResultStore, now_iso, write_atomic


@dataclass(frozen=True)
class JobSpec:
    """Everything a job needs; pickled by submitit and shipped to every rank."""

    runs: tuple[RunConfig, ...]
    results_dir: str
    device: str = "auto"
    cpu_threads_per_rank: int | None = None
    collective_timeout_s: float = 300.0
    verify: bool = False
    estimates: dict[str, EstimatedPeaks] = field(default_factory=dict)
    """run_id -> the peaks estimated before launch, copied into each record."""


@dataclass
class JobContext:
    info: RankInfo
    device: torch.device
    store: ResultStore
    verify: bool
    meshes: dict[tuple[int, ...], DeviceMesh] = field(default_factory=dict)

    def mesh(self, shape: tuple[int, ...]) -> DeviceMesh:
        """(world,) for FSDP; (replicas, shard group) for HSDP. Made once per job and shape."""
        if shape not in self.meshes:
            names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
            self.meshes[shape] = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        return self.meshes[shape]


class Terminated(BaseException):
    """The scheduler is ending the job (scancel, requeue, time limit): stop at once."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(f"the job was stopped by the scheduler ({signal.Signals(signum).name})")


def _note_warning(signum: int, frame: object) -> None:
    print("fsdp-bench: the scheduler warns that this job ends soon (USR2)", flush=True)


def run_job(job: JobSpec) -> list[str]:
    """Entry point of every rank (a picklable top-level callable). Returns run ids recorded."""
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete")
    # submitit ignores SIGTERM in jobs; here it means the allocation is going away, and the
    # run must not go on for the scheduler's kill delay, measuring nothing useful.
    signal.signal(signal.SIGTERM, _terminate)
    # submitit turns its early warning (USR2, 90 s before the time limit or at preemption)
    # into an exception unless the job checkpoints; jobs here are requeued whole by Slurm and
    # the scheduler's final state (TIMEOUT, PREEMPTED) classifies the run, so keep working.
    signal.signal(signal.SIGUSR2, _note_warning)
    info = rank_info()
    device = pick_device(job.device, info.local_rank)
    if device.type == "cpu":
        torch.set_num_threads(job.cpu_threads_per_rank or _cpus_for_rank(info))
    store = ResultStore(job.results_dir)
    init_process_group(info, device, store.jobs_dir / "rendezvous", job.collective_timeout_s)
    # What exists now lives for the whole job; later collections only scan what runs create,
    # which makes the collection between runs ~10x cheaper.
    gc.freeze()
    context = JobContext(info=info, device=device, store=store, verify=job.verify)
    recorded = []
    for run in job.runs:
        if _already_recorded(run, context):
            continue
        inflight = store.inflight(run.run_id)
        if info.rank == 0:
            _mark_started(inflight, info)
            print(f"fsdp-bench: run {run.run_id} started", flush=True)
        started_at = now_iso()
        start = time.perf_counter()
        try:
            outcome = execute_run(run, context)
        except BaseException as err:
            _fail(inflight, info, err)
        where = RunContext(
            device=device,
            info=info,
            started_at=started_at,
            wall_s=time.perf_counter() - start,
            peaks=job.estimates.get(run.run_id, EstimatedPeaks()),
        )
        result = gather_result(run, outcome, where)
        if result is not None:
            store.record(result)
            _remove(inflight)
            recorded.append(run.run_id)
        _release(device)
    barrier_and_destroy()
    return recorded


def _cpus_for_rank(info: RankInfo) -> int:
    """What Slurm gave this task, else this machine's cores shared by the ranks on it."""
    allotted = os.environ.get("SLURM_CPUS_PER_TASK")
    if allotted:
        return int(allotted)
    return max(1, (os.cpu_count() or 1) // (info.world_size // info.num_nodes))


def execute_run(run: RunConfig, context: JobContext) -> RankOutcome:
    """Build, shard, warm up, profile one step (collectives, memory), time. Every rank."""
    device, rank = context.device, context.info.rank
    mesh = context.mesh(run.mesh_shape)
    parity = None
    if context.verify:
        parity = asdict(check_parity(run, mesh, device, rank))
        _release(device)

    start = time.perf_counter()
    torch.manual_seed(run.data.seed)
    bundle = build_model(run.model)
    model, plan = parallelize(bundle, run, mesh, device)
    optimizer = build_optimizer(model, run)
    batches = rank_batches(run, rank, bundle.vocab_size, device)
    step = make_train_step(model, optimizer, batches, run)
    setup_s = time.perf_counter() - start

    _inject_fault(run, rank, device)
    measured = measure_steps(
        step, lambda: profile_step(model, optimizer, batches, run), run, device
    )
    memory = measured.profile.memory
    return RankOutcome(
        hostname=hostname(),
        step_times_s=measured.step_times_s,
        tracked_peak_bytes=memory.peak_bytes,
        breakdown_bytes=memory.breakdown_bytes,
        counts=asdict(measured.profile.counts),
        largest_group_bytes=plan.largest_group_bytes,
        num_groups=plan.num_groups,
        num_params=sum(g.num_params for g in plan.groups),
        flops_per_token=bundle.flops_per_token(run.data.seq_len)
        if bundle.flops_per_token
        else None,
        setup_s=setup_s,
        warmup_s=measured.warmup_s,
        cuda_peak_allocated_bytes=measured.cuda_peak_allocated_bytes,
        cuda_peak_reserved_bytes=measured.cuda_peak_reserved_bytes,
        parity=parity,
    )


def _already_recorded(run: RunConfig, context: JobContext) -> bool:
    """Rank 0 decides (a requeued job skips what it finished) and tells the others."""
    decision = [context.store.has(run.run_id) if context.info.rank == 0 else None]
    dist.broadcast_object_list(decision, src=0)
    return bool(decision[0])


def _inject_fault(run: RunConfig, rank: int, device: torch.device) -> None:
    if run.fault.kind == "none" or rank != run.fault.rank:
        return
    match run.fault.kind:
        case "oom":  # a real allocation failure: 256 TiB
            torch.empty(1 << 48, dtype=torch.uint8, device=device)
        case "error":
            raise RuntimeError(f"injected fault on rank {rank}")
        case "hang":
            while True:
                time.sleep(3600)
        case "exit":
            os._exit(17)
        case other:
            raise ValueError(f"fault.kind {other!r}")


def classify(err: BaseException) -> str:
    """oom, timeout, error; or peer / interrupted, which only echo another rank's failure."""
    if isinstance(err, (KeyboardInterrupt, SystemExit, Terminated)):
        return "interrupted"  # the driver or the scheduler stopped the job
    text = f"{type(err).__name__}: {err}"
    if isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in text:
        return "oom"
    lowered = text.lower()
    if "timed out" in lowered or "timeout" in lowered:
        return "timeout"
    peer_signs = (
        "connection closed by peer",
        "connection reset by peer",
        "broken pipe",
        "econnreset",
    )
    if any(sign in lowered for sign in peer_signs):
        return "peer"
    return "error"


def _fail(inflight: Path, info: RankInfo, err: BaseException) -> NoReturn:
    """Leave a note for the driver and end this process (see the module docstring)."""
    note = {
        "rank": info.rank,
        "attempt": info.attempt,
        "hostname": hostname(),
        "class": classify(err),
        "type": type(err).__name__,
        "message": _tail(traceback.format_exception_only(type(err), err)),
        "traceback": _tail(traceback.format_exception(type(err), err, err.__traceback__), 40),
        "at": now_iso(),
    }
    try:
        write_atomic(inflight / f"rank{info.rank}.json", json.dumps(note))
    finally:
        traceback.print_exception(type(err), err, err.__traceback__)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _mark_started(inflight: Path, info: RankInfo) -> None:
    marker = {"job_id": info.job_id, "attempt": info.attempt, "started_at": now_iso()}
    write_atomic(inflight / "started.json", json.dumps(marker))


def _remove(inflight: Path) -> None:
    shutil.rmtree(inflight, ignore_errors=True)


def _release(device: torch.device) -> None:
    """Free what the last run built, so the next one starts from the same state."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _tail(lines: list[str], keep: int = 5) -> str:
    return "".join(lines[-keep:]).strip()[-2000:]
