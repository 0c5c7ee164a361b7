"""A search's trials read back: which count against the budget, the memory constraint, the
best feasible trial and the Pareto front."""

from __future__ import annotations

from typing import Any

import optuna

from fsdp_bench.config.grid import SweepSpec
from fsdp_bench.config.grid_settings import MemoryConfig
from fsdp_bench.memory.calibration import Calibration, calibration
from fsdp_bench.store import ResultStore, RunResult

INFEASIBLE_STATUSES = ("oom", "skipped")


def constraint_value(result: RunResult, memory: MemoryConfig, known: Calibration) -> float:
    """Device memory used + margin - budget, in GiB: > 0 means it did not, or would not, fit.
    Measured where the run ran (on CUDA what the card held; on CPU the tensors plus any
    configured overhead), else the estimate's device-used figure."""
    if memory.budget_gib is None:
        return 1.0 if result.status == "oom" else 0.0
    if result.status == "ok":
        used = result.device_used_peak_gib
        if used is None and result.peak_memory_gib is not None:
            used = result.peak_memory_gib + (known.configured_outside_gib or 0.0)
    else:
        used = result.estimated_device_used_gib or result.estimated_peak_gib
    if used is None:  # an OOM whose size nobody knows: at the budget, just over
        return 1e-3
    value = used + memory.margin_gib - memory.budget_gib
    return max(value, 1e-3) if result.status in INFEASIBLE_STATUSES else value


PointKey = tuple[tuple[str, str], ...]


def point_key(params: dict[str, Any]) -> PointKey:
    return tuple(sorted((k, repr(v)) for k, v in params.items()))


def counted_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials that count against the budget: the first asking of each point. A sampler
    proposing a point again is answered from the store for free, and a trial abandoned by a
    killed driver is asked again, so neither counts."""
    abandoned = set(study.user_attrs.get("abandoned_trials", []))
    seen: set[PointKey] = set()
    counted = []
    for trial in study.get_trials(deepcopy=False):
        point = point_key(trial.params)
        if trial.number in abandoned or point in seen:
            continue
        seen.add(point)
        counted.append(trial)
    return counted


def launched_run_ids(study: optuna.Study) -> list[str]:
    """Runs launched for a trial, in launch order, by this driver or one before a restart
    (whose trial was asked again): what `search.trials` counts."""
    return list(dict.fromkeys(
        str(t.user_attrs["run_id"]) for t in study.get_trials(deepcopy=False)
        if t.user_attrs.get("launched")
    ))  # fmt: skip


def best_feasible(
    study: optuna.Study, store: ResultStore, spec: SweepSpec
) -> tuple[optuna.trial.FrozenTrial, float] | None:
    """The best trial whose run ran and fits (optuna's best_trial ignores constraints)."""
    maximize = spec.search.direction == "maximize"
    known = calibration(spec.memory, store)
    best: tuple[optuna.trial.FrozenTrial, float] | None = None
    for trial, result in _completed(study, store):
        if result.status != "ok" or constraint_value(result, spec.memory, known) > 0:
            continue
        value = trial.values[0]
        if best is None or (value > best[1] if maximize else value < best[1]):
            best = (trial, value)
    return best


def feasible_run_ids(study: optuna.Study, store: ResultStore, spec: SweepSpec) -> list[str]:
    """The run ids of the completed trials whose run ran ok and fits: the candidates
    `best_feasible` chooses from, and those that can be tied with it."""
    known = calibration(spec.memory, store)
    return [
        result.run_id
        for _, result in _completed(study, store)
        if result.status == "ok" and constraint_value(result, spec.memory, known) <= 0
    ]


def _completed(
    study: optuna.Study, store: ResultStore
) -> list[tuple[optuna.trial.FrozenTrial, RunResult]]:
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    pairs = [(t, store.get(str(t.user_attrs.get("run_id")))) for t in done]
    return [(t, r) for t, r in pairs if r is not None]


def pareto_trials(
    study: optuna.Study, store: ResultStore, spec: SweepSpec
) -> list[optuna.trial.FrozenTrial]:
    """Feasible trials that no other feasible trial beats on both objectives."""
    known = calibration(spec.memory, store)
    feasible = [
        t
        for t, r in _completed(study, store)
        if r.status == "ok" and constraint_value(r, spec.memory, known) <= 0 and len(t.values) == 2
    ]
    signs = [1 if d == optuna.study.StudyDirection.MAXIMIZE else -1 for d in study.directions]

    def dominates(a: optuna.trial.FrozenTrial, b: optuna.trial.FrozenTrial) -> bool:
        pairs = [(s * x, s * y) for s, x, y in zip(signs, a.values, b.values, strict=True)]
        return all(x >= y for x, y in pairs) and any(x > y for x, y in pairs)

    unique = {t.user_attrs["run_id"]: t for t in feasible}.values()
    return [t for t in unique if not any(dominates(o, t) for o in unique if o is not t)]
