"""benchmarks/gpu_check.py, the one command for a lent GPU, kept working on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def test_a_spent_time_budget_skips_the_parts_left_and_still_reports(tmp_path: Path) -> None:
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu",
               "--out", str(tmp_path), "--budget-s", "0",
               "--only", "environment", "models"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert list(parts) == ["environment", "models"]
    assert all(part["skipped"].startswith("the time budget (0 s)") for part in parts.values())
    assert "## models" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow
def test_the_gpu_check_runs_on_cpu_and_reports_every_part(tmp_path: Path) -> None:
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu",
               "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = report["parts"]
    assert not [name for name, part in parts.items() if "error" in part]
    assert {r["status"] for r in parts["models"]["runs"]} == {"ok"}
    assert all(abs(r["estimated_peak_gib_error_pct"]) < 5 for r in parts["models"]["runs"])
    assert [r["parity_ok"] for r in parts["parity"]["runs"]] == [True] * 5
    assert parts["failures"]["injected_oom_recorded_as"] == ["oom"]
    assert parts["failures"]["twins_same_peak"]
    assert parts["harness"]["returncode"] == 0 and parts["harness"]["ratio_of_medians"] > 0
    assert parts["harness"]["ranks_on"] == "cpu"
    assert parts["timer"]["skipped"] and parts["multi_gpu"]["skipped"]
    breakdown = parts["step_breakdown"]["runs"]
    assert {(r["world_size"], r["status"]) for r in breakdown} == {(1, "ok"), (2, "ok")}
    assert all(r["checkpoint_restore_ok"] and r["checkpoint_reshard_ok"] for r in breakdown)
    assert all(s == 0 for s in parts["step_breakdown"]["world_size_1_exposed_comm_s"])
    assert all(r["memory_peak_at"] for r in breakdown)
    assert set(parts["step_breakdown"]["rank0_trace_files"]) == {"rank0.json"}  # no CUDA snapshot
    compile_runs = parts["compile"]["runs"]
    assert [(r["compile"], r["status"], r["parity_ok"]) for r in compile_runs] == [
        ("none", "ok", True), ("block", "ok", True)]  # fmt: skip
    assert parts["compile"]["compiled_over_eager_tokens_per_s"] > 0
    under = parts["torchrun"]
    assert under["returncode"] == 0 and [(r["status"], r["launcher"]) for r in under["runs"]] == [
        ("ok", "torchrun")]  # fmt: skip
    text = (tmp_path / "gpu_check.md").read_text()
    assert all(f"## {name}" in text for name in parts)
