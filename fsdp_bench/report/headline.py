"""The lines a report opens with (the best configuration per world size, the fastest FSDP2
one beside a DDP best, whether there is a clear winner) and how to run a best one again."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fsdp_bench.report import summaries
from fsdp_bench.report.configs import (
    SCALE_COLUMNS,
    config_columns,
    describe_config,
    named_apart,
    varying,
)


def headline_text(df: pd.DataFrame, best: pd.DataFrame, limit_gib: float | None = None) -> str:
    """One sentence per world size: the best configuration spelled out and its numbers, and
    the runs tied with it (`best_per_world_size`'s `tied`, among the runs within
    `limit_gib`); a DDP best followed by the fastest FSDP2 run, and "no clear winner" when
    most runs tie."""
    columns = varying(df, config_columns(df, SCALE_COLUMNS))
    good = df[summaries.fits(df, limit_gib)].drop_duplicates("run_id")
    by_id = df.drop_duplicates("run_id").set_index("run_id")
    lines = _machine_lines(by_id)
    contended = by_id.get("contended", pd.Series(dtype=object)).eq(True)
    for _, row in best.iterrows():
        size = int(row["world_size"])
        if not isinstance(row["run_id"], str):
            lines.append(f"World size {size}: no configuration fits ({row['note']}).")
            continue
        run = by_id.loc[str(row["run_id"])]
        assert isinstance(run, pd.Series)
        config = describe_config(run, columns) or "the only configuration"
        tied = row.get("tied")
        ids = tied.split(", ") if isinstance(tied, str) and tied else []
        also = f"; tied with the best: {named_apart(by_id, ids, run, columns)}" if ids else ""
        lines.append(
            f"Best at world size {size}: {config}: {row['tokens_per_s']:,.0f} tokens/s, "
            f"peak {row['peak_memory_gib']:.3f} GiB per rank (run {row['run_id']}{also})."
        )
        if run.get("strategy") == "ddp":
            lines += _fastest_fsdp2_line(good, run, ids, columns)
        competing = int(good["world_size"].eq(size).sum())
        if competing >= 3 and len(ids) + 1 > competing / 2:
            busy = int(contended.reindex(good[good["world_size"].eq(size)]["run_id"]).sum())
            cure = (
                f"{busy} of them were contended: measure them again on a quiet machine "
                "(--rerun-contended)"
                if busy
                else "more passes or timed steps (measure.rounds, measure.timed_steps) would "
                "separate them"
            )
            lines.append(
                f"No clear winner: {len(ids) + 1} of {competing} runs cannot be told apart "
                f"from the best; {cure}."
            )
    return "\n".join(lines)


def _machine_lines(by_id: pd.DataFrame) -> list[str]:
    """What the machine did, before any verdict: runs measured while something else competed
    (and what that makes of the sweep), runs whose passes disagreed."""
    lines = []
    ok = by_id[by_id["status"].eq("ok")]
    busy = int(ok["contended"].eq(True).sum()) if "contended" in ok else 0
    if busy:
        if busy == len(ok):
            verdict = "this sweep is a smoke test, not a ranking"
        else:
            verdict = "their figures say how busy the machine was, and rank low"
        lines.append(
            f"Contended: {busy} of {len(ok)} runs were measured while something else used the "
            f"machine; {verdict}. Measure them again on a quiet machine: fsdp-bench sweep "
            "GRID --rerun-contended."
        )
    unstable = int(by_id["status"].eq("unstable").sum())
    if unstable:
        lines.append(
            f"Unstable: {unstable} runs' passes disagreed twice beyond the machine's noise; they "
            "are left out of every comparison (see Runs by status)."
        )
    return lines


def launch_table(
    df: pd.DataFrame, root: Path, limit_gib: float | None, best: pd.DataFrame
) -> pd.DataFrame:
    """The command that prints each best run's torchrun line, sbatch script and fully_shard
    code (`fsdp-bench sweep --print-launch`), and the fastest FSDP2 run's where DDP is best."""
    good = df[summaries.fits(df, limit_gib)].drop_duplicates("run_id")
    by_id = good.set_index("run_id")
    rows = []
    for run_id in best["run_id"].dropna():
        chosen = [by_id.loc[run_id]]
        if chosen[0].get("strategy") == "ddp":
            fsdp = _fastest_fsdp2(good, chosen[0]["world_size"])
            chosen += [] if fsdp is None else [by_id.loc[fsdp["run_id"]]]
        for run in chosen:
            command = f"fsdp-bench sweep {root / 'grid.yaml'} --results {root} --print-launch "
            rows.append({"world size": int(run["world_size"]), "strategy": run["strategy"],
                         "run": run.name, "command": command + str(run.name)})  # fmt: skip
    return pd.DataFrame(rows, columns=["world size", "strategy", "run", "command"])


def _fastest_fsdp2(good: pd.DataFrame, world_size: int) -> pd.Series | None:
    """The fastest FSDP2 run of `good` (the runs within the budget) at `world_size`."""
    here = good[good["world_size"].eq(world_size) & good["strategy"].ne("ddp")]
    return None if here.empty else here.sort_values("tokens_per_s", ascending=False).iloc[0]


def _fastest_fsdp2_line(
    good: pd.DataFrame, ddp: pd.Series, tied: list[str], columns: list[str]
) -> list[str]:
    """When the DDP baseline is the best, the fastest FSDP2 run of its world size beside it:
    the configuration the user came for, never left unnamed."""
    best = _fastest_fsdp2(good, ddp["world_size"])
    if best is None:
        return []
    slower_pct = 100 * (1 - best["tokens_per_s"] / ddp["tokens_per_s"])
    how = "tied with DDP" if best["run_id"] in tied else f"{slower_pct:.0f}% slower"
    config = describe_config(best, [c for c in columns if c != "strategy"]) or "as above"
    return [
        f"Fastest FSDP2 configuration there: {config}: {best['tokens_per_s']:,.0f} tokens/s, "
        f"{how}, peak {best['peak_memory_gib']:.3f} GiB per rank (run {best['run_id']})."
    ]
