"""fsdp-bench: measure which FSDP2 configuration trains a model fastest within its memory.

The public API: load and expand a grid, run a sweep or a search, read the results, build a
report; `ModelBundle` is what a user's model function returns. Names are imported on first
use, so `import fsdp_bench` (done by every rank's worker) stays light.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from fsdp_bench._version import __version__

# torchao (imported by train.float8, and by transformers whenever it is installed) warns on
# import about its optional CUDA kernels built for another torch, and torch's pytree about the
# enums torchao registers: noise on every command's stderr and every rank's log, about code
# fsdp-bench does not use (float8 training runs torchao's Python path and torch._scaled_mm).
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").addFilter(
    lambda record: "natively supported by torch.compile" not in record.getMessage()
)

if TYPE_CHECKING:
    from fsdp_bench.config import expand as expand
    from fsdp_bench.config import load_grid as load_grid
    from fsdp_bench.job.model.zoo import ModelBundle as ModelBundle
    from fsdp_bench.report import build_report as build_report
    from fsdp_bench.search import run_search as run_search
    from fsdp_bench.store import load_results as load_results
    from fsdp_bench.sweep import run_sweep as run_sweep

_PUBLIC = {
    "load_grid": "fsdp_bench.config",
    "expand": "fsdp_bench.config",
    "run_sweep": "fsdp_bench.sweep",
    "run_search": "fsdp_bench.search",
    "load_results": "fsdp_bench.store",
    "build_report": "fsdp_bench.report",
    "ModelBundle": "fsdp_bench.job.model.zoo",
}

__all__ = ["ModelBundle", "__version__", *sorted(k for k in _PUBLIC if k != "ModelBundle")]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'fsdp_bench' has no attribute {name!r}")
