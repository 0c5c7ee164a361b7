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
        return 32 << 20 if self.compute_capability >= (9, 0) else (8 << 20) + (128 << 10)


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
