"""Whether a run's passes (`measure.rounds`) agree well enough for the run to be a result.

A pass is the same configuration measured again in the same job, so its step time moves only
by the machine's noise. How much that is comes from the folder's own runs: the between-pass
noise pooled over every run measured in two passes or more and not contended
(`stats.pass_noise`). Two passes of one run disagree when their ratio is beyond what that
noise gives two single passes once in a thousand (a two-sided t-test at 0.1%, a strict level:
every run of a sweep is tested). Before the folder has enough runs to pool, a pass more than
twice as slow as another is taken as disagreeing (quiet quickstarts on 2 cores: at most 1.25x;
contended ones up to 1.7x).

Such a run says nothing reliable about its configuration: the driver measures it once more in
a later job, and if the passes disagree again the run is recorded `unstable`, with both
measurements in its reason, and is left out of every ranking, tie, effect, scaling figure
and comparison (they read `ok` runs only).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from fsdp_bench.stats import Estimate, PassNoise, pass_noise, t_quantile
from fsdp_bench.store import RunResult

ALPHA = 0.001
"""Two-sided level of the test of two passes of one run."""
UNPOOLED_RATIO = 2.0
"""The slowest pass over the fastest beyond which passes disagree before noise is pooled."""
REMEASURES = 1
"""Times a run whose passes disagree is measured again before it is recorded unstable."""


def folder_noise(results: Iterable[RunResult]) -> PassNoise | None:
    """The between-pass noise of the runs measured so far (ok, not contended)."""
    return pass_noise([_estimate(r) for r in results if r.status == "ok" and not r.contended])


def _estimate(result: RunResult) -> Estimate | None:
    passes = [s for s in result.round_step_time_s or [] if s > 0]
    if len(passes) < 2:
        return None
    return Estimate(1.0, pass_values=tuple(1 / s for s in passes))


def limit_ratio(noise: PassNoise | None) -> float:
    """The largest ratio of two passes' step times that noise explains."""
    if noise is None:
        return UNPOOLED_RATIO
    return math.exp(t_quantile(1 - ALPHA / 2, noise.df) * noise.sd_log * math.sqrt(2))


def disagreement(result: RunResult, noise: PassNoise | None) -> str:
    """Why `result`'s passes disagree beyond `noise`, or '' when they agree (or it is not an
    ok run of two passes or more)."""
    passes = result.round_step_time_s or []
    if result.status != "ok" or len(passes) < 2 or min(passes) <= 0:
        return ""
    ratio, limit = max(passes) / min(passes), limit_ratio(noise)
    if ratio <= limit:
        return ""
    said = ", ".join(f"{s:.4g}" for s in passes)
    basis = (
        f"the folder's between-pass noise ({noise.pct:.1f}% a pass, {noise.runs} runs) "
        f"explains at most {limit:.2f}x"
        if noise is not None
        else f"more than {UNPOOLED_RATIO:g}x before the folder's noise can be pooled"
    )
    return f"passes disagree: median step {said} s, {ratio:.1f}x apart ({basis})"
