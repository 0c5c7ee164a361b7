"""The search's confirmation round: the top k feasible configurations measured again,
interleaved, and the winner named with its interval, or a tie."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.config.grid import load_grid, parse_grid
from fsdp_bench.config.grid_settings import SearchConfig
from fsdp_bench.config.measure import MeasureConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.config.schema import to_plain
from fsdp_bench.errors import ConfigError
from fsdp_bench.search import open_study
from fsdp_bench.search.confirm import confirmation_run, decide, skip_reason, top_feasible
from fsdp_bench.store import ResultStore, RunResult
from tests.conftest import write_grid
from tests.test_search import GRID

GROUPINGS = ["root", "block", "linear", "blocks:2"]


def record(
    grouping: str, tokens: float, *, peak: float = 0.019, status: str = "ok", **fields: Any
) -> RunResult:
    run = RunConfig(world_size=2, fsdp=FsdpConfig(grouping=grouping))
    return RunResult(
        run_id=run.run_id,
        status=status,  # type: ignore[arg-type]
        config=to_plain(run),
        tokens_per_s=tokens if status == "ok" else None,
        peak_memory_gib=peak,
        **fields,
    )


def test_top_k_is_distinct_feasible_and_best_first(tmp_path: Path) -> None:
    grid = {**GRID, "search": {"confirm_top_k": 3}}
    spec = load_grid(write_grid(tmp_path, grid))
    store = ResultStore(tmp_path / "r")
    study = open_study(spec, store, None)
    told = [
        record("root", 99_000.0, peak=0.030),  # fastest, over the 0.0205 GiB budget
        record("block", 5_000.0),
        record("linear", 7_000.0),
        record("block", 5_000.0),  # the same point asked again: one configuration
        record("blocks:2", 6_000.0),
        record("blocks:3", 8_000.0, status="error"),
        record("blocks:4", 1_000.0),  # feasible, but 4th
    ]
    for result in told:
        store.record(result)
        trial = study.ask()
        trial.set_user_attr("run_id", result.run_id)
        if result.status != "ok":
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            continue
        trial.set_constraint("memory", result.peak_memory_gib - 0.0205)  # type: ignore[operator]
        study.tell(trial, [result.tokens_per_s])
    top = top_feasible(study, store, spec)
    assert [r.config["fsdp"]["grouping"] for r in top] == ["linear", "blocks:2", "block"]


def test_a_confirmation_copy_is_another_run_of_the_same_configuration() -> None:
    run = RunConfig(world_size=2, fsdp=FsdpConfig(grouping="block"))
    copy = confirmation_run(run, 3)
    assert copy.run_id != run.run_id and copy.measure.rounds == 3
    assert to_plain(copy)["fsdp"] == to_plain(run)["fsdp"]
    already = RunConfig(measure=MeasureConfig(rounds=3))
    assert confirmation_run(already, 3).run_id != already.run_id  # never itself


def confirmed(result: RunResult, tokens: float, low: float, high: float) -> RunResult:
    return RunResult(
        run_id=result.run_id + "-c",
        status="ok",
        config=result.config,
        tokens_per_s=tokens,
        tokens_per_s_ci_low=low,
        tokens_per_s_ci_high=high,
        peak_memory_gib=result.peak_memory_gib,
    )


def test_the_fastest_confirmed_wins_and_overlapping_intervals_tie() -> None:
    a, b, c = record("block", 9_000.0), record("linear", 8_000.0), record("root", 7_000.0)
    again = {
        a.run_id: confirmed(a, 7_000.0, 6_900.0, 7_100.0),  # the trials' best was lucky
        b.run_id: confirmed(b, 8_100.0, 8_000.0, 8_200.0),
        c.run_id: confirmed(c, 7_950.0, 7_900.0, 8_050.0),  # overlaps b's interval
    }
    outcome = decide([a, b, c], again, lambda r: True, rounds=3)
    assert outcome.winner is not None and outcome.winner.trial is b
    assert [t.trial for t in outcome.tied] == [c]
    assert outcome.winner_differs and outcome.trial_best is not None
    assert outcome.trial_best.trial is a and not outcome.failed
    clear = decide([a, b], again, lambda r: True, rounds=3)
    assert clear.winner is not None and clear.winner.trial is b and not clear.tied


def test_a_failed_or_over_budget_confirmation_is_reported_not_fatal() -> None:
    a, b, c = record("block", 9_000.0), record("linear", 8_000.0), record("root", 7_000.0)
    failed = RunResult(run_id="x", status="timeout", config=a.config, reason="slow\nmore")
    big = confirmed(c, 9_500.0, 9_400.0, 9_600.0)
    again = {a.run_id: failed, b.run_id: confirmed(b, 8_000.0, 7_900.0, 8_100.0),
             c.run_id: big}  # fmt: skip
    outcome = decide([a, b, c], again, lambda r: r is not big, rounds=2)
    assert outcome.winner is not None and outcome.winner.trial is b
    assert [(f.trial, f.problem) for f in outcome.failed] == [
        (a, "timeout: slow"),
        (c, "peak 0.019 GiB is over the budget"),
    ]
    nothing = decide([a], {a.run_id: None}, lambda r: True, rounds=2)
    assert nothing.winner is None and nothing.failed[0].problem == "not measured"


def test_no_interval_falls_back_to_the_step_spread() -> None:
    a, b = record("block", 9_000.0), record("linear", 8_000.0)
    again = {
        a.run_id: RunResult(run_id="a", status="ok", config=a.config, tokens_per_s=1000.0,
                            step_time_spread_pct=5.0),
        b.run_id: RunResult(run_id="b", status="ok", config=b.config, tokens_per_s=980.0,
                            step_time_spread_pct=1.0),
    }  # fmt: skip
    outcome = decide([a, b], again, lambda r: True, rounds=2)
    assert outcome.winner is not None and [t.trial for t in outcome.tied] == [b]


def test_when_there_is_a_round_and_its_settings_are_checked() -> None:
    assert skip_reason(SearchConfig()) == ""
    assert "0" in skip_reason(SearchConfig(confirm_top_k=0))
    assert "Pareto" in skip_reason(SearchConfig(multi_objective=True))
    assert "mfu" in skip_reason(SearchConfig(metric="mfu"))
    grid = {"name": "g", "base": {}, "axes": {"data.seed": [0]},
            "search": {"confirm_rounds": 1}}  # fmt: skip
    with pytest.raises(ConfigError) as info:
        parse_grid(grid, source="g.yaml")
    assert str(info.value) == (
        "g.yaml: search.confirm_rounds: 1 is not allowed; expected an integer >= 2"
    )
