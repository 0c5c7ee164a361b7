"""The GPU check: what only a GPU can show, each part with what must hold; exits non-zero
naming every part that failed.

Run it on a new cluster before spending GPU-hours on a sweep, and whenever a GPU is at hand:

    python benchmarks/gpu_check.py --out /tmp/gpu-check                 # about 6 min, one H200
    python benchmarks/gpu_check.py --out /tmp/gpu-check --only parity timer  # rerun what failed
    python benchmarks/gpu_check.py --device cpu --out /tmp/gpu-check    # reduced, ~3 min here

On the lent device machine (no registry there, few files back, a 10-minute call) it runs as
`benchmarks/gpu_check_device.sh run`, which brings the report, the log and the records back.

It writes `gpu_check.md` (for people) and `gpu_check.json` (every figure) to --out, again after
every part, so a check stopped by a time limit keeps what it measured. Each part runs through
fsdp-bench's own pipeline (grids, local launcher, worker, records) and is recorded even when
it fails; each states what must hold (`expect`), and the exit code is 1 when a part failed
(an error or an expectation that did not hold), 2 when none failed but some were left out for
the time budget, else 0. This process never initialises CUDA (that would put a context of its
own on GPU 0 and every run would see another process on its GPU): what needs CUDA runs in
child processes, and the last line of the report says whether CUDA stayed untouched here.

The parts, with their estimated time on one H200 (start-up of each job included: a fresh
process imports torch and starts CUDA, ~10 s):

- environment (15 s): torch, CUDA, NCCL, driver, device, the peak-FLOPS row, TF32 state, and
  device memory in use after CUDA init and after a process group's first collective (the
  CUDA context, then NCCL's communicator and buffers: the memory outside the allocator);
- models (60 s): Llama-3-1B, bf16, seq 2048, without and with activation checkpointing:
  tokens/s, MFU, spread, allocated / reserved / device-used peaks beside their estimates
  made before launch, each inside the estimate's interval (the tracked tensors within 5%);
  the summary counts how many measured figures of every part fell inside their intervals;
- allocator (20 s): a real allocator history (`torch.cuda.memory._record_memory_history`)
  of two steps, replayed through the allocator model: the same reserved peak; the history is
  kept (allocator_history.json) as test data for tests/test_allocator.py;
- parity (45 s): --verify on `small` in fp32 with TF32 off and on (each checked under its own
  precision), in bf16, with CPU offload, and the DDP baseline;
- failures (30 s): an injected OOM recorded `oom`; two equal runs in one job, the same peak;
- harness (40 s): fsdp-bench's step time against a bare FSDP2 loop, same processes;
- timer (35 s): the worker's event-timed steps against the wall clock around them;
- step_breakdown (50 s): forward / backward / optimizer by CUDA events and exposed
  communication, Llama-3-1B, root against block grouping; Distributed Checkpoint save and load
  on `small`, the restore checked; the kept trace read back;
- compile (55 s; 2 min on a GPU): eager against `train.compile: block` on `small`, one shape,
  parity checked; on a GPU also compiled float8 (tensorwise with float8 all-gather, rowwise)
  and the loss compiled, against bf16 eager, and every compiled run's allocated peak inside
  the estimate's interval;
- torchrun (30 s): `fsdp-bench run` under torchrun (NCCL through torchrun's store);
- multi_gpu (two GPUs or more, 60 s): FSDP and HSDP at world size 2 or 4, a hang recorded
  `timeout`. About 6 minutes in all on one GPU.

What one GPU cannot show: every run is world size 1, where FSDP2 replaces the reduce-scatter
with a copy and runs the all-gather in place, so no NCCL kernel runs in a step and exposed
communication is zero by construction; the world-size-2 parts run when there are two GPUs.
On CPU (--device cpu) the same parts run on the tiny preset at world sizes 1 and 2 (gloo);
CUDA-only figures and expectations are not there, and timing ratios are reported, not
checked (CPU timings are a smoke test). tests/test_gpu_check.py runs it so in CI.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from fsdp_bench import load_results
from fsdp_bench.config import parse_grid
from fsdp_bench.job.measure.step_trace import breakdown, timeline_from_trace
from fsdp_bench.report import tables
from fsdp_bench.report.estimates import ESTIMATE_PAIRS
from fsdp_bench.sweep import SweepOptions, run_sweep

REPO = Path(__file__).resolve().parents[1]

ONE_GPU_LIMITS = (
    "one GPU: every run is world size 1, where FSDP2 replaces the reduce-scatter with a copy "
    "and runs the all-gather in place; no NCCL kernel runs in a step, so comm_s and exposed "
    "communication are zero by construction and say nothing about a multi-GPU run"
)
HARNESS_TARGET = 1.02
"""fsdp-bench's step time over a bare loop's, at most (benchmarks/harness_overhead.py)."""
TIMER_BOUNDS = (0.99, 1.05)
"""The wall clock around a repeat of back-to-back steps, synchronised at both ends, over the
sum of the worker's event timings of those steps: the wall clock adds the barrier before the
first event and the last synchronisation, well under a percent of five Llama-3-1B steps; it
cannot be shorter. Events that missed the steps' work (recorded on another stream, say) make
the ratio far larger. (A per-step synchronised clock is no reference: it lets the GPU idle
while the CPU starts each step, a cost training does not pay; on the H200 it read 16% above
the events, `timing.time_repeat`. It is reported beside, for information.)"""
INTERVAL_FIGURES = ("allocated", "reserved", "device-used")
"""The CUDA figures estimated with an interval (`memory.error_model`)."""
TWIN_TOLERANCE_GIB = 2**-10
"""Two equal runs in one job: peaks within a MiB (the allocator rounds to 512 bytes)."""


@dataclass(frozen=True)
class Check:
    """Where the check writes, what it runs on, and what the environment probe found."""

    out: Path
    device: str
    """cuda or cpu."""
    num_gpus: int = 0

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def measure(self) -> dict[str, int]:
        """Timed steps of the parts that report speed; on CPU only enough to keep them working."""
        return MEASURE if self.on_gpu else {"warmup_steps": 2, "timed_steps": 3, "repeats": 1}

    @property
    def small(self) -> str:
        """The model for checkpoint, parity and compile: small on a GPU, tiny on CPU."""
        return "small" if self.on_gpu else "tiny"

    @property
    def large(self) -> str:
        """The model for speed and memory figures."""
        return "llama3-1b" if self.on_gpu else "tiny"


MEASURE = {"warmup_steps": 2, "timed_steps": 5, "repeats": 3}


def sweep(check: Check, name: str, base: dict[str, Any], axes: Any, **options: Any) -> pd.DataFrame:
    """Run a grid through fsdp-bench (local launcher) and return its records."""
    grid = {
        "name": name,
        "base": base,
        "axes": axes,
        "launcher": {"device": check.device, "collective_timeout_s": 120},
    }
    spec = parse_grid(grid, source=f"gpu_check:{name}")
    results = check.out / "results" / name
    run_sweep(spec, SweepOptions(results_dir=results, progress=False, **options))
    return load_results(results)


def expect(result: dict[str, Any], statement: str, holds: bool) -> None:
    """Note in a part's result whether `statement` held (a failed one fails the part)."""
    result.setdefault("expectations", {})[statement] = bool(holds)


