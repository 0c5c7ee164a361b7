"""Search efficiency on replay tables: does a search launch the fastest configuration that fits,
and how much does it spend on runs that do not fit, when the memory estimate is exact or off?

A replay launcher answers each launched run from a table (no hardware), so fsdp-bench's search
goes through its real loop: optuna's ask, the results store, the memory estimate with its
interval and calibration, pruning, the driver, the tell. Tables (`--tables`):

- roofline, published: Llama-3-8B tables whose throughput and memory come from models written
  apart from fsdp-bench's (`search_tables.py`, with their sources), the fastest fitting point
  at the memory edge;
- cpu: a real sweep of sweeps/search-cpu.yaml on this machine (48 runs, gloo, world size 2),
  its measured peaks and fsdp-bench's own estimates (run once, kept in --work).

fsdp-bench's estimate of each point is the table's truth times an error (`--errors`): exact,
a systematic -15% or +15%, or a random 10% per point (log-normal); on the cpu table, its own
estimate times the same. Strategies, each given 21% of the table's points as launches
(`--share`):

- fsdp-bench: `run_search` with the grid's defaults (the additive sampler);
- fsdp-bench tpe, fsdp-bench gp: the same search with `search.sampler` tpe (the default until
  2026-12-05) or gp, the alternatives measured for the default;
- optuna TPE: TPESampler with defaults, no constraints; a run that does not fit is told 0;
- random: distinct points in random order;
- grid order: the sweep's order (what a sweep stopped at that many runs measures).

Printed per table and error, over `--seeds` seeds: in how many seeds the true best was
launched and the median launches until then; the reported best's true tokens/s over the true
best's (noise-free, median); the median share of launches that did not fit (over the budget,
or OOM); the median wall time of a search.

    python benchmarks/search_efficiency.py
    python benchmarks/search_efficiency.py --tables roofline --errors exact +15% --seeds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna

from fsdp_bench.config.grid import (
    SweepSpec,
    expand,
    get_path,
    load_grid,
    parse_grid,
    search_space,
)
from fsdp_bench.config.grid_settings import SamplerName
from fsdp_bench.config.run import RunConfig
from fsdp_bench.config.schema import to_plain
from fsdp_bench.launch.base import ALIVE_STATES
from fsdp_bench.memory.estimate import RunEstimate, cached_estimates, target_device
from fsdp_bench.memory.model_check import source_digests
from fsdp_bench.search import SearchOptions, best_feasible, run_search
from fsdp_bench.store import ResultStore, RunResult, write_atomic
from fsdp_bench.sweep import SweepOptions, run_sweep

sys.path.insert(0, str(Path(__file__).resolve().parent))
from search_tables import TABLES, IndependentTable, Truth

REPO = Path(__file__).resolve().parents[1]
assert "ENDED" not in ALIVE_STATES
ERRORS = {"exact": (0.0, 0.0), "-15%": (-0.15, 0.0), "+15%": (0.15, 0.0), "random 10%": (0.0, 0.1)}
"""A named estimate error: (systematic share, log-normal sigma per point)."""


@dataclasses.dataclass
class Table:
    name: str
    spec: SweepSpec
    runs: dict[str, RunConfig]
    truth: dict[str, Truth]
    card_gib: float
    """A run needing more than this dies of OOM."""
    estimates: dict[str, RunEstimate]
    """fsdp-bench's estimate when exact (the truth, or on the cpu table its own)."""

    @property
    def budget_gib(self) -> float:
        assert self.spec.memory.budget_gib is not None
        return self.spec.memory.budget_gib - self.spec.memory.margin_gib

    def fits(self, run_id: str) -> bool:
        return self.truth[run_id].device_used_gib <= self.budget_gib

    def best(self) -> str:
        fitting = [r for r in self.runs if self.fits(r)]
        return max(fitting, key=lambda r: self.truth[r].tokens_per_s)

    def record(self, run_id: str, estimated: Any) -> RunResult:
        """What the run records: its truth, or an OOM in torch's words when the card is short."""
        truth, run = self.truth[run_id], self.runs[run_id]
        fields = estimated._asdict() if estimated is not None else {}
        provenance = {"device_name": "NVIDIA H100 80GB HBM3", "torch_version": "2.13.0"}
        if truth.device_used_gib > self.card_gib:
            held = self.card_gib - 0.5
            asked = truth.device_used_gib - held
            reason = (f"CUDA out of memory. Tried to allocate {asked:.2f} GiB. GPU 0 has a total "
                      f"capacity of {self.card_gib + 0.3:.2f} GiB of which 0.30 GiB is free. "
                      f"Including non-PyTorch memory, this process has {held:.2f} GiB memory "
                      "in use.")  # fmt: skip
            return RunResult(run_id=run_id, status="oom", config=to_plain(run), reason=reason,
                             provenance=provenance, **fields)  # fmt: skip
        return RunResult(
            run_id=run_id,
            status="ok",
            config=to_plain(run),
            tokens_per_s=truth.tokens_per_s,
            peak_memory_gib=truth.allocated_gib,
            tracked_peak_gib=truth.allocated_gib,
            peak_reserved_gib=truth.reserved_gib,
            device_used_peak_gib=truth.device_used_gib,
            provenance=provenance,
            **fields,
        )


