"""Memory estimates: accuracy against measured peaks, and how long estimating takes.

1. Runs a grid (default: the quickstart) and prints, per run, the analytic and simulated
   estimates next to the measured peak (tracked tensors on CPU, the CPU allocator's for a
   compiled run, max_memory_allocated on CUDA) and the error of each (target for simulated:
   <= 5%; sweeps/compiled-cpu.yaml for compiled runs).
2. Times the simulated estimate for Llama-3 1B, 8B and 70B shapes (bf16, block activation
   checkpointing, sequence 4096, micro-batch 1) at world sizes 8, 64 and 1,024 (target for 8B
   at 64 ranks: < 10 s), and once without deepening for 8B at 64 ranks.
3. Deepening against full simulation, timed in the same run: four FSDP configurations of
   a 24-block small model at 16 ranks (those of tests/test_estimate.py), each estimated with
   deepening and without (the baseline), their wall times, the ratio full / deepened
   (target: > 1) and the difference of the peaks (the test's bound: <= 1%).

    python benchmarks/estimate_accuracy.py
    python benchmarks/estimate_accuracy.py sweeps/quickstart.yaml --skip-timing
    python benchmarks/estimate_accuracy.py --skip-accuracy --skip-timing   # 3. only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from fsdp_bench import load_results
from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.config.grid import load_grid
from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.run import DataConfig, RunConfig
from fsdp_bench.memory.simulate import simulate
from fsdp_bench.report.tables import varying_axes
from fsdp_bench.sweep import SweepOptions, run_sweep

REPO = Path(__file__).resolve().parents[1]


def accuracy(grid: Path) -> None:
    spec = load_grid(grid)
    with tempfile.TemporaryDirectory() as folder:
        run_sweep(spec, SweepOptions(results_dir=Path(folder), progress=False))
        df = load_results(folder)
    df = df[df.status == "ok"].copy()
    df["analytic_err"] = 100 * (df.analytic_peak_gib / df.peak_memory_gib - 1)
    df["simulated_err"] = 100 * (df.estimated_peak_gib / df.peak_memory_gib - 1)
    mib = 1024
    table = df[["run_id", *varying_axes(df)]].copy()
    table["analytic MiB"] = (df.analytic_peak_gib * mib).round(2)
    table["simulated MiB"] = (df.estimated_peak_gib * mib).round(2)
    table["measured MiB"] = (df.peak_memory_gib * mib).round(2)
    table["measured by"] = df.peak_memory_source
    table["analytic err %"] = df.analytic_err.round(1)
    table["simulated err %"] = df.simulated_err.round(2)
    print(table.to_string(index=False))
    print(
        f"simulated: max |error| {df.simulated_err.abs().max():.2f}%, "
        f"mean {df.simulated_err.abs().mean():.2f}% (target <= 5%); "
        f"analytic: max |error| {df.analytic_err.abs().max():.1f}%, "
        f"mean {df.analytic_err.abs().mean():.1f}%  [{df.device.iloc[0]}, {len(df)} runs]"
    )


def timing() -> None:
    print("\nmodel       world  estimate GiB/rank  wall s  method")
    for name in ("llama3-1b", "llama3-8b", "llama3-70b"):
        for world_size in (8, 64, 1024):
            estimate = simulate(_big_run(name, world_size))
            print(
                f"{name:10s} {world_size:6d} {estimate.peak_bytes / 1024**3:18.2f}"
                f" {estimate.wall_s:7.1f}  {estimate.method}"
            )
    full = simulate(_big_run("llama3-8b", 64), deepen=False)
    print(f"llama3-8b      64 {full.peak_bytes / 1024**3:18.2f} {full.wall_s:7.1f}  full")


DEEPENED_CONFIGS = {
    "default": FsdpConfig(),
    "blocks:2 no-reshard": FsdpConfig(grouping="blocks:2", reshard_after_forward=False),
    "root + block AC": FsdpConfig(grouping="root", activation_checkpointing="block"),
    "prefetch 2 + bf16": FsdpConfig(prefetch=2, mixed_precision="bf16"),
}


def deepening_speedup() -> None:
    print("\nsmall model, 24 blocks, 16 ranks: deepened vs full simulation (baseline)")
    print(f"{'fsdp':20s} {'deep s':>8s} {'full s':>7s} {'full/deep':>11s} {'peak diff %':>11s}")
    ratios = []
    for label, fsdp in DEEPENED_CONFIGS.items():
        run = RunConfig(
            world_size=16,
            model=ModelConfig(name="small", n_layers=24),
            data=DataConfig(micro_batch_size=2, seq_len=256),
            fsdp=fsdp,
        )
        fast, full = simulate(run), simulate(run, deepen=False)
        ratios.append(full.wall_s / fast.wall_s)
        diff = 100 * (fast.peak_bytes / full.peak_bytes - 1)
        print(f"{label:20s} {fast.wall_s:8.2f} {full.wall_s:7.2f} {ratios[-1]:10.2f}x {diff:11.3f}")
    print(
        f"full / deepened: min {min(ratios):.2f}x, max {max(ratios):.2f}x (target > 1x; "
        "both measured in this run)"
    )


def _big_run(name: str, world_size: int) -> RunConfig:
    return RunConfig(
        world_size=world_size,
        model=ModelConfig(name=name),
        data=DataConfig(micro_batch_size=1, seq_len=4096),
        fsdp=FsdpConfig(mixed_precision="bf16", activation_checkpointing="block"),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", nargs="?", default=str(REPO / "sweeps" / "quickstart.yaml"))
    parser.add_argument("--skip-accuracy", action="store_true", help="skip 1. (runs a sweep)")
    parser.add_argument("--skip-timing", action="store_true", help="skip 2. (Llama shapes)")
    args = parser.parse_args()
    if not args.skip_accuracy:
        accuracy(Path(args.grid))
    if not args.skip_timing:
        timing()
    deepening_speedup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
