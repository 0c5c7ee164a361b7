"""What a rank decides by itself: failure classes from real error texts, its device, its threads,
and a timed region free of garbage collection."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import pytest
import torch

from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.config.measure import MeasureConfig
from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.presets import PRESETS
from fsdp_bench.config.run import RunConfig, TrainConfig
from fsdp_bench.errors import ConfigError
from fsdp_bench.job.failure_words import classify_text
from fsdp_bench.job.failures import classify
from fsdp_bench.job.measure.flops import peak_flops
from fsdp_bench.job.measure.timing import time_steps
from fsdp_bench.job.model.zoo import attention_backend, attention_inputs
from fsdp_bench.job.rendezvous import RankInfo, cpus_for_rank, pick_device, rank_info
from fsdp_bench.job.training import empty_host_cache
from fsdp_bench.job.watchdog import Watchdog
from fsdp_bench.job.worker import JobContext
from fsdp_bench.store import ResultStore

# Texts as torch, CUDA, cuBLAS, NCCL and gloo print them (shortened where they run on).
FAILURE_TEXTS = [
    ("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
     "capacity of 139.72 GiB of which 1.02 GiB is free.", "oom"),
    ("RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
     "reported at some other API call", "oom"),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
     "oom"),
    ("DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:2027, unhandled cuda error (run "
     "with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to "
     "CUDA function failed.\nLast error:\nCuda failure 'out of memory'", "oom"),
    ("RuntimeError: [enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't "
     "allocate memory: you tried to allocate 281474976710656 bytes.", "oom"),
    ("DistBackendError: [Rank 1] Watchdog caught collective operation timeout: "
     "WorkNCCL(SeqNum=12, OpType=_ALLGATHER_BASE, NumelIn=1048576, Timeout(ms)=30000) ran for "
     "30012 milliseconds before timing out.", "timeout"),
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
     "[127.0.0.1]:4411: Connection reset by peer", "peer"),
    ("DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with "
     "NCCL_DEBUG=WARN for details)", "error"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "expected"), FAILURE_TEXTS)
def test_failure_texts_are_classified(text: str, expected: str) -> None:
    assert classify_text(text) == expected


def test_a_torch_oom_is_oom_whatever_its_words() -> None:
    assert classify(torch.OutOfMemoryError("no words")) == "oom"
    assert classify(KeyboardInterrupt()) == "interrupted"


def test_each_local_rank_gets_a_gpu_of_its_own() -> None:
    assert pick_device("cuda", 1, device_count=2) == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match="local rank 2 has no GPU of its own: 2 visible"):
        pick_device("cuda", 2, device_count=2)
    assert pick_device("cpu", 5, device_count=0) == torch.device("cpu")


def test_threads_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    info = RankInfo(rank=0, local_rank=0, world_size=8, num_nodes=2, job_id="1", attempt=0)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "12")
    assert cpus_for_rank(info) == 12
    monkeypatch.delenv("SLURM_CPUS_PER_TASK")
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    assert cpus_for_rank(info) == 16  # 64 cores shared by the 4 ranks of this node


def test_no_garbage_collection_in_the_timed_steps(one_rank_group: None) -> None:
    seen: list[bool] = []
    measure = MeasureConfig(timed_steps=3, repeats=2)
    times = time_steps(lambda: seen.append(gc.isenabled()), measure, torch.device("cpu"))
    assert [len(repeat) for repeat in times] == [3, 3] and seen == [False] * 6
    assert gc.isenabled()


def test_the_watchdog_calls_a_phase_that_outlives_its_allowance() -> None:
    expired: list[tuple[str, float]] = []
    done = threading.Event()

    def on_expire(phase: str, waited_s: float) -> None:
        expired.append((phase, waited_s))
        done.set()

    watchdog = Watchdog(on_expire, poll_s=0.02)
    watchdog.arm("warm-up step 1", 10.0)
    watchdog.arm("timed repeat 1", 0.1)  # re-arming replaces the phase and its deadline
    assert done.wait(5.0)
    assert expired[0][0] == "timed repeat 1" and expired[0][1] >= 0.1
    quiet = Watchdog(on_expire, poll_s=0.02)
    quiet.arm("gathering the results", 0.05)
    quiet.disarm()
    time.sleep(0.2)
    assert len(expired) == 1  # a disarmed phase never expires


@pytest.mark.parametrize(
    ("device_name", "precision", "tf32", "source"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", False, "H100 bf16 989.4 TFLOPS"),
        ("NVIDIA H100 NVL", "bf16", False, "H100 NVL bf16 835.5 TFLOPS"),
        ("NVIDIA H200 NVL", "fp32", True, "H200 NVL tf32 417.5 TFLOPS"),
        ("NVIDIA H200", "fp32", False, "H200 fp32 67 TFLOPS"),
        ("NVIDIA GB200", "bf16", False, "GB200 bf16 2500 TFLOPS"),
        ("NVIDIA B200", "bf16", False, "B200 bf16 2250 TFLOPS"),
    ],
)
def test_peak_flops_rows(device_name: str, precision: str, tf32: bool, source: str) -> None:
    peak = peak_flops(device_name, precision, tf32)
    assert peak is not None and peak.source == source
    assert peak.flop_s == pytest.approx(float(source.split()[-2]) * 1e12)


def test_no_peak_flops_for_mig_slices_and_cpus() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "bf16", False) is None
    assert peak_flops("x86_64", "bf16", False) is None


def test_attention_inputs_and_backend_on_cpu() -> None:
    q, k = torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 8, 16)
    _, k_out, _, gqa = attention_inputs(q, k, k, repeat_fp32_gqa=False)
    assert gqa and k_out.shape[1] == 2
    _, k_out, _, gqa = attention_inputs(q, k, k, repeat_fp32_gqa=True)  # fp32 for CUDA
    assert not gqa and k_out.shape[1] == 4
    assert attention_inputs(q, q, q, repeat_fp32_gqa=True)[3] is False
    backend = attention_backend(PRESETS["tiny"], 128, torch.float32, torch.device("cpu"))
    assert backend in {"FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"}


LAUNCH_VARIABLES = ("SUBMITIT_EXECUTOR", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_STEP_ID")


def test_rank_info_reads_torchrun_srun_or_says_what_it_looked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="no launcher environment found: start `fsdp-bench run`"):
        rank_info()
    torchrun = {"TORCHELASTIC_RUN_ID": "abc", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "1"}  # fmt: skip
    with monkeypatch.context() as env:
        for name, value in torchrun.items():
            env.setenv(name, value)
        assert rank_info() == RankInfo(3, 1, 4, 2, "torchrun-abc", 1, "torchrun")
    srun = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8",
            "SLURM_STEP_NUM_NODES": "4", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}  # fmt: skip
    with monkeypatch.context() as env:
        for name, value in srun.items():
            env.setenv(name, value)
        assert rank_info() == RankInfo(5, 1, 8, 4, "77.0", 0, "srun")


@pytest.mark.slow
def test_each_run_is_verified_under_its_own_fp32_matmul_precision(
    one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs of one job, TF32 then full fp32: each parity check runs under its run's
    precision (before, the first was checked with TF32 off and the second with it on). The
    setting acts on CUDA only, so here it is applied on the CPU as a GPU would."""
    from fsdp_bench.job import worker

    def apply_anywhere(run: RunConfig, device: torch.device) -> None:
        torch.set_float32_matmul_precision("high" if run.train.fp32_matmul == "tf32" else "highest")

    monkeypatch.setattr(worker, "set_fp32_matmul", apply_anywhere)
    info = RankInfo(0, 0, 1, 1, "in-process", 0)
    context = JobContext(info, torch.device("cpu"), ResultStore(tmp_path), verify=True)
    seen = {}
    try:
        for precision in ("tf32", "ieee"):
            run = RunConfig(
                model=ModelConfig(name="tiny"),
                train=TrainConfig(fp32_matmul=precision),
                measure=MeasureConfig(warmup_steps=1, timed_steps=1, repeats=1),
            )
            seen[precision] = worker.execute_run(run, context).parity
    finally:
        torch.set_float32_matmul_precision("highest")
    assert {k: v["fp32_matmul_precision"] for k, v in seen.items()} == {
        "tf32": "high", "ieee": "highest"}  # fmt: skip


