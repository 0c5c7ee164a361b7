"""The code every rank of a job runs: set up once, then execute the job's runs one by one.

A job holds runs of the same shape (world size and nodes), so process start, `import torch`
and the process group are paid once per job, not once per run. Between runs everything a run
built is released and peak statistics are reset, so a run measures the same alone or after
others.

When a rank fails, it writes a note saying why and ends its process (`failures.py`); the
driver turns the notes into the run's record and starts the remaining runs in a new job.

Imports: torch and submitit only (no optuna, pandas or seaborn), so what runs on a node is light.
"""

from __future__ import annotations

import gc
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_bench.config.run import RunConfig
from fsdp_bench.job.failures import (
    classify,
    fail,
    handle_scheduler_signals,
    inject_fault,
    mark_started,
    note_failure,
    slowed,
)
from fsdp_bench.job.measure.checkpoint_cost import checkpoint_cost
from fsdp_bench.job.measure.load import run_pids, sample
from fsdp_bench.job.measure.profile import StepProfile, profile_once, profile_step
from fsdp_bench.job.measure.step_trace import trace_file
from fsdp_bench.job.measure.timing import GRACE_S, StepMeasurements, compile_time_s, measure_steps
from fsdp_bench.job.model.zoo import build_model, check_initialised, sdpa_backend
from fsdp_bench.job.parallel.parallelize import ShardPlan, parallelize
from fsdp_bench.job.parity import verify_on_every_rank
from fsdp_bench.job.record import RankOutcome, RunContext, gather_result, pool_passes
from fsdp_bench.job.rendezvous import (
    RankInfo,
    barrier_and_destroy,
    cpus_for_rank,
    device_at_init,
    hostname,
    init_process_group,
    pick_device,
    rank_info,
)
from fsdp_bench.job.spec import JobSpec
from fsdp_bench.job.training import (
    build_optimizer,
    make_train_step,
    rank_batches,
    release,
    set_allocator,
    set_fp32_matmul,
)
from fsdp_bench.job.watchdog import Watchdog
from fsdp_bench.store import EstimatedPeaks, Flops, ResultStore, now_iso


@dataclass
class JobContext:
    info: RankInfo
    device: torch.device
    store: ResultStore
    verify: bool
    collective_timeout_s: float = 300.0
    watchdog: Watchdog | None = None
    """Armed while a run steps (`timing.measure_steps`) and while its results are gathered."""
    inflight: Path | None = None
    """The in-flight folder of the run being measured: where a hang's note goes."""
    meshes: dict[tuple[tuple[int, ...], tuple[str, ...]], DeviceMesh] = field(default_factory=dict)
    profiles: dict[str, StepProfile] = field(default_factory=dict)
    """run_id -> its first pass's profiled step: later passes (`measure.rounds`) take a plain
    step in its place, as the profile is the same and costs more than the step."""
    run_pids: frozenset[int] = frozenset()
    """This job's ranks on this host: what `load.sample` does not count as competition."""
    gpu_uuid: str | None = None
    """The rank's GPU as NVML knows it (`load.gpu_processes`); None on CPU."""
    device_used_at_init_bytes: int | None = None
    """CUDA: device memory in use once the process group had run its first collective,
    before any model: the CUDA context and NCCL's communicator and buffers."""

    def mesh(self, run: RunConfig) -> DeviceMesh:
        """The run's device mesh (`RunConfig.mesh_shape`): (world,) for FSDP, (replicas,
        shard group) for HSDP, (shard, tp) with tensor parallelism. Made once per job and
        shape."""
        key = (run.mesh_shape, run.mesh_dim_names)
        if key not in self.meshes:
            shape, names = key
            self.meshes[key] = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        return self.meshes[key]


