"""One run's predicted memory per rank as the budget is judged on it: the estimate's figures,
corrected by what the folder measured (`calibration`), each with its interval (`error_model`),
and whether it fits: yes when the interval's high end is within the budget, no when its low
end is over, maybe between. Pruning launches nothing that is `no` and everything else."""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Literal

from fsdp_bench.config.grid_settings import MemoryConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.memory.calibration import Calibration, Correction
from fsdp_bench.memory.compiled import compiled_as
from fsdp_bench.memory.device_memory import communicators
from fsdp_bench.memory.error_model import (
    TENSORS,
    ErrorModel,
    Interval,
    Term,
    error_model,
    scatter_term,
)
from fsdp_bench.store import EstimatedPeaks

Fits = Literal["yes", "no", "maybe", "?"]


@dataclass(frozen=True)
class Prediction:
    """One rank's predicted memory (GiB): the figures, their intervals, the terms that make
    device-used and where each came from."""

    tensors_gib: float | None
    allocated_gib: float | None = None
    reserved_gib: float | None = None
    device_used_gib: float | None = None
    errors: ErrorModel | None = None
    terms_gib: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    correction: Correction = field(default_factory=Correction)

    @property
    def figures(self) -> dict[str, float | None]:
        """The three figures and their intervals, under the records' names."""
        out: dict[str, float | None] = {}
        for name in ("allocated", "reserved", "device_used"):
            figure = getattr(self, f"{name}_gib")
            interval: Interval | None = getattr(self.errors, name) if self.errors else None
            interval = interval if figure is not None else None
            out[f"estimated_{name}_gib"] = figure
            out[f"estimated_{name}_low_gib"] = interval.low_gib if interval else None
            out[f"estimated_{name}_high_gib"] = interval.high_gib if interval else None
        return out

    @property
    def error_terms(self) -> list[Term]:
        return self.errors.terms if self.errors else []

    @property
    def unseen(self) -> list[str]:
        return self.errors.unseen if self.errors else []


def predict(
    run: RunConfig,
    tensors_gib: float | None,
    allocated_gib: float | None,
    reserved_gib: float | None,
    outside_default_gib: dict[str, float],
    known: Calibration,
    *,
    records_streams: bool = False,
    eager_loss_gib: tuple[float, float] | None = None,
) -> Prediction:
    """The figures of an estimate's tensors and allocator replay (None on CPU, where
    device-used is the tensors plus a configured overhead), corrected by `known`.
    `eager_loss_gib`: the allocator's figures of the step with the loss eager, for a loss
    compiled on a GPU (`error_model.COMPILED_LOSS`)."""
    if tensors_gib is None:
        return Prediction(None)
    correction = known.correction(run)
    factor = correction.factor
    if reserved_gib is None or allocated_gib is None:  # no caching allocator to model
        return _tensors_only(tensors_gib, known, correction)
    reserved = reserved_gib * factor
    measured = known.outside(run.world_size)
    if measured is None:
        outside_gib, outside_range, outside_source = dict(outside_default_gib), None, "model"
    else:
        center, outside_range, outside_source = measured
        outside_gib = {"outside": center}
    errors = error_model(
        allocated_gib,
        reserved,
        outside_gib,
        communicators(run, known.gpu),
        gpu=known.gpu,
        compiled=compiled_as(run),
        records_streams=records_streams,
        outside_measured=outside_range,
        scatter=correction.scatter,
        eager_loss_gib=None
        if eager_loss_gib is None
        else (eager_loss_gib[0], eager_loss_gib[1] * factor),
    )
    return Prediction(
        tensors_gib,
        allocated_gib,
        reserved,
        reserved + sum(outside_gib.values()),
        errors,
        {"tensors": tensors_gib, "allocator": reserved - tensors_gib, **outside_gib},
        {"reserved": f"allocator replay, correction {correction.describe}",
         "outside": outside_source},
        correction,
    )  # fmt: skip


