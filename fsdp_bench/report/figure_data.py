"""What each figure draws, as plain DataFrames: rows picked and reshaped here, so the drawing
modules only draw and every number on a figure is tested exactly."""

from __future__ import annotations

import pandas as pd

from fsdp_bench.report.configs import (
    at_baseline,
    baseline_value,
    config_columns,
    config_labels,
    key,
    ok_runs,
    varying,
)
from fsdp_bench.report.summaries import pareto_front

MIB = 2**20

COLLECTIVES = {
    "all-gather": ("all_gathers_per_step", "all_gather_bytes_per_step"),
    "reduce-scatter": ("reduce_scatters_per_step", "reduce_scatter_bytes_per_step"),
    "all-reduce": ("all_reduces_per_step", "all_reduce_bytes_per_step"),
}
"""Each collective's name on the figures and its (calls, bytes) columns in a results row."""


def grouping_order(values: pd.Series) -> list[str]:
    """Coarse to fine: root, blocks:K (K descending), block, linear, then anything else."""

    def rank(name: str) -> tuple[int, float, str]:
        if name == "root":
            return (0, 0.0, name)
        if name.startswith("blocks:"):
            return (1, -float(name.split(":")[1]), name)
        if name == "block":
            return (2, 0.0, name)
        if name == "linear":
            return (3, 0.0, name)
        return (4, 0.0, name)

    return sorted({key(v) for v in values}, key=rank)


def grouping_bars(df: pd.DataFrame) -> pd.DataFrame:
    """One row per FSDP run where only grouping, reshard_after_forward and world size vary:
    its tokens/s and the same 95% interval the ranking shows (`tokens_per_s_ci_low` and
    `_high`, NaN where a run has none); grouping and reshard spelled as in YAML, `world size`
    an int."""
    ok = ok_runs(df)
    ok = ok[ok["strategy"].eq("fsdp")] if "strategy" in ok else ok
    core = at_baseline(ok, ["grouping", "reshard_after_forward"]).drop_duplicates("run_id")
    columns = ["run_id", "world size", "grouping", "reshard_after_forward", "tokens_per_s",
               "ci_low", "ci_high"]  # fmt: skip
    if core.empty:
        return pd.DataFrame(columns=columns)
    missing = pd.Series(float("nan"), index=core.index)
    return pd.DataFrame(
        {
            "run_id": core["run_id"],
            "world size": core["world_size"].astype(int),
            "grouping": core["grouping"].map(key),
            "reshard_after_forward": core["reshard_after_forward"].map(key),
            "tokens_per_s": core["tokens_per_s"].astype(float),
            "ci_low": core.get("tokens_per_s_ci_low", missing).astype(float),
            "ci_high": core.get("tokens_per_s_ci_high", missing).astype(float),
        }
    )[columns]


def measured_runs(df: pd.DataFrame) -> pd.DataFrame:
    """Ok runs with a measured peak, with the world size and strategy spelled for legends."""
    ok = ok_runs(df).dropna(subset=["peak_memory_gib"])
    return ok.assign(
        **{
            "world size": ok["world_size"].astype(int).astype(str),
            "strategy ": ok["strategy"].map(key),
        }
    )


def unmeasured_runs(df: pd.DataFrame) -> pd.DataFrame:
    """Runs that have no peak because memory ran out, or was predicted to (OOM, skipped)."""
    return df[df["status"].isin(["oom", "skipped"])] if not df.empty else df


def pareto_listing(measured: pd.DataFrame) -> pd.DataFrame:
    """The Pareto front of `measured`, numbered by peak memory, each with its legend line
    ("1: W=2, block, reshard=true")."""
    front = pareto_front(measured)
    labels = config_labels(measured, config_columns(measured, ["world_size"]))
    numbers = range(1, len(front) + 1)
    return front.assign(
        number=list(numbers),
        listing=[
            f"{n}: W={int(w)}, {labels.loc[i]}"
            for n, w, i in zip(numbers, front["world_size"], front.index, strict=True)
        ],
    )


def breakdown_runs(df: pd.DataFrame) -> pd.DataFrame:
    """Ok runs with a memory breakdown, by world size then peak, each with a `label`
    ("W=2: block") saying how it differs from the common configuration."""
    ok = ok_runs(df)
    ok = ok[ok["memory_breakdown_gib"].map(lambda v: isinstance(v, dict) and bool(v))]
    ok = ok.sort_values(["world_size", "peak_memory_gib"])
    labels = config_labels(ok, config_columns(ok, ["world_size"]))
    return ok.assign(
        label=[f"W={int(w)}: {text}" for w, text in zip(ok["world_size"], labels, strict=True)]
    )


