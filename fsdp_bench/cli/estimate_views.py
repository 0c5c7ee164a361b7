"""Terminal views of memory estimates: every run's figures with their intervals, and what a
search would do before it launches anything."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fsdp_bench.cli.views import text_table
from fsdp_bench.config.grid import (
    SweepSpec,
    axis_keys,
    expand,
    get_path,
    search_points,
    search_space,
)
from fsdp_bench.config.run import RunConfig
from fsdp_bench.errors import yaml_scalar
from fsdp_bench.memory.calibration import calibration
from fsdp_bench.memory.estimate import RunEstimate, estimate_runs, target_device
from fsdp_bench.memory.model_check import check_models
from fsdp_bench.memory.prediction import (
    Fits,
    Prediction,
    fits,
    predicted_oom,
    search_prune_reason,
)
from fsdp_bench.store import ResultStore
from fsdp_bench.sweep import results_dir_for


def describe_estimates(spec: SweepSpec, results: Path | None, as_json: bool) -> str:
    """Every run's predicted memory per rank: the tensors (analytic, simulated) and, for CUDA,
    allocated, reserved and device-used, each with its interval; whether it fits the budget
    (yes / no / maybe, on device-used's interval)."""
    runs = expand(spec).runs
    check_models(runs)
    estimates, predictions = _predictions(spec, runs, results)
    if as_json:
        shown = [_estimate_json(estimates[r.run_id], predictions[r.run_id], spec) for r in runs]
        return json.dumps(shown, indent=1)
    return _estimate_text(spec, runs, estimates, predictions)


def _estimate_text(
    spec: SweepSpec,
    runs: list[RunConfig],
    estimates: dict[str, RunEstimate],
    predictions: dict[str, Prediction],
) -> str:
    """The estimate table, how many runs fit, and what the figures are."""
    verdicts = {k: fits(p, spec.memory) for k, p in predictions.items()}
    keys = axis_keys(spec)
    rows = []
    for run in runs:
        e, p = estimates[run.run_id], predictions[run.run_id]
        top = sorted(e.breakdown_gib.items(), key=lambda kv: -kv[1])[:3]
        rows.append(
            [
                run.run_id,
                *(yaml_scalar(get_path(run, k)) for k in keys),
                "n/a" if run.model.is_user_model else _gib(e.analytic_peak_gib),
                _gib(e.estimated_peak_gib),
                *(_ranged(p, name) for name in ("allocated", "reserved", "device_used")),
                verdicts[run.run_id],
                ", ".join(f"{k} {v:.2f}" for k, v in top) or e.error[:60],
            ]
        )
    header = ["run_id", *(k.split(".")[-1] for k in keys), "analytic", "tensors", "allocated",
              "reserved", "device-used", "fits", "largest tensors (GiB)"]  # fmt: skip
    return (
        text_table(header, rows)
        + "\n"
        + _fit_counts(verdicts, spec)
        + _estimate_footer(spec, target_device(spec.launcher), runs, predictions)
    )


def _predictions(
    spec: SweepSpec, runs: list[RunConfig], results: Path | None
) -> tuple[dict[str, RunEstimate], dict[str, Prediction]]:
    """Each run's estimate and its prediction, calibrated on the folder's records."""
    store = ResultStore(results_dir_for(spec, results))
    device_type = target_device(spec.launcher)
    estimates = estimate_runs(runs, store.root / "estimates", device_type=device_type)
    known = calibration(spec.memory, store)
    return estimates, {run.run_id: estimates[run.run_id].predict(known, run) for run in runs}


def describe_search_plan(spec: SweepSpec, results: Path | None, prune: bool) -> str:
    """What `search` would do, launching nothing: its space, trials and sampler, every
    point's memory estimate, and how many points it would skip as predicted over budget."""
    from fsdp_bench.search.confirm import skip_reason  # optuna: only for a search

    settings, points = spec.search, search_points(spec)
    check_models(points.runs)
    estimates, predictions = _predictions(spec, points.runs, results)
    space = search_space(spec)
    sizes = [len(values) for values in space.values()]
    lines = [
        f"search {spec.name}: {settings.trials} trials over {len(points.runs)} distinct runs "
        f"(each key sampled from every value the grid gives it: {' x '.join(map(str, sizes))} "
        f"= {math.prod(sizes)} points, {points.excluded} excluded or not valid, "
        f"{points.collapsed} equal to another), "
        f"sampler {settings.sampler_name}, "
        f"seed {settings.seed if settings.seed is not None else 'none'}"
        f", {settings.parallel} in flight, maximizing {settings.metric} -> "
        f"{results_dir_for(spec, results)}",
        *(f"  {key}: {', '.join(yaml_scalar(v) for v in values)}" for key, values in space.items()),
        (
            f"then: the best {settings.confirm_top_k} measured again in "
            f"{settings.confirm_rounds} interleaved passes"
        )
        if not (why := skip_reason(settings))
        else f"then: no confirmation round ({why})",
        _estimate_text(spec, points.runs, estimates, predictions),
    ]
    if spec.memory.budget_gib is None:
        lines.append("no budget: every point is a candidate (memory.budget_gib or --budget-gib)")
    elif prune:
        over = sum(1 for p in predictions.values() if search_prune_reason(p, spec.memory))
        lines.append(
            f"the search skips the {over} points predicted over the budget without a run "
            f"(told infeasible; --no-prune launches them) and samples among the other "
            f"{len(points.runs) - over}"
        )
    else:
        lines.append("--no-prune: points predicted over the budget are launched too")
    return "\n".join(lines) + "\nnothing launched (a dry run)"


def _estimate_json(estimate: Any, prediction: Prediction, spec: SweepSpec) -> dict[str, Any]:
    return {
        **asdict(estimate),
        **prediction.figures,
        "fits": fits(prediction, spec.memory),
        "half_width_pct": {
            name: round(interval.half_width_pct(figure), 2)
            for name in ("allocated", "reserved", "device_used")
            if prediction.errors is not None
            and (figure := getattr(prediction, f"{name}_gib")) is not None
            and (interval := getattr(prediction.errors, name)) is not None
        },
        "terms_gib": prediction.terms_gib,
        "error_terms": [asdict(t) for t in prediction.error_terms],
        "unseen": prediction.unseen,
        "sources": prediction.sources,
        "correction": asdict(prediction.correction),
        "predicted_oom": predicted_oom(prediction, spec.memory),
    }


def _ranged(prediction: Prediction, name: str) -> str:
    """The figure and its interval: 71.204 (66.912-76.811)."""
    figure = getattr(prediction, f"{name}_gib")
    interval = getattr(prediction.errors, name) if prediction.errors else None
    if figure is None or interval is None:
        return _gib(figure)
    return f"{figure:.3f} ({interval.low_gib:.3f}-{interval.high_gib:.3f})"


def _fit_counts(verdicts: dict[str, Fits], spec: SweepSpec) -> str:
    if spec.memory.budget_gib is None:
        return ""
    counts = Counter(verdicts.values())
    return (
        f"{counts['yes']} of {len(verdicts)} runs fit, {counts['maybe']} may fit (launched and "
        f"measured), {counts['no']} do not (skipped)\n"
    )


def _estimate_footer(
    spec: SweepSpec, device_type: str, runs: list[RunConfig], predictions: dict[str, Prediction]
) -> str:
    """Units, what each figure is for this device, where the terms came from, what the
    intervals do not cover, the budget."""
    budget = spec.memory
    if device_type == "cuda":
        sources = sorted({f"{k}: {v}" for p in predictions.values() for k, v in p.sources.items()})
        unseen = sorted({u for p in predictions.values() for u in p.unseen})
        said = (
            "GiB per rank, for CUDA, each figure with its interval (memory/error_model.py). "
            "tensors: simulated; allocated / reserved: the caching allocator's peaks "
            "(max_memory_allocated / max_memory_reserved); device-used: reserved + CUDA "
            f"context + NCCL buffers ({'; '.join(sources)}). Not seen by the estimate: "
            f"{'; '.join(unseen)}. "
        )
    else:
        sources = sorted({p.sources.get("outside", "") for p in predictions.values()} - {""})
        said = (
            f"GiB per rank, for {device_type} (no caching allocator: device-used is the tensors"
            f"{' + ' + '; '.join(sources) if sources else ''}). "
        )
    if any(run.model.is_user_model for run in runs):
        said += "analytic: n/a for hf: and your own models (its formulas need a preset's shape). "
    return said + (
        f"Budget {budget.budget_gib:g} GiB on device-used, margin {budget.margin_gib:g} GiB: "
        "fits yes when the interval's high end is within it, no when its low end is over"
        if budget.budget_gib is not None
        else "No budget (memory.budget_gib)"
    )


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