def _tensors_only(tensors_gib: float, known: Calibration, correction: Correction) -> Prediction:
    """On CPU: device-used is the tensors plus a configured overhead (`memory.overhead_gib`)."""
    tensors = tensors_gib * correction.factor
    extra = known.configured_outside_gib or 0.0
    term = Term("tensors", tensors * TENSORS.below, tensors * TENSORS.above, TENSORS.source)
    spread = scatter_term(tensors, correction.scatter)
    below = math.hypot(term.below_gib, spread.below_gib)
    above = math.hypot(term.above_gib, spread.above_gib)
    band = Interval(max(tensors - below, 0.0) + extra, tensors + above + extra)
    errors = ErrorModel(band, band, band, [term, *([spread] if correction.scatter else [])])
    terms = {"tensors": tensors, **({"outside": extra} if extra else {})}
    sources = {"outside": "configured (memory.overhead_gib)"} if extra else {}
    return Prediction(tensors_gib, None, None, tensors + extra, errors, terms, sources, correction)


def fits(prediction: Prediction, memory: MemoryConfig) -> Fits:
    """yes: the device-used interval's high end is within the budget less the margin; no:
    its low end is over; maybe: the budget is inside it. ?: no budget or no estimate."""
    used = prediction.device_used_gib
    if memory.budget_gib is None or used is None:
        return "?"
    limit = memory.budget_gib - memory.margin_gib
    interval = prediction.errors.device_used if prediction.errors else Interval(used, used)
    if interval.high_gib <= limit:
        return "yes"
    return "no" if interval.low_gib > limit else "maybe"


def fit_probability(prediction: Prediction, memory: MemoryConfig) -> float:
    """How likely the run fits, reading the device-used interval as a 95% one of a normal
    error on each side (1.0 with no budget or no estimate)."""
    used = prediction.device_used_gib
    if memory.budget_gib is None or used is None or prediction.errors is None:
        return 1.0
    limit = memory.budget_gib - memory.margin_gib
    interval = prediction.errors.device_used
    side = (used - interval.low_gib) if limit < used else (interval.high_gib - used)
    if side <= 0:
        return 1.0 if used <= limit else 0.0
    return statistics.NormalDist().cdf((limit - used) / (side / 1.96))


MIN_FIT_PROBABILITY = 0.1
"""A `maybe` point less likely than this to fit is told infeasible without a launch. On the
search-efficiency benchmark's tables (benchmarks/results/2026-12-05-search-efficiency.txt)
0.1 cut the launches that did not fit from 8.9% to 6.7% and 7.9% to 3.9% with exact
estimates, the true best launched as often; 0.25 cut more and missed it more often when
single estimates stray by 10%."""


def search_prune_reason(prediction: Prediction, memory: MemoryConfig) -> str:
    """Why a search does not launch a point: it fits `no`, or `maybe` with a chance under
    MIN_FIT_PROBABILITY; '' when it is launched. (A sweep launches every `maybe`.)"""
    reason = predicted_oom(prediction, memory)
    chance = fit_probability(prediction, memory)
    if not reason and chance < MIN_FIT_PROBABILITY:
        reason = f"predicted_oom: fits with probability {chance:.2f}"
    return reason


def predicted_oom(prediction: Prediction, memory: MemoryConfig) -> str:
    """Why the run cannot fit the budget, naming the terms, or '' unless it fits `no`."""
    if fits(prediction, memory) != "no":
        return ""
    assert prediction.errors is not None and prediction.device_used_gib is not None
    interval = prediction.errors.device_used
    parts = " + ".join(f"{name} {value:.2f}" for name, value in prediction.terms_gib.items())
    sources = "; ".join(f"{k}: {v}" for k, v in prediction.sources.items())
    return (
        f"predicted_oom: device-used {prediction.device_used_gib:.2f} GiB, at least "
        f"{interval.low_gib:.2f} ({parts}; {sources}) + margin {memory.margin_gib:.2f} > "
        f"budget {memory.budget_gib:.2f} GiB per rank"
    )


def record_peaks(
    raw: Prediction,
    decided: Prediction,
    memory: MemoryConfig,
    estimated_peak_gib: float | None,
    analytic_peak_gib: float | None,
) -> EstimatedPeaks:
    """What a run's record keeps of its estimate: the raw figures with their intervals (so a
    correction read back from records is made from the models' own figures), and what was
    decided with the folder's correction."""
    correction = decided.correction
    return EstimatedPeaks(
        estimated_peak_gib=estimated_peak_gib,
        analytic_peak_gib=analytic_peak_gib,
        estimate_fits=fits(decided, memory),
        estimate_correction=dataclasses.asdict(correction) if correction.run_ids else None,
        **raw.figures,
    )