def memory_parts(runs: pd.DataFrame) -> pd.DataFrame:
    """GiB per category at the peak, a row per run of `breakdown_runs` (by label), categories
    largest first, 0 where a run has none."""
    parts = pd.DataFrame(list(runs["memory_breakdown_gib"]), index=list(runs["label"]))
    parts = parts.fillna(0.0)
    return parts[parts.sum().sort_values(ascending=False).index]


def collective_counts(df: pd.DataFrame, x: pd.Series) -> pd.DataFrame:
    """A row per run and collective it issued: `x` (the run's bar), collective, calls per
    step, MiB per step (0 when the row has no bytes for it)."""
    records = []
    xs = x.to_dict()
    for index, row in df.iterrows():
        for collective, (count, size) in COLLECTIVES.items():
            if count not in row or pd.isna(row[count]):
                continue
            records.append(
                {
                    "x": xs[index],
                    "collective": collective,
                    "calls per step": float(row[count]),
                    "MiB per step": float(row.get(size) or 0.0) / MIB,
                }
            )
    return pd.DataFrame(records, columns=["x", "collective", "calls per step", "MiB per step"])


def collective_runs(df: pd.DataFrame) -> pd.DataFrame:
    """Ok runs at the largest world size measured, if any ok run beyond one rank counted its
    collectives (a single rank issues none)."""
    ok = ok_runs(df)
    ok = ok[ok["world_size"].gt(1)] if not ok.empty else ok
    counted = [count for count, _ in COLLECTIVES.values() if count in ok]
    if ok.empty or not counted or ok[counted].isna().all(axis=None):
        return ok.iloc[0:0]
    return ok[ok["world_size"].eq(ok["world_size"].max())]


def collective_panels(runs: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """The collectives figure's panels, (x-axis label, `collective_counts`): per grouping (DDP
    last) and, when the grid varies it, per gradient-accumulation setting."""
    panels: list[tuple[str, pd.DataFrame]] = []
    by_grouping = at_baseline(runs, ["grouping", "strategy"])
    if not by_grouping.empty:
        x = by_grouping.apply(
            lambda r: "DDP" if r.get("strategy") == "ddp" else key(r["grouping"]), axis=1
        )
        long = collective_counts(by_grouping, x)
        order = grouping_order(by_grouping["grouping"][x != "DDP"]) + (
            ["DDP"] if (x == "DDP").any() else []
        )
        panels.append(("grouping", long.assign(x=pd.Categorical(long["x"], order))))
    accum = at_baseline(runs, ["accumulation_steps", "grad_sync"])
    if varying(accum, ["accumulation_steps", "grad_sync"]):
        accum = accum.sort_values(["accumulation_steps", "grad_sync"])
        x = accum.apply(
            lambda r: f"{int(r['accumulation_steps'])} micro-batch(es)\nsync {r['grad_sync']}",
            axis=1,
        )
        panels.append(("gradient accumulation", collective_counts(accum, x)))
    return [(label, data) for label, data in panels if not data.empty]


def comparison_long(table: pd.DataFrame, names: tuple[str, str]) -> pd.DataFrame:
    """The configurations of `compare_results` that ran ok in both folders, a row per folder:
    configuration ("W=2: block"), results (the folder's name), tokens/s, peak GiB."""
    both = table[table["tokens_per_s_a"].notna() & table["tokens_per_s_b"].notna()]
    rows = [f"W={int(w)}: {c}" for w, c in zip(both["world_size"], both["config"], strict=True)]
    return pd.concat(
        [
            pd.DataFrame(
                {
                    "configuration": rows,
                    "results": names[i],
                    "tokens/s": both[f"tokens_per_s_{side}"].to_numpy(),
                    "peak GiB": both[f"peak_memory_gib_{side}"].to_numpy(),
                }
            )
            for i, side in enumerate("ab")
        ],
        ignore_index=True,
    )


PHASE_COLUMNS = {"forward": "forward_s", "backward": "backward_s", "optimizer": "optimizer_s"}
"""Each phase of the profiled step and its column in a results row."""


def step_phases(df: pd.DataFrame) -> pd.DataFrame:
    """Ok runs whose profiled step was broken down, by world size then step time: a row per
    run (index: its label, "W=2: block"), milliseconds per phase, exposed and total
    communication, and the share hidden."""
    ok = ok_runs(df)
    if ok.empty or "forward_s" not in ok:
        return pd.DataFrame()
    ok = ok[ok["forward_s"].notna()].sort_values(["world_size", "step_time_s"])
    if ok.empty:
        return pd.DataFrame()
    labels = config_labels(ok, config_columns(ok, ["world_size"]))
    index = [f"W={int(w)}: {text}" for w, text in zip(ok["world_size"], labels, strict=True)]
    table = pd.DataFrame(
        {phase: 1000 * ok[column].to_numpy() for phase, column in PHASE_COLUMNS.items()},
        index=index,
    )
    table["communication"] = 1000 * ok["comm_s"].to_numpy()
    table["exposed communication"] = 1000 * ok["exposed_comm_s"].to_numpy()
    table["hidden %"] = ok["comm_hidden_pct"].to_numpy()
    table["run_id"] = ok["run_id"].to_numpy()
    return table


TIMELINE_AXES = ("prefetch", "reshard_after_forward", "grouping")
"""The knobs whose memory timelines are laid over each other: explicit prefetch (the
double-buffer peak, seed section 07), parameters kept to backward, and how much one
all-gather materialises."""


def timeline_panels(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame, pd.DataFrame]]:
    """Per knob of TIMELINE_AXES that varies among the ok FSDP runs at the most common world
    size, every other knob at its common value: (knob, points, collectives). `points`: run
    `label`, `x` (fraction of the step's operators), `mib`, `where` ("layers.1 backward") and
    `peak` (the run's largest point); `collectives`: `label`, `x`, `kind`."""
    ok = ok_runs(df)
    if ok.empty or "memory_timeline" not in ok.columns:
        return []
    ok = ok[ok["memory_timeline"].map(lambda t: isinstance(t, dict) and bool(t.get("points")))]
    if ok.empty:
        return []
    ok = ok[(ok["strategy"] != "ddp") & (ok["world_size"] == baseline_value(ok["world_size"]))]
    panels = []
    for axis in TIMELINE_AXES:
        runs = at_baseline(ok, [axis]).drop_duplicates(axis) if axis in ok.columns else ok[:0]
        if len(runs) < 2:
            continue
        points, marks = [], []
        for value, timeline in zip(runs[axis], runs["memory_timeline"], strict=True):
            label, num_ops = f"{axis}={key(value)}", max(int(timeline["num_ops"]), 1)
            peak = max(timeline["points"], key=lambda p: p[1])
            for point in timeline["points"]:
                index, num_bytes, where = point
                row = {"label": label, "x": index / num_ops, "mib": num_bytes / MIB}
                points.append({**row, "where": where, "peak": point is peak})
            marks += [
                {"label": label, "x": i / num_ops, "kind": k} for i, k in timeline["collectives"]
            ]
        panels.append(
            (axis, pd.DataFrame(points), pd.DataFrame(marks, columns=["label", "x", "kind"]))
        )
    return panels


