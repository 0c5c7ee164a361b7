"""`fsdp-bench report`: a results folder (and optionally a second one) -> report folder:
`report.html` (one self-contained file) and `summary.md` (to paste into a design doc) beside
the PNGs. Works on a sweep still running: it reports what is recorded now.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import yaml

from fsdp_bench import study_storage
from fsdp_bench.errors import FsdpBenchError, ResultsError
from fsdp_bench.report import compare as comparing
from fsdp_bench.report import estimates, figure_data, memory_figures, summaries, ties
from fsdp_bench.report import figures as figs
from fsdp_bench.report import html as html_report
from fsdp_bench.report import search_figures as study_figures
from fsdp_bench.report import study as study_data
from fsdp_bench.report import tables as report_tables
from fsdp_bench.report.canvas import Canvas, Figure
from fsdp_bench.report.configs import (
    one_per_configuration,
)
from fsdp_bench.report.failures import failure_reasons
from fsdp_bench.report.headline import headline_text, launch_table
from fsdp_bench.report.markdown import markdown_summary
from fsdp_bench.store import load_results, write_atomic

if TYPE_CHECKING:
    import optuna


@dataclass(frozen=True)
class GridInfo:
    """What a results folder's grid.yaml says that the report uses."""

    name: str
    budget_gib: float | None
    text: str
    path: Path | None
    metric: str = "tokens_per_s"
    """What a search optimised (search.metric)."""
    margin_gib: float = 0.0
    """Kept free below the budget (memory.margin_gib): a measured run fits when peak + margin
    <= budget (what `search` calls feasible)."""


@dataclass
class ReportOutcome:
    out: Path
    paths: list[Path]
    """Everything written: report.html, summary.md, then the figure files."""
    headline: str
    best: pd.DataFrame
    figures: list[Figure] = field(default_factory=list)
    comparison: str = ""
    """With --compare: what the comparison found (`compare.comparison_summary`)."""


def read_grid(results_dir: Path) -> GridInfo:
    """Name and memory budget from the grid saved with the results; the folder name and no
    budget when there is none. A grid this version cannot validate is still read as YAML."""
    path = results_dir / "grid.yaml"
    if not path.exists():
        return GridInfo(results_dir.name, None, "", None)
    text = path.read_text()
    try:
        from fsdp_bench.config.grid import load_grid

        spec = load_grid(path)
        memory_config = spec.memory
        return GridInfo(spec.name, memory_config.budget_gib, text, path, spec.search.metric,
                        memory_config.margin_gib)  # fmt: skip
    except FsdpBenchError:
        data: Any = yaml.safe_load(text) or {}
        memory = data.get("memory") or {} if isinstance(data, dict) else {}
        budget = memory.get("budget_gib") if isinstance(memory, dict) else None
        margin = memory.get("margin_gib") if isinstance(memory, dict) else None
        name = data.get("name", results_dir.name) if isinstance(data, dict) else results_dir.name
        return GridInfo(str(name), float(budget) if budget else None, text, path,
                        margin_gib=float(margin or 0.0))  # fmt: skip


def load(results_dir: Path) -> pd.DataFrame:
    """The runs of a folder, or a one-line error a user can act on."""
    if not results_dir.is_dir():
        raise ResultsError(f"{results_dir}: no such results folder")
    df = load_results(results_dir)
    if df.empty:
        raise ResultsError(
            f"{results_dir}: no runs recorded yet (runs/ is empty); "
            "run `fsdp-bench sweep` or `fsdp-bench search` first, or wait for the first run"
        )
    kept = one_per_configuration(df)
    kept.attrs["measured_again"] = len(df) - len(kept)
    return kept


