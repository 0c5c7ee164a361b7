"""Calls whose CUDA kernel keeps other tensors than the CPU's: the simulation runs a CUDA run's
step on CPU fake tensors, so such a call must allocate, and save for backward, what the CUDA
kernel would.

RMSNorm (`nn.RMSNorm`, through `F.rms_norm`): torch dispatches it to `_fused_rms_norm`
when the weight's dtype is the input's. On CUDA that is one kernel and one autograd node that
saves the input, the weight and the reciprocal RMS per row (fp32), and allocates the output;
on CPU it decomposes (aten/src/ATen/native/layer_norm.cpp, `rms_norm_composite`) into an fp32
copy of the input, its square, the normalised fp32 rows and a copy back, and autograd keeps
two fp32 tensors of the input's size for each norm. For a bf16 Llama block that is 8 bytes per
element of the residual stream saved by each of its two norms where CUDA saves 2: about a
fifth of a block's activations without checkpointing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["use_cuda_kernels"]


class _FusedRMSNorm(torch.autograd.Function):
    """The allocations of CUDA's fused RMSNorm, forward and backward, without its values: it
    only ever runs on fake tensors, whose values do not exist."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, num_dims: int) -> torch.Tensor:
        stat_shape = (*x.shape[: x.dim() - num_dims], *([1] * num_dims))
        rstd = x.new_empty(stat_shape, dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), None


def use_cuda_kernels(module: nn.Module, device_type: str) -> None:
    """Where `device_type` is cuda, `module`'s RMSNorms allocate as CUDA's fused kernel does
    (their forward replaced; a checkpointed block's recompute calls it again, which a
    function mode would not see: the engine runs backward without the caller's modes)."""
    if device_type != "cuda" or not hasattr(torch.ops.aten, "_fused_rms_norm"):
        return  # an older torch decomposes RMSNorm on CUDA too
    for norm in module.modules():
        if isinstance(norm, nn.RMSNorm):
            norm.forward = functools.partial(_rms_norm, norm)  # type: ignore[method-assign]


def _rms_norm(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`nn.RMSNorm.forward`, fused where torch would fuse it: fake tensors of one dtype. Under
    tensor parallelism the input is a DTensor (split by sequence, or replicated) and the
    weight a replicated one: each rank's kernel runs on its local rows."""
    weight, num_dims = norm.weight, len(norm.normalized_shape)
    local_x = x.to_local() if isinstance(x, DTensor) else x
    local_weight: torch.Tensor | None = weight
    if isinstance(weight, DTensor):
        replicated = all(isinstance(p, Replicate) for p in weight.placements)
        local_weight = weight.to_local() if replicated else None
    if not (
        isinstance(local_x, FakeTensor)
        and isinstance(local_weight, FakeTensor)
        and local_weight.dtype == local_x.dtype
    ):
        return F.rms_norm(x, norm.normalized_shape, weight, norm.eps)
    out = _FusedRMSNorm.apply(local_x, local_weight, num_dims)
    if isinstance(x, DTensor):
        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)
    return out
