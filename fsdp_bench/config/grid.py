"""A grid file: a base run, axes whose cartesian product gives the runs, and exclusions.

`axes` is one mapping (one product) or a list of mappings (the union of their products, for
"this product, plus one knob at a time against the base"). Equal runs are listed once.

Everything is validated here, before anything runs: a grid either expands into a list of
valid `RunConfig`s or fails with one line naming the key, the value and what is allowed. A
grid whose products hold more than `max_runs` points is refused by counting them, before any
is built.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_bench.config.fsdp import canonical_grouping
from fsdp_bench.config.grid_paths import find_cluster_profile, paths_from
from fsdp_bench.config.grid_settings import MemoryConfig, SearchConfig
from fsdp_bench.config.launcher import LauncherConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.config.schema import bad_value, build, coerce, field_paths
from fsdp_bench.config.yaml_file import read_yaml
from fsdp_bench.errors import CombinationError, ConfigError, FieldError, show, unknown_key

AXIS_PATHS: dict[str, Any] = field_paths(RunConfig)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
DEFAULT_MAX_RUNS = 100_000
"""Product points a grid may have unless told otherwise (10^5 points take ~20 s to expand)."""


@dataclass(frozen=True, kw_only=True)
class SweepSpec:
    name: str
    """Names the results folder (results/<name>/)."""
    description: str = ""
    base: dict[str, Any] = field(default_factory=dict)
    """The run every grid point starts from (a RunConfig as a mapping)."""
    axes: tuple[dict[str, tuple[Any, ...]], ...] = ()
    """Products of dotted RunConfig key -> values; the runs are the union of the products."""
    exclude: tuple[dict[str, tuple[Any, ...]], ...] = ()
    """Combinations to leave out: every key's value must match (a list means any of)."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """The per-rank memory budget runs are estimated against."""
    search: SearchConfig = field(default_factory=SearchConfig)
    source: str = "<grid>"
    """Where the grid came from (for messages and provenance)."""
    max_runs: int = DEFAULT_MAX_RUNS
    """The most product points `expand` builds (not read from the file: `--max-runs`)."""


@dataclass(frozen=True)
class Expansion:
    """The runs of a grid, and how many product points were dropped or merged, and why."""

    runs: list[RunConfig]
    excluded: int
    collapsed: int


_TOP_KEYS = ("name", "description", "base", "axes", "exclude", "memory", "search", "launcher")


def load_grid(path: str | Path) -> SweepSpec:
    """Read and validate a grid file completely; relative paths in it (`hf:` configs, cluster
    profiles) are taken from the grid's folder, whatever the working folder."""
    path = Path(path).resolve()
    return parse_grid(paths_from(read_yaml(path), path.parent), source=str(path))


def parse_grid(data: object, *, source: str = "<grid>") -> SweepSpec:
    """Validate a parsed grid mapping into a `SweepSpec` (every axis value checked)."""
    try:
        return _parse(data, source)
    except FieldError as err:
        raise err.located(source) from None


def _parse(data: object, source: str) -> SweepSpec:
    if not isinstance(data, Mapping):
        raise bad_value("", data, f"a grid is a mapping with keys: {', '.join(_TOP_KEYS)}")
    for key in data:
        if key not in _TOP_KEYS:
            raise unknown_key(key, _TOP_KEYS)
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_value("name", name, "expected a name of letters, digits, '.', '_' or '-'")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise bad_value("description", description, "expected a string")

    base = data.get("base") or {}
    try:
        build(RunConfig, base)
    except FieldError as err:
        raise err.under("base") from None

    raw_axes = data.get("axes") or {}
    if isinstance(raw_axes, list):
        axes = tuple(_parse_axes(p, f"axes[{i}]", base) for i, p in enumerate(raw_axes))
    else:
        axes = (_parse_axes(raw_axes, "axes", base),)
    exclude = _parse_exclude(data.get("exclude") or [])
    launcher = _parse_launcher(data.get("launcher") or {}, source)
    try:
        memory = build(MemoryConfig, data.get("memory") or {})
    except FieldError as err:
        raise err.under("memory") from None
    try:
        search = build(SearchConfig, data.get("search") or {})
    except FieldError as err:
        raise err.under("search") from None
    return SweepSpec(
        name=name,
        description=description,
        base=dict(base),
        axes=axes,
        exclude=exclude,
        launcher=launcher,
        memory=memory,
        search=search,
        source=source,
    )


