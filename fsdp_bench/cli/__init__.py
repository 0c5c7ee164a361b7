"""The `fsdp-bench` command: the parser and main (user errors become one line and an exit
code), the console views of grids, estimates and searches, and the fully_shard code generator."""

from __future__ import annotations

from fsdp_bench.cli.main import main

__all__ = ["main"]
