"""Which optuna sampler proposes a search's points, set up for a grid's small, costly space."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import optuna

from fsdp_bench.config.grid import SweepSpec, search_space
from fsdp_bench.errors import ConfigError
from fsdp_bench.search.additive import AdditiveSampler


def make_sampler(spec: SweepSpec) -> optuna.samplers.BaseSampler:
    """Constraint-aware samplers read each trial's `memory` constraint (set when told)."""
    settings = spec.search
    match settings.sampler_name:
        case "tpe":
            return optuna.samplers.TPESampler(
                seed=settings.seed,
                multivariate=True,
                n_startup_trials=startup_trials(spec),
            )
        case "additive":
            if settings.multi_objective:
                raise ConfigError(
                    "search.sampler: 'additive' is single-objective; use tpe or random"
                )
            return AdditiveSampler(
                search_space(spec), direction=settings.direction, seed=settings.seed
            )
        case "random":
            return optuna.samplers.RandomSampler(seed=settings.seed)
        case "grid":
            grid = {k: list(v) for k, v in search_space(spec).items()}
            return AskTellGridSampler(grid, seed=settings.seed)
        case "gp":
            if settings.multi_objective:
                raise ConfigError("search.sampler: 'gp' is single-objective; use tpe or random")
            if importlib.util.find_spec("scipy") is None:
                raise ConfigError(
                    "search.sampler: 'gp' needs scipy: pip install 'fsdp-bench[gp]' (or use tpe)"
                )
            return optuna.samplers.GPSampler(seed=settings.seed)
        case other:
            raise ConfigError(f"search.sampler: {other!r} is not supported")


class AskTellGridSampler(optuna.samplers.GridSampler):
    """optuna's grid order without its `study.stop()` once the grid is covered, which only
    works inside `study.optimize`; the search stops at its own budget."""

    def after_trial(self, *args: Any, **kwargs: Any) -> None:
        return None


def startup_trials(spec: SweepSpec) -> int:
    """Random trials before TPE models the space: few, since a grid's space is small and
    every trial is a real run (3 below 64 points, 10 from 160)."""
    points = math.prod(len(values) for values in search_space(spec).values())
    return max(3, min(10, min(points, spec.search.trials) // 16))