@dataclass(frozen=True)
class Inputs:
    """What a report is built from: the runs, their grid, a search's study and the budget."""

    results_dir: Path
    df: pd.DataFrame
    grid: GridInfo
    budget_gib: float | None
    """--budget-gib, else the search's, else the grid's."""
    study: optuna.Study | None = None
    compare: Path | None = None
    other: pd.DataFrame | None = None
    """The runs of the folder compared with, if any."""

    @property
    def limit_gib(self) -> float | None:
        """The most a run may peak at to fit: the budget less the grid's margin."""
        return None if self.budget_gib is None else self.budget_gib - self.grid.margin_gib

    @property
    def names(self) -> tuple[str, str]:
        """The two folders as the comparison names them (full paths when the names clash)."""
        names = (self.results_dir.name, self.compare.name if self.compare is not None else "")
        return (str(self.results_dir), str(self.compare)) if names[0] == names[1] else names


def load_inputs(
    results_dir: Path, compare: Path | None, budget_gib: float | None, storage: str | None
) -> Inputs:
    """The runs (and those compared with), the grid and, for a search, its study, whose
    budget and metric (overrides included) replace the grid's."""
    df = load(results_dir)
    other = load(compare) if compare is not None else None
    grid = read_grid(results_dir)
    study = study_storage.load_study(results_dir, grid.name, storage)
    if study is not None:
        grid = dataclasses.replace(
            grid,
            budget_gib=study.user_attrs.get("budget_gib", grid.budget_gib),
            metric=study.user_attrs.get("metric", grid.metric),
        )
    budget = budget_gib if budget_gib is not None else grid.budget_gib
    return Inputs(results_dir, df, grid, budget, study, compare, other)


def build_report(
    results_dir: Path,
    *,
    out: Path | None = None,
    compare: Path | None = None,
    svg: bool = False,
    budget_gib: float | None = None,
    storage: str | None = None,
) -> ReportOutcome:
    """Write the report folder and say what was written: by default `<results>/report`, and
    with `compare` `<results>/report-vs-<other folder's name>`, so the folder's own report
    stays as it was."""
    inputs = load_inputs(results_dir, compare, budget_gib, storage)
    df = inputs.df
    default = "report" if compare is None else f"report-vs-{compare.resolve().name}"
    out = out or results_dir / default
    _clear_figures(out)
    canvas = Canvas(out=out, subject=summaries.subject(df), svg=svg)
    best = summaries.best_per_world_size(df, inputs.limit_gib)
    effects = summaries.axis_effects(df)
    scaling = summaries.scaling_efficiency(df)
    sections, drawn = _measured_sections(inputs, canvas, best, effects, scaling)
    if inputs.study is not None:
        section, figures = _search_section(inputs.study, canvas, inputs.grid.metric)
        sections.append(section)
        drawn += figures
    comparison = ""
    if inputs.other is not None:
        section, comparison = _comparison_section(inputs, canvas)
        sections.append(section)
        drawn += section.figures
    sections.append(
        html_report.Section(
            "All runs",
            "Fastest first; failures last with the first line of their reason.",
            [("", report_tables.runs_table(df))],
        )
    )
    doc = html_report.Document(
        title=f"fsdp-bench report: {inputs.grid.name}",
        subtitle=canvas.subject,
        headline=headline_text(df, best, inputs.limit_gib),
        sections=sections,
        provenance=provenance_table(inputs),
        grid_text=inputs.grid.text,
    )
    out.mkdir(parents=True, exist_ok=True)
    html_path, md_path = out / "report.html", out / "summary.md"
    write_atomic(html_path, html_report.render(doc))
    write_atomic(md_path, markdown_summary(doc, best, effects, scaling, drawn))
    files = [p for f in drawn for p in f.paths]
    return ReportOutcome(out, [html_path, md_path, *files], doc.headline, best, drawn, comparison)


