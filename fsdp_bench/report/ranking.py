"""Summaries of a results table for people: computed as plain data first, formatted after.

The terminal ranking lives here; the report folder (`fsdp-bench report`: figures, HTML,
markdown) is built by `reporting` from `summaries`, `figures` and `html_report`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pandas as pd

from fsdp_bench.errors import yaml_scalar
from fsdp_bench.report.summaries import varying

# Configuration columns in the order people read them; only those that vary are shown.
AXIS_COLUMNS = [
    "model",
    "world_size",
    "nodes",
    "strategy",
    "micro_batch_size",
    "seq_len",
    "grouping",
    "reshard_after_forward",
    "prefetch",
    "accumulation_steps",
    "grad_sync",
    "mixed_precision",
    "cpu_offload",
    "activation_checkpointing",
    "optimizer",
    "fault",
]
FSDP_ONLY_COLUMNS = ["grouping", "reshard_after_forward", "prefetch", "cpu_offload"]
METRIC_COLUMNS = [
    "tokens_per_s",
    "step_time_s",
    "step_time_spread_pct",
    "mfu",
    "peak_memory_gib",
    "all_gathers_per_step",
    "reduce_scatters_per_step",
    "all_reduces_per_step",
    "parity_ok",
    "status",
]


def varying_axes(df: pd.DataFrame) -> list[str]:
    """The configuration columns that take more than one value in `df`."""
    return varying(df, AXIS_COLUMNS)


def ranking(df: pd.DataFrame, run_ids: Iterable[str] | None = None) -> pd.DataFrame:
    """Runs ranked by tokens/s (failures last), with the columns that tell them apart."""
    if run_ids is not None:
        df = df[df["run_id"].isin(list(run_ids))]
    if df.empty:
        return df
    ordered = df.assign(_ok=df["status"].eq("ok")).sort_values(
        ["_ok", "tokens_per_s"], ascending=[False, False], na_position="last"
    )
    metrics = [c for c in METRIC_COLUMNS if c in df and df[c].notna().any()]
    return ordered[["run_id", *varying_axes(df), *metrics]].reset_index(drop=True)


def format_ranking(table: pd.DataFrame) -> str:
    """A terminal table: integers with separators, GiB to 3 decimals, spread in percent."""
    if table.empty:
        return "(no runs)"
    formatters: dict[str, Callable[[Any], str]] = {
        "tokens_per_s": _number("{:,.0f}"),
        "step_time_s": _number("{:.4f}"),
        "step_time_spread_pct": _number("{:.1f}%"),
        "mfu": lambda v: "-" if pd.isna(v) else f"{100 * v:.1f}%",
        "peak_memory_gib": _number("{:.3f}"),
        "all_gathers_per_step": _number("{:.0f}"),
        "reduce_scatters_per_step": _number("{:.0f}"),
        "all_reduces_per_step": _number("{:.0f}"),
    }
    headers = {
        "tokens_per_s": "tokens/s",
        "step_time_s": "step s",
        "step_time_spread_pct": "spread",
        "peak_memory_gib": "peak GiB",
        "all_gathers_per_step": "AG/step",
        "reduce_scatters_per_step": "RS/step",
        "all_reduces_per_step": "AR/step",
        "reshard_after_forward": "reshard",
        "accumulation_steps": "accum",
        "activation_checkpointing": "AC",
        "mixed_precision": "precision",
        "cpu_offload": "offload",
        "micro_batch_size": "micro-batch",
    }
    shown = table.copy()
    for column in AXIS_COLUMNS:
        if column in shown:
            shown[column] = shown[column].map(yaml_scalar)
    if "strategy" in shown:  # DDP has no groups to shard, reshard or prefetch
        fsdp_only = [c for c in FSDP_ONLY_COLUMNS if c in shown]
        shown.loc[shown["strategy"] == "ddp", fsdp_only] = "-"
    for column, fmt in formatters.items():
        if column in shown:
            shown[column] = shown[column].map(fmt)
    shown = shown.rename(columns=headers)
    return shown.to_string(index=False)


def _number(pattern: str) -> Callable[[Any], str]:
    return lambda v: "-" if pd.isna(v) else pattern.format(v)
