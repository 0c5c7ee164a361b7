"""A search's optuna study as plain data for the report: trials as a table, importances."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:
    import optuna

log = logging.getLogger(__name__)


def trial_table(study: optuna.Study) -> pd.DataFrame:
    """One row per trial: number, state, value (the first objective), feasible, run_id."""
    rows = []
    for trial in study.get_trials(deepcopy=False):
        values = trial.values
        rows.append(
            {
                "number": trial.number,
                "state": trial.state.name,
                "value": float(values[0]) if values else float("nan"),
                "feasible": all(v <= 0 for v in trial.constraints.values()),
                "run_id": trial.user_attrs.get("run_id"),
            }
        )
    return pd.DataFrame(rows, columns=["number", "state", "value", "feasible", "run_id"])


def maximizes(study: optuna.Study) -> bool:
    import optuna

    return bool(study.directions[0] == optuna.study.StudyDirection.MAXIMIZE)


def importances(study: optuna.Study) -> tuple[dict[str, float], str]:
    """optuna's parameter importances for the first objective over feasible completed trials,
    or ({}, why not)."""
    import optuna

    complete = [
        t
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if all(v <= 0 for v in t.constraints.values())
    ]
    varied = {
        k for t in complete for k in t.params if len({str(u.params.get(k)) for u in complete}) > 1
    }
    if len(complete) < 3 or not varied:
        return {}, (
            f"{len(complete)} feasible completed trials; importance needs 3 or more "
            "with parameters that vary"
        )
    # A single-objective copy: the evaluator then reads the direction from the study.
    feasible_study = optuna.create_study(direction=study.directions[0])
    feasible_study.add_trials(
        optuna.trial.create_trial(
            params=t.params, distributions=t.distributions, value=float(t.values[0])
        )
        for t in complete
    )
    try:
        found = optuna.importance.get_param_importances(feasible_study)
    except (RuntimeError, ValueError) as err:
        log.info("parameter importance failed: %s", err)
        return {}, f"optuna could not compute importances: {err}"
    return {k: float(v) for k, v in found.items()}, ""
