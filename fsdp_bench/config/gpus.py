"""The GPU kinds a grid's memory estimate can be told about (`memory.gpu`): what changes the
memory outside the tensors from one kind to another. No torch.

- cuBLAS's workspace: 32 MiB per handle on compute capability 9.0 and later, 8 MiB + 128 KiB
  before (aten/src/ATen/cuda/CublasHandlePool.cpp, `parseChosenWorkspaceSize`).
- NVLink SHARP (NVLS): NCCL's multicast buffers, on nodes whose GPUs meet at NVSwitches with
  multicast (HGX H100/H200/B200 boards; NCCL >= 2.17 enables it by default where the
  hardware has it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GpuName = Literal["A100", "H100", "H100-NVL", "H200", "GH200", "B200", "L40S"]


@dataclass(frozen=True)
class GpuKind:
    name: str
    compute_capability: tuple[int, int]
    nvswitch_multicast: bool
    """Sold on boards whose GPUs meet at NVSwitches with multicast (NVLS)."""

    @property
    def cublas_workspace_bytes(self) -> int:
        return (
            CUBLAS_WORKSPACE_SM90_BYTES
            if self.compute_capability >= (9, 0)
            else (CUBLAS_WORKSPACE_BEFORE_SM90_BYTES)
        )


CUBLAS_WORKSPACE_SM90_BYTES = 32 << 20
CUBLAS_WORKSPACE_BEFORE_SM90_BYTES = (8 << 20) + (128 << 10)
"""cuBLAS's workspace per (handle, stream), allocated through the caching allocator and kept
(`:4096:8` on sm90+; aten/src/ATen/cuda/CublasHandlePool.cpp, docs/source/notes/cuda.rst)."""
CUBLAS_HANDLES = 2
"""Handles are per thread: the main thread's (forward, optimizer) and autograd's device
thread's (backward), both on the default stream."""


GPUS: dict[str, GpuKind] = {
    kind.name: kind
    for kind in (
        GpuKind("A100", (8, 0), False),
        GpuKind("H100", (9, 0), True),
        GpuKind("H100-NVL", (9, 0), False),
        GpuKind("H200", (9, 0), True),
        GpuKind("GH200", (9, 0), False),
        GpuKind("B200", (10, 0), True),
        GpuKind("L40S", (8, 9), False),
    )
}
"""H100 and H200 are the SXM parts of HGX boards; the NVL and PCIe cards have no NVSwitch."""
