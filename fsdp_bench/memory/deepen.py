"""A deep model's allocation trace made from a shallow one's: what a step of N identical blocks
allocates, from a simulation of k, without simulating N.

A block-tagged trace (`alloc_trace`) is a sequence of sweeps over the blocks: forward visits
them in order and backward in reverse; materialising, a foreach operator's outputs, clipping
and `zero_grad` visit them in parameter order. In each sweep a block contributes a run of
consecutive events tagged with its index. The middle blocks' runs are alike, so the deep trace
repeats a middle period of runs (the template: `period` blocks from `template_start`) as many
times as blocks are missing, and moves the later blocks' runs after the copies.

An allocation in a sweep is known by its role: (sweep, position in its block's run, block).
A free refers to the allocation at the same distance in blocks as in the shallow trace: block
b's forward frees what block b-1 gathered, backward frees what the same block saved. The
first and last blocks' runs hold more (the embedding, a second prefetch): their events are
matched in order to the template's, and the rest, their own, has no copies. Whether
that holds for a configuration is not assumed: `simulate` makes the (k+period)-block trace
from the k-block one too and compares it with a simulated one before trusting the deep trace.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from fsdp_bench.memory.alloc_trace import AllocationTrace


class CannotDeepen(Exception):
    """The trace is not a repetition of its template (a free whose allocation has no copy,
    a sweep that holds part of the template): simulate the whole model instead."""


def growth_per_period(made: AllocationTrace, simulated: AllocationTrace) -> dict[int, int]:
    """How much each shallow allocation grows per period of blocks: `made` (deepened by one
    period) against `simulated` (that depth simulated), which must be the same sequence of
    allocations and frees on the same streams. Most sizes do not grow; those that do hold
    every block (a root group's all-gather, DDP's buckets, the stacked norms of clipping)."""
    if structure(made) != structure(simulated):
        raise CannotDeepen("the deepened trace is not the simulated one")
    growth: dict[int, int] = {}
    for source, mine, theirs in zip(made.sources, made.events, simulated.events, strict=True):
        if mine[0] != "alloc":
            continue
        if growth.setdefault(source, theirs[2] - mine[2]) != theirs[2] - mine[2]:
            raise CannotDeepen(f"event {source}'s copies grow unequally")
    return {source: bytes_ for source, bytes_ in growth.items() if bytes_}


def grown(made: AllocationTrace, growth: dict[int, int], periods: int) -> AllocationTrace:
    """`made` with each allocation grown by `periods` times its growth per period."""
    if not growth:
        return made
    events = [
        (e[0], e[1], e[2] + growth.get(source, 0) * periods, e[3]) if e[0] == "alloc" else e
        for source, e in zip(made.sources, made.events, strict=True)
    ]
    return AllocationTrace(events, made.tags, made.categories, made.marks, made.sources)


def structure(trace: AllocationTrace) -> list[tuple[Any, ...]]:
    """The trace without sizes or keys: allocations by stream, frees by which allocation,
    those made one after another in the order of their allocations (what was freed at once
    can be freed in any order: a cache cleared iterates a hash table; the allocator ends in
    the same state either way)."""
    number: dict[Any, int] = {}
    out: list[tuple[Any, ...]] = []
    frees: list[int] = []
    for event in [*trace.events, ("end",)]:
        if event[0] == "free":
            frees.append(number.get(event[1], -1))
            continue
        out.extend(("free", n) for n in sorted(frees))
        frees = []
        if event[0] == "alloc":
            number[event[1]] = len(number)
            out.append(("alloc", event[3]))
    return out


@dataclass
class _Run:
    """Consecutive events of one block: its tag and their positions in the trace."""

    tag: int
    positions: list[int]


def deepen(
    trace: AllocationTrace, blocks: int, target: int, template_start: int, period: int
) -> AllocationTrace:
    """`trace` of a `blocks`-block model as a `target`-block model would make it."""
    return ShallowTrace(trace, blocks, template_start, period).deepened(target)


class ShallowTrace:
    """A `blocks`-block model's trace, its sweeps and the role of each allocation found once
    for every depth it is deepened to (the one-period check's and the model's)."""

    def __init__(
        self, trace: AllocationTrace, blocks: int, template_start: int, period: int
    ) -> None:
        self.trace, self.blocks, self.period = trace, blocks, period
        self.template = range(template_start, template_start + period)
        self.tags = _effective_tags(trace)
        self.sweeps = _sweeps(self.tags, period)
        freed_in = _freeing_sweeps(trace, self.sweeps)
        self.role: dict[Any, _Role] = {}
        for number, runs in enumerate(self.sweeps):
            alignments = _alignments(trace, runs, self.template, freed_in)
            for run, aligned in zip(runs, alignments, strict=True):
                for position, event_index in enumerate(run.positions):
                    event = trace.events[event_index]
                    if event[0] != "alloc":
                        continue
                    if position in aligned and run.tag < blocks:  # the head has no copies
                        self.role[event[1]] = (number, aligned[position], run.tag, None)
                    else:  # keyed apart from the aligned ones
                        later = run.tag > self.template[-1]
                        self.role[event[1]] = (number, -1 - position, run.tag, later)
        self.batch = _freed_at_once(trace, self.role, period)

    def deepened(self, target: int) -> AllocationTrace:
        """The trace a `target`-block model would make."""
        trace, blocks, period, tags = self.trace, self.blocks, self.period, self.tags
        if (target - blocks) % period or target < blocks:
            raise CannotDeepen(f"{target} blocks are not {blocks} and whole periods of {period}")
        copies = (target - blocks) // period + 1
        later_shift = (copies - 1) * period
        out = _Deep(AllocationTrace(), self.role, self.batch, later_shift)
        start_of_sweep = {runs[0].positions[0]: number for number, runs in enumerate(self.sweeps)}
        mark_at = {index: name for name, index in trace.marks.items()}
        index = 0
        while index < len(trace.events):
            if index in mark_at:
                out.trace.marks[mark_at[index]] = len(out.trace.events)
            if index not in start_of_sweep:
                _emit(trace, index, tags[index], 0, out)
                index += 1
                continue
            runs = self.sweeps[start_of_sweep[index]]
            for run, shift in _expanded(runs, self.template, copies, later_shift):
                for position in run.positions:
                    if position in mark_at and position != index:
                        out.trace.marks[mark_at[position]] = len(out.trace.events)
                    _emit(trace, position, tags[position], shift, out)
            index = runs[-1].positions[-1] + 1
        for name in trace.marks.keys() - out.trace.marks.keys():  # marks at the very end
            out.trace.marks[name] = len(out.trace.events)
        return out.trace


_Role = tuple[int, int, int, bool | None]
"""An allocation's role: (sweep, position in its block's run as aligned with the template's,
block, later). `later` None: aligned, copied with its block; else the run's own event, not
copied, moved past the copies if its block comes after the template (`later`)."""


@dataclass
class _Deep:
    """The deep trace being made: its allocations alive, the copies made of each shallow
    allocation, and the shallow frees that free every copy (`_freed_at_once`)."""

    trace: AllocationTrace
    role: dict[Any, _Role]
    batch: set[int]
    later_shift: int
    live: set[Any] = field(default_factory=set)
    copies: dict[Any, list[Any]] = field(default_factory=dict)


def _freed_at_once(trace: AllocationTrace, role: dict[Any, _Role], period: int) -> set[int]:
    """The frees, among frees made one after another, of one role's allocations in more
    blocks than a period: a cache cleared at once (autocast's casts of every block's weights,
    as backward begins), which in the deep model frees every copy, not one at a distance."""
    batch: set[int] = set()
    group: list[int] = []
    for index, event in enumerate([*trace.events, ("end",)]):
        if event[0] == "free":
            group.append(index)
            continue
        blocks: dict[tuple[int, int], set[int]] = {}
        for free in group:
            number, aligned, block, _ = role.get(trace.events[free][1], (0, 0, -1, None))
            blocks.setdefault((number, aligned), set()).add(block)
        for free in group:
            where = role.get(trace.events[free][1])
            if where is not None and len(blocks[where[:2]]) > period:
                batch.add(free)
        group = []
    return batch


def _emit(trace: AllocationTrace, index: int, tag: int | None, shift: int, out: _Deep) -> None:
    """Event `index` of the shallow trace for the block `shift` blocks further on. What is
    allocated outside the part of a run that all blocks share (the embedding, the head) has
    no copies: whoever frees it frees the one allocation, where its block was moved to; a
    free made at once with others of its kind (`_freed_at_once`) frees every copy alive."""
    event = trace.events[index]
    where = out.role.get(event[1])
    if where is None:
        key = event[1]
    else:
        number, aligned, block, later = where
        moved = shift if later is None else out.later_shift if later else 0
        key = (number, aligned, block + moved)
    if event[0] == "alloc":
        if key in out.live:
            raise CannotDeepen(f"allocation {key} made twice")
        out.live.add(key)
        out.copies.setdefault(event[1], []).append(key)
        out.trace.events.append(("alloc", key, event[2], event[3]))
        out.trace.sources.append(index)
        out.trace.categories[key] = trace.categories.get(event[1], "other")
        out.trace.tags.append(None if tag is None else tag + shift)
        return
    if index in out.batch:
        keys = [k for k in out.copies.get(event[1], ()) if k in out.live]
    else:
        keys = [key]
    for key in keys:
        if key not in out.live:
            raise CannotDeepen(
                f"event {index} (block {tag}, moved {shift}) frees {where or event[1]} as "
                f"{key}, which is not allocated"
            )
        out.live.remove(key)
        out.trace.events.append(("free", key))
        out.trace.sources.append(index)
        out.trace.tags.append(None if tag is None else tag + shift)


def _expanded(
    runs: list[_Run], template: range, copies: int, later_shift: int
) -> list[tuple[_Run, int]]:
    """A sweep's runs in the deep model's order, each with the blocks it moves by."""
    inside = [i for i, run in enumerate(runs) if run.tag in template]
    if not inside:
        return [(run, later_shift if run.tag > template[-1] else 0) for run in runs]
    first, last = inside[0], inside[-1]
    if inside != list(range(first, last + 1)):
        raise CannotDeepen("a sweep leaves the template and comes back")
    before, group, after = runs[:first], runs[first : last + 1], runs[last + 1 :]
    if len(group) > 1:
        ascending = group[0].tag < group[-1].tag
    else:  # one block's run: the sweep's direction is its neighbours'
        ascending = (
            before[-1].tag < group[0].tag if before else not after or after[0].tag > group[0].tag
        )
    shifts = [c * len(template) for c in range(copies)]
    repeated = [(run, shift) for shift in (shifts if ascending else shifts[::-1]) for run in group]
    moved = [(run, later_shift if run.tag > template[-1] else 0) for run in before + after]
    return moved[: len(before)] + repeated + moved[len(before) :]


def _alignments(
    trace: AllocationTrace, runs: list[_Run], template: range, freed_in: dict[Any, int]
) -> list[dict[int, int]]:
    """Which events of each run are the ones all blocks share, by their position in the
    template run of the same block of the period: every event of a run alike; for the first
    block's runs (the embedding before its forward, a second prefetch, the embedding's
    backward after it) the events matched to the template's in order. The events left out are
    the run's own: they have no copies."""
    by_tag = {run.tag: run for run in runs}
    alignments = []
    for run in runs:
        model = by_tag.get(template[0] + (run.tag - template[0]) % len(template))
        mine = _signature(trace, run, freed_in)
        theirs = mine if model is None else _signature(trace, model, freed_in)
        if mine == theirs:
            alignments.append(dict(zip(range(len(mine)), range(len(mine)), strict=True)))
            continue
        matcher = difflib.SequenceMatcher(None, mine, theirs, autojunk=False)
        alignments.append(
            {i + n: j + n for i, j, size in matcher.get_matching_blocks() for n in range(size)}
        )
    return alignments


