"""What every figure shares: the `Figure` it returns, the `Canvas` it is written to, and the
helpers that save it or say why it was not drawn.

A figure the data cannot support (one world size, no search study) is a `Figure` with no files
and the reason, which the report shows instead of the picture. matplotlib runs headless (Agg).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import matplotlib.ticker
import pandas as pd
import seaborn as sns

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis
    from matplotlib.figure import Figure as MplFigure

log = logging.getLogger(__name__)

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


def draw_budget(ax: Axes, budget_gib: float) -> None:
    """The memory budget per rank as a vertical dashed line on a GiB axis."""
    ax.axvline(budget_gib, color=FAILED_COLOR, linestyle="--", linewidth=1.2,
               label=f"budget {budget_gib:g} GiB")  # fmt: skip


def thousands(axis: Axis) -> None:
    """Tick labels with thousands separators: tokens/s run to six digits."""
    axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))


def save_figure(fig: MplFigure, canvas: Canvas, name: str) -> list[Path]:
    """Write PNG (and SVG on request) and close the figure, so a long report frees memory."""
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


def stack_bars(ax: Axes, parts: pd.DataFrame, positions: list[int], height: float) -> pd.Series:
    """One stacked horizontal bar per row of `parts` at `positions`, a colour and a legend
    entry per column (underscores as spaces); returns where each bar ends."""
    left = pd.Series(0.0, index=parts.index)
    colors = sns.color_palette("muted", len(parts.columns))
    for column, color in zip(parts.columns, colors, strict=True):
        label = str(column).replace("_", " ")
        ax.barh(positions, parts[column], left=left, color=color, height=height, label=label)
        left += parts[column]
    return left
