"""A busy machine is data: each record says what else ran around its run (load average, other
processes' CPU, other processes on its GPUs) and is marked `contended` when something competed;
the local driver never computes beside a run an earlier driver left timing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

import fsdp_bench.sweep as sweep_module
from fsdp_bench import load_results
from fsdp_bench.config.grid import load_grid
from fsdp_bench.job.measure import load
from fsdp_bench.job.measure.load import LoadSample
from fsdp_bench.launch.local import LocalJob
from fsdp_bench.report.tables import format_ranking, ranking, shown
from fsdp_bench.sweep import SweepOptions, run_sweep
from tests.conftest import REPO, started_counts, sweep, tiny_grid, write_grid

STAT = "cpu  {user} 0 {system} {idle} 5 0 {softirq} {steal} 9 9\ncpu0 1 2 3 4 5 6 7 8 0 0\n"


def stat_text(user: int, system: int, idle: int, softirq: int = 0, steal: int = 0) -> str:
    return STAT.format(user=user, system=system, idle=idle, softirq=softirq, steal=steal)


def pid_stat(comm: str, utime: int, stime: int) -> str:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    return f"42 ({comm}) S 1 1 1 0 -1 0 0 0 0 0 {utime} {stime} 0 0 20 0 1 0\n"


def test_machine_ticks_count_busy_states_and_leave_guest_time_inside_user() -> None:
    busy, total = load.machine_ticks(stat_text(user=100, system=20, idle=300, softirq=3, steal=7))
    assert busy == 100 + 20 + 3 + 7  # user, nice 0, system, irq 0, softirq, steal
    assert total == 100 + 20 + 300 + 5 + 3 + 7  # iowait 5 idle-like; guest (9 9) not again
    with pytest.raises(ValueError):
        load.machine_ticks("intr 1 2 3\n")


def test_process_ticks_read_past_a_command_name_with_spaces_and_parentheses() -> None:
    assert load.process_ticks(pid_stat("python", 70, 30)) == 100
    assert load.process_ticks(pid_stat("pt_main (thread) x", 5, 6)) == 11


def test_other_cpu_is_the_machine_minus_the_run_as_a_share_of_all_cores() -> None:
    # 2 cores over 0.2 s at 100 Hz: 40 ticks; 30 busy, 10 of them the run's -> 50% others
    assert load.other_cpu_pct((1000, 5000, 100), (1030, 5040, 110)) == pytest.approx(50.0)
    # ticks are sampled, so the run may read above the machine: never below zero
    assert load.other_cpu_pct((0, 0, 0), (5, 40, 9)) == 0.0
    assert load.other_cpu_pct((0, 40, 0), (0, 40, 0)) is None


def test_reading_proc_skips_a_rank_that_ended(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text(stat_text(user=50, system=10, idle=40))
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_text(pid_stat("rank", 4, 1))
    assert load._read([7, 8], tmp_path) == (60, 105, 5)  # pid 8 has no folder: gone


def test_every_rank_sleeps_the_window_and_local_rank_zero_measures(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text(stat_text(user=50, system=10, idle=40))
    started = time.perf_counter()
    other = load.sample("end", 1, frozenset(), None, window_s=0.05, proc=tmp_path)
    assert time.perf_counter() - started >= 0.05
    assert other == LoadSample("end")  # no CPU figures from a rank that is not local rank 0
    first = load.sample("start", 0, frozenset({os.getpid()}), None, window_s=0.05)
    assert first.when == "start" and first.load_per_core is not None
    assert first.other_cpu_pct is not None and 0.0 <= first.other_cpu_pct <= 100.0


def test_the_verdict_is_the_other_cpu_or_a_gpu_process_never_the_load_average() -> None:
    quiet = LoadSample("start", load_per_core=5.0, other_cpu_pct=load.CONTENDED_CPU_PCT)
    assert load.verdict([quiet]) == (False, "")  # at the threshold, and load alone: quiet
    busy = LoadSample("end", load_per_core=0.1, other_cpu_pct=48.0)
    contended, why = load.verdict([quiet, busy])
    assert contended and "48%" in why and "CPU" in why
    on_gpu = LoadSample("start", gpu_other_processes=2)
    contended, why = load.verdict([on_gpu])
    assert contended and "2 other process" in why and "CPU" not in why
    assert load.verdict([]) == (False, "")


def test_record_fields_take_the_busiest_host_per_window() -> None:
    samples = [
        LoadSample("start", 0.5, 2.0, None),
        LoadSample("end", 0.7, 30.0, None),
        LoadSample("start", 1.5, 12.0, None),  # the second host
        LoadSample("end", None, None, None),  # a rank that is not local rank 0
    ]
    fields = load.record_fields(samples)
    assert fields == {
        "contended": True,
        "contention": fields["contention"],
        "load_per_core_start": 1.5,
        "load_per_core_end": 0.7,
        "other_cpu_start_pct": 12.0,
        "other_cpu_end_pct": 30.0,
        "other_cpu_run_pct": None,  # no readings to span the run
        "gpu_other_processes": None,
    }
    assert "30%" in fields["contention"]
    assert load.record_fields([]) == {}


def test_a_competitor_during_the_timed_steps_shows_over_the_run() -> None:
    # quiet windows; between them (2 cores, 10 s: 2,000 ticks) others took 600 busy ticks
    start = LoadSample("start", 0.5, 1.0, None, ticks=(1000, 5000, 400))
    end = LoadSample("end", 0.9, 2.0, None, ticks=(3000, 7000, 1800))
    assert load.over_run_pct([start, end]) == pytest.approx(30.0)
    contended, why = load.verdict([start, end])
    assert contended and "30%" in why
    assert load.record_fields([start, end])["other_cpu_run_pct"] == pytest.approx(30.0)
    # the first reading nearest the run is taken after its window, the last before
    first = load.sample("start", 0, frozenset({os.getpid()}), None, window_s=0.02)
    time.sleep(0.05)  # the run
    last = load.sample("end", 0, frozenset({os.getpid()}), None, window_s=0.02)
    assert first.ticks is not None and last.ticks is not None
    assert load.over_run_pct([first, last]) is not None


NODE_GPUS = ["GPU-0a0a0a0a-0000-0000-0000-000000000000", "GPU-1b1b1b1b-1111-1111-1111-111111111111",
             "GPU-2c2c2c2c-2222-2222-2222-222222222222"]  # fmt: skip
"""NVML's view of a node: every GPU, in NVML's order."""


def fake_nvml(
    monkeypatch: pytest.MonkeyPatch, pids: dict[int, list[int]], fail: bool = False
) -> None:
    """NVML on a node of three GPUs; `pids` maps an NVML index to the processes on it."""

    def processes(handle: int) -> list[Any]:
        if fail:
            raise RuntimeError("NVML_ERROR_UNINITIALIZED")
        return [types.SimpleNamespace(pid=p) for p in pids.get(handle, [])]

    module = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: len(NODE_GPUS),
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetUUID=lambda handle: NODE_GPUS[handle].encode(),  # bytes, as older pynvml
        nvmlDeviceGetComputeRunningProcesses=processes,
        nvmlDeviceGetGraphicsRunningProcesses=lambda handle: [],
    )
    monkeypatch.setitem(sys.modules, "pynvml", module)


def test_gpu_processes_other_than_the_runs_by_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank's GPU found by UUID: on a Slurm node that gave this job NVML's GPU 2
    (CUDA_VISIBLE_DEVICES=2, so torch calls it cuda:0, torch's UUID without the GPU- prefix),
    another job's process on NVML's GPU 0 is not this run's competition."""
    ours = frozenset({10, 11})
    mine = "2C2C2C2C-2222-2222-2222-222222222222"
    fake_nvml(monkeypatch, {0: [777], 2: [10, 99]})
    assert load.gpu_processes(mine, ours) == 1
    assert load.nvml_handle(sys.modules["pynvml"], mine) == 2
    assert load.gpu_processes(None, ours) is None  # CPU runs
    assert load.gpu_processes("GPU-ffffffff-0000-0000-0000-000000000000", ours) is None
    fake_nvml(monkeypatch, {0: [777], 2: [10]})
    assert load.gpu_processes(mine, ours) == 0
    fake_nvml(monkeypatch, {2: [5001, 5002]})  # a container: NVML's pids are the host's
    assert load.gpu_processes(mine, ours) == 1  # one of them is this rank
    fake_nvml(monkeypatch, {}, fail=True)
    assert load.gpu_processes(mine, ours) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import fails
    assert load.gpu_processes(mine, ours) is None