def _signature(
    trace: AllocationTrace, run: _Run, freed_in: dict[Any, int]
) -> list[tuple[Any, ...]]:
    """A run's events as matched to the template's: an allocation by its size, stream and the
    sweep that frees it (the model's rotary table made in block 0's forward and freed as
    forward ends is not a block's post-forward shard of the same size, freed in backward)."""
    out: list[tuple[Any, ...]] = []
    for position in run.positions:
        event = trace.events[position]
        if event[0] == "alloc":
            out.append(("alloc", *event[2:], freed_in.get(event[1])))
        else:
            out.append(("free",))
    return out


def _freeing_sweeps(trace: AllocationTrace, sweeps: list[list[_Run]]) -> dict[Any, int]:
    """The sweep whose events free each allocation (-1: an untagged event between sweeps)."""
    sweep_at = {p: number for number, runs in enumerate(sweeps) for r in runs for p in r.positions}
    return {
        event[1]: sweep_at.get(position, -1)
        for position, event in enumerate(trace.events)
        if event[0] == "free"
    }


def _effective_tags(trace: AllocationTrace) -> list[int | None]:
    """The trace's tags, with untagged events between two blocks' events counted as the
    second's (AdamW's step counters, made from nothing before a parameter's moments; between
    two events of one block, that block's), and an untagged free as its allocation's block."""
    tags = list(trace.tags)
    previous: int | None = None
    gap: list[int] = []
    for position, tag in enumerate(trace.tags):
        if tag is None:
            gap.append(position)
            continue
        if gap and previous is not None and abs(tag - previous) <= 1:
            for inside in gap:
                tags[inside] = tag
        gap, previous = [], tag
    tag_of: dict[Any, int | None] = {}
    for position, event in enumerate(trace.events):
        if event[0] == "alloc":
            tag_of[event[1]] = tags[position]
        elif tags[position] is None:
            tags[position] = tag_of.get(event[1])
    return tags


def _sweeps(tags: list[int | None], period: int = 1) -> list[list[_Run]]:
    """Runs of equal tags, grouped into sweeps: consecutive runs whose blocks step by one in
    one direction (or by up to a period: what happens once per FSDP group of blocks:K). A run
    where the direction turns (forward's last block, then backward's) ends the sweep it
    belongs to; an untagged event ends it too."""
    runs: list[_Run] = []
    separated: list[bool] = []  # an untagged event before the run
    gap = True
    for position, tag in enumerate(tags):
        if tag is None:
            gap = True
            continue
        if runs and not gap and runs[-1].tag == tag:
            runs[-1].positions.append(position)
        else:
            runs.append(_Run(tag, [position]))
            separated.append(gap)
        gap = False
    sweeps: list[list[_Run]] = []
    direction = 0
    for run, after_gap in zip(runs, separated, strict=True):
        step = run.tag - sweeps[-1][-1].tag if sweeps and not after_gap else 0
        sign = (step > 0) - (step < 0)
        if 0 < abs(step) <= period and direction in (0, sign):
            sweeps[-1].append(run)
            direction = sign
        else:
            sweeps.append([run])
            direction = 0
    return sweeps
