"""`search.sampler: additive`: an optimistic ranking of the whole grid on a model of the
metric that adds one effect per axis value, in log space.

Why this shape: FSDP2's knobs mostly multiply throughput (a larger world size, no activation
recomputation, a larger micro-batch, keeping parameters gathered each speed a run up by a
factor, largely apart from the others), and the fastest of them use the most memory. So the
model ranks every point of the grid, and the sampler proposes the best point not yet asked.
The search answers a point its estimate puts over the budget without a launch (free), so
walking down the ranking ends at the fastest points that fit: the memory edge, where TPE,
which models good and bad regions, hesitates because the infeasible and the best points are
neighbours.

The model is Bayesian linear regression on one-hot features of the categorical axes, with a
prior of +-`PRIOR_EFFECT` per value and a noise of `NOISE`. A point's score is its posterior
mean plus `OPTIMISM` standard deviations (an upper confidence bound): a value no run has
measured looks as good as the prior allows, so the first runs cover every value of every
axis, and later runs go where the measured effects add up to the most. Runs that did not run
(an OOM, predicted over budget, failed) teach it nothing about speed; those that ran over the
budget do. Measured on replay tables it was not tuned on: `benchmarks/search_efficiency.py`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

PRIOR_EFFECT = 0.5
"""Prior standard deviation of one value's effect on the log metric (a factor of e^0.5)."""
NOISE = 0.1
"""Standard deviation of what the additive model cannot explain: measurement noise and the
axes' interactions, in log space (about 10%)."""
OPTIMISM = 1.0
"""Posterior standard deviations added to a point's mean; 2 explored too long on the replay
tables (6 of 10 seeds found the best with a 10% random memory error, against 9 at 1)."""
MAX_CANDIDATES = 20_000
"""Points ranked per proposal; a larger grid is ranked on a random subset of this size."""


class AdditiveSampler(optuna.samplers.BaseSampler):
    """Proposes the unasked point of `space` with the highest upper confidence bound.

    `space` maps each axis to its values, in the order the searcher suggests them. Ties (all
    of them before the first run) are broken at random, from `seed`."""

    def __init__(
        self,
        space: Mapping[str, Sequence[Any]],
        direction: str = "maximize",
        seed: int | None = None,
    ) -> None:
        self.space = {name: list(values) for name, values in space.items()}
        self.sign = 1.0 if direction == "maximize" else -1.0
        self.rng = np.random.default_rng(seed)
        self.columns = [(name, repr(value)) for name, values in self.space.items()
                        for value in values]  # fmt: skip
        self.column_of = {key: i for i, key in enumerate(self.columns)}

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return {name: CategoricalDistribution(values) for name, values in self.space.items()}

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        trials = study.get_trials(deepcopy=False)
        asked = {self._key(t.params) for t in trials if t.number != trial.number}
        candidates = [p for p in self._candidates() if self._key(p) not in asked]
        if not candidates:
            return {}  # every point asked: the searcher stops on its own
        measured = [(t.params, v) for t in trials if (v := self._log_metric(t)) is not None]
        mean, covariance = self._posterior(measured)
        features = np.array([self._features(point) for point in candidates])
        spread = np.sqrt(np.einsum("ij,jk,ik->i", features, covariance, features))
        tie_break = 1e-9 * self.rng.random(len(candidates))
        return candidates[int(np.argmax(features @ mean + OPTIMISM * spread + tie_break))]

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        """Only an axis outside `space` gets here; any of its values will do."""
        assert isinstance(param_distribution, CategoricalDistribution)
        choices = param_distribution.choices
        return choices[int(self.rng.integers(len(choices)))]

    def _candidates(self) -> list[dict[str, Any]]:
        names = list(self.space)
        size = math.prod(len(v) for v in self.space.values())
        if size <= MAX_CANDIDATES:
            combos = itertools.product(*self.space.values())
            return [dict(zip(names, combo, strict=True)) for combo in combos]
        picks = [self.rng.integers(len(v), size=MAX_CANDIDATES) for v in self.space.values()]
        return [
            {name: self.space[name][int(p[i])] for name, p in zip(names, picks, strict=True)}
            for i in range(MAX_CANDIDATES)
        ]

    def _posterior(
        self, measured: list[tuple[dict[str, Any], float]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Mean and covariance of the effects given the measured runs (zero mean before any).
        The intercept is the mean measured log metric, so the prior is on effects only."""
        precision = np.eye(len(self.columns)) / PRIOR_EFFECT**2
        mean = np.zeros(len(self.columns))
        if measured:
            x = np.array([self._features(params) for params, _ in measured])
            y = np.array([value for _, value in measured])
            precision = precision + x.T @ x / NOISE**2
            mean = np.linalg.solve(precision, x.T @ (y - y.mean()) / NOISE**2)
        return mean, np.linalg.inv(precision)

    def _features(self, params: dict[str, Any]) -> np.ndarray:
        row = np.zeros(len(self.columns))
        for name, value in params.items():
            column = self.column_of.get((name, repr(value)))
            if column is not None:
                row[column] = 1.0
        return row

    def _log_metric(self, trial: FrozenTrial) -> float | None:
        """The signed log metric of a run that ran (an infeasible point told 0 or inf did
        not); None for any other trial."""
        if trial.state != TrialState.COMPLETE or not trial.values:
            return None
        value = trial.values[0]
        if not (math.isfinite(value) and value > 0):
            return None
        return self.sign * math.log(value)

    def _key(self, params: dict[str, Any]) -> tuple[str, ...]:
        return tuple(repr(params.get(name)) for name in self.space)