def run_job(job: JobSpec, info: RankInfo | None = None) -> list[str]:
    """Entry point of every rank (a picklable top-level callable). Returns run ids recorded.

    The runs are measured in passes (`measure.rounds`): pass 1 measures every run once, pass
    2 every run with two rounds or more again, and so on; a run is recorded after its last
    pass, with the step times of all its passes pooled."""
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete")
    handle_scheduler_signals()
    context = _start(job, info or rank_info(), ResultStore(job.results_dir))
    todo = [run for run in job.runs if not _already_recorded(run, context)]
    passes: dict[str, list[MeasuredPass]] = {run.run_id: [] for run in todo}
    recorded = []
    for index in range(max((run.measure.rounds for run in todo), default=0)):
        for run in list(todo):
            if index >= run.measure.rounds:
                continue
            if index == 0 and _skip_asked(run, context):  # the driver's estimate changed
                todo.remove(run)
                continue
            done = passes[run.run_id]
            done.append(_measure_pass(run, context, index))
            if len(done) < run.measure.rounds:
                _between_passes(context)
            elif _record(run, job, context, done):
                recorded.append(run.run_id)
            release(context.device)
    barrier_and_destroy()
    return recorded


def _start(job: JobSpec, info: RankInfo, store: ResultStore) -> JobContext:
    """Device, threads and process group, once per job.

    A failure here fails every run of the job the same way (a rank without a GPU of its own,
    a rendezvous that never completes): each pending run gets this rank's note, so the driver
    records them all at once instead of retrying the job."""
    try:
        device = pick_device(job.device, info.local_rank)
        # On every device: with CPU offload the optimizer step runs on the host.
        torch.set_num_threads(job.cpu_threads_per_rank or cpus_for_rank(info))
        if not dist.is_initialized():  # `fsdp-bench run` has made the group already
            init_job_group(job, info, device, store)
        pids = run_pids(info.world_size)  # the first collective: NCCL's buffers exist now
        gpu_uuid, used_at_init = device_at_init(device)
    except BaseException as err:
        pending = [r for r in job.runs if not store.has(r.run_id)]
        if not pending or classify(err) == "interrupted":
            raise
        for run in pending[1:]:
            note_failure(store.inflight(run.run_id), info, err)
        first = store.inflight(pending[0].run_id)
        mark_started(first, info)  # lets the driver stop the ranks still waiting for this one
        fail(first, info, err)
    # What exists now lives for the whole job; later collections only scan what runs create,
    # which makes the collection between runs ~10x cheaper.
    gc.freeze()
    context = JobContext(
        info=info,
        device=device,
        store=store,
        verify=job.verify,
        collective_timeout_s=job.collective_timeout_s,
        run_pids=pids,
        gpu_uuid=gpu_uuid,
        device_used_at_init_bytes=used_at_init,
    )
    context.watchdog = Watchdog(lambda phase, waited_s: _hung(context, phase, waited_s))
    return context


def init_job_group(job: JobSpec, info: RankInfo, device: torch.device, store: ResultStore) -> None:
    """The job's process group. NCCL's own watchdog aborts the process without a word: it
    waits longer than this rank's watchdog, which writes the note first. gloo raises in the
    main thread, and its message, which names the operation, comes first."""
    nccl_later_s = 2 * GRACE_S if device.type == "cuda" else 0.0
    init_process_group(
        info,
        device,
        store.jobs_dir / "rendezvous",
        job.collective_timeout_s + nccl_later_s,
        cpu_collectives=job.verify and any(r.fsdp.cpu_offload for r in job.runs),
    )


def _hung(context: JobContext, phase: str, waited_s: float) -> None:
    """The watchdog's verdict: this rank made no progress in time (called from its thread)."""
    rank = context.info.rank
    err = TimeoutError(
        f"rank {rank} made no progress for {waited_s:.0f} s in {phase}: a collective is hung "
        "or another rank stopped (fsdp-bench watchdog; launcher.collective_timeout_s "
        f"{context.collective_timeout_s:g} s)"
    )
    if context.inflight is not None:
        fail(context.inflight, context.info, err)


