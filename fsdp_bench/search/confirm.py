"""The search's confirmation round: the best few trials measured again, interleaved.

Each trial is one measurement, and the best of many noisy measurements is biased towards the
luckiest, so the search's last step measures the top `search.confirm_top_k` feasible
configurations again: copies of their runs with `measure.rounds = search.confirm_rounds`
(another run id each, so the trial records stay as they were and a rerun finds these), the
runs of one shape (world size, nodes) packed into one job, which times them in passes (all
once, then all again), so a slow drift of the machine hits every candidate alike. Runs of
different shapes cannot share a process group: they are measured in separate jobs, and
interleaved only within their shape.

The winner is the fastest confirmed run by median tokens/s; the others that
`stats.indistinguishable` cannot tell apart from it are tied with it. A confirmation run
that fails, or no longer fits the budget, is reported and does not compete.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import optuna

from fsdp_bench.config.grid import SweepSpec
from fsdp_bench.config.grid_settings import SearchConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.config.schema import build
from fsdp_bench.errors import FsdpBenchError, one_line
from fsdp_bench.launch import Launcher
from fsdp_bench.launch.driver import Driver
from fsdp_bench.launch.ledger import Ledger
from fsdp_bench.memory.calibration import calibration
from fsdp_bench.search.trials import constraint_value, feasible_run_ids
from fsdp_bench.stats import Estimate, indistinguishable, pass_noise, pass_values
from fsdp_bench.store import EstimatedPeaks, ResultStore, RunResult
from fsdp_bench.sweep import progress_bar

CONFIRMED_METRIC = "tokens_per_s"
"""What the confirmation compares: the metric whose record carries a 95% interval."""


@dataclass(frozen=True)
class Candidate:
    """One configuration of the top k: its trial's record and its confirmation record."""

    trial: RunResult
    confirmed: RunResult | None = None
    """None: no record landed (the round was cut short by a launcher error)."""
    fits: bool = True
    """Whether the confirmation record is within the memory budget."""

    @property
    def competes(self) -> bool:
        c = self.confirmed
        return c is not None and c.status == "ok" and c.tokens_per_s is not None and self.fits

    @property
    def estimate(self) -> Estimate:
        """The confirmed tokens/s with its interval (only for a candidate that competes)."""
        assert self.confirmed is not None and self.competes
        return estimate_of(self.confirmed)

    @property
    def problem(self) -> str:
        """Why a candidate does not compete ("" when it does)."""
        c = self.confirmed
        if c is None:
            return "not measured"
        if c.status != "ok":
            first_line = c.reason.splitlines()[0] if c.reason else ""
            return f"{c.status}: {first_line}".rstrip(": ")
        if c.tokens_per_s is None:
            return "no tokens/s in its record"
        return "" if self.fits else f"peak {c.peak_memory_gib} GiB is over the budget"


@dataclass
class Confirmation:
    """The round's outcome: candidates best trial first, the winner, those tied with it."""

    rounds: int
    candidates: list[Candidate] = field(default_factory=list)
    winner: Candidate | None = None
    tied: list[Candidate] = field(default_factory=list)
    """Confirmed runs `stats.indistinguishable` cannot tell from the winner, fastest first."""
    shapes: int = 0
    """Distinct (world size, nodes) among the candidates: one interleaved job each."""
    error: str = ""
    """A launcher error that stopped the round (the records that landed still count)."""

    @property
    def trial_best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    @property
    def failed(self) -> list[Candidate]:
        return [c for c in self.candidates if not c.competes]

    @property
    def winner_differs(self) -> bool:
        """The confirmed winner is not the configuration the trials ranked first."""
        best = self.trial_best
        return self.winner is not None and best is not None and self.winner is not best


def skip_reason(settings: SearchConfig) -> str:
    """Why this search has no confirmation round; "" when it has one."""
    if settings.confirm_top_k == 0:
        return "search.confirm_top_k is 0"
    if settings.multi_objective:
        return "a multi-objective search reports its Pareto front instead"
    if settings.metric != CONFIRMED_METRIC:
        return f"it compares {CONFIRMED_METRIC} (search.metric is {settings.metric})"
    return ""


