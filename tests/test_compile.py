"""`train.compile`: torch.compile (inductor) per block or of the whole model, under FSDP2 and
DDP, on real gloo jobs; the compilation is recorded apart, and a compiler that cannot work
becomes an error record naming it while the sweep goes on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import sweep, tiny_grid

pytestmark = pytest.mark.slow


def test_compiled_runs_match_eager_and_are_measured_and_estimated(tmp_path: Path) -> None:
    axes = [
        {"train.compile": ["none", "block", "model"]},
        {"train.compile": ["block", "model"], "fsdp.activation_checkpointing": ["block"]},
        {"train.compile": ["block"], "strategy": ["ddp"]},
    ]
    outcome, df = sweep(tmp_path, tiny_grid("compile", axes), verify=True)
    assert outcome.statuses == {"ok": 6}, df[["run_id", "status", "reason"]]
    assert df.parity_ok.all(), df[["compile", "parity_grad_max_abs_diff"]]
    eager, compiled = df[df.compile == "none"], df[df.compile != "none"]
    assert eager.compile_s.isna().all()
    # Every compiled run paid its own compilation (dynamo's caches cleared between runs of
    # the job): far more than a step of the tiny model.
    assert (compiled.compile_s > compiled.step_time_s).all(), compiled[["compile", "compile_s"]]
    # FSDP2's hooks run eagerly between the compiled graphs: the collectives stay eager's.
    fsdp = df[(df.strategy == "fsdp") & (df.activation_checkpointing == "none")]
    for column in ("all_gathers_per_step", "reduce_scatters_per_step"):
        assert fsdp[column].nunique() == 1, fsdp[["compile", column]]
    # Memory: a compiled run's peak is taken at the CPU allocator (inductor's buffers are no
    # tensors the tracker sees, which alone reads less), and the estimate, which runs the
    # partitioned graphs on fake tensors, is within 10% of it, with and without checkpointing.
    df["error"] = df.estimated_peak_gib / df.peak_memory_gib - 1
    shown = df[["compile", "strategy", "activation_checkpointing", "peak_memory_source", "error"]]
    assert (compiled.peak_memory_source == "cpu_allocator").all(), shown
    assert (eager.peak_memory_source == "tracked_tensors").all(), shown
    assert (compiled.tracked_peak_gib < compiled.peak_memory_gib).all(), shown
    assert (df.error.abs() <= 0.10).all(), shown


def test_a_compiler_that_fails_is_an_error_record_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")  # inductor's CPU backend needs a C++ compiler
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # nothing cached
    grid = tiny_grid("no-compiler", [{"train.compile": ["block", "none"]}], world_size=1)
    outcome, df = sweep(tmp_path, grid)
    assert outcome.statuses == {"ok": 1, "error": 1}
    by_mode = df.set_index("compile")
    assert by_mode.loc["none", "status"] == "ok"
    assert by_mode.loc["block", "status"] == "error"
    reason = by_mode.loc["block", "reason"]
    assert "torch.compile failed" in reason and "/nonexistent/g++" in reason, reason
