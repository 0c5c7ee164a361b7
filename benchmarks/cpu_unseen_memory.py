"""Memory a CPU run takes that no dispatch mode sees, measured at the CPU allocator
(torch.profiler's memory events, `allocator_peak`) beside what our accounting sees of the same
operations:

1. Gloo's collectives at two ranks: all_gather_into_tensor, reduce_scatter_tensor and
   all_reduce on a 16 MiB buffer, fp32 and bf16, beside the tracker (`TensorMemoryTracker`,
   the figure CPU runs record). ProcessGroupGloo may work in buffers of its own inside the
   C++ call; NCCL writes into the output.
2. One bf16 Linear (4096 x 4096) converted to float8 (torchao), a forward and backward,
   beside the estimate's recorder on fake tensors (`memory.alloc_trace`): the CPU's
   `torch._scaled_mm` per recipe, bf16 as the baseline in the same run.

A figure at the allocator above the other is memory the estimate cannot see on the CPU; CUDA
runs make neither (NCCL; float8 kernels), which is why the estimate does not model it.

    python benchmarks/cpu_unseen_memory.py     # about 30 s on 2 cores
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fsdp_bench.job.measure.allocator_peak import allocator_peak
from fsdp_bench.job.measure.tracker import TensorMemoryTracker
from fsdp_bench.memory.alloc_trace import recording
from fsdp_bench.memory.fake import fake_tensors

MIB = 2**20
BUFFER_BYTES = 16 * MIB


def above_start_mib(operation: Callable[[], object], *held: torch.Tensor) -> tuple[float, float]:
    """(allocator, tracker): MiB each saw allocated above where `operation` began; `held`:
    the tensors alive before it, which the tracker is told of first."""
    with allocator_peak() as at_allocator:
        operation()
    tracker = TensorMemoryTracker()
    tracker.track_external(*held)
    with tracker:
        before = tracker.get_tracker_snapshot("current")
        operation()
        peak = tracker.get_tracker_snapshot("peak")
    cpu = torch.device("cpu")
    tracked = peak.get(cpu, {}).get("Total", 0) - before.get(cpu, {}).get("Total", 0)
    return at_allocator.bytes_above_start / MIB, tracked / MIB


def _collectives(rank: int, folder: str) -> None:
    store = dist.FileStore(os.path.join(folder, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            numel = BUFFER_BYTES // torch.tensor([], dtype=dtype).element_size()
            full, shard = torch.zeros(numel, dtype=dtype), torch.zeros(numel // 2, dtype=dtype)
            cases = {
                "all_gather_into_tensor": partial(dist.all_gather_into_tensor, full, shard),
                "reduce_scatter_tensor": partial(dist.reduce_scatter_tensor, shard, full),
                "all_reduce": partial(dist.all_reduce, full),
            }
            for name, operation in cases.items():
                allocator_mib, tracked_mib = above_start_mib(operation, full, shard)
                if rank == 0:
                    print(f"  {name:24} {str(dtype)[6:]:9} {allocator_mib:9.2f} "
                          f"{tracked_mib:9.2f}", flush=True)  # fmt: skip
    finally:
        dist.destroy_process_group()


def _float8_linear(recipe: str) -> tuple[float, float]:
    """(allocator, estimate's recorder): MiB above the start of a forward and backward of one
    bf16 Linear converted to float8 by `recipe` (bf16: not converted), the recorder's on fake
    tensors as the estimate simulates it."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def build() -> tuple[nn.Module, torch.Tensor]:
        model = nn.Sequential(nn.Linear(4096, 4096, bias=False, dtype=torch.bfloat16))
        if recipe != "bf16":
            config = Float8LinearConfig.from_recipe_name(recipe)
            convert_to_float8_training(model, config=dataclasses.replace(config, emulate=False))
        return model, torch.randn(64, 4096, dtype=torch.bfloat16, requires_grad=True)

    def step(model: nn.Module, batch: torch.Tensor) -> None:
        model(batch).float().sum().backward()
        model.zero_grad(set_to_none=True)
        batch.grad = None

    model, batch = build()
    step(model, batch)  # the first step's one-time allocations out of the way
    with allocator_peak() as at_allocator:
        step(model, batch)
    with fake_tensors(), recording() as recorder:  # every storage made where it sees it
        model, batch = build()
        step(model, batch)
        recorder.mark("step")
        step(model, batch)
    trace = recorder.trace
    peak_bytes, _ = trace.live_peak("step", with_inputs=True)
    alive: dict[object, int] = {}
    for event in trace.events[: trace.marks["step"]]:
        if event[0] == "alloc":
            alive[event[1]] = event[2]
        else:
            alive.pop(event[1], None)
    return at_allocator.bytes_above_start / MIB, (peak_bytes - sum(alive.values())) / MIB


def main() -> None:
    print(f"1. gloo at two ranks, a {BUFFER_BYTES // MIB} MiB buffer (MiB above the start)")
    print(f"  {'collective':24} {'dtype':9} {'allocator':>9} {'tracker':>9}")
    mp.spawn(_collectives, args=(tempfile.mkdtemp(),), nprocs=2)
    print("2. one bf16 Linear 4096 x 4096, batch 64: forward and backward (MiB above the start)")
    print(f"  {'recipe':24} {'allocator':>9} {'estimate':>9} {'unseen':>9}")
    for recipe in ("bf16", "tensorwise", "rowwise", "rowwise_with_gw_hp"):
        allocator_mib, recorded_mib = _float8_linear(recipe)
        print(f"  {recipe:24} {allocator_mib:9.2f} {recorded_mib:9.2f} "
              f"{allocator_mib - recorded_mib:9.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