def expect_none(result: dict[str, Any], statement: str, offenders: list[str]) -> None:
    """`statement` holds when nothing offends it; the offenders are named after it."""
    expect(result, f"{statement}: not {'; '.join(offenders)}" if offenders else statement,
           not offenders)  # fmt: skip


def failed_expectations(part: dict[str, Any]) -> list[str]:
    return [s for s, held in part.get("expectations", {}).items() if not held]


RUN_COLUMNS = [
    "run_id", "status", "model", "n_layers", "world_size", "strategy", "mixed_precision",
    "fp32_matmul", "cpu_offload", "activation_checkpointing", "tokens_per_s", "mfu",
    "peak_flops_source", "step_time_spread_pct", "peak_memory_gib", "peak_reserved_gib",
    "device_used_peak_gib", "device_used_at_init_gib", "tracked_peak_gib", "estimated_peak_gib",
    "estimated_allocated_gib", "estimated_reserved_gib", "estimated_device_used_gib",
    "analytic_peak_gib", "sdpa_backend", "parity_ok", "parity_scope", "parity_fp32_matmul",
    "parity_grad_max_abs_diff", "num_alloc_retries", "allocated_at_start_gib", "device_indices",
    "contended", "gpu_other_processes", "reason",
]  # fmt: skip


def rows(df: pd.DataFrame, columns: list[str] = RUN_COLUMNS) -> list[dict[str, Any]]:
    """The records as plain rows, with the estimate errors against what was measured and,
    where the estimate has an interval, whether the measurement fell inside it."""
    out = []
    pairs = {**ESTIMATE_PAIRS, "analytic": ("analytic_peak_gib", "tracked_peak_gib")}
    full = columns_of(df, list(df.columns))
    for clean, record in zip(columns_of(df, columns), full, strict=True):
        for name, (estimate, measurement) in pairs.items():
            value, measured = clean.get(estimate), clean.get(measurement)
            if measured and value is not None:
                clean[f"{name}_error_pct"] = 100 * (value - measured) / measured
            low = record.get(estimate.replace("_gib", "_low_gib"))
            high = record.get(estimate.replace("_gib", "_high_gib"))
            if measured and low is not None and high is not None:
                clean[f"{name}_inside"] = bool(low <= measured <= high)
        reason = clean.get("reason") or ""
        clean["reason"] = reason.splitlines()[0][:200] if reason else ""
        out.append(clean)
    return out