def test_the_ranking_marks_contended_runs_only_when_there_are_some() -> None:
    df = pd.DataFrame(
        {
            "run_id": ["a", "b", "c"],
            "status": ["ok", "ok", "error"],
            "tokens_per_s": [9000.0, 3000.0, None],
            "contended": [False, True, None],
        }
    )
    table = ranking(df)
    assert list(table.columns).index("contended") == list(table.columns).index("tie") + 1
    assert shown(table)["contended"].tolist() == ["no", "yes", "-"]
    assert format_ranking(table).splitlines()[0].split()[3] == "contended"
    assert "contended" not in ranking(df.assign(contended=[False, False, None])).columns


BURNER = "while True:\n    pass\n"


def one_run_grid(name: str) -> dict[str, Any]:
    grid = tiny_grid(name, {"data.seed": [0]}, world_size=1)
    grid["base"]["measure"] = {"warmup_steps": 1, "timed_steps": 3, "repeats": 1}
    return grid


def other_cpu(df: pd.DataFrame) -> tuple[float, float]:
    row = df.iloc[0]
    return float(row["other_cpu_start_pct"]), float(row["other_cpu_end_pct"])


@pytest.mark.slow
def test_a_cpu_burner_beside_a_real_run_marks_it_contended(tmp_path: Path) -> None:
    _, quiet = sweep(tmp_path, one_run_grid("quiet"), results=tmp_path / "quiet")
    burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)  # running on every core before the run starts
        _, busy = sweep(tmp_path, one_run_grid("busy"), results=tmp_path / "busy")
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert quiet["status"].tolist() == busy["status"].tolist() == ["ok"]
    record = busy.iloc[0]
    assert record["contended"] is True or record["contended"] == 1
    assert "processes outside the run used" in record["contention"]
    assert min(other_cpu(busy)) > load.CONTENDED_CPU_PCT
    # This machine may be shared, so the quiet run is not asserted quiet: only quieter.
    assert max(other_cpu(quiet)) < min(other_cpu(busy))
    assert quiet.iloc[0]["load_per_core_start"] is not None