@dataclasses.dataclass
class ReplayJob:
    job_id: str

    def cancel(self) -> None: ...

    def log_tail(self, rank: int, lines: int = 20) -> str:
        return ""


class ReplayLauncher:
    """Answers a launched run at once from its table; logs the launch order."""

    kind = "replay"
    max_array_size = 1

    def __init__(self, table: Table, store: ResultStore) -> None:
        self.table, self.store = table, store
        self.max_jobs_in_flight = 1
        self.launched: list[str] = []

    def check(self, world_size: int, nodes: int) -> None: ...

    def submit(self, specs: list[Any]) -> list[ReplayJob]:
        for spec in specs:
            for run in spec.runs:
                self.launched.append(run.run_id)
                self.store.record(self.table.record(run.run_id, spec.estimates.get(run.run_id)))
        return [ReplayJob(str(len(self.launched)))]

    def reattach(self, job_id: str) -> ReplayJob:
        return ReplayJob(job_id)

    def poll(self, jobs: list[ReplayJob]) -> dict[str, str]:
        return {job.job_id: "ENDED" for job in jobs}


def independent_table(source: IndependentTable) -> Table:
    spec = parse_grid(source.grid, source=str(REPO / "sweeps" / f"{source.grid['name']}.yaml"))
    runs = {run.run_id: run for run in expand(spec).runs}
    points = {run_id: _point(run, source) for run_id, run in runs.items()}
    truth = {run_id: source.truth(point) for run_id, point in points.items()}
    device = target_device(spec.launcher)
    digests = source_digests(list(runs.values()))
    estimates = {
        run_id: RunEstimate(
            run_id=run_id,
            estimated_peak_gib=t.allocated_gib,
            estimated_allocated_gib=t.allocated_gib,
            estimated_reserved_gib=t.reserved_gib,
            outside_terms_gib={"context and NCCL": t.device_used_gib - t.reserved_gib},
            device_type=device,
            world_size=runs[run_id].world_size,
            torch_version="2.13.0",
            model_source=digests[runs[run_id].model.name],
        )
        for run_id, t in truth.items()
    }
    return Table(source.name, spec, runs, truth, source.card_gib, estimates)


def _point(run: RunConfig, source: IndependentTable) -> dict[str, Any]:
    return {key: get_path(run, key) for key in source.grid["axes"]}


def cpu_table(work: Path) -> Table:
    """A real sweep of the CPU search grid, recorded on this machine (once, kept in `work`)."""
    spec = load_grid(REPO / "sweeps" / "search-cpu.yaml")
    results = work / "cpu"
    run_sweep(spec, SweepOptions(results_dir=results, prune=False, progress=False))
    records = {r.run_id: r for r in ResultStore(results).results()}
    runs = {run.run_id: run for run in expand(spec).runs}
    truth = {}
    for run_id, r in records.items():
        used = r.tracked_peak_gib or r.peak_memory_gib or math.inf
        truth[run_id] = Truth(r.tokens_per_s or 0.0, used, used, used)
    estimates = cached_estimates(list(runs.values()), results / "estimates", "cpu")
    return Table("cpu", spec, runs, truth, math.inf, estimates)


