"""Work that needs torch, done in fresh processes so the driver never imports it."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


def in_subprocesses(
    fn: Callable[[Item], Result], items: list[Item], workers: int | None = None
) -> Iterator[tuple[int, Result]]:
    """(index of the item, fn(item)) as each finishes; one item runs here, not worth a process
    start. `fn` must be a top-level function (it is pickled)."""
    if len(items) <= 1:
        yield from ((i, fn(item)) for i, item in enumerate(items))
        return
    count = min(workers or os.cpu_count() or 1, len(items))
    context = multiprocessing.get_context("spawn")  # never fork a process that imported torch
    with ProcessPoolExecutor(max_workers=count, mp_context=context) as pool:
        futures = {pool.submit(fn, item): i for i, item in enumerate(items)}
        for future in as_completed(futures):
            yield futures[future], future.result()
