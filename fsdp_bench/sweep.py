"""The grid pipeline: expand, drop what is recorded, pack runs into jobs, follow them, record.

The driver never holds a result only in memory: workers write each run's record as it
finishes, failures are recorded from the notes ranks leave, and which runs went into which job
is on disk (`jobs/ledger.json`), so a driver that is killed and started again picks up where
it was without running anything twice.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_bench.config.grid import SweepSpec, expand
from fsdp_bench.config.run import RunConfig
from fsdp_bench.launch import ALIVE_STATES, Launcher, LocalLauncher, make_launcher
from fsdp_bench.launch.driver import Driver, Watched, age_s
from fsdp_bench.launch.ledger import Ledger
from fsdp_bench.launch.packing import pack_runs
from fsdp_bench.memory.calibration import calibration
from fsdp_bench.memory.estimate import RunEstimate, estimate_runs, target_device
from fsdp_bench.memory.model_check import check_models
from fsdp_bench.memory.prediction import predicted_oom
from fsdp_bench.store import ResultStore, RunResult


@dataclass
class SweepOptions:
    results_dir: Path | None = None
    rerun: bool = False
    """Run again (and replace) runs that are already recorded; old records are kept aside."""
    rerun_contended: bool = False
    """Run again (and replace) the recorded runs marked `contended`; old records kept aside."""
    verify: bool = False
    """Check each configuration against a single-process step before timing it."""
    prune: bool = True
    """Record runs predicted over the memory budget as skipped instead of launching them."""
    progress: bool = True


@dataclass
class SweepOutcome:
    results_dir: Path
    run_ids: list[str]
    already_recorded: int
    recorded: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    estimate_s: float = 0.0
    """Wall time spent estimating memory before launching (0 when all were cached)."""


def results_dir_for(spec: SweepSpec, override: Path | None) -> Path:
    return override if override is not None else Path("results") / spec.name


def run_sweep(spec: SweepSpec, options: SweepOptions) -> SweepOutcome:
    """Run every run of the grid that is not recorded yet; return what happened."""
    runs = expand(spec).runs
    store = ResultStore(results_dir_for(spec, options.results_dir))
    launcher = make_launcher(spec.launcher, store.jobs_dir)
    for shape in sorted({(r.world_size, r.nodes) for r in runs}):
        launcher.check(*shape)
    device_type = target_device(spec.launcher)
    for run in runs:
        run.check_device(device_type)
    ledger = Ledger(store.jobs_dir / "ledger.json")
    watched = _reattach(ledger, launcher, {r.run_id: r for r in runs})
    if launcher.kind == "local":  # nothing computes beside a run an earlier driver left timing
        Driver(store, ledger, spec, options.verify).wait_for(launcher, watched)
        _note_other_jobs(launcher)
    # A broken model stops here: nothing launched, nothing written. A rerun also checks and
    # estimates a user's model again, which may import files its digest does not cover.
    check_models(runs, again=options.rerun)
    store.save_grid(spec.source)
    if options.rerun:
        for run in runs:
            store.set_aside(run.run_id)
        _forget_estimates(store, [r.run_id for r in runs if r.model.is_user_model])
    elif options.rerun_contended:
        for run in runs:
            if _contended(store.get(run.run_id)):
                store.set_aside(run.run_id)
    done = store.done_ids()
    outcome = SweepOutcome(
        results_dir=store.root,
        run_ids=[r.run_id for r in runs],
        already_recorded=sum(r.run_id in done for r in runs),
    )
    busy = {r.run_id for w in watched for r in w.runs}
    todo = [r for r in runs if r.run_id not in done and r.run_id not in busy]
    started = time.perf_counter()
    estimates = _estimate(todo, store, device_type, options.progress)
    outcome.estimate_s = time.perf_counter() - started

    passes = max((run.measure.rounds for run in todo), default=1)
    bar = progress_bar(spec.name, len(todo) + len(busy), passes) if options.progress else None
    driver = Driver(store, ledger, spec, options.verify)
    pruner = Pruner(spec, store, driver, estimates, todo, prune=options.prune)
    driver.on_record = _updater(bar, pruner.on_record)
    todo = pruner.decide()
    try:
        driver.run(launcher, watched, pack_runs(todo, spec.launcher))
    finally:
        if bar is not None:
            bar.close()
        outcome.recorded = driver.progress.recorded
        outcome.statuses = driver.progress.statuses
    return outcome


def _estimate(
    runs: list[RunConfig], store: ResultStore, device_type: str, progress: bool
) -> dict[str, RunEstimate]:
    """Every run's memory estimate before anything launches (cached in estimates/)."""
    bar = progress_bar("estimate", len(runs)) if progress else None
    try:
        return estimate_runs(
            runs,
            store.root / "estimates",
            device_type=device_type,
            on_estimate=lambda _: bar.update(1) if bar else None,
        )
    finally:
        if bar is not None:
            bar.close()


