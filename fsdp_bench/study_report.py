"""A search's optuna study, read back for the report: trials as a table, importances.

`fsdp-bench search` keeps its study in `<results>/study.journal` (named after the grid);
reading it needs no lock and works while the search is still running.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from fsdp_bench.errors import ConfigError

if TYPE_CHECKING:
    import optuna

log = logging.getLogger(__name__)

JOURNAL = "study.journal"


def load_study(
    results_dir: Path, name: str | None, storage_url: str | None = None
) -> optuna.Study | None:
    """The study of a search: from `storage_url` when the search had `--storage`, else the
    journal in its results folder; None for a sweep."""
    import optuna

    storage: optuna.storages.BaseStorage
    if storage_url is not None:
        storage = database_storage(storage_url)
    else:
        path = results_dir / JOURNAL
        if not path.exists():
            return None
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        storage = JournalStorage(JournalFileBackend(str(path)))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = optuna.get_all_study_names(storage)
    if not names:
        return None
    chosen = name if name in names else names[0]
    return optuna.load_study(study_name=chosen, storage=storage)


def database_storage(url: str) -> optuna.storages.BaseStorage:
    """optuna's RDB storage for `--storage URL`, or a one-line error naming the URL."""
    import optuna

    try:
        return optuna.storages.RDBStorage(url)
    except Exception as err:  # sqlalchemy's and the drivers' errors have no common base
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(
            f"--storage: {url!r} is not a usable database URL ({reason}); "
            "expected e.g. sqlite:///study.db or postgresql://user@host/db"
        ) from err


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
