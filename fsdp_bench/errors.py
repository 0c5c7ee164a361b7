"""One exception root for everything a user can cause or fix.

The CLI turns a `FsdpBenchError` into one line on stderr and its `exit_code`; anything else is
a bug and keeps its traceback. Messages name the offending key or value and what is allowed.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence


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


def unknown_key(key: object, valid: Sequence[str], at: str | None = None) -> FieldError:
    """The one line for a key that is not among `valid` (at the key path `at`, by default
    the key): the closest valid key, if one is close, and only the valid keys of the key's
    own section (`fsdp.` for `fsdp.reshard`); a dotted key of an unknown section lists the
    sections."""
    text = str(key)
    section, _, name = text.rpartition(".")
    keys = [v for v in valid if v.rpartition(".")[0] == section]
    sections = sorted({v.rpartition(".")[0] for v in valid} - {""})
    close = _closest(name, keys) or difflib.get_close_matches(text, valid, n=1, cutoff=0.6)
    if not keys:  # an unknown section
        listed, what = [f"{s}." for s in sections], "valid sections"
    elif section:
        listed, what = [v.rpartition(".")[2] for v in keys], f"valid keys in {section}"
    else:
        listed, what = keys + [f"{s}.*" for s in sections], "valid keys"
    hint = f"did you mean {close[0]!r}? " if close else ""
    return FieldError(at or text, key, f"{hint}{what}: {', '.join(listed)}", unknown_key=True)


def _closest(name: str, keys: Sequence[str]) -> list[str]:
    """The key of a section that `name` begins (a truncated key; the first declared of
    several), or the closest spelling."""
    by_name = {k.rpartition(".")[2]: k for k in keys}
    begun = [k for n, k in by_name.items() if name and n.startswith(name)]
    close = difflib.get_close_matches(name, list(by_name), n=1, cutoff=0.6)
    return begun[:1] if begun else [by_name[c] for c in close]


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
