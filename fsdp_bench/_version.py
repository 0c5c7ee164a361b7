"""The installed version, in a leaf module that every part of the package may import (the
top-level `fsdp_bench/__init__.py` is the public API and imports nothing of the package's)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fsdp-bench")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
