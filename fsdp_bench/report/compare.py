"""Two results folders side by side: the same configurations matched, ratios B / A.

Rows match on every configuration field (world size included) and nothing else, so two
clusters, torch versions or measurement settings (repeats, timed steps) still line up. A
configuration in only one folder keeps its row with the other side empty.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from fsdp_bench.report.configs import config_columns, config_keys, config_labels, varying

COLUMNS = [
    "config",
    "world_size",
    "status_a",
    "status_b",
    "tokens_per_s_a",
    "tokens_per_s_b",
    "tokens_per_s_ratio",
    "tokens_per_s_ratio_ci",
    "differs_from_1",
    "peak_memory_gib_a",
    "peak_memory_gib_b",
    "peak_memory_ratio",
    "note",
    "run_id_a",
    "run_id_b",
]
_MEASURED = ["tokens_per_s", "peak_memory_gib", "tokens_per_s_ci_low", "tokens_per_s_ci_high"]


def compare_results(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration in either table: status, tokens/s and peak memory on each
    side (median over repeated rows that ran ok), and their ratios B / A.

    The tokens/s ratio's interval is [B's low / A's high, B's high / A's low] from the two
    runs' 95% intervals (it holds the ratio of true medians when both intervals hold theirs);
    `differs_from_1` is "yes" only when it lies on one side of 1, "no" when it holds 1,
    "unknown" when a side has no interval (too few steps). `note` says why a ratio is not to
    be read as it stands: a side measured while something else competed (contended), or
    whose passes disagreed (unstable, no ratio).
    """
    both = pd.concat([a.assign(_side="a"), b.assign(_side="b")], ignore_index=True)
    if both.empty:
        return pd.DataFrame(columns=COLUMNS)
    for column in [*_MEASURED[2:], "contended"]:
        if column not in both:
            both[column] = math.nan
    identity = config_columns(both)
    both["_k"] = config_keys(both, identity)
    shown = [c for c in varying(both, identity) if c != "world_size"]
    both["config"] = config_labels(both, shown)
    both["contended"] = both["contended"].eq(True)
    sides = {}
    for side in "ab":
        rows = both[both["_side"] == side]
        ok = rows[rows["status"].eq("ok")]
        metrics = ok.groupby("_k")[_MEASURED].median()
        metrics["contended"] = ok.groupby("_k")["contended"].any()
        first = rows.sort_values("status", key=lambda s: s.ne("ok")).groupby("_k").first()
        sides[side] = (
            first[["config", "world_size", "status", "run_id"]].join(metrics).add_suffix(f"_{side}")
        )
    table = sides["a"].join(sides["b"], how="outer")
    table["config"] = table["config_a"].fillna(table["config_b"])
    table["world_size"] = table["world_size_a"].fillna(table["world_size_b"]).astype(int)
    table["tokens_per_s_ratio"] = table["tokens_per_s_b"] / table["tokens_per_s_a"]
    table["peak_memory_ratio"] = table["peak_memory_gib_b"] / table["peak_memory_gib_a"]
    low = table["tokens_per_s_ci_low_b"] / table["tokens_per_s_ci_high_a"]
    high = table["tokens_per_s_ci_high_b"] / table["tokens_per_s_ci_low_a"]
    known = low.notna() & high.notna()
    table["tokens_per_s_ratio_ci"] = pd.Series(
        [(float(lo), float(hi)) if k else None for lo, hi, k in zip(low, high, known, strict=True)],
        index=table.index,
        dtype=object,
    )
    table["differs_from_1"] = [
        ("no" if lo <= 1 <= hi else "yes") if k else ("unknown" if pd.notna(r) else "-")
        for lo, hi, k, r in zip(low, high, known, table["tokens_per_s_ratio"], strict=True)
    ]
    table["note"] = [_note(row) for row in table.itertuples()]
    table = table.sort_values(["world_size", "config"]).reset_index(drop=True)
    return table[COLUMNS]


def _note(row: Any) -> str:
    """Why a row's ratio is not a plain result, side by side ("contended in A; ...")."""
    notes = []
    for side in "ab":
        if getattr(row, f"status_{side}") == "unstable":
            notes.append(f"unstable in {side.upper()}: its passes disagreed")
        elif getattr(row, f"contended_{side}") is True:
            notes.append(f"contended in {side.upper()}")
    return "; ".join(notes)


def comparison_summary(table: pd.DataFrame, names: tuple[str, str]) -> str:
    """What the comparison found, in one paragraph: how many configurations ran ok in both,
    the median tokens/s and memory ratios over those measured quietly on both sides, how
    many ratios are clear of 1, and what was left out."""
    a, b = names
    matched = table[table["tokens_per_s_ratio"].notna()]
    quiet = matched[matched["note"].eq("")]
    text = f"{len(matched)} configurations ran ok in both; ratios are {b} ÷ {a}"
    if len(quiet):
        clear = quiet["differs_from_1"]
        faster = int((clear.eq("yes") & quiet["tokens_per_s_ratio"].gt(1)).sum())
        slower = int((clear.eq("yes") & quiet["tokens_per_s_ratio"].lt(1)).sum())
        text += (
            f": median {quiet['tokens_per_s_ratio'].median():.2f}× tokens/s and "
            f"{quiet['peak_memory_ratio'].median():.2f}× peak memory over {len(quiet)} "
            f"measured without contention on both sides; {faster} clearly faster in {b}, "
            f"{slower} clearly slower, {int(clear.eq('no').sum())} within their intervals"
        )
        if clear.eq("unknown").any():
            text += f", {int(clear.eq('unknown').sum())} without intervals (too few steps)"
    if len(matched) > len(quiet):
        text += (
            f". {len(matched) - len(quiet)} contended on a side: shown, marked, left out of "
            "the medians (measure them again with --rerun-contended)"
        )
    unstable = int(table["note"].str.contains("unstable").sum())
    if unstable:
        text += f". {unstable} unstable on a side: no ratio"
    in_one = {
        name: int((table[f"run_id_{s}"].notna() & table[f"run_id_{o}"].isna()).sum())
        for name, s, o in ((a, "a", "b"), (b, "b", "a"))
    }
    if any(in_one.values()):
        text += ". In one folder only: " + ", ".join(f"{n} {name}" for name, n in in_one.items())
    return text + "."
