"""Launch jobs and follow them to their records: local or Slurm (through submitit), and the
driver that keeps the slots full and turns whatever a job left behind into records."""

from __future__ import annotations

from pathlib import Path

from fsdp_bench.config.launcher import LauncherConfig
from fsdp_bench.errors import ConfigError
from fsdp_bench.launch.base import ALIVE_STATES, Launcher, SubmittedJob
from fsdp_bench.launch.driver import Driver, Watched
from fsdp_bench.launch.ledger import Ledger
from fsdp_bench.launch.local import LocalLauncher
from fsdp_bench.launch.packing import pack_runs
from fsdp_bench.launch.slurm import SlurmLauncher

__all__ = [
    "ALIVE_STATES",
    "Driver",
    "Launcher",
    "Ledger",
    "LocalLauncher",
    "SlurmLauncher",
    "SubmittedJob",
    "Watched",
    "make_launcher",
    "pack_runs",
]


def make_launcher(config: LauncherConfig, jobs_dir: Path) -> Launcher:
    match config.kind:
        case "local":
            return LocalLauncher(config, jobs_dir)
        case "slurm":
            return SlurmLauncher(config, jobs_dir)
        case _:
            raise ConfigError(f"launcher.kind: {config.kind!r} is not supported")
