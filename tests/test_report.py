"""`fsdp-bench report`: summaries exactly on a hand-built table, every figure on the real
quickstart results, the HTML report in a real headless Chromium."""

from __future__ import annotations

import html
import json
import math
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import matplotlib.image
import pandas as pd
import pytest
import yaml

from fsdp_bench import load_results
from fsdp_bench.cli.main import main
from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.config.measure import MeasureConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.config.schema import to_plain
from fsdp_bench.report import configs, estimates, failures, figure_data, summaries, tables, ties
from fsdp_bench.report.build import build_report, load
from fsdp_bench.report.compare import compare_results, comparison_summary
from fsdp_bench.report.figure_data import MIB
from fsdp_bench.report.figures import FIGURES
from fsdp_bench.report.html import Document, Section
from fsdp_bench.report.markdown import markdown_summary
from fsdp_bench.store import FAULT_COLUMNS, MODEL_COLUMNS, ResultStore, RunResult

# --- a hand-built results folder: failures in some cells, cells missing -----------------------

BUDGET_GIB = 8.0


def _record(
    store: ResultStore,
    world_size: int,
    grouping: str,
    status: str,
    tokens: float | None = None,
    peak: float | None = None,
    reshard: Any = "default",
    reason: str = "",
) -> str:
    run = RunConfig(
        world_size=world_size, fsdp=FsdpConfig(grouping=grouping, reshard_after_forward=reshard)
    )
    store.record(
        RunResult(
            run_id=run.run_id,
            status=status,  # type: ignore[arg-type]
            config=to_plain(run),
            reason=reason,
            tokens_per_s=tokens,
            step_time_s=1.0 if tokens else None,
            step_times_s=[0.9, 1.0, 1.1] if tokens else None,
            peak_memory_gib=peak,
            memory_breakdown_gib={"parameter": peak / 2, "activation": peak / 2} if peak else None,
            all_gathers_per_step=9 if tokens else None,
            provenance={"hostnames": [f"node{world_size}"], "torch_version": "2.13.0"},
        )
    )
    return run.run_id


