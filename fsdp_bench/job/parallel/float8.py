"""Float8 training (`train.float8`) with torchao, as torchtitan applies it: the Linears of the
blocks become `Float8Linear` on the meta device, before tensor parallelism, activation
checkpointing, torch.compile and fully_shard. With `fsdp.float8_all_gather`, FSDP2 gathers
their weights already cast to float8 (half of bf16's bytes) and one all-reduce per step,
after the optimizer, computes every weight's scale instead of one per weight per gather.

torchao is imported only when a run asks for float8, so a rank that does not pays nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

from fsdp_bench.errors import ConfigError

DIMENSION_MULTIPLE = 16
"""float8 matmuls (`torch._scaled_mm`) need both dimensions of a weight to be multiples of 16;
torchtitan leaves the other Linears in high precision, as this does."""


def _torchao_float8() -> Any:
    """torchao.float8, or one line saying how to install it."""
    try:
        import torchao.float8 as float8
    except ImportError:
        raise ConfigError(
            "train.float8 needs torchao: pip install 'fsdp-bench[float8]' (torchao 0.18)"
        ) from None
    return float8


def float8_filter(blocks: list[nn.Module]) -> Callable[[nn.Module, str], bool]:
    """Which Linears become float8: those inside the blocks whose in and out features are
    multiples of 16. The embedding and the output projection are outside the blocks, so a
    Llama is converted as torchtitan converts it (its filter names `output`)."""
    in_blocks = {id(m) for block in blocks for m in block.modules()}

    def convert(module: nn.Module, _name: str) -> bool:
        return (
            isinstance(module, nn.Linear)
            and id(module) in in_blocks
            and module.in_features % DIMENSION_MULTIPLE == 0
            and module.out_features % DIMENSION_MULTIPLE == 0
        )

    return convert


def convert_to_float8(
    module: nn.Module, blocks: list[nn.Module], recipe: str, all_gather: bool, device_type: str
) -> int:
    """Swap the blocks' eligible Linears for torchao's Float8Linear in place, with the scaling
    `recipe` (tensorwise, rowwise, rowwise_with_gw_hp); the number converted.

    For a run on the CPU (`device_type`), torchao's emulation: the same float8 casts and
    scales with the matmul in high precision. torch's CPU `_scaled_mm` exists but is slow: a
    forward and backward of a 128x384 MLP on 256 tokens took 2.0 s tensorwise, 0.010 s
    emulated and 0.017 s in bf16 (measured here), so a CPU float8 run checks what is
    gathered, kept and computed, not float8's speed."""
    float8 = _torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(
        config, enable_fsdp_float8_all_gather=all_gather, emulate=device_type == "cpu"
    )
    float8.convert_to_float8_training(module, module_filter_fn=float8_filter(blocks), config=config)
    from torchao.float8.float8_linear import Float8Linear

    return sum(isinstance(m, Float8Linear) for m in module.modules())


class ByteViewAllGather(DefaultAllGather):
    """FSDP2's all-gather, its float8 buffers viewed as uint8: gloo has no float8 dtype
    ('Invalid scalar type'), and the bytes on the wire are the same. NCCL needs none of it."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if input_tensor.dtype.is_floating_point and input_tensor.element_size() == 1:
            output_tensor, input_tensor = (
                output_tensor.view(torch.uint8),
                input_tensor.view(torch.uint8),
            )
        return super().__call__(output_tensor, input_tensor, group, async_op)


def gather_float8_as_bytes(model: nn.Module) -> None:
    """Every fully_shard group of `model` all-gathers through `ByteViewAllGather`."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(ByteViewAllGather())


def scale_precompute(model: nn.Module) -> Callable[[], None]:
    """What the step runs after the optimizer: the float8 weights' scales for the next step's
    all-gathers, from one all-reduce of their amaxes (looked up once, not every step)."""
    return functools.partial(_torchao_float8().precompute_float8_dynamic_scale_for_fsdp, model)
