"""Shared fixtures: run real sweeps (real processes, gloo on loopback) into temporary folders."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch.distributed as dist
import yaml
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_bench import load_results
from fsdp_bench.config.grid import load_grid
from fsdp_bench.sweep import SweepOptions, SweepOutcome, run_sweep

REPO = Path(__file__).resolve().parents[1]

# Fast measurement for tests that check behaviour, not speed.
QUICK_MEASURE = {"warmup_steps": 1, "timed_steps": 1, "repeats": 1}


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A real one-process gloo group for the test (collectives on the rank side in-process)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeviceMesh]:
    """A real one-process gloo group for the module, enough to shard and run forward and
    backward in-process."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


# A user's own model, as a module file a test writes (format it with a width): `build`
# returns its ModelBundle.
USER_MODEL = """
from torch import nn
from fsdp_bench import ModelBundle

WIDTH = {width}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, 100)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x).relu()
        return self.head(x)

def build():
    net = Net()
    return ModelBundle(module=net, blocks=list(net.blocks), vocab_size=100)
"""


def write_grid(folder: Path, grid: dict[str, Any]) -> Path:
    path = folder / f"{grid['name']}.yaml"
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return path


def sweep(
    folder: Path, grid: dict[str, Any], *, verify: bool = False, results: Path | None = None
) -> tuple[SweepOutcome, pd.DataFrame]:
    """Run a grid for real (local launcher) and return its outcome and results table."""
    spec = load_grid(write_grid(folder, grid))
    results = results or folder / "results"
    outcome = run_sweep(spec, SweepOptions(results_dir=results, verify=verify, progress=False))
    return outcome, load_results(results)


def started_counts(results: Path) -> dict[str, int]:
    """How often each run was started, from rank 0's logs of every job of a results folder."""
    counts: dict[str, int] = {}
    for log in (results / "jobs" / "submitit").glob("*_0_log.out"):
        for run_id in re.findall(r"fsdp-bench: run (\w+) started", log.read_text()):
            counts[run_id] = counts.get(run_id, 0) + 1
    return counts


def tiny_grid(name: str, axes: Any, **base: Any) -> dict[str, Any]:
    """A grid on the tiny model at world size 2 with quick measurement."""
    merged: dict[str, Any] = {
        "world_size": 2,
        "model": {"name": "tiny"},
        "measure": dict(QUICK_MEASURE),
    }
    merged.update(base)
    return {
        "name": name,
        "base": merged,
        "axes": axes,
        "launcher": {"collective_timeout_s": 30},
    }


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    """In CI a skip is a failure, unless it is a GPU test on a machine without a GPU."""
    if not os.environ.get("CI"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    bad = [r for r in reporter.stats.get("skipped", []) if "no GPU" not in str(r.longrepr)]
    if bad:
        reporter.write_line(f"CI: {len(bad)} test(s) skipped for a reason other than 'no GPU':")
        for report in bad:
            reporter.write_line(f"  {report.nodeid}: {report.longrepr}")
        session.exitstatus = 1


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def quickstart_sweep(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """`fsdp-bench sweep sweeps/quickstart.yaml` run once per session as a user runs it (the
    console script pip installed): its results folder and what it printed."""
    results = tmp_path_factory.mktemp("quickstart") / "quickstart"
    console_script = Path(sys.executable).parent / "fsdp-bench"
    command = [str(console_script), "sweep", "sweeps/quickstart.yaml", "--results", str(results)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return results, done


SLURM_STATE_DIR = Path("/tmp/fsdp-bench-test-slurm")


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[dict[str, str]]:
    """A real two-node Slurm cluster on this machine (installed from Debian packages when
    missing), started once per test session and stopped at its end. Failing to start it is a
    test error, never a skip: CI must run these tests for real."""
    start = REPO / "slurm" / "testbed" / "start.sh"
    stop = REPO / "slurm" / "testbed" / "stop.sh"
    done = subprocess.run(
        [str(start), str(SLURM_STATE_DIR)], capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        pytest.fail(f"the Slurm testbed did not start:\n{done.stdout}\n{done.stderr}"[-4000:])
    conf = str(SLURM_STATE_DIR / "etc" / "slurm.conf")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf  # for the driver in this process and the jobs it submits
    try:
        yield {"SLURM_CONF": conf, "state_dir": str(SLURM_STATE_DIR)}
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        subprocess.run([str(stop), str(SLURM_STATE_DIR)], capture_output=True, timeout=300)
