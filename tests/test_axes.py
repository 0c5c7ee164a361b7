"""Every axis of a grid changes what runs: shown by exact collective counts and tracked memory.

One real sweep (the quickstart's: gloo, two processes on loopback) covers the axes, and one
verified sweep at four ranks the settings that need them (HSDP, an int reshard, FSDP2's newer
knobs); the assertions are the FSDP2 facts of seed 000: one all-gather per group unshard, one
reduce-scatter per group reduction, resharding after forward costs one more all-gather per
group in backward.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from fsdp_bench import load_results
from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.config.grid import expand, load_grid
from fsdp_bench.config.run import RunConfig
from fsdp_bench.errors import ConfigError
from tests.conftest import sweep, tiny_grid

pytestmark = pytest.mark.slow

GROUPS = {"root": 1, "block": 5, "blocks:2": 3, "linear": 30}  # tiny: 4 blocks x 7 Linears + head


@pytest.fixture(scope="module")
def table(quickstart_sweep: tuple[Path, object]) -> pd.DataFrame:
    """The quickstart's own sweep, run once per session (`conftest.quickstart_sweep`): every
    axis this module checks is in it (grouping x reshard at world sizes 1 and 2, then one
    knob at a time against block grouping at 2, and the DDP baseline)."""
    df = load_results(quickstart_sweep[0])
    assert set(df["status"]) == {"ok"}, df[["run_id", "status", "reason"]]
    return df


def one(df: pd.DataFrame, **where: object) -> pd.Series:
    mask = pd.Series(True, index=df.index)
    defaults = {
        "world_size": 2,
        "strategy": "fsdp",
        "grouping": "block",
        "reshard_after_forward": "default",
        "prefetch": "implicit",
        "accumulation_steps": 1,
        "grad_sync": "every",
        "mixed_precision": "fp32",
        "activation_checkpointing": "none",
        "cpu_offload": False,
    }
    for column, value in {**defaults, **where}.items():
        mask &= df[column].map(lambda v, value=value: type(v) is type(value) and v == value)
    rows = df[mask]
    assert len(rows) == 1, f"{where}: {len(rows)} rows"
    return rows.iloc[0]


KNOBS = {
    "plain": {"data.seed": 0},
    "all_reduce_last": {"train.grad_sync": "all_reduce_last"},
    "reshard after last": {"fsdp.reshard_after_backward": "last"},
    "staging, uncast inputs": {
        "fsdp.reduce_scatter_buffers": 2,
        "fsdp.separate_reduce_scatter_group": True,
        "fsdp.comm_buffers_from_process_group": True,
        "fsdp.cast_forward_inputs": False,
        "fsdp.mixed_precision": "bf16",
    },
}
"""FSDP2's newer knobs, one at a time, under HSDP with two micro-batches."""
FOUR_RANKS = {
    "fsdp": {"strategy": "fsdp", "fsdp.reshard_after_forward": False},
    "hsdp": {"strategy": "hsdp", "fsdp.reshard_after_forward": False},
    "reshard to 2, seed 0": {"fsdp.reshard_after_forward": 2, "data.seed": 0},
    "reshard to 2, seed 1": {"fsdp.reshard_after_forward": 2, "data.seed": 1},
    **{
        f"knob: {name}": {"strategy": "hsdp", "train.accumulation_steps": 2, **change}
        for name, change in KNOBS.items()
    },
}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pd.Series]:
    """One verified sweep at world size 4 (shard groups of 2) for the tests that need four
    ranks, one job for all (a job's start costs more than a tiny run): each setting's row,
    by the names of FOUR_RANKS."""
    folder = tmp_path_factory.mktemp("four-ranks")
    axes = [{key: [value] for key, value in change.items()} for change in FOUR_RANKS.values()]
    grid = tiny_grid("four-ranks", axes, world_size=4, fsdp={"shard_group_size": 2})
    _, df = sweep(folder, grid, verify=True)
    assert set(df.status) == {"ok"} and df.parity_ok.all(), df[["run_id", "status", "reason"]]
    runs = expand(load_grid(folder / "four-ranks.yaml")).runs
    by_id = df.set_index("run_id")
    return {name: by_id.loc[run.run_id] for name, run in zip(FOUR_RANKS, runs, strict=True)}


@pytest.mark.parametrize("grouping", list(GROUPS))
def test_grouping_and_resharding_set_the_collectives(table: pd.DataFrame, grouping: str) -> None:
    groups = GROUPS[grouping]
    # one group for the whole model: false is FSDP2's default, one run (RunConfig.canonical)
    kept = "default" if grouping == "root" else False
    no_reshard = one(table, grouping=grouping, reshard_after_forward=kept)
    reshard = one(table, grouping=grouping, reshard_after_forward=True)
    default = one(table, grouping=grouping)
    for row in (no_reshard, reshard, default):
        assert row.num_groups == groups
        assert row.reduce_scatters_per_step == groups  # one reduction per group
    assert no_reshard.all_gathers_per_step == groups  # forward only
    assert reshard.all_gathers_per_step == 2 * groups  # again in backward
    # FSDP2's default reshards every group but the root, which backward needs at once.
    assert default.all_gathers_per_step == max(2 * groups - 1, 1)


def test_root_is_one_all_gather_of_the_whole_model(table: pd.DataFrame) -> None:
    root = one(table, grouping="root")
    block = one(table, grouping="block")
    assert root.all_gathers_per_step == 1
    assert root.largest_group_bytes == root.all_gather_bytes_per_step
    assert root.largest_group_bytes > 3 * block.largest_group_bytes


def test_resharding_trades_memory_for_all_gathers(table: pd.DataFrame) -> None:
    kept = one(table, reshard_after_forward=False)
    freed = one(table, reshard_after_forward=True)
    assert kept.tracked_peak_gib > freed.tracked_peak_gib


def test_explicit_prefetch_issues_all_gathers_ahead(table: pd.DataFrame) -> None:
    implicit, depth1, depth2 = (one(table, prefetch=p) for p in ("implicit", 1, 2))
    # Same collectives, issued earlier: before block 0 computes, the root and block 0 are
    # gathered, plus `depth` blocks ahead.
    assert (
        implicit.all_gathers_per_step == depth1.all_gathers_per_step == depth2.all_gathers_per_step
    )
    assert implicit.all_gathers_before_compute == 2
    assert depth1.all_gathers_before_compute == 3
    assert depth2.all_gathers_before_compute == 4


def test_accumulation_multiplies_collectives_unless_sync_is_last(table: pd.DataFrame) -> None:
    single = one(table)
    every = one(table, accumulation_steps=2, grad_sync="every")
    last = one(table, accumulation_steps=2, grad_sync="last")
    assert every.all_gathers_per_step == 2 * single.all_gathers_per_step
    assert every.reduce_scatters_per_step == 2 * single.reduce_scatters_per_step
    assert last.reduce_scatters_per_step == single.reduce_scatters_per_step
    assert last.all_gathers_per_step == every.all_gathers_per_step
    # Skipping the sync keeps unsharded gradients between micro-batches: more memory.
    assert last.tracked_peak_gib > every.tracked_peak_gib


def test_bf16_halves_all_gather_bytes_and_keeps_fp32_reduction(table: pd.DataFrame) -> None:
    fp32 = one(table)
    bf16 = one(table, mixed_precision="bf16")
    assert bf16.all_gather_bytes_per_step == pytest.approx(
        fp32.all_gather_bytes_per_step / 2, rel=1e-3
    )
    assert bf16.reduce_scatter_bytes_per_step == fp32.reduce_scatter_bytes_per_step
    assert bf16.tracked_peak_gib < fp32.tracked_peak_gib


def test_activation_checkpointing_saves_activation_memory(table: pd.DataFrame) -> None:
    plain = one(table)
    checkpointed = one(table, activation_checkpointing="block")
    assert checkpointed.tracked_peak_gib < plain.tracked_peak_gib
    assert (
        checkpointed.memory_breakdown_gib["activation"] < plain.memory_breakdown_gib["activation"]
    )


def test_cpu_offload_runs(table: pd.DataFrame) -> None:
    # On a CPU-only machine the offload policy has nowhere to move parameters from (the
    # effect is measured by the gpu tests); here it must still run and communicate the same.
    offload = one(table, cpu_offload=True)
    assert offload.status == "ok"
    assert offload.all_gathers_per_step == one(table).all_gathers_per_step


def test_world_size_one_needs_no_collectives(table: pd.DataFrame) -> None:
    single = one(table, world_size=1)
    assert single.all_gathers_per_step == 0 and single.reduce_scatters_per_step == 0
    assert one(table).all_gathers_per_step > 0


def test_ddp_all_reduces_instead(tmp_path: Path) -> None:
    grid = tiny_grid("ddp", {"train.accumulation_steps": [1, 2]}, strategy="ddp",
                     train={"grad_sync": "last"})  # fmt: skip
    _, runs = sweep(tmp_path, grid)
    ddp = one(runs, strategy="ddp", grad_sync="last")
    ddp_accum = one(runs, strategy="ddp", accumulation_steps=2, grad_sync="last")
    assert ddp.all_gathers_per_step == 0 and ddp.reduce_scatters_per_step == 0
    assert ddp.all_reduces_per_step >= 1
    # no_sync on the first micro-batch: the same all-reduces for twice the tokens
    assert ddp_accum.all_reduces_per_step == ddp.all_reduces_per_step
    params_bytes = ddp.num_params * 4
    assert ddp.all_reduce_bytes_per_step == params_bytes
    assert ddp.largest_group_bytes == params_bytes  # DDP keeps the whole model on every rank


def test_throughput_and_provenance_columns(table: pd.DataFrame) -> None:
    row = one(table)
    tokens_per_step = row.world_size * row.micro_batch_size * row.seq_len
    assert row.tokens_per_s == pytest.approx(tokens_per_step / row.step_time_s)
    assert row.tokens_per_s_per_rank == pytest.approx(row.tokens_per_s / 2)
    assert row.peak_memory_gib == row.tracked_peak_gib
    assert row.backend == "gloo" and row.device == "cpu"
    assert len(row.hostnames) == 1 and row.torch_version.startswith("2.")
    assert pd.isna(row.mfu)  # no peak-FLOPS figure for a CPU


def test_hsdp_shards_inside_groups_and_all_reduces_across(
    four_ranks: dict[str, pd.Series],
) -> None:
    fsdp, hsdp = four_ranks["fsdp"], four_ranks["hsdp"]
    assert fsdp.all_reduces_per_step == 0
    assert hsdp.all_reduces_per_step == hsdp.reduce_scatters_per_step == 5  # one per group
    # A shard group of 2 instead of 4: each rank keeps twice the optimizer state.
    assert hsdp.memory_breakdown_gib["optimizer_state"] == pytest.approx(
        2 * fsdp.memory_breakdown_gib["optimizer_state"], rel=0.05
    )


def test_an_int_reshard_trains_correctly_run_after_run(four_ranks: dict[str, pd.Series]) -> None:
    """Runs of one job share the post-forward mesh of reshard_after_forward=2 at W=4."""
    for seed in (0, 1):  # resharded: backward all-gathers again
        assert four_ranks[f"reshard to 2, seed {seed}"].all_gathers_per_step == 10


def test_every_block_but_the_last_reshards(tmp_path: Path) -> None:
    """torchtitan's policy: the last block group keeps its parameters to backward, which
    needs it first. 4 blocks at W=2: block grouping's 5 forward all-gathers and 3 in
    backward (default: 4); blocks:2 has 3 forward and 1 in backward. Parity holds and the
    estimate is the tracked peak."""
    axes = {"fsdp.grouping": ["block", "blocks:2"], "fsdp.reshard_after_forward": ["all_but_last"]}
    _, df = sweep(tmp_path, tiny_grid("all-but-last", axes), verify=True)
    assert set(df.status) == {"ok"} and df.parity_ok.all(), df[["status", "reason"]]
    counts = dict(zip(df.grouping, df.all_gathers_per_step, strict=True))
    assert counts == {"block": 8, "blocks:2": 4}
    assert (df.estimated_peak_gib == df.tracked_peak_gib).all()
    with pytest.raises(ConfigError, match="all_but_last names the last block: it needs "):
        RunConfig(fsdp=FsdpConfig(grouping="linear", reshard_after_forward="all_but_last"))


def test_practitioners_settings_run_verify_and_estimate(tmp_path: Path) -> None:
    """Each setting torchtitan's configs use, against the plain run (tiny, 4 blocks, W=2):
    every one trains correctly and its estimate is within 5% of the tracked peak. The
    collectives are exact: bf16 reduction halves the reduce-scatter bytes; clipping adds one
    all-reduce per step, of one fp32 norm per parameter tensor (39: 9 in each of 4 blocks,
    the embedding, the final norm, the head), which DTensor sums over the shards."""
    settings = {
        "plain": {"data.seed": 0},
        "bf16 reduce": {"fsdp.reduce_dtype": "bf16"},
        "bf16 storage": {"model.dtype": "bf16", "fsdp.mixed_precision": "bf16"},
        "bf16 compute": {"fsdp.mixed_precision": "bf16"},
        "block AC": {"fsdp.activation_checkpointing": "block"},
        "every_2 AC": {"fsdp.activation_checkpointing": "every_2"},
        "selective_op AC": {"fsdp.activation_checkpointing": "selective_op"},
        "fused": {"train.optimizer_impl": "fused"},
        "for_loop": {"train.optimizer_impl": "for_loop"},
        "clipped": {"train.max_grad_norm": 1.0},
    }
    axes = [{key: [value] for key, value in change.items()} for change in settings.values()]
    _, df = sweep(tmp_path, tiny_grid("practitioners", axes), verify=True)
    assert set(df.status) == {"ok"} and df.parity_ok.all(), df[["run_id", "status", "reason"]]
    error = (df.estimated_peak_gib / df.tracked_peak_gib - 1).abs()
    assert (error < 0.05).all(), df[["run_id", "estimated_peak_gib", "tracked_peak_gib"]]
    spec = expand(load_grid(tmp_path / "practitioners.yaml")).runs
    by_id = df.set_index("run_id")
    row = {name: by_id.loc[run.run_id] for name, run in zip(settings, spec, strict=True)}
    plain = row["plain"]
    assert row["bf16 reduce"].reduce_scatter_bytes_per_step == (
        plain.reduce_scatter_bytes_per_step // 2
    )
    clipped = row["clipped"]
    assert (clipped.all_reduces_per_step, clipped.all_reduce_bytes_per_step) == (1, 39 * 4)
    assert plain.all_reduces_per_step == 0
    state = {name: row[name].memory_breakdown_gib["optimizer_state"] for name in row}
    assert state["bf16 storage"] == pytest.approx(state["bf16 compute"] / 2, rel=0.01)
    activations = {name: row[name].memory_breakdown_gib.get("activation", 0.0) for name in row}
    assert activations["block AC"] < activations["every_2 AC"] < activations["plain"]
    assert activations["selective_op AC"] < activations["plain"]


def test_fsdp2_communication_knobs_run_verify_count_and_estimate(
    four_ranks: dict[str, pd.Series],
) -> None:
    """FSDP2's newer knobs under HSDP (2 replicas of 2 ranks, 2 micro-batches, tiny: 5
    groups): each trains correctly (the fixture's parity) and is estimated within 5% of its
    tracked peak. The counts are exact: HSDP reduce-scatters and all-reduces every group
    every micro-batch (10 and 10); all_reduce_last all-reduces once a step (10 and 5);
    parameters kept unsharded after the first backward spare the second micro-batch's
    forward all-gathers but the root's (13 instead of 18); the staging and overlap knobs, and
    uncast inputs, change none of it."""
    rows = {name: four_ranks[f"knob: {name}"] for name in KNOBS}
    for name, row in rows.items():
        assert abs(row.estimated_peak_gib / row.tracked_peak_gib - 1) < 0.05, name
    counts = {
        name: tuple(
            int(row[c])
            for c in ("all_gathers_per_step", "reduce_scatters_per_step", "all_reduces_per_step")
        )
        for name, row in rows.items()
    }
    assert counts["plain"] == counts["staging, uncast inputs"] == (18, 10, 10)
    assert counts["all_reduce_last"] == (18, 10, 5)
    assert counts["reshard after last"] == (13, 10, 10)
