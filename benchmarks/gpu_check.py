"""The GPU check: one command that measures what only a GPU can show, and writes a report.

Run it first whenever a machine with a GPU is at hand (about 8 minutes on one H200):

    python benchmarks/gpu_check.py --out benchmarks/results/2026-12-01-h200
    python benchmarks/gpu_check.py --device cpu --out /tmp/gpu-check    # reduced, ~3.5 min here

On the lent device machine (no registry there, few files back, a 10-minute call) it runs as
`benchmarks/gpu_check_device.sh run`, which brings the report, the log and the records back.

It writes `gpu_check.md` (for people) and `gpu_check.json` (every figure) to --out, again after
every part, so a check stopped by a time limit keeps what it measured. Each part
runs through fsdp-bench's own pipeline (grids, local launcher, worker, records) and is
recorded even when it fails, with its wall time:

- environment: torch, CUDA, NCCL, driver, device, the peak-FLOPS row, TF32 state, device
  memory in use after CUDA init and after process-group init;
- models: Llama-3-1B and a Llama-3-8B shape cut to 8 blocks, bf16, without and with activation
  checkpointing: tokens/s, MFU, spread, allocated / reserved / device-used peaks beside the
  simulated and analytic estimates, with the error in %;
- parity (--verify) in fp32 with TF32 off and on and in bf16, CPU offload, the DDP baseline,
  and which SDPA kernel each ran;
- failures and isolation: an injected OOM classified `oom`; two equal runs in one job giving
  the same peak;
- the harness against a bare FSDP2 loop in the same processes (benchmarks/harness_overhead.py);
- step time by perf_counter + synchronize against CUDA events over the same steps;
- where a step's time goes (issue 14): forward / backward / optimizer and exposed
  communication, root against block grouping, at world size 1 (nothing to expose) and, with
  two GPUs or more (or on CPU), at world size 2; on the same runs, Distributed Checkpoint
  save and load times with the restore checked at the same world size and at world size 1;
  where the tracked memory peaked, and the traces kept (on CUDA the allocator's memory
  snapshot beside the profiler's);
- eager against `train.compile: block` for one shape: tokens/s, compile_s, parity;
- `fsdp-bench run` under torchrun (two GPUs when there are two: NCCL through torchrun's store);
- with two GPUs or more: world size 2 with FSDP and HSDP, an injected hang recorded `timeout`,
  and which device each rank used.
On CPU (--device cpu) the same parts run on the tiny preset, and the CUDA-only figures
(MFU, events, device memory) are not there; tests/test_gpu_check.py runs it so in CI.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from fsdp_bench import load_results
from fsdp_bench.config import parse_grid
from fsdp_bench.report import tables
from fsdp_bench.sweep import SweepOptions, run_sweep

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Check:
    """Where the check writes and what it runs on."""

    out: Path
    device: str
    """cuda or cpu."""

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def measure(self) -> dict[str, int]:
        """Timed steps of the parts that report speed; on CPU only enough to keep them working."""
        return MEASURE if self.on_gpu else {"warmup_steps": 2, "timed_steps": 3, "repeats": 1}

    @property
    def num_gpus(self) -> int:
        return torch.cuda.device_count() if self.on_gpu else 0


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


MEASURE = {"warmup_steps": 2, "timed_steps": 5, "repeats": 3}
RUN_COLUMNS = [
    "run_id", "status", "model", "n_layers", "world_size", "strategy", "mixed_precision",
    "fp32_matmul", "cpu_offload", "activation_checkpointing", "tokens_per_s", "mfu",
    "peak_flops_source", "step_time_spread_pct", "peak_memory_gib", "peak_reserved_gib",
    "device_used_peak_gib", "tracked_peak_gib", "estimated_peak_gib", "analytic_peak_gib",
    "sdpa_backend", "parity_ok", "parity_scope", "parity_grad_max_abs_diff", "num_alloc_retries",
    "allocated_at_start_gib", "device_indices", "reason",
]  # fmt: skip


def rows(df: pd.DataFrame) -> list[dict[str, Any]]:
    """The records as plain rows, with the estimate errors against what was measured."""
    out = []
    for clean in columns_of(df, RUN_COLUMNS):
        measured = clean.get("tracked_peak_gib")
        for estimate in ("estimated_peak_gib", "analytic_peak_gib"):
            value = clean.get(estimate)
            if measured and value is not None:
                clean[f"{estimate}_error_pct"] = 100 * (value - measured) / measured
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


def environment(check: Check) -> dict[str, Any]:
    from fsdp_bench.job.flops import peak_flops
    from fsdp_bench.job.record import device_name, driver_version, nccl_version
    from fsdp_bench.job.training import fp32_matmul_precision

    device = torch.device(check.device, 0) if check.on_gpu else torch.device("cpu")
    name = device_name(device)
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "device": name,
        "num_gpus": check.num_gpus,
        "fp32_matmul_precision": fp32_matmul_precision(),
    }
    if check.on_gpu:
        free, total = torch.cuda.mem_get_info(device)
        bf16 = peak_flops(name, "bf16", tf32=False)
        info.update(
            cuda=torch.version.cuda,
            nccl=nccl_version(),
            driver=driver_version(),
            peak_flops_bf16=bf16.source if bf16 else "no row matched: no MFU",
            total_gib=total / 2**30,
            used_after_cuda_init_gib=(total - free) / 2**30,
        )
    return info


def models(check: Check) -> dict[str, Any]:
    if check.on_gpu:
        axes = [
            {"model.name": ["llama3-1b"], "fsdp.activation_checkpointing": ["none", "block"]},
            {
                "model.name": ["llama3-8b"],
                "model.n_layers": [8],
                "fsdp.activation_checkpointing": ["none", "block"],
            },
        ]
        data = {"micro_batch_size": 1, "seq_len": 2048}
    else:
        axes = [{"model.name": ["tiny"], "fsdp.activation_checkpointing": ["none", "block"]}]
        data = {"micro_batch_size": 2, "seq_len": 128}
    base = {
        "world_size": 1,
        "data": data,
        "fsdp": {"mixed_precision": "bf16"},
        "measure": check.measure,
    }
    return {"runs": rows(sweep(check, "models", base, axes))}


def parity(check: Check) -> dict[str, Any]:
    axes = [
        {"fsdp.mixed_precision": ["fp32"], "train.fp32_matmul": ["ieee", "tf32"]},
        {"fsdp.mixed_precision": ["bf16"]},
        {"fsdp.cpu_offload": [True]},
        {"strategy": ["ddp"]},
    ]
    world_size = 2 if check.num_gpus >= 2 or not check.on_gpu else 1
    base = {
        "world_size": world_size,
        "model": {"name": "small" if check.on_gpu else "tiny"},
        "data": {"micro_batch_size": 2, "seq_len": 256 if check.on_gpu else 128},
        "measure": {"warmup_steps": 1, "timed_steps": 3, "repeats": 2},
    }
    return {"runs": rows(sweep(check, "parity", base, axes, verify=True))}


def failures_and_isolation(check: Check) -> dict[str, Any]:
    base = {
        "world_size": 1,
        "model": {"name": "llama3-1b" if check.on_gpu else "tiny"},
        "data": {"micro_batch_size": 1, "seq_len": 1024 if check.on_gpu else 128},
        "measure": {"warmup_steps": 1, "timed_steps": 3, "repeats": 1},
    }
    axes = [{"data.seed": [0, 1]}, {"fault.kind": ["oom"]}]  # the twins share a job
    found = rows(sweep(check, "failures", base, axes))
    twins = [r for r in found if r["status"] == "ok"]
    peaks = sorted({round(r["peak_memory_gib"], 6) for r in twins})
    return {
        "runs": found,
        "injected_oom_recorded_as": [r["status"] for r in found if r["status"] != "ok"],
        "twin_peaks_gib": peaks,
        "twins_same_peak": len(twins) == 2 and len(peaks) == 1,
    }


def harness(check: Check) -> dict[str, Any]:
    model, seq, rounds = ("llama3-1b", "1024", "2") if check.on_gpu else ("tiny", "128", "1")
    command = [sys.executable, str(REPO / "benchmarks" / "harness_overhead.py"), "--model", model,
               "--world-size", "1", "--seq-len", seq, "--rounds", rounds]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    lines = done.stdout.strip().splitlines()
    median = next((line for line in lines if line.startswith("median")), "")
    ratio = float(median.split()[3]) if median else None
    ranks_on = next((line.rpartition("ranks on ")[2] for line in lines if "ranks on " in line), "")
    if check.on_gpu and done.returncode == 0 and ranks_on != "cuda":
        raise RuntimeError(f"the harness's ranks ran on {ranks_on or 'an unknown device'}")
    return {
        "returncode": done.returncode,
        "ranks_on": ranks_on,
        "ratio_of_medians": ratio,
        "output": lines[-6:],
        "stderr_tail": done.stderr.strip().splitlines()[-5:] if done.returncode else [],
    }


BREAKDOWN_COLUMNS = [
    "run_id", "status", "world_size", "grouping", "step_time_s", "profiled_step_s", "forward_s",
    "backward_s", "optimizer_s", "comm_s", "exposed_comm_s", "comm_hidden_pct",
    "all_gather_gb_s", "checkpoint_save_s", "checkpoint_load_s", "checkpoint_bytes",
    "checkpoint_restore_ok", "checkpoint_reshard_ok", "memory_peak_at", "reason",
]  # fmt: skip


def step_breakdown(check: Check) -> dict[str, Any]:
    """Root against block grouping, each profiled step broken down and checkpointed."""
    sizes = [1, 2] if check.num_gpus >= 2 or not check.on_gpu else [1]
    base = {
        "model": {"name": "llama3-1b" if check.on_gpu else "tiny"},
        "data": {"micro_batch_size": 1, "seq_len": 1024 if check.on_gpu else 128},
        "fsdp": {"mixed_precision": "bf16" if check.on_gpu else "fp32"},
        "measure": {"warmup_steps": 2, "timed_steps": 3, "repeats": 1, "checkpoint": True,
                    "trace": True},
    }  # fmt: skip
    axes = {"world_size": sizes, "fsdp.grouping": ["root", "block"]}
    df = sweep(check, "step_breakdown", base, axes, verify=True)
    found = columns_of(df, BREAKDOWN_COLUMNS)
    one_rank = [r["exposed_comm_s"] or 0.0 for r in found if r["world_size"] == 1]
    traces = check.out / "results" / "step_breakdown" / "traces"
    kept = sorted(p.name for p in traces.glob("*/rank0*"))  # on CUDA: the memory snapshot too
    return {"runs": found, "world_size_1_exposed_comm_s": one_rank, "rank0_trace_files": kept}


COMPILE_COLUMNS = [
    "run_id", "status", "compile", "tokens_per_s", "step_time_s", "step_time_spread_pct",
    "compile_s", "warmup_s", "peak_memory_gib", "tracked_peak_gib", "estimated_peak_gib",
    "parity_ok", "parity_grad_max_abs_diff", "reason",
]  # fmt: skip


def compiled(check: Check) -> dict[str, Any]:
    """Eager against torch.compile per block for one shape at world size 1, parity checked."""
    base = {
        "model": {"name": "llama3-1b" if check.on_gpu else "tiny"},
        "data": {"micro_batch_size": 1, "seq_len": 1024 if check.on_gpu else 128},
        "fsdp": {"mixed_precision": "bf16" if check.on_gpu else "fp32"},
        "measure": check.measure,
    }
    df = sweep(check, "compile", base, {"train.compile": ["none", "block"]}, verify=True)
    found = columns_of(df, COMPILE_COLUMNS)
    speed = {r["compile"]: r["tokens_per_s"] for r in found if r["status"] == "ok"}
    ratio = speed["block"] / speed["none"] if {"none", "block"} <= speed.keys() else None
    return {"runs": found, "compiled_over_eager_tokens_per_s": ratio}


def timer(check: Check) -> dict[str, Any]:
    """perf_counter + synchronize against CUDA events over the same steps (one GPU)."""
    if not check.on_gpu:
        return {"skipped": "CUDA events need a GPU"}
    import submitit

    executor = submitit.LocalExecutor(folder=check.out / "results" / "timer")
    executor.update_parameters(tasks_per_node=1, nodes=1, timeout_min=10, gpus_per_node=1)
    return executor.submit(_time_both_ways, str(check.out / "results" / "timer")).results()[0]


def _time_both_ways(folder: str) -> dict[str, Any]:
    from fsdp_bench.config import DataConfig, FsdpConfig, ModelConfig, RunConfig
    from fsdp_bench.job.models import build_model
    from fsdp_bench.job.parallelize import parallelize
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
    bundle = build_model(run.model)
    model, _ = parallelize(bundle, run, mesh, device)
    optimizer = build_optimizer(model, run)
    step = make_train_step(model, optimizer, rank_batches(run, 0, bundle.vocab_size, device), run)
    for _ in range(3):
        step()
    pairs = []
    for _ in range(3):
        begin_event = torch.cuda.Event(enable_timing=True)
        end_event = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        begin_event.record()
        for _ in range(5):
            step()
        end_event.record()
        torch.cuda.synchronize(device)
        wall_s = (time.perf_counter() - began) / 5
        pairs.append((wall_s, begin_event.elapsed_time(end_event) / 1000 / 5))
    barrier_and_destroy()
    return {
        "perf_counter_s": [p[0] for p in pairs],
        "cuda_events_s": [p[1] for p in pairs],
        "ratio": [p[0] / p[1] for p in pairs],
    }


def under_torchrun(check: Check) -> dict[str, Any]:
    """`fsdp-bench run` in processes torchrun started (issue 15): the group meets through
    torchrun's store, on NCCL with two GPUs or more."""
    world_size = min(check.num_gpus, 2) if check.on_gpu else 1
    model = {"name": "llama3-1b", "n_layers": 4} if check.on_gpu else {"name": "tiny"}
    base = {"world_size": world_size, "model": model, "measure": check.measure}
    grid = {"name": "torchrun", "base": base, "launcher": {"device": check.device}}
    path, results = check.out / "torchrun.yaml", check.out / "results" / "torchrun"
    path.write_text(json.dumps(grid))  # JSON is YAML
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size)]
    command = [*torchrun, "-m", "fsdp_bench", "run", str(path), "--results", str(results)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    found = load_results(results) if (results / "runs").is_dir() else pd.DataFrame()
    columns = ["run_id", "status", "world_size", "launcher", "backend", "device",
               "tokens_per_s", "reason"]  # fmt: skip
    return {
        "returncode": done.returncode,
        "runs": columns_of(found, columns),
        "stderr_tail": done.stderr.strip().splitlines()[-8:] if done.returncode else [],
    }


def multi_gpu(check: Check) -> dict[str, Any]:
    if check.num_gpus < 2:
        return {"skipped": f"{check.num_gpus} GPU(s): world size 2, HSDP and the hang need 2"}
    world_size = 4 if check.num_gpus >= 4 else 2
    base = {
        "world_size": world_size,
        "model": {"name": "llama3-1b"},
        "data": {"micro_batch_size": 1, "seq_len": 1024},
        "fsdp": {"mixed_precision": "bf16", "shard_group_size": world_size // 2},
        "measure": MEASURE,
    }
    axes = [{"strategy": ["fsdp", "hsdp"]}, {"fault.kind": ["hang"], "fault.rank": [1]}]
    grid_runs = rows(sweep(check, "multi_gpu", base, axes))
    return {"runs": grid_runs}


PARTS: list[tuple[str, Callable[[Check], dict[str, Any]]]] = [
    ("environment", environment),
    ("models", models),
    ("parity", parity),
    ("failures", failures_and_isolation),
    ("harness", harness),
    ("timer", timer),
    ("step_breakdown", step_breakdown),
    ("compile", compiled),
    ("torchrun", under_torchrun),
    ("multi_gpu", multi_gpu),
]


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU check: {report['device_name']}", "", f"{report['started_at']}, "
             f"{report['wall_s']:.0f} s, `{report['command']}`", ""]  # fmt: skip
    for name, part in report["parts"].items():
        lines += [f"## {name} ({part.get('wall_s', 0):.0f} s)", ""]
        if "error" in part:
            lines += ["Failed:", "", "```", part["error"], "```", ""]
            continue
        table = part.get("runs")
        if table:
            frame = pd.DataFrame(table).dropna(axis=1, how="all")
            lines += [tables.markdown(frame.map(_cell)), ""]
        other = {k: v for k, v in part.items() if k not in ("runs", "wall_s")}
        lines += [f"- {k}: {v}" for k, v in other.items()] + [""]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the report")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="default: cuda when available")  # fmt: skip
    parser.add_argument("--only", nargs="*", help="run only these parts")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no part after this many seconds; the parts left are reported as skipped",
    )
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check = Check(out=args.out.resolve(), device=device)
    check.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "device": device,
        "device_name": device,
        "parts": {},
    }
    for name, part in PARTS:
        if args.only and name not in args.only:
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
        report["wall_s"] = time.perf_counter() - started
        write_report(check.out, report)  # after every part: a killed check keeps what it did
        print(f"gpu_check: {name} done in {result['wall_s']:.0f} s", flush=True)
    print(f"gpu_check: {check.out / 'gpu_check.md'}")
    failed = [n for n, p in report["parts"].items() if "error" in p]
    return 1 if failed else 0


def write_report(out: Path, report: dict[str, Any]) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))


if __name__ == "__main__":
    sys.exit(main())
