"""The results store: atomic one-file-per-run records, read back as a DataFrame."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp_bench import load_results
from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.config.schema import to_plain
from fsdp_bench.job.record import RankOutcome, RunContext, build_result
from fsdp_bench.job.rendezvous import RankInfo
from fsdp_bench.store import GIB, EstimatedPeaks, ResultStore, RunResult, write_atomic

CONTRACT = [
    "run_id",
    "status",
    "world_size",
    "grouping",
    "reshard_after_forward",
    "prefetch",
    "accumulation_steps",
    "tokens_per_s",
    "step_time_s",
    "peak_memory_gib",
    "all_gathers_per_step",
    "reduce_scatters_per_step",
    "all_gather_bytes_per_step",
    "largest_group_bytes",
]


def result(run: RunConfig, **fields: object) -> RunResult:
    return RunResult(run_id=run.run_id, config=to_plain(run), **fields)  # type: ignore[arg-type]


def test_records_round_trip_into_a_dataframe(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    ok_run = RunConfig(world_size=2, fsdp=FsdpConfig(grouping="linear", reshard_after_forward=2))
    bad_run = RunConfig(world_size=2)
    store.record(result(ok_run, status="ok", tokens_per_s=1234.5, step_times_s=[0.1, 0.2]))
    store.record(result(bad_run, status="oom", reason="rank 1: out of memory"))
    df = load_results(tmp_path)
    assert set(CONTRACT) <= set(df.columns)
    assert len(df) == 2 and set(df.status) == {"ok", "oom"}
    row = df.set_index("run_id").loc[ok_run.run_id]
    assert row.grouping == "linear" and row.reshard_after_forward == 2 and row.nodes == 1
    assert row.tokens_per_s == 1234.5 and row.step_times_s == [0.1, 0.2]
    assert store.done_ids() == {ok_run.run_id, bad_run.run_id}


def test_empty_folder_gives_the_contract_columns(tmp_path: Path) -> None:
    df = load_results(tmp_path)
    assert df.empty and set(CONTRACT) <= set(df.columns)
    with pytest.raises(FileNotFoundError):
        load_results(tmp_path / "missing")


def test_atomic_write_leaves_no_partial_file(tmp_path: Path) -> None:
    target = tmp_path / "runs" / "x.json"
    write_atomic(target, json.dumps({"a": 1}))

    with pytest.raises(TypeError):
        write_atomic(target, 5)  # type: ignore[arg-type]
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in target.parent.iterdir()] == ["x.json"]


def test_unknown_fields_from_newer_versions_are_ignored(tmp_path: Path) -> None:
    run = RunConfig()
    data = json.loads(result(run, status="ok").to_json())
    data["added_in_a_later_version"] = 1
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / f"{run.run_id}.json").write_text(json.dumps(data))
    assert load_results(tmp_path).run_id.tolist() == [run.run_id]


def test_a_record_takes_the_slowest_rank_per_repeat_and_the_largest_peak() -> None:
    counts = {
        "all_gathers": 9, "all_gather_bytes": 900, "reduce_scatters": 5,
        "reduce_scatter_bytes": 500, "all_reduces": 0, "all_reduce_bytes": 0, "other": 0,
        "all_gathers_before_compute": 2,
    }  # fmt: skip

    def outcome(
        times: list[float], peak_gib: float, parity: dict[str, object] | None
    ) -> RankOutcome:
        return RankOutcome(
            hostname="n1", step_times_s=times, tracked_peak_bytes=int(peak_gib * GIB),
            breakdown_bytes={"activation": int(peak_gib * GIB)}, counts=counts,
            largest_group_bytes=123, num_groups=5, num_params=1000,
            setup_s=1.0, warmup_s=0.5, parity=parity,
        )  # fmt: skip

    run = RunConfig(world_size=2)  # 2 ranks x 1 sequence x 128 tokens per step
    parity = {
        "ok": False, "grad_max_abs_diff": 1.0, "param_max_abs_diff": 2.0, "detail": "off",
        "scope": "as run",
    }  # fmt: skip
    ranks = [outcome([0.1, 0.4, 0.2], 1.0, parity), outcome([0.3, 0.2, 0.2], 2.0, None)]
    info = RankInfo(rank=0, local_rank=0, world_size=2, num_nodes=1, job_id="7", attempt=0)
    where = RunContext(torch.device("cpu"), info, "t0", 9.0, EstimatedPeaks(1.5, 3.0))
    record = build_result(run, ranks, where, {"device_name": "cpu"})

    assert record.step_times_s == [0.3, 0.4, 0.2]  # the slowest rank of each repeat
    assert record.step_time_s == 0.3 and record.tokens_per_s == pytest.approx(256 / 0.3)
    assert record.tokens_per_s_per_rank == pytest.approx(128 / 0.3)
    assert record.peak_memory_gib == pytest.approx(2.0)  # the largest rank's
    assert record.memory_breakdown_gib == {"activation": pytest.approx(2.0)}
    assert (record.estimated_peak_gib, record.analytic_peak_gib) == (1.5, 3.0)
    assert record.all_gathers_per_step == 9 and record.largest_group_bytes == 123
    assert record.parity_ok is False and record.reason == "off" and record.parity_scope == "as run"
    assert record.mfu is None and record.peak_reserved_gib is None and record.wall_s == 9.0