@dataclass
class MeasuredPass:
    """One pass over a run on this rank: its outcome and when it happened."""

    outcome: RankOutcome
    started_at: str
    wall_s: float


def _measure_pass(run: RunConfig, context: JobContext, index: int) -> MeasuredPass:
    """Build, warm up and time `run` once; a failure leaves a note and ends the process.

    The run's in-flight folder exists only while one of its passes is measured (and while it
    is recorded): a job that fails later restarts the runs it had measured only in part."""
    info, store = context.info, context.store
    inflight = context.inflight = store.inflight(run.run_id)
    if info.rank == 0:
        mark_started(inflight, info)
        passes = run.measure.rounds
        said = f" (round {index + 1} of {passes})" if passes > 1 else ""
        print(f"fsdp-bench: run {run.run_id} started{said}", flush=True)
    started_at = now_iso()
    start = time.perf_counter()
    try:
        outcome = execute_run(run, context, first_pass=index == 0)
    except BaseException as err:
        fail(inflight, info, err)
    return MeasuredPass(outcome, started_at, time.perf_counter() - start)


def _between_passes(context: JobContext) -> None:
    if context.info.rank == 0 and context.inflight is not None:
        shutil.rmtree(context.inflight, ignore_errors=True)
    context.inflight = None


def _record(run: RunConfig, job: JobSpec, context: JobContext, passes: list[MeasuredPass]) -> bool:
    """Gather every rank's pooled passes on rank 0, which writes the record; a failure leaves
    a note and ends the process."""
    info, store = context.info, context.store
    inflight = store.inflight(run.run_id)
    try:
        where = RunContext(
            device=context.device,
            info=info,
            started_at=passes[0].started_at,
            wall_s=sum(p.wall_s for p in passes),
            peaks=job.estimates.get(run.run_id, EstimatedPeaks()),
            flops=job.flops.get(run.run_id, Flops()),
        )
        # Inside the handler: rank 0 failing here must end the job, not leave the other
        # ranks waiting in the next collective.
        if context.watchdog is not None:
            context.watchdog.arm("gathering the results", context.collective_timeout_s + GRACE_S)
        result = gather_result(run, pool_passes([p.outcome for p in passes]), where)
        if context.watchdog is not None:
            context.watchdog.disarm()
        if result is not None:
            store.record(result)
    except BaseException as err:
        fail(inflight, info, err)
    context.inflight = None
    context.profiles.pop(run.run_id, None)
    if result is None:
        return False
    shutil.rmtree(inflight, ignore_errors=True)
    return True


def execute_run(run: RunConfig, context: JobContext, first_pass: bool = True) -> RankOutcome:
    """Build, shard, warm up, profile one step (collectives, memory), time. Every rank.
    In a run's first pass only (`measure.rounds`): the checkpoint's cost last and then, once
    the run is released, the parity check (`--verify`), so that nothing the check leaves
    enters the run's figures (DDP's reducer leaves its buckets allocated on CUDA:
    `launch.packing.pack_runs`) and the check has the device to itself."""
    set_fp32_matmul(run, context.device)  # the parity check must run as the run does
    set_allocator(run, context.device)
    mesh = context.mesh(run)
    outcome = _measure_run(run, context, mesh, first_pass)
    if context.verify and first_pass:
        release(context.device)
        allowance_s = context.collective_timeout_s + GRACE_S
        outcome.parity = verify_on_every_rank(
            run, mesh, context.device, context.info, context.watchdog, allowance_s
        )
    return outcome


