"""Failures are data: an OOM, an exception, a dead or hung rank become classified records and
the sweep goes on (a driver killed mid-sweep: tests/test_contention.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import sweep, tiny_grid

pytestmark = pytest.mark.slow


def test_injected_failures_are_classified_and_the_sweep_goes_on(tmp_path: Path) -> None:
    # Each fault ends its job; the clean run queued after them must still run.
    grid = tiny_grid(
        "faults",
        [{"fault.kind": ["oom", "error", "exit", "hang"], "fault.rank": [1]}, {"data.seed": [7]}],
    )
    grid["launcher"]["collective_timeout_s"] = 5
    outcome, df = sweep(tmp_path, grid)
    by_fault = df.set_index("fault")
    assert outcome.recorded == 5
    assert by_fault.loc["oom", "status"] == "oom"
    assert "rank 1" in by_fault.loc["oom", "reason"]
    assert "can't allocate memory" in by_fault.loc["oom", "reason"]
    assert by_fault.loc["error", "status"] == "error"
    assert "injected fault on rank 1" in by_fault.loc["error", "reason"]
    assert by_fault.loc["exit", "status"] == "error"
    assert "ended without a report" in by_fault.loc["exit", "reason"]
    assert by_fault.loc["hang", "status"] == "timeout"
    assert "Timed out" in by_fault.loc["hang", "reason"]
    assert by_fault.loc["none", "status"] == "ok"  # the run after the failures
    assert not list((tmp_path / "results" / "inflight").iterdir())