def test_pinned_host_blocks_are_freed_on_torch_without_the_public_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.11 (the GPU machine's) has no torch.accelerator.empty_host_cache."""
    calls = []
    monkeypatch.delattr(torch.accelerator, "empty_host_cache", raising=False)
    monkeypatch.setattr(
        torch._C, "_host_emptyCache", lambda: calls.append("private"), raising=False
    )
    empty_host_cache()
    monkeypatch.setattr(
        torch.accelerator, "empty_host_cache", lambda: calls.append("public"), raising=False
    )
    empty_host_cache()
    assert calls == ["private", "public"]


@pytest.mark.slow
def test_a_run_leaves_nothing_alive_for_the_next_run_of_its_job(
    one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every model a run materialises (the sharded one, and with --verify the parity check's
    reference and sharded copies) is freed once the run has ended and `release` ran. Before,
    the memory tracker's autograd hooks held each run's parameters through a cycle the
    collector could not see: on an H200 the second Llama-3-1B run of a job began with the
    first's 4.6 GiB still allocated, and its peak read 4.6 GiB high."""
    import weakref

    from fsdp_bench.job import parity, worker
    from fsdp_bench.job.parallel import parallelize

    built: list[weakref.ref[torch.Tensor]] = []
    materialize = parallelize.materialize

    def watched(module: torch.nn.Module, device: torch.device, **options: bool) -> None:
        materialize(module, device, **options)
        built.append(weakref.ref(next(module.parameters())))

    monkeypatch.setattr(parallelize, "materialize", watched)
    monkeypatch.setattr(parity, "materialize", watched)
    context = JobContext(RankInfo(0, 0, 1, 1, "in-process", 0), torch.device("cpu"),
                         ResultStore(tmp_path), verify=True)  # fmt: skip
    for ac in ("none", "block"):
        built.clear()
        run = RunConfig(
            model=ModelConfig(name="tiny"),
            fsdp=FsdpConfig(activation_checkpointing=ac),
            measure=MeasureConfig(warmup_steps=1, timed_steps=1, repeats=1),
        )
        worker.execute_run(run, context)
        context.profiles.clear()  # as `_record` does once the run is recorded
        worker.release(context.device)
        assert len(built) == 3  # the run's model, then parity's reference and sharded copy
        assert [ref() is None for ref in built] == [True] * 3, ac
