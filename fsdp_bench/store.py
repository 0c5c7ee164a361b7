"""The results store: one JSON record per run, written atomically, read back as a DataFrame.

Layout of a results folder (`results/<grid name>/` by default):

    runs/<run_id>.json        one finished run (any status), written by temp file + rename
    inflight/<run_id>/        a run in progress: who started it, per-rank failure notes
    jobs/                     launcher state and submitit's job folders (logs)
    skip/<run_id>.json        a run its job should not start, and its record (`take_skip`)
    replaced/                 records set aside (--rerun, a run measured again)
    grid.yaml                 the grid as it was given, for provenance

One file per run: no two writers ever touch the same file, on one machine or over a shared
filesystem; a crash can lose at most the run that was executing."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from fsdp_bench.config.run import RunConfig
from fsdp_bench.config.schema import field_paths, to_plain

if TYPE_CHECKING:
    import pandas as pd

GIB = 1024**3
"""Bytes per GiB: records give memory in GiB, as `nvidia-smi` and allocator stats do."""

Status = Literal[
    "ok", "oom", "error", "timeout", "skipped", "cancelled", "preempted", "node_fail", "unstable"
]


@dataclass(kw_only=True)
class RunResult:
    """What one run produced: its configuration, status, metrics and provenance. Metrics are
    None where the run did not get that far or the device cannot give them (MFU on CPU)."""

    run_id: str
    status: Status
    config: dict[str, Any]
    reason: str = ""
    """Why a run is not ok: the failure's class and the tail of its error or log; for an
    `unstable` run, how its passes disagreed (`launch.stability`)."""
    # Throughput (timed steps only; each step's time is the slowest rank's)
    tokens_per_s: float | None = None
    """From the median step time."""
    tokens_per_s_per_rank: float | None = None
    tokens_per_s_ci_low: float | None = None
    tokens_per_s_ci_high: float | None = None
    """The 95% interval of tokens/s: the step time's interval, inverted."""
    step_time_s: float | None = None
    """The median over every timed step."""
    step_time_ci_low_s: float | None = None
    step_time_ci_high_s: float | None = None
    """The 95% interval of the median step time (`fsdp_bench.stats`: order statistics,
    distribution-free); None with fewer than 6 timed steps."""
    ci_converged: bool | None = None
    """With measure.target_ci_pct: whether the interval came within it before max_repeats."""
    step_time_min_s: float | None = None
    step_time_max_s: float | None = None
    step_time_spread_pct: float | None = None
    """(max - min) / median over every timed step, in percent."""
    step_times_s: list[float] | None = None
    """Every timed step's seconds (the slowest rank's), repeat after repeat."""
    round_step_time_s: list[float] | None = None
    """With measure.rounds > 1: each pass's median step time, in pass order (a drift of the
    machine over the job shows as a trend); step_times_s pools them all."""
    timed_repeats: int | None = None
    """Repeats of measure.timed_steps timed, over all passes (more than measure.repeats with
    a target, rounds x repeats with measure.rounds)."""
    mfu: float | None = None
    flops_per_token: float | None = None
    flops_source: str | None = None
    """How flops_per_token was found: the presets' formula, a model's own, or counted."""
    peak_flops_source: str | None = None
    """The row of the peak-FLOPS table MFU was computed against (device, dtype, TFLOPS)."""
    # Memory (max over ranks)
    peak_memory_gib: float | None = None
    """CUDA: max_memory_allocated over the timed steps. CPU: the tracked tensor peak, or for a
    compiled run the CPU allocator's in the profiled step (`peak_memory_source`)."""
    peak_reserved_gib: float | None = None
    device_used_peak_gib: float | None = None
    """CUDA: device memory in use after the timed steps (largest rank), from the driver: the
    allocator's reserve plus the CUDA context, NCCL buffers and workspaces outside it."""
    device_used_at_init_gib: float | None = None
    """CUDA: device memory in use after the job group's first collective, before any model
    (largest rank): the CUDA context and NCCL's buffers, outside the allocator."""
    tracked_peak_gib: float | None = None
    """Tracked tensors at the peak on the run's device; on CUDA without host memory."""
    host_peak_gib: float | None = None
    """CUDA: tracked tensors in host memory at their peak (CPU offload's shards and state)."""
    memory_breakdown_gib: dict[str, float] | None = None
    peak_memory_source: str | None = None
    estimated_peak_gib: float | None = None
    """The simulated estimate made before the run (tensors only, like tracked_peak_gib)."""
    analytic_peak_gib: float | None = None
    estimated_allocated_gib: float | None = None
    estimated_allocated_low_gib: float | None = None
    estimated_allocated_high_gib: float | None = None
    estimated_reserved_gib: float | None = None
    estimated_reserved_low_gib: float | None = None
    estimated_reserved_high_gib: float | None = None
    estimated_device_used_gib: float | None = None
    estimated_device_used_low_gib: float | None = None
    estimated_device_used_high_gib: float | None = None
    """On CUDA, made before the run as the models make them, never corrected, with their
    intervals (`memory.error_model`); on CPU device-used is the tensors (+ overhead_gib)."""
    estimate_fits: str | None = None
    """yes, no or maybe when the run was decided (`memory.prediction.fits`), with the
    folder's correction then (`memory.calibration.Correction`)."""
    estimate_correction: dict[str, Any] | None = None
    allocated_at_start_gib: float | None = None
    """CUDA memory allocated when the run began (largest rank): above zero, something of an
    earlier run of the job was still alive, and the run's peak includes it."""
    num_alloc_retries: int | None = None
    """cudaMalloc retries after freeing the allocator's cache, during the timed steps (sum
    over ranks): a run that fits only this way is slow for that reason."""
    num_ooms: int | None = None
    sdpa_backend: str | None = None
    """The attention kernel (FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION, MATH) the
    preset model's SDPA calls get; None for user models."""
    # Communication per optimizer step (rank 0; all ranks issue the same collectives)
    all_gathers_per_step: int | None = None
    all_gather_bytes_per_step: int | None = None
    reduce_scatters_per_step: int | None = None
    reduce_scatter_bytes_per_step: int | None = None
    all_reduces_per_step: int | None = None
    all_reduce_bytes_per_step: int | None = None
    all_gathers_before_compute: int | None = None
    """All-gathers issued before the first matmul of a step: 2 for block grouping with
    implicit prefetch (root, first block); explicit prefetch of depth d adds d."""
    collectives_per_dimension: dict[str, dict[str, int]] | None = None
    """The counts above per mesh dimension: {"shard": {"all_gathers": n, "all_gather_bytes":
    b, ...}, "tp": {...}}; FSDP2's on the shard dimension, tensor parallelism's on tp."""
    largest_group_bytes: int | None = None
    num_groups: int | None = None
    num_params: int | None = None
    # Correctness (only with --verify)
    parity_ok: bool | None = None
    parity_grad_max_abs_diff: float | None = None
    parity_param_max_abs_diff: float | None = None
    parity_scope: str | None = None
    """What was compared: "as run", or the scaled-down copy of a large model (its shape)."""
    parity_fp32_matmul: str | None = None
    """What fp32 matmuls ran as during the check (torch's float32 matmul precision: highest,
    high = TF32 on CUDA): the run's own `train.fp32_matmul`, or the check proves nothing."""
    # Where a step's time goes: rank 0's profiled step under torch.profiler (`step_trace`)
    profiled_step_s: float | None = None
    """The profiled step (slower than a timed one: the profiler's own cost)."""
    forward_s: float | None = None
    backward_s: float | None = None
    optimizer_s: float | None = None
    """Its phases, all micro-batches together; the optimizer includes zero_grad."""
    comm_s: float | None = None
    """Time some collective was in flight (the backend's work: NCCL kernels on CUDA)."""
    exposed_comm_s: float | None = None
    """Of comm_s, the time no compute ran beside it: what communication adds to the step."""
    comm_hidden_pct: float | None = None
    """100 x (1 - exposed / comm): the share of communication hidden by compute."""
    all_gather_gb_s: float | None = None
    all_gather_group_gb_s: list[float] | None = None
    """All-gather output bytes over duration (algorithm bandwidth; NCCL's bus bandwidth is
    this x (n - 1) / n): all together, and each in issue order (one per group unshard)."""
    all_gather_s: list[float] | None = None
    all_gather_exposed_s: list[float] | None = None
    """Each all-gather's duration, and its time with no compute beside it, in issue order."""
    # Distributed Checkpoint of the sharded model and optimizer state (measure.checkpoint)
    memory_timeline: dict[str, Any] | None = None
    """Rank 0's tracked memory over the profiled step (`job.memory_timeline.Timeline`)."""
    memory_peak_at: str | None = None
    """The module and phase running at the tracked peak ("layers.1 backward"; "loss" or
    "optimizer" outside every module)."""
    checkpoint_save_s: float | None = None
    checkpoint_load_s: float | None = None
    """Each ends when the slowest rank's does; the load includes set_state_dict."""
    checkpoint_bytes: int | None = None
    """On disk: every rank's file and the metadata."""
    checkpoint_dir: str | None = None
    """Where the files were kept (measure.keep_checkpoint); None: removed after the load."""
    checkpoint_restore_ok: bool | None = None
    checkpoint_reshard_ok: bool | None = None
    """--verify: the state restored at the same world size; every full parameter at world
    size 1. A failure's text is in `reason`."""
    # The machine around the run (`fsdp_bench.job.measure.load`): sampled before the model is built
    # and after the timed steps, each in a 0.1 s window while the run's ranks sleep
    contended: bool | None = None
    """Something else competed: other processes used more than `load.CONTENDED_CPU_PCT` of a
    host's CPU over the run (`WINDOW_CONTENDED_PCT` in a 0.1 s window), or another process
    was on one of the run's GPUs. None: not sampled (failures, older records)."""
    contention: str = ""
    """What made the run contended, in one line ("" when quiet)."""
    load_per_core_start: float | None = None
    load_per_core_end: float | None = None
    """The 1-minute load average over the cores (largest host): recorded, decides nothing."""
    other_cpu_start_pct: float | None = None
    other_cpu_end_pct: float | None = None
    """Percent of a host's CPU (all cores = 100) that processes other than the run's ranks
    used in each window (largest host)."""
    other_cpu_run_pct: float | None = None
    """The same over the run, start window to end window (largest host and pass)."""
    gpu_other_processes: int | None = None
    """With NVML: the most processes other than the run's seen on one of its GPUs."""
    # Provenance
    setup_s: float | None = None
    """Build, shard and materialise the model, create the optimizer (slowest rank)."""
    warmup_s: float | None = None
    compile_s: float | None = None
    """train.compile or compile_loss: what compilation added to the first warm-up step
    (slowest rank, the run's first pass), dynamo's caches cleared before the run; None: eager."""
    timed_s: float | None = None
    """Time of all timed steps (the slowest rank's per step, summed)."""
    wall_s: float | None = None
    """The whole run on rank 0, measurement steps and gathering included."""
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> RunResult:
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class EstimatedPeaks(NamedTuple):
    """A run's estimate before launch, copied into its record (the RunResult fields of the
    same names)."""

    estimated_peak_gib: float | None = None
    analytic_peak_gib: float | None = None
    estimated_allocated_gib: float | None = None
    estimated_allocated_low_gib: float | None = None
    estimated_allocated_high_gib: float | None = None
    estimated_reserved_gib: float | None = None
    estimated_reserved_low_gib: float | None = None
    estimated_reserved_high_gib: float | None = None
    estimated_device_used_gib: float | None = None
    estimated_device_used_low_gib: float | None = None
    estimated_device_used_high_gib: float | None = None
    estimate_fits: str | None = None
    estimate_correction: dict[str, Any] | None = None