def write_estimates(table: Table, folder: Path, error: str, seed: int) -> None:
    """fsdp-bench's estimates of every point, off by `error`, where the search reads them."""
    shift, sigma = ERRORS[error]
    rng = random.Random(f"{table.name}-{error}-{seed}")
    for run_id in sorted(table.estimates):
        factor = (1 + shift) * math.exp(rng.gauss(0.0, sigma)) if sigma else 1 + shift
        exact = table.estimates[run_id]
        scaled = dataclasses.replace(
            exact,
            estimated_peak_gib=_times(exact.estimated_peak_gib, factor),
            estimated_allocated_gib=_times(exact.estimated_allocated_gib, factor),
            estimated_reserved_gib=_times(exact.estimated_reserved_gib, factor),
            outside_terms_gib={k: v * factor for k, v in exact.outside_terms_gib.items()},
        )
        write_atomic(folder / f"{run_id}.json", json.dumps(dataclasses.asdict(scaled)))


def _times(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


@dataclasses.dataclass
class Outcome:
    launched: list[str]
    reported: str | None
    wall_s: float


def fsdp_bench_search(
    table: Table, launches: int, error: str, seed: int, sampler: SamplerName | None = None
) -> Outcome:
    """`run_search` with the grid's settings, or another `search.sampler`."""
    search = dataclasses.replace(table.spec.search, trials=launches, seed=seed, confirm_top_k=0)
    if sampler is not None:
        search = dataclasses.replace(search, sampler=sampler)
    launcher_config = dataclasses.replace(table.spec.launcher, poll_interval_s=1e-4)
    spec = dataclasses.replace(table.spec, search=search, launcher=launcher_config)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        store = ResultStore(folder)
        write_estimates(table, store.root / "estimates", error, seed)
        launcher = ReplayLauncher(table, store)
        options = SearchOptions(results_dir=Path(folder), progress=False)
        outcome = run_search(spec, options, launcher=launcher)
        found = best_feasible(outcome.study, store, spec)
        reported = found[0].user_attrs.get("run_id") if found else None
    return Outcome(launcher.launched, reported, time.perf_counter() - started)


def optuna_search(table: Table, launches: int, sampler: optuna.samplers.BaseSampler) -> Outcome:
    """Plain optuna over the table's points: no estimate, no constraint; a run that does not
    fit is told 0 tokens/s. A point proposed again is answered free; launches are distinct."""
    started = time.perf_counter()
    axes = _axes(table)
    by_point = {_key(table.runs[r], axes): r for r in table.runs}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    launched: list[str] = []
    told: dict[str, float] = {}
    for _ in range(launches * 20):
        if len(launched) >= launches:
            break
        trial = study.ask()
        point = {k: trial.suggest_categorical(k, [repr(v) for v in values])
                 for k, values in axes.items()}  # fmt: skip
        run_id = by_point.get(tuple(point[k] for k in axes))
        if run_id is None:  # a point two values make equal (grouping root's reshard)
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            continue
        if run_id not in told:
            launched.append(run_id)
            told[run_id] = table.truth[run_id].tokens_per_s if table.fits(run_id) else 0.0
        study.tell(trial, told[run_id])
    return Outcome(launched, _best_launched(table, launched), time.perf_counter() - started)


def ordered_search(table: Table, launches: int, order: list[str]) -> Outcome:
    launched = order[:launches]
    return Outcome(launched, _best_launched(table, launched), 0.0)


def _best_launched(table: Table, launched: list[str]) -> str | None:
    fitting = [r for r in launched if table.fits(r)]
    return max(fitting, key=lambda r: table.truth[r].tokens_per_s) if fitting else None


def _axes(table: Table) -> dict[str, list[Any]]:
    return {k: list(v) for k, v in search_space(table.spec).items()}


def _key(run: RunConfig, axes: dict[str, list[Any]]) -> tuple[str, ...]:
    return tuple(repr(_as_given(get_path(run, k), axes[k])) for k in axes)


def _as_given(value: Any, values: list[Any]) -> Any:
    """The grid's spelling of a run's value (True for a canonical reshard of `True`)."""
    for given in values:
        if given == value and type(given) is type(value):
            return given
    return value


Strategy = Callable[[Table, int, str, int], Outcome]
STRATEGIES: dict[str, Strategy] = {
    "fsdp-bench": fsdp_bench_search,
    "fsdp-bench tpe": functools.partial(fsdp_bench_search, sampler="tpe"),
    "fsdp-bench gp": functools.partial(fsdp_bench_search, sampler="gp"),
    "optuna TPE": lambda t, n, e, s: optuna_search(t, n, optuna.samplers.TPESampler(seed=s)),
    "random": lambda t, n, e, s: ordered_search(
        t, n, random.Random(s).sample(list(t.runs), len(t.runs))
    ),
    "grid order": lambda t, n, e, s: ordered_search(t, n, list(t.runs)),
}
"""The estimate's error matters to fsdp-bench only: the others never read it."""


def summary(table: Table, outcomes: list[Outcome]) -> str:
    best = table.best()
    hits = [o.launched.index(best) + 1 for o in outcomes if best in o.launched]
    ratio = statistics.median(
        table.truth[o.reported].tokens_per_s / table.truth[best].tokens_per_s if o.reported else 0.0
        for o in outcomes
    )
    not_fit = statistics.median(
        sum(not table.fits(r) for r in o.launched) / max(len(o.launched), 1) for o in outcomes
    )
    to_best = f"median {statistics.median(hits):.0f}" if hits else "-"
    wall_s = statistics.median(o.wall_s for o in outcomes)
    return (f"{len(hits):2d} of {len(outcomes)} ({to_best:>10s})  {ratio:6.3f}  "
            f"{100 * not_fit:5.1f}%  {wall_s:6.2f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", nargs="+", default=["roofline", "published", "cpu"],
                        choices=[*TABLES, "cpu"])  # fmt: skip
    parser.add_argument("--errors", nargs="+", default=list(ERRORS), choices=list(ERRORS))
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES),
                        choices=list(STRATEGIES))  # fmt: skip
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--share", type=float, default=0.21, help="launches, share of the points")
    parser.add_argument("--work", type=Path, default=REPO / "results" / "search-efficiency",
                        help="where the cpu table is kept between invocations")  # fmt: skip
    args = parser.parse_args()
    for name in args.tables:
        table = cpu_table(args.work) if name == "cpu" else independent_table(TABLES[name])
        launches = max(1, round(args.share * len(table.runs)))
        best = table.best()
        fitting = sum(map(table.fits, table.runs))
        print(
            f"\ntable {name}: {len(table.runs)} points, {fitting} fit the "
            f"{table.budget_gib:g} GiB budget; true best {best} "
            f"({table.truth[best].tokens_per_s:,.0f} tokens/s, "
            f"{table.truth[best].device_used_gib:.2f} GiB used); {launches} launches each"
        )
        print(f"  {'estimate':10s} {'strategy':19s} {'best launched':>24s} {'found':>6s} "
              f"{'unfit':>6s} {'wall s':>6s}")  # fmt: skip
        for error in args.errors:
            for strategy in args.strategies:
                if not strategy.startswith("fsdp-bench") and error != args.errors[0]:
                    continue  # the others never read the estimate
                outcomes = [STRATEGIES[strategy](table, launches, error, seed)
                            for seed in range(args.seeds)]  # fmt: skip
                label = error if strategy.startswith("fsdp-bench") else "(unused)"
                print(f"  {label:10s} {strategy:19s} {summary(table, outcomes)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