class Pruner:
    """Which runs not launched yet fit the memory budget, decided before launching and again
    each time a run is measured: the folder's correction learns from every measured run
    (`calibration`), and a run whose interval it moves wholly over the budget is taken back
    from the driver (`Driver.withdraw`) and recorded skipped. The records of the runs still
    to launch carry the estimate as last decided."""

    def __init__(
        self,
        spec: SweepSpec,
        store: ResultStore,
        driver: Driver,
        estimates: dict[str, RunEstimate],
        runs: list[RunConfig],
        *,
        prune: bool,
    ) -> None:
        self.spec, self.driver, self.estimates = spec, driver, estimates
        self.pending = {run.run_id: run for run in runs}
        self.prune = prune and spec.memory.budget_gib is not None
        self.known = calibration(spec.memory, store)

    def decide(self) -> list[RunConfig]:
        """Record the runs that do not fit as skipped; return the others, to launch."""
        for run, reason in self._decided():
            self.driver.record_unlaunched(run, "skipped", reason, {})
        return list(self.pending.values())

    def on_record(self, result: RunResult) -> None:
        self.pending.pop(result.run_id, None)
        learned = self.known.learn(result)
        if learned == self.known or not self.pending:
            return
        self.known = learned
        for run, reason in self._decided():
            self.driver.withdraw(run, "skipped", reason)

    def _decided(self) -> list[tuple[RunConfig, str]]:
        """The pending runs that do not fit now, taken out of `pending`, with why."""
        known, memory = self.known, self.spec.memory
        out = []
        for run_id, run in list(self.pending.items()):
            estimate = self.estimates[run_id]
            self.driver.estimates[run_id] = estimate.peaks(known, run, memory)
            reason = predicted_oom(estimate.predict(known, run), memory) if self.prune else ""
            if reason:
                del self.pending[run_id]
                out.append((run, reason))
        return out


def _reattach(ledger: Ledger, launcher: Launcher, by_id: dict[str, RunConfig]) -> list[Watched]:
    """Jobs an earlier driver submitted and did not see end: follow them again."""
    return [
        Watched(
            job=launcher.reattach(entry["job_id"]),
            runs=[by_id[i] for i in entry["run_ids"] if i in by_id],
        )
        for entry in ledger.open_jobs(launcher.kind)
    ]


@dataclass
class RunState:
    run_id: str
    state: str
    """ok, oom, error, ... (recorded); running; queued; not submitted."""
    job_id: str = ""
    detail: str = ""


def sweep_status(spec: SweepSpec, results_dir: Path | None) -> list[RunState]:
    """Where every run of the grid is: recorded (and how), running, queued, or not submitted."""
    runs = expand(spec).runs
    store = ResultStore(results_dir_for(spec, results_dir))
    ledger = Ledger(store.jobs_dir / "ledger.json")
    launcher = make_launcher(spec.launcher, store.jobs_dir)
    open_jobs = ledger.open_jobs(launcher.kind)
    job_of = {run_id: e["job_id"] for e in open_jobs for run_id in e["run_ids"]}
    states = launcher.poll([launcher.reattach(e["job_id"]) for e in open_jobs])
    out = []
    for run in runs:
        result = store.get(run.run_id)
        if result is not None:
            first_line = result.reason.splitlines()[0] if result.reason else ""
            out.append(
                RunState(run.run_id, result.status, result.provenance.get("job_id", ""), first_line)
            )
            continue
        job_id = job_of.get(run.run_id)
        running_s = age_s(store.inflight(run.run_id) / "started.json")
        if job_id is None:
            out.append(RunState(run.run_id, "not submitted"))
        elif states.get(job_id) in ALIVE_STATES and running_s is not None:
            out.append(RunState(run.run_id, "running", job_id, f"for {running_s:.0f} s"))
        elif states.get(job_id) in ALIVE_STATES:
            out.append(RunState(run.run_id, "queued", job_id, f"job {states[job_id]}"))
        else:
            out.append(RunState(run.run_id, "not submitted", job_id, "job ended; rerun to collect"))
    return out


def progress_bar(name: str, total: int, passes: int = 1) -> Any:
    """A tqdm bar of `total` runs (None for none); tqdm imported only when one is shown.
    With `passes` > 1 (measure.rounds) a run is recorded after its last pass, so records
    come late and then fast: no rate or time left is shown, which would be wrong either way
    (a 4-minute sweep of 2 rounds showed 48 minutes left)."""
    if not total:
        return None
    from tqdm import tqdm

    timeless = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
    return tqdm(
        total=total,
        unit="run",
        desc=name if passes < 2 else f"{name} ({passes} passes: runs recorded after the last)",
        dynamic_ncols=True,
        bar_format=None if passes < 2 else timeless,
    )


def _updater(bar: Any, then: Callable[[RunResult], None]) -> Callable[[RunResult], None]:
    statuses: Counter[str] = Counter()

    def update(result: RunResult) -> None:
        then(result)
        if bar is None:
            return
        statuses[result.status] += 1
        counts = " ".join(f"{k}={v}" for k, v in sorted(statuses.items()))
        last = (
            f"last {result.tokens_per_s:,.0f} tok/s"
            if result.status == "ok" and result.tokens_per_s
            else f"last {result.status}"
        )
        bar.update(1)
        bar.set_postfix_str(f"{counts} | {last}", refresh=True)

    return update


def wait_for_earlier_jobs(spec: SweepSpec, store: ResultStore, launcher: Launcher) -> None:
    """A local search's `Driver.wait_for` before anything computes: the jobs of the ledger.
    (Without their configurations only the ranks' own watchdogs bound the wait.)"""
    if launcher.kind == "local":
        ledger = Ledger(store.jobs_dir / "ledger.json")
        Driver(store, ledger, spec, False).wait_for(launcher, _reattach(ledger, launcher, {}))


def _note_other_jobs(launcher: Launcher) -> None:
    others = launcher.other_jobs() if isinstance(launcher, LocalLauncher) else []
    if others:
        print(
            f"fsdp-bench: note: other local jobs are running on this machine (pids "
            f"{', '.join(map(str, others))}); runs timed beside busy ones are recorded contended"
        )


def _contended(result: RunResult | None) -> bool:
    return result is not None and result.contended is True


def _forget_estimates(store: ResultStore, run_ids: list[str]) -> None:
    """A cached estimate is keyed by the file that `model.name` names, not by the files that
    one imports: a rerun estimates again."""
    for run_id in run_ids:
        (store.root / "estimates" / f"{run_id}.json").unlink(missing_ok=True)
