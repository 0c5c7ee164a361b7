"""FSDP2's settings of a run (`FsdpConfig`, the `fsdp:` section of a grid) and the helpers that
read them: which fields DDP has no use for, a grouping's canonical form, checkpointing's period.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from fsdp_bench.config.schema import at_least, bad_value

GROUPING_HELP = (
    "expected root, block, blocks:K (K >= 1 consecutive blocks per group), linear, "
    "or a list of module-name patterns (e.g. ['layers.*.attention', 'layers.*.feed_forward'])"
)


@dataclass(frozen=True, kw_only=True)
class FsdpConfig:
    grouping: str | tuple[str, ...] = "block"
    """Which modules get their own fully_shard call (the communication boundary). Given as a
    string or a list of module-name patterns; stored as a string (`modules:a,b` for a list)."""
    reshard_after_forward: bool | int | Literal["default", "all_but_last"] = "default"
    """true frees full parameters after forward; false keeps them to backward; an int
    reshards to groups of that many ranks; default is FSDP2's own (true except the root);
    all_but_last: every block group true but the last, whose parameters backward needs
    first (torchtitan's policy until its PR 1094; block and blocks:K groupings)."""
    prefetch: Literal["implicit"] | int = "implicit"
    """implicit (FSDP2's default) or an explicit forward/backward prefetch depth."""
    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: parameters cast to bf16 for compute and all-gathers (MixedPrecisionPolicy's
    param_dtype; torchtitan's mixed_precision_param)."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype gradients are reduce-scattered in (MixedPrecisionPolicy's reduce_dtype;
    torchtitan's mixed_precision_reduce): bf16 halves the reduce-scatter bytes and rounds the
    gradients before their sum."""
    cpu_offload: bool = False
    activation_checkpointing: str = "none"
    """none; block (every block, torchtitan's full); every_N (the blocks whose index is a
    multiple of N, torchtitan's selective per layer, e.g. every_2); selective_op (inside
    every block, the outputs of matmuls but every second one, attention and reduce-scatters
    are saved and the rest recomputed: torchtitan's selective per op)."""
    float8_all_gather: bool = False
    """With train.float8 tensorwise: all-gather the float8 weights already cast (half of
    bf16's bytes) and compute their scales in one all-reduce after the optimizer step
    (torchao's enable_fsdp_float8_all_gather, precompute_float8_dynamic_scale_for_fsdp)."""
    shard_group_size: int | None = None
    """hsdp: ranks that hold one replica (shard it, and with tp_size split it too); None: the
    processes of one node."""
    reshard_after_backward: Literal["every", "last"] = "every"
    """every: parameters freed after each micro-batch's backward (FSDP2's default); last: kept
    unsharded between the micro-batches of a step, freed after the last backward
    (set_reshard_after_backward): no all-gather per micro-batch, the unsharded groups held
    through accumulation."""
    cast_forward_inputs: bool = True
    """MixedPrecisionPolicy(cast_forward_inputs): each group casts its floating-point forward
    inputs to the compute dtype (FSDP2's default); false: inputs arrive as they are."""
    offload_pin_memory: bool = True
    """With cpu_offload on CUDA: CPUOffloadPolicy(pin_memory), page-locked host shards copied
    asynchronously; false: pageable host memory, copies that block. CPU runs ignore it."""
    reduce_scatter_buffers: int = 1
    """set_reduce_scatter_max_input_buffers: reduce-scatter input buffers in flight (1: FSDP2's
    default). More let backward's copy-in skip waiting for an exposed reduce-scatter, each one
    a group's gradients of memory more."""
    separate_reduce_scatter_group: bool = False
    """set_separate_reduce_scatter_group: reduce-scatters on a process group of their own, so
    they can overlap backward's all-gathers (one communicator more)."""
    comm_buffers_from_process_group: bool = False
    """set_allocate_memory_from_process_group_for_comm: collectives' staging buffers from the
    process group's allocator (NCCL: zero-copy over NVLink SHARP), not PyTorch's cache."""
    symm_mem: bool = False
    """set_symm_mem_for_comm: all-gather buffers in NCCL symmetric memory (copy-engine or
    symmetric-kernel all-gathers). CUDA only: refused for CPU runs."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "grouping", canonical_grouping(self.grouping))
        if self.shard_group_size is not None:
            at_least(self, "shard_group_size", 1)
        at_least(self, "reduce_scatter_buffers", 1)
        reshard = self.reshard_after_forward
        if isinstance(reshard, int) and not isinstance(reshard, bool) and reshard < 1:
            raise bad_value(
                "reshard_after_forward", reshard, "expected true, false, default or an int >= 1"
            )
        if isinstance(self.prefetch, int) and self.prefetch < 1:
            raise bad_value("prefetch", self.prefetch, "expected implicit or a depth >= 1")
        if checkpointed_every(self.activation_checkpointing) is None and (
            self.activation_checkpointing not in ("none", "selective_op")
        ):
            raise bad_value(
                "activation_checkpointing",
                self.activation_checkpointing,
                "expected none, block, every_N (N >= 1) or selective_op",
            )


def checkpointed_every(mode: str) -> int | None:
    """Every how many blocks one is checkpointed whole: block is 1, every_N is N; None for
    none, selective_op or an unknown mode."""
    if mode == "block":
        return 1
    match = re.fullmatch(r"every_([1-9]\d*)", mode)
    return int(match.group(1)) if match else None


FSDP_ONLY_FIELDS = (
    "grouping",
    "reshard_after_forward",
    "prefetch",
    "reduce_dtype",
    "cpu_offload",
    "float8_all_gather",
    "shard_group_size",
    "reshard_after_backward",
    "cast_forward_inputs",
    "offload_pin_memory",
    "reduce_scatter_buffers",
    "separate_reduce_scatter_group",
    "comm_buffers_from_process_group",
    "symm_mem",
)
"""The FsdpConfig fields DDP has no use for: reset under DDP (`RunConfig.canonical`) and shown
as '-' for DDP rows in tables."""


def canonical_grouping(value: object) -> str:
    """Validate a grouping and give its one string form (`modules:` + patterns for lists)."""
    if isinstance(value, (list, tuple)):
        patterns = [str(p).strip() for p in value]
        if not patterns or not all(patterns) or any("," in p for p in patterns):
            raise bad_value("grouping", list(value), GROUPING_HELP)
        return "modules:" + ",".join(patterns)
    if not isinstance(value, str):
        raise bad_value("grouping", value, GROUPING_HELP)
    if value in ("root", "block", "linear"):
        return value
    if value.startswith("modules:") and all(value[len("modules:") :].split(",")):
        return value
    match = re.fullmatch(r"blocks:(\d+)", value)
    if match and int(match.group(1)) >= 1:
        return value
    raise bad_value("grouping", value, GROUPING_HELP)


def grouping_block_count(grouping: str) -> int | None:
    """K of `blocks:K`, else None."""
    return int(grouping.split(":")[1]) if grouping.startswith("blocks:") else None
