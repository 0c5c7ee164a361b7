"""The analytic memory model: the seeds' exercises, exactly, and its terms on real shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_bench.config.presets import PRESETS
from fsdp_bench.config.run import (
    DataConfig,
    FsdpConfig,
    MemoryConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
)
from fsdp_bench.config.schema import to_plain
from fsdp_bench.memory.analytic import GB, analytic_estimate, peak_lower_bound, steady_state_bytes
from fsdp_bench.memory.estimate import overhead
from fsdp_bench.store import ResultStore, RunResult


def test_seed_000_sharded_steady_state_and_lower_bound() -> None:
    # 12 GB weights + 12 GB gradients + 72 GB optimizer state over 8 ranks: 12 GB per rank;
    # plus a 3 GB largest unsharded group and a 3 GB prefetch: 18 GB before activations.
    steady = steady_state_bytes(12 * GB, 12 * GB, 72 * GB, ranks=8)
    assert steady == 12 * GB
    assert peak_lower_bound(steady, largest_group=3 * GB, prefetch=3 * GB) == 18 * GB


def test_seed_001_mixed_precision_adam_arithmetic() -> None:
    # 16 bytes per parameter (bf16 weights and gradients, fp32 master, two Adam moments):
    # 7B parameters need 112 GB unsharded; 70B over 16 ranks about 70 GB each.
    assert steady_state_bytes(7e9 * 2, 7e9 * 2, 7e9 * 12, ranks=1) == 112 * GB
    assert steady_state_bytes(70e9 * 2, 70e9 * 2, 70e9 * 12, ranks=16) == pytest.approx(70 * GB)


def test_sharded_terms_divide_by_the_shard_group() -> None:
    def terms(world_size: int) -> dict[str, float]:
        run = RunConfig(world_size=world_size, model=ModelConfig(name="llama3-8b"))
        return analytic_estimate(run).terms

    eight, sixty_four = terms(8), terms(64)
    params = PRESETS["llama3-8b"].num_params
    assert eight["sharded_parameters"] == pytest.approx(params * 4 / 8, rel=1e-4)
    assert eight["optimizer_state"] == pytest.approx(params * 8 / 8, rel=1e-4)
    assert sixty_four["sharded_gradients"] == pytest.approx(
        eight["sharded_gradients"] / 8, rel=1e-3
    )
    assert sixty_four["largest_unsharded_group"] == eight["largest_unsharded_group"]


def test_the_estimate_carries_the_seed_lower_bound() -> None:
    run = RunConfig(world_size=8, model=ModelConfig(name="llama3-8b"), fsdp=FsdpConfig(prefetch=2))
    estimate = analytic_estimate(run)
    t = estimate.terms
    steady = t["sharded_parameters"] + t["sharded_gradients"] + t["optimizer_state"]
    bound = steady + t["largest_unsharded_group"] + t["prefetch_buffer"]
    assert estimate.lower_bound_bytes == pytest.approx(bound)
    assert t["prefetch_buffer"] > 0 and estimate.lower_bound_bytes < estimate.peak_bytes


def test_knobs_move_the_terms_they_should() -> None:
    base = RunConfig(
        world_size=8, model=ModelConfig(name="llama3-1b"), data=DataConfig(seq_len=2048)
    )

    def with_(**changes: object) -> dict[str, float]:
        fsdp = {k: v for k, v in changes.items() if k in FsdpConfig.__dataclass_fields__}
        train = {k: v for k, v in changes.items() if k in TrainConfig.__dataclass_fields__}
        run = RunConfig(
            world_size=8, model=base.model, data=base.data,
            fsdp=FsdpConfig(**fsdp), train=TrainConfig(**train),  # type: ignore[arg-type]
        )  # fmt: skip
        return analytic_estimate(run).terms

    plain = with_()
    assert (
        with_(reshard_after_forward=False)["kept_unsharded_parameters"]
        > 0
        == plain["kept_unsharded_parameters"]
    )
    assert with_(prefetch=2)["prefetch_buffer"] == 2 * plain["prefetch_buffer"]
    assert with_(activation_checkpointing="block")["activations"] < plain["activations"] / 4
    assert with_(mixed_precision="bf16")["largest_unsharded_group"] == (
        plain["largest_unsharded_group"] / 2
    )
    synced_last = with_(accumulation_steps=4, grad_sync="last")
    # every group keeps its gradients, not just the largest (the 0.26B embedding of 1.24B)
    assert synced_last["unsharded_gradients"] > 4 * plain["unsharded_gradients"]
    assert with_(grouping="root")["largest_unsharded_group"] > plain["largest_unsharded_group"]
    assert with_(optimizer="sgd")["optimizer_state"] == 0


def test_the_overhead_is_calibrated_per_device_and_world_size(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    cases = [("H100", 8, used) for used in (10.0, 11.0, 12.0, 13.0, 20.0)]
    cases += [("A100", 8, 15.0), ("H100", 64, 30.0)]
    for index, (device, world_size, used) in enumerate(cases):
        run = RunConfig(world_size=world_size, data=DataConfig(seed=index))
        store.record(
            RunResult(
                run_id=run.run_id, status="ok", config=to_plain(run), estimated_peak_gib=5.0,
                device_used_peak_gib=used, provenance={"device_name": f"NVIDIA {device}"},
            )
        )  # fmt: skip
    overheads = overhead(MemoryConfig(), store)
    # world size 8: p90 of H100's gaps (5, 6, 7, 8, 15) is 12.2; A100's one gap is 10
    assert overheads.at(8).gib == pytest.approx(12.2)
    assert "NVIDIA A100, NVIDIA H100; world size 8" in overheads.at(8).source
    assert overheads.at(64).gib == pytest.approx(25.0)
    assert "all world sizes" in overheads.at(16).source  # never measured at 16
    assert overhead(MemoryConfig(overhead_gib=6.0), store).at(8).gib == 6.0
    assert overhead(MemoryConfig(), ResultStore(tmp_path / "empty")).at(8).gib == 0.0


def test_cpu_offload_moves_the_sharded_state_to_the_host() -> None:
    def estimate(offload: bool) -> tuple[float, float]:
        run = RunConfig(
            world_size=8, model=ModelConfig(name="llama3-8b"), fsdp=FsdpConfig(cpu_offload=offload)
        )
        found = analytic_estimate(run)
        return found.peak_bytes, found.host_bytes

    (resident, none), (on_device, host) = estimate(False), estimate(True)
    params = PRESETS["llama3-8b"].num_params
    assert none == 0 and host == pytest.approx(params * 16 / 8, rel=1e-3)  # fp32 + grad + Adam
    assert on_device == pytest.approx(resident - host)


@pytest.mark.slow
def test_the_simulated_offload_estimate_is_the_devices_share() -> None:
    from fsdp_bench.memory.simulate import simulate

    def run(offload: bool) -> RunConfig:
        return RunConfig(world_size=4, fsdp=FsdpConfig(cpu_offload=offload))

    resident, offloaded = simulate(run(False)), simulate(run(True))
    shards = resident.breakdown_bytes["optimizer_state"] // 2  # AdamW: two fp32 moments
    assert offloaded.host_bytes == pytest.approx(4 * shards, rel=0.01)
    assert "optimizer_state" not in offloaded.breakdown_bytes
    assert offloaded.peak_bytes < resident.peak_bytes - resident.breakdown_bytes["optimizer_state"]
