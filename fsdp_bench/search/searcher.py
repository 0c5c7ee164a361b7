"""`fsdp-bench search`: optuna finds the fastest configuration that fits the memory budget.

A search is a sweep that samples instead of enumerating: the same expansion rules, launcher,
worker and results store. Before a trial costs a run, three cheaper answers are tried: a
point an exclude rule drops is a failed trial; a configuration already in the results store
is told its recorded result; one the estimator predicts over budget is recorded `skipped` and
told as infeasible. Only the rest run, up to `parallel` at a time, each told the moment its
record lands and replaced by a new ask at once.

Feasibility goes through a `memory` constraint on each trial (`Trial.set_constraint`: device
memory used, measured or estimated, + margin - budget <= 0), so an OOM or an over-budget peak
teaches the sampler where not to go instead of being a failure it keeps proposing. Errors and
timeouts are failed trials.

`search.trials` counts launched runs: a point predicted over budget, already recorded or
excluded is told without one and costs nothing; a point the sampler proposes again is told its
record for free, and after a few such repeats in a row the next trial is an unvisited point.

After the last trial, the best few feasible configurations are measured again, interleaved
(`search.confirm`), and the winner is named from those measurements, or a tie.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from fsdp_bench.config.grid import SweepSpec, model_runs, run_for_point, search_space
from fsdp_bench.config.grid_settings import SearchConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.errors import ConfigError, FieldError
from fsdp_bench.launch import Launcher, make_launcher
from fsdp_bench.launch.driver import Driver, Watched
from fsdp_bench.launch.ledger import Ledger
from fsdp_bench.memory.calibration import calibration
from fsdp_bench.memory.estimate import RunEstimate, estimate_runs, target_device
from fsdp_bench.memory.model_check import check_models
from fsdp_bench.memory.prediction import search_prune_reason
from fsdp_bench.search.confirm import Confirmation, confirm, skip_reason
from fsdp_bench.search.samplers import make_sampler
from fsdp_bench.search.trials import (
    INFEASIBLE_STATUSES,
    PointKey,
    best_feasible,
    constraint_value,
    counted_trials,
    launched_run_ids,
    point_key,
)
from fsdp_bench.store import EstimatedPeaks, ResultStore, RunResult
from fsdp_bench.study_storage import JOURNAL, storage_for
from fsdp_bench.sweep import results_dir_for, wait_for_earlier_jobs

REPEATS_BEFORE_EXPLORING = 3
"""Known points proposed in a row before the next trial is an unvisited point instead."""
MAX_REPEATS_PER_TRIAL = 20
"""A safety stop: known points proposed this many times per budgeted trial."""
MAX_FREE_PER_LAUNCH = 20
"""A safety stop: points answered without a launch, per budgeted launch."""


@dataclass
class SearchOptions:
    results_dir: Path | None = None
    storage: str | None = None
    """An optuna storage URL; default: a journal file beside the results (optuna-dashboard
    reads it)."""
    prune: bool = True
    """Ask the estimator before launching; trials predicted over budget cost no run."""
    verify: bool = False
    progress: bool = True


@dataclass
class SearchOutcome:
    study: optuna.Study
    results_dir: Path
    counts: Counter[str] = field(default_factory=Counter)
    """launched, pruned (predicted over budget), infeasible (measured), failed, from_store,
    excluded: how each trial was answered."""
    storage: str = ""
    """Where the study lives: the journal file, or the --storage URL."""
    confirmation: Confirmation | None = None
    """The top configurations measured again (`search.confirm`); None: no round."""
    confirm_skipped: str = ""
    """Why there was no confirmation round ("" when there was one)."""


def run_search(
    spec: SweepSpec, options: SearchOptions, launcher: Launcher | None = None
) -> SearchOutcome:
    """Run the study to `search.trials` trials (a rerun continues it).

    `launcher` replaces the grid's (the search-efficiency benchmark replays a recorded table).
    """
    settings = spec.search
    spec = dataclasses.replace(
        spec, launcher=dataclasses.replace(spec.launcher, max_jobs_in_flight=settings.parallel)
    )
    store = ResultStore(results_dir_for(spec, options.results_dir))
    launcher = launcher or make_launcher(spec.launcher, store.jobs_dir)
    first = model_runs(spec)
    for run in first[:1]:  # no scheduler here: one line, before the study is written
        launcher.check(run.world_size, run.nodes)
    wait_for_earlier_jobs(spec, store, launcher)  # a job a killed driver left still timing
    check_models(first)  # a broken model stops here: nothing launched, nothing written
    store.save_grid(spec.source)
    study = open_study(spec, store, options.storage)
    # what `report` applies, command-line overrides included (grid.yaml has the file's)
    study.set_user_attr("budget_gib", spec.memory.budget_gib)
    study.set_user_attr("metric", settings.metric)
    ledger = Ledger(store.jobs_dir / "ledger.json")
    searcher = Searcher(spec, study, store, options)
    driver = Driver(store, ledger, spec, options.verify, on_record=searcher.on_record)
    searcher.driver = driver
    watched = searcher.recover(ledger, launcher)
    for item in watched:
        driver.estimates.update(searcher.estimated_peaks(item.runs))
    try:
        driver.run(launcher, watched, [], supply=searcher.supply)
    finally:
        searcher.close()
    where = options.storage or str(store.root / JOURNAL)
    outcome = SearchOutcome(study, store.root, searcher.counts, where)
    outcome.confirm_skipped = skip_reason(settings)
    if not outcome.confirm_skipped:
        outcome.confirmation = confirm(spec, study, store, launcher, ledger, options.progress)
    return outcome


def open_study(spec: SweepSpec, store: ResultStore, storage_url: str | None) -> optuna.Study:
    """The grid's study, created or loaded (a rerun continues it)."""
    storage = storage_for(store.root, storage_url)
    settings = spec.search
    directions = [settings.direction] + (["minimize"] if settings.multi_objective else [])
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(
        study_name=spec.name,
        storage=storage,
        sampler=make_sampler(spec),
        directions=directions,
        load_if_exists=True,
    )


