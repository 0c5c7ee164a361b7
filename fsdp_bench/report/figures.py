"""The report's figures: one function per figure, each drawing a frame `figure_data` or
`summaries` computed, and `FIGURES`, the ones every results folder gets.

The memory figures are in `memory_figures`, a search's in `search_figures`; what they share
(`Figure`, `Canvas`, saving) is in `canvas`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from fsdp_bench.report import figure_data as data
from fsdp_bench.report import summaries
from fsdp_bench.report.canvas import (
    Canvas,
    Figure,
    not_drawn,
    save_figure,
    stack_bars,
    thousands,
)
from fsdp_bench.report.configs import ok_runs
from fsdp_bench.report.memory_figures import (
    memory_breakdown,
    memory_timeline,
    memory_vs_throughput,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure as MplFigure


def throughput_by_grouping(df: pd.DataFrame, canvas: Canvas) -> Figure:
    """tokens/s per grouping x reshard_after_forward, a panel per world size: each run's
    figure and 95% interval as the ranking gives them."""
    name, title = "throughput_by_grouping", "tokens/s by grouping and reshard_after_forward"
    bars = data.grouping_bars(df)
    if bars.empty:
        return not_drawn(name, title, "no FSDP run finished ok")
    sizes = sorted(bars["world size"].unique())
    order = data.grouping_order(bars["grouping"])
    hues = sorted(bars["reshard_after_forward"].unique())
    width = 0.8 / len(hues)
    colors = sns.color_palette("deep", len(hues))
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes) + 1, 3.6), sharey=True,
                             squeeze=False)  # fmt: skip
    for ax, size in zip(axes[0], sizes, strict=True):
        here = bars[bars["world size"] == size]
        for h, (hue, color) in enumerate(zip(hues, colors, strict=True)):
            rows = here[here["reshard_after_forward"] == hue].set_index("grouping")
            rows = rows.reindex([g for g in order if g in rows.index])
            x = [order.index(g) + (h - (len(hues) - 1) / 2) * width for g in rows.index]
            errors = [(rows["tokens_per_s"] - rows["ci_low"]).fillna(0),
                      (rows["ci_high"] - rows["tokens_per_s"]).fillna(0)]  # fmt: skip
            ax.bar(x, rows["tokens_per_s"], width, yerr=errors, capsize=3, color=color,
                   label=hue, error_kw={"linewidth": 1.2})  # fmt: skip
        ax.set_xticks(range(len(order)), order)
        ax.set_title(f"world size {size}")
        ax.set_xlabel("grouping (fully_shard units)")
        thousands(ax.yaxis)
    axes[0][0].set_ylabel("tokens/s (all ranks)")
    axes[0][-1].legend(title="reshard_after_forward", loc="upper left", bbox_to_anchor=(1, 1))
    fig.suptitle(f"{title}\n{canvas.subject}", y=1.06)
    caption = (
        "Bar: each run's tokens/s (from its median step time); error bar: its 95% interval, "
        "the one the ranking shows (order statistics of the step times, inverted; none with "
        "fewer than 6 timed steps). Other knobs at the grid's most common value; DDP not "
        "shown; a missing bar is a configuration that did not finish ok (see Runs by status)."
    )
    return Figure(name, title, caption, save_figure(fig, canvas, name))


def collectives(df: pd.DataFrame, canvas: Canvas) -> Figure:
    """Collective calls and bytes per optimizer step per grouping and, when the grid varies
    it, per gradient-accumulation setting, at the largest world size measured."""
    name, title = "collectives", "collectives per optimizer step"
    runs = data.collective_runs(df)
    if runs.empty:
        return not_drawn(
            name, title, "no ok run at world size > 1 with collective counts (one rank has none)"
        )
    panels = data.collective_panels(runs)
    if not panels:
        return not_drawn(name, title, "no run recorded collective counts")
    fig = _collective_panels(panels)
    size = int(runs["world_size"].max())
    fig.suptitle(f"{title} at world size {size}\n{canvas.subject}")
    caption = (
        "Calls and bytes each rank issues per optimizer step (rank 0's count). Finer grouping "
        "means more, smaller all-gathers; accumulation all-gathers again for every micro-batch, "
        "and syncing gradients only on the last one saves reduce-scatters."
    )
    return Figure(name, title, caption, save_figure(fig, canvas, name))


def _collective_panels(panels: list[tuple[str, pd.DataFrame]]) -> MplFigure:
    """A row per panel: calls per step on the left, MiB per step on the right; one legend."""
    fig, axes = plt.subplots(
        len(panels), 2, figsize=(11, 1.2 + 3.6 * len(panels)), squeeze=False, layout="constrained"
    )
    for row, (label, long) in enumerate(panels):
        for col, metric in enumerate(["calls per step", "MiB per step"]):
            ax = axes[row][col]
            sns.barplot(
                data=long,
                x="x",
                y=metric,
                hue="collective",
                ax=ax,
                palette="deep",
                hue_order=list(data.COLLECTIVES),
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
    return fig


def scaling(df: pd.DataFrame, canvas: Canvas) -> Figure:
    """Scaling efficiency (tokens/s per rank relative to the smallest world size) per
    configuration, against world size."""
    name, title = "scaling", "scaling efficiency vs world size"
    table = summaries.scaling_efficiency(df)
    table = table[table["note"].eq("")]  # a slowed baseline's figure is not drawn
    if table.empty:
        seen = ok_runs(df)["world_size"].nunique()
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
    ax.set_ylabel("scaling efficiency\n(tokens/s per rank ÷ same at the smallest world size)")
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


def tensor_parallel(df: pd.DataFrame, canvas: Canvas) -> Figure:
    """tokens/s and peak memory per rank against tp_size, a line per world size (the fastest
    run at each point)."""
    name, title = "tensor_parallel", "tokens/s and peak memory against tp_size"
    points = data.tensor_parallel_points(df)
    if points.empty:
        return not_drawn(name, title, "tp_size does not vary among the ok runs")
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    sizes = sorted(points["world_size"].unique())
    palette = dict(zip(sizes, sns.color_palette("deep", len(sizes)), strict=True))
    for size in sizes:
        at = points[points["world_size"] == size]
        low = at["tokens_per_s"] - at["tokens_per_s_ci_low"]
        high = at["tokens_per_s_ci_high"] - at["tokens_per_s"]
        speed.errorbar(at["tp_size"], at["tokens_per_s"], yerr=[low, high], marker="o",
                       capsize=3, color=palette[size], label=f"world size {size}")  # fmt: skip
        memory.plot(at["tp_size"], at["peak_memory_gib"], marker="o", color=palette[size])
    tp_sizes = sorted(points["tp_size"].unique())
    for ax, label in ((speed, "tokens/s (all ranks)"), (memory, "peak memory per rank (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(tp_sizes, [str(t) for t in tp_sizes])
        ax.set_xlabel("tp_size (ranks per tensor-parallel group)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    thousands(speed.yaxis)
    fig.legend(loc="outside right upper", frameon=False)
    fig.suptitle(f"{title}\n{canvas.subject}")
    caption = (
        "The fastest run at each world size and tp_size; error bars: 95% intervals of its "
        "tokens/s. A tensor-parallel group's ranks share a batch slice, so tokens/s counts "
        "each token once; memory falls as TP splits weights and activations, while every "
        "matmul's input or output crosses the group."
    )
    return Figure(name, title, caption, save_figure(fig, canvas, name))


def step_breakdown(df: pd.DataFrame, canvas: Canvas) -> Figure:
    """Per configuration: the profiled step's forward, backward and optimizer time stacked,
    and below each bar the communication no compute hid."""
    name, title = "step_breakdown", "where a step's time goes, per configuration"
    phases = data.step_phases(df)
    if phases.empty:
        return not_drawn(name, title, "no ok run recorded a profiled step's breakdown")
    fig, ax = plt.subplots(figsize=(9.5, 1.6 + 0.42 * len(phases)))
    positions = list(range(len(phases)))
    stack_bars(ax, phases[list(data.PHASE_COLUMNS)], positions, height=0.5)
    exposed = [p + 0.33 for p in positions]
    ax.barh(exposed, phases["exposed communication"], color="0.35", height=0.16,
            label="exposed communication")  # fmt: skip
    ax.set_yticks(positions, list(phases.index), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds in the profiled step (rank 0)")
    ax.set_title(f"{title}\n{canvas.subject}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    caption = (
        "Stacked bar: forward, backward (all micro-batches) and optimizer time of one profiled "
        "step under torch.profiler; thin bar: the time a collective was in flight with no "
        "compute beside it. On CPU + gloo almost nothing overlaps; on GPUs the thin bar is "
        "what prefetching and grouping did not hide."
    )
    return Figure(name, title, caption, save_figure(fig, canvas, name))


def comparison(table: pd.DataFrame, canvas: Canvas, names: tuple[str, str]) -> Figure:
    """tokens/s and peak memory of the same configurations in two results folders, side by
    side, one bar per folder."""
    name, title = "comparison", f"{names[0]} vs {names[1]}: the same configurations"
    long = data.comparison_long(table, names)
    if long.empty:
        return not_drawn(name, title, "no configuration ran ok in both results folders")
    fig, axes = plt.subplots(
        1, 2, figsize=(12, 2.2 + 0.42 * (len(long) // 2)), sharey=True, layout="constrained"
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
    thousands(axes[0].xaxis)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", frameon=False, title="results folder")
    fig.suptitle(f"{title}\n{canvas.subject}")
    caption = "Configurations that ran ok in both folders, matched on every configuration field."
    return Figure(name, title, caption, save_figure(fig, canvas, name))


FIGURES: dict[str, Callable[..., Figure]] = {
    "throughput_by_grouping": throughput_by_grouping,
    "memory_vs_throughput": memory_vs_throughput,
    "memory_breakdown": memory_breakdown,
    "memory_timeline": memory_timeline,
    "collectives": collectives,
    "step_breakdown": step_breakdown,
    "scaling": scaling,
}
"""The figures every results folder gets, in report order (a search adds those of
`search_figures`)."""
