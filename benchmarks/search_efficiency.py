"""Search efficiency, deterministic: how many runs until the search finds the best feasible
configuration of a recorded full-grid table?

A replay launcher answers each launched run from the table (no hardware), so every trial goes
through the real search loop: optuna's ask, the results store, the memory estimate and its
pruning, the driver, the tell. Two tables:

- cpu: a real sweep of sweeps/search-cpu.yaml on this machine (48 runs, gloo, world size 2),
  measured peaks and simulated estimates, its 21 MiB budget;
- 8b: Llama-3-8B on A100-40GB nodes, world sizes 8-64 (128 points): peaks from the simulated
  estimate, tokens/s from a throughput model (compute at 45% of bf16 peak, recompute for
  checkpointing, ring all-gather / reduce-scatter over NVLink or InfiniBand, overlapped with
  compute by how fine the groups are), a 40 GiB budget with a 4 GiB margin (peaks range
  10-73 GiB: runs over 40 GiB die of OOM, those within 4 GiB of it are infeasible).

For 20 seeds each: TPE with constraints and estimator pruning (fsdp-bench's default), TPE
with constraints but no pruning (predicted OOMs are launched and fail), and random search.
Each search has the grid's size as its trial budget. Prints the median number of launched
runs until the best feasible run (and until one within 3% of it) is among them, as a share
of the grid, and how many predicted-OOM runs each strategy launched in the whole search.

    python benchmarks/search_efficiency.py                # both tables
    python benchmarks/search_efficiency.py --tables 8b --seeds 5

The tables are kept in results/search-efficiency/ (the CPU sweep's records, the 8B estimates)
and reused by the next invocation: the first one sweeps 48 CPU runs (~2 min) and simulates
128 8B configurations (~30 min on 2 cores; groupings the estimator cannot extrapolate are
simulated whole), later ones only replay.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from fsdp_bench.config.grid import SweepSpec, expand, load_grid, parse_grid
from fsdp_bench.config.grid_settings import SamplerName
from fsdp_bench.config.presets import PRESETS
from fsdp_bench.config.run import RunConfig
from fsdp_bench.config.schema import to_plain
from fsdp_bench.launch.base import ALIVE_STATES
from fsdp_bench.memory.estimate import estimate_runs
from fsdp_bench.search import SearchOptions, run_search
from fsdp_bench.store import ResultStore, RunResult
from fsdp_bench.sweep import SweepOptions, run_sweep

REPO = Path(__file__).resolve().parents[1]
assert "ENDED" not in ALIVE_STATES


@dataclasses.dataclass
class ReplayJob:
    job_id: str

    def cancel(self) -> None: ...

    def log_tail(self, rank: int, lines: int = 20) -> str:
        return ""


class ReplayLauncher:
    """Answers a launched run at once with its row of the table; logs the launch order."""

    kind = "replay"
    max_array_size = 1

    def __init__(self, table: dict[str, RunResult], store: ResultStore, parallel: int) -> None:
        self.table = table
        self.store = store
        self.max_jobs_in_flight = parallel
        self.launched: list[str] = []

    def check(self, world_size: int, nodes: int) -> None: ...

    def submit(self, specs: list[Any]) -> list[ReplayJob]:
        for spec in specs:
            for run in spec.runs:
                self.launched.append(run.run_id)
                self.store.record(self.table[run.run_id])
        return [ReplayJob(str(len(self.launched)))]

    def reattach(self, job_id: str) -> ReplayJob:
        return ReplayJob(job_id)

    def poll(self, jobs: list[ReplayJob]) -> dict[str, str]:
        return {job.job_id: "ENDED" for job in jobs}


NEAR_BEST = 0.97
"""Within 3% of the best: inside the step-time spread of the CPU table's runs."""


