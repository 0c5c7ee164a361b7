"""What a results table says, as plain DataFrames: computed here, drawn and formatted elsewhere.

Pure pandas, no plotting, so every number a report shows is tested exactly. Every function
takes the table `load_results` returns, works on partial results (a sweep still running,
failures in some cells) and returns an empty frame rather than raising when nothing qualifies.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from fsdp_bench.report import ties
from fsdp_bench.report.configs import (
    EFFECT_AXES,
    SCALE_COLUMNS,
    baseline_value,
    config_columns,
    config_keys,
    config_labels,
    key,
    ok_runs,
    ordered_unique,
    varying,
)

STATUS_CATEGORIES = ["ok", "oom", "skipped: predicted_oom", "error", "timeout", "cancelled"]
"""Always shown, in this order, even at zero; other statuses follow when present."""


def status_category(status: str, reason: str) -> str:
    """ok, oom, ..., and "skipped: <why>" (the reason's first word, e.g. predicted_oom)."""
    if status != "skipped":
        return status
    why = (reason or "").split(":")[0].split()
    return f"skipped: {why[0]}" if why else "skipped"


def status_counts(df: pd.DataFrame) -> pd.DataFrame:
    """Runs per status category: a row per category (the usual six always, others when
    present), a column per world size and `total`."""
    if df.empty:
        categories = pd.Series(dtype=object)
    else:
        reasons = df["reason"] if "reason" in df else pd.Series("", index=df.index)
        categories = pd.Series(
            [status_category(s, r) for s, r in zip(df["status"], reasons, strict=True)],
            index=df.index,
        )
    order = STATUS_CATEGORIES + sorted(set(categories) - set(STATUS_CATEGORIES))
    sizes = sorted(df["world_size"].dropna().unique()) if "world_size" in df else []
    table = pd.DataFrame(index=pd.Index(order, name="status"))
    for size in sizes:
        counts = categories[df["world_size"] == size].value_counts()
        table[f"world size {int(size)}"] = [int(counts.get(c, 0)) for c in order]
    counts = categories.value_counts()
    table["total"] = [int(counts.get(c, 0)) for c in order]
    return table


def fits(df: pd.DataFrame, budget_gib: float | None) -> pd.Series:
    """Rows that ran ok with a measured peak within the budget (all ok rows without one)."""
    ok = df["status"].eq("ok") & df["tokens_per_s"].notna()
    if budget_gib is None:
        return ok
    return ok & df["peak_memory_gib"].le(budget_gib)


def best_per_world_size(df: pd.DataFrame, budget_gib: float | None) -> pd.DataFrame:
    """For every world size in the table, the fastest run that fits the budget.

    Equal tokens/s go to the lower peak memory, then the run_id. `tied` lists the other runs
    there that fit and cannot be told apart from the best (`fsdp_bench.stats.indistinguishable`),
    fastest first, comma-separated. A world size where nothing fits keeps its row, with no
    run_id and a note saying why (all failed, or all over budget).
    """
    columns = ["world_size", "run_id", "tokens_per_s", "peak_memory_gib", "tied", "note"]
    if df.empty:
        return pd.DataFrame(columns=columns)
    good = df[fits(df, budget_gib)]
    rows: list[dict[str, Any]] = []
    for size in sorted(df["world_size"].dropna().unique()):
        here = good[good["world_size"] == size]
        if here.empty:
            ok = df[(df["world_size"] == size) & df["status"].eq("ok")]
            note = "no run finished ok" if ok.empty else "every ok run is over the budget"
            rows.append({"world_size": int(size), "run_id": None, "note": note})
            continue
        best = here.sort_values(
            ["tokens_per_s", "peak_memory_gib", "run_id"], ascending=[False, True, True]
        ).iloc[0]
        rows.append(
            {
                "world_size": int(size),
                "run_id": best["run_id"],
                "tokens_per_s": float(best["tokens_per_s"]),
                "peak_memory_gib": float(best["peak_memory_gib"]),
                "tied": ", ".join(ties.tied_with(here, str(best["run_id"]))),
                "note": _contended_note(best),
            }
        )
    table = pd.DataFrame(rows, columns=columns)
    described = config_columns(df, exclude=SCALE_COLUMNS)
    shown = varying(df, described)
    by_id = df.drop_duplicates("run_id").set_index("run_id")
    for column in shown:
        values = [by_id.at[r, column] if isinstance(r, str) else None for r in table["run_id"]]
        table[column] = pd.Series(values, index=table.index, dtype=object)
    metrics = ["tokens_per_s", "peak_memory_gib", "tied", "note"]
    return table[["world_size", "run_id", *shown, *metrics]]


def _contended_note(run: pd.Series) -> str:
    """The best run's caveat when something else competed while it was timed."""
    flag = run.get("contended")
    return "contended: measured while something else ran" if flag is True or flag == 1 else ""


def axis_effects(df: pd.DataFrame) -> pd.DataFrame:
    """For each axis and each of its values: tokens/s, peak memory and all-gather bytes per
    step relative to the axis's baseline value, in runs identical in everything else (world
    size included).

    The median ratio over those matched pairs is the effect; `pairs` says how many there were
    (0: no run with this value has a twin at the baseline, so no effect is claimed). The
    tokens/s ratio's interval and `differs_from_1` are `_ratio_interval`'s.
    """
    columns = [
        "axis",
        "baseline",
        "value",
        "pairs",
        "tokens_per_s_ratio",
        "tokens_per_s_ratio_ci",
        "differs_from_1",
        "peak_memory_ratio",
        "all_gather_bytes_ratio",
    ]
    ok = ok_runs(df)
    numeric = [*CI_COLUMNS, "all_gather_bytes_per_step"]
    ok = ok.assign(**{c: pd.to_numeric(ok[c]) if c in ok else math.nan for c in numeric})
    measured = ["tokens_per_s", "peak_memory_gib", *numeric]
    rows: list[dict[str, Any]] = []
    identity = config_columns(df)
    for axis in varying(ok, [c for c in EFFECT_AXES if c in df.columns]):
        base = baseline_value(ok[axis])
        others = config_keys(ok, [c for c in identity if c != axis])
        values = ok[axis].map(key)
        at_base = ok[values == key(base)].assign(_k=others[values == key(base)])
        at_base = at_base.groupby("_k")[measured].median()
        at_base = at_base.add_suffix("_base")
        for value in ordered_unique(ok[axis]):
            if key(value) == key(base):
                continue
            mask = values == key(value)
            here = ok[mask].assign(_k=others[mask])
            here = here.groupby("_k")[measured].median()
            matched = here.join(at_base, how="inner")
            rows.append(
                {
                    "axis": axis,
                    "baseline": base,
                    "value": value,
                    "pairs": len(matched),
                    "tokens_per_s_ratio": _median_ratio(
                        matched["tokens_per_s"], matched["tokens_per_s_base"]
                    ),
                    **_ratio_interval(matched),
                    "peak_memory_ratio": _median_ratio(
                        matched["peak_memory_gib"], matched["peak_memory_gib_base"]
                    ),
                    "all_gather_bytes_ratio": _median_ratio(
                        matched["all_gather_bytes_per_step"],
                        matched["all_gather_bytes_per_step_base"],
                    ),
                }
            )
    return pd.DataFrame(rows, columns=columns)


def _median_ratio(values: pd.Series, base: pd.Series) -> float:
    ratios = (values / base).dropna()
    return float(ratios.median()) if len(ratios) else float("nan")


CI_COLUMNS = ["tokens_per_s_ci_low", "tokens_per_s_ci_high"]


def _ratio_interval(matched: pd.DataFrame) -> dict[str, Any]:
    """The tokens/s ratio's interval over matched pairs and whether it tells the effect from 1.

    Each pair's ratio lies in [low / base's high, high / base's low] when both runs' 95%
    intervals hold their true medians; the effect's interval is the hull of its pairs'
    (lowest low, highest high), so an effect is claimed ("yes") only when every pair's
    interval lies on the same side of 1; "no": it holds 1 (indistinguishable from no effect);
    "unknown": some pair has a run without an interval (too few steps).
    """
    if matched.empty:
        return {"tokens_per_s_ratio_ci": None, "differs_from_1": "-"}
    low = matched["tokens_per_s_ci_low"] / matched["tokens_per_s_ci_high_base"]
    high = matched["tokens_per_s_ci_high"] / matched["tokens_per_s_ci_low_base"]
    if low.isna().any() or high.isna().any():
        return {"tokens_per_s_ratio_ci": None, "differs_from_1": "unknown"}
    hull = (float(low.min()), float(high.max()))
    return {
        "tokens_per_s_ratio_ci": hull,
        "differs_from_1": "no" if hull[0] <= 1 <= hull[1] else "yes",
    }


SUSPECT_EFFICIENCY = 1.5
"""Scaling efficiency beyond which a figure is a symptom, not a result."""


def scaling_efficiency(df: pd.DataFrame) -> pd.DataFrame:
    """tokens/s per rank at each world size relative to the smallest world size in the table,
    for every configuration that ran ok, uncontended, at that smallest size and at least one
    other.

    Efficiency 1.0 is linear scaling; 0.5 means each rank does half the work it did alone.
    Above SUSPECT_EFFICIENCY no FSDP run scales: the smaller run was slowed by something
    (the note says so). Contended runs are left out: their speed is the machine's.
    """
    columns = ["config", "world_size", "tokens_per_s", "tokens_per_s_per_rank", "efficiency",
               "note"]  # fmt: skip
    ok = ok_runs(df)
    if "contended" in ok:
        ok = ok[ok["contended"].ne(True)]
    if ok.empty or ok["world_size"].nunique() < 2:
        return pd.DataFrame(columns=columns)
    identity = config_columns(ok, exclude=SCALE_COLUMNS)
    ok = ok.assign(
        _k=config_keys(ok, identity),
        config=config_labels(ok, varying(ok, identity)),
        tokens_per_s_per_rank=ok["tokens_per_s"] / ok["world_size"],
    )
    smallest = ok["world_size"].min()
    per = ok.groupby(["_k", "world_size"], as_index=False).agg(
        config=("config", "first"),
        tokens_per_s=("tokens_per_s", "median"),
        tokens_per_s_per_rank=("tokens_per_s_per_rank", "median"),
    )
    base = per[per["world_size"] == smallest].set_index("_k")["tokens_per_s_per_rank"]
    counts = per.groupby("_k")["world_size"].nunique()
    keep = [k for k in base.index if counts[k] > 1]
    per = per[per["_k"].isin(keep)].copy()
    per["efficiency"] = per["tokens_per_s_per_rank"] / per["_k"].map(base)
    per["note"] = [
        f"above {SUSPECT_EFFICIENCY:.0%}: the smaller run was slowed, not this one sped up"
        if e > SUSPECT_EFFICIENCY
        else ""
        for e in per["efficiency"]
    ]
    per["world_size"] = per["world_size"].astype(int)
    per = per.sort_values(["config", "world_size"]).reset_index(drop=True)
    return per[columns]


def pareto_front(df: pd.DataFrame) -> pd.DataFrame:
    """Ok runs no other ok run beats on both tokens/s (higher) and peak memory (lower),
    sorted by peak memory."""
    ok = df[df["status"].eq("ok") & df["tokens_per_s"].notna() & df["peak_memory_gib"].notna()]
    ordered = ok.sort_values(["peak_memory_gib", "tokens_per_s"], ascending=[True, False])
    front = []
    best = float("-inf")
    for index, row in ordered.iterrows():
        if row["tokens_per_s"] > best:
            front.append(index)
            best = row["tokens_per_s"]
    return ordered.loc[front]


def best_so_far(trials: pd.DataFrame, maximize: bool = True) -> pd.DataFrame:
    """A search's completed trials in order, each marked feasible or not, with the best
    feasible value up to and including it (NaN before the first feasible one).

    `trials` has one row per trial: number, state (optuna's name: COMPLETE, FAIL, ...), value
    and feasible (the memory constraint held).
    """
    columns = ["number", "value", "kind", "best_so_far"]
    if trials.empty:
        return pd.DataFrame(columns=columns)
    done = trials[trials["state"].eq("COMPLETE")].sort_values("number")
    if done.empty:
        return pd.DataFrame(columns=columns)
    feasible = done["feasible"].astype(bool)
    values = done["value"].where(feasible)
    best = (values.cummax() if maximize else values.cummin()).ffill()
    return pd.DataFrame(
        {
            "number": done["number"].astype(int).to_numpy(),
            "value": done["value"].astype(float).to_numpy(),
            "kind": ["feasible" if f else "over budget / OOM" for f in feasible],
            "best_so_far": best.astype(float).to_numpy(),
        }
    )


def subject(df: pd.DataFrame) -> str:
    """Model and hardware of a results table, for figure titles: "tiny on CPU (x86_64), gloo"."""
    if df.empty:
        return "no runs"

    def names(column: str) -> list[str]:
        if column not in df:
            return []
        return sorted({key(v) for v in df[column].dropna() if key(v) not in ("", "null")})

    models = ", ".join(names("model")) or "unknown model"
    hardware = []
    for device in names("device"):
        here = df[df["device"].map(key) == device]
        details = sorted({key(v) for v in here.get("device_name", pd.Series()).dropna()})
        shown = ", ".join(details)
        hardware.append(f"{device.upper()} ({shown})" if device == "cpu" and shown else shown)
    backends = ", ".join(names("backend"))
    where = " + ".join(h for h in hardware if h) or "unknown hardware"
    return f"model {models} on {where}" + (f", {backends}" if backends else "")


def provenance(df: pd.DataFrame) -> dict[str, str]:
    """Where and when the runs were measured: versions, devices, hosts, first and last date."""

    def distinct(column: str) -> list[str]:
        if column not in df:
            return []
        found: set[str] = set()
        for value in df[column].dropna():
            items = value if isinstance(value, list) else [value]
            found.update(key(v) for v in items if key(v) not in ("", "null"))
        return sorted(found)

    hosts = distinct("hostnames")
    shown_hosts = ", ".join(hosts[:20]) + (
        f" and {len(hosts) - 20} more" if len(hosts) > 20 else ""
    )
    started = distinct("started_at")
    finished = distinct("finished_at")
    return {
        "runs recorded": str(len(df)),
        "torch version": ", ".join(distinct("torch_version")) or "-",
        "fsdp-bench version": ", ".join(distinct("fsdp_bench_version")) or "-",
        "python version": ", ".join(distinct("python_version")) or "-",
        "devices": " / ".join(
            part
            for part in (", ".join(distinct("device")), ", ".join(distinct("device_name")))
            if part
        )
        or "-",
        "backend": ", ".join(distinct("backend")) or "-",
        "hosts": f"{len(hosts)}: {shown_hosts}" if hosts else "-",
        "first run started": started[0] if started else "-",
        "last run finished": finished[-1] if finished else "-",
        **_measured_again(df),
    }


def _measured_again(df: pd.DataFrame) -> dict[str, str]:
    count = int(df.attrs.get("measured_again", 0))
    if not count:
        return {}
    what = "configuration was" if count == 1 else "configurations were"
    return {
        "measured again": f"{count} {what} measured again (a search's confirmation round, "
        "other measurement settings): the record with the most timed steps stands for each"
    }
