"""Tensor parallelism, applied on the meta device before activation checkpointing and
fully_shard (torchtitan's order: TP, AC, compile, FSDP): torchtitan's plan for the Llama
presets, the plan transformers ships for `hf:` models, a user's own for their bundle.

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

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fsdp_bench.errors import ConfigError
from fsdp_bench.job.model.zoo import ModelBundle, Transformer


def block_plan(sequence_parallel: bool, float8: bool = False) -> dict[str, ParallelStyle]:
    """The plan of one transformer block, by submodule name. With `float8` (tensorwise
    Float8Linears), torchao's float8 styles, as torchtitan applies them: activations are cast
    before the sequence-parallel all-gather, which then carries float8, and gradients are cast
    to float8 on their way back."""
    colwise, rowwise, prepare_input = (
        _float8_styles() if float8 else (ColwiseParallel, RowwiseParallel, PrepareModuleInput)
    )
    plan: dict[str, ParallelStyle] = {
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "feed_forward.w1": colwise(),
        "feed_forward.w3": colwise(),
    }
    if not sequence_parallel:
        return {**plan, "attention.wo": rowwise(), "feed_forward.w2": rowwise()}
    seq = Shard(1)
    return {
        **plan,
        "attention_norm": SequenceParallel(),
        "attention": prepare_input(
            input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wo": rowwise(output_layouts=seq),
        "ffn_norm": SequenceParallel(),
        "feed_forward": prepare_input(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w2": rowwise(output_layouts=seq),
    }


def _float8_styles() -> tuple[Any, Any, Any]:
    """torchao's Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput."""
    from torchao.float8 import float8_tensor_parallel as styles

    return (
        styles.Float8ColwiseParallel,
        styles.Float8RowwiseParallel,
        styles.PrepareFloat8ModuleInput,
    )


def model_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan of what surrounds the blocks: embedding, final norm, output projection."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": _vocabulary_parallel(seq),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    return plan


def apply_tensor_parallel(
    bundle: ModelBundle, mesh: DeviceMesh, sequence_parallel: bool, float8: str = "none"
) -> None:
    """Split the model over `mesh` (the TP dimension): a preset by torchtitan's plan (with
    torchao's float8 styles for tensorwise float8, as torchtitan), a transformers model by the
    plan its config class ships, a user's model by the bundle's (their Float8Linears, if any,
    split by the plain styles: float8 compute, activations gathered in bf16)."""
    model = bundle.module
    if isinstance(model, Transformer):
        float8_styles = float8 == "tensorwise"
        for block in bundle.blocks:
            parallelize_module(block, mesh, block_plan(sequence_parallel, float8_styles))
        parallelize_module(model, mesh, model_plan(sequence_parallel))
    elif bundle.tp_plan is not None:
        parallelize_module(model, mesh, bundle.tp_plan)
    else:
        base, plan = transformers_plan(model)
        parallelize_module(base, mesh, plan)
        if getattr(model, "lm_head", None) is not None:  # logits split, loss_parallel's
            parallelize_module(model, mesh, {"lm_head": _vocabulary_parallel(Replicate())})


HF_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
"""The styles of transformers' plans (`base_model_tp_plan`) this job applies, by their name."""


def transformers_plan(model: nn.Module) -> tuple[nn.Module, dict[str, ParallelStyle]]:
    """(the base model, its plan) from the config class's `base_model_tp_plan`
    (transformers' own, e.g. LlamaConfig's: attention's q/k/v column-wise and o row-wise, the
    MLP's gate/up column-wise and down row-wise; no sequence parallel, the embedding
    replicated); a `ConfigError` naming the model when it has none, or a style this job does
    not apply, or an output projection tied to the embedding."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ConfigError(
            f"tp_size: {name} has no tensor-parallel plan (its config class has no "
            "base_model_tp_plan); give the bundle a tp_plan, or use tp_size 1"
        )
    unknown = sorted({style for style in plan.values() if style not in HF_STYLES})
    if unknown:
        raise ConfigError(
            f"tp_size: {name}'s tensor-parallel plan uses {', '.join(unknown)}; this job "
            f"applies {', '.join(HF_STYLES)}"
        )
    head = getattr(model, "lm_head", None)
    embeddings = getattr(model, "get_input_embeddings", None)
    embedding = embeddings() if callable(embeddings) else None
    if head is not None and embedding is not None and head.weight is embedding.weight:
        raise ConfigError(
            f"tp_size: {name} ties its output projection to the embedding "
            "(tie_word_embeddings): tensor parallelism needs one of its own"
        )
    styles = {key: HF_STYLES[style]() for key, style in plan.items()}
    return getattr(model, "base_model", model), styles


def _vocabulary_parallel(input_layout: Placement) -> ParallelStyle:
    """The output projection split by vocabulary, its logits left split (a DTensor) for the
    loss, which runs on them under `loss_parallel`."""
    return ColwiseParallel(
        input_layouts=input_layout, output_layouts=Shard(-1), use_local_output=False
    )