def tensor_parallel_points(df: pd.DataFrame) -> pd.DataFrame:
    """The fastest ok run at each (world size, tp_size) of a grid that varies tp_size: its
    tokens/s with the 95% interval, and its peak memory. Empty when tp_size does not vary."""
    ok = ok_runs(df)
    if "tp_size" not in ok.columns or ok["tp_size"].nunique() < 2:
        return pd.DataFrame()
    fastest = ok.sort_values("tokens_per_s", ascending=False).drop_duplicates(
        ["world_size", "tp_size"]
    )
    columns = ["world_size", "tp_size", "tokens_per_s", "tokens_per_s_ci_low",
               "tokens_per_s_ci_high", "peak_memory_gib", "run_id"]  # fmt: skip
    out = fastest[columns].sort_values(["world_size", "tp_size"]).reset_index(drop=True)
    return out.astype({"world_size": int, "tp_size": int})


def collectives_by_dimension(df: pd.DataFrame) -> pd.DataFrame:
    """Per ok run over a mesh of more than one dimension (HSDP, tensor parallelism), a row
    per dimension: its collectives per step and their MiB (`collectives_per_dimension`)."""
    ok = ok_runs(df)
    if "collectives_per_dimension" not in ok.columns:
        return pd.DataFrame()
    labels = config_labels(ok, config_columns(ok, ["world_size"]))  # apart from every run
    ok = ok[ok["collectives_per_dimension"].map(lambda v: isinstance(v, dict) and len(v) > 1)]
    rows = []
    for label, (_, run) in zip(labels.loc[ok.index], ok.iterrows(), strict=True):
        for dimension, counts in sorted(run["collectives_per_dimension"].items()):
            row = {"configuration": f"W={int(run['world_size'])}: {label}",
                   "dimension": dimension}  # fmt: skip
            for name, (calls, size) in COLLECTIVES.items():
                field = calls.removesuffix("_per_step")
                row[name] = counts.get(field, 0)
                row[f"{name} MiB"] = counts.get(size.removesuffix("_per_step"), 0) / MIB
            rows.append(row)
    return pd.DataFrame(rows)
