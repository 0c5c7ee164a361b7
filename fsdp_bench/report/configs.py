"""Configurations in a results table: spelled, matched, labelled and sliced as plain data.

The columns come from the store (`CONFIG_COLUMNS`, derived from RunConfig), so a new field
is matched, labelled and ranked without a list to update here.
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from fsdp_bench.config.fsdp import FSDP_ONLY_FIELDS
from fsdp_bench.errors import yaml_scalar
from fsdp_bench.store import (
    COLUMN_OF_PATH,
    CONFIG_COLUMNS,
    FAULT_COLUMNS,
    MODEL_COLUMNS,
)

SCALE_COLUMNS = ["world_size", "processes_per_node", "nodes"]
"""How many GPUs and where: the axis of scaling, not of a configuration's identity."""

EFFECT_AXES = [
    c for c in CONFIG_COLUMNS if c not in {*SCALE_COLUMNS, *MODEL_COLUMNS, *FAULT_COLUMNS}
]
"""Axes whose effect is measured holding the others fixed: not the model (what is trained),
the scale (scaling has its own table) or injected faults."""

_SHORT = {
    "reshard_after_forward": "reshard",
    "accumulation_steps": "accum",
    "activation_checkpointing": "AC",
    "cpu_offload": "offload",
    "world_size": "W",
    "micro_batch_size": "micro-batch",
}
"""Names in configuration labels, kept short because labels sit beside points and bars."""
_BARE = {"grouping", "strategy", "model", "mixed_precision"}
"""Axes whose values say which axis they are ("block", "ddp", "bf16"): labelled bare."""


def key(value: Any) -> str:
    """A hashable, comparable spelling of a cell (lists, dicts, None, NaN all included)."""
    if hasattr(value, "item") and not isinstance(value, (list, dict)):
        value = value.item()  # numpy scalars: np.True_ spells like True
    if isinstance(value, float) and pd.isna(value):
        return "null"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, default=str)
    return yaml_scalar(value)


def config_columns(df: pd.DataFrame, exclude: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The configuration columns present in `df`, minus `exclude`."""
    return [c for c in CONFIG_COLUMNS if c in df.columns and c not in exclude]


def varying(df: pd.DataFrame, columns: list[str]) -> list[str]:
    """Those of `columns` that take more than one value in `df`."""
    return [c for c in columns if c in df.columns and df[c].map(key).nunique() > 1]


def config_keys(df: pd.DataFrame, columns: list[str]) -> pd.Series:
    """One string per row naming its configuration over `columns` (for matching rows)."""
    if not columns:
        return pd.Series("", index=df.index, dtype=object)
    parts = [df[c].map(key) for c in columns]
    joined = parts[0].astype(str)
    for part in parts[1:]:
        joined = joined + "|" + part.astype(str)
    return joined


def baseline_value(values: pd.Series) -> Any:
    """The value most runs share (the grid's base, in a one-knob-at-a-time sweep); ties go
    to the value seen first."""
    keys = values.map(key)
    counts = keys.value_counts(sort=False)
    top = counts.max()
    first = next(k for k in keys if counts[k] == top)
    return values[keys == first].iloc[0]


def ordered_unique(values: pd.Series) -> list[Any]:
    """Distinct values in a stable order: sorted when comparable, else first seen."""
    seen: dict[str, Any] = {}
    for v in values:
        seen.setdefault(key(v), v)
    distinct = list(seen.values())
    try:
        return sorted(distinct)
    except TypeError:
        return sorted(distinct, key=key)


def config_labels(df: pd.DataFrame, columns: list[str] | None = None) -> pd.Series:
    """Short labels that say how each row differs from the common configuration.

    Of the `columns` that vary (default: every configuration column), a row shows those
    where it differs from the value most rows share, plus its grouping, which readers use
    to find a configuration: "block", "root, reshard=true", "block, bf16", "ddp". DDP rows
    leave out the FSDP-only axes, which DDP does not have.
    """
    if df.empty:
        return pd.Series(dtype=object)
    shown = varying(df, config_columns(df) if columns is None else columns)
    base = {c: key(baseline_value(df[c])) for c in shown}

    def label(row: pd.Series) -> str:
        ddp = row.get("strategy") == "ddp"
        parts = []
        for c in shown:
            value = key(row[c])
            if (ddp and c in FSDP_ONLY_FIELDS) or (value == base[c] and c != "grouping"):
                continue
            parts.append(value if c in _BARE else f"{_SHORT.get(c, c)}={value}")
        return ", ".join(parts) or "base"

    return df.apply(label, axis=1)


def describe_config(row: pd.Series, columns: list[str]) -> str:
    """A configuration spelled out, name=value over `columns` (DDP without FSDP-only axes)."""
    ddp = row.get("strategy") == "ddp"
    return ", ".join(
        f"{c}={key(row[c])}" for c in columns if c in row and not (ddp and c in FSDP_ONLY_FIELDS)
    )


def at_baseline(df: pd.DataFrame, free: list[str]) -> pd.DataFrame:
    """Rows whose effect axes, other than `free`, all hold their most common value: the
    slice of a one-knob-at-a-time grid where only `free` (and world size) vary."""
    if df.empty:
        return df
    mask = pd.Series(True, index=df.index)
    for axis in varying(df, EFFECT_AXES):
        if axis not in free:
            mask &= df[axis].map(key) == key(baseline_value(df[axis]))
    return df[mask]


def ok_runs(df: pd.DataFrame) -> pd.DataFrame:
    """The rows that finished ok with a throughput: what every summary and figure measures."""
    if df.empty:
        return df
    return df[df["status"].eq("ok") & df["tokens_per_s"].notna()]


def one_per_configuration(df: pd.DataFrame) -> pd.DataFrame:
    """One record per configuration and seed: where one was measured again under other
    measurement settings (a search's confirmation round, a grid given more repeats), the
    record with the most timed steps stands for it, an ok one first. Without this the
    ranking would list one configuration twice, tied with itself."""
    columns = [c for p, c in COLUMN_OF_PATH.items() if not p.startswith("measure.")]
    present = [c for c in columns if c in df.columns]
    if df.empty or not present:
        return df
    steps = df["step_times_s"].map(lambda t: len(t) if isinstance(t, list) else 0)
    ranked = df.assign(_ok=df["status"].eq("ok"), _steps=steps, _key=config_keys(df, present))
    ranked = ranked.sort_values(["_ok", "_steps"], ascending=False, kind="stable")
    return df[df.index.isin(ranked.drop_duplicates("_key").index)]


def named_apart(
    by_id: pd.DataFrame, run_ids: list[str], best: pd.Series, columns: list[str]
) -> str:
    """Runs (of `by_id`, indexed by run id) named by the settings of `columns` where each
    differs from `best`, with its id: how a reader tells tied runs apart."""
    named = []
    for run_id in run_ids:
        run = by_id.loc[[run_id]].iloc[0]
        changed = [c for c in columns if c in run and key(run[c]) != key(best.get(c))]
        named.append(f"{describe_config(run, changed) or 'the same settings'} ({run_id})")
    return "; ".join(named)