def _measured_sections(
    inputs: Inputs,
    canvas: Canvas,
    best: pd.DataFrame,
    effects: pd.DataFrame,
    scaling: pd.DataFrame,
) -> tuple[list[html_report.Section], list[Figure]]:
    """What every results folder gets, in report order, and the figures drawn for it."""
    df, budget = inputs.df, inputs.budget_gib
    drawn = [
        figs.throughput_by_grouping(df, canvas),
        memory_figures.memory_vs_throughput(df, canvas, budget),
        memory_figures.memory_breakdown(df, canvas, budget),
        memory_figures.memory_timeline(df, canvas),
        figs.collectives(df, canvas),
    ]
    if not figure_data.tensor_parallel_points(df).empty:
        drawn.append(figs.tensor_parallel(df, canvas))
    step_figure = figs.step_breakdown(df, canvas)
    scaling_figure = figs.scaling(df, canvas)
    accuracy = estimates.estimate_accuracy(df)
    sections = [
        *_best_and_status_sections(inputs, best),
        html_report.Section("Throughput and memory", "", figures=list(drawn)),
        html_report.Section(
            "Where a step's time goes",
            STEP_TEXT,
            [("", report_tables.step_table(figure_data.step_phases(df)))],
            [step_figure],
            in_summary=True,
        ),
        html_report.Section(
            "Memory: estimated before launch against measured",
            ESTIMATE_TEXT,
            [(report_tables.coverage_line(accuracy), report_tables.estimate_table(accuracy))],
            in_summary=True,
        ),
        html_report.Section(
            "Effect of each axis",
            "tokens/s and peak memory relative to the axis's most common value, in runs equal "
            "in every other setting (world size included): the median ratio over matched "
            "pairs. Above 1× means faster or more memory. The tokens/s interval spans "
            "every pair's (from both runs' 95% intervals); an effect differs from 1× only "
            "when that whole interval lies on one side of 1.",
            [("", report_tables.effects_table(effects))],
        ),
        *_dimension_sections(df),
        html_report.Section(
            "Scaling",
            scaling_figure.skipped and f"No scaling table: {scaling_figure.skipped}.",
            [("", report_tables.scaling_table(scaling))] if not scaling.empty else [],
            [scaling_figure],
        ),
    ]
    return sections, [*drawn, step_figure, scaling_figure]


def _dimension_sections(df: pd.DataFrame) -> list[html_report.Section]:
    """Collectives per mesh dimension, where some run's mesh has more than one."""
    counts = figure_data.collectives_by_dimension(df)
    if counts.empty:
        return []
    text = "Calls and MiB per optimizer step on each dimension of the mesh (rank 0's count): "
    text += "FSDP2's all-gathers and reduce-scatters on shard, HSDP's all-reduces on replicate, "
    text += "tensor parallelism's collectives on tp."
    return [html_report.Section("Collectives per mesh dimension", text,
                                [("", report_tables.dimension_table(counts))])]  # fmt: skip


def _best_and_status_sections(inputs: Inputs, best: pd.DataFrame) -> list[html_report.Section]:
    """The best run per world size (with how to run each again) and the runs by status (with
    why those that did not finish ok stopped)."""
    df = inputs.df
    status = report_tables.status_table(summaries.status_counts(df))
    failures = failure_reasons(df).drop(columns="run_ids")
    again = launch_table(df, inputs.results_dir, inputs.limit_gib, best)
    return [
        html_report.Section(
            "Best configuration per world size",
            _budget_text(inputs.budget_gib, inputs.grid.margin_gib),
            [("", report_tables.best_table(best)), ("To run one again", again)],
        ),
        html_report.Section(
            "Runs by status",
            "",
            [("", status)] + ([("Why runs did not finish ok", failures)] if len(failures) else []),
            in_summary=True,
        ),
    ]


ESTIMATE_TEXT = (
    "Per rank, GiB, the largest rank. tensors: the simulation against the tracked tensors; on "
    "CUDA, allocated (max_memory_allocated), reserved (max_memory_reserved: the caching "
    "allocator's segments) and device-used (what the card held: reserved plus the CUDA "
    "context and NCCL's buffers), each estimated before launch with its interval "
    "(memory/error_model.py): inside says whether the measurement fell in it. fits: yes when "
    "the device-used interval's high end was within the budget, no when its low end was over, "
    "maybe between; correction: the factor the folder's measured runs put on the estimate "
    "then (the estimates shown are the models' own). Error in % of the measurement."
)

