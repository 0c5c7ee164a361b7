"""`search.sampler: additive` (fsdp_bench.search.additive): it proposes each point once, covers
every value before it exploits, and walks to the best point of a table whose speed multiplies
per axis, the shape FSDP2's knobs have."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import optuna
import pytest

from fsdp_bench.config.grid_settings import SearchConfig
from fsdp_bench.search.additive import AdditiveSampler

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPACE = {"world_size": [2, 4, 8, 16], "ac": ["none", "selective", "full"],
         "micro_batch": [1, 2, 4, 8], "reshard": [True, False]}  # fmt: skip


def ask(study: optuna.Study) -> tuple[optuna.trial.Trial, dict[str, Any]]:
    trial = study.ask()
    return trial, {name: trial.suggest_categorical(name, values) for name, values in SPACE.items()}


def multiplicative_speed(point: dict[str, Any], seed: int) -> float:
    """A random factor per axis value, times a small interaction the model cannot see."""
    rng = random.Random(seed)
    factors = {(name, repr(v)): rng.uniform(0.5, 2.0) for name, values in SPACE.items()
               for v in values}  # fmt: skip
    speed = math.prod(factors[(name, repr(v))] for name, v in point.items())
    return speed * (1.0 + 0.03 * rng.random() * (point["reshard"] is True))


def test_every_point_is_proposed_once() -> None:
    study = optuna.create_study(direction="maximize", sampler=AdditiveSampler(SPACE, seed=0))
    points = 96
    seen = set()
    for _ in range(points):
        trial, point = ask(study)
        seen.add(tuple(point.values()))
        study.tell(trial, 1.0)
    assert len(seen) == points


def test_the_first_runs_cover_every_value_of_every_axis() -> None:
    """Optimism: a value no run has measured scores above one measured at the average, so the
    first four runs (the longest axis has four values) try each value of each axis."""
    study = optuna.create_study(direction="maximize", sampler=AdditiveSampler(SPACE, seed=3))
    asked = []
    for _ in range(4):
        trial, point = ask(study)
        asked.append(point)
        study.tell(trial, 100.0)
    for name, values in SPACE.items():
        assert {repr(p[name]) for p in asked} == {repr(v) for v in values}, name


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("direction", ["maximize", "minimize"])
def test_it_finds_the_best_of_a_multiplicative_table_in_a_fifth_of_it(
    seed: int, direction: str
) -> None:
    points = [dict(zip(SPACE, combo, strict=True)) for combo in itertools.product(*SPACE.values())]
    speed = {tuple(p.values()): multiplicative_speed(p, seed) for p in points}
    value = speed if direction == "maximize" else {k: 1.0 / v for k, v in speed.items()}
    best = max(speed, key=speed.__getitem__)
    study = optuna.create_study(direction=direction, sampler=AdditiveSampler(SPACE, direction, 0))
    asked = []
    for _ in range(len(points) // 5):
        trial, point = ask(study)
        asked.append(tuple(point.values()))
        study.tell(trial, value[asked[-1]])
    assert best in asked, f"best not launched in {len(asked)} of {len(points)}"


@pytest.mark.parametrize("seed", range(3))
def test_a_point_that_did_not_run_teaches_nothing_about_speed(seed: int) -> None:
    """A point told 0 (over the budget, an OOM) is left out of the model, so its values stay
    unmeasured and the next four runs cover each of them. Learned as a tiny speed (1e-6
    instead of 0), none of its values would come back in those four."""
    study = optuna.create_study(direction="maximize", sampler=AdditiveSampler(SPACE, seed=seed))
    trial, first = ask(study)
    study.tell(trial, 0.0)
    later = []
    for _ in range(4):
        trial, point = ask(study)
        later.append(point)
        study.tell(trial, 50.0)
    for name in SPACE:
        assert any(p[name] == first[name] for p in later), name


def test_the_default_sampler_is_additive_with_one_objective_and_tpe_with_two() -> None:
    assert SearchConfig().sampler_name == "additive"
    assert SearchConfig(multi_objective=True).sampler_name == "tpe"
    assert SearchConfig(sampler="random", multi_objective=True).sampler_name == "random"
