"""Activation checkpointing as `fsdp.activation_checkpointing` asks, applied to the blocks
before `fully_shard` (non-reentrant `checkpoint_wrapper`, as torchtitan applies it):

- block: every block recomputed in backward; only its input is kept (torchtitan's full);
- every_N: the blocks whose index is a multiple of N (torchtitan's selective per layer,
  `selective_ac_option` N: block 0, N, 2N, ...); the others keep everything;
- selective_op: every block, but inside it the outputs of some operators are kept and the
  rest recomputed (torchtitan's selective per op): attention, reduce-scatters, and matrix
  products except every second one, which are the expensive ones to recompute
  (`torch.utils.checkpoint.create_selective_checkpoint_contexts`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fsdp_bench.config.fsdp import checkpointed_every
from fsdp_bench.job.model.zoo import ModelBundle


def _ops(*names: str) -> set[Any]:
    """The aten or c10d ops of these names this torch build has (kernels differ by version
    and platform: flash attention for CPU, cuDNN attention)."""
    found = set()
    for name in names:
        namespace, _, op = name.partition(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            found.add(packet.default)
    return found


KEPT_OPS = _ops(
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "_c10d_functional.reduce_scatter_tensor",
    "aten.max",
)
"""What selective_op keeps besides the matrix products: attention's outputs, and under tensor
parallelism the reduce-scatters (communication is the costliest thing to redo)."""
MATMUL = torch.ops.aten.mm.default


def apply_checkpointing(bundle: ModelBundle, mode: str) -> ModelBundle:
    """The bundle with its blocks wrapped as `mode` asks (in place; `none`: as it is)."""
    if mode == "none":
        return bundle
    every = checkpointed_every(mode)
    parents = {
        id(child): (parent, name)
        for parent in bundle.module.modules()
        for name, child in parent.named_children()
    }
    blocks = []
    for index, block in enumerate(bundle.blocks):
        if every is not None and index % every:
            blocks.append(block)
            continue
        wrapper = (
            checkpoint_wrapper(block)
            if every is not None
            else checkpoint_wrapper(block, context_fn=_selective_contexts)
        )
        parent, name = parents[id(block)]
        setattr(parent, name, wrapper)
        blocks.append(wrapper)
    return dataclasses.replace(bundle, blocks=blocks)


def _selective_contexts() -> Any:
    """A fresh count of matrix products for each forward of a block, and for its recompute."""
    counts = {"forward": 0, "recompute": 0}
    return create_selective_checkpoint_contexts(functools.partial(_policy, counts))


def _policy(counts: dict[str, int], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Keep attention and reduce-scatters; keep the 1st, 3rd, ... matrix product, recompute
    the 2nd, 4th, ... (the same ones in forward and in the recompute); recompute the rest."""
    if op is MATMUL:
        phase = "recompute" if ctx.is_recompute else "forward"
        counts[phase] += 1
        keep = counts[phase] % 2 == 1
    else:
        keep = op in KEPT_OPS
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