@dataclasses.dataclass
class Table:
    name: str
    spec: SweepSpec
    records: dict[str, RunResult]
    estimates_dir: Path

    def fits(self, result: RunResult) -> bool:
        budget = self.spec.memory.budget_gib or float("inf")
        peak = result.peak_memory_gib
        if result.status != "ok" or peak is None:
            return False
        return peak + self.spec.memory.margin_gib <= budget

    def best_feasible(self) -> RunResult:
        return max(filter(self.fits, self.records.values()), key=lambda r: r.tokens_per_s or 0)

    def near_best(self) -> set[str]:
        threshold = NEAR_BEST * (self.best_feasible().tokens_per_s or 0)
        return {
            r.run_id for r in self.records.values()
            if self.fits(r) and (r.tokens_per_s or 0) >= threshold
        }  # fmt: skip


@dataclasses.dataclass
class Outcome:
    to_best: int
    """Launches until the best feasible run was among them (the grid's size if never)."""
    to_near_best: int
    predicted_oom_launches: int


def cpu_table(work: Path) -> Table:
    """A real sweep of the CPU search grid, recorded on this machine."""
    spec = load_grid(REPO / "sweeps" / "search-cpu.yaml")
    results = work / "cpu"
    run_sweep(spec, SweepOptions(results_dir=results, prune=False, progress=False))
    records = {r.run_id: r for r in ResultStore(results).results()}
    return Table("cpu", spec, records, results / "estimates")


EIGHT_B = {
    "name": "replay-8b",
    "base": {
        "model": {"name": "llama3-8b"},
        "data": {"micro_batch_size": 1, "seq_len": 4096},
        "fsdp": {"mixed_precision": "bf16"},
    },
    "axes": {
        "world_size": [8, 16, 32, 64],
        "fsdp.grouping": ["block", "blocks:2", "blocks:4", "root"],
        "fsdp.reshard_after_forward": ["default", False],
        "fsdp.activation_checkpointing": ["none", "block"],
        "train.accumulation_steps": [1, 4],
    },
    "memory": {"budget_gib": 40, "margin_gib": 4},
    "launcher": {"kind": "slurm", "gpus_per_node": 8},
}


def eight_b_table(work: Path) -> Table:
    """Simulated peaks and modelled throughput for Llama-3-8B on A100-40GB nodes."""
    spec = parse_grid(EIGHT_B, source=str(REPO / "sweeps" / "replay-8b.yaml"))
    runs = expand(spec).runs
    estimates_dir = work / "8b" / "estimates"
    estimates = estimate_runs(runs, estimates_dir)
    records = {}
    for run in runs:
        peak = estimates[run.run_id].estimated_peak_gib
        assert peak is not None
        fits_gpu = peak <= 40  # an A100-40GB holds 40 GB; above that the run dies
        records[run.run_id] = RunResult(
            run_id=run.run_id,
            status="ok" if fits_gpu else "oom",
            config=to_plain(run),
            tokens_per_s=modelled_tokens_per_s(run) if fits_gpu else None,
            peak_memory_gib=peak if fits_gpu else None,
            estimated_peak_gib=peak,
        )
    return Table("8b", spec, records, estimates_dir)


def modelled_tokens_per_s(run: RunConfig) -> float:
    """Throughput of Llama-3-8B on A100s: compute plus the communication it cannot hide."""
    shape = PRESETS["llama3-8b"]
    k = run.train.accumulation_steps
    tokens_per_rank = run.data.micro_batch_size * run.data.seq_len * k
    compute = shape.flops_per_token(run.data.seq_len) * tokens_per_rank / (312e12 * 0.45)
    if run.fsdp.activation_checkpointing == "block":
        compute *= 4 / 3  # the forward again in backward
    w = run.world_size
    bandwidth = 240e9 if w <= 8 else 25e9  # bytes/s per GPU: NVLink in a node, HDR IB across
    params = shape.num_params
    gathers = 1 if run.fsdp.reshard_after_forward is False else 2  # forward (+ backward)
    gather_bytes = params * 2 * gathers * k  # bf16, every micro-batch
    scatter_bytes = params * 4 * k  # fp32 gradients
    comm = (gather_bytes + scatter_bytes) * (w - 1) / w / bandwidth
    grouping = str(run.fsdp.grouping)
    hidden = {"block": 0.9, "blocks:2": 0.8, "blocks:4": 0.65, "root": 0.0}[grouping]
    groups = {"block": 33, "blocks:2": 17, "blocks:4": 9, "root": 1}[grouping]
    latency = groups * (gathers + 1) * k * 30e-6 * (1 + w / 64)
    step = compute + max(0.0, comm - hidden * compute) + latency
    return w * tokens_per_rank / step


