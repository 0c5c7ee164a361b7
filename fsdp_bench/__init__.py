"""fsdp-bench: measure which FSDP2 configuration trains a model fastest within its memory.

The public API is small: load and expand a grid, run a sweep, read its results.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fsdp-bench")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

from fsdp_bench.results import load_results

__all__ = ["__version__", "load_results"]
