"""Slurm orchestration on the throwaway testbed (slurm/testbed), three figures:

1. submission: wall time to submit a 1,000-run grid as job arrays (target < 5 s);
2. the driver's CPU time per recorded result while it follows a real sweep;
3. packed (runs of one shape share a job) vs one job per run, sweeps/testbed.yaml, one job in
   flight in both modes: wall time ratio (target >= 3x).

    python benchmarks/slurm_overhead.py          # starts the testbed if needed, stops nothing
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsdp_bench import load_results
from fsdp_bench.config.grid import expand, load_grid, parse_grid
from fsdp_bench.launch import make_launcher
from fsdp_bench.launch.driver import Driver
from fsdp_bench.launch.ledger import Ledger
from fsdp_bench.launch.packing import pack_runs
from fsdp_bench.store import ResultStore
from fsdp_bench.sweep import SweepOptions, run_sweep

REPO = Path(__file__).resolve().parents[1]
STATE_DIR = "/tmp/fsdp-bench-slurm"


def start_testbed() -> None:
    subprocess.run([str(REPO / "slurm/testbed/start.sh"), STATE_DIR], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    os.environ["SLURM_CONF"] = f"{STATE_DIR}/etc/slurm.conf"


def submission_time(runs: int) -> tuple[float, int, int]:
    """Seconds to expand, pack and submit a grid of `runs` one-run jobs; (s, jobs, arrays)."""
    grid = {
        "name": "submit",
        "base": {"world_size": 2, "model": {"name": "tiny"}},
        "axes": {"data.seed": list(range(runs))},
        "launcher": {"cluster": "testbed", "max_runs_per_job": 1, "max_jobs_in_flight": runs},
    }
    # cancelled jobs may still write their logs while the folder goes away
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as folder:
        start = time.perf_counter()
        spec = parse_grid(grid, source=str(REPO / "sweeps" / "submit.yaml"))
        store = ResultStore(folder)
        launcher = make_launcher(spec.launcher, store.jobs_dir)
        driver = Driver(store, Ledger(store.jobs_dir / "ledger.json"), spec, verify=False)
        watched: list = []
        driver.fill(launcher, watched, pack_runs(expand(spec).runs, spec.launcher))
        elapsed = time.perf_counter() - start
        subprocess.run(["scancel", "--me"], check=True)
        arrays = len({w.job.job_id.split("_")[0] for w in watched})
        return elapsed, len(watched), arrays


def sweep_wall(runs_per_job: int | None) -> tuple[float, float, int]:
    """(wall s, driver CPU s, results) of sweeps/testbed.yaml with one job in flight; both
    without the memory estimates made before launch (the same work in both modes)."""
    spec = load_grid(REPO / "sweeps" / "testbed.yaml")
    launcher = dataclasses.replace(
        spec.launcher, max_jobs_in_flight=1, max_runs_per_job=runs_per_job
    )
    spec = dataclasses.replace(spec, launcher=launcher)
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        wall, cpu = time.perf_counter(), time.process_time()
        outcome = run_sweep(spec, SweepOptions(results_dir=Path(folder), progress=False))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert len(load_results(folder)) == outcome.recorded
    return wall - outcome.estimate_s, cpu, outcome.recorded


def main() -> int:
    start_testbed()
    seconds, jobs, arrays = submission_time(1000)
    print(f"submit 1000 runs: {seconds:.2f} s for {jobs} jobs in {arrays} array(s) (target < 5 s)")
    packed_wall, packed_cpu, results = sweep_wall(None)
    single_wall, single_cpu, _ = sweep_wall(1)
    print(f"sweeps/testbed.yaml, {results} runs, one job in flight (wall without estimating):")
    for label, wall, cpu in (
        ("packed", packed_wall, packed_cpu),
        ("one job per run", single_wall, single_cpu),
    ):
        print(f"  {label:16s} {wall:6.1f} s wall, driver CPU {cpu / results:.3f} s/result")
    print(f"  packed is {single_wall / packed_wall:.2f}x faster (target >= 3x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
