"""`measure.rounds`: a job measures its runs in passes (all once, then all again), and each
run's record pools the step times of its passes under the run's own id."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from fsdp_bench.config.grid import parse_grid
from fsdp_bench.config.measure import MeasureConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.errors import ConfigError
from fsdp_bench.job.record import RunContext, build_result, pool_passes
from fsdp_bench.job.rendezvous import RankInfo
from fsdp_bench.store import EstimatedPeaks
from tests.conftest import sweep, tiny_grid
from tests.test_timing_stats import outcome


def test_passes_pool_in_order_with_the_worst_memory_and_the_first_parity() -> None:
    first = dataclasses.replace(
        outcome([0.10, 0.12, 0.11]), tracked_peak_bytes=300, parity={"ok": True}, setup_s=2.0
    )
    second = dataclasses.replace(outcome([0.20, 0.19, 0.21]), tracked_peak_bytes=100)
    pooled = pool_passes([first, second])
    assert pooled.step_times_s == [0.10, 0.12, 0.11, 0.20, 0.19, 0.21]
    assert pooled.steps_per_round == [3, 3]
    assert pooled.tracked_peak_bytes == 300 and pooled.parity == {"ok": True}
    assert pooled.setup_s == 2.0  # one pass's cost, the slowest
    assert pool_passes([first]) is first


def test_a_pooled_record_gives_each_pass_its_median_and_counts_every_repeat() -> None:
    run = RunConfig(measure=MeasureConfig(timed_steps=3, repeats=1, rounds=2))
    info = RankInfo(rank=0, local_rank=0, world_size=1, num_nodes=1, job_id="7", attempt=0)
    where = RunContext(torch.device("cpu"), info, "t0", 9.0, EstimatedPeaks())
    pooled = pool_passes([outcome([0.10, 0.12, 0.11]), outcome([0.20, 0.19, 0.21])])
    result = build_result(run, [pooled], where, {"device_name": "cpu"})
    assert result.run_id == run.run_id != RunConfig().run_id  # rounds are part of the id
    assert result.round_step_time_s == [0.11, 0.20]  # a drift shows
    assert result.step_time_s == pytest.approx(0.155) and result.timed_repeats == 2
    assert result.step_time_ci_low_s == 0.10 and result.step_time_ci_high_s == 0.21


def test_rounds_below_one_are_refused_in_one_line() -> None:
    grid = {"name": "g", "base": {"measure": {"rounds": 0}}, "axes": {"data.seed": [0]}}
    with pytest.raises(ConfigError) as info:
        parse_grid(grid, source="grid.yaml")
    expected = "grid.yaml: base.measure.rounds: 0 is not allowed; expected an integer >= 1"
    assert str(info.value) == expected


def started_in_order(results: Path) -> list[tuple[str, int]]:
    """(run id, round) in the order rank 0 of each job started them, job after job."""
    logs = sorted(
        (results / "jobs" / "submitit").glob("*_0_log.out"), key=lambda p: p.stat().st_mtime
    )
    found = []
    for log in logs:
        for run_id, index in re.findall(r"run (\w+) started \(round (\d) of 2\)", log.read_text()):
            found.append((run_id, int(index)))
    return found


@pytest.mark.slow
def test_a_job_interleaves_its_runs_and_a_failed_run_does_not_cost_the_others(
    tmp_path: Path,
) -> None:
    measure = {"warmup_steps": 1, "timed_steps": 3, "repeats": 2, "rounds": 2}
    axes = [{"fsdp.grouping": ["root", "block"]}, {"fault.kind": ["error"], "fault.rank": [0]}]
    grid = tiny_grid("rounds", axes, world_size=1, measure=measure)
    outcome_, df = sweep(tmp_path, grid)
    assert len(df) == 3 and outcome_.recorded == 3
    by_status = df.groupby("status")["run_id"].apply(list).to_dict()
    assert len(by_status["ok"]) == 2 and len(by_status["error"]) == 1
    order = started_in_order(tmp_path / "results")
    ok = df[df["status"] == "ok"]
    root, block = (ok.set_index("grouping").loc[g, "run_id"] for g in ("root", "block"))
    failed = by_status["error"][0]
    # job 1 ends at the failing run's first pass; job 2 measures root and block afresh
    first_job = [(root, 1), (block, 1), (failed, 1)]
    assert order == [*first_job, (root, 1), (block, 1), (root, 2), (block, 2)]
    assert all(len(times) == 2 * 2 * 3 for times in ok["step_times_s"])
    assert all(len(medians) == 2 for medians in ok["round_step_time_s"])
    assert set(ok["timed_repeats"]) == {4}
    assert not (tmp_path / "results" / "inflight").exists() or not any(
        (tmp_path / "results" / "inflight").iterdir()
    )
