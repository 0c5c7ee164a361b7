"""`fsdp-bench sweep` on a real two-node Slurm cluster (slurm/testbed, started by the tests):
multi-node rendezvous, job arrays, the in-flight limit, scancel, time limits, OOM, requeue,
and a killed driver. (Launcher settings checked without a cluster: tests/test_launch_config.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fsdp_bench import load_results
from fsdp_bench.config.grid import load_grid
from fsdp_bench.config.run import RunConfig
from tests.conftest import QUICK_MEASURE, REPO, started_counts, sweep, write_grid

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

PROFILE = str(REPO / "slurm" / "clusters" / "testbed.yaml")


def slurm_grid(name: str, axes: Any, launcher: dict[str, Any] | None = None, **base: Any) -> dict:
    merged: dict[str, Any] = {"world_size": 2, "model": {"name": "tiny"}, "measure": QUICK_MEASURE}
    merged.update(base)
    return {
        "name": name,
        "base": merged,
        "axes": axes,
        "launcher": {"cluster": PROFILE, "collective_timeout_s": 30, **(launcher or {})},
    }


class Background(threading.Thread):
    """Calls `target(*args)` in a daemon thread and keeps what it returned or raised, so that
    `finish` fails the test when the call raised or did not end in time (a plain thread's
    exception is printed and lost, and `join(timeout)` says nothing when it times out)."""

    def __init__(self, target: Callable[..., Any], *args: Any) -> None:
        super().__init__(daemon=True, name=f"background {getattr(target, '__name__', target)}")
        self._call = target
        self._call_args = args
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._call(*self._call_args)
        except BaseException as err:  # kept for finish(), in the test's thread
            self.error = err

    def finish(self, timeout_s: float) -> Any:
        """Wait for the call to end; its result, or what it raised re-raised here."""
        self.join(timeout_s)
        if self.is_alive():
            raise AssertionError(f"{self.name} still running after {timeout_s:g} s")
        if self.error is not None:
            raise AssertionError(f"{self.name} raised {self.error!r}") from self.error
        return self.result


class QueueWatcher(Background):
    """Samples squeue while a sweep runs: the most jobs of ours of world size 2 queued or
    running at once (the time-limit sweep's job of world size 1 is alive meanwhile)."""

    def __init__(self) -> None:
        super().__init__(self._watch)
        self.name = "squeue watcher"
        self.most = 0
        self.samples = 0
        self._done = threading.Event()

    def _watch(self) -> None:
        while not self._done.is_set():
            self.most = max(self.most, len(_alive_jobs("fsdp-bench-w2")))
            self.samples += 1
            time.sleep(0.2)

    def stop(self) -> None:
        self._done.set()
        self.finish(timeout_s=30)


def _alive_jobs(name: str) -> list[str]:
    """Ids of this user's queued or running jobs (array tasks one by one) called `name`."""
    command = ["squeue", "--me", "--noheader", "--array", "--name", name, "--format=%i"]
    output = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
    return output.stdout.split()


def ledger(results: Path) -> list[dict[str, Any]]:
    return json.loads((results / "jobs" / "ledger.json").read_text())


def wait_for(condition: Any, timeout_s: float, what: str, thread: Background | None = None) -> Any:
    """Poll `condition` until it is true; fail at once if `thread` ends first (with what it
    raised, if it raised)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if thread is not None and not thread.is_alive():
            thread.finish(0)  # re-raises what the thread raised
            raise AssertionError(f"{thread.name} ended before {what}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_two_node_run_matches_local_columns_and_parity(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    _, slurm_df = sweep(
        tmp_path, slurm_grid("twonode", {"fsdp.grouping": ["block"]}), verify=True,
        results=tmp_path / "slurm",
    )  # fmt: skip
    row = slurm_df.iloc[0]
    assert row.status == "ok", row.reason
    assert sorted(row.hostnames) == ["n1", "n2"]
    assert row.nodes == 2 and row.processes_per_node == 1 and row.backend == "gloo"
    assert row.parity_ok
    assert row.all_gathers_per_step == 9 and row.reduce_scatters_per_step == 5

    local = {"name": "local", "base": {"world_size": 2, "measure": QUICK_MEASURE}}
    _, local_df = sweep(tmp_path, local, results=tmp_path / "local")
    metrics = [c for c in local_df.columns if local_df[c].notna().all()]
    assert set(metrics) <= set(slurm_df.columns[slurm_df.notna().all()])


def test_fsdp_bench_run_under_srun_spans_both_nodes(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    grid = {
        "name": "srun",
        "base": {"world_size": 2, "processes_per_node": 1, "measure": QUICK_MEASURE},
        "axes": {"fsdp.grouping": ["block", "root"]},
        "launcher": {"collective_timeout_s": 30},
    }
    path, results = write_grid(tmp_path, grid), tmp_path / "r"
    srun = ["srun", "--partition", "debug", "--nodes", "2", "--ntasks-per-node", "1"]
    command = [
        *srun,
        sys.executable,
        "-m",
        "fsdp_bench",
        "run",
        str(path),
        "--results",
        str(results),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "2 runs at world size 2 on 2 node(s), started by srun" in done.stdout
    df = load_results(results)
    assert set(df.status) == {"ok"} and len(df) == 2
    assert all(sorted(h) == ["n1", "n2"] for h in df.hostnames)
    assert set(df.launcher) == {"srun"}


def test_arrays_keep_the_in_flight_limit_and_split_at_max_array_size(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    grid = slurm_grid(
        "array",
        {"data.seed": list(range(4))},
        launcher={"max_jobs_in_flight": 2, "max_runs_per_job": 1, "max_array_size": 2},
        measure={"warmup_steps": 1, "timed_steps": 3, "repeats": 1},
    )
    watcher = QueueWatcher()
    watcher.start()
    try:
        outcome, _ = sweep(tmp_path, grid)
    finally:
        watcher.stop()
    assert outcome.statuses == {"ok": 4}
    assert watcher.samples > 10 and 1 <= watcher.most <= 2
    job_ids = [e["job_id"] for e in ledger(tmp_path / "results")]
    tasks_per_array: dict[str, int] = {}
    for job_id in job_ids:
        array = job_id.split("_")[0]
        tasks_per_array[array] = tasks_per_array.get(array, 0) + 1
    assert len(job_ids) == 4 and any("_" in j for j in job_ids), f"no job arrays: {job_ids}"
    assert max(tasks_per_array.values()) == 2, tasks_per_array
    assert set(started_counts(tmp_path / "results").values()) == {1}


def test_scancel_is_recorded_cancelled_and_the_rest_finish(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    # three runs in one job; the second would take minutes
    grid = slurm_grid(
        "cancel",
        [{"data.seed": [0]}, {"measure.timed_steps": [5000]}, {"data.seed": [2]}],
        launcher={"max_jobs_in_flight": 1},
    )
    results = tmp_path / "results"
    victim = _runs(tmp_path, grid)[1].run_id
    thread = Background(sweep, tmp_path, grid)
    thread.start()
    started = results / "inflight" / victim / "started.json"
    wait_for(started.exists, 120, "run 2", thread)
    job_id = next(e["job_id"] for e in ledger(results) if victim in e["run_ids"])
    subprocess.run(["scancel", job_id], check=True)
    thread.finish(timeout_s=300)
    df = load_results(results).set_index("run_id")
    assert df.loc[victim, "status"] == "cancelled"
    assert "scancel" in df.loc[victim, "reason"]
    assert (df.drop(index=victim).status == "ok").all() and len(df) == 3


@pytest.fixture(scope="module", autouse=True)
def time_limit_sweep(
    slurm_cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Background:
    """A sweep whose one job hangs (asleep) until Slurm's shortest time limit, one minute,
    ends it 60-90 s later: started with the module's first test, so the tests before
    `test_slurm_time_limit_is_a_timeout` use that time. They start once its job is submitted,
    its estimate done (a process simulates one run at a time)."""
    grid = slurm_grid(
        "timelimit",
        {"fault.kind": ["hang"]},
        launcher={"timeout_min": 1, "collective_timeout_s": 600},
        world_size=1,
    )
    folder = tmp_path_factory.mktemp("timelimit")
    thread = Background(sweep, folder, grid)
    thread.start()
    submitted = folder / "results" / "jobs" / "ledger.json"
    wait_for(submitted.exists, 120, "the time-limit job's submission", thread)
    return thread


def test_slurm_time_limit_is_a_timeout(time_limit_sweep: Background) -> None:
    outcome, df = time_limit_sweep.finish(timeout_s=400)
    assert outcome.statuses == {"timeout": 1}
    assert "Slurm TIMEOUT" in df.iloc[0].reason
    assert df.iloc[0].job_state == "TIMEOUT"


def test_oom_is_recorded_once_and_not_retried(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    grid = slurm_grid("oom", {"fault.kind": ["oom"], "fault.rank": [1]})
    outcome, df = sweep(tmp_path, grid)
    assert outcome.statuses == {"oom": 1}
    assert "rank 1 (n2)" in df.iloc[0].reason
    assert list(started_counts(tmp_path / "results").values()) == [1]
    assert len(ledger(tmp_path / "results")) == 1


def test_requeued_job_completes_its_run_once(slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    grid = slurm_grid(
        "requeue",
        {"data.seed": [0]},
        measure={"warmup_steps": 1, "timed_steps": 60, "repeats": 1},
    )
    results = tmp_path / "results"
    run_id = _runs(tmp_path, grid)[0].run_id
    thread = Background(sweep, tmp_path, grid)
    thread.start()
    wait_for((results / "inflight" / run_id / "started.json").exists, 120, "start", thread)
    job_id = ledger(results)[0]["job_id"]
    subprocess.run(["scontrol", "requeue", job_id], check=True)  # what preemption does
    thread.finish(timeout_s=400)
    df = load_results(results)
    assert df.status.tolist() == ["ok"]
    assert df.iloc[0].attempt == 1, "the run finished in the requeued job"
    assert started_counts(results)[run_id] == 2  # started, interrupted, started again
    assert len(ledger(results)) == 1, "the driver did not submit it again"


def test_killed_driver_resumes_without_resubmitting(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    grid = slurm_grid(
        "resume",
        {"data.seed": list(range(4))},
        launcher={"max_jobs_in_flight": 2, "max_runs_per_job": 1},
        measure={"warmup_steps": 1, "timed_steps": 10, "repeats": 1},
    )
    path = write_grid(tmp_path, grid)
    results = tmp_path / "results"
    command = [sys.executable, "-m", "fsdp_bench", "sweep", str(path), "--results",
               str(results), "--no-progress"]  # fmt: skip
    env = {**os.environ, "SLURM_CONF": slurm_cluster["SLURM_CONF"]}
    driver = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    wait_for(lambda: len(list((results / "runs").glob("*.json"))) >= 2, 180, "2 records")
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()

    status = subprocess.run([*command, "--status"], cwd=REPO, env=env, capture_output=True,
                            text=True, check=True).stdout  # fmt: skip
    assert len(status.strip().splitlines()) == 1 + 4 + 1
    assert re.search(r"\d+ ok", status.splitlines()[-1])

    resumed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=400)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    df = load_results(results)
    assert len(df) == 4 and set(df.status) == {"ok"}
    assert set(started_counts(results).values()) == {1}, "no run ran twice"
    submitted = [run_id for entry in ledger(results) for run_id in entry["run_ids"]]
    assert sorted(submitted) == sorted(df.run_id), "no run was submitted twice"


def _runs(folder: Path, grid: dict[str, Any]) -> list[RunConfig]:
    from fsdp_bench.config.grid import expand

    return expand(load_grid(write_grid(folder, grid))).runs


def test_search_keeps_parallel_trials_in_flight(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    from fsdp_bench.search import SearchOptions, run_search

    grid = slurm_grid(
        "search",
        {
            "fsdp.grouping": ["root", "block", "blocks:2", "linear"],
            "fsdp.reshard_after_forward": ["default", True, False],
            "data.seed": [0, 1],
        },
        measure={"warmup_steps": 1, "timed_steps": 8, "repeats": 1},
    )
    grid["search"] = {
        "trials": 4,
        "parallel": 2,
        "sampler": "random",
        "seed": 4,
        "confirm_top_k": 0,
    }
    spec = load_grid(write_grid(tmp_path, grid))
    watcher = QueueWatcher()
    watcher.start()
    try:
        outcome = run_search(spec, SearchOptions(results_dir=tmp_path / "r", progress=False))
    finally:
        watcher.stop()
    assert outcome.counts["launched"] >= 3
    assert watcher.most == 2, "two trials in flight at once, never more"
    assert len(outcome.study.trials) == 4
    assert set(started_counts(tmp_path / "r").values()) == {1}