@pytest.mark.slow
def test_rerun_contended_measures_only_the_contended_runs_again(tmp_path: Path) -> None:
    grid = tiny_grid("again", {"data.seed": [0, 1]}, world_size=1)
    results = tmp_path / "results"
    _, df = sweep(tmp_path, grid, results=results)
    marked, quiet = (str(run_id) for run_id in df["run_id"])
    for run_id, flag in ((marked, True), (quiet, False)):  # whatever this machine was doing
        path = results / "runs" / f"{run_id}.json"
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "contended": flag, "contention": "test" * flag}))
    spec = load_grid(write_grid(tmp_path, grid))
    options = SweepOptions(results_dir=results, rerun_contended=True, progress=False)
    outcome = run_sweep(spec, options)
    assert outcome.recorded == 1
    counts = started_counts(results)
    assert counts == {marked: 2, quiet: 1}
    assert len(list((results / "replaced").glob(f"{marked}.*.json"))) == 1
    assert load_results(results).set_index("run_id").loc[marked, "contention"] != "test"


def open_jobs_alive(results: Path) -> list[str]:
    """Jobs of the results folder's ledger whose submitit controller is still running."""
    folder = (results / "jobs" / "submitit").absolute()
    entries = json.loads((results / "jobs" / "ledger.json").read_text())
    return [e["job_id"] for e in entries if LocalJob(job_id=e["job_id"], folder=folder).alive()]


