"""Runs that share a job do not contaminate each other: a run measures the same memory and
collectives alone in a fresh job as after other runs in the same job."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import sweep, tiny_grid

pytestmark = pytest.mark.slow

MEASURED = [
    "tracked_peak_gib",
    "memory_breakdown_gib",
    "all_gathers_per_step",
    "all_gather_bytes_per_step",
    "reduce_scatters_per_step",
    "reduce_scatter_bytes_per_step",
    "all_gathers_before_compute",
    "largest_group_bytes",
]


def test_same_measurements_alone_and_after_other_runs(tmp_path: Path) -> None:
    target = {"fsdp.grouping": ["block"], "train.accumulation_steps": [2]}
    crowded = tiny_grid(
        "crowded",
        [
            # heavier runs first: root keeps the whole model, linear makes many groups,
            # DDP and bf16 use other code paths, then the target.
            {"fsdp.grouping": ["root", "linear"], "fsdp.reshard_after_forward": [False]},
            {"strategy": ["ddp"], "fsdp.mixed_precision": ["bf16"]},
            {"fsdp.grouping": ["blocks:2"], "fsdp.activation_checkpointing": ["block"]},
            target,
        ],
    )
    alone = tiny_grid("alone", [target])
    crowded_outcome, crowded_df = sweep(tmp_path, crowded, results=tmp_path / "crowded")
    alone_outcome, alone_df = sweep(tmp_path, alone, results=tmp_path / "alone")
    assert crowded_outcome.statuses == {"ok": 5} and alone_outcome.statuses == {"ok": 1}
    assert crowded_df.job_id.nunique() == 1, "all five runs shared one job"

    after_others = crowded_df.set_index("run_id").loc[alone_df.run_id[0]]
    by_itself = alone_df.iloc[0]
    for column in MEASURED:
        assert after_others[column] == by_itself[column], column