def _parse_launcher(raw: object, source: str) -> LauncherConfig:
    """The launcher section, on top of its cluster profile when it names one."""
    if not isinstance(raw, Mapping):
        raise bad_value("launcher", raw, "expected a mapping of launcher settings")
    settings = dict(raw)
    name = settings.get("cluster")
    if name is not None:
        path = find_cluster_profile(str(name), Path(source).parent)
        profile = read_yaml(path)
        if not isinstance(profile, Mapping):
            raise ConfigError(f"{path}: a cluster profile is a mapping of launcher settings")
        try:
            build(LauncherConfig, {"kind": "slurm", **profile})
        except FieldError as err:  # reported against the profile, not the grid
            raise ConfigError(str(err.located(str(path)))) from None
        settings = {"kind": "slurm", **profile, **settings}
    try:
        return build(LauncherConfig, settings)
    except FieldError as err:
        raise err.under("launcher") from None


def _parse_axes(
    raw: object, where_axes: str, base: Mapping[str, Any]
) -> dict[str, tuple[Any, ...]]:
    if not isinstance(raw, Mapping):
        raise bad_value(
            where_axes,
            raw,
            "expected a mapping of dotted keys to lists of values (or a list of them)",
        )
    axes: dict[str, tuple[Any, ...]] = {}
    for key, values in raw.items():
        where = f"{where_axes}.{key}"
        _check_path(where, key)
        if not isinstance(values, list) or not values:
            raise bad_value(where, values, "expected a non-empty list of values")
        normalised = tuple(_normalise(key, v, f"{where}[{i}]") for i, v in enumerate(values))
        for i, value in enumerate(normalised):
            _check_alone(base, key, value, f"{where}[{i}]")
        for i, value in enumerate(normalised):
            if any(_same(value, earlier) for earlier in normalised[:i]):
                raise bad_value(f"{where}[{i}]", values[i], "each value may appear only once")
        axes[key] = normalised
    return axes


def _parse_exclude(raw: object) -> tuple[dict[str, tuple[Any, ...]], ...]:
    if not isinstance(raw, list):
        raise bad_value("exclude", raw, "expected a list of mappings {dotted key: value or list}")
    rules = []
    for index, rule in enumerate(raw):
        where = f"exclude[{index}]"
        if not isinstance(rule, Mapping) or not rule:
            raise bad_value(where, rule, "expected a mapping {dotted key: value or list of values}")
        parsed = {}
        for key, value in rule.items():
            _check_path(f"{where}.{key}", key)
            options = value if isinstance(value, list) and key != "fsdp.grouping" else [value]
            parsed[key] = tuple(_normalise(key, v, f"{where}.{key}") for v in options)
        rules.append(parsed)
    return tuple(rules)


def _check_path(where: str, key: object) -> None:
    if key not in AXIS_PATHS:
        raise unknown_key(key, list(AXIS_PATHS), at=where)


def _normalise(key: str, value: object, where: str) -> Any:
    """One axis or exclude value, checked against its field's type, in canonical form."""
    try:
        value = coerce(AXIS_PATHS[key], value)
        if key == "fsdp.grouping":
            value = canonical_grouping(value)
    except FieldError as err:
        raise bad_value(where, value, err.allowed) from None
    return value


def _check_alone(base: Mapping[str, Any], key: str, value: Any, where: str) -> None:
    """Range checks of one axis value on the base run, reported at the axis value's place.

    Errors that depend on other axes (an int reshard against a world size) are left to the
    check of each run, which names the combination.
    """
    try:
        build(RunConfig, _with_values(base, {key: value}))
    except CombinationError:
        return
    except FieldError as err:
        if err.key == key:
            raise bad_value(where, value, err.allowed) from None


