"""Orchestration overhead per run: wall time outside the warm-up and timed steps.

Runs one grid twice in the same invocation: packed (runs of one world size share a job, the
default) and one fresh job per run (process start, `import torch` and the process group paid
every time). Overhead per run = (sweep wall time - memory estimation before launch - sum of
warm-up and timed step time) / runs; the estimation time is printed on its own.

    python benchmarks/orchestration_overhead.py                       # sweeps/quickstart.yaml
    python benchmarks/orchestration_overhead.py sweeps/quickstart.yaml --only packed

Targets on 2 cores: <= 0.5 s per run packed; the whole quickstart sweep < 3 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from fsdp_bench import load_results
from fsdp_bench.config.grid import load_grid
from fsdp_bench.sweep import SweepOptions, run_sweep

REPO = Path(__file__).resolve().parents[1]


def measure(grid_path: Path, runs_per_job: int | None) -> dict[str, float]:
    spec = load_grid(grid_path)
    spec = dataclasses.replace(
        spec, launcher=dataclasses.replace(spec.launcher, max_runs_per_job=runs_per_job)
    )
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        outcome = run_sweep(spec, SweepOptions(results_dir=Path(folder), progress=False))
        wall = time.perf_counter() - start
        df = load_results(folder)
    stepping = float((df.warmup_s + df.timed_s).sum())
    runs = len(df)
    return {
        "runs": runs,
        "ok": outcome.statuses.get("ok", 0),
        "wall_s": wall,
        "estimate_s": outcome.estimate_s,
        "stepping_s": stepping,
        "overhead_per_run_s": (wall - outcome.estimate_s - stepping) / runs,
        "setup_per_run_s": float(df.setup_s.mean()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", nargs="?", default=str(REPO / "sweeps" / "quickstart.yaml"))
    parser.add_argument("--only", choices=["packed", "per-run"])
    args = parser.parse_args()
    modes = {"packed": None, "per-run": 1}
    if args.only:
        modes = {args.only: modes[args.only]}
    figures = {name: measure(Path(args.grid), per_job) for name, per_job in modes.items()}
    print(f"grid {args.grid}")
    print(
        "mode      runs  ok   wall s  estimating s  in steps s  overhead s/run  model setup s/run"
    )
    for name, f in figures.items():
        print(
            f"{name:8s} {f['runs']:5.0f} {f['ok']:3.0f} {f['wall_s']:8.1f} {f['estimate_s']:13.1f}"
            f" {f['stepping_s']:11.1f} {f['overhead_per_run_s']:15.3f} {f['setup_per_run_s']:18.3f}"
        )
    if len(figures) == 2:
        ratio = figures["per-run"]["wall_s"] / figures["packed"]["wall_s"]
        print(f"packed is {ratio:.2f}x faster than one job per run (wall time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
