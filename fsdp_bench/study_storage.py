"""Where a search's optuna study lives: a journal file in its results folder, or a database.

`fsdp-bench search` opens the study here and `fsdp-bench report` reads it back from here, so
both find the same study. A journal needs no lock to read and can be read while the search
is still running; optuna-dashboard opens it too.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_bench.errors import ConfigError

if TYPE_CHECKING:
    import optuna

JOURNAL = "study.journal"


def storage_for(results_dir: Path, storage_url: str | None) -> optuna.storages.BaseStorage:
    """The `--storage URL` database, else the journal file in the results folder."""
    if storage_url is not None:
        return database_storage(storage_url)
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    results_dir.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(results_dir / JOURNAL)))


def load_study(
    results_dir: Path, name: str | None, storage_url: str | None = None
) -> optuna.Study | None:
    """The study of a search (its grid's name, else the only one); None for a sweep."""
    import optuna

    if storage_url is None and not (results_dir / JOURNAL).exists():
        return None
    storage = storage_for(results_dir, storage_url)
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
