"""What AOTAutograd's partitioner saves for backward in one compiled Llama-3-8B block under
FSDP2 with float8 training, on whichever torch and torchao are installed.

Standalone on purpose (it imports nothing of fsdp-bench): it runs on older torch releases
than the tool supports, to tell which of a published run's memory came from the partitioner
of its day. One block of Llama-3.1-8B's shape, torchtitan's way: float8 linears, selective
activation checkpointing per op, `torch.compile` per block, then `fully_shard` at the world
size given, bf16 parameters with fp32 reduction, on a fake process group. Dynamo and
AOTAutograd trace the full-size block on fake tensors; the backend, inductor's partitioner
and decompositions, records the forward half the partitioner returns and stops, so nothing is
computed (inductor's code generation comes after and does not change what it returns).

    python benchmarks/partition_probe.py [--world-size 32] [--seq-len 8192] [--batch 2]

Prints one line per configuration: the bytes the block's forward saves for backward that
are not its inputs, and of those the float8 tensors shaped like a weight (each block weight
saved in float8 beside the sharded parameter FSDP2 frees).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

DIM, HEADS, KV_HEADS, FFN, HEAD_DIM = 4096, 32, 8, 14336, 128


class Block(nn.Module):
    """A Llama-3 block as torchtitan writes it (RMSNorm, GQA attention with rotary embedding
    as cos/sin, SwiGLU); the rotary tables are inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(batch, seq, HEADS, HEAD_DIM)
        k = self.wk(h).view(batch, seq, KV_HEADS, HEAD_DIM)
        v = self.wv(h).view(batch, seq, KV_HEADS, HEAD_DIM)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        repeats = HEADS // KV_HEADS
        k = k.repeat_interleave(repeats, dim=2)
        v = v.repeat_interleave(repeats, dim=2)
        attention = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.wo(attention.transpose(1, 2).reshape(batch, seq, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = t.float().chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return rotated.type_as(t)


def context_fn() -> Any:
    """torchtitan's per-op selective checkpointing (2025): save the matmuls but every other
    one, attention, reduce-scatters and max; recompute the rest. The matmul count is kept
    per checkpoint, separately for forward and recomputation."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = torch.ops
    save = {
        ops.aten.mm.default,
        ops.aten._scaled_dot_product_efficient_attention.default,
        ops.aten._scaled_dot_product_flash_attention.default,
        ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        ops._c10d_functional.reduce_scatter_tensor.default,
        ops.aten.max.default,
    }
    matmuls = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        phase = "recompute" if ctx.is_recompute else "forward"
        if func == ops.aten.mm.default:
            matmuls[phase] += 1
            if matmuls[phase] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Recorded(Exception):
    """Raised by the backend once the forward half is recorded."""


def recorded(error: BaseException | None) -> bool:
    """Whether `error` is, or was raised from, `Recorded` (dynamo wraps a backend's errors)."""
    while error is not None:
        inner = getattr(error, "inner_exception", None)
        if isinstance(error, Recorded) or isinstance(inner, Recorded):
            return True
        error = error.__cause__ or error.__context__
    return False


class Saved:
    """The forward halves the partitioner produced: what each returns beyond the block's
    output is what it saves for backward."""

    def __init__(self) -> None:
        self.graphs: list[list[dict[str, Any]]] = []

    def backend(self) -> Any:
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch._inductor.decomposition import select_decomp_table

        partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")

        def forward_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            output = next(n for n in gm.graph.nodes if n.op == "output")
            saved = []
            for node in output.args[0][1:]:
                value = node.meta.get("val") if node is not None else None
                if not isinstance(value, torch.Tensor):
                    continue
                saved.append(
                    {
                        "name": node.name,
                        "input": node.op == "placeholder",
                        "dtype": str(value.dtype).removeprefix("torch."),
                        "shape": list(value.shape),
                        "bytes": value.numel() * value.element_size(),
                    }
                )
            self.graphs.append(saved)
            raise Recorded  # the forward half is all this asks: nothing runs

        return aot_autograd(
            fw_compiler=forward_compiler,
            bw_compiler=boxed_nop,
            partition_fn=partition,
            decompositions=select_decomp_table(),
        )


def float8_config(all_gather: bool, recompute_weight: bool) -> Any:
    """Tensorwise scaling (the only recipe float8 all-gather allows); the recompute flag
    where the installed torchao still has it."""
    from torchao.float8 import Float8LinearConfig

    kwargs: dict[str, Any] = {"enable_fsdp_float8_all_gather": all_gather}
    if "force_recompute_fp8_weight_in_bwd" in inspect.signature(Float8LinearConfig).parameters:
        kwargs["force_recompute_fp8_weight_in_bwd"] = recompute_weight
    return Float8LinearConfig(**kwargs)


def probe(args: argparse.Namespace, recipe: str, all_gather: bool, recompute: bool) -> dict:
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (args.world_size,))
    with torch.device("meta"):
        block = Block()
    if recipe != "bf16":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(block, config=float8_config(all_gather, recompute))
    wrapped = checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False)
    saved = Saved()
    compiled: nn.Module = torch.compile(wrapped, backend=saved.backend(), fullgraph=True)  # type: ignore[assignment]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(compiled, mesh=mesh, mp_policy=policy)
    # Real tensors: torch 2.8's fake tensors have no all-gather. Tracing and partitioning
    # happen on fake tensors anyway; the backend stops before anything is computed.
    compiled.to_empty(device="cpu")
    for parameter in compiled.parameters():
        nn.init.normal_(parameter, std=0.02)
    shape = (args.batch, args.seq_len, DIM)
    x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    cos = torch.randn(args.seq_len, HEAD_DIM // 2)
    sin = torch.randn(args.seq_len, HEAD_DIM // 2)
    try:
        compiled(x, cos, sin)
    except Exception as error:
        if not recorded(error):
            raise
    graph = saved.graphs[-1]
    weight_shapes = {tuple(m.weight.shape) for m in block.modules() if isinstance(m, nn.Linear)}
    weight_shapes |= {shape[::-1] for shape in weight_shapes}
    new = [t for t in graph if not t["input"]]
    float8_weights = [
        t for t in new if t["dtype"].startswith("float8") and tuple(t["shape"]) in weight_shapes
    ]
    gib = 2**30
    return {
        "recipe": recipe,
        "float8_all_gather": all_gather,
        "force_recompute_fp8_weight_in_bwd": recompute,
        "saved_not_inputs_gib": round(sum(t["bytes"] for t in new) / gib, 4),
        "saved_inputs": [f"{t['name']} {t['dtype']}{t['shape']}" for t in graph if t["input"]],
        "float8_weights_saved_gib": round(sum(t["bytes"] for t in float8_weights) / gib, 4),
        "float8_weights_saved": [t["dtype"] + str(t["shape"]) for t in float8_weights],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=args.world_size, store=FakeStore())
    import torchao

    versions = {"torch": torch.__version__, "torchao": torchao.__version__}
    print(json.dumps({"versions": versions, "world_size": args.world_size,
                      "seq_len": args.seq_len, "batch": args.batch}))  # fmt: skip
    cases = [("bf16", False, False), ("tensorwise", True, True), ("tensorwise", True, False),
             ("tensorwise", False, False)]  # fmt: skip
    for case in cases:
        try:
            print(json.dumps(probe(args, *case)), flush=True)
        except Exception as error:  # one case failing says so and the others still run
            print(json.dumps({"case": case, "error": f"{type(error).__name__}: {error}"[:600]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
