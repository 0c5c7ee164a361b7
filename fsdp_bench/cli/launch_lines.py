"""How to run one configuration again outside fsdp-bench's launchers: a grid of that run
alone, written beside the results, and the `torchrun` line and `sbatch` script that measure
it with `fsdp-bench run` (issue: users who hold nodes already, or whose cluster is not Slurm).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import yaml

from fsdp_bench.config.grid import SweepSpec
from fsdp_bench.config.run import RunConfig
from fsdp_bench.config.schema import non_default_fields
from fsdp_bench.store import write_atomic


def write_run_grid(spec: SweepSpec, run: RunConfig, results: Path) -> Path:
    """`<results>/launch/<run_id>.yaml`: the run as a grid base, the grid's launcher kept
    (timeouts, device, threads), so `fsdp-bench run` measures exactly this run."""
    launcher = non_default_fields(spec.launcher)
    launcher.pop("cluster", None)  # its profile's settings are in the launcher already
    grid = {
        "name": f"{spec.name}-{run.run_id}",
        "description": f"run {run.run_id} of {spec.name}, alone",
        "base": non_default_fields(run),
        "launcher": launcher,
    }
    path = results / "launch" / f"{run.run_id}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, yaml.safe_dump(grid, sort_keys=False))
    return path


def launch_lines(spec: SweepSpec, run: RunConfig, results: Path) -> list[str]:
    """The grid file, a torchrun line (on each node) and an sbatch script for `run`; each
    records into `<results>-<run_id>`, so the original record stays as it is. Paths are
    absolute and the commands name this environment's interpreter (a batch job's `python` is
    rarely the virtual environment's); a user's model module is found where the grid is."""
    results = results.resolve()
    grid = shlex.quote(str(write_run_grid(spec, run, results)))
    again = shlex.quote(f"{results}-{run.run_id}")
    nodes, per_node = run.nodes, run.world_size // run.nodes
    command = f"-m fsdp_bench run {grid} --results {again}"
    torchrun = f"{_beside_python('torchrun')} --nnodes {nodes} --nproc_per_node {per_node}"
    where = "on this machine"
    if nodes > 1:
        torchrun += f" --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 --rdzv-id {run.run_id}"
        where = f"on each of the {nodes} nodes ($HEAD_NODE: the first node's address)"
    environment = _module_path(spec, run)
    python = shlex.quote(sys.executable)
    return [
        f"to measure it again outside fsdp-bench's launchers, {where}:",
        f"  {environment + ' ' if environment else ''}{torchrun} {command}",
        "or as a Slurm batch script (sbatch):",
        *(f"  {line}" for line in sbatch_script(spec, run, f"{python} {command}", environment)),
    ]


def _beside_python(program: str) -> str:
    """`program` of this interpreter's environment, where it has one."""
    found = Path(sys.executable).parent / program
    return shlex.quote(str(found)) if found.exists() else program


def _module_path(spec: SweepSpec, run: RunConfig) -> str:
    """PYTHONPATH=... for a user's model module (imported from the grid's folder), or ''."""
    if not run.model.is_user_model or run.model.is_hf_model:
        return ""
    folder = shlex.quote(str(Path(spec.source).resolve().parent))
    return f"PYTHONPATH={folder}${{PYTHONPATH:+:$PYTHONPATH}}"


def sbatch_script(
    spec: SweepSpec, run: RunConfig, command: str, environment: str = ""
) -> list[str]:
    """An sbatch script of the run's shape, with the grid's Slurm settings where it has them
    (a local grid has no Slurm time limit to give: none is set)."""
    launcher = spec.launcher
    per_node = run.world_size // run.nodes
    slurm = launcher.kind == "slurm"
    options = {
        "job-name": f"fsdp-bench-{run.run_id}",
        "nodes": run.nodes,
        "ntasks-per-node": per_node,
        "gpus-per-node": launcher.gpus_per_node or None,
        "cpus-per-task": launcher.cpus_per_task,
        "partition": launcher.partition,
        "account": launcher.account,
        "qos": launcher.qos,
        "constraint": launcher.constraint,
        "mem": launcher.mem,
        "time": int(launcher.timeout_min) if slurm else None,
        **launcher.sbatch_extra,
    }
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH --{key}={value}" for key, value in options.items() if value is not None]
    if launcher.exclusive:
        lines.append("#SBATCH --exclusive")
    lines += list(launcher.setup)
    lines += [f"export {environment}"] if environment else []
    lines.append(" ".join(["srun", *launcher.srun_extra, command]))
    return lines
