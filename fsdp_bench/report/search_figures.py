"""The figures of a search: best value so far per trial, and optuna's parameter importance.

Drawn from plain data (`summaries.best_so_far`, `study.importances`) like every figure.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import matplotlib.ticker
import pandas as pd
import seaborn as sns

from fsdp_bench.report import summaries
from fsdp_bench.report.canvas import FAILED_COLOR, Canvas, Figure, not_drawn, save_figure


def search_progress(
    trials: pd.DataFrame, canvas: Canvas, metric: str, maximize: bool = True
) -> Figure:
    """Every trial's value against its number, infeasible ones marked, and the best
    feasible value so far as a step line."""
    name, title = "search_progress", f"search: best {metric} so far vs trial"
    history = summaries.best_so_far(trials, maximize)
    if history.empty:
        return not_drawn(name, title, "no completed trial in the study")
    fig, ax = plt.subplots(figsize=(8.5, 4.6))
    kinds = history["kind"]
    for kind, marker, color in [
        ("feasible", "o", sns.color_palette("deep")[0]),
        ("over budget / OOM", "X", FAILED_COLOR),
    ]:
        part = history[kinds == kind]
        if not part.empty:
            ax.scatter(
                part["number"],
                part["value"],
                marker=marker,
                color=color,
                s=45,
                label=f"{kind} trial",
                zorder=3,
            )
    best = history.dropna(subset=["best_so_far"])
    ax.step(
        best["number"],
        best["best_so_far"],
        where="post",
        color="black",
        linewidth=1.5,
        label="best feasible so far",
    )
    ax.set_xlabel("trial number")
    ax.set_ylabel(_metric_label(metric))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.4g}"))
    ax.set_title(f"{title}\n{canvas.subject}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    caption = (
        "Infeasible trials (measured or predicted over the memory budget) are told to optuna "
        "with value 0 and do not count for the best. Failed trials are not drawn."
    )
    return Figure(name, title, caption, save_figure(fig, canvas, name))


def param_importance(importances: dict[str, float], canvas: Canvas, metric: str) -> Figure:
    """optuna's parameter importances for the searched metric, as horizontal bars."""
    name, title = "param_importance", f"search: parameter importance for {metric}"
    if not importances:
        return not_drawn(name, title, "optuna could not compute importances (too few trials)")
    data = pd.DataFrame({"parameter": list(importances), "importance": list(importances.values())})
    fig, ax = plt.subplots(figsize=(7.5, 1.4 + 0.45 * len(data)))
    sns.barplot(data=data, y="parameter", x="importance", ax=ax, color=sns.color_palette()[0])
    ax.set_xlabel("importance (fraction of variance explained, sums to 1)")
    ax.set_ylabel("searched axis")
    ax.set_title(f"{title}\n{canvas.subject}")
    caption = "optuna's default importance evaluator over the feasible completed trials."
    return Figure(name, title, caption, save_figure(fig, canvas, name))


def _metric_label(metric: str) -> str:
    return {
        "tokens_per_s": "tokens/s (all ranks)",
        "mfu": "MFU (fraction of peak FLOPS)",
        "step_time_s": "step time (s)",
        "peak_memory_gib": "peak memory per rank (GiB)",
    }.get(metric, metric)
