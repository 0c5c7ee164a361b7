"""Work that needs torch, spread over worker processes (spawned: a process that imported
torch is never forked).

Starting a worker costs its `import torch` (2-3 s, more on a busy machine): about what a small
sweep's whole estimate costs. Work on our own code (the presets) therefore goes to one pool
kept for the life of the driver process, so a notebook or a test session that sweeps many
times pays the start once, and a single item runs here. Work that imports a user's code
always gets fresh processes: a kept worker, or this process, would hold the module from before
the user edited it.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

_kept: ProcessPoolExecutor | None = None
_lock = threading.Lock()
"""Guards this process's state when sweeps run in threads: the kept pool, and the item run
here (it sets process-wide state: a fake default process group)."""


def in_subprocesses(
    fn: Callable[[Item], Result], items: list[Item], *, user_code: bool
) -> Iterator[tuple[int, Result]]:
    """(index of the item, fn(item)) as each finishes. `fn` must be a top-level function (it
    is pickled). `user_code`: the work imports a user's modules, so its items, even one, go
    to fresh processes."""
    if not items:
        return
    if user_code:
        count = min(os.cpu_count() or 1, len(items))
        with ProcessPoolExecutor(max_workers=count, mp_context=_spawn()) as fresh:
            yield from _results(fresh, fn, items)
        return
    if len(items) == 1:
        with _lock:
            result = fn(items[0])
        yield 0, result
        return
    try:
        yield from _results(_kept_pool(), fn, items)
    except BrokenProcessPool:  # a worker died (the OOM killer): start afresh next time
        _close_kept()
        raise


def _results(
    pool: ProcessPoolExecutor, fn: Callable[[Item], Result], items: list[Item]
) -> Iterator[tuple[int, Result]]:
    futures = {pool.submit(fn, item): i for i, item in enumerate(items)}
    for future in as_completed(futures):
        yield futures[future], future.result()


def _spawn() -> multiprocessing.context.SpawnContext:
    return multiprocessing.get_context("spawn")


def _kept_pool() -> ProcessPoolExecutor:
    """Workers start on first use, up to one per core, and stay until the process exits."""
    global _kept
    with _lock:
        if _kept is None:
            _kept = ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=_spawn())
        return _kept


@atexit.register
def _close_kept() -> None:
    global _kept
    if _kept is not None:
        _kept.shutdown(wait=False, cancel_futures=True)
        _kept = None
