"""CUDA + NCCL: what only a GPU can show (allocator peaks, MFU, offload). Skipped without one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import sweep, tiny_grid

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"),
]


def test_cuda_run_reports_allocator_peaks_and_mfu(tmp_path: Path) -> None:
    world_size = min(torch.cuda.device_count(), 2)
    grid = tiny_grid(
        "gpu",
        [
            {"fsdp.cpu_offload": [False, True]},
            {"fsdp.mixed_precision": ["bf16"]},
            {"train.fp32_matmul": ["tf32"]},
            {"strategy": ["ddp"]},
        ],
        world_size=world_size,
        model={"name": "small"},
        measure={"warmup_steps": 2, "timed_steps": 5, "repeats": 2},
    )
    grid["launcher"]["device"] = "cuda"
    _, df = sweep(tmp_path, grid, verify=True)
    assert set(df.status) == {"ok"}, df[["run_id", "reason"]]
    # offload with --verify gathers CPU shards: gloo beside NCCL in that job
    assert set(df.backend) <= {"nccl", "cuda:nccl,cpu:gloo"} and set(df.device) == {"cuda"}
    assert (df.peak_memory_source == "cuda_max_memory_allocated").all()
    assert (df.peak_reserved_gib >= df.peak_memory_gib).all()
    assert (df.device_used_peak_gib >= df.peak_reserved_gib).all()  # + context, NCCL
    assert (df.device_used_at_init_gib > 0).all()  # the CUDA context, NCCL's buffers
    assert (df.device_used_peak_gib > df.device_used_at_init_gib).all()
    assert (df.gpu_other_processes.fillna(0) == 0).all(), "the GPU found by UUID, ours alone"
    # phases timed by CUDA events: backward is work on the device, not the CPU's ~1 us
    assert (df.backward_s >= 0.5 * df.forward_s).all(), df[["forward_s", "backward_s"]]
    want = {"ieee": "highest", "tf32": "high"}
    assert (df.parity_fp32_matmul == df.fp32_matmul.map(want)).all()
    assert (df.mfu > 0).all() and (df.mfu < 1).all() and df.peak_flops_source.notna().all()
    assert (df.sdpa_backend != "MATH").all(), df[["mixed_precision", "sdpa_backend"]]
    # nothing of an earlier run survives but cuBLAS's two 32 MiB workspaces (H200: 0.0625 GiB)
    assert (df.allocated_at_start_gib <= 0.0625 + 0.001).all(), df.allocated_at_start_gib
    assert df.parity_ok.all()
    offload = df[df.cpu_offload & (df.strategy == "fsdp")].iloc[0]
    resident = df[~df.cpu_offload & (df.strategy == "fsdp") & (df.mixed_precision == "fp32")].iloc[
        0
    ]
    # Offloaded shards and optimizer state live in host memory, not on the GPU.
    assert offload.peak_memory_gib < resident.peak_memory_gib


def test_local_rank_picks_the_device(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("no GPU pair: needs 2 GPUs")
    grid = tiny_grid("two_gpus", {"data.seed": [0]})
    grid["launcher"]["device"] = "cuda"
    _, df = sweep(tmp_path, grid)
    assert df.status.tolist() == ["ok"]