def _measure_run(
    run: RunConfig, context: JobContext, mesh: DeviceMesh, first_pass: bool
) -> RankOutcome:
    """`execute_run` but the parity check."""
    device, rank = context.device, context.info.rank
    on_cuda = device.type == "cuda"
    gpu, pids = context.gpu_uuid, context.run_pids
    load_start = sample("start", context.info.local_rank, pids, gpu)  # the ranks sleep in it
    allocated_at_start = torch.cuda.memory_allocated(device) if on_cuda else None
    start = time.perf_counter()
    torch.manual_seed(run.data.seed)
    bundle = build_model(run.model, device.type)
    model, plan = parallelize(bundle, run, mesh, device)
    check_initialised(run.model, model, context.info.world_size)
    optimizer = build_optimizer(model, run)
    batches = rank_batches(run, rank, bundle.vocab_size, device)
    step = slowed(run, rank, make_train_step(model, optimizer, batches, run), first_pass)
    setup_s = time.perf_counter() - start

    inject_fault(run, rank, device)
    trace = trace_file(run, context.store.root, rank)
    measured = measure_steps(
        step,
        profile_once(
            context.profiles,
            run.run_id,
            lambda: profile_step(model, optimizer, batches, run, trace, mesh=mesh),
            step,
        ),
        run,
        device,
        context.watchdog,
        context.collective_timeout_s,
    )
    load_end = sample("end", context.info.local_rank, pids, gpu)
    saved = None
    if run.measure.checkpoint and first_pass:
        if context.watchdog is not None:  # save, load and checks: three collectives' worth
            context.watchdog.arm("the checkpoint", 3 * context.collective_timeout_s + GRACE_S)
        saved = checkpoint_cost(run, model, optimizer, context.store.root, device, context.verify)
        if context.watchdog is not None:
            context.watchdog.disarm()
    return _outcome(
        measured,
        plan,
        device,
        setup_s=setup_s,
        compile_s=compile_time_s(run, measured),
        allocated_at_start_bytes=allocated_at_start,
        device_used_at_init_bytes=context.device_used_at_init_bytes,
        sdpa_backend=sdpa_backend(run, device),
        load=[load_start, load_end],
        checkpoint=saved,
    )


def _outcome(
    measured: StepMeasurements, plan: ShardPlan, device: torch.device, **extra: Any
) -> RankOutcome:
    """What the measurement protocol and the sharding plan give the record, plus `extra`."""
    memory, profile = measured.profile.memory, measured.profile
    return RankOutcome(
        hostname=hostname(),
        step_times_s=measured.step_times_s,
        tracked_peak_bytes=memory.peak_bytes,
        breakdown_bytes=memory.breakdown_bytes,
        counts=asdict(profile.counts),
        largest_group_bytes=plan.largest_group_bytes,
        num_groups=plan.num_groups,
        num_params=sum(g.num_params for g in plan.groups),
        warmup_s=measured.warmup_s,
        cuda_peak_allocated_bytes=measured.cuda_peak_allocated_bytes,
        cuda_peak_reserved_bytes=measured.cuda_peak_reserved_bytes,
        cpu_allocator_peak_bytes=memory.allocator_peak_bytes,
        num_alloc_retries=measured.num_alloc_retries,
        num_ooms=measured.num_ooms,
        device_used_bytes=measured.device_used_bytes,
        host_peak_bytes=memory.host_peak_bytes,
        device_index=device.index,
        breakdown=asdict(profile.breakdown) if profile.breakdown else None,
        timeline=asdict(profile.timeline) if profile.timeline else None,
        **extra,
    )


def _skip_asked(run: RunConfig, context: JobContext) -> bool:
    """Whether the driver asked, since the job started, not to launch this run (it no longer
    fits once runs measured before it corrected the estimate): rank 0 records it as asked
    (`ResultStore.take_skip`) and tells the others."""
    decision = [context.store.take_skip(run.run_id) if context.info.rank == 0 else None]
    dist.broadcast_object_list(decision, src=0)
    return bool(decision[0])


def _already_recorded(run: RunConfig, context: JobContext) -> bool:
    """Rank 0 decides (a requeued job skips what it finished) and tells the others."""
    decision = [context.store.has(run.run_id) if context.info.rank == 0 else None]
    dist.broadcast_object_list(decision, src=0)
    return bool(decision[0])
