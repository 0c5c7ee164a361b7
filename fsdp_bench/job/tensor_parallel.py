"""Tensor parallelism for the Llama presets: torchtitan's plan, applied on the meta device
before activation checkpointing and fully_shard (torchtitan's order: TP, AC, compile, FSDP).

Each block's attention splits its heads over the TP group (wq, wk, wv column-wise, wo
row-wise) and its MLP its hidden width (w1, w3 column-wise, w2 row-wise): one all-reduce, or
with sequence parallel one all-gather and one reduce-scatter, per sub-layer in forward and as
many in backward. With sequence parallel (`RunConfig.tp_sequence_parallel`, torchtitan's
default) the norms and the residual stream between sub-layers hold a 1/tp slice of the
sequence. The embedding is split by rows of its table, the output projection by vocabulary,
and its logits stay split: the loss is computed on them under `loss_parallel`
(`training.forward_backward`), as torchtitan does, which never holds a rank's whole logits
(at 16 x 8192 tokens and Llama-3's 128,256-token vocabulary, 33.6 GB in bf16).

Source: torchtitan, torchtitan/models/llama3/infra/parallelize.py (`apply_tp`), and the
`torch.distributed.tensor.parallel` docs.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fsdp_bench.errors import ConfigError
from fsdp_bench.job.models import ModelBundle, Transformer


def block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan of one transformer block, by submodule name."""
    plan: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    if not sequence_parallel:
        return {**plan, "attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()}
    seq = Shard(1)
    return {
        **plan,
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }


def model_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan of what surrounds the blocks: embedding, final norm, output projection."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    return plan


def apply_tensor_parallel(bundle: ModelBundle, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split the preset's blocks, embedding and output over `mesh` (the TP dimension)."""
    model = bundle.module
    if not isinstance(model, Transformer):
        raise ConfigError(
            f"tp_size: tensor parallelism has a plan for the Llama presets only, not "
            f"{type(model).__name__}"
        )
    for block in bundle.blocks:
        parallelize_module(block, mesh, block_plan(sequence_parallel))
    parallelize_module(model, mesh, model_plan(sequence_parallel))