def _with_values(base: Mapping[str, Any], point: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the base mapping with dotted keys set."""
    data = copy.deepcopy(dict(base))
    for key, value in point.items():
        section = data
        *parents, leaf = key.split(".")
        for part in parents:
            section = section.setdefault(part, {})
        section[leaf] = list(value) if isinstance(value, tuple) else value
    return data


def _same(a: object, b: object) -> bool:
    """Equality that keeps true and 1 apart (they mean different reshard settings)."""
    return type(a) is type(b) and a == b


def point_count(spec: SweepSpec) -> int:
    """Points of the grid's products, before exclusions and merging, counted without building."""
    return sum(
        math.prod(len(values) for values in product.values()) for product in spec.axes or ({},)
    )


def check_size(spec: SweepSpec) -> None:
    """Refuse a grid with more product points than `spec.max_runs`, before building any."""
    count = point_count(spec)
    if count > spec.max_runs:
        raise ConfigError(
            f"{spec.source}: the axes make {count:,} points (before exclude: rules and merging "
            f"equal runs), more than the limit of {spec.max_runs:,}; split the grid, or raise "
            f"the limit with --max-runs {count}"
        )


def expand(spec: SweepSpec) -> Expansion:
    """The grid's runs in axis order, excluded points removed, equivalent points merged.

    Refused (`check_size`) when the products hold more than `spec.max_runs` points.
    """
    check_size(spec)
    base_run = build(RunConfig, spec.base)
    runs: dict[str, RunConfig] = {}
    excluded = 0
    points = 0
    for product in spec.axes or ({},):
        keys = list(product)
        for values in itertools.product(*(product[k] for k in keys)):
            point = dict(zip(keys, values, strict=True))
            if any(_matches(rule, point, base_run) for rule in spec.exclude):
                excluded += 1
                continue
            points += 1
            run = _build_run(spec, point).canonical()
            runs.setdefault(run.run_id, run)
    return Expansion(runs=list(runs.values()), excluded=excluded, collapsed=points - len(runs))


def search_space(spec: SweepSpec) -> dict[str, tuple[Any, ...]]:
    """Every axis key with every value any product lists for it (a search samples each key)."""
    space: dict[str, list[Any]] = {}
    for product in spec.axes:
        for key, values in product.items():
            known = space.setdefault(key, [])
            known += [v for v in values if not any(_same(v, k) for k in known)]
    return {key: tuple(values) for key, values in space.items()}


def search_points(spec: SweepSpec) -> Expansion:
    """The distinct runs of the search space's product (what a search can propose); points an
    exclude rule drops or that are no valid run count as excluded, as a search fails them."""
    space = search_space(spec)
    total = math.prod(len(values) for values in space.values())
    if total > spec.max_runs:
        raise ConfigError(
            f"{spec.source}: the search space has {total:,} points, more than --max-runs "
            f"{spec.max_runs:,} to list"
        )
    runs: dict[str, RunConfig] = {}
    excluded = 0
    for values in itertools.product(*space.values()):
        try:
            run = run_for_point(spec, dict(zip(space, values, strict=True)))
        except FieldError:
            run = None
        if run is None:
            excluded += 1
        else:
            runs.setdefault(run.run_id, run)
    return Expansion(list(runs.values()), excluded, total - excluded - len(runs))


def model_runs(spec: SweepSpec) -> list[RunConfig]:
    """A run for each model and sequence length the search space can give, other keys at the
    base (what a search checks its models on before its first trial)."""
    space = search_space(spec)
    keys = [k for k in space if k.startswith("model.") or k == "data.seq_len"]
    runs = []
    for values in itertools.product(*(space[k] for k in keys)):
        try:
            run = run_for_point(spec, dict(zip(keys, values, strict=True)))
        except FieldError:  # a combination the base cannot take; another point will show it
            continue
        if run is not None:
            runs.append(run)
    return runs


def run_for_point(spec: SweepSpec, point: dict[str, Any]) -> RunConfig | None:
    """The run of one point of the search space; None when an exclude rule drops it."""
    base_run = build(RunConfig, spec.base)
    if any(_matches(rule, point, base_run) for rule in spec.exclude):
        return None
    return _build_run(spec, point).canonical()


def axis_keys(spec: SweepSpec) -> list[str]:
    """Every key that some product varies, in first-appearance order."""
    return list(dict.fromkeys(k for product in spec.axes for k in product))


def _matches(rule: dict[str, tuple[Any, ...]], point: dict[str, Any], base: RunConfig) -> bool:
    for key, options in rule.items():
        value = point[key] if key in point else get_path(base, key)
        if not any(_same(value, option) for option in options):
            return False
    return True


def _build_run(spec: SweepSpec, point: dict[str, Any]) -> RunConfig:
    label = "{" + ", ".join(f"{k}: {show(v)}" for k, v in point.items()) + "}"
    data = _with_values(spec.base, point)
    try:
        _place(data, spec.launcher)
        return build(RunConfig, data)
    except FieldError as err:
        err.allowed += " (or leave this combination out with an exclude: entry)"
        raise err.located(f"{spec.source}: run {label}") from None


def _place(data: dict[str, Any], launcher: LauncherConfig) -> None:
    """Fill in processes_per_node from the launcher (a cluster's GPUs per node) when the run
    did not choose: it decides the nodes, so it is part of what the run is."""
    world_size = data.get("world_size", 1)
    if data.get("processes_per_node") is not None or not isinstance(world_size, int):
        return
    per_node = launcher.ranks_per_node(world_size)
    if per_node is None:
        return
    if world_size % per_node:
        raise CombinationError(
            "world_size",
            world_size,
            f"it must be a multiple of the cluster's {per_node} processes per node "
            "(launcher.processes_per_node / gpus_per_node)",
        )
    data["processes_per_node"] = per_node


def get_path(obj: Any, dotted: str) -> Any:
    """The value at a dotted key of a RunConfig."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj
