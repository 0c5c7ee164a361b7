"""A deep model's allocation trace made from a shallow one's (`memory.deepen`), against the deep
model simulated: the same allocations and frees, in the same order, of the same sizes."""

from __future__ import annotations

import dataclasses

import pytest

from fsdp_bench.config import DataConfig, FsdpConfig, ModelConfig, RunConfig, TrainConfig
from fsdp_bench.memory.alloc_trace import AllocationTrace
from fsdp_bench.memory.deepen import CannotDeepen, deepen, grown, structure
from fsdp_bench.memory.fake_step import record_step, simulate_step
from fsdp_bench.memory.pool import in_subprocesses
from fsdp_bench.memory.repeat_step import repeat_step, repeats
from fsdp_bench.memory.simulate import _checked, _deepenings

DEEP = 12

CONFIGS = {
    "block": {},
    "root": {"fsdp": FsdpConfig(grouping="root")},  # its all-gather holds every block
    "bf16": {"fsdp": FsdpConfig(mixed_precision="bf16")},
    "prefetch-2": {"fsdp": FsdpConfig(prefetch=2)},
    "blocks-2": {"fsdp": FsdpConfig(grouping="blocks:2")},
    "every-2": {"fsdp": FsdpConfig(activation_checkpointing="every_2")},
    "selective-op": {"fsdp": FsdpConfig(activation_checkpointing="selective_op")},
    "all-but-last": {"fsdp": FsdpConfig(reshard_after_forward="all_but_last")},
    "reshard-to-2": {"fsdp": FsdpConfig(reshard_after_forward=2)},
    "bf16-reduce": {"fsdp": FsdpConfig(mixed_precision="bf16", reduce_dtype="bf16")},
    "accumulate-last": {"train": TrainConfig(accumulation_steps=2, grad_sync="last")},
    "clipped-fused": {"train": TrainConfig(max_grad_norm=1.0, optimizer_impl="fused")},
    "hsdp": {"strategy": "hsdp", "fsdp": FsdpConfig(shard_group_size=2)},
    "ddp": {"strategy": "ddp"},  # its buckets hold every block: sizes that grow
}


def _run(name: str) -> RunConfig:
    return RunConfig(
        world_size=4,
        model=ModelConfig(name="small", n_layers=DEEP),
        data=DataConfig(micro_batch_size=2, seq_len=64),
        **CONFIGS[name],
    ).canonical()


def _sized(trace: AllocationTrace) -> list[tuple[object, ...]]:
    sizes = [e[2] if e[0] == "alloc" else 0 for e in trace.events]
    return list(zip(structure(trace), sizes, strict=True))


def compare(name: str) -> tuple[str, int, bool, bool, bool]:
    """(name, shallow blocks, one step simulated, same structure, same sizes) of the deep trace
    made as the estimate makes it (`_checked`: the plan whose one-period check holds, its
    shallow trace) and the deep model simulated; top level, for the process pool."""
    run = _run(name)
    own = _checked(run, "cuda", _deepenings(run))
    made = grown(
        own.shallow.deepened(DEEP), own.growth, (DEEP - own.plan.blocks) // own.plan.period
    )
    simulated = record_step(run, "cuda").trace
    same, sized = structure(made) == structure(simulated), _sized(made) == _sized(simulated)
    return name, own.plan.blocks, own.one_step, same, sized


@pytest.mark.slow
def test_deepened_traces_are_the_simulated_ones() -> None:
    """Every configuration deepens exactly, from a trace of one simulated step. Where a block
    frees what the block two before it made (an explicit prefetch's all-gather, an input kept
    without checkpointing), the template needs a period like it before it: the second plan,
    a period deeper, whose shallow trace the first plan's failed check already simulated."""
    results = in_subprocesses(compare, list(CONFIGS), user_code=False)
    found = {name: rest for _, (name, *rest) in results}
    assert all(same and sized for _, _, same, sized in found.values()), found
    assert all(one_step for _, one_step, _, _ in found.values()), found
    # With checkpointing a block's input is freed by the block itself: the first plan holds
    # (3 blocks; every_2: 2 + a period of 2 + 2); without, the second one.
    assert found["selective-op"][0] == 3 and found["every-2"][0] == 6, found
    assert found["block"][0] == 4 and found["prefetch-2"][0] == 6, found


def test_the_trace_gives_the_trackers_peak() -> None:
    """What the estimate reads from a trace is what the tracker measures (the batch apart,
    as the tracker leaves it apart), category by category."""
    run = dataclasses.replace(_run("block"), model=ModelConfig(name="small", n_layers=3))
    peak, parts = record_step(run, "cuda").trace.live_peak("step")
    tracked = simulate_step(run, "cuda")
    assert peak == tracked.peak_bytes
    for category in ("parameter", "optimizer_state"):
        assert parts[category] == tracked.breakdown_bytes[category], category


def test_a_free_without_its_allocation_refuses_to_deepen() -> None:
    """Every copy of block 1 frees one allocation made before the blocks: a trace that is
    not a repetition of its template is refused, never guessed."""
    trace = AllocationTrace(
        events=[("alloc", "x", 512, "default"), ("alloc", "a", 512, "default"), ("free", "x")]
        + [("alloc", f"b{i}", 512, "default") for i in range(3)],
        tags=[None, 0, 1, 2, 3, 4],
    )
    with pytest.raises(CannotDeepen, match="not allocated"):
        deepen(trace, 5, 7, 1, 1)


@pytest.mark.slow
def test_runs_alike_but_for_world_size_share_one_check_and_keep_their_own_figures() -> None:
    """The one-period check of the first run stands for runs whose traces deepen into the same
    events (`simulate_alike`); each still gets its own figures, equal to those of a run
    checked alone."""
    from fsdp_bench.memory.simulate import simulate, simulate_alike

    runs = [dataclasses.replace(_run("block"), world_size=w) for w in (2, 4, 8)]
    shared = simulate_alike(runs, device_type="cuda")
    alone = [simulate(run, device_type="cuda") for run in runs]
    assert ["ranks" in s.method for s in shared] == [False, True, True], [s.method for s in shared]
    figures = [[(s.peak_bytes, s.allocated_bytes, s.reserved_bytes) for s in found]
               for found in (shared, alone)]  # fmt: skip
    assert figures[0] == figures[1]
    assert len({peak for peak, _, _ in figures[0]}) == 3  # the shards' sizes differ


def test_a_rotary_table_is_not_taken_for_a_blocks_post_forward_shard() -> None:
    """Llama-3-8B at 64 ranks resharded to 8 after forward: each block's post-forward shard of
    wk (1 MiB) has the size of the rotary tables made before block 0, which are freed as
    forward ends. Matched by size alone, block 0's table was a copy of the shards, its free
    moved with the head, and the run fell back to the whole model (32 s instead of 2)."""
    from fsdp_bench.memory.simulate import simulate

    run = RunConfig(
        world_size=64,
        model=ModelConfig(name="llama3-8b"),
        data=DataConfig(micro_batch_size=1, seq_len=4096),
        fsdp=FsdpConfig(reshard_after_forward=8, mixed_precision="bf16",
                        activation_checkpointing="block"),
    ).canonical()  # fmt: skip
    assert simulate(run, device_type="cuda").method.startswith("deepened from 3 blocks")


def test_the_measured_step_is_the_warmup_step_repeated() -> None:
    """The second step of a simulation allocates what the first did, but the optimizer's
    state (made once, lazily, by the first step) and frees of what set-up made; with them
    the whole trace is made from one step, event for event, with tags and categories."""
    run = dataclasses.replace(_run("bf16"), model=ModelConfig(name="small", n_layers=3))
    trace = record_step(run, "cuda").trace
    assert repeats(trace)
    one = record_step(run, "cuda", steps=1).trace
    made = repeat_step(one)
    assert _sized(made) == _sized(trace) and made.tags == trace.tags
    state = [k for k, category in one.categories.items() if category == "optimizer_state"]
    assert state and not any(("again", k) in made.categories for k in state)


def test_a_second_step_that_differs_is_not_taken_for_the_first_repeated() -> None:
    setup = [("alloc", "w", 512, "default")]
    first = [("alloc", "a", 1024, "default"), ("free", "a"), ("alloc", "s", 512, "default")]
    second = [("alloc", "b", 2048, "default"), ("free", "b")]  # not the first's size
    trace = AllocationTrace(
        events=setup + first + second,
        tags=[None] * 6,
        categories={"w": "parameter", "a": "temp", "s": "optimizer_state", "b": "temp"},
        marks={"warmup": 1, "step": 4},
    )
    assert not repeats(trace)
    trace.events[4] = ("alloc", "b", 1024, "default")
    assert repeats(trace)