def replay(table: Table, sampler: SamplerName, prune: bool, seed: int) -> Outcome:
    """One search through the real loop, answered from the table; trials: the grid's size."""
    size = len(table.records)
    search = dataclasses.replace(  # runs until the best was launched: no confirmation round
        table.spec.search, trials=size, sampler=sampler, seed=seed, confirm_top_k=0
    )
    launcher_config = dataclasses.replace(table.spec.launcher, poll_interval_s=1e-4)
    spec = dataclasses.replace(table.spec, search=search, launcher=launcher_config)
    with tempfile.TemporaryDirectory() as folder:
        store = ResultStore(folder)
        shutil.copytree(table.estimates_dir, store.root / "estimates")
        launcher = ReplayLauncher(table.records, store, parallel=1)
        options = SearchOptions(results_dir=Path(folder), prune=prune, progress=False)
        run_search(spec, options, launcher=launcher)
    launched = launcher.launched

    def launches_until(targets: set[str]) -> int:
        hits = [i + 1 for i, run_id in enumerate(launched) if run_id in targets]
        return hits[0] if hits else size

    budget = spec.memory.budget_gib or float("inf")
    predicted = {
        run_id for run_id, r in table.records.items()
        if (r.estimated_peak_gib or 0) + spec.memory.margin_gib > budget
    }  # fmt: skip
    return Outcome(
        to_best=launches_until({table.best_feasible().run_id}),
        to_near_best=launches_until(table.near_best()),
        predicted_oom_launches=len(predicted & set(launched)),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", nargs="+", default=["cpu", "8b"], choices=["cpu", "8b"])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--work", type=Path, default=REPO / "results" / "search-efficiency",
                        help="where the tables are kept between invocations")  # fmt: skip
    args = parser.parse_args()
    strategies: list[tuple[str, SamplerName, bool]] = [("TPE + constraints + pruning", "tpe", True),
                  ("TPE + constraints, no pruning", "tpe", False),
                  ("random search", "random", False)]  # fmt: skip
    work: Path = args.work
    for name in args.tables:
        table = cpu_table(work) if name == "cpu" else eight_b_table(work)
        size = len(table.records)
        feasible = sum(map(table.fits, table.records.values()))
        best = table.best_feasible()
        print(
            f"\ntable {name}: {size} configurations, {feasible} feasible, best feasible "
            f"{best.run_id} ({best.tokens_per_s:,.0f} tokens/s), "
            f"{len(table.near_best())} within 3% of it; medians of {args.seeds} seeds:"
        )
        print(f"{'strategy':31s} {'runs to best':>14s} {'runs to within 3%':>19s} "
              f"{'predicted-OOM launches (all)':>29s}")  # fmt: skip
        for label, sampler, prune in strategies:
            outcomes = [replay(table, sampler, prune, seed) for seed in range(args.seeds)]
            to_best = statistics.median(o.to_best for o in outcomes)
            to_near = statistics.median(o.to_near_best for o in outcomes)
            oom = statistics.median(o.predicted_oom_launches for o in outcomes)
            share_best, share_near = 100 * to_best / size, 100 * to_near / size
            print(
                f"{label:31s} {to_best:5.1f} ({share_best:4.1f}%) "
                f"{to_near:9.1f} ({share_near:4.1f}%) {oom:29.1f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
