"""What a run is and where it runs, validated at the edge, without importing torch: the run
sections, launcher settings, model presets, and grids (YAML load, expansion, run ids, the
search space). Every bad value is one line naming its key path, the value and what is allowed."""

from __future__ import annotations

from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.config.grid import Expansion, SweepSpec, expand, load_grid, parse_grid
from fsdp_bench.config.grid_settings import MemoryConfig, SearchConfig
from fsdp_bench.config.launcher import LauncherConfig
from fsdp_bench.config.measure import MeasureConfig
from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.presets import PRESETS, ModelShape
from fsdp_bench.config.run import DataConfig, FaultConfig, RunConfig, TrainConfig

__all__ = [
    "PRESETS",
    "DataConfig",
    "Expansion",
    "FaultConfig",
    "FsdpConfig",
    "LauncherConfig",
    "MeasureConfig",
    "MemoryConfig",
    "ModelConfig",
    "ModelShape",
    "RunConfig",
    "SearchConfig",
    "SweepSpec",
    "TrainConfig",
    "expand",
    "load_grid",
    "parse_grid",
]
