"""`fsdp-bench search`: optuna picks the points of a grid's axes, each run through the same
launcher, worker and results store as a sweep, until the fastest configuration within the
memory budget is found (the searcher, its samplers, and the trials read back)."""

from __future__ import annotations

from fsdp_bench.search.confirm import Candidate, Confirmation
from fsdp_bench.search.searcher import SearchOptions, SearchOutcome, open_study, run_search
from fsdp_bench.search.trials import (
    best_feasible,
    counted_trials,
    feasible_run_ids,
    pareto_trials,
)

__all__ = [
    "Candidate",
    "Confirmation",
    "SearchOptions",
    "SearchOutcome",
    "best_feasible",
    "counted_trials",
    "feasible_run_ids",
    "open_study",
    "pareto_trials",
    "run_search",
]
