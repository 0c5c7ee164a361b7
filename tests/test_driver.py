"""The driver's pure decisions: how runs are packed into jobs, and what a failed run was."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_bench.config.launcher import LauncherConfig
from fsdp_bench.config.run import DataConfig, RunConfig
from fsdp_bench.launch.ledger import Ledger
from fsdp_bench.launch.local import interruptible_children
from fsdp_bench.launch.packing import pack_runs
from fsdp_bench.launch.verdicts import Verdict, classify_failure, explain_from_logs
from tests.conftest import tiny_grid, write_grid


def note(rank: int, klass: str, message: str = "boom") -> dict[str, object]:
    return {"rank": rank, "class": klass, "hostname": f"n{rank + 1}", "message": message}


def test_root_cause_wins_over_its_echoes() -> None:
    notes = [note(0, "timeout", "Timed out"), note(1, "oom", "CUDA out of memory"), note(2, "peer")]
    assert classify_failure(notes, "", "FAILED") == Verdict(
        "oom", "rank 1 (n2): CUDA out of memory"
    )
    assert classify_failure([note(0, "peer"), note(1, "error")], "", "FAILED")[0] == "error"
    assert classify_failure([note(0, "timeout")], "", "ENDED")[0] == "timeout"


@pytest.mark.parametrize(
    ("state", "status"),
    [
        ("TIMEOUT", "timeout"),
        ("CANCELLED", "cancelled"),
        ("OUT_OF_MEMORY", "oom"),
        ("NODE_FAIL", "node_fail"),
        ("PREEMPTED", "preempted"),
    ],
)
def test_scheduler_verdicts_explain_interrupted_ranks(state: str, status: str) -> None:
    echoes = [note(0, "interrupted"), note(1, "peer")]
    assert classify_failure(echoes, "", state)[0] == status


def test_a_job_the_driver_stopped_keeps_its_ranks_reason() -> None:
    notes = [note(0, "timeout", "Timed out waiting"), note(1, "interrupted")]
    assert classify_failure(notes, "ranks were stuck", "CANCELLED") == Verdict(
        "timeout", "rank 0 (n1): Timed out waiting"
    )
    assert classify_failure(
        [], "run exceeded launcher.run_timeout_s (60 s)", "CANCELLED"
    ) == Verdict("timeout", "run exceeded launcher.run_timeout_s (60 s)")


def test_silent_death_is_an_error_that_says_so() -> None:
    verdict = classify_failure([note(0, "peer")], "", "FAILED")
    assert verdict.status == "error" and verdict.unexplained
    assert "without a report (rank 0: peer; job state FAILED)" in verdict.reason
    assert not classify_failure([note(0, "oom")], "", "FAILED").unexplained


def test_a_silent_death_is_read_from_the_logs() -> None:
    silent = classify_failure([], "", "FAILED")
    nccl = (
        "[rank1]:[E1201 09:12:01.123 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=12, OpType=_ALLGATHER_BASE, NumelIn=4096"
        ", NumelOut=8192, Timeout(ms)=30000) ran for 30012 milliseconds before timing out."
    )
    verdict = explain_from_logs(silent, ["starting", f"step 3\n{nccl}\nAborted"])
    assert verdict.status == "timeout" and not verdict.unexplained
    assert (
        verdict.reason.startswith("rank 1 (from its log): [rank1]")
        and "_ALLGATHER_BASE" in verdict.reason
    )
    assert "rank 0 log tail:\nstarting" in verdict.reason
    quiet = explain_from_logs(silent, ["nothing", "to see"])
    assert quiet.status == "error" and "rank 1 log tail:\nto see" in quiet.reason


def test_runs_are_packed_by_shape_and_spread_over_the_slots() -> None:
    runs = [RunConfig(world_size=w, data=DataConfig(seed=s)) for w in (1, 2) for s in range(5)]
    local = pack_runs(runs, LauncherConfig())
    assert [len(p) for p in local] == [5, 5]
    assert all(len({r.world_size for r in p}) == 1 for p in local)
    slurm = pack_runs(runs, LauncherConfig(kind="slurm", max_jobs_in_flight=2))
    assert [len(p) for p in slurm] == [3, 2, 3, 2]
    one_each = pack_runs(runs, LauncherConfig(kind="slurm", max_runs_per_job=1))
    assert len(one_each) == 10
    ddp = [RunConfig(strategy="ddp", data=DataConfig(seed=s)) for s in range(2)]
    assert [len(p) for p in pack_runs([*runs[:5], *ddp], LauncherConfig(device="cpu"))] == [7]
    on_gpus = pack_runs([*runs[:5], *ddp], LauncherConfig(device="cuda"))
    assert [[r.strategy for r in p] for p in on_gpus] == [["ddp"], ["ddp"], ["fsdp"] * 5]


def test_ledger_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "ledger.json"
    ledger = Ledger(path)
    ledger.add("slurm", [("12_0", ["a", "b"]), ("12_1", ["c"])])
    ledger.close("12_0")
    again = Ledger(path)
    assert [e["job_id"] for e in again.open_jobs("slurm")] == ["12_1"]
    assert again.open_jobs("local") == []


def test_local_jobs_can_be_cancelled_when_the_driver_ignores_sigint() -> None:
    """Started with nohup or `&` from a script, the driver ignores SIGINT and so would the job
    controllers it starts: cancelling a local job (SIGINT) would do nothing."""
    code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    probe = [sys.executable, "-c", code]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ignored = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
        with interruptible_children():
            started = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # the driver's own, restored
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ignored.strip() == "False"  # inherited: ignored
    assert started.strip() == "True"  # Python's own handler: SIGINT interrupts


@pytest.mark.slow
def test_ctrl_c_in_a_sweep_says_one_line_and_exits_130(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches the driver, its estimate workers and the local job's
    controller (one process group): the driver's one line, exit 130, no traceback. Before,
    four tracebacks (about 50 lines) came first, from the workers and the controller."""
    grid = tiny_grid("ctrl-c", {"data.seed": [0, 1, 2, 3]}, world_size=1,
                     measure={"warmup_steps": 1, "timed_steps": 20, "repeats": 3})  # fmt: skip
    path = write_grid(tmp_path, grid)
    results = tmp_path / "results"
    driver = subprocess.Popen(
        [sys.executable, "-m", "fsdp_bench", "sweep", str(path), "--results", str(results)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not list((results / "runs").glob("*.json")) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(driver.pid, signal.SIGINT)  # what a terminal does: the whole foreground group
    _, stderr = driver.communicate(timeout=120)
    assert driver.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    # "interrupted; every ..." or, with a run in flight, "interrupted (run X: ...); every ..."
    assert re.search(r"interrupted( \(run \w+: .*\))?; every finished run is recorded", stderr)
    assert list((results / "runs").glob("*.json"))


def test_a_search_on_a_slurm_grid_without_slurm_says_one_line_and_writes_nothing(
    tmp_path: Path,
) -> None:
    grid = tiny_grid("off-cluster", {"fsdp.grouping": ["root", "block"]})
    grid["launcher"] = {"kind": "slurm"}
    grid["search"] = {"trials": 2}
    path = write_grid(tmp_path, grid)
    no_slurm = tmp_path / "bin"
    no_slurm.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_bench", "search", str(path), "--results",
         str(tmp_path / "results")], capture_output=True, text=True,
        env={**os.environ, "PATH": str(no_slurm)}, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip().splitlines() == [
        "fsdp-bench: error: launcher.kind slurm: cannot run sbatch ([Errno 2] No such file or "
        "directory: 'sbatch')"
    ]
    assert not (tmp_path / "results" / "study.journal").exists()