@pytest.fixture
def hand_built(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """World size 1 and 2 ok with one OOM, one predicted OOM and one error; world size 4
    timed out or was cancelled; no run of linear grouping finished."""
    store = ResultStore(tmp_path / "hand")
    ids = {
        "w1_block": _record(store, 1, "block", "ok", 1000.0, 7.0),
        "w1_root": _record(store, 1, "root", "ok", 1200.0, 14.0),
        "w2_block": _record(store, 2, "block", "ok", 1800.0, 6.0),
        "w2_root": _record(store, 2, "root", "ok", 2000.0, 9.0),
        "w2_block_true": _record(store, 2, "block", "ok", 1600.0, 5.0, reshard=True),
        "w2_root_true": _record(store, 2, "root", "oom", reshard=True, reason="rank 0: OOM"),
        "w2_linear": _record(
            store, 2, "linear", "skipped", reason="predicted_oom: estimate 9 GiB > budget 8"
        ),
        "w2_linear_true": _record(store, 2, "linear", "error", reshard=True, reason="boom"),
        "w4_block": _record(store, 4, "block", "timeout", reason="collective timeout"),
        "w4_root": _record(store, 4, "root", "cancelled"),
    }
    (store.root / "grid.yaml").write_text(
        yaml.safe_dump({"name": "hand", "base": {}, "memory": {"budget_gib": BUDGET_GIB}})
    )
    return store.root, ids


def test_status_counts_every_category(hand_built: tuple[Path, dict[str, str]]) -> None:
    counts = summaries.status_counts(load_results(hand_built[0]))
    assert list(counts.index) == summaries.STATUS_CATEGORIES
    assert counts["total"].to_dict() == {
        "ok": 5,
        "oom": 1,
        "skipped: predicted_oom": 1,
        "error": 1,
        "timeout": 1,
        "cancelled": 1,
    }
    assert counts["world size 1"].tolist() == [2, 0, 0, 0, 0, 0]
    assert counts["world size 2"].tolist() == [3, 1, 1, 1, 0, 0]
    assert counts["world size 4"].tolist() == [0, 0, 0, 0, 1, 1]


def test_best_per_world_size_under_the_budget(hand_built: tuple[Path, dict[str, str]]) -> None:
    root, ids = hand_built
    best = summaries.best_per_world_size(load_results(root), BUDGET_GIB)
    assert best["world_size"].tolist() == [1, 2, 4]
    # world size 1: root is faster but 14 GiB; world size 2: root is fastest but 9 GiB
    assert best["run_id"].tolist()[:2] == [ids["w1_block"], ids["w2_block"]]
    assert best["tokens_per_s"].tolist()[:2] == [1000.0, 1800.0]
    assert best["grouping"].tolist()[:2] == ["block", "block"]
    assert best["run_id"].isna().tolist()[2] and best["note"].tolist()[2] == "no run finished ok"
    unlimited = summaries.best_per_world_size(load_results(root), None)
    assert unlimited["run_id"].tolist()[:2] == [ids["w1_root"], ids["w2_root"]]
    tight = summaries.best_per_world_size(load_results(root), 4.0)
    assert tight["note"].tolist()[:2] == ["every ok run is over the budget"] * 2


def test_axis_effects_are_median_ratios_of_matched_runs(
    hand_built: tuple[Path, dict[str, str]],
) -> None:
    effects = summaries.axis_effects(load_results(hand_built[0])).set_index(["axis", "value"])
    root = effects.loc[("grouping", "root")]
    assert root["baseline"] == "block" and root["pairs"] == 2  # the root OOM has no twin
    assert root["tokens_per_s_ratio"] == pytest.approx((1200 / 1000 + 2000 / 1800) / 2)
    assert root["peak_memory_ratio"] == pytest.approx((14 / 7 + 9 / 6) / 2)
    reshard = effects.loc[("reshard_after_forward", True)]
    assert reshard["baseline"] == "default" and reshard["pairs"] == 1
    assert reshard["tokens_per_s_ratio"] == pytest.approx(1600 / 1800)
    assert reshard["peak_memory_ratio"] == pytest.approx(5 / 6)
    assert ("grouping", "linear") not in effects.index  # no linear run finished
    assert len(effects) == 2


def test_scaling_efficiency_relative_to_the_smallest_world_size(
    hand_built: tuple[Path, dict[str, str]],
) -> None:
    table = summaries.scaling_efficiency(load_results(hand_built[0]))
    rows = zip(table["config"], table["world_size"], table["efficiency"], strict=True)
    got = {(c, w): e for c, w, e in rows}
    # block with reshard=true ran at world size 2 only: nothing to scale from
    assert got == pytest.approx(
        {("block", 1): 1.0, ("block", 2): 0.9, ("root", 1): 1.0, ("root", 2): 1000 / 1200}
    )
    assert table.loc[table["world_size"] == 2, "tokens_per_s_per_rank"].tolist() == [900, 1000]


def test_pareto_front_and_best_so_far(hand_built: tuple[Path, dict[str, str]]) -> None:
    root, ids = hand_built
    front = summaries.pareto_front(load_results(root))
    assert front["run_id"].tolist() == [ids["w2_block_true"], ids["w2_block"], ids["w2_root"]]
    trials = pd.DataFrame(
        {
            "number": [0, 1, 2, 3, 4],
            "state": ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE", "COMPLETE"],
            "value": [5.0, 9.0, math.nan, 0.0, 7.0],
            "feasible": [True, False, False, False, True],
        }
    )
    history = summaries.best_so_far(trials)
    assert history["number"].tolist() == [0, 1, 3, 4]
    assert history["best_so_far"].tolist() == [5.0, 5.0, 5.0, 7.0]
    assert history["kind"].tolist()[1] == "over budget / OOM"


def test_compare_matches_configurations_and_divides_b_by_a(
    hand_built: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    root, ids = hand_built
    other = ResultStore(tmp_path / "other")
    _record(other, 2, "block", "ok", 3600.0, 3.0)
    _record(other, 2, "root", "oom")
    _record(other, 1, "block", "ok", 1010.0, 7.0)
    _record(other, 1, "root", "ok", 9000.0, 14.0)
    _record(other, 8, "block", "ok", 100.0, 1.0)  # only in B
    with_intervals = {(1, "block"): (990.0, 1030.0), (1, "root"): (8000.0, 9900.0)}
    for path in (other.root / "runs").glob("*.json"):
        record = json.loads(path.read_text())
        shape = (record["config"]["world_size"], record["config"]["fsdp"]["grouping"])
        low, high = with_intervals.get(shape, (None, None))
        contended = shape == (1, "root")  # a 7.5x ratio from a run measured beside another
        given = {"tokens_per_s_ci_low": low, "tokens_per_s_ci_high": high, "contended": contended}
        path.write_text(json.dumps({**record, **given}))
    for path in (root / "runs").glob("*.json"):
        record = json.loads(path.read_text())
        if record["tokens_per_s"]:
            tokens = record["tokens_per_s"]
            path.write_text(json.dumps({**record, "tokens_per_s_ci_low": 0.98 * tokens,
                                        "tokens_per_s_ci_high": 1.02 * tokens}))  # fmt: skip
    table = compare_results(load_results(root), load_results(other.root))
    by_a = table.set_index("run_id_a")
    block = by_a.loc[ids["w2_block"]]
    assert block["tokens_per_s_ratio"] == 2.0 and block["peak_memory_ratio"] == 0.5
    assert block["differs_from_1"] == "unknown" and block["note"] == ""  # B has no interval
    assert by_a.loc[ids["w2_root"], "status_b"] == "oom"
    assert math.isnan(by_a.loc[ids["w2_root"], "tokens_per_s_ratio"])
    assert len(table) == 11 and table["run_id_a"].isna().sum() == 1
    # [B low / A high, B high / A low]: 990/1020 to 1030/980 holds 1
    interval = by_a.loc[ids["w1_block"], "tokens_per_s_ratio_ci"]
    assert interval == pytest.approx((990 / 1020, 1030 / 980))
    assert by_a.loc[ids["w1_block"], "differs_from_1"] == "no"
    assert by_a.loc[ids["w1_root"], "note"] == "contended in B"
    assert by_a.loc[ids["w1_root"], "differs_from_1"] == "yes"

    summary = comparison_summary(table, ("A", "B"))
    assert summary.startswith("3 configurations ran ok in both; ratios are B ÷ A: median ")
    assert "over 2 measured without contention on both sides" in summary  # the 7.5x left out
    assert "1 contended on a side: shown, marked, left out of the medians" in summary
    assert "In one folder only: 6 A, 1 B" in summary
    people = tables.compare_table(table, ("A", "B"))
    row = people[people["tokens/s A"] == "1,000"].iloc[0]  # formatted, not 1000.0
    assert row["ratio interval"] == "0.97-1.05×" and row["differs from 1×"] == "no"


def test_estimate_accuracy_puts_each_estimate_beside_its_measurement(tmp_path: Path) -> None:
    """Two CUDA runs: each figure's estimate, measurement and error in % of the measurement,
    and the table for people."""
    store = ResultStore(tmp_path)
    figures = [(10.0, 10.2, 12.0, 13.0, 10.0, 10.1, 12.5, 13.5), (20.0, 20.1, 25.0, 26.0,
               19.0, 20.4, 24.0, 27.0)]  # fmt: skip
    for index, values in enumerate(figures):
        run = RunConfig(world_size=8, fsdp=FsdpConfig(grouping=["block", "root"][index]))
        tensors, allocated, reserved, used, tracked, peak, peak_reserved, peak_used = values
        store.record(
            RunResult(
                run_id=run.run_id, status="ok", config=to_plain(run), tokens_per_s=1.0,
                step_time_s=1.0, estimated_peak_gib=tensors, estimated_allocated_gib=allocated,
                estimated_reserved_gib=reserved, estimated_device_used_gib=used,
                tracked_peak_gib=tracked, peak_memory_gib=peak, peak_reserved_gib=peak_reserved,
                device_used_peak_gib=peak_used, peak_memory_source="cuda_max_memory_allocated",
                estimated_reserved_low_gib=reserved - 0.75,
                estimated_reserved_high_gib=reserved + 0.75,
                estimate_fits=["yes", "maybe"][index],
                estimate_correction={"factor": 1.1, "run_ids": ["x"], "scope": "y"} if index
                else None,
            )
        )  # fmt: skip
    accuracy = estimates.estimate_accuracy(load_results(tmp_path))
    assert list(accuracy["reserved inside"]) == [True, False]  # 12.5 in 11.25-12.75, 24 not
    assert list(accuracy["fits"]) == ["yes", "maybe"]
    assert tables.coverage_line(accuracy) == "1 of 2 measured figures inside their interval"
    root = accuracy.loc["W=8: root"]
    assert root["tensors error %"] == pytest.approx(100 * (20.0 - 19.0) / 19.0)
    assert root["allocated measured"] == 20.4 and root["device-used est"] == 26.0
    assert root["reserved error %"] == pytest.approx(100 * (25 - 24) / 24)
    shown = tables.estimate_table(accuracy)
    assert list(shown.columns)[:4] == ["configuration", "tensors est", "tensors measured",
                                       "tensors error"]  # fmt: skip
    assert shown.set_index("configuration").loc["W=8: block", "reserved error"] == "-4.0%"
    assert shown.set_index("configuration").loc["W=8: root", "correction"] == "x 1.100"
    assert shown.set_index("configuration").loc["W=8: root", "reserved inside"] == "no"
    assert estimates.estimate_accuracy(load_results(tmp_path).iloc[0:0]).empty


def test_effect_axes_are_the_configuration_less_model_scale_and_faults() -> None:
    assert configs.EFFECT_AXES[0] == "strategy" and "grouping" in configs.EFFECT_AXES
    left_out = {*configs.SCALE_COLUMNS, *MODEL_COLUMNS, *FAULT_COLUMNS}
    assert not left_out & set(configs.EFFECT_AXES)


def test_at_baseline_keeps_the_slice_where_only_free_axes_vary() -> None:
    df = pd.DataFrame(
        {
            "world_size": [1, 2, 2, 2, 2],
            "strategy": ["fsdp"] * 5,
            "grouping": ["block", "block", "root", "block", "block"],
            "reshard_after_forward": ["default", "default", "default", True, "default"],
            "mixed_precision": ["fp32", "fp32", "fp32", "fp32", "bf16"],
        }
    )
    # world size is not an effect axis: both world sizes stay
    assert configs.at_baseline(df, []).index.tolist() == [0, 1]
    assert configs.at_baseline(df, ["grouping"]).index.tolist() == [0, 1, 2]
    assert configs.at_baseline(df, ["grouping", "mixed_precision"]).index.tolist() == [0, 1, 2, 4]
    assert configs.at_baseline(df.iloc[0:0], []).empty


def test_grouping_order_is_coarse_to_fine() -> None:
    values = pd.Series(["linear", "block", "root", "blocks:2", "blocks:4", "custom", "root"])
    order = ["root", "blocks:4", "blocks:2", "block", "linear", "custom"]
    assert figure_data.grouping_order(values) == order


def test_grouping_bars_give_each_run_the_rankings_interval(
    hand_built: tuple[Path, dict[str, str]],
) -> None:
    """One bar per run with the tokens/s and interval the ranking shows: a figure drawn from
    step samples read 800-1,000 tokens/s with a bootstrap interval where the table said 156."""
    df = load_results(hand_built[0])
    chosen = df["run_id"] == hand_built[1]["w2_block"]
    df.loc[chosen, ["tokens_per_s_ci_low", "tokens_per_s_ci_high"]] = [1700.0, 2100.0]
    bars = figure_data.grouping_bars(df)
    assert len(bars) == 5  # five FSDP runs finished ok
    block = bars[bars["run_id"] == hand_built[1]["w2_block"]].iloc[0]
    assert block["tokens_per_s"] == df[chosen].iloc[0]["tokens_per_s"]
    assert (block["ci_low"], block["ci_high"]) == (1700.0, 2100.0)
    assert bars[bars["run_id"] != hand_built[1]["w2_block"]]["ci_low"].isna().all()
    assert set(bars["reshard_after_forward"]) == {"default", "true"}
    assert block["world size"] == 2


def test_collective_counts_in_calls_and_mib() -> None:
    mib = 2**20
    df = pd.DataFrame(
        {
            "all_gathers_per_step": [9, 4],
            "all_gather_bytes_per_step": [3 * mib, 2 * mib],
            "reduce_scatters_per_step": [9.0, math.nan],
            "reduce_scatter_bytes_per_step": [6 * mib, math.nan],
        },
        index=[10, 11],
    )
    long = figure_data.collective_counts(df, pd.Series(["block", "root"], index=df.index))
    assert long.to_dict("records") == [
        {"x": "block", "collective": "all-gather", "calls per step": 9.0, "MiB per step": 3.0},
        {"x": "block", "collective": "reduce-scatter", "calls per step": 9.0, "MiB per step": 6.0},
        {"x": "root", "collective": "all-gather", "calls per step": 4.0, "MiB per step": 2.0},
    ]


def test_collective_panels_at_the_largest_world_size(
    hand_built: tuple[Path, dict[str, str]],
) -> None:
    df = load_results(hand_built[0])
    runs = figure_data.collective_runs(df)
    assert set(runs["world_size"]) == {2} and len(runs) == 3  # world size 4 never finished
    panels = figure_data.collective_panels(runs)
    assert [label for label, _ in panels] == ["grouping"]  # accumulation never varies
    long = panels[0][1]
    assert list(long["x"].cat.categories) == ["root", "block"]
    assert long["x"].tolist() == ["block", "root"]  # at the baseline: reshard=default
    assert long["calls per step"].tolist() == [9.0, 9.0]
    assert long["MiB per step"].tolist() == [0.0, 0.0]  # no bytes recorded
    one_rank = df[df["world_size"] == 1]
    assert figure_data.collective_runs(one_rank).empty


def test_pareto_listing_and_unmeasured_runs(hand_built: tuple[Path, dict[str, str]]) -> None:
    root, ids = hand_built
    df = load_results(root)
    listing = figure_data.pareto_listing(figure_data.measured_runs(df))
    assert listing["run_id"].tolist() == [ids["w2_block_true"], ids["w2_block"], ids["w2_root"]]
    assert listing["listing"].tolist() == [
        "1: W=2, block, reshard=true",
        "2: W=2, block",
        "3: W=2, root",
    ]
    unmeasured = figure_data.unmeasured_runs(df)["run_id"]
    assert sorted(unmeasured) == sorted([ids["w2_root_true"], ids["w2_linear"]])


def test_memory_breakdown_rows_and_parts(hand_built: tuple[Path, dict[str, str]]) -> None:
    runs = figure_data.breakdown_runs(load_results(hand_built[0]))
    assert runs["label"].tolist() == [
        "W=1: block",
        "W=1: root",
        "W=2: block, reshard=true",
        "W=2: block",
        "W=2: root",
    ]
    hand = pd.DataFrame(
        {
            "label": ["a", "b"],
            "memory_breakdown_gib": [
                {"parameter": 1.0, "activation": 4.0},
                {"parameter": 2.0, "gradient": 0.5},
            ],
        }
    )
    parts = figure_data.memory_parts(hand)
    assert list(parts.columns) == ["activation", "parameter", "gradient"]  # largest first
    assert parts.to_dict("index") == {
        "a": {"activation": 4.0, "parameter": 1.0, "gradient": 0.0},
        "b": {"activation": 0.0, "parameter": 2.0, "gradient": 0.5},
    }


def test_timeline_panels_lay_runs_differing_in_one_knob_over_each_other() -> None:
    def timeline(peak_mib: float, where: str) -> dict[str, object]:
        points = [[0, MIB, "root forward"], [5, peak_mib * MIB, where], [9, MIB, "optimizer"]]
        return {"num_ops": 10, "points": points, "collectives": [[1, "all_gather"]]}

    rows = [  # (world size, strategy, prefetch, reshard, peak MiB)
        (2, "fsdp", "implicit", "default", 10.0),
        (2, "fsdp", "2", "default", 12.0),
        (2, "fsdp", "implicit", "False", 14.0),
        (2, "fsdp", "2", "False", 99.0),  # two knobs off the base: in no panel
        (2, "ddp", "implicit", "default", 50.0),
        (1, "fsdp", "implicit", "default", 5.0),  # another world size
    ]
    df = pd.DataFrame(
        [
            {"status": "ok", "tokens_per_s": 1.0, "world_size": w, "strategy": s, "prefetch": p,
             "reshard_after_forward": r, "grouping": "block",
             "memory_timeline": timeline(peak, f"layers.{i} backward")}
            for i, (w, s, p, r, peak) in enumerate(rows)
        ]
    )  # fmt: skip
    panels = figure_data.timeline_panels(df)
    assert [axis for axis, _, _ in panels] == ["prefetch", "reshard_after_forward"]
    _, points, marks = panels[0]
    peaks = points[points["peak"]]
    assert peaks[["label", "mib", "where"]].values.tolist() == [
        ["prefetch=implicit", 10.0, "layers.0 backward"],
        ["prefetch=2", 12.0, "layers.1 backward"],
    ]
    assert points["x"].tolist()[:3] == [0.0, 0.5, 0.9]
    assert marks.values.tolist() == [["prefetch=implicit", 0.1, "all_gather"],
                                     ["prefetch=2", 0.1, "all_gather"]]  # fmt: skip
    assert panels[1][1][panels[1][1]["peak"]]["mib"].tolist() == [10.0, 14.0]
    assert figure_data.timeline_panels(df[df["prefetch"] == "implicit"].iloc[:1]) == []


def test_comparison_long_keeps_configurations_ok_in_both() -> None:
    table = pd.DataFrame(
        {
            "config": ["block", "root"],
            "world_size": [2, 2],
            "tokens_per_s_a": [100.0, 200.0],
            "tokens_per_s_b": [150.0, math.nan],
            "peak_memory_gib_a": [1.0, 2.0],
            "peak_memory_gib_b": [0.5, math.nan],
        }
    )
    long = figure_data.comparison_long(table, ("A", "B"))
    assert long.to_dict("records") == [
        {"configuration": "W=2: block", "results": "A", "tokens/s": 100.0, "peak GiB": 1.0},
        {"configuration": "W=2: block", "results": "B", "tokens/s": 150.0, "peak GiB": 0.5},
    ]


def test_terminal_ranking_uses_the_report_headers_and_ddp_dashes() -> None:
    df = pd.DataFrame(
        {
            "run_id": ["a", "b", "c"],
            "status": ["ok", "ok", "oom"],
            "world_size": [2, 2, 2],
            "strategy": ["fsdp", "ddp", "fsdp"],
            "grouping": ["root", "block", "block"],
            "tokens_per_s": [1000.0, 2000.0, math.nan],
            "peak_memory_gib": [1.5, 2.25, math.nan],
        }
    )
    lines = [line.split() for line in tables.format_ranking(tables.ranking(df)).splitlines()]
    assert lines == [
        ["run_id", "strategy", "grouping", "tokens/s", "tie", "peak", "GiB/rank", "status"],
        ["b", "ddp", "-", "2,000", "best", "2.250", "ok"],
        ["a", "fsdp", "root", "1,000", "tied", "1.500", "ok"],  # nothing says they differ
        ["c", "fsdp", "block", "-", "-", "oom"],
    ]
    assert tables.shown(df).columns[-1] == "peak GiB/rank"  # the same header in the report
    assert tables.format_ranking(tables.ranking(df, [])) == "(no runs)"


def test_summary_md_repeats_the_sections_marked_for_it() -> None:
    table = pd.DataFrame({"x": ["1"]})
    doc = Document(
        title="t",
        subtitle="s",
        headline="",
        sections=[
            Section("Comparison: not marked", "left out", [("", table)]),
            Section("Marked", "kept", [("", table)], in_summary=True),
        ],
        provenance=dict.fromkeys(
            ["torch version", "devices", "hosts", "first run started", "last run finished"], "-"
        )
        | {"grid file": "-"},
    )
    empty = pd.DataFrame()
    best = pd.DataFrame(columns=["world_size", "run_id", "note"])
    effects = summaries.axis_effects(pd.DataFrame())
    md = markdown_summary(doc, best, effects, empty, [])
    assert "## Marked\n\nkept\n\n| x |" in md and "left out" not in md


def test_report_of_a_table_with_failures(hand_built: tuple[Path, dict[str, str]]) -> None:
    root, ids = hand_built
    outcome = build_report(root)
    assert (root / "report" / "report.html").exists() and (root / "report" / "summary.md").exists()
    # 1,800 and 1,600 tokens/s differ by 11%, less than their steps' 20% spread: a tie
    # a tied run by the settings where it differs from the best (not a bare run id)
    tied = f"tied with the best: reshard_after_forward=true ({ids['w2_block_true']})"
    assert f"(run {ids['w2_block']}; {tied})" in outcome.headline
    assert "World size 4: no configuration fits (no run finished ok)" in outcome.headline
    summary = (root / "report" / "summary.md").read_text()
    assert tied in summary
    assert ids["w2_block"] in summary and "budget" in (root / "report" / "report.html").read_text()
    page = (root / "report" / "report.html").read_text()
    assert "Why runs did not finish ok" in page and "collective timeout" in page
    assert f"--print-launch {ids['w2_block']}" in page  # the best's launch, one command away
    assert "Why runs did not finish ok" in summary and "boom" in summary


def test_failure_reasons_one_row_per_status_and_reason(
    hand_built: tuple[Path, dict[str, str]],
) -> None:
    """What the sweep prints and the report lists: the rank that said it left out."""
    root, ids = hand_built
    table = failures.failure_reasons(load_results(root))
    rows = {(r.status, r.reason): (r.runs, r.run_ids) for r in table.itertuples()}
    assert rows[("oom", "OOM")] == (1, ids["w2_root_true"])  # "rank 0: OOM"
    assert rows[("error", "boom")] == (1, ids["w2_linear_true"])
    assert ("skipped", "predicted_oom: estimate 9 GiB > budget 8") in rows
    assert len(rows) == 5 and table["runs"].sum() == 5


def test_the_grid_margin_is_kept_free_below_the_budget(
    hand_built: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """peak + margin <= budget, as sweep prunes and search decides feasibility: with 2.5 GiB
    kept free of 8, the 6 GiB block run no longer fits and the 5 GiB one is best."""
    root, ids = hand_built
    memory = {"budget_gib": BUDGET_GIB, "margin_gib": 2.5}
    (root / "grid.yaml").write_text(yaml.safe_dump({"name": "hand", "base": {}, "memory": memory}))
    outcome = build_report(root, out=tmp_path / "out")
    best = outcome.best.set_index("world_size")
    assert best.loc[2, "run_id"] == ids["w2_block_true"]
    assert "less its 2.5 GiB margin" in (tmp_path / "out" / "report.html").read_text()


def test_cli_errors_are_one_line_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "no runs recorded yet" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "empty"), "--budget-gib", "-1"]) == 2