@pytest.mark.slow
def test_a_rerun_waits_for_the_job_a_killed_driver_left_before_computing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    grid = tiny_grid("orphan", {"data.seed": list(range(6))})
    grid["base"]["measure"] = {"warmup_steps": 2, "timed_steps": 4, "repeats": 2}
    path = write_grid(tmp_path, grid)
    results = tmp_path / "results"
    command = [sys.executable, "-m", "fsdp_bench", "sweep", str(path), "--results",
               str(results), "--no-progress"]  # fmt: skip
    driver = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list((results / "runs").glob("*.json")):
        assert time.monotonic() < deadline and driver.poll() is None
        time.sleep(0.05)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    assert open_jobs_alive(results), "the orphaned job ended before the rerun: nothing tested"

    alive_at: dict[str, list[str]] = {}

    def watching(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            alive_at[name] = open_jobs_alive(results)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(sweep_module, "check_models", watching("check", sweep_module.check_models))
    monkeypatch.setattr(sweep_module, "_estimate", watching("estimate", sweep_module._estimate))
    spec = load_grid(path)
    run_sweep(spec, SweepOptions(results_dir=results, progress=False))
    assert alive_at == {"check": [], "estimate": []}
    assert "which an earlier driver started and which is still timing" in capsys.readouterr().out
    df = load_results(results)
    assert len(df) == 6 and set(df.status) == {"ok"}
    assert set(started_counts(results).values()) == {1}, "a run was started twice"


@pytest.mark.slow
def test_the_quickstart_beside_a_cpu_burner_names_contention_and_claims_no_super_scaling(
    tmp_path: Path,
) -> None:
    """The quickstart's scaling product (grouping x world size 1 and 2, two rounds), cut to
    two groupings, with a burner on every core until three runs are recorded (of the
    world-size-1 job): the report's headline says how many runs were contended and what that
    makes of the sweep, and no scaling efficiency above 150% is given as a result (contended
    runs are not baselines; one still above is noted and not drawn). Before, a slowed
    world-size-1 pass made "2051% scaling"."""
    from fsdp_bench.report import headline, summaries
    from fsdp_bench.report.build import load_inputs

    quickstart = yaml.safe_load((REPO / "fsdp_bench" / "grids" / "quickstart.yaml").read_text())
    quickstart["axes"] = [{"world_size": [1, 2], "fsdp.grouping": ["root", "block"]}]
    grid = tmp_path / "quickstart.yaml"
    grid.write_text(yaml.safe_dump(quickstart))
    burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(os.cpu_count() or 1)]
    runs = tmp_path / "qs" / "runs"

    def stop_after_three_runs() -> None:
        while len(list(runs.glob("*.json"))) < 3 and burners[0].poll() is None:
            time.sleep(0.2)
        for burner in burners:
            burner.kill()

    threading.Thread(target=stop_after_three_runs, daemon=True).start()
    try:
        done = subprocess.run([sys.executable, "-m", "fsdp_bench", "sweep", str(grid),
                               "--results", str(tmp_path / "qs")], capture_output=True,
                              text=True, timeout=900, check=False)  # fmt: skip
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert done.returncode == 0, done.stderr[-2000:]
    df = load_results(tmp_path / "qs")
    assert df["contended"].eq(True).any(), "the burner marked no run"
    scaling = summaries.scaling_efficiency(df)
    assert (scaling[scaling["note"].eq("")]["efficiency"] <= summaries.SUSPECT_EFFICIENCY).all()
    inputs = load_inputs(tmp_path / "qs", None, None, None)
    best = summaries.best_per_world_size(inputs.df, inputs.limit_gib)
    text = headline.headline_text(inputs.df, best, inputs.limit_gib)
    assert text.startswith("Contended: ") and "--rerun-contended" in text
