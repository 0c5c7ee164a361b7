"""How precisely a run's step time is known: a 95% confidence interval of its median.

The interval is the distribution-free order-statistic interval for a median (the binomial, or
sign-test, interval): with the n step times sorted, x(1) <= ... <= x(n), it is
[x(k), x(n+1-k)] for the largest k with P(B <= k-1) <= 2.5%, B ~ Binomial(n, 1/2). For
independent draws from any continuous distribution it covers the true median with
probability 1 - 2 P(B <= k-1) >= 95% (96.5% at n = 15), exactly, not asymptotically; with
fewer than 6 draws even [x(1), x(n)] covers less than 95%, and there is no interval (None).
Consecutive steps of a drifting machine are not independent: the interval is about the noise
between steps of one run, not about a run measured at another time.

What moves a run between measurements (its setup, where its memory landed, a neighbour) is
measured only by measuring it again: with `measure.rounds` > 1, each pass is one such
measurement. `pass_noise` pools the passes of every run compared into one estimate of that
noise (the standard deviation of ln(pass throughput) around each run's mean, as a one-way
analysis of variance does), and `indistinguishable` also ties two runs whose difference a
t-test on those passes cannot tell from it.

Naming a best compares it with every other run, and the best is the run whose noise happened
to be most favourable (the winner's curse): each of those m comparisons is a two-sided test at
5%/m (Bonferroni), so the tie set holds the truly fastest run with probability >= 95%,
whatever m (subset selection, as in Gupta 1965, with a Bonferroni bound). One pairwise test
at 5% per run drops it more often: in 8% of synthetic sweeps of 30 runs (tests/test_ties.py),
against none.

Pure Python (no torch, no numpy), for the worker and for reports alike.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

CONFIDENCE = 0.95
MIN_SAMPLES = 6
"""The fewest draws with a 95% interval for the median (1 - 2 / 2^6 = 96.9%)."""
MIN_PASS_DF = 4
"""The fewest degrees of freedom (passes beyond the first, summed over runs) for a pooled
between-pass noise: below it the t quantile grows too fast to say anything."""


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
    interval (None: fewer than 6 timed steps), the range of its single steps, percent, and
    the throughput of each pass (`measure.rounds` > 1; empty with one pass)."""

    value: float
    low: float | None = None
    high: float | None = None
    spread_pct: float | None = None
    pass_values: tuple[float, ...] = ()
    contended: bool = False
    """Measured while something else competed for the machine: its passes say how busy the
    machine was, not how much a pass moves, so they stay out of the pooled noise."""


def pass_values(
    value: float, median_s: float | None, pass_median_s: Sequence[float] | None
) -> tuple[float, ...]:
    """Each pass's throughput from its median step time, scaled like `value` (the run's
    throughput at its pooled median step time `median_s`); empty with fewer than 2 passes."""
    if not pass_median_s or len(pass_median_s) < 2 or not median_s or median_s <= 0:
        return ()
    return tuple(value * median_s / s for s in pass_median_s if s > 0)


def t_quantile(p: float, df: int) -> float:
    """Student's t `p` quantile, by the Cornish-Fisher expansion around the normal quantile
    (four terms): against scipy, within 0.05% at p = 0.975 from 4 degrees of freedom, and
    within 0.6% up to p = 0.9999 from 6 (3% at 4), a little below the exact value."""
    z = statistics.NormalDist().inv_cdf(p)
    terms = (
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
    )
    return z + sum(term / df ** (i + 1) for i, term in enumerate(terms))


@dataclass(frozen=True)
class PassNoise:
    """How much one pass of a run moves its throughput: the pooled standard deviation of
    ln(pass throughput) around each run's mean, with its degrees of freedom."""

    sd_log: float
    df: int
    runs: int

    @property
    def pct(self) -> float:
        """The standard deviation as a percent of throughput (one pass)."""
        return 100.0 * math.expm1(self.sd_log)

    def bound_log(self, passes_a: int, passes_b: int, comparisons: int = 1) -> float:
        """The largest |ln(a / b)| a two-sided t-test on the passes of two runs (of `passes_a`
        and `passes_b` passes) at level 5% / `comparisons` cannot tell from no difference."""
        p = 1 - (1 - CONFIDENCE) / 2 / max(comparisons, 1)
        return t_quantile(p, self.df) * self.sd_log * math.sqrt(1 / passes_a + 1 / passes_b)


def pass_noise(estimates: Sequence[Estimate | None]) -> PassNoise | None:
    """The between-pass noise pooled over every estimate with 2 or more passes, contended
    ones left out; None with fewer than `MIN_PASS_DF` degrees of freedom (a sweep of one
    pass has none)."""
    squares, df, runs = 0.0, 0, 0
    for estimate in estimates:
        if estimate is None or len(estimate.pass_values) < 2 or estimate.contended:
            continue
        logs = [math.log(v) for v in estimate.pass_values]
        mean = statistics.fmean(logs)
        squares += sum((x - mean) ** 2 for x in logs)
        df += len(logs) - 1
        runs += 1
    return PassNoise(math.sqrt(squares / df), df, runs) if df >= MIN_PASS_DF else None


def indistinguishable(
    a: Estimate, b: Estimate, noise: PassNoise | None = None, comparisons: int = 1
) -> bool:
    """Whether two runs cannot be told apart (the rule behind every "tied with the best").

    Tied when the difference is within the between-pass noise (both runs measured in 2 or
    more passes, `noise` pooled over the runs compared: a t-test on ln throughput at 5% /
    `comparisons`, the number of runs the best is compared with).
    Otherwise, with both step intervals known: tied when they overlap. When either is
    missing (too few steps): tied when the values differ by less than the larger of the two
    step spreads, relative to the larger value; with either spread unknown too, tied
    (nothing bounds the noise). The reading is conservative on purpose: a winner is only
    claimed when clearly separated.
    """
    if noise is not None and a.pass_values and b.pass_values and min(a.value, b.value) > 0:
        bound = noise.bound_log(len(a.pass_values), len(b.pass_values), comparisons)
        if abs(math.log(a.value / b.value)) <= bound:
            return True
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
    told apart from the best by `indistinguishable`, with the passes' noise pooled over all
    of them and each test corrected for the number of runs compared with the best) or ""
    (clearly slower, or None: a run that does not compete, such as a failed one)."""
    competing = [(i, e) for i, e in enumerate(estimates) if e is not None]
    marks = [""] * len(estimates)
    if not competing:
        return marks
    noise = pass_noise(estimates)
    first, best = max(competing, key=lambda pair: (pair[1].value, -pair[0]))
    for i, estimate in competing:
        if i == first:
            marks[i] = "best"
        elif indistinguishable(best, estimate, noise, len(competing) - 1):
            marks[i] = "tied"
    return marks
