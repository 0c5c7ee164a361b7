"""The report's figures: one function per figure, each drawing data `summaries` computed.

Every function returns a `Figure`: the files it wrote (PNG, and SVG on request), or, when the
data cannot support it (one world size, no search study), no files and the reason, which the
report shows instead of the picture. matplotlib runs headless (Agg); nothing is shown.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from fsdp_bench.report import summaries
from fsdp_bench.report.summaries import key

log = logging.getLogger(__name__)

MIB = 2**20
FAILED_COLOR = "#c0392b"


@dataclass
class Figure:
    """A drawn figure (its files, PNG first) or the reason it was not drawn."""

    name: str
    title: str
    caption: str
    paths: list[Path] = field(default_factory=list)
    skipped: str = ""


@dataclass(frozen=True)
class Canvas:
    """Where and how figures are written, and what their titles name."""

    out: Path
    subject: str
    """Model and hardware, for every title ("tiny on CPU x86_64, gloo")."""
    svg: bool = False


def draw_budget(ax: Any, budget_gib: float) -> None:
    """The memory budget per rank as a vertical dashed line on a GiB axis."""
    ax.axvline(budget_gib, color=FAILED_COLOR, linestyle="--", linewidth=1.2,
               label=f"budget {budget_gib:g} GiB")  # fmt: skip


def save_figure(fig: Any, canvas: Canvas, name: str) -> list[Path]:
    canvas.out.mkdir(parents=True, exist_ok=True)
    paths = [canvas.out / f"{name}.png"]
    if canvas.svg:
        paths.append(canvas.out / f"{name}.svg")
    for path in paths:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return paths


def not_drawn(name: str, title: str, reason: str) -> Figure:
    log.info("figure %s not drawn: %s", name, reason)
    return Figure(name=name, title=title, caption="", skipped=reason)


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    if df.empty:
        return df
    return df[df["status"].eq("ok") & df["tokens_per_s"].notna()]


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


def at_baseline(df: pd.DataFrame, free: list[str]) -> pd.DataFrame:
    """Rows whose effect axes, other than `free`, all hold their most common value: the
    slice of a one-knob-at-a-time grid where only `free` (and world size) vary."""
    if df.empty:
        return df
    mask = pd.Series(True, index=df.index)
    for axis in summaries.varying(df, summaries.EFFECT_AXES):
        if axis in free:
            continue
        mask &= df[axis].map(key) == key(summaries.baseline_value(df[axis]))
    return df[mask]


def throughput_by_grouping(df: pd.DataFrame, canvas: Canvas) -> Figure:
    """tokens/s per grouping x reshard_after_forward, a panel per world size; error bars span
    the repeats (min to max)."""
    name, title = "throughput_by_grouping", "tokens/s by grouping and reshard_after_forward"
    ok = _ok(df)
    ok = ok[ok["strategy"].eq("fsdp")] if "strategy" in ok else ok
    core = at_baseline(ok, ["grouping", "reshard_after_forward"])
    if core.empty:
        return not_drawn(name, title, "no FSDP run finished ok")
    samples = summaries.repeat_samples(core)
    samples["grouping"] = samples["grouping"].map(key)
    samples["reshard_after_forward"] = samples["reshard_after_forward"].map(key)
    samples["world size"] = samples["world_size"].astype(int)
    sizes = sorted(samples["world size"].unique())
    grid = sns.catplot(
        data=samples,
        kind="bar",
        x="grouping",
        y="tokens_per_s_sample",
        hue="reshard_after_forward",
        col="world size",
        order=grouping_order(samples["grouping"]),
        estimator="median",
        errorbar=("pi", 100),
        capsize=0.15,
        err_kws={"linewidth": 1.2},
        height=3.6,
        aspect=1.15 if len(sizes) > 1 else 1.6,
        sharey=True,
        palette="deep",
    )
    grid.set_axis_labels("grouping (fully_shard units)", "tokens/s (all ranks)")
    grid.set_titles("world size {col_name}")
    for ax in grid.axes.flat:
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    if grid.legend is not None:
        grid.legend.set_title("reshard_after_forward")
    grid.figure.suptitle(f"{title}\n{canvas.subject}", y=1.06)
    caption = (
        "Bar: median tokens/s over the timed repeats; error bar: min to max over repeats. "
        "Other knobs at the grid's most common value; DDP not shown; a missing bar is a "
        "configuration that did not finish ok (see Runs by status)."
    )
    return Figure(name, title, caption, save_figure(grid.figure, canvas, name))


def memory_vs_throughput(df: pd.DataFrame, canvas: Canvas, budget_gib: float | None) -> Figure:
    """Every ok run as peak memory vs tokens/s, the Pareto front joined, the budget a line and
    runs without a measurement (OOM, predicted OOM) as crosses at the budget edge."""
    name, title = "memory_vs_throughput", "peak memory vs tokens/s"
    ok = _ok(df).dropna(subset=["peak_memory_gib"])
    failed = df[df["status"].isin(["oom", "skipped"])] if not df.empty else df
    if ok.empty:
        return not_drawn(name, title, f"no run finished ok ({len(failed)} OOM or predicted OOM)")
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    ok = ok.assign(
        **{
            "world size": ok["world_size"].astype(int).astype(str),
            "strategy ": ok["strategy"].map(key),
        }
    )
    sns.scatterplot(
        data=ok,
        x="peak_memory_gib",
        y="tokens_per_s",
        hue="world size",
        style="strategy ",
        markers={"fsdp": "o", "ddp": "s"},
        s=60,
        ax=ax,
        palette="deep",
        zorder=3,
    )
    front = summaries.pareto_front(ok)
    ax.plot(
        front["peak_memory_gib"],
        front["tokens_per_s"],
        drawstyle="steps-post",
        color="0.35",
        linewidth=1,
        zorder=2,
        label="Pareto front",
    )
    ax.scatter(
        front["peak_memory_gib"],
        front["tokens_per_s"],
        s=170,
        facecolors="none",
        edgecolors="0.2",
        linewidths=1.2,
        zorder=4,
        label="on the Pareto front",
    )
    labels = summaries.config_labels(ok, summaries.config_columns(ok, ["world_size"]))
    listed = []
    texts = labels.to_dict()
    for number, (index, row) in enumerate(front.iterrows(), start=1):
        ax.annotate(
            str(number),
            (row["peak_memory_gib"], row["tokens_per_s"]),
            xytext=(7, -3),
            textcoords="offset points",
            fontsize=8,
            color="0.15",
            fontweight="bold",
        )
        listed.append(f"{number}: W={int(row['world_size'])}, {texts[index]}")
    fig.text(
        1.02,
        0.0,
        "Pareto front, by peak memory\n" + "\n".join(listed),
        fontsize=7.5,
        va="bottom",
        ha="left",
        transform=ax.transAxes,
        bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "0.8"},
    )
    peaks = ok["peak_memory_gib"]
    edge = budget_gib if budget_gib is not None else float(peaks.max()) * 1.05
    if budget_gib is not None:
        draw_budget(ax, budget_gib)
    if not failed.empty:
        ax.scatter(
            [edge] * len(failed),
            [0.0] * len(failed),
            marker="X",
            s=90,
            color=FAILED_COLOR,
            zorder=5,
            clip_on=False,
            label=f"OOM / skipped ({len(failed)}), no measurement",
        )
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0, right=max(edge, float(peaks.max())) * 1.12)
    ax.set_xlabel("peak memory per rank (GiB)")
    ax.set_ylabel("tokens/s (all ranks)")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_title(f"{title}\n{canvas.subject}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    caption = (
        "Up and to the left is better. Ringed points are the Pareto front (no other run is "
        "both faster and smaller), labelled by how they differ from the common configuration. "
        "Red crosses at the budget edge: runs that ran out of memory or were predicted to."
    )
    return Figure(name, title, caption, save_figure(fig, canvas, name))


def memory_breakdown(df: pd.DataFrame, canvas: Canvas, budget_gib: float | None) -> Figure:
    """Per configuration: the tracked memory at peak split by category (parameters,
    gradients, optimizer state, activations, temporaries), next to the measured peak."""
    name, title = "memory_breakdown", "memory at peak by category, per configuration"
    ok = _ok(df)
    ok = ok[ok["memory_breakdown_gib"].map(lambda v: isinstance(v, dict) and bool(v))]
    if ok.empty:
        return not_drawn(name, title, "no ok run recorded a memory breakdown")
    ok = ok.sort_values(["world_size", "peak_memory_gib"])
    labels = summaries.config_labels(ok, summaries.config_columns(ok, ["world_size"]))
    rows = [f"W={int(w)}: {text}" for w, text in zip(ok["world_size"], labels, strict=True)]
    parts = pd.DataFrame(list(ok["memory_breakdown_gib"]), index=rows).fillna(0.0)
    parts = parts[parts.sum().sort_values(ascending=False).index]
    colors = sns.color_palette("muted", len(parts.columns))
    fig, ax = plt.subplots(figsize=(9.5, 1.6 + 0.32 * len(parts)))
    left = pd.Series(0.0, index=parts.index)
    positions = range(len(parts))
    for column, color in zip(parts.columns, colors, strict=True):
        ax.barh(
            positions,
            parts[column],
            left=left,
            color=color,
            label=column.replace("_", " "),
            height=0.7,
        )
        left += parts[column]
    ax.scatter(
        ok["peak_memory_gib"],
        positions,
        marker="D",
        color="black",
        s=22,
        zorder=3,
        label="measured peak",
    )
    if "estimated_peak_gib" in ok and ok["estimated_peak_gib"].notna().any():
        ax.scatter(
            ok["estimated_peak_gib"],
            positions,
            marker="o",
            facecolors="none",
            edgecolors="black",
            s=40,
            zorder=3,
            label="estimated peak (before launch)",
        )
    if budget_gib is not None:
        draw_budget(ax, budget_gib)
    ax.set_yticks(list(positions), parts.index, fontsize=8)
    ax.invert_yaxis()
    drawn = [left, ok["peak_memory_gib"], ok.get("estimated_peak_gib"), pd.Series([budget_gib])]
    ax.set_xlim(left=0, right=1.04 * float(pd.concat(drawn).max()))  # no marker on the edge
    ax.set_xlabel("memory per rank (GiB)")
    ax.set_title(f"{title}\n{canvas.subject}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    caption = (
        "Stacked bars: what the tracked tensors held at the peak, by category; diamond: the "
        "measured peak per rank. W is the world size; labels say how a run differs from the "
        "common configuration."
    )
    return Figure(name, title, caption, save_figure(fig, canvas, name))


_COLLECTIVES = {
    "all-gather": ("all_gathers_per_step", "all_gather_bytes_per_step"),
    "reduce-scatter": ("reduce_scatters_per_step", "reduce_scatter_bytes_per_step"),
    "all-reduce": ("all_reduces_per_step", "all_reduce_bytes_per_step"),
}


def _collective_long(df: pd.DataFrame, x: pd.Series) -> pd.DataFrame:
    records = []
    xs = x.to_dict()
    for index, row in df.iterrows():
        for collective, (count, size) in _COLLECTIVES.items():
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
    return pd.DataFrame(records)


def collectives(df: pd.DataFrame, canvas: Canvas) -> Figure:
    """Collective calls and bytes per optimizer step per grouping and, when the grid varies
    it, per gradient-accumulation setting, at the largest world size measured."""
    name, title = "collectives", "collectives per optimizer step"
    ok = _ok(df)
    ok = ok[ok["world_size"].gt(1)] if not ok.empty else ok
    counted = [count for count, _ in _COLLECTIVES.values() if count in ok]
    if ok.empty or not counted or ok[counted].isna().all(axis=None):
        return not_drawn(
            name, title, "no ok run at world size > 1 with collective counts (one rank has none)"
        )
    size = int(ok["world_size"].max())
    ok = ok[ok["world_size"].eq(size)]
    panels: list[tuple[str, pd.DataFrame]] = []
    by_grouping = at_baseline(ok, ["grouping", "strategy"])
    if not by_grouping.empty:
        x = by_grouping.apply(
            lambda r: "DDP" if r.get("strategy") == "ddp" else key(r["grouping"]), axis=1
        )
        long = _collective_long(by_grouping, x)
        order = grouping_order(by_grouping["grouping"][x != "DDP"]) + (
            ["DDP"] if (x == "DDP").any() else []
        )
        panels.append(("grouping", long.assign(x=pd.Categorical(long["x"], order))))
    accum = at_baseline(ok, ["accumulation_steps", "grad_sync"])
    if summaries.varying(accum, ["accumulation_steps", "grad_sync"]):
        accum = accum.sort_values(["accumulation_steps", "grad_sync"])
        x = accum.apply(
            lambda r: f"{int(r['accumulation_steps'])} micro-batch(es)\nsync {r['grad_sync']}",
            axis=1,
        )
        panels.append(("gradient accumulation", _collective_long(accum, x)))
    panels = [(label, data) for label, data in panels if not data.empty]
    if not panels:
        return not_drawn(name, title, "no run recorded collective counts")
    fig, axes = plt.subplots(
        len(panels), 2, figsize=(11, 1.2 + 3.6 * len(panels)), squeeze=False, layout="constrained"
    )
    for row, (label, data) in enumerate(panels):
        for col, metric in enumerate(["calls per step", "MiB per step"]):
            ax = axes[row][col]
            sns.barplot(
                data=data,
                x="x",
                y=metric,
                hue="collective",
                ax=ax,
                palette="deep",
                hue_order=list(_COLLECTIVES),
                errorbar=None,
            )
            ax.set_xlabel(label)
            ax.set_ylabel("collective calls per step" if col == 0 else "MiB per step (per rank)")
            ax.tick_params(axis="x", labelsize=8)
            legend = ax.get_legend()
            if legend is not None:
                legend.remove()
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside right upper", frameon=False)
    fig.suptitle(f"{title} at world size {size}\n{canvas.subject}")
    caption = (
        "Calls and bytes each rank issues per optimizer step (rank 0's count). Finer grouping "
        "means more, smaller all-gathers; accumulation all-gathers again for every micro-batch, "
        "and syncing gradients only on the last one saves reduce-scatters."
    )
    return Figure(name, title, caption, save_figure(fig, canvas, name))


def scaling(df: pd.DataFrame, canvas: Canvas) -> Figure:
    """Scaling efficiency (tokens/s per GPU relative to the smallest world size) per
    configuration, against world size."""
    name, title = "scaling", "scaling efficiency vs world size"
    table = summaries.scaling_efficiency(df)
    if table.empty:
        seen = _ok(df)["world_size"].nunique() if not df.empty else 0
        return not_drawn(name, title, f"ok runs at {seen} world size(s); scaling needs two or more")
    fig, ax = plt.subplots(figsize=(9, 5))
    configs = list(dict.fromkeys(table["config"]))
    sns.lineplot(
        data=table,
        x="world_size",
        y="efficiency",
        hue="config",
        style="config",
        hue_order=configs,
        style_order=configs,
        markers=True,
        dashes=False,
        ax=ax,
        palette=sns.color_palette("tab20", len(configs)),
    )
    ax.axhline(1.0, color="0.5", linestyle=":", linewidth=1, label="linear scaling")
    sizes: list[int] = sorted(int(w) for w in table["world_size"].unique())
    ax.set_xticks(sizes)
    ax.set_xlabel("world size (GPUs / ranks)")
    ax.set_ylabel("scaling efficiency\n(tokens/s per GPU ÷ same at the smallest world size)")
    ax.set_ylim(bottom=0, top=max(1.1, float(table["efficiency"].max()) * 1.08))
    ax.set_title(f"{title}\n{canvas.subject}")
    ax.legend(
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        frameon=False,
        title="configuration",
    )
    caption = (
        f"1.0 is linear scaling from world size {sizes[0]}. Configurations measured at the "
        "smallest world size and at least one more."
    )
    return Figure(name, title, caption, save_figure(fig, canvas, name))


def comparison(table: pd.DataFrame, canvas: Canvas, names: tuple[str, str]) -> Figure:
    """tokens/s and peak memory of the same configurations in two results folders, side by
    side, one bar per folder."""
    name, title = "comparison", f"{names[0]} vs {names[1]}: the same configurations"
    both = table[table["tokens_per_s_a"].notna() & table["tokens_per_s_b"].notna()]
    if both.empty:
        return not_drawn(name, title, "no configuration ran ok in both results folders")
    rows = [f"W={int(w)}: {c}" for w, c in zip(both["world_size"], both["config"], strict=True)]
    long = pd.concat(
        [
            pd.DataFrame(
                {
                    "configuration": rows,
                    "results": names[i],
                    "tokens/s": both[f"tokens_per_s_{s}"].to_numpy(),
                    "peak GiB": both[f"peak_memory_gib_{s}"].to_numpy(),
                }
            )
            for i, s in enumerate("ab")
        ]
    )
    fig, axes = plt.subplots(
        1, 2, figsize=(12, 2.2 + 0.42 * len(both)), sharey=True, layout="constrained"
    )
    for ax, metric, label in [
        (axes[0], "tokens/s", "tokens/s (all ranks)"),
        (axes[1], "peak GiB", "peak memory per rank (GiB)"),
    ]:
        sns.barplot(
            data=long,
            y="configuration",
            x=metric,
            hue="results",
            ax=ax,
            palette="deep",
            errorbar=None,
        )
        ax.set_xlabel(label)
        ax.set_ylabel("")
        ax.tick_params(axis="y", labelsize=8)
        legend = ax.get_legend()
        if legend is not None:
            legend.remove()
    axes[0].xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", frameon=False, title="results folder")
    fig.suptitle(f"{title}\n{canvas.subject}")
    caption = "Configurations that ran ok in both folders, matched on every configuration field."
    return Figure(name, title, caption, save_figure(fig, canvas, name))


FIGURES: dict[str, Callable[..., Figure]] = {
    "throughput_by_grouping": throughput_by_grouping,
    "memory_vs_throughput": memory_vs_throughput,
    "memory_breakdown": memory_breakdown,
    "collectives": collectives,
    "scaling": scaling,
}
"""The figures every results folder gets, in report order (a search adds those of
`study_figures`)."""
