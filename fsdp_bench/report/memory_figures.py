"""The memory figures: peak memory against tokens/s with the Pareto front, and what the
tracked memory held at the peak. They draw the frames `figure_data` prepares."""

from __future__ import annotations

from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from fsdp_bench.report import figure_data as data
from fsdp_bench.report.canvas import (
    FAILED_COLOR,
    Canvas,
    Figure,
    draw_budget,
    not_drawn,
    save_figure,
    stack_bars,
    thousands,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure as MplFigure


def memory_vs_throughput(df: pd.DataFrame, canvas: Canvas, budget_gib: float | None) -> Figure:
    """Every ok run as peak memory vs tokens/s, the Pareto front joined, the budget a line and
    runs without a measurement (OOM, predicted OOM) as crosses at the budget edge."""
    name, title = "memory_vs_throughput", "peak memory vs tokens/s"
    measured, failed = data.measured_runs(df), data.unmeasured_runs(df)
    if measured.empty:
        return not_drawn(name, title, f"no run finished ok ({len(failed)} OOM or predicted OOM)")
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    sns.scatterplot(
        data=measured,
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
    _draw_front(fig, ax, data.pareto_listing(measured))
    largest = float(measured["peak_memory_gib"].max())
    # a budget far above every peak would squeeze the runs into a corner: it is named instead
    shown_budget = budget_gib if budget_gib is not None and budget_gib <= 3 * largest else None
    edge = shown_budget if shown_budget is not None else largest * 1.05
    if shown_budget is not None:
        draw_budget(ax, shown_budget)
    elif budget_gib is not None:
        ax.plot([], [], " ", label=f"budget {budget_gib:g} GiB, off the axis")
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
    ax.set_ylim(bottom=0, top=float(measured["tokens_per_s"].max()) * 1.1)  # no point clipped
    ax.set_xlim(left=0, right=max(edge, largest) * 1.12)
    ax.set_xlabel("peak memory per rank (GiB)")
    ax.set_ylabel("tokens/s (all ranks)")
    thousands(ax.yaxis)
    ax.set_title(f"{title}\n{canvas.subject}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    caption = (
        "Up and to the left is better. Ringed points are the Pareto front (no other run is "
        "both faster and smaller), labelled by how they differ from the common configuration. "
        "Red crosses at the budget edge: runs that ran out of memory or were predicted to."
    )
    return Figure(name, title, caption, save_figure(fig, canvas, name))


def _draw_front(fig: MplFigure, ax: Axes, front: pd.DataFrame) -> None:
    """The front as a step line and rings, each point numbered, the numbers listed beside."""
    x, y = front["peak_memory_gib"], front["tokens_per_s"]
    ax.plot(x, y, drawstyle="steps-post", color="0.35", linewidth=1, zorder=2, label="Pareto front")
    ax.scatter(
        x,
        y,
        s=170,
        facecolors="none",
        edgecolors="0.2",
        linewidths=1.2,
        zorder=4,
        label="on the Pareto front",
    )
    for number, px, py in zip(front["number"], x, y, strict=True):
        ax.annotate(
            str(number),
            (px, py),
            xytext=(7, -3),
            textcoords="offset points",
            fontsize=8,
            color="0.15",
            fontweight="bold",
        )
    fig.text(
        1.02,
        0.0,
        "Pareto front, by peak memory\n" + "\n".join(front["listing"]),
        fontsize=7.5,
        va="bottom",
        ha="left",
        transform=ax.transAxes,
        bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "0.8"},
    )


def memory_breakdown(df: pd.DataFrame, canvas: Canvas, budget_gib: float | None) -> Figure:
    """Per configuration: the tracked memory at peak split by category (parameters,
    gradients, optimizer state, activations, temporaries), next to the measured peak."""
    name, title = "memory_breakdown", "memory at peak by category, per configuration"
    runs = data.breakdown_runs(df)
    if runs.empty:
        return not_drawn(name, title, "no ok run recorded a memory breakdown")
    parts = data.memory_parts(runs)
    fig, ax = plt.subplots(figsize=(9.5, 1.6 + 0.32 * len(parts)))
    positions = list(range(len(parts)))
    totals = stack_bars(ax, parts, positions, height=0.7)
    estimated = _mark_peaks(ax, runs, positions)
    if budget_gib is not None:
        draw_budget(ax, budget_gib)
    ax.set_yticks(positions, list(parts.index), fontsize=8)
    ax.invert_yaxis()
    drawn = [totals, runs["peak_memory_gib"], estimated, pd.Series([budget_gib])]
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


def _mark_peaks(ax: Axes, runs: pd.DataFrame, positions: list[int]) -> pd.Series | None:
    """The measured peak (diamond) and, when recorded, the estimate made before launch
    (ring) of each run; returns the estimates, which the x range must include."""
    ax.scatter(
        runs["peak_memory_gib"],
        positions,
        marker="D",
        color="black",
        s=22,
        zorder=3,
        label="measured peak",
    )
    estimated = runs.get("estimated_peak_gib")
    if estimated is not None and estimated.notna().any():
        ax.scatter(
            estimated,
            positions,
            marker="o",
            facecolors="none",
            edgecolors="black",
            s=40,
            zorder=3,
            label="estimated peak (before launch)",
        )
    return estimated


def memory_timeline(df: pd.DataFrame, canvas: Canvas) -> Figure:
    """Memory over one step for configurations that differ in one knob (prefetch, resharding,
    grouping), laid over each other, the collectives marked under the curves and each
    curve's peak named by its module and phase."""
    name, title = "memory_timeline", "memory over one step, configurations laid over each other"
    panels = data.timeline_panels(df)
    if not panels:
        return not_drawn(
            name, title, "no two ok FSDP runs with a memory timeline differ in one knob only"
        )
    fig, axes = plt.subplots(len(panels), 1, figsize=(9.5, 3.1 * len(panels)), squeeze=False)
    for ax, (axis, points, marks) in zip(axes[:, 0], panels, strict=True):
        labels = list(dict.fromkeys(points["label"]))
        colors = dict(zip(labels, sns.color_palette("deep", len(labels)), strict=True))
        for row, label in enumerate(labels):
            run = points[points["label"] == label]
            peak = run[run["peak"]].iloc[0]
            text = f"{label} (peak {peak['mib']:.1f} MiB: {peak['where']})"
            ax.plot(run["x"], run["mib"], color=colors[label], lw=1.3, label=text)
            ax.scatter([peak["x"]], [peak["mib"]], color=colors[label], s=30, zorder=3)
            for kind, marker in (("all_gather", 2), ("reduce_scatter", 3)):
                at = marks[(marks["label"] == label) & (marks["kind"] == kind)]["x"]
                ax.plot(at, [row * 0.04] * len(at), ls="", marker=marker, ms=6,
                        color=colors[label], transform=ax.get_xaxis_transform())  # fmt: skip
        low, high = float(points["mib"].min()), float(points["mib"].max())
        ax.set_ylim(low - 0.05 * (high - low), high + 0.5 * (high - low))  # room for the legend
        ax.set_ylabel("tracked MiB (rank 0)")
        ax.set_xlim(0, 1)
        ax.legend(fontsize=8, frameon=False, loc="upper left", title=axis, title_fontsize=8)
    axes[-1, 0].set_xlabel("fraction of the step's operators (forward, backward, optimizer)")
    fig.suptitle(f"{title}\n{canvas.subject}", fontsize=10)
    caption = (
        "Tracked tensor memory of rank 0 after every operator of the profiled step, for runs "
        "equal in every knob but the panel's; ticks at the bottom: all-gathers (up) and "
        "reduce-scatters (down) where they were issued. The dot is each run's peak; the "
        "legend names the module and phase running then."
    )
    return Figure(name, title, caption, save_figure(fig, canvas, name))