class Flops(NamedTuple):
    """A run's training FLOPs per token (for MFU), found before launch, copied into its record."""

    flops_per_token: float | None = None
    flops_source: str | None = None


def now_iso() -> str:
    """A UTC timestamp for records, notes and the ledger, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same folder, fsync, rename: readers see all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ResultStore:
    """A results folder. Safe for concurrent writers of different runs."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.runs_dir = self.root / "runs"
        self.inflight_dir = self.root / "inflight"
        self.jobs_dir = self.root / "jobs"

    def save_grid(self, source: str) -> None:
        """The grid file as given, beside its results (provenance, the budget of `report`)."""
        if Path(source).is_file():
            write_atomic(self.root / "grid.yaml", Path(source).read_text())

    def record(self, result: RunResult) -> None:
        write_atomic(self.runs_dir / f"{result.run_id}.json", result.to_json())
        (self.root / "skip" / f"{result.run_id}.json").unlink(missing_ok=True)

    def has(self, run_id: str) -> bool:
        return (self.runs_dir / f"{run_id}.json").exists()

    def get(self, run_id: str) -> RunResult | None:
        path = self.runs_dir / f"{run_id}.json"
        return RunResult.from_json(path.read_text()) if path.exists() else None

    def done_ids(self) -> set[str]:
        return {p.stem for p in self.runs_dir.glob("*.json")}

    def results(self) -> list[RunResult]:
        paths = sorted(self.runs_dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
        return [RunResult.from_json(p.read_text()) for p in paths]

    def inflight(self, run_id: str) -> Path:
        return self.inflight_dir / run_id

    def set_aside(self, run_id: str) -> None:
        """Move a record to replaced/ (kept, not deleted): the run is measured again."""
        path = self.runs_dir / f"{run_id}.json"
        if path.exists():
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%f")
            target = self.root / "replaced" / f"{run_id}.{stamp}.json"
            target.parent.mkdir(parents=True, exist_ok=True)
            path.replace(target)

    def request_skip(self, result: RunResult) -> None:
        """Ask the job holding a run not to start it: `result` becomes its record (`take_skip`)."""
        write_atomic(self.root / "skip" / f"{result.run_id}.json", result.to_json())

    def take_skip(self, run_id: str) -> bool:
        """Whether a skip was asked for a run not recorded yet; it is then recorded as asked.
        Only the worker about to start the run calls this, so nothing else can race it."""
        request = self.root / "skip" / f"{run_id}.json"
        if not request.exists() or self.has(run_id):
            return False
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        os.replace(request, self.runs_dir / f"{run_id}.json")
        return True


# DataFrame columns for the RunConfig: leaf names, except where a leaf name is ambiguous.
_RENAMED = {"model.name": "model", "fault.kind": "fault", "fault.rank": "fault_rank"}
COLUMN_OF_PATH = {
    path: _RENAMED.get(path, path.rsplit(".", 1)[-1]) for path in field_paths(RunConfig)
}
"""Each RunConfig leaf (dotted path) and the results column it becomes."""

# How a run is timed (warm-up, timed steps, repeats), its seed and learning rate change how
# precisely it is measured, not what runs: two folders measured differently still match.
_NOT_IDENTITY = ("measure.", "data.seed", "train.learning_rate")
CONFIG_COLUMNS = [
    column
    for path, leaf in COLUMN_OF_PATH.items()
    if not path.startswith(_NOT_IDENTITY)
    for column in ([leaf, "nodes"] if path == "processes_per_node" else [leaf])
]
"""The columns that identify a configuration, in RunConfig order (`nodes` derived)."""
MODEL_COLUMNS = [c for p, c in COLUMN_OF_PATH.items() if p.startswith("model.")]
FAULT_COLUMNS = [c for p, c in COLUMN_OF_PATH.items() if p.startswith("fault.")]


def result_row(result: RunResult) -> dict[str, Any]:
    """One flat row: run_id, status, the config's leaves, metrics, provenance."""
    row: dict[str, Any] = {"run_id": result.run_id, "status": result.status}
    row.update(_flatten_config(result.config))
    row["nodes"] = row["world_size"] // (row.get("processes_per_node") or row["world_size"])
    for f in dataclasses.fields(result):
        if f.name in ("run_id", "status", "config", "provenance"):
            continue
        row[f.name] = getattr(result, f.name)
    for key, value in result.provenance.items():
        row[key] = value
    return row


def _flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and key != "options":
            out.update(_flatten_config(value, f"{dotted}."))
        else:
            out[COLUMN_OF_PATH.get(dotted, key)] = value
    return out


def load_results(root: str | Path) -> pd.DataFrame:
    """Every recorded run of a results folder as a DataFrame, one row per run.

    Columns: run_id, status, the configuration (world_size, grouping, ...), the metrics of
    `RunResult` and provenance (hostnames, torch_version, ...). A folder without runs gives an
    empty table with the configuration and metric columns.
    """
    import pandas as pd

    store = ResultStore(root)
    if not store.root.exists():
        raise FileNotFoundError(f"no results folder at {store.root}")
    rows = [result_row(r) for r in store.results()]
    if not rows:
        template = result_row(RunResult(run_id="", status="ok", config=to_plain(RunConfig())))
        return pd.DataFrame(columns=list(template))
    return pd.DataFrame(rows)
