"""Two results folders side by side: the same configurations matched, ratios B / A.

Rows match on every configuration field (world size included) and nothing else, so two
clusters, torch versions or measurement settings (repeats, timed steps) still line up. A
configuration in only one folder keeps its row with the other side empty.
"""

from __future__ import annotations

import pandas as pd

from fsdp_bench.report.configs import config_columns, config_keys, config_labels, varying


def compare_results(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration in either table: status, tokens/s and peak memory on each
    side (median over repeated rows that ran ok), and their ratios B / A.

    Columns: config (label), world_size, status_a, status_b, tokens_per_s_a, tokens_per_s_b,
    tokens_per_s_ratio, peak_memory_gib_a, peak_memory_gib_b, peak_memory_ratio, run_id_a,
    run_id_b.
    """
    columns = [
        "config",
        "world_size",
        "status_a",
        "status_b",
        "tokens_per_s_a",
        "tokens_per_s_b",
        "tokens_per_s_ratio",
        "peak_memory_gib_a",
        "peak_memory_gib_b",
        "peak_memory_ratio",
        "run_id_a",
        "run_id_b",
    ]
    both = pd.concat([a.assign(_side="a"), b.assign(_side="b")], ignore_index=True)
    if both.empty:
        return pd.DataFrame(columns=columns)
    identity = config_columns(both)
    both["_k"] = config_keys(both, identity)
    shown = [c for c in varying(both, identity) if c != "world_size"]
    both["config"] = config_labels(both, shown)
    sides = {}
    for side in "ab":
        rows = both[both["_side"] == side]
        ok = rows[rows["status"].eq("ok")]
        metrics = ok.groupby("_k")[["tokens_per_s", "peak_memory_gib"]].median()
        first = rows.sort_values("status", key=lambda s: s.ne("ok")).groupby("_k").first()
        sides[side] = (
            first[["config", "world_size", "status", "run_id"]].join(metrics).add_suffix(f"_{side}")
        )
    table = sides["a"].join(sides["b"], how="outer")
    table["config"] = table["config_a"].fillna(table["config_b"])
    table["world_size"] = table["world_size_a"].fillna(table["world_size_b"]).astype(int)
    table["tokens_per_s_ratio"] = table["tokens_per_s_b"] / table["tokens_per_s_a"]
    table["peak_memory_ratio"] = table["peak_memory_gib_b"] / table["peak_memory_gib_a"]
    table = table.sort_values(["world_size", "config"]).reset_index(drop=True)
    return table[columns]