def top_feasible(study: optuna.Study, store: ResultStore, spec: SweepSpec) -> list[RunResult]:
    """The trial records of the `search.confirm_top_k` best distinct configurations that ran
    ok within the budget, best first (a point asked twice is one configuration)."""
    settings = spec.search
    records = [store.get(run_id) for run_id in dict.fromkeys(feasible_run_ids(study, store, spec))]
    found = [r for r in records if r is not None and getattr(r, settings.metric) is not None]
    sign = -1.0 if settings.direction == "maximize" else 1.0
    found.sort(key=lambda r: sign * float(getattr(r, settings.metric)))
    return found[: settings.confirm_top_k]


def confirmation_run(run: RunConfig, rounds: int) -> RunConfig:
    """The run measured in `rounds` passes: another run id, the same configuration. A run
    already measured in that many passes gets one more, or its copy would be itself."""
    passes = rounds if run.measure.rounds != rounds else rounds + 1
    return dataclasses.replace(run, measure=dataclasses.replace(run.measure, rounds=passes))


def estimate_of(result: RunResult) -> Estimate:
    """A record's tokens/s with its interval and step spread (`stats`' inputs)."""
    assert result.tokens_per_s is not None
    return Estimate(
        value=result.tokens_per_s,
        low=result.tokens_per_s_ci_low,
        high=result.tokens_per_s_ci_high,
        spread_pct=result.step_time_spread_pct,
        pass_values=pass_values(result.tokens_per_s, result.step_time_s, result.round_step_time_s),
    )


def decide(
    trials: list[RunResult],
    confirmed: dict[str, RunResult | None],
    fits: Callable[[RunResult], bool],
    rounds: int,
) -> Confirmation:
    """The winner and those tied with it, from the trial records (best first) and their
    confirmation records (by trial run id). Pure: tests hand it records."""
    candidates = []
    for trial in trials:
        record = confirmed.get(trial.run_id)
        ok = record is None or record.status != "ok" or fits(record)
        candidates.append(Candidate(trial=trial, confirmed=record, fits=ok))
    shapes = {(t.config.get("world_size"), t.config.get("nodes")) for t in trials}
    outcome = Confirmation(rounds=rounds, candidates=candidates, shapes=len(shapes))
    competing = [c for c in candidates if c.competes]
    if not competing:
        return outcome
    competing.sort(key=lambda c: -c.estimate.value)  # stable: equals keep the trials' order
    winner, others = competing[0], competing[1:]
    outcome.winner = winner
    noise = pass_noise([c.estimate for c in competing])
    outcome.tied = [
        c for c in others if indistinguishable(winner.estimate, c.estimate, noise, len(others))
    ]
    return outcome


def confirm(
    spec: SweepSpec,
    study: optuna.Study,
    store: ResultStore,
    launcher: Launcher,
    ledger: Ledger,
    progress: bool = False,
) -> Confirmation:
    """Measure the top k again, interleaved within each shape, and decide. Runs already
    recorded (an earlier session's round) are reused; a launcher error ends the round with
    what landed, reported, not raised."""
    settings = spec.search
    trials = top_feasible(study, store, spec)
    runs = {t.run_id: confirmation_run(build(RunConfig, t.config), settings.confirm_rounds)
            for t in trials}  # fmt: skip
    todo = [run for run in runs.values() if not store.has(run.run_id)]
    by_shape: dict[tuple[int, int], list[RunConfig]] = {}
    for run in todo:
        by_shape.setdefault((run.world_size, run.nodes), []).append(run)
    peaks = {
        runs[t.run_id].run_id: EstimatedPeaks(*(getattr(t, f) for f in EstimatedPeaks._fields))
        for t in trials
    }
    rounds = settings.confirm_rounds
    bar = progress_bar("confirm", len(todo), rounds) if progress else None
    on_record = (lambda _: bar.update(1)) if bar is not None else None
    driver = Driver(store, ledger, spec, verify=False, on_record=on_record, estimates=peaks)
    error = ""
    try:
        driver.run(launcher, [], list(by_shape.values()))
    except FsdpBenchError as err:
        error = one_line(err)
    finally:
        if bar is not None:
            bar.close()
    known = calibration(spec.memory, store)
    outcome = decide(
        trials,
        {trial_id: store.get(run.run_id) for trial_id, run in runs.items()},
        lambda r: constraint_value(r, spec.memory, known) <= 0,
        settings.confirm_rounds,
    )
    outcome.error = error
    return outcome
