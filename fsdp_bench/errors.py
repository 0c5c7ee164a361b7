"""One exception root for everything a user can cause or fix.

The CLI turns a `FsdpBenchError` into one line on stderr and its `exit_code`; anything else is
a bug and keeps its traceback. Messages name the offending key or value and what is allowed.
"""

from __future__ import annotations


class FsdpBenchError(Exception):
    """Root of the errors a user can act on."""

    exit_code: int = 1


class ConfigError(FsdpBenchError):
    """A grid, launcher or run configuration that cannot be run as written."""

    exit_code = 2


class FieldError(ConfigError):
    """A bad value at a key path; `where` is filled in as the error travels up the config tree."""

    def __init__(self, key: str, value: object, allowed: str, *, unknown_key: bool = False) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        self.unknown_key = unknown_key
        self.where = ""
        super().__init__(self._format())

    def _format(self) -> str:
        prefix = f"{self.where}: " if self.where else ""
        if self.unknown_key:
            return f"{prefix}{self.key}: unknown key; {self.allowed}"
        return f"{prefix}{self.key}: {show(self.value)} is not allowed; {self.allowed}"

    def under(self, parent: str) -> FieldError:
        """Prefix the key path with `parent` (a section name or list index)."""
        if parent:
            joiner = "" if self.key.startswith("[") else "."
            self.key = f"{parent}{joiner}{self.key}" if self.key else parent
        self.args = (self._format(),)
        return self

    def located(self, where: str) -> FieldError:
        """Say which file (and run) the key belongs to."""
        self.where = where
        self.args = (self._format(),)
        return self


class CombinationError(FieldError):
    """A value that is wrong only together with another setting (a reshard int and a world
    size): reported for the combination, since another point of the grid may be fine."""


def show(value: object) -> str:
    """A value as the user wrote it in YAML, strings quoted (for error messages)."""
    return repr(value) if isinstance(value, str) else yaml_scalar(value)


def one_line(err: BaseException, limit: int = 800) -> str:
    """An exception's text on one line (tools such as YAML and sbatch answer in several)."""
    return " ".join(str(err).split())[:limit]


def yaml_scalar(value: object) -> str:
    """true, not True; null, not None (for tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


class LaunchError(FsdpBenchError):
    """A job could not be submitted or followed (cluster unreachable, submission rejected)."""

    exit_code = 3


class ResultsError(FsdpBenchError):
    """A results folder that cannot be reported on: missing, or with no runs recorded yet."""

    exit_code = 2
