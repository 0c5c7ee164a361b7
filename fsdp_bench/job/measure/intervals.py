"""Interval arithmetic on a step's timeline (seconds or microseconds alike): how much of one
set of intervals (communication) no other set (compute) covers. Pure Python, tested alone."""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged where they overlap or touch, sorted; empty ones dropped."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def length(intervals: Iterable[Interval]) -> float:
    """The time the intervals cover together (overlaps counted once)."""
    return sum(end - start for start, end in union(intervals))


def uncovered(intervals: Iterable[Interval], cover: Iterable[Interval]) -> float:
    """The time `intervals` cover that `cover` does not: communication not hidden by compute."""
    covering = union(cover)
    total = 0.0
    for start, end in union(intervals):
        at = start
        for c_start, c_end in covering:
            if c_end <= at:
                continue
            if c_start >= end:
                break
            total += max(0.0, c_start - at)
            at = max(at, c_end)
            if at >= end:
                break
        total += max(0.0, end - at)
    return total
