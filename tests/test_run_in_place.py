"""`fsdp-bench run` under torchrun (one node, and two agents as two nodes on loopback): each
group measures the runs of its shape, a failure under `--max-restarts` becomes a record (a
rank's crash without a note too), and a second invocation on a busy results folder is
refused."""

from __future__ import annotations

import json
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fsdp_bench import load_results
from fsdp_bench.config.grid import expand, load_grid
from fsdp_bench.memory.estimate import estimate_runs
from fsdp_bench.memory.model_check import COUNTED
from tests.conftest import REPO, USER_MODEL, started_counts, write_grid

pytestmark = pytest.mark.slow

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
MEASURE = {"warmup_steps": 1, "timed_steps": 2, "repeats": 1}


def grid(name: str, axes: Any, **base: Any) -> dict[str, Any]:
    return {
        "name": name,
        "base": {"model": {"name": "tiny"}, "measure": MEASURE, **base},
        "axes": axes,
        "launcher": {"collective_timeout_s": 30},
    }


def torchrun(args: list[str], path: Path, results: Path, **popen: Any) -> Any:
    command = [*TORCHRUN, *args, "-m", "fsdp_bench", "run", str(path), "--results", str(results)]
    if popen:
        return subprocess.Popen(command, cwd=REPO, text=True, **popen)
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_torchrun_measures_exactly_the_runs_of_its_world_size(tmp_path: Path) -> None:
    axes = [{"world_size": [1, 2, 4]}, {"world_size": [2], "fsdp.grouping": ["root"]}]
    path = write_grid(tmp_path, grid("one-node", axes))
    results = tmp_path / "r"
    estimated = [r for r in expand(load_grid(path)).runs if r.world_size == 2][:1]
    estimate_runs(estimated, results / "estimates")  # as `fsdp-bench estimate` leaves them
    done = torchrun(["--nnodes", "1", "--nproc_per_node", "2"], path, results)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 runs need world size 1 on 1 node(s): not run here" in done.stdout
    assert "1 runs need world size 4 on 1 node(s): not run here" in done.stdout
    assert f"1 of 2 runs have a memory estimate for cpu in {results}" in done.stdout
    df = load_results(results)
    wanted = {r.run_id for r in expand(load_grid(path)).runs if r.world_size == 2}
    assert set(df.run_id) == wanted and set(df.status) == {"ok"}
    has_estimate = df.set_index("run_id").estimated_peak_gib.notna()
    assert has_estimate.to_dict() == {r: r == estimated[0].run_id for r in wanted}
    assert set(df.launcher) == {"torchrun"} and set(df.job_id.str[:9]) == {"torchrun-"}
    assert not (results / "run.lock").exists()
    again = torchrun(["--nnodes", "1", "--nproc_per_node", "2"], path, results)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not re.search(r"run \w+ started", again.stdout), "recorded runs are not measured again"
    check_printed_launch_line(path, results, df.run_id.iloc[0])


def check_printed_launch_line(path: Path, results: Path, run_id: str) -> None:
    """`sweep --print-launch`'s torchrun line, run as printed from another folder, measures the
    same configuration; the sbatch script names this environment's interpreter and, for a
    local grid, no Slurm time limit (it had said --time=600, 10 hours, from timeout_min)."""
    shown = subprocess.run([sys.executable, "-m", "fsdp_bench", "sweep", str(path), "--results",
                            str(results), "--print-launch", run_id], cwd=REPO,
                           capture_output=True, text=True, check=True)  # fmt: skip
    line = next(line.strip() for line in shown.stdout.splitlines() if "torchrun " in line)
    argv = shlex.split(line)
    assert argv[0] == str(Path(sys.executable).parent / "torchrun")  # this environment's
    assert "#SBATCH --ntasks-per-node=2" in shown.stdout and "--time" not in shown.stdout
    assert f"srun {shlex.quote(sys.executable)} -m fsdp_bench run" in shown.stdout
    elsewhere = results.parent / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    done = subprocess.run(argv, cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    def config(folder: Path) -> Any:
        return json.loads((folder / "runs" / f"{run_id}.json").read_text())["config"]

    assert config(Path(f"{results}-{run_id}")) == config(results)


def test_two_agents_on_loopback_are_two_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a user's model, which each rank checks and counts itself."""
    (tmp_path / "agents_model.py").write_text(USER_MODEL.format(width=32))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    path = write_grid(tmp_path, grid("two-nodes", {"fsdp.grouping": ["block"]}, world_size=2,
                                     processes_per_node=1, model={"name": "agents_model:build"},
                                     data={"seq_len": 16}))  # fmt: skip
    results = tmp_path / "r"
    with socket.socket() as probe:  # a free port for the c10d rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes"]  # fmt: skip
    agents = [torchrun(args, path, results, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
              for _ in range(2)]  # fmt: skip
    outputs = [agent.communicate(timeout=300) for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], [o[1][-2000:] for o in outputs]
    df = load_results(results)
    assert list(df.status) == ["ok"] and list(df.nodes) == [2]
    assert list(df.world_size) == [2]
    assert list(df.flops_source) == [COUNTED] and df.flops_per_token.iloc[0] > 0


@pytest.mark.parametrize(
    ("fault", "status", "reason"),
    [
        ("oom", "oom", "rank 1 ("),
        # os._exit: no note, as for a segfault; measured again, it would exit every attempt
        ("exit", "error", "a rank ended without a report and torchrun restarted the group"),
    ],
)
def test_a_failure_under_max_restarts_is_recorded_and_the_other_runs_go_on(
    tmp_path: Path, fault: str, status: str, reason: str
) -> None:
    axes = [{"data.seed": [0]}, {"fault.kind": [fault], "fault.rank": [1]}, {"data.seed": [2]}]
    path = write_grid(tmp_path, grid("restarts", axes, world_size=2))
    results = tmp_path / "r"
    done = torchrun(["--nnodes", "1", "--nproc_per_node", "2", "--max-restarts", "1"], path,
                    results)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    df = load_results(results).set_index("fault")
    assert df.loc[fault, "status"] == status and reason in df.loc[fault, "reason"]
    assert (df.drop(index=fault)["status"] == "ok").all() and len(df) == 3
    restarted = [attempt for attempt in load_results(results)["attempt"] if attempt]
    assert restarted, "the runs after the failure were measured by the restarted group"


def test_a_second_invocation_on_a_busy_folder_is_refused(tmp_path: Path) -> None:
    path = write_grid(tmp_path, grid("busy", {"data.seed": [0]}, world_size=1,
                                     measure={**MEASURE, "timed_steps": 100_000}))  # fmt: skip
    results = tmp_path / "r"
    # Each its own free port (torch 2.11's torchrun takes 29500 for both otherwise, and the
    # second fails to bind before fsdp-bench runs)
    args = ["--standalone", "--nproc_per_node", "1"]
    first = torchrun(args, path, results, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not started_counts(results) and not list(results.glob("inflight/*/started.json")):
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.2)
        lock = json.loads((results / "run.lock").read_text())
        second = torchrun(args, path, results)
        assert second.returncode != 0
        assert "is in use by another fsdp-bench run" in second.stderr
        assert f"pid {lock['pid']}" in second.stderr
    finally:  # torchrun stops its workers on SIGTERM (they run in sessions of their own)
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
        leftover = subprocess.run(["pgrep", "-f", str(path)], capture_output=True, text=True)
        assert not leftover.stdout.strip(), f"workers outlived torchrun: {leftover.stdout}"