# --- the real quickstart sweep ------------------------------------------------------------------


@pytest.fixture(scope="session")
def quickstart_results(quickstart_sweep: tuple[Path, subprocess.CompletedProcess[str]]) -> Path:
    """The built-in quickstart sweep, run for real once per session (three repeats)."""
    return quickstart_sweep[0]


@pytest.fixture(scope="session")
def quickstart_report(quickstart_results: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report")
    assert main(["report", str(quickstart_results), "--out", str(out), "--svg"]) == 0
    return out


@pytest.mark.slow
def test_every_figure_for_the_quickstart_sweep(
    quickstart_report: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in FIGURES:
        png = quickstart_report / f"{name}.png"
        image = matplotlib.image.imread(png)
        assert image.shape[0] > 200 and image.shape[1] > 300, name
        assert image[..., :3].std() > 0.01, f"{name} is blank"
        assert (quickstart_report / f"{name}.svg").stat().st_size > 1000
    summary = (quickstart_report / "summary.md").read_text()
    assert "Best at world size 1" in summary and "Best at world size 2" in summary


@pytest.mark.slow
def test_compare_a_folder_with_itself(
    quickstart_results: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, copy = tmp_path / "quickstart", tmp_path / "copy"
    shutil.copytree(quickstart_results / "runs", folder / "runs")
    shutil.copytree(quickstart_results / "runs", copy / "runs")
    assert main(["report", str(folder)]) == 0
    own = (folder / "report" / "report.html").read_text()
    assert main(["report", str(folder), "--compare", str(copy)]) == 0
    printed = capsys.readouterr().out
    out = folder / "report-vs-copy"  # the folder's own report is left as it was
    assert (folder / "report" / "report.html").read_text() == own
    assert str(out / "comparison.png") in printed and "Best at world size 2" in printed
    assert matplotlib.image.imread(out / "comparison.png").shape[0] > 500
    said = next(line for line in printed.splitlines() if line.startswith("Compared with "))
    ok = int(re.search(r": (\d+) configurations ran ok in both", said)[1])  # type: ignore[index]
    quiet = re.search(r"over (\d+) measured without contention on both sides", said)
    contended = re.search(r"(\d+) contended on a side", said)
    assert ok >= 25 and sum(int(m[1]) for m in (quiet, contended) if m) == ok
    assert quiet is None or "median 1.00× tokens/s and 1.00× peak memory" in said
    assert f"{ok} configurations ran ok in both" in (out / "report.html").read_text()


def test_search_figures_from_a_study_journal(
    hand_built: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    root, _ = hand_built
    storage = JournalStorage(JournalFileBackend(str(root / "study.journal")))
    study = optuna.create_study(study_name="hand", storage=storage, direction="maximize")
    study.set_user_attr("budget_gib", 6.5)  # what `search --budget-gib 6.5` ran with
    for number in range(8):  # values that vary among the feasible trials, not left to chance
        study.enqueue_trial({"fsdp.grouping": ["block", "root"][number % 2],
                             "fsdp.reshard_after_forward": number % 4 < 2})  # fmt: skip
        trial = study.ask()
        grouping = trial.suggest_categorical("fsdp.grouping", ["block", "root"])
        reshard = trial.suggest_categorical("fsdp.reshard_after_forward", [True, False])
        trial.set_constraint("memory", 1.0 if number % 3 == 0 else -1.0)
        study.tell(trial, 1000.0 + 100 * number + (50 if grouping == "root" else 0) + reshard)
    outcome = build_report(root, out=tmp_path / "out")
    drawn = {f.name: f for f in outcome.figures}
    for name in ("search_progress", "param_importance"):
        assert not drawn[name].skipped, drawn[name].skipped
        assert matplotlib.image.imread(drawn[name].paths[0]).shape[0] > 200
    assert "within the 6.5 GiB per rank budget" in (tmp_path / "out" / "report.html").read_text()


# --- the HTML report in a real browser ----------------------------------------------------------

PROBE = """<script>
window.__probe = {errors: []};
window.addEventListener("error", function (e) {
  var what = e.message || (e.target && (e.target.src || e.target.tagName)) || "error";
  window.__probe.errors.push("error: " + String(what).slice(0, 200));
}, true);
window.addEventListener("unhandledrejection", function (e) {
  window.__probe.errors.push("unhandled rejection: " + e.reason);
});
["error", "warn"].forEach(function (level) {
  var original = console[level];
  console[level] = function () {
    var text = Array.prototype.join.call(arguments, " ");
    window.__probe.errors.push("console." + level + ": " + text);
    original.apply(console, arguments);
  };
});
window.addEventListener("load", function () {
  var out = window.__probe;
  out.images = Array.prototype.map.call(document.images, function (img) {
    return {alt: img.alt, width: img.naturalWidth, complete: img.complete};
  });
  out.text = document.body.innerText;
  // click the tokens/s header of the all-runs table (the last but provenance) twice
  var tables = document.querySelectorAll("table"), runs = tables[tables.length - 2];
  var headers = Array.prototype.map.call(runs.tHead.rows[0].cells, function (h) { return h; });
  var column = headers.findIndex(function (h) { return h.textContent === "tokens/s"; });
  function cells() {
    return Array.prototype.map.call(runs.tBodies[0].rows, function (r) {
      return r.cells[column].textContent;
    });
  }
  headers[column].click();
  out.ascending = cells();
  headers[column].click();
  out.descending = cells();
  var pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def chromium() -> str:
    """The chromium binary (`make test` installs the Debian package); the test is skipped only
    when there is none, and never silently in CI (see conftest)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("chromium is not installed (make test installs it: apt-get install chromium)")


@pytest.fixture(scope="session")
def browser() -> Iterator[str]:
    yield chromium()


@pytest.mark.slow
def test_html_report_in_headless_chromium(
    quickstart_results: Path, quickstart_report: Path, browser: str, tmp_path: Path
) -> None:
    page = (quickstart_report / "report.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "needs the network"
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("<head>", "<head>" + PROBE, 1))
    done = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=10000",
            "--enable-logging=stderr",
            "--dump-dom",
            probed.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = re.search(r'<pre id="probe">(.*?)</pre>', done.stdout, re.S)
    assert found, f"the page did not load:\n{done.stderr[-3000:]}"
    probe = json.loads(html.unescape(found.group(1)))
    assert probe["errors"] == []
    assert "Uncaught" not in done.stderr
    assert len(probe["images"]) == len(FIGURES)
    assert all(image["complete"] and image["width"] > 0 for image in probe["images"]), probe
    best = summaries.best_per_world_size(load_results(quickstart_results), None)
    for _, row in best.iterrows():
        assert f"(run {row['run_id']}" in probe["text"]
        # each tied run named in the page, by its settings and id
        assert all(f"({run_id})" in probe["text"] for run_id in row["tied"].split(", ") if run_id)
    headlines = re.findall(r'<p class="headline">(.*?)</p>', page, re.S)
    sizes = [line for line in headlines if line.startswith("Best at world size")]
    assert len(sizes) == 2, "one line per world size (DDP's followed by the fastest FSDP2)"
    assert all(html.unescape(line) in probe["text"] for line in headlines)
    for order in ("ascending", "descending"):
        tokens = [float(t.replace(",", "")) for t in probe[order]]
        assert len(tokens) == 31
        assert tokens == sorted(tokens, reverse=order == "descending"), f"not {order}"


def test_a_configuration_measured_again_is_one_row_the_most_measured(tmp_path: Path) -> None:
    store = ResultStore(tmp_path / "again")
    trial = RunConfig(world_size=2)
    again = RunConfig(world_size=2, measure=MeasureConfig(rounds=3))
    other = RunConfig(world_size=2, fsdp=FsdpConfig(grouping="root"))
    for run, steps in ((trial, 15), (again, 45), (other, 15)):
        store.record(RunResult(run_id=run.run_id, status="ok", config=to_plain(run),
                               tokens_per_s=100.0 + steps, step_times_s=[0.1] * steps))  # fmt: skip
    df = load(store.root)
    assert sorted(df["run_id"]) == sorted([again.run_id, other.run_id])
    assert df.attrs["measured_again"] == 1
    failed = RunConfig(world_size=2, measure=MeasureConfig(rounds=2))
    store.record(RunResult(run_id=failed.run_id, status="error", config=to_plain(failed)))
    assert again.run_id in set(load(store.root)["run_id"])  # an ok record before a failed one


def test_the_verdict_names_the_fastest_fsdp2_configuration_beside_the_ddp_baseline() -> None:
    """The quickstart's bold best was DDP and its launch line the baseline's; and when most
    runs tie, the verdict says there is no clear winner instead of naming one."""
    records = pd.DataFrame({
        "run_id": ["d", "f1", "f2", "f3"], "status": "ok",
        "strategy": ["ddp", "fsdp", "fsdp", "fsdp"], "tokens_per_s": [1000.0, 900, 800, 700],
    })  # fmt: skip
    clear = records.assign(tie=["best", "", "", ""])
    assert ties.verdict(clear, records) == (
        ["fastest: the DDP baseline (run d); the fastest FSDP2 configuration: run f1, 10% slower"],
        "f1",
    )
    tied = records.assign(tie=["best", "tied", "tied", ""])
    lines, chosen = ties.verdict(tied, records)
    assert chosen == "f1" and lines[0].endswith("run f1, tied with it")
    assert lines[1].startswith("no clear winner: 3 of 4 runs cannot be told apart")
    fsdp_first = records.iloc[1:].assign(tie=["best", "", ""])
    assert ties.verdict(fsdp_first, records) == ([], "f1")
    assert ties.verdict(records.assign(status="oom", tie=""), records) == ([], None)


def test_an_effect_without_matched_pairs_says_why_it_is_empty() -> None:
    effects = pd.DataFrame({
        "axis": ["prefetch", "prefetch"], "baseline": ["implicit", "implicit"],
        "value": [1, 2], "pairs": [2, 0], "tokens_per_s_ratio": [1.1, math.nan],
        "peak_memory_ratio": [1.0, math.nan],
    })  # fmt: skip
    table = tables.effects_table(effects)
    assert table["note"].tolist() == [
        "",
        "the grid never ran 2 with everything else at a run of implicit: no effect claimed",
    ]
    assert "note" not in tables.effects_table(effects.iloc[:1])
