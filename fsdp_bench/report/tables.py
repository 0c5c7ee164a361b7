"""Summary frames as tables of strings for people: units in headers, numbers formatted once
so the HTML and the markdown report show the same text."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd

from fsdp_bench.report.ranking import AXIS_COLUMNS, ranking
from fsdp_bench.report.summaries import key

HEADERS = {
    "world_size": "world size",
    "tokens_per_s": "tokens/s",
    "peak_memory_gib": "peak GiB/rank",
    "peak_reserved_gib": "peak reserved GiB",
    "estimated_peak_gib": "estimated GiB",
    "step_time_s": "step s",
    "step_time_spread_pct": "spread",
    "mfu": "MFU",
    "all_gathers_per_step": "AG/step",
    "reduce_scatters_per_step": "RS/step",
    "all_reduces_per_step": "AR/step",
    "tokens_per_s_per_gpu": "tokens/s per GPU",
    "efficiency": "scaling efficiency",
    "tokens_per_s_ratio": "tokens/s ratio",
    "peak_memory_ratio": "peak memory ratio",
    "parity_ok": "parity",
}


def _num(pattern: str) -> Callable[[Any], str]:
    def show(value: Any) -> str:
        if value is None or (isinstance(value, float) and pd.isna(value)):
            return "-"
        return pattern.format(value)

    return show


FORMATS: dict[str, Callable[[Any], str]] = {
    "tokens_per_s": _num("{:,.0f}"),
    "tokens_per_s_per_gpu": _num("{:,.0f}"),
    "peak_memory_gib": _num("{:.3f}"),
    "peak_reserved_gib": _num("{:.3f}"),
    "estimated_peak_gib": _num("{:.3f}"),
    "step_time_s": _num("{:.4f}"),
    "step_time_spread_pct": _num("{:.1f}%"),
    "mfu": lambda v: "-" if v is None or pd.isna(v) else f"{100 * v:.1f}%",
    "efficiency": lambda v: "-" if v is None or pd.isna(v) else f"{100 * v:.0f}%",
    "tokens_per_s_ratio": _num("{:.2f}×"),
    "peak_memory_ratio": _num("{:.2f}×"),
    "all_gathers_per_step": _num("{:.0f}"),
    "reduce_scatters_per_step": _num("{:.0f}"),
    "all_reduces_per_step": _num("{:.0f}"),
}


def shown(table: pd.DataFrame, headers: dict[str, str] | None = None) -> pd.DataFrame:
    """Every cell a string: known metrics formatted, configuration values as in YAML."""
    out = pd.DataFrame(index=table.index)
    for column in table.columns:
        fmt = FORMATS.get(column, _cell)
        out[column] = [fmt(v) for v in table[column]]
    names = {**HEADERS, **(headers or {})}
    return out.rename(
        columns=lambda c: names.get(c, c.replace("_", " ") if c not in AXIS_COLUMNS else c)
    )


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return "-"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return key(value)


def best_table(best: pd.DataFrame) -> pd.DataFrame:
    return shown(_ddp_dashes(best.drop(columns=["note"]).assign(note=best["note"])))


def _ddp_dashes(table: pd.DataFrame) -> pd.DataFrame:
    """DDP has no groups to shard, reshard or prefetch: its FSDP-only cells show "-"."""
    if "strategy" not in table:
        return table
    table = table.copy()
    for column in ("grouping", "reshard_after_forward", "prefetch", "cpu_offload"):
        if column in table:
            table[column] = table[column].astype(object)
            table.loc[table["strategy"] == "ddp", column] = "-"
    return table


def effects_table(effects: pd.DataFrame) -> pd.DataFrame:
    table = effects.assign(
        change=[
            f"{key(b)} → {key(v)}"
            for b, v in zip(effects["baseline"], effects["value"], strict=True)
        ]
    )
    table = table[["axis", "change", "pairs", "tokens_per_s_ratio", "peak_memory_ratio"]]
    return shown(
        table,
        {
            "pairs": "matched pairs",
            "tokens_per_s_ratio": "tokens/s ×",
            "peak_memory_ratio": "peak memory ×",
        },
    )


def scaling_table(scaling: pd.DataFrame) -> pd.DataFrame:
    return shown(scaling, {"config": "configuration"})


def status_table(counts: pd.DataFrame) -> pd.DataFrame:
    return counts.reset_index().astype(str)


def runs_table(df: pd.DataFrame) -> pd.DataFrame:
    """Every run, fastest first, failures last with their reason's first line."""
    ranked = ranking(df)
    if ranked.empty:
        return ranked
    reasons = df.drop_duplicates("run_id").set_index("run_id")["reason"]
    ranked = ranked.assign(reason=[_first_line(reasons.get(r)) for r in ranked["run_id"]])
    return shown(_ddp_dashes(ranked))


def _first_line(reason: Any) -> str:
    text = "" if reason is None or not isinstance(reason, str) else reason
    return text.splitlines()[0][:160] if text.strip() else ""


def compare_table(table: pd.DataFrame, names: tuple[str, str]) -> pd.DataFrame:
    a, b = names
    return shown(
        table.drop(columns=["run_id_a", "run_id_b"]),
        {
            "config": "configuration",
            "status_a": f"status {a}",
            "status_b": f"status {b}",
            "tokens_per_s_a": f"tokens/s {a}",
            "tokens_per_s_b": f"tokens/s {b}",
            "tokens_per_s_ratio": f"tokens/s {b} ÷ {a}",
            "peak_memory_gib_a": f"peak GiB {a}",
            "peak_memory_gib_b": f"peak GiB {b}",
            "peak_memory_ratio": f"peak {b} ÷ {a}",
        },
    )


def markdown(table: pd.DataFrame) -> str:
    """A GitHub-flavoured markdown table (pipes in cells escaped)."""
    if table.empty:
        return "(none)"

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|")

    lines = [
        "| " + " | ".join(cell(c) for c in table.columns) + " |",
        "| " + " | ".join("---" for _ in table.columns) + " |",
    ]
    lines += [
        "| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)
    ]
    return "\n".join(lines)
