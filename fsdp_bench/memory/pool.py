"""Work that needs torch, spread over worker processes (spawned: a process that imported
torch is never forked).

Starting a worker costs its `import torch` (2-3 s, more on a busy machine): about what a small
sweep's whole estimate costs. Work on our own code (the presets) therefore goes to one pool
kept for the life of the driver process, so a notebook or a test session that sweeps many
times pays the start once, and a single item runs here. Work that imports a user's code
always gets fresh processes: a kept worker, or this process, would hold the module from before
the user edited it.

A worker holds nothing that must outlive it (results go back as values), so once told to stop
it exits without tearing its interpreter down: with torch loaded that teardown takes 0.7 s,
which a driver at exit, or leaving a pool, waits for. It also ends when its parent does,
however that ends.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
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
        with _executor(count) as fresh:
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


def _executor(max_workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(
        max_workers=max_workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_worker_started,
    )


def _worker_started() -> None:
    """A worker ends with its parent, however the parent ends: killed, it never tells its
    workers to stop, and each would wait on its queue for ever (it holds the queue's write
    end too, so no end of file ever comes)."""
    atexit.register(_exit_now)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's to act on
    parent = multiprocessing.parent_process()
    if parent is not None:
        sentinel = parent.sentinel
        threading.Thread(target=_exit_with, args=(sentinel,), daemon=True).start()


def _exit_with(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


def _exit_now() -> None:
    """A worker's last exit handler (registered first, so run after torch's): its output
    flushed, the process ends without the interpreter's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _kept_pool() -> ProcessPoolExecutor:
    """Workers start on first use, up to one per core, and stay until the process exits."""
    global _kept
    with _lock:
        if _kept is None:
            _kept = _executor(os.cpu_count() or 1)
        return _kept


@atexit.register
def _close_kept() -> None:
    global _kept
    if _kept is not None:
        _kept.shutdown(wait=False, cancel_futures=True)
        _kept = None
