"""Tables for people, from the frames `summaries` computes: one set of headers and number
formats for the terminal ranking, the HTML report and summary.md, so all three read alike.

Every cell becomes a string once, here: metrics with their units' precision, configuration
values as in YAML, "-" for what is missing or what DDP does not have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pandas as pd

from fsdp_bench.config.fsdp import FSDP_ONLY_FIELDS
from fsdp_bench.report import ties
from fsdp_bench.report.configs import key, varying
from fsdp_bench.store import CONFIG_COLUMNS

METRIC_COLUMNS = [
    "tokens_per_s",
    "step_time_s",
    "step_time_spread_pct",
    "mfu",
    "peak_memory_gib",
    "all_gathers_per_step",
    "reduce_scatters_per_step",
    "all_reduces_per_step",
    "checkpoint_save_s",
    "checkpoint_load_s",
    "parity_ok",
    "estimate_fits",
    "status",
]
"""What the ranking shows of each run, when any run has it."""

HEADERS = {
    "tokens_per_s": "tokens/s",
    "tokens_per_s_ci": "tokens/s 95% CI",
    ties.MARKS_COLUMN: "tie",
    "contended": "contended",
    "tied": "tied with the best",
    "tokens_per_s_per_rank": "tokens/s per rank",
    "step_time_s": "step s",
    "step_time_spread_pct": "spread",
    "mfu": "MFU",
    "peak_memory_gib": "peak GiB/rank",
    "peak_reserved_gib": "peak reserved GiB",
    "estimated_peak_gib": "estimated GiB",
    "all_gathers_per_step": "AG/step",
    "reduce_scatters_per_step": "RS/step",
    "all_reduces_per_step": "AR/step",
    "efficiency": "scaling efficiency",
    "tokens_per_s_ratio": "tokens/s ratio",
    "peak_memory_ratio": "peak memory ratio",
    "all_gather_bytes_ratio": "all-gather bytes ratio",
    "parity_ok": "parity",
    "estimate_fits": "fits (estimate)",
    "checkpoint_save_s": "ckpt-save-s",
    "checkpoint_load_s": "ckpt-load-s",
    "micro_batch_size": "micro-batch",
    "reshard_after_forward": "reshard",
    "mixed_precision": "precision",
    "cpu_offload": "offload",
    "activation_checkpointing": "AC",
    "accumulation_steps": "accum",
}
"""Column headers with units, short enough for a terminal. Other columns keep their results
names (run_id, world_size, ...), one word each, so the ranking splits on whitespace."""


def _missing(value: Any) -> bool:
    return value is None or (pd.api.types.is_scalar(value) and bool(pd.isna(value)))


def _num(pattern: str) -> Callable[[Any], str]:
    return lambda value: "-" if _missing(value) else pattern.format(value)


def _percent(decimals: int) -> Callable[[Any], str]:
    """A fraction (0.42) as a percentage ("42%")."""
    return lambda value: "-" if _missing(value) else f"{100 * value:.{decimals}f}%"


def _interval(value: Any) -> str:
    """A (low, high) pair of tokens/s as "9,100-9,800"."""
    if not isinstance(value, tuple):
        return "-"
    return f"{value[0]:,.0f}-{value[1]:,.0f}"


def _yes_no(value: Any) -> str:
    return "-" if _missing(value) else ("yes" if value else "no")


def _ratio_interval(value: Any) -> str:
    """A (low, high) pair of ratios as "0.95-1.10×"."""
    return f"{value[0]:.2f}-{value[1]:.2f}×" if isinstance(value, tuple) else "-"


FORMATS: dict[str, Callable[[Any], str]] = {
    "tokens_per_s": _num("{:,.0f}"),
    "tokens_per_s_ci": _interval,
    "contended": _yes_no,
    "tokens_per_s_ratio_ci": _ratio_interval,
    "tokens_per_s_per_rank": _num("{:,.0f}"),
    "peak_memory_gib": _num("{:.3f}"),
    "peak_reserved_gib": _num("{:.3f}"),
    "estimated_peak_gib": _num("{:.3f}"),
    "step_time_s": _num("{:.4f}"),
    "step_time_spread_pct": _num("{:.1f}%"),
    "mfu": _percent(1),
    "efficiency": _percent(0),
    "tokens_per_s_ratio": _num("{:.2f}×"),
    "peak_memory_ratio": _num("{:.2f}×"),
    "all_gather_bytes_ratio": _num("{:.3f}×"),
    **{f"tokens_per_s_{side}": _num("{:,.0f}") for side in "ab"},
    **{f"peak_memory_gib_{side}": _num("{:.3f}") for side in "ab"},
    "all_gathers_per_step": _num("{:.0f}"),
    "reduce_scatters_per_step": _num("{:.0f}"),
    "all_reduces_per_step": _num("{:.0f}"),
    "checkpoint_save_s": _num("{:.3f}"),
    "checkpoint_load_s": _num("{:.3f}"),
}
"""How each metric is printed; every other cell is spelled by `_cell`."""


def shown(table: pd.DataFrame, headers: dict[str, str] | None = None) -> pd.DataFrame:
    """Every cell a string (metrics formatted, configuration values as in YAML), headed by
    HEADERS overridden by `headers`."""
    out = pd.DataFrame(index=table.index)
    for column in table.columns:
        fmt = FORMATS.get(column, _cell)
        out[column] = [fmt(v) for v in table[column]]
    names = {**HEADERS, **(headers or {})}
    return out.rename(columns=lambda c: names.get(c, c))


def _cell(value: Any) -> str:
    if _missing(value):
        return "-"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return key(value)


def _ddp_dashes(table: pd.DataFrame) -> pd.DataFrame:
    """DDP has no groups to shard, reshard or prefetch: its FSDP-only cells show "-"."""
    if "strategy" not in table:
        return table
    table = table.copy()
    for column in FSDP_ONLY_FIELDS:
        if column in table:
            table[column] = table[column].astype(object)
            table.loc[table["strategy"] == "ddp", column] = "-"
    return table


def varying_axes(df: pd.DataFrame) -> list[str]:
    """The configuration columns that take more than one value in `df`, in RunConfig order."""
    return varying(df, CONFIG_COLUMNS)


def ranking(df: pd.DataFrame, run_ids: Iterable[str] | None = None) -> pd.DataFrame:
    """Runs ranked by tokens/s (failures last), with the columns that tell them apart: after
    tokens/s its 95% interval (when any run has one), the `tie` mark ("best", "tied":
    cannot be told apart from the best by `fsdp_bench.stats.indistinguishable`, or "") and,
    when any run was measured while something else competed, `contended` (yes, no)."""
    if run_ids is not None:
        df = df[df["run_id"].isin(list(run_ids))]
    if df.empty:
        return df
    ordered = df.assign(_ok=df["status"].eq("ok")).sort_values(
        ["_ok", "tokens_per_s"], ascending=[False, False], na_position="last"
    )
    metrics = [c for c in METRIC_COLUMNS if c in df and df[c].notna().any()]
    if "tokens_per_s" in metrics:
        added = [ties.MARKS_COLUMN]
        ordered = ordered.assign(**{ties.MARKS_COLUMN: ties.marks(ordered)})
        if {"tokens_per_s_ci_low", "tokens_per_s_ci_high"} <= set(df.columns):
            pairs = [
                ties.interval(lo, hi)
                for lo, hi in zip(
                    ordered["tokens_per_s_ci_low"], ordered["tokens_per_s_ci_high"], strict=True
                )
            ]
            if any(p is not None for p in pairs):
                ordered = ordered.assign(tokens_per_s_ci=pd.Series(pairs, index=ordered.index))
                added.insert(0, "tokens_per_s_ci")
        if "contended" in df and df["contended"].eq(True).any():
            added.append("contended")
        at = metrics.index("tokens_per_s") + 1
        metrics[at:at] = added
    return ordered[["run_id", *varying_axes(df), *metrics]].reset_index(drop=True)


def format_ranking(table: pd.DataFrame) -> str:
    """The ranking as the terminal shows it after a sweep or search."""
    if table.empty:
        return "(no runs)"
    return shown(_ddp_dashes(table)).to_string(index=False)


def best_table(best: pd.DataFrame) -> pd.DataFrame:
    return shown(_ddp_dashes(best.drop(columns=["note"]).assign(note=best["note"])))


def effects_table(effects: pd.DataFrame) -> pd.DataFrame:
    table = effects.assign(
        change=[
            f"{key(b)} → {key(v)}"
            for b, v in zip(effects["baseline"], effects["value"], strict=True)
        ],
        note=[
            "" if pairs else f"the grid never ran {key(v)} with everything else at a run of "
            f"{key(b)}: no effect claimed"
            for b, v, pairs in zip(effects["baseline"], effects["value"], effects["pairs"],
                                   strict=True)
        ],
    )  # fmt: skip
    shown_columns = ["axis", "change", "pairs", "tokens_per_s_ratio"]
    shown_columns += [c for c in ("tokens_per_s_ratio_ci", "differs_from_1") if c in table]
    shown_columns.append("peak_memory_ratio")
    if "all_gather_bytes_ratio" in table and table["all_gather_bytes_ratio"].notna().any():
        shown_columns.append("all_gather_bytes_ratio")
    notes = ["note"] if table["note"].any() else []
    return shown(
        table[[*shown_columns, *notes]],
        {
            "pairs": "matched pairs",
            "tokens_per_s_ratio": "tokens/s ×",
            "tokens_per_s_ratio_ci": "tokens/s × interval",
            "differs_from_1": "differs from 1×",
            "peak_memory_ratio": "peak memory ×",
            "all_gather_bytes_ratio": "all-gather bytes ×",
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


def _first_line(reason: object) -> str:
    text = reason if isinstance(reason, str) else ""
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
            "tokens_per_s_ratio_ci": "ratio interval",
            "differs_from_1": "differs from 1×",
            "peak_memory_gib_a": f"peak GiB/rank {a}",
            "peak_memory_gib_b": f"peak GiB/rank {b}",
            "peak_memory_ratio": f"peak {b} ÷ {a}",
        },
    )


def markdown(table: pd.DataFrame) -> str:
    """A GitHub-flavoured markdown table (pipes in cells escaped)."""
    if table.empty:
        return "(none)"

    def cell(value: object) -> str:
        return str(value).replace("|", "\\|")

    lines = [
        "| " + " | ".join(cell(c) for c in table.columns) + " |",
        "| " + " | ".join("---" for _ in table.columns) + " |",
    ]
    lines += [
        "| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)
    ]
    return "\n".join(lines)


def step_table(phases: pd.DataFrame) -> pd.DataFrame:
    """`figure_data.step_phases` for people: milliseconds and the hidden share."""
    if phases.empty:
        return phases
    shown_ = phases.drop(columns=["run_id"]).reset_index(names="configuration")
    for column in shown_.columns[1:]:
        pattern = "{:.0f}%" if column == "hidden %" else "{:.1f}"
        shown_[column] = [_num(pattern)(v) for v in shown_[column]]
    names = {c: f"{c} ms" for c in shown_.columns[1:-1]}
    return shown_.rename(columns={**names, "hidden %": "hidden"})


def estimate_table(accuracy: pd.DataFrame) -> pd.DataFrame:
    """`estimates.estimate_accuracy` for people: GiB to three decimals, errors signed."""
    if accuracy.empty:
        return accuracy
    shown_ = accuracy.drop(columns=["run_id"]).reset_index(names="configuration")
    for column in shown_.columns[1:]:
        if column.endswith(" inside"):
            shown_[column] = [_yes_no(v) for v in shown_[column]]
        elif column == "fits":
            shown_[column] = [_cell(v) for v in shown_[column]]
        else:
            pattern = {"correction": "x {:.3f}"}.get(column, "{:+.1f}%" if column.endswith(
                "error %") else "{:.3f}")  # fmt: skip
            shown_[column] = [_num(pattern)(v) for v in shown_[column]]
    return shown_.rename(columns=lambda c: c.replace(" error %", " error"))


def coverage_line(accuracy: pd.DataFrame) -> str:
    """How many measured figures fell inside the interval estimated before launch."""
    inside = [v for c in accuracy.columns if c.endswith(" inside") for v in accuracy[c]]
    known = [bool(v) for v in inside if not _missing(v)]
    return f"{sum(known)} of {len(known)} measured figures inside their interval" if known else ""


def dimension_table(counts: pd.DataFrame) -> pd.DataFrame:
    """`figure_data.collectives_by_dimension` for people: calls as integers, MiB to 2 places."""
    shown_ = counts.copy()
    for column in shown_.columns[2:]:
        pattern = "{:.2f}" if column.endswith("MiB") else "{:.0f}"
        shown_[column] = [_num(pattern)(v) for v in shown_[column]]
    return shown_
