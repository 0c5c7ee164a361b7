"""Replay tables for the search benchmark whose throughput and memory come from models written
apart from fsdp-bench's: no import of its estimator, its throughput arithmetic or its presets'
FLOP counts. Each table is a grid (a search space fsdp-bench can run) and, for every point of
it, a true tokens/s and true peaks (allocated, reserved, device-used GiB per rank).

- roofline: Llama-3-8B (Meta's model card: 8.03B parameters, dim 4096, 32 layers, FFN 14336,
  vocabulary 128256) at sequence 8192 on 80 GB H100s, world size 8-64. Compute at a
  micro-batch-dependent share of the bf16 dense peak (989 TFLOP/s), ring collectives at
  NVLink (in a node) or 400 Gb/s InfiniBand (across nodes) bandwidth, overlapped with compute
  by a share that falls as groups grow, plus a latency per collective; memory from sharded
  state, parameters and gradients in flight, activations per layer (per-token bytes in the
  form of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", without the attention-score term, which flash attention does not keep), logits,
  and a fixed CUDA/NCCL share.
- published: Llama 3.1 8B on 96 GB H100s, world size 8-128, fitted to torchtitan's published
  figures (pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, December 2024:
  FSDP, local batch 2, selective activation checkpointing: 5,762 tokens/s per GPU and 82.4 GiB
  at 8 GPUs, 5,605 and 67.0 GiB at 128; docs/performance.md, 64 A100s: Llama 2 13B local
  batch 2 without activation checkpointing 2,162 tokens/s per GPU against 1,904 with
  selective op checkpointing). Multiplicative in every knob, a different form from the
  roofline's; where no published figure pins a factor, the factor is an assumption named
  where it is set.

Both are built so that the fastest point within the budget sits at the memory edge (its
neighbours that trade more memory for speed do not fit), as the fastest configurations do.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Truth:
    """What a run of one point really does."""

    tokens_per_s: float
    allocated_gib: float
    reserved_gib: float
    device_used_gib: float


@dataclasses.dataclass(frozen=True)
class IndependentTable:
    name: str
    grid: dict[str, Any]
    """The grid (a search space) in fsdp-bench's format."""
    truth: Callable[[dict[str, Any]], Truth]
    """A point's truth from its axis values (dotted keys, as in the grid)."""
    card_gib: float
    """What the card holds: a point needing more dies of OOM."""
    source: str

    def points(self) -> Iterator[dict[str, Any]]:
        axes = self.grid["axes"]
        for values in itertools.product(*axes.values()):
            yield dict(zip(axes, values, strict=True))


# Llama-3-8B (Meta's model card)
PARAMS = 8.03e9
DIM, LAYERS, FFN, VOCAB, KV_DIM = 4096, 32, 14_336, 128_256, 1024
LAYER_PARAMS = 2 * DIM * DIM + 2 * DIM * KV_DIM + 3 * DIM * FFN  # attention + SwiGLU MLP
SEQ = 8192


def _groups(grouping: str) -> int:
    """Blocks per FSDP group."""
    return 1 if grouping == "block" else int(grouping.split(":")[1])


BASE = {
    "model": {"name": "llama3-8b"},
    "data": {"seq_len": SEQ},
    "fsdp": {"mixed_precision": "bf16"},
}
"""Both tables' runs: Llama-3-8B at sequence 8192, bf16 compute."""


