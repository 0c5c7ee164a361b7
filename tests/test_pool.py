"""Worker processes for the torch work before launch: the kept pool, and fresh processes for
a user's code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fsdp_bench import load_results
from fsdp_bench.config.grid import load_grid
from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.memory import pool
from fsdp_bench.memory.estimate import estimate_runs
from fsdp_bench.memory.model_check import run_flops, source_digest
from fsdp_bench.memory.pool import in_subprocesses
from fsdp_bench.sweep import SweepOptions, run_sweep
from tests.conftest import REPO, USER_MODEL, sweep, tiny_grid, write_grid


def pid_of(_: int) -> int:
    return os.getpid()


def children() -> set[int]:
    """This process's spawned workers (not multiprocessing's resource tracker), from /proc."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
        if parent == os.getpid() and b"spawn_main" in command:
            found.add(int(stat.parent.name))
    return found


def test_our_own_work_reuses_the_kept_workers_and_user_code_gets_fresh_ones() -> None:
    pool._close_kept()  # a pool an earlier test kept: start from none
    before = children()
    first = {pid for _, pid in in_subprocesses(pid_of, [0, 1, 2], user_code=False)}
    kept = children() - before
    assert first <= kept and 1 <= len(kept) <= (os.cpu_count() or 1)
    again = {pid for _, pid in in_subprocesses(pid_of, [0, 1, 2], user_code=False)}
    assert again <= kept and children() - before == kept, "no process was started again"
    fresh = {pid for _, pid in in_subprocesses(pid_of, [0, 1], user_code=True)}
    assert fresh and not fresh & kept and os.getpid() not in fresh
    assert children() - before == kept, "the fresh processes ended with their work"
    assert [pid for _, pid in in_subprocesses(pid_of, [0], user_code=False)] == [os.getpid()]
    alone = [pid for _, pid in in_subprocesses(pid_of, [0], user_code=True)]
    assert alone and os.getpid() not in alone, "one item of a user's code is not run here"


def test_estimates_asked_from_two_threads_at_once_both_succeed() -> None:
    """A single run is simulated in this process, with a fake default process group that two
    simulations at once would both try to create."""
    runs = [RunConfig(world_size=w) for w in (2, 4)]
    with ThreadPoolExecutor(max_workers=2) as threads:
        found = list(threads.map(lambda run: estimate_runs([run], cache_dir=None), runs))
    estimates = [f[r.run_id] for f, r in zip(found, runs, strict=True)]
    assert [e.error for e in estimates] == ["", ""]
    assert all(e.estimated_peak_gib for e in estimates)


@pytest.mark.slow
def test_a_users_model_edited_between_sweeps_is_checked_and_estimated_as_it_is_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within one process (a notebook) and one results folder: the FLOPs memo, the estimate
    cache, and the processes a single run and several runs are estimated in."""
    monkeypatch.syspath_prepend(str(tmp_path))
    runs = [RunConfig(model=ModelConfig(name="wide_model:build"), world_size=w) for w in (1, 2)]
    cache_dir = tmp_path / "estimates"

    def facts(width: int) -> list[float]:
        (tmp_path / "wide_model.py").write_text(USER_MODEL.format(width=width))
        several = estimate_runs(runs, cache_dir)
        alone = estimate_runs(runs[:1], cache_dir=None)[runs[0].run_id]
        flops = run_flops(runs[:1])[runs[0].run_id].flops_per_token
        peaks = [several[r.run_id].estimated_peak_gib or 0.0 for r in runs]
        return [*peaks, alone.estimated_peak_gib or 0.0, flops or 0.0]

    narrow, wide = facts(16), facts(256)
    assert all(0 < n < w for n, w in zip(narrow, wide, strict=True)), (narrow, wide)
    assert source_digest(runs[0].model) in {
        json.loads(p.read_text())["model_source"] for p in cache_dir.glob("*.json")
    }


def test_a_source_digest_follows_the_file_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "digest_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('a package run by the digest')\n")
    (package / "net.py").write_text("WIDTH = 1\n")
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2}')
    monkeypatch.syspath_prepend(str(tmp_path))
    module = ModelConfig(name="digest_pkg.net:build")
    hf = ModelConfig(name=f"hf:{tmp_path}")
    before = source_digest(module), source_digest(hf)
    assert all(before) and "digest_pkg" not in sys.modules
    (package / "net.py").write_text("WIDTH = 2\n")
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 4}')
    after = source_digest(module), source_digest(hf)
    assert before[0] != after[0] and before[1] != after[1]
    assert source_digest(ModelConfig(name="no_such_module_xyz:build")) == ""
    assert source_digest(ModelConfig(name="tiny")) == ""


@pytest.mark.slow
def test_a_rerun_checks_and_estimates_a_users_model_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edit the source digest cannot see (a file the model's module imports)."""
    (tmp_path / "wide_layers.py").write_text("WIDTH = 16\n")
    model = USER_MODEL.replace("WIDTH = {width}", "from wide_layers import WIDTH")
    (tmp_path / "wide_model.py").write_text(model)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the ranks import it too
    grid = tiny_grid("edited", {"data.seed": [0]}, world_size=1, model={"name": "wide_model:build"})
    _, narrow = sweep(tmp_path, grid)
    (tmp_path / "wide_layers.py").write_text("WIDTH = 256\n")
    spec = load_grid(write_grid(tmp_path, grid))
    run_sweep(spec, SweepOptions(results_dir=tmp_path / "results", rerun=True, progress=False))
    wide = load_results(tmp_path / "results")
    assert list(narrow.status) == list(wide.status) == ["ok"]
    for column in ("estimated_peak_gib", "flops_per_token", "tracked_peak_gib"):
        assert narrow[column].iloc[0] < wide[column].iloc[0], column


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None  # gone


def test_no_worker_outlives_the_command_that_started_it(tmp_path: Path) -> None:
    """`fsdp-bench estimate` killed while its kept workers estimate (as a terminal closed,
    an OOM killer or a test's timeout would): every worker ends within seconds. Before, a
    worker blocked on its queue, whose write end it holds too, for ever, with parent 1
    (about 325 MB each, seen after full test runs)."""
    grid = REPO / "sweeps" / "llama8b-h100.yaml"
    command = [sys.executable, "-m", "fsdp_bench", "estimate", str(grid),
               "--results", str(tmp_path / "results")]  # fmt: skip
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: set[int] = set()
    deadline = time.monotonic() + 60
    while len(workers) < min(2, os.cpu_count() or 1) and time.monotonic() < deadline:
        time.sleep(0.2)
        workers = {int(p.parent.name) for p in Path("/proc").glob("[0-9]*/stat")
                   if _parent(int(p.parent.name)) == driver.pid}  # fmt: skip
    assert workers, "the estimate started no worker"
    driver.kill()
    driver.wait()
    deadline = time.monotonic() + 15
    while any(_parent(pid) is not None for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [pid for pid in workers if _parent(pid) is not None]
    for pid in alive:
        os.kill(pid, 9)
    assert not alive, f"workers {alive} outlived their driver"