def columns_of(df: pd.DataFrame, columns: list[str]) -> list[dict[str, Any]]:
    """The records' `columns` (missing ones empty) as plain JSON-ready rows."""
    records = df.reindex(columns=columns).to_dict(orient="records")
    return [{str(k): _plain(v) for k, v in r.items()} for r in records]


def _plain(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if hasattr(value, "item") and not isinstance(value, (list, dict)):
        return value.item()
    return value


def expect_runs_ok(
    result: dict[str, Any], check: Check, statuses: dict[str, str] | None = None
) -> None:
    """Every run `ok` (or the status `statuses` names for its run id), and on a GPU none
    contended: nothing else ran on the machine, so a contended record is the check's own
    doing (a CUDA context of this process on the GPU, say)."""
    runs = result["runs"]
    wanted = statuses or {}
    wrong = [f"{r['run_id']}: {r['status']} {r['reason']}".strip() for r in runs
             if r["status"] != wanted.get(r["run_id"], "ok")]  # fmt: skip
    expect(result, "some run recorded", bool(runs))
    expect_none(result, "every run recorded as expected", wrong)
    if check.on_gpu:
        busy = [r["run_id"] for r in runs if r.get("contended") or r.get("gpu_other_processes")]
        expect_none(result, "no run contended", busy)


PROBE = """
import json, sys, torch
device_kind = sys.argv[1]
info = {"torch": torch.__version__, "python": sys.version.split()[0]}
from fsdp_bench.job.measure.flops import peak_flops
from fsdp_bench.job.record import device_name, driver_version, nccl_version
from fsdp_bench.job.training import fp32_matmul_precision
info["fp32_matmul_precision"] = fp32_matmul_precision()
if device_kind == "cuda" and torch.cuda.is_available():
    import torch.distributed as dist
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    name = device_name(device)
    torch.zeros(1, device=device)  # the context exists now
    free, total = torch.cuda.mem_get_info(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    dist.all_reduce(torch.ones(1, device=device))
    torch.cuda.synchronize(device)
    free_after, _ = torch.cuda.mem_get_info(device)
    dist.destroy_process_group()
    bf16 = peak_flops(name, "bf16", tf32=False)
    info.update(
        device=name, num_gpus=torch.cuda.device_count(), cuda=torch.version.cuda,
        nccl=nccl_version(), driver=driver_version(),
        peak_flops_bf16=bf16.source if bf16 else "no row matched: no MFU",
        total_gib=total / 2**30, used_after_cuda_init_gib=(total - free) / 2**30,
        used_after_group_init_gib=(total - free_after) / 2**30,
    )
else:
    info.update(device=device_name(torch.device("cpu")), num_gpus=0)
print(json.dumps(info))
"""


def probe(device: str) -> dict[str, Any]:
    """The environment, asked of a child process (this one must not initialise CUDA)."""
    done = subprocess.run([sys.executable, "-c", PROBE, device], capture_output=True, text=True,
                          timeout=300, check=False, cwd=REPO)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the environment probe failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def environment(check: Check) -> dict[str, Any]:
    result = probe(check.device)
    if check.on_gpu:
        expect(result, "CUDA found a GPU", result["num_gpus"] >= 1)
        nccl_gib = result["used_after_group_init_gib"] - result["used_after_cuda_init_gib"]
        result["nccl_world_size_1_gib"] = nccl_gib
        expect(result, "device memory grew or stayed at the process group's init", nccl_gib >= 0)
    return result


def models(check: Check) -> dict[str, Any]:
    base = {
        "world_size": 1,
        "model": {"name": check.large},
        "data": {"micro_batch_size": 1, "seq_len": 2048 if check.on_gpu else 128},
        "fsdp": {"mixed_precision": "bf16"},
        "measure": check.measure,
    }
    axes = {"fsdp.activation_checkpointing": ["none", "block"]}
    result: dict[str, Any] = {"runs": rows(sweep(check, "models", base, axes))}
    if check.num_gpus == 1:
        result["limits"] = ONE_GPU_LIMITS
    expect_runs_ok(result, check)
    ok = [r for r in result["runs"] if r["status"] == "ok"]
    errors_pct = {r["run_id"]: r.get("tensors_error_pct") for r in ok}
    off = [run_id for run_id, pct in errors_pct.items() if pct is None or abs(pct) > 5]
    expect_none(result, "estimated tensors within 5% of the measurement", off)
    if check.on_gpu:
        outside = [f"{r['run_id']} {name}" for r in ok for name in INTERVAL_FIGURES
                   if r.get(f"{name}_inside") is not True]  # fmt: skip
        expect_none(result, "every measured figure inside the estimate's interval", outside)
    if check.on_gpu:
        expect(result, "MFU between 0 and 1", all(0 < (r["mfu"] or 0) < 1 for r in ok))
        expect(result, "reserved >= allocated, device-used >= reserved", all(
            r["peak_reserved_gib"] >= r["peak_memory_gib"]
            and r["device_used_peak_gib"] >= r["peak_reserved_gib"] for r in ok))  # fmt: skip
    return result


def parity(check: Check) -> dict[str, Any]:
    axes = [
        {"fsdp.mixed_precision": ["fp32"], "train.fp32_matmul": ["ieee", "tf32"]},
        {"fsdp.mixed_precision": ["bf16"]},
        {"fsdp.cpu_offload": [True]},
        {"strategy": ["ddp"]},
    ]
    base = {
        "world_size": 2 if check.num_gpus >= 2 or not check.on_gpu else 1,
        "model": {"name": check.small},
        "data": {"micro_batch_size": 2, "seq_len": 256 if check.on_gpu else 128},
        "measure": {"warmup_steps": 1, "timed_steps": 3, "repeats": 2},
    }
    result: dict[str, Any] = {"runs": rows(sweep(check, "parity", base, axes, verify=True))}
    expect_runs_ok(result, check)
    runs = result["runs"]
    expect(result, "every parity check passed", bool(runs) and all(r["parity_ok"] for r in runs))
    # TF32 applies on CUDA only: on CPU every check runs at full fp32
    want = {"tf32": "high" if check.on_gpu else "highest", "ieee": "highest"}
    wrong = [r["run_id"] for r in runs if r["parity_fp32_matmul"] != want[r["fp32_matmul"]]]
    expect_none(result, "each run verified under its own fp32 matmul precision", wrong)
    return result


def failures_and_isolation(check: Check) -> dict[str, Any]:
    base = {
        "world_size": 1,
        "model": {"name": check.small},
        "data": {"micro_batch_size": 2, "seq_len": 512 if check.on_gpu else 128},
        "measure": {"warmup_steps": 1, "timed_steps": 3, "repeats": 1},
    }
    axes = [{"data.seed": [0, 1]}, {"fault.kind": ["oom"]}]  # the twins share a job
    found = rows(sweep(check, "failures", base, axes))
    injected = [r for r in found if r["status"] != "ok"]
    twins = [r for r in found if r["status"] == "ok"]
    peaks = [r["peak_memory_gib"] for r in twins]
    result: dict[str, Any] = {
        "runs": found,
        "injected_oom_recorded_as": [r["status"] for r in injected],
        "twin_peaks_gib": peaks,
    }
    expect(
        result, "the injected OOM recorded as oom", result["injected_oom_recorded_as"] == ["oom"]
    )
    expect(result, "two equal runs in one job, the same peak (within 1 MiB)",
           len(peaks) == 2 and max(peaks) - min(peaks) <= TWIN_TOLERANCE_GIB)  # fmt: skip
    return result


def harness(check: Check) -> dict[str, Any]:
    model, seq, rounds = ("llama3-1b", "1024", "2") if check.on_gpu else ("tiny", "128", "1")
    command = [sys.executable, str(REPO / "benchmarks" / "harness_overhead.py"), "--model", model,
               "--world-size", "1", "--seq-len", seq, "--rounds", rounds]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    lines = done.stdout.strip().splitlines()
    median = next((line for line in lines if line.startswith("median")), "")
    ratio = float(median.split()[3]) if median else None
    ranks_on = next((line.rpartition("ranks on ")[2] for line in lines if "ranks on " in line), "")
    result: dict[str, Any] = {
        "returncode": done.returncode,
        "ranks_on": ranks_on,
        "ratio_of_medians": ratio,
        "output": lines[-6:],
        "stderr_tail": done.stderr.strip().splitlines()[-5:] if done.returncode else [],
    }
    expect(result, "the harness ran", done.returncode == 0 and ratio is not None)
    expect(result, f"its ranks ran on {check.device}", ranks_on == check.device)
    if check.on_gpu:
        expect(result, f"fsdp-bench's step within {HARNESS_TARGET} of the bare loop's",
               ratio is not None and ratio <= HARNESS_TARGET)  # fmt: skip
    return result


def timer(check: Check) -> dict[str, Any]:
    """The worker's event timing (`timing.time_repeat`) against the wall clock around the
    same steps (one GPU)."""
    if not check.on_gpu:
        return {"not_applicable": "CUDA events need a GPU"}
    import submitit

    executor = submitit.LocalExecutor(folder=check.out / "results" / "timer")
    executor.update_parameters(tasks_per_node=1, nodes=1, timeout_min=10, gpus_per_node=1)
    job = executor.submit(_time_both_ways, str(check.out / "results" / "timer"))
    return timer_verdict(job.results()[0])


def timer_verdict(result: dict[str, Any]) -> dict[str, Any]:
    low, high = TIMER_BOUNDS
    expect(result, f"wall clock around the repeats over their events between {low} and {high}",
           low <= result["wall_over_events"] <= high)  # fmt: skip
    return result


def compare_timers(
    step: Callable[[], None],
    time_repeat: Callable[[Callable[[], None], int], list[float]],
    synchronize: Callable[[], None],
    steps: int = 5,
    repeats: int = 3,
) -> dict[str, Any]:
    """`time_repeat(step, steps)` (the worker's timing) against perf_counter around it,
    synchronised at both ends; then, interleaved, each step between two synchronisations
    (for information: `TIMER_BOUNDS`)."""
    events_s: list[float] = []
    wall_s: list[float] = []
    synchronized_s: list[float] = []
    for _ in range(repeats):
        synchronize()
        began = time.perf_counter()
        events_s.append(sum(time_repeat(step, steps)))
        synchronize()
        wall_s.append(time.perf_counter() - began)
        for _ in range(steps):
            synchronize()
            began = time.perf_counter()
            step()
            synchronize()
            synchronized_s.append(time.perf_counter() - began)
    mean_step_s = sum(events_s) / (steps * repeats)
    return {
        "repeat_events_s": events_s,
        "repeat_wall_s": wall_s,
        "wall_over_events": sum(wall_s) / sum(events_s),
        "per_step_synchronized_s": synchronized_s,
        "per_step_synchronized_over_events": statistics.median(synchronized_s) / mean_step_s,
    }


def _time_both_ways(folder: str) -> dict[str, Any]:
    from fsdp_bench.config import DataConfig, FsdpConfig, ModelConfig, RunConfig
    from fsdp_bench.job.measure.timing import time_repeat
    from fsdp_bench.job.model.zoo import build_model
    from fsdp_bench.job.parallel.parallelize import parallelize
    from fsdp_bench.job.rendezvous import barrier_and_destroy, init_process_group, rank_info
    from fsdp_bench.job.training import build_optimizer, make_train_step, rank_batches

    info = rank_info()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    init_process_group(info, device, Path(folder) / "rendezvous", 120)
    run = RunConfig(
        model=ModelConfig(name="llama3-1b"),
        data=DataConfig(seq_len=1024),
        fsdp=FsdpConfig(mixed_precision="bf16"),
    )
    mesh = torch.distributed.device_mesh.init_device_mesh("cuda", (1,))
    bundle = build_model(run.model, device.type)
    model, _ = parallelize(bundle, run, mesh, device)
    optimizer = build_optimizer(model, run)
    step = make_train_step(model, optimizer, rank_batches(run, 0, bundle.vocab_size, device), run)
    for _ in range(3):
        step()
    found = compare_timers(
        step, lambda s, n: time_repeat(s, n, device), lambda: torch.cuda.synchronize(device)
    )
    barrier_and_destroy()
    return found


BREAKDOWN_COLUMNS = [
    "run_id", "status", "model", "world_size", "grouping", "step_time_s", "profiled_step_s",
    "forward_s", "backward_s", "optimizer_s", "comm_s", "exposed_comm_s", "comm_hidden_pct",
    "all_gather_gb_s", "checkpoint_save_s", "checkpoint_load_s", "checkpoint_bytes",
    "checkpoint_restore_ok", "checkpoint_reshard_ok", "memory_peak_at", "contended",
    "gpu_other_processes", "reason",
]  # fmt: skip


def step_breakdown(check: Check) -> dict[str, Any]:
    """Root against block grouping, each profiled step broken down (Llama-3-1B); the
    checkpoint's cost on the small model; world size 2 too where there are two GPUs."""
    sizes = [1, 2] if check.num_gpus >= 2 or not check.on_gpu else [1]
    base = {
        "model": {"name": check.large},
        "data": {"micro_batch_size": 1, "seq_len": 1024 if check.on_gpu else 128},
        "fsdp": {"mixed_precision": "bf16" if check.on_gpu else "fp32"},
        "measure": {"warmup_steps": 2, "timed_steps": 3, "repeats": 1, "trace": True},
    }
    axes = [
        {"world_size": sizes, "fsdp.grouping": ["root", "block"]},
        {"world_size": sizes, "model.name": [check.small], "measure.checkpoint": [True]},
    ]
    df = sweep(check, "step_breakdown", base, axes, verify=True)
    found = columns_of(df, BREAKDOWN_COLUMNS)
    result: dict[str, Any] = {"runs": found}
    if check.num_gpus == 1:
        result["limits"] = ONE_GPU_LIMITS
    expect_runs_ok(result, check)
    ok = [r for r in found if r["status"] == "ok"]
    saved = [r for r in ok if r["checkpoint_bytes"]]
    expect(result, "every checkpoint restored, and resharded to world size 1",
           bool(saved) and all(r["checkpoint_restore_ok"] and r["checkpoint_reshard_ok"]
                               for r in saved))  # fmt: skip
    expect(result, "nothing exposed at world size 1",
           all((r["exposed_comm_s"] or 0) == 0 for r in ok if r["world_size"] == 1))  # fmt: skip
    expect(result, "the phases add up to the profiled step (90-100%)", all(
        0.9 * r["profiled_step_s"] <= r["forward_s"] + r["backward_s"] + r["optimizer_s"]
        <= 1.0001 * r["profiled_step_s"] for r in ok))  # fmt: skip
    # the CPU's view of a CUDA backward is ~1 us: on the device it costs about twice forward
    expect(result, "backward at least half as long as forward",
           all(r["backward_s"] >= 0.5 * r["forward_s"] for r in ok))  # fmt: skip
    traces = check.out / "results" / "step_breakdown" / "traces"
    result["rank0_trace_files"] = sorted(p.name for p in traces.glob("*/rank0*"))
    again = []
    for r in ok:
        path = traces / str(r["run_id"]) / "rank0.json"
        if path.is_file():
            read = breakdown(timeline_from_trace(path), check.on_gpu, _phases(r))
            again.append(math.isclose(read.comm_s, r["comm_s"], rel_tol=1e-3, abs_tol=1e-6))
    expect(result, "each kept trace, read back, gives the recorded communication",
           bool(again) and all(again))  # fmt: skip
    return result


def _phases(record: dict[str, Any]) -> dict[str, float]:
    names = {"forward": "forward_s", "backward": "backward_s", "optimizer": "optimizer_s",
             "step": "profiled_step_s"}  # fmt: skip
    return {phase: record[column] for phase, column in names.items()}


COMPILE_COLUMNS = [
    "run_id", "status", "compile", "compile_loss", "float8", "float8_all_gather", "tokens_per_s",
    "step_time_s", "step_time_spread_pct", "compile_s", "warmup_s", "peak_memory_gib",
    "tracked_peak_gib", "estimated_peak_gib", "estimated_allocated_low_gib",
    "estimated_allocated_high_gib", "parity_ok", "parity_grad_max_abs_diff", "contended",
    "gpu_other_processes", "reason",
]  # fmt: skip


def compiled(check: Check) -> dict[str, Any]:
    """Eager against torch.compile per block for one shape at world size 1, parity checked;
    on a GPU also compiled float8 (tensorwise with float8 all-gather, rowwise) and the loss
    compiled, each against bf16 eager in the same job, its memory beside the estimate's
    interval (compiled runs are estimated from the partition, `memory.compiled`; the loss
    with inductor's fusion as on CPU, its high end eager: `error_model.COMPILED_LOSS`)."""
    base = {
        "model": {"name": check.small},
        "data": {"micro_batch_size": 2, "seq_len": 512 if check.on_gpu else 128},
        "fsdp": {"mixed_precision": "bf16" if check.on_gpu else "fp32"},
        "measure": check.measure,
    }
    axes: list[dict[str, Any]] = [{"train.compile": ["none", "block"]}]
    if check.on_gpu:
        axes += [
            {"train.compile": ["block"], "train.float8": ["tensorwise"],
             "fsdp.float8_all_gather": [True]},
            {"train.compile": ["block"], "train.float8": ["rowwise"]},
            {"train.compile": ["block"], "train.compile_loss": [True]},
        ]  # fmt: skip
    df = sweep(check, "compile", base, axes, verify=True)
    found = columns_of(df, COMPILE_COLUMNS)
    speed = {
        (r["compile"] + ("+loss" if r.get("compile_loss") else ""), r.get("float8") or "none"):
            r["tokens_per_s"]
        for r in found
        if r["status"] == "ok"
    }  # fmt: skip
    eager = speed.get(("none", "none"))
    ratios = {f"{c}+{f}": v / eager for (c, f), v in speed.items() if eager and c != "none"}
    result: dict[str, Any] = {
        "runs": found,
        "compiled_over_eager_tokens_per_s": ratios.get("block+none"),
        "over_bf16_eager_tokens_per_s": ratios,
    }
    expect_runs_ok(result, check)
    expect(result, "every run passes parity",
           len(found) == len(axes) + 1 and all(r["parity_ok"] for r in found))  # fmt: skip
    if check.on_gpu:
        outside = [
            f"{r['run_id']} ({r['compile']}, {r.get('float8')}): allocated "
            f"{r['peak_memory_gib']:.2f} GiB, interval {r.get('estimated_allocated_low_gib')}"
            f"-{r.get('estimated_allocated_high_gib')}"
            for r in found
            if r["status"] == "ok" and not _inside(r)
        ]
        expect_none(result, "compiled memory inside the estimate's interval", outside)
    return result


def _inside(row: dict[str, Any]) -> bool:
    low, high = row.get("estimated_allocated_low_gib"), row.get("estimated_allocated_high_gib")
    return low is not None and high is not None and low <= row["peak_memory_gib"] <= high


def under_torchrun(check: Check) -> dict[str, Any]:
    """`fsdp-bench run` in processes torchrun started (issue 15): the group meets through
    torchrun's store, on NCCL with two GPUs or more."""
    world_size = min(check.num_gpus, 2) if check.on_gpu else 1
    model = {"name": "llama3-1b", "n_layers": 4} if check.on_gpu else {"name": "tiny"}
    base = {"world_size": world_size, "model": model, "measure": check.measure}
    grid = {"name": "torchrun", "base": base, "launcher": {"device": check.device}}
    path, results = check.out / "torchrun.yaml", check.out / "results" / "torchrun"
    path.write_text(json.dumps(grid))  # JSON is YAML
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(world_size)]  # fmt: skip
    command = [*torchrun, "-m", "fsdp_bench", "run", str(path), "--results", str(results)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    found = load_results(results) if (results / "runs").is_dir() else pd.DataFrame()
    columns = ["run_id", "status", "world_size", "launcher", "backend", "device",
               "tokens_per_s", "reason"]  # fmt: skip
    result: dict[str, Any] = {
        "returncode": done.returncode,
        "runs": columns_of(found, columns),
        "stderr_tail": done.stderr.strip().splitlines()[-8:] if done.returncode else [],
    }
    expect(result, "torchrun exited 0", done.returncode == 0)
    expect(result, f"one run, ok, by torchrun on {check.device}",
           [(r["status"], r["launcher"], r["device"]) for r in result["runs"]]
           == [("ok", "torchrun", check.device)])  # fmt: skip
    return result


def multi_gpu(check: Check) -> dict[str, Any]:
    if check.num_gpus < 2:
        return {
            "not_applicable": f"{check.num_gpus} GPU(s): world size 2, HSDP and the hang need 2"
        }
    world_size = 4 if check.num_gpus >= 4 else 2
    base = {
        "world_size": world_size,
        "model": {"name": "llama3-1b"},
        "data": {"micro_batch_size": 1, "seq_len": 1024},
        "fsdp": {"mixed_precision": "bf16", "shard_group_size": world_size // 2},
        "measure": MEASURE,
    }
    axes = [{"strategy": ["fsdp", "hsdp"]}, {"fault.kind": ["hang"], "fault.rank": [1]}]
    df = sweep(check, "multi_gpu", base, axes)
    result: dict[str, Any] = {"runs": rows(df)}
    hang = {run_id: "timeout" for run_id in df[df["fault"] == "hang"].run_id}
    expect_runs_ok(result, check, hang)
    indices = [r["device_indices"] for r in result["runs"] if r["status"] == "ok"]
    expect(result, "each rank on a GPU of its own",
           all(sorted(i) == list(range(world_size)) for i in indices))  # fmt: skip
    return result


ALLOCATOR_HISTORY = """
import json, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.run import DataConfig, RunConfig
from fsdp_bench.job.model.zoo import build_model, initialize
from fsdp_bench.job.parallel.parallelize import parallelize
from fsdp_bench.job.training import build_optimizer, make_train_step, rank_batches
from fsdp_bench.memory.snapshot import slim
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
torch.cuda.memory._record_memory_history(max_entries=1_000_000)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
run = RunConfig(model=ModelConfig(name="small"), data=DataConfig(seq_len=256, micro_batch_size=2))
bundle = build_model(run.model, "cuda")
mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("shard",))
model, _ = parallelize(bundle, run, mesh, device)
initialize(bundle, model)
optimizer = build_optimizer(model, run)
step = make_train_step(model, optimizer, rank_batches(run, 0, bundle.vocab_size, device), run)
step()
step()
torch.cuda.synchronize(device)
history = {"run_id": run.run_id, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "max_memory_reserved": torch.cuda.max_memory_reserved(device),
           **slim(torch.cuda.memory._snapshot())}
json.dump(history, open(sys.argv[1], "w"))
dist.destroy_process_group()
"""


def allocator(check: Check) -> dict[str, Any]:
    """A real allocator's history (two steps of `small` at world size 1, recorded in a child
    process), replayed through the allocator model: the reserved memory must be the same.
    The history is kept as allocator_history.json, for tests/data/snapshots/."""
    if not check.on_gpu:
        return {"not_applicable": "the caching allocator's history needs CUDA"}
    from fsdp_bench.memory.snapshot import reserved_peak_bytes, trace_of

    path = check.out / "allocator_history.json"
    done = subprocess.run([sys.executable, "-c", ALLOCATOR_HISTORY, str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"recording the history failed:\n{done.stderr[-3000:]}")
    history = json.loads(path.read_text())
    recorded = reserved_peak_bytes(history)
    replayed = trace_of(history).replay(cublas=False).stats.peak_reserved_bytes
    result: dict[str, Any] = {
        "entries": len(history["device_traces"][0]),
        "max_memory_reserved_mib": history["max_memory_reserved"] / 2**20,
        "history_reserved_peak_mib": recorded / 2**20,
        "replayed_reserved_peak_mib": replayed / 2**20,
        "history_file": str(path),
    }
    expect(result, "the history's segments reach max_memory_reserved",
           recorded == history["max_memory_reserved"])  # fmt: skip
    expect(result, "the allocator model reserves what the allocator did", replayed == recorded)
    return result


PARTS: list[tuple[str, Callable[[Check], dict[str, Any]]]] = [
    ("environment", environment),
    ("models", models),
    ("allocator", allocator),
    ("parity", parity),
    ("failures", failures_and_isolation),
    ("harness", harness),
    ("timer", timer),
    ("step_breakdown", step_breakdown),
    ("compile", compiled),
    ("torchrun", under_torchrun),
    ("multi_gpu", multi_gpu),
]


def verdict(part: dict[str, Any]) -> str:
    """passed, FAILED, skipped (the time budget) or not applicable (this machine)."""
    if "error" in part or failed_expectations(part):
        return "FAILED"
    if "skipped" in part:
        return "skipped"
    if "not_applicable" in part:
        return "not applicable"
    return "passed"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU check: {report['device_name']}", "", f"{report['started_at']}, "
             f"{report['wall_s']:.0f} s, `{report['command']}`", "",
             report["summary"], ""]  # fmt: skip
    for name, part in report["parts"].items():
        lines += [f"## {name}: {verdict(part)} ({part.get('wall_s', 0):.0f} s)", ""]
        for statement, held in part.get("expectations", {}).items():
            lines.append(f"- [{'x' if held else ' '}] {statement}")
        lines += [""] if part.get("expectations") else []
        if "error" in part:
            lines += ["Failed:", "", "```", part["error"], "```", ""]
            continue
        table = part.get("runs")
        if table:
            frame = pd.DataFrame(table).dropna(axis=1, how="all")
            lines += [tables.markdown(frame.map(_cell)), ""]
        other = {k: v for k, v in part.items() if k not in ("runs", "wall_s", "expectations")}
        lines += [f"- {k}: {v}" for k, v in other.items()] + [""]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the report")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda (default) or cpu: the reduced check")  # fmt: skip
    parser.add_argument("--only", nargs="*", choices=[n for n, _ in PARTS],
                        help="run only these parts (environment always runs)")  # fmt: skip
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no part after this many seconds; the parts left are reported as skipped",
    )
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "device": args.device,
        "device_name": args.device,
        "summary": "",
        "parts": {},
    }
    check = Check(out=out, device=args.device)
    for name, part in PARTS:
        if args.only and name not in args.only and name != "environment":
            continue
        began = time.perf_counter()
        result: dict[str, Any]
        if args.budget_s is not None and began - started > args.budget_s:
            result = {"skipped": f"the time budget ({args.budget_s:g} s) was spent"}
        else:
            try:
                result = part(check)
            except Exception:  # a part that fails is reported; the others still run
                result = {"error": traceback.format_exc()[-3000:]}
        result["wall_s"] = time.perf_counter() - began
        report["parts"][name] = result
        if name == "environment" and "device" in result:
            report["device_name"] = result["device"]
            check = Check(out=out, device=args.device, num_gpus=int(result["num_gpus"]))
        report["wall_s"] = time.perf_counter() - started
        report["summary"] = summary(report["parts"])
        write_report(out, report)  # after every part: a killed check keeps what it did
        print(f"gpu_check: {name} {verdict(result)} in {result['wall_s']:.0f} s", flush=True)
    report["cuda_initialised_here"] = torch.cuda.is_initialized()
    report["summary"] = summary(report["parts"], report["cuda_initialised_here"])
    write_report(out, report)
    print(f"gpu_check: {report['summary']}\ngpu_check: {out / 'gpu_check.md'}")
    if report["summary"].startswith("FAILED"):
        return 1
    return 2 if any(verdict(p) == "skipped" for p in report["parts"].values()) else 0


def summary(parts: dict[str, dict[str, Any]], cuda_initialised_here: bool = False) -> str:
    """One line: which parts failed (and what of them), or that all that ran passed."""
    failed = [f"{name} ({'; '.join(failed_expectations(p)) or 'error'})"
              for name, p in parts.items() if verdict(p) == "FAILED"]  # fmt: skip
    if cuda_initialised_here:
        failed.append("the check's own process initialised CUDA (a context on GPU 0)")
    counts = {v: sum(verdict(p) == v for p in parts.values())
              for v in ("passed", "skipped", "not applicable")}  # fmt: skip
    said = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    inside = [r[f"{name}_inside"] for p in parts.values() for r in p.get("runs", [])
              for name in INTERVAL_FIGURES if f"{name}_inside" in r]  # fmt: skip
    if inside:
        said += f"; {sum(inside)} of {len(inside)} measured figures inside their interval"
    if failed:
        return f"FAILED: {'; '.join(failed)} ({said})"
    return f"no part failed: {said}"


def write_report(out: Path, report: dict[str, Any]) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))


if __name__ == "__main__":
    sys.exit(main())
