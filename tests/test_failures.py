"""Failures are data: an OOM, an exception, a dead or hung rank become classified records, the
sweep goes on, and a driver killed mid-sweep resumes without running anything twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_bench import load_results
from tests.conftest import REPO, started_counts, sweep, tiny_grid, write_grid

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


def test_killed_driver_resumes_without_repeating_runs(tmp_path: Path) -> None:
    grid = tiny_grid("resume", {"data.seed": list(range(8))})
    grid["base"]["measure"] = {"warmup_steps": 2, "timed_steps": 4, "repeats": 2}
    path = write_grid(tmp_path, grid)
    results = tmp_path / "results"
    command = [
        sys.executable,
        "-m",
        "fsdp_bench",
        "sweep",
        str(path),
        "--results",
        str(results),
        "--no-progress",
    ]
    driver = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while len(list((results / "runs").glob("*.json"))) < 2:
        assert time.monotonic() < deadline and driver.poll() is None
        time.sleep(0.1)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    recorded_at_kill = len(list((results / "runs").glob("*.json")))
    assert recorded_at_kill < 8, "the kill came too late to test anything"

    resumed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    df = load_results(results)
    assert sorted(df.run_id) == sorted(set(df.run_id)) and len(df) == 8
    assert set(df.status) == {"ok"}
    assert set(started_counts(results).values()) == {1}, "a run was started twice"
