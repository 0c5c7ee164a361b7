"""Which runs of a results frame cannot be told apart from the best: the rule of
`fsdp_bench.stats.indistinguishable` on each ok run's tokens/s, its 95% interval, its
step-time spread and (with `measure.rounds` > 1) its passes, their noise pooled over the
frame's runs."""

from __future__ import annotations

from typing import Any

import pandas as pd

from fsdp_bench.stats import (
    MIN_PASS_DF,
    Estimate,
    PassNoise,
    indistinguishable,
    pass_noise,
    pass_values,
    tie_marks,
)

MARKS_COLUMN = "tie"


def _number(row: pd.Series, column: str) -> float | None:
    value: Any = row.get(column)
    return None if value is None or pd.isna(value) else float(value)


def estimate(row: pd.Series) -> Estimate | None:
    """A run's tokens/s as an Estimate; None when it did not finish ok with a throughput."""
    value = _number(row, "tokens_per_s")
    if row.get("status") != "ok" or value is None:
        return None
    return Estimate(
        value=value,
        low=_number(row, "tokens_per_s_ci_low"),
        high=_number(row, "tokens_per_s_ci_high"),
        spread_pct=_number(row, "step_time_spread_pct"),
        pass_values=pass_values(value, _number(row, "step_time_s"), _passes(row)),
        contended=row.get("contended") is True,
    )


def _passes(row: pd.Series) -> list[float] | None:
    value: Any = row.get("round_step_time_s")
    return [float(v) for v in value] if isinstance(value, (list, tuple)) else None


def noise(df: pd.DataFrame) -> PassNoise | None:
    """The between-pass noise pooled over the frame's ok runs (None: too few passes)."""
    return pass_noise([estimate(row) for _, row in df.iterrows()])


def marks(df: pd.DataFrame) -> pd.Series:
    """ "best", "tied" or "" for each row of `df` (same index), among its ok runs."""
    found = [estimate(row) for _, row in df.iterrows()]
    return pd.Series(tie_marks(found), index=df.index, dtype=object)


def _why_no_noise(df: pd.DataFrame) -> str:
    """The true reason no between-pass noise could be pooled."""
    passed = [e for _, row in df.iterrows() if (e := estimate(row)) and len(e.pass_values) >= 2]
    if not passed:
        return "no run finished ok with 2 passes or more (measure.rounds)"
    quiet = [e for e in passed if not e.contended]
    if not quiet:
        return (
            f"all {len(passed)} runs with 2 passes or more were contended, and a contended "
            "run's passes say how busy the machine was (rerun them with --rerun-contended)"
        )
    return (
        f"{len(quiet)} uncontended runs with 2 passes or more give fewer than {MIN_PASS_DF} "
        "degrees of freedom"
    )


def noise_text(df: pd.DataFrame) -> str:
    """One line on the between-pass noise the ties allow for, or why there is none."""
    found = noise(df)
    if found is None:
        why = _why_no_noise(df)
        return f"not measured: {why}; ties allow only for the noise between one run's steps"
    contended = int(df["contended"].eq(True).sum()) if "contended" in df else 0
    left_out = f", {contended} contended runs left out" if contended else ""
    return (
        f"{found.pct:.1f}% per pass, standard deviation (pooled over {found.runs} runs, "
        f"{found.df} degrees of freedom{left_out}); runs a t-test on their passes cannot tell "
        "from the best are tied (at 5% over all comparisons with the best, Bonferroni)"
    )


def tied_with(df: pd.DataFrame, run_id: str) -> list[str]:
    """The ok runs of `df` other than `run_id` that cannot be told apart from it, fastest
    first."""
    rows = df.drop_duplicates("run_id").set_index("run_id", drop=False)
    ordered = rows.sort_values("tokens_per_s", ascending=False)
    found = {str(i): e for i, r in ordered.iterrows() if (e := estimate(r)) is not None}
    best = found.pop(str(run_id), None)
    if best is None:
        return []
    passes = pass_noise([best, *found.values()])
    return [
        other_id
        for other_id, other in found.items()
        if indistinguishable(best, other, passes, comparisons=len(found))
    ]


def interval(low: Any, high: Any) -> tuple[float, float] | None:
    """A (low, high) pair, or None when either end is missing."""
    if low is None or high is None or pd.isna(low) or pd.isna(high):
        return None
    return float(low), float(high)


def verdict(ranked: pd.DataFrame, records: pd.DataFrame) -> tuple[list[str], str | None]:
    """What a ranking (`tables.ranking`, fastest first) means, in lines under it, and the run
    whose launch line to give: the fastest FSDP2 configuration, what the user came for, with
    the DDP baseline named beside it when it is faster; and, when most runs cannot be told
    apart from the best, that there is no clear winner (None: no run finished ok)."""
    ok = ranked[ranked["status"] == "ok"] if "status" in ranked else ranked.iloc[0:0]
    if ok.empty:
        return [], None
    by_id = records.drop_duplicates("run_id").set_index("run_id")
    is_ddp = ok["run_id"].map(by_id["strategy"]).eq("ddp").to_numpy()
    speed = ok["run_id"].map(by_id["tokens_per_s"]).to_numpy()
    lines = []
    chosen = next((i for i, ddp in enumerate(is_ddp) if not ddp), 0)
    if is_ddp[0] and chosen:
        tied = "tie" in ok and ok["tie"].iloc[chosen] == "tied"
        how = "tied with it" if tied else f"{100 * (1 - speed[chosen] / speed[0]):.0f}% slower"
        lines.append(
            f"fastest: the DDP baseline (run {ok['run_id'].iloc[0]}); the fastest FSDP2 "
            f"configuration: run {ok['run_id'].iloc[chosen]}, {how}"
        )
    tied_count = int(ok["tie"].eq("tied").sum()) if "tie" in ok else 0
    if len(ok) >= 3 and tied_count + 1 > len(ok) / 2:
        lines.append(
            f"no clear winner: {tied_count + 1} of {len(ok)} runs cannot be told apart from "
            "the best; more passes (measure.rounds) would separate them"
        )
    return lines, str(ok["run_id"].iloc[chosen])
