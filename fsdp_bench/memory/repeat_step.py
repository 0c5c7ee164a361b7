"""The measured step's allocations made from the warm-up step's, without simulating it.

A simulation records set-up, a warm-up step and the measured step (`fake_step.record_step`).
The second step allocates and frees what the first did, in the same order and sizes, except
what the first step makes once: the optimizer's state (AdamW creates it lazily, inside the
first `step()`), alive when the step ends. So a trace of set-up and the warm-up step alone
gives both steps, at about half the cost of simulating two. Whether that holds for a
configuration is not assumed: `simulate` compares it with a simulated second step
(`repeats`) before any trace is completed this way.
"""

from __future__ import annotations

from typing import Any

from fsdp_bench.memory.alloc_trace import AllocationTrace
from fsdp_bench.memory.deepen import structure

WARMUP = "warmup"
"""The mark where the warm-up step begins (set-up before it)."""
STEP = "step"
"""The mark where the measured step begins: the end of a trace of one step."""


def repeat_step(trace: AllocationTrace) -> AllocationTrace:
    """`trace` (set-up and the warm-up step, which ends it) followed by the measured step:
    the warm-up step's events again, without the allocations that outlive it and without its
    frees of what existed before it (both happen once)."""
    start, end = trace.marks[WARMUP], trace.marks[STEP]
    if end != len(trace.events):
        raise ValueError("repeat_step: the trace goes on after the warm-up step")
    made: set[Any] = set()
    kept: set[Any] = set()
    for event in trace.events[start:end]:
        if event[0] == "alloc":
            made.add(event[1])
            kept.add(event[1])
        else:
            kept.discard(event[1])
    out = AllocationTrace(
        list(trace.events), list(trace.tags), dict(trace.categories), dict(trace.marks)
    )
    for index in range(start, end):
        event = trace.events[index]
        if event[1] in kept or event[1] not in made:
            continue
        again = ("again", event[1])
        if event[0] == "alloc":
            out.events.append(("alloc", again, *event[2:]))
            out.categories[again] = trace.categories.get(event[1], "other")
        else:
            out.events.append(("free", again))
        out.tags.append(trace.tags[index])
    return out


def first_step(trace: AllocationTrace) -> AllocationTrace:
    """`trace` up to the measured step: what a simulation of one step records."""
    end = trace.marks[STEP]
    keys = {event[1] for event in trace.events[:end]}
    return AllocationTrace(
        trace.events[:end],
        trace.tags[:end],
        {key: category for key, category in trace.categories.items() if key in keys},
        {name: at for name, at in trace.marks.items() if at <= end},
    )


def repeats(trace: AllocationTrace) -> bool:
    """Whether `trace`'s measured step is its warm-up step repeated (`repeat_step`): the same
    allocations and frees in the same order, sizes and streams, with the same block tags and
    categories."""
    made = repeat_step(first_step(trace))
    return _described(made) == _described(trace) and made.tags == trace.tags


def _described(trace: AllocationTrace) -> list[tuple[Any, ...]]:
    """The trace's `structure`, each allocation with its size and category."""
    about = [
        (event[2], trace.categories.get(event[1])) if event[0] == "alloc" else ()
        for event in trace.events
    ]
    return list(zip(structure(trace), about, strict=True))
