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


@pytest.mark.slow
def test_an_interrupt_that_reaches_only_the_ranks_is_measured_again(tmp_path: Path) -> None:
    """A Ctrl-C the terminal gave the ranks but not the driver: before, the run was recorded
    `error` for good, the sweep exited 0 and a rerun skipped it. Now the command ends as
    interrupted (130) with nothing recorded, and the same command starts the run again."""
    import subprocess
    import sys

    from tests.conftest import REPO, started_counts, write_grid

    grid = tiny_grid("interrupted", {"fault.kind": ["interrupt"]}, world_size=1)
    command = [sys.executable, "-m", "fsdp_bench", "sweep", str(write_grid(tmp_path, grid)),
               "--results", str(tmp_path / "r")]  # fmt: skip
    for attempt in (1, 2):
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 130, done.stderr
        assert "interrupted (run " in done.stderr and "a signal interrupted rank 0" in done.stderr
        assert not list((tmp_path / "r" / "runs").glob("*.json"))
        assert list(started_counts(tmp_path / "r").values()) == [attempt]


def test_an_oom_on_one_rank_frees_its_job_without_waiting_for_the_collective_timeout(
    tmp_path: Path,
) -> None:
    """Rank 1 dies of OOM at its run's start while rank 0 waits in a collective for it: the
    job ends on rank 1's failure note, not after `collective_timeout_s` (600 s here), and the
    run queued after it is measured. (A bound against the timeout, not a speed target.)"""
    import time

    grid = tiny_grid("oom-frees", [{"fault.kind": ["oom"], "fault.rank": [1]}, {"data.seed": [7]}])
    grid["launcher"]["collective_timeout_s"] = 600
    started = time.monotonic()
    outcome, df = sweep(tmp_path, grid)
    took_s = time.monotonic() - started
    by_fault = df.set_index("fault")
    assert outcome.recorded == 2 and by_fault.loc["oom", "status"] == "oom"
    assert by_fault.loc["none", "status"] == "ok"
    assert took_s < 600 / 2, f"{took_s:.0f} s: the OOM's job waited for the collective timeout"


def _raised_in(filename: str) -> AssertionError:
    """A plain AssertionError as if raised by code in `filename`."""
    try:
        exec(compile("assert False, 'saved a DeviceMesh'", filename, "exec"))
    except AssertionError as err:
        return err
    raise RuntimeError("not raised")


def test_an_error_raised_inside_torch_compile_is_named_so() -> None:
    """AOTAutograd refusing what a compiled checkpoint of DTensor code saves (compile, tensor
    parallelism and full checkpointing on torch 2.13) raises a plain AssertionError: where it
    was raised names torch.compile, not the error's type."""
    from fsdp_bench.job.failures import compiler_named

    site = "/venv/lib/python3.11/site-packages/torch"
    assert compiler_named(_raised_in(f"{site}/_functorch/_aot_autograd/x.py")).startswith(
        "torch.compile failed"
    )
    assert compiler_named(_raised_in(f"{site}/_inductor/x.py")) == "torch.compile failed: "
    assert compiler_named(_raised_in(f"{site}/nn/modules/linear.py")) == ""
    assert compiler_named(_raised_in("/home/user/model.py")) == ""