STEP_TEXT = (
    "One profiled step per configuration (rank 0, untimed, under torch.profiler): forward, "
    "backward and optimizer time, the time a collective was in flight (communication) and "
    "the part of it no compute ran beside (exposed); hidden = 1 - exposed / communication. "
    "On CPU + gloo almost nothing overlaps; on GPUs this is what grouping and prefetch hide."
)


def _budget_text(budget: float | None, margin: float) -> str:
    if budget is None:
        return (
            "Fastest run per world size that finished ok. No memory budget: the results "
            "folder's grid.yaml sets no memory.budget_gib; pass --budget-gib to apply one."
        )
    return (
        f"Fastest run per world size that finished ok within the {budget:g} GiB per rank "
        "budget (the grid's memory.budget_gib, or --budget-gib)"
        + (f" less its {margin:g} GiB margin." if margin else ".")
    )


def _search_section(
    study: optuna.Study, canvas: Canvas, metric: str
) -> tuple[html_report.Section, list[Figure]]:
    trials = study_data.trial_table(study)
    progress = study_figures.search_progress(trials, canvas, metric, study_data.maximizes(study))
    found, why = study_data.importances(study)
    importance = study_figures.param_importance(found, canvas, metric)
    if why:
        importance.skipped = why
    counts = trials["state"].value_counts()
    text = (
        f"optuna study '{study.study_name}': {len(trials)} trials ("
        + ", ".join(f"{n} {str(state).lower()}" for state, n in counts.items())
        + f"); {int(trials['feasible'][trials['state'].eq('COMPLETE')].sum())} feasible."
    )
    figures = [progress, importance]
    return html_report.Section("Search", text, figures=figures), figures


def _comparison_section(inputs: Inputs, canvas: Canvas) -> tuple[html_report.Section, str]:
    """The same configurations in both folders: ratios B / A as a table and a figure, and
    what they found in a paragraph."""
    assert inputs.other is not None
    names = inputs.names
    table = comparing.compare_results(inputs.df, inputs.other)
    subject = f"{canvas.subject} | {summaries.subject(inputs.other)}"
    figure = figs.comparison(table, Canvas(canvas.out, subject, canvas.svg), names)
    summary = comparing.comparison_summary(table, names)
    section = html_report.Section(
        f"Comparison: {names[0]} vs {names[1]}",
        summary + " A tokens/s ratio's interval runs from the low end of B's 95% interval over the "
        "high end of A's to the high end of B's over the low end of A's; a configuration in "
        "one folder only has an empty other side.",
        [("", report_tables.compare_table(table, names))],
        [figure],
        in_summary=True,
    )
    return section, summary


def provenance_table(inputs: Inputs) -> dict[str, str]:
    """Where the runs came from and when the report was written, both folders when compared."""
    grid, budget = inputs.grid, inputs.budget_gib
    table = {
        "results folder": str(inputs.results_dir.resolve()),
        "grid file": str(grid.path.resolve()) if grid.path else "- (no grid.yaml)",
        "memory budget": f"{budget:g} GiB per rank" if budget is not None else "none",
        **summaries.provenance(inputs.df),
        "between-pass noise": ties.noise_text(inputs.df),
        "report written": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if inputs.other is not None and inputs.compare is not None:
        table["compared with"] = str(inputs.compare.resolve())
        other = summaries.provenance(inputs.other)
        table.update({f"{k} ({inputs.names[1]})": v for k, v in other.items()})
    return table


def _clear_figures(out: Path) -> None:
    """Remove figures an earlier report wrote here (and only those), so none goes stale."""
    names = [*figs.FIGURES, "search_progress", "param_importance", "comparison"]
    for name in names:
        for suffix in (".png", ".svg"):
            (out / f"{name}{suffix}").unlink(missing_ok=True)