def roofline_truth(point: dict[str, Any]) -> Truth:
    w = point["world_size"]
    b = point["data.micro_batch_size"]
    ac = point["fsdp.activation_checkpointing"]
    reshard = point["fsdp.reshard_after_forward"]
    per_group = _groups(point["fsdp.grouping"]) * LAYER_PARAMS
    tokens = b * SEQ

    # memory, bytes per rank
    state = PARAMS * 16 / w  # fp32 parameters, fp32 gradients, two AdamW moments
    in_flight = 2 * per_group * 2  # the group computing and the one prefetched, bf16
    grads_in_flight = per_group * 4  # fp32 unsharded gradients before reduce-scatter
    if reshard is False:
        kept = PARAMS * 2 * (1 - 1 / w)  # every bf16 parameter held from forward to backward
    elif reshard == 8 and w > 8:
        kept = PARAMS * 2 / 8  # resharded to a group of 8: an eighth held
    else:
        kept = 0.0
    per_token_layer = {  # bytes kept per token per layer, bf16
        "none": 18 * DIM + 6 * FFN,
        "selective_op": 10 * DIM + 2 * FFN,  # matmul outputs kept, elementwise recomputed
        "block": 2 * DIM,  # the block's input only
    }[ac]
    activations = tokens * LAYERS * per_token_layer
    if ac != "none":
        activations += tokens * (18 * DIM + 6 * FFN)  # one block recomputed at a time
    logits = tokens * VOCAB * 8  # bf16 logits, their fp32 copy for the loss, its gradient half
    allocated = state + in_flight + grads_in_flight + kept + activations + logits
    reserved = allocated * (1.04 if ac == "block" else 1.07)  # more, larger frees without AC
    nodes = max(1, w // 8)
    outside = (0.55 + 0.3 + 0.12 * math.log2(nodes) + 0.25 * (nodes > 1)) * GIB  # ctx, NCCL
    used = reserved + outside

    # time per step
    flops_per_token = 6 * PARAMS + 6 * LAYERS * DIM * SEQ  # causal attention: half of 12
    recompute = {"none": 0.0, "selective_op": 0.04, "block": 1 / 3}[ac]
    efficiency = 0.55 * tokens / (tokens + 3000)  # small micro-batches leave tensor cores idle
    compute_s = flops_per_token * tokens * (1 + recompute) / (989e12 * efficiency)
    bandwidth = 360e9 if w <= 8 else 45e9  # bytes/s per GPU: NVLink, 400 Gb/s IB
    gathers_s = 2 * PARAMS * (w - 1) / w / bandwidth
    if reshard is False:
        comm_s = gathers_s  # backward needs no second all-gather
    elif reshard == 8 and w > 8:
        comm_s = gathers_s + 2 * PARAMS * 7 / 8 / 360e9  # the backward one inside the node
    else:
        comm_s = 2 * gathers_s
    comm_s += 4 * PARAMS * (w - 1) / w / bandwidth  # fp32 gradients reduce-scattered
    overlap = {1: 0.9, 2: 0.8, 4: 0.62}[_groups(point["fsdp.grouping"])]
    num_groups = LAYERS // _groups(point["fsdp.grouping"]) + 1
    latency_s = num_groups * 3 * 25e-6 * math.log2(2 * w)
    step_s = compute_s + max(0.0, comm_s - overlap * compute_s) + latency_s
    return Truth(w * tokens / step_s, allocated / GIB, reserved / GIB, used / GIB)


ROOFLINE = IndependentTable(
    name="roofline",
    grid={
        "name": "replay-roofline",
        "base": BASE,
        "axes": {
            "world_size": [8, 16, 32, 64],
            "fsdp.grouping": ["block", "blocks:2", "blocks:4"],
            "fsdp.reshard_after_forward": [True, False, 8],
            "fsdp.activation_checkpointing": ["none", "selective_op", "block"],
            "data.micro_batch_size": [1, 2],
        },
        "memory": {"gpu": "H100", "budget_gib": 70},
        "launcher": {"kind": "slurm", "gpus_per_node": 8},
    },
    truth=roofline_truth,
    card_gib=79.2,
    source="a roofline with exposed communication (benchmarks/search_tables.py)",
)


def published_truth(point: dict[str, Any]) -> Truth:
    w = point["world_size"]
    b = point["data.micro_batch_size"]
    ac = point["fsdp.activation_checkpointing"]
    reshard_false = point["fsdp.reshard_after_forward"] is False
    # tokens/s per GPU, relative to torchtitan's 5,762 (8 GPUs, batch 2, selective op AC)
    scale = (5605 / 5762) ** (math.log2(w / 8) / 4)  # through the 128-GPU figure
    checkpointing = {"selective_op": 1.0, "none": 2162 / 1904, "block": 2162 / 1904 * 0.75}[ac]
    # assumed: full AC runs the forward again (3/4 of no AC's rate); a larger micro-batch
    # helps as torchtitan's 70B note says (MFU 50.5% at batch 2, up to 54% above it)
    batch = (b / (b + 0.25)) / (2 / 2.25)
    # assumed: no reshard saves the backward all-gather, worth more across nodes
    reshard = (1.03 if w <= 8 else 1.06) if reshard_false else 1.0
    grouping = 0.99 if point["fsdp.grouping"] == "blocks:2" else 1.0  # assumed: less overlap
    per_gpu = 5762 * scale * checkpointing * batch * reshard * grouping
    # device-used GiB per rank: a / w + fixed + per micro-batch, through 82.4 (8) and 67.0 (128)
    state = (82.4 - 67.0) / (1 / 8 - 1 / 128) / w
    fixed = 4.0  # assumed: context, NCCL, allocator slack
    per_batch = (82.4 - state * w / 8 - fixed) / 2  # selective op AC, from the 8-GPU figure
    # assumed: without AC the activations are 1.7x selective op's; full AC keeps the logits
    # and the blocks' inputs (about a third)
    per_batch *= {"selective_op": 1.0, "none": 1.7, "block": 0.34}[ac]
    kept = 2 * PARAMS / GIB * (1 - 1 / w) if reshard_false else 0.0
    larger_groups = 0.4 if point["fsdp.grouping"] == "blocks:2" else 0.0  # two blocks in flight
    used = state + fixed + b * per_batch + kept + larger_groups
    reserved = used - 1.2  # assumed: 1.2 GiB outside the allocator
    return Truth(w * per_gpu, reserved / 1.06, reserved, used)


PUBLISHED = IndependentTable(
    name="published",
    grid={
        "name": "replay-published",
        "base": BASE,
        "axes": {
            "world_size": [8, 16, 32, 64, 128],
            "fsdp.grouping": ["block", "blocks:2"],
            "fsdp.reshard_after_forward": [True, False],
            "fsdp.activation_checkpointing": ["none", "selective_op", "block"],
            "data.micro_batch_size": [1, 2, 4],
        },
        "memory": {"gpu": "H100", "budget_gib": 75},
        "launcher": {"kind": "slurm", "gpus_per_node": 8},
    },
    truth=published_truth,
    card_gib=94.5,
    source="fitted to torchtitan's published H100 and A100 figures (benchmarks/search_tables.py)",
)

TABLES = {table.name: table for table in (ROOFLINE, PUBLISHED)}
