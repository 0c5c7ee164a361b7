"""A run whose passes disagree is not a result: measured again, then recorded `unstable` and
left out of everything that compares runs (`launch.stability`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_bench.config.run import RunConfig
from fsdp_bench.config.schema import to_plain
from fsdp_bench.launch.stability import disagreement, folder_noise, limit_ratio
from fsdp_bench.report import failures, summaries, tables
from fsdp_bench.report.compare import compare_results
from fsdp_bench.store import RunResult
from tests.conftest import started_counts, sweep, tiny_grid


def passes(run_id: str, seconds: list[float], contended: bool = False) -> RunResult:
    return RunResult(run_id=run_id, status="ok", config=to_plain(RunConfig()),
                     round_step_time_s=seconds, contended=contended)  # fmt: skip


def test_the_limit_comes_from_the_folders_between_pass_noise() -> None:
    """Noise pooled over quiet runs with passes 2% apart: a 1.3x pair is beyond it; before
    any noise can be pooled, only a pass more than twice as slow."""
    quiet = [passes(f"r{i}", [1.0, 1.02 if i % 2 else 0.98]) for i in range(8)]
    noise = folder_noise([*quiet, passes("busy", [1.0, 5.0], contended=True)])
    assert noise is not None and noise.runs == 8  # the contended run is left out
    assert 1.05 < limit_ratio(noise) < 1.3
    assert disagreement(passes("x", [0.10, 0.13]), noise).startswith("passes disagree")
    assert disagreement(passes("x", [0.10, 0.101]), noise) == ""
    assert disagreement(passes("x", [0.10, 0.13]), None) == ""
    assert "more than 2x" in disagreement(passes("x", [0.1, 0.25]), None)
    assert disagreement(passes("x", [0.1]), None) == ""


@pytest.mark.slow
def test_a_run_whose_passes_disagree_is_measured_again_then_recorded_unstable(
    tmp_path: Path,
) -> None:
    """One pass 20 times as slow as the other (fault.kind slow_pass, a sleep in each step of
    the first pass). The run is measured again in a job of its own and disagrees again: it is
    recorded `unstable` with both measurements; the first record is kept in replaced/. It is
    left out of the ranking's order and ties, the best run, the scaling table and the
    comparison, and the report lists it with why."""
    grid = tiny_grid(
        "unstable",
        {"fault.kind": ["none", "slow_pass"], "world_size": [1, 2]},
        measure={"warmup_steps": 1, "timed_steps": 3, "repeats": 1, "rounds": 2},
    )
    _, df = sweep(tmp_path, grid)
    slow = df[df.fault == "slow_pass"]
    assert set(slow.status) == {"unstable"}, df[["run_id", "status", "reason"]]
    for reason in slow.reason:
        assert reason.count("passes disagree") == 2 and "measured again" in reason
    assert set(df[df.fault == "none"].status) == {"ok"}
    started = started_counts(tmp_path / "results")
    assert all(started[run_id] == 4 for run_id in slow.run_id)  # 2 passes, twice
    replaced = list((tmp_path / "results" / "replaced").glob("*.json"))
    assert {p.name.split(".")[0] for p in replaced} == set(slow.run_id)
    ranked = tables.ranking(df)
    assert set(ranked.tail(2).run_id) == set(slow.run_id) and set(ranked.tail(2).tie) == {""}
    assert not set(summaries.best_per_world_size(df, None).run_id) & set(slow.run_id)
    assert set(summaries.scaling_efficiency(df).config).isdisjoint({"slow_pass"})
    assert len(summaries.scaling_efficiency(df)) == 2  # the quiet configuration, W=1 and 2
    listed = failures.failure_reasons(df)
    assert listed[listed.status == "unstable"].runs.sum() == 2
    compared = compare_results(df, df)
    unstable = compared[compared.status_a == "unstable"]
    assert len(unstable) == 2 and unstable.tokens_per_s_ratio.isna().all()
    assert pytest.approx(1.0) == compared[compared.status_a == "ok"].tokens_per_s_ratio.iloc[0]