class Searcher:
    """Asks optuna for points, answers them as cheaply as possible, tells the results."""

    def __init__(
        self, spec: SweepSpec, study: optuna.Study, store: ResultStore, options: SearchOptions
    ) -> None:
        self.spec = spec
        self.settings: SearchConfig = spec.search
        self.study = study
        self.store = store
        self.options = options
        self.space = search_space(spec)
        if not self.space:
            raise ConfigError(f"{spec.source}: axes: a search needs at least one axis")
        self.space_size = math.prod(len(values) for values in self.space.values())
        self.known = calibration(spec.memory, store)
        self.device_type = target_device(spec.launcher)
        self.driver: Driver | None = None
        self.pending: dict[str, list[optuna.trial.Trial]] = {}
        self.watched_runs: set[str] = set()
        """Runs in jobs an earlier driver submitted: a trial asking for one waits for it."""
        self.counts: Counter[str] = Counter()
        self.repeats_in_a_row = 0
        found = best_feasible(study, store, spec)  # from earlier sessions; then kept as told
        self.best_value: float | None = found[1] if found else None
        self.bar: Any = None
        if options.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=self.settings.trials, unit="trial", desc=spec.name)
            self.bar.n = min(self._finished(), self.settings.trials)

    # the driver's hooks

    def supply(self, free: int) -> list[list[RunConfig]] | None:
        """Up to `free` runs to launch; None when the trial budget is spent."""
        runs: list[RunConfig] = []
        while len(runs) < free and not self._budget_spent():
            run = self._ask()
            if run is not None:
                runs.append(run)
        if not runs and self._budget_spent():
            return None
        return [[run] for run in runs]

    def on_record(self, result: RunResult) -> None:
        """Tell the trials waiting for this run; what it measured corrects the estimates of
        the points asked from now on (`Calibration.learn`)."""
        self.known = self.known.learn(result)
        self.watched_runs.discard(result.run_id)
        for trial in self.pending.pop(result.run_id, []):
            self._tell(trial, result)

    # asking

    def _ask(self) -> RunConfig | None:
        """One trial; the run to launch, or None when it was answered without one."""
        visited = {point_key(t.params) for t in counted_trials(self.study)}
        if self.repeats_in_a_row >= REPEATS_BEFORE_EXPLORING:
            unvisited = self._unvisited_point(visited)
            if unvisited is not None:
                self.study.enqueue_trial(unvisited, skip_if_exists=False)
            self.repeats_in_a_row = 0
        trial = self.study.ask()
        point = {k: trial.suggest_categorical(k, list(v)) for k, v in self.space.items()}
        self.repeats_in_a_row = self.repeats_in_a_row + 1 if point_key(point) in visited else 0
        try:
            run = run_for_point(self.spec, point)
            if run is not None:
                run.check_device(self.device_type)
        except FieldError as err:
            self._fail(trial, "excluded", f"not a valid run: {err}")
            return None
        if run is None:
            self._fail(trial, "excluded", "an exclude rule drops this point")
            return None
        trial.set_user_attr("run_id", run.run_id)
        recorded = self.store.get(run.run_id)
        if recorded is not None:
            self.counts["from_store"] += 1
            self._tell(trial, recorded, count=False)
            return None
        if run.run_id in self.pending or run.run_id in self.watched_runs:
            self.pending.setdefault(run.run_id, []).append(trial)  # in flight already
            return None
        self.pending[run.run_id] = [trial]
        estimate = self._estimate(run)
        prediction = estimate.predict(self.known, run)
        reason = search_prune_reason(prediction, self.spec.memory) if self.options.prune else ""
        assert self.driver is not None
        self.driver.estimates[run.run_id] = estimate.peaks(self.known, run, self.spec.memory)
        if reason:
            self.counts["pruned"] += 1
            self.driver.record_unlaunched(run, "skipped", reason, {"trial": trial.number})
            return None
        self.counts["launched"] += 1
        trial.set_user_attr("launched", True)
        return run

    def _unvisited_point(self, visited: set[PointKey]) -> dict[str, Any] | None:
        """A random point no trial has asked for (a sampler stuck on known points would
        otherwise spend the budget re-telling them); None when none is found."""
        rng = random.Random(f"{self.settings.seed}-{len(visited)}")
        for _ in range(min(10 * self.space_size, 10_000)):
            point = {k: rng.choice(list(v)) for k, v in self.space.items()}
            if point_key(point) not in visited:
                return point
        return None

    def _estimate(self, run: RunConfig) -> RunEstimate:
        return self._estimates([run])[run.run_id]

    def estimated_peaks(self, runs: list[RunConfig]) -> dict[str, EstimatedPeaks]:
        found = self._estimates(runs)
        by_id = {run.run_id: run for run in runs}
        return {k: e.peaks(self.known, by_id[k], self.spec.memory) for k, e in found.items()}

    def _estimates(self, runs: list[RunConfig]) -> dict[str, RunEstimate]:
        return estimate_runs(runs, self.store.root / "estimates", device_type=self.device_type)

    # telling

    def _tell(self, trial: optuna.trial.Trial, result: RunResult, count: bool = True) -> None:
        """Values for a run that happened (or was predicted not to fit); FAIL for errors."""
        if result.status != "ok" and result.status not in INFEASIBLE_STATUSES:
            first_line = result.reason.splitlines()[0] if result.reason else ""
            self._fail(trial, "failed", f"{result.status}: {first_line}")
            return
        value = getattr(result, self.settings.metric, None) if result.status == "ok" else None
        if value is None:
            value = 0.0 if self.settings.direction == "maximize" else math.inf
        values = [float(value)]
        if self.settings.multi_objective:
            values.append(float(result.peak_memory_gib or result.estimated_peak_gib or math.inf))
        constraint = constraint_value(result, self.spec.memory, self.known)
        if count and constraint > 0 and result.status != "skipped":
            self.counts["infeasible"] += 1  # measured: an OOM, or a peak over the budget
        trial.set_constraint("memory", constraint)
        self.study.tell(trial, values)
        if result.status == "ok" and constraint <= 0:
            self._note_feasible(values[0])
        self._advance()

    def _note_feasible(self, value: float) -> None:
        maximize = self.settings.direction == "maximize"
        best = self.best_value
        if best is None or (value > best if maximize else value < best):
            self.best_value = value

    def _fail(self, trial: optuna.trial.Trial, kind: str, reason: str) -> None:
        self.counts[kind] += 1
        trial.set_user_attr("failure", reason)
        self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        self._advance()

    def _advance(self) -> None:
        if self.bar is not None:
            self.bar.n = min(self._finished(), self.settings.trials)
            self.bar.set_postfix_str(self._postfix(), refresh=True)

    def _postfix(self) -> str:
        counts = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        shown = f" | best {self.best_value:,.4g}" if self.best_value is not None else ""
        return f"{counts} in flight={sum(map(len, self.pending.values()))}{shown}"

    # restart

    def recover(self, ledger: Ledger, launcher: Launcher) -> list[Watched]:
        """After a restart: trials the earlier driver left running are asked again (their
        first asking is set aside, never counted twice); their runs, if still in a job, are
        followed there rather than launched again."""
        running = (optuna.trial.TrialState.RUNNING,)
        for frozen in self.study.get_trials(deepcopy=False, states=running):
            abandoned = self.study.user_attrs.get("abandoned_trials", [])
            self.study.set_user_attr("abandoned_trials", [*abandoned, frozen.number])
            self.study.tell(frozen.number, state=optuna.trial.TrialState.FAIL)
            self.study.enqueue_trial(dict(frozen.params), skip_if_exists=False)
        watched = []
        for entry in ledger.open_jobs(launcher.kind):
            runs = [r for r in map(self._run_of_id, entry["run_ids"]) if r is not None]
            watched.append(Watched(job=launcher.reattach(entry["job_id"]), runs=runs))
            self.watched_runs.update(r.run_id for r in runs)
        return watched

    def _run_of_id(self, run_id: str) -> RunConfig | None:
        """The configuration of a run the ledger names (from the trial that asked for it)."""
        for trial in self.study.get_trials(deepcopy=False):
            if trial.user_attrs.get("run_id") == run_id:
                return run_for_point(self.spec, dict(trial.params))
        return None

    def _asked(self) -> int:
        return len(counted_trials(self.study))

    def _finished(self) -> int:
        return sum(1 for run_id in launched_run_ids(self.study) if self.store.has(run_id))

    def _budget_spent(self) -> bool:
        """`search.trials` runs launched, every point of the space asked, or (safety stops)
        the sampler keeps repeating itself or answering points without a launch. Points
        answered without one (predicted over budget, recorded already, excluded) are free."""
        asked, launched = self._asked(), len(launched_run_ids(self.study))
        repeats = len(self.study.get_trials(deepcopy=False)) - asked
        limit = self.settings.trials
        return (
            launched >= limit
            or asked >= self.space_size
            or asked - launched >= MAX_FREE_PER_LAUNCH * limit
            or repeats >= MAX_REPEATS_PER_TRIAL * limit
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
