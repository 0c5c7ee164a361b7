"""Why runs did not finish ok, as the sweep prints it and the report lists it."""

from __future__ import annotations

import re

import pandas as pd


def failure_reasons(df: pd.DataFrame, width: int = 160) -> pd.DataFrame:
    """Why runs did not finish ok: one row per status and distinct reason (its first line, the
    rank and host that said it left out, so one failure on every rank is one row), with the
    number of runs and their ids; most runs first."""
    columns = ["status", "reason", "runs", "run_ids"]
    if df.empty or "status" not in df:
        return pd.DataFrame(columns=columns)
    failed = df[df["status"] != "ok"].drop_duplicates("run_id")
    reasons = failed["reason"] if "reason" in failed else pd.Series("", index=failed.index)
    short = [_short_reason(r, width) for r in reasons]
    groups = failed.assign(short=short).groupby(["status", "short"], sort=False)["run_id"]
    rows = [(status, reason, len(ids), ", ".join(ids)) for (status, reason), ids in groups]
    table = pd.DataFrame(rows, columns=columns)
    return table.sort_values("runs", ascending=False, kind="stable").reset_index(drop=True)


def _short_reason(reason: object, width: int) -> str:
    text = reason if isinstance(reason, str) and reason.strip() else "no reason recorded"
    first = re.sub(r"^rank \d+( \([^)]*\))?: ", "", text.strip().splitlines()[0])
    return first if len(first) <= width else first[: width - 3] + "..."
