"""Peak FLOP/s of a GPU for MFU, from a table that says where each figure comes from.

Dense (no 2:4 sparsity) tensor-core throughput per GPU, in TFLOPS, from NVIDIA's datasheets
(figures printed "with sparsity" halved):
- H100 SXM / H200 SXM / GH200: 989.4 BF16, 494.7 TF32, 67 FP32;
- H100 NVL / H200 NVL (PCIe cards): 835.5 BF16, 417.5 TF32, 60 FP32;
- H100 PCIe: 756 BF16, 378 TF32, 51 FP32;
- A100: 312 BF16, 156 TF32, 19.5 FP32; L40S: 362 BF16, 183 TF32, 91.6 FP32;
- B200: 2250 BF16, 1100 TF32, 75 FP32; GB200 (per GPU): 2500 BF16, 1250 TF32, 80 FP32.
An fp32 run counts at the TF32 rate only when it ran its matmuls in TF32
(`train.fp32_matmul: tf32`). A MIG slice has a fraction of the GPU, which the name does not
say exactly: no MFU rather than a wrong one.
"""

from __future__ import annotations

from typing import NamedTuple

# (name fragment, bf16, tf32, fp32); first match wins, so specific names come first.
_PEAK_TFLOPS: list[tuple[str, float, float, float]] = [
    ("GH200", 989.4, 494.7, 67.0),
    ("GB200", 2500.0, 1250.0, 80.0),
    ("H200 NVL", 835.5, 417.5, 60.0),
    ("H200", 989.4, 494.7, 67.0),
    ("H100 NVL", 835.5, 417.5, 60.0),
    ("H100 PCIe", 756.0, 378.0, 51.0),
    ("H100", 989.4, 494.7, 67.0),
    ("A100", 312.0, 156.0, 19.5),
    ("L40S", 362.0, 183.0, 91.6),
    ("B200", 2250.0, 1100.0, 75.0),
]


class PeakFlops(NamedTuple):
    flop_s: float
    source: str
    """Which row and column matched, e.g. "H200 NVL bf16 835.5 TFLOPS"."""


def peak_flops(device_name: str, mixed_precision: str, tf32: bool) -> PeakFlops | None:
    """Peak FLOP/s of one device for the run's compute dtype; None when unknown (CPUs, MIG)."""
    if "MIG" in device_name:
        return None
    for fragment, bf16, tf32_tflops, fp32 in _PEAK_TFLOPS:
        if fragment in device_name:
            if mixed_precision == "bf16":
                column, tflops = "bf16", bf16
            elif tf32:
                column, tflops = "tf32", tf32_tflops
            else:
                column, tflops = "fp32", fp32
            return PeakFlops(tflops * 1e12, f"{fragment} {column} {tflops:g} TFLOPS")
    return None
