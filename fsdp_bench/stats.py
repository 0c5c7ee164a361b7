"""How precisely a run's step time is known: a 95% confidence interval of its median.

The interval is the distribution-free order-statistic interval for a median (the binomial, or
sign-test, interval): with the n step times sorted, x(1) <= ... <= x(n), it is
[x(k), x(n+1-k)] for the largest k with P(B <= k-1) <= 2.5%, B ~ Binomial(n, 1/2). For
independent draws from any continuous distribution it covers the true median with
probability 1 - 2 P(B <= k-1) >= 95% (96.5% at n = 15), exactly, not asymptotically; with
fewer than 6 draws even [x(1), x(n)] covers less than 95%, and there is no interval (None).
Consecutive steps of a drifting machine are not independent: the interval is about the noise
between steps of one run, not about a run measured at another time.

Pure Python (no torch, no numpy), for the worker and for reports alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

CONFIDENCE = 0.95
MIN_SAMPLES = 6
"""The fewest draws with a 95% interval for the median (1 - 2 / 2^6 = 96.9%)."""


def median_interval_ranks(n: int, confidence: float = CONFIDENCE) -> tuple[int, int] | None:
    """1-based ranks (k, n+1-k) of the order statistics that bound the median's interval;
    None when n draws are too few for `confidence`. Exact integer arithmetic, any n."""
    allowed = (1 - Fraction(confidence).limit_denominator(10**9)) / 2 * 2**n
    below = 0  # sum of C(n, j) for j < k: 2^n P(B <= k-1)
    term = 1  # C(n, k)
    k = 0
    while k < (n + 1) // 2 and below + term <= allowed:
        below += term
        term = term * (n - k) // (k + 1)
        k += 1
    return (k, n + 1 - k) if k else None


def median_interval(
    samples: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float, float] | None:
    """The order-statistic confidence interval (low, high) of the median of `samples`, or
    None when there are too few of them (fewer than 6 at 95%)."""
    ranks = median_interval_ranks(len(samples), confidence)
    if ranks is None:
        return None
    ordered = sorted(samples)
    return ordered[ranks[0] - 1], ordered[ranks[1] - 1]


@dataclass(frozen=True)
class TimeSummary:
    """Seconds per step over every timed step (each the slowest rank's): median, extremes and
    the 95% interval of the median (None with fewer than 6 steps)."""

    median_s: float
    min_s: float
    max_s: float
    ci_low_s: float | None = None
    ci_high_s: float | None = None

    @property
    def spread_pct(self) -> float:
        """(max - min) / median, in percent: the range of single steps."""
        return 100.0 * (self.max_s - self.min_s) / self.median_s if self.median_s else 0.0

    @property
    def ci_half_width_pct(self) -> float | None:
        """Half the interval's width relative to the median, in percent; None: no interval."""
        if self.ci_low_s is None or self.ci_high_s is None or not self.median_s:
            return None
        return 100.0 * (self.ci_high_s - self.ci_low_s) / 2 / self.median_s

    def within(self, target_ci_pct: float) -> bool:
        """The interval is known and its relative half-width is at most the target (%)."""
        half_width = self.ci_half_width_pct
        return half_width is not None and half_width <= target_ci_pct


def summarize_times(step_times_s: Sequence[float]) -> TimeSummary:
    interval = median_interval(step_times_s)
    low, high = interval if interval is not None else (None, None)
    return TimeSummary(
        median_s=statistics.median(step_times_s),
        min_s=min(step_times_s),
        max_s=max(step_times_s),
        ci_low_s=low,
        ci_high_s=high,
    )


def within_target(step_times_s: Sequence[float], target_ci_pct: float) -> bool:
    """Whether the median's interval is known and its relative half-width is at most the
    target (percent): what ends the repeats of a run with `measure.target_ci_pct`."""
    return bool(step_times_s) and summarize_times(step_times_s).within(target_ci_pct)


@dataclass(frozen=True)
class Estimate:
    """A run's throughput (higher is better) and what says how well it is known: the 95%
    interval (None: fewer than 6 timed steps) and the range of its single steps, percent."""

    value: float
    low: float | None = None
    high: float | None = None
    spread_pct: float | None = None


def indistinguishable(a: Estimate, b: Estimate) -> bool:
    """Whether two runs cannot be told apart (the rule behind every "tied with the best").

    With both intervals known: tied when they overlap. When either is missing (too few
    steps): tied when the values differ by less than the larger of the two step spreads,
    relative to the larger value; with either spread unknown too, tied (nothing bounds the
    noise). The reading is conservative on purpose: a winner is only claimed when clearly
    separated.
    """
    if None not in (a.low, a.high, b.low, b.high):
        assert a.low is not None and a.high is not None  # for mypy
        assert b.low is not None and b.high is not None
        return a.low <= b.high and b.low <= a.high
    reference = max(a.value, b.value)
    if a.spread_pct is None or b.spread_pct is None or reference <= 0:
        return True
    return 100.0 * abs(a.value - b.value) / reference < max(a.spread_pct, b.spread_pct)


def tie_marks(estimates: Sequence[Estimate | None]) -> list[str]:
    """For each estimate: "best" (the highest value, the first of equals), "tied" (cannot be
    told apart from the best by `indistinguishable`) or "" (clearly slower, or None: a run
    that does not compete, such as a failed one)."""
    competing = [(i, e) for i, e in enumerate(estimates) if e is not None]
    marks = [""] * len(estimates)
    if not competing:
        return marks
    first, best = max(competing, key=lambda pair: (pair[1].value, -pair[0]))
    for i, estimate in competing:
        if i == first:
            marks[i] = "best"
        elif indistinguishable(best, estimate):
            marks[i] = "tied"
    return marks
