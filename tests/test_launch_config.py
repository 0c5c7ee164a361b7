"""Slurm launcher settings checked without a cluster: the sbatch script a job is submitted
with, launcher settings that must not reach a shell, and errors in cluster profiles.
(tests/test_slurm.py runs jobs on the real testbed.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_bench.config.grid import expand, load_grid
from fsdp_bench.config.launcher import LauncherConfig
from fsdp_bench.errors import ConfigError, FieldError
from fsdp_bench.job.spec import JobSpec
from fsdp_bench.launch.slurm import SlurmLauncher
from tests.conftest import REPO, write_grid


def test_sbatch_script_carries_every_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # submitit's SlurmExecutor refuses to exist where `srun` is not on PATH; writing the
    # script runs nothing, so a stub that fails if it ever is run stands in for it.
    stub = tmp_path / "bin" / "srun"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\necho 'stub srun: not a cluster' >&2\nexit 1\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stub.parent}{os.pathsep}{os.environ['PATH']}")
    grid = {
        "name": "h100",
        "base": {"world_size": 16, "model": {"name": "llama3-8b"}},
        "launcher": {
            "cluster": str(REPO / "slurm" / "clusters" / "example-h100.yaml"),
            "sbatch_extra": {"reservation": "big-run", "mail-type": "FAIL"},
        },
    }
    spec = load_grid(write_grid(tmp_path, grid))
    run = expand(spec).runs[0]
    assert (run.nodes, run.processes_per_node) == (2, 8)
    launcher = SlurmLauncher(spec.launcher, tmp_path / "jobs")
    script = launcher.sbatch_script(JobSpec(runs=(run,), results_dir=str(tmp_path)))
    script = script.replace(str(tmp_path), "<results>").replace(sys.executable, "<python>")
    expected = (REPO / "tests" / "data" / "h100_sbatch.sh").read_text()
    assert script == expected


def test_shell_injection_in_launcher_settings_is_rejected(tmp_path: Path) -> None:
    """Rejected when the grid is loaded, before anything (sbatch included) is run."""
    marker = tmp_path / "pwned"
    for bad in (
        {"partition": f"debug; touch {marker}"},
        {"account": f"$(touch {marker})"},
        {"sbatch_extra": {"comment": f"x`touch {marker}`"}},
        {"srun_extra": [f"--label;touch {marker}"]},
    ):
        grid = {
            "name": "inject",
            "base": {"world_size": 2, "model": {"name": "tiny"}},
            "axes": {"data.seed": [0]},
            "launcher": {"cluster": str(REPO / "slurm" / "clusters" / "testbed.yaml"), **bad},
        }
        path = write_grid(tmp_path, grid)
        done = subprocess.run(
            [sys.executable, "-m", "fsdp_bench", "sweep", str(path), "--results",
             str(tmp_path / "results")],
            capture_output=True, text=True, cwd=REPO, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        key = next(iter(bad))
        assert f"launcher.{key}" in done.stderr and "is not allowed" in done.stderr
    assert not marker.exists()
    assert not (tmp_path / "results").exists(), "nothing was submitted"


def test_profile_errors_name_the_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profile = tmp_path / "bad.yaml"
    profile.write_text("partition: 'a b'\n")
    grid = {"name": "p", "launcher": {"cluster": str(profile)}}
    with pytest.raises(ConfigError, match=r"bad\.yaml: partition: 'a b' is not allowed"):
        load_grid(write_grid(tmp_path, grid))
    grid = {"name": "p", "launcher": {"cluster": "nosuch"}}
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match=r"no profile 'nosuch'.*available: example-h100, testbed"):
        load_grid(write_grid(tmp_path, grid))


def test_slurm_gpu_requests_are_checked() -> None:
    with pytest.raises(FieldError, match="gpus_per_node: 0 is not allowed; device: cuda on Slurm"):
        LauncherConfig(kind="slurm", device="cuda")
    with pytest.raises(FieldError, match="processes_per_node: 8 is not allowed; at most"):
        LauncherConfig(kind="slurm", gpus_per_node=4, processes_per_node=8)
    assert LauncherConfig(kind="slurm", gpus_per_node=8).job_device == "cuda"
    assert LauncherConfig(kind="slurm").job_device == "cpu"  # auto, and no GPUs requested
    assert LauncherConfig().job_device == "auto"  # local ranks decide by what they see


def test_relative_paths_are_the_grids_own_from_any_working_folder(tmp_path: Path) -> None:
    """`hf:config.json` and `cluster: mycluster.yaml` beside the grid: `fsdp-bench estimate`
    from another folder finds both (the hf: path was taken from the working folder, the
    profile from the grid's); the launch file `--print-launch` writes names the model by its
    absolute path and carries the profile's settings, not its relative name; a profile that
    is not there lists the cluster profiles only, not the launch files."""
    from transformers import LlamaConfig

    project = tmp_path / "project"
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                max_position_embeddings=256).save_pretrained(project)  # fmt: skip
    (project / "mycluster.yaml").write_text("partition: gpu\ncpus_per_task: 2\n")
    grid = {"name": "relative", "base": {"model": {"name": "hf:config.json"},
            "data": {"seq_len": 32}}, "axes": {"world_size": [1, 2]},
            "launcher": {"cluster": "mycluster.yaml"}}  # fmt: skip
    path = write_grid(project, grid)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    command = [sys.executable, "-m", "fsdp_bench", "estimate", str(path), "--json",
               "--results", str(tmp_path / "results")]  # fmt: skip
    done = subprocess.run(command, cwd=elsewhere, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    spec = load_grid(path)
    assert spec.launcher.partition == "gpu"
    run = expand(spec).runs[0]
    assert run.model.name == f"hf:{project / 'config.json'}"
    from fsdp_bench.cli.launch_lines import write_run_grid

    launch = load_grid(write_run_grid(spec, run, tmp_path / "results"))
    assert expand(launch).runs[0].run_id == run.run_id
    assert launch.launcher.partition == "gpu" and launch.launcher.cluster is None
    missing = {**grid, "launcher": {"cluster": "nosuch"}}
    with pytest.raises(ConfigError) as found:
        load_grid(write_grid(tmp_path / "results" / "launch", missing))
    assert "available: example-h100, testbed" in str(found.value) or "available: none" in str(
        found.value
    )
    assert run.run_id not in str(found.value)  # launch files are not profiles
