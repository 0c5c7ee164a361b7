"""The configuration values: what one run is (`RunConfig`), where it runs (`LauncherConfig`),
and a whole grid (`SweepSpec`), with every check a user can trip over.

Only `RunConfig` crosses process and host boundaries (with `RunResult`); it is a frozen tree
of plain values, picklable and JSON-serialisable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Literal

from fsdp_bench.config.fsdp import (
    FSDP_ONLY_FIELDS,
    FsdpConfig,
    grouping_block_count,
)
from fsdp_bench.config.measure import MeasureConfig
from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.schema import at_least, bad_value, non_default_fields
from fsdp_bench.config.tensor_parallel import check_tensor_parallel, divisors
from fsdp_bench.errors import CombinationError


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    micro_batch_size: int = 1
    """Sequences per rank per micro-batch."""
    seq_len: int = 128
    seed: int = 0
    """Seeds the synthetic tokens and the weight initialisation."""

    def __post_init__(self) -> None:
        at_least(self, "micro_batch_size", 1)
        at_least(self, "seq_len", 1)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    grad_sync: Literal["every", "last", "all_reduce_last"] = "every"
    """every: reduce-scatter after each micro-batch; last: only after the final one
    (set_requires_gradient_sync(False) before the others: less communication, more memory);
    all_reduce_last (hsdp): reduce-scatter after each, all-reduce across the replicas only
    after the final one (set_requires_all_reduce(False) before the others)."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    optimizer_impl: Literal["foreach", "fused", "for_loop"] = "foreach"
    """How the optimizer's update runs: foreach (a few kernels over all tensors, with
    temporary copies of a group's states), fused (one kernel, no temporaries: what torchtitan
    and most GPU users pick) or for_loop (a tensor at a time)."""
    max_grad_norm: float | None = None
    """Clip the gradients' total norm to this (clip_grad_norm_ over the sharded gradients:
    an all-reduce of the norm every step; torchtitan's default is 1.0); None: no clipping."""
    learning_rate: float = 1e-4
    fp32_matmul: Literal["ieee", "tf32"] = "ieee"
    """How fp32 matmuls run on CUDA: ieee (full fp32, PyTorch's own default since 1.12, and
    what the parity tolerances assume) or tf32 (tensor cores, 10-bit mantissa: much faster on
    Ampere and later). bf16 runs are not affected. CPU runs ignore it."""
    compile: Literal["none", "block", "model"] = "none"
    """torch.compile (inductor): none (eager), block (each transformer block, applied after
    activation checkpointing and before fully_shard, as torchtitan does) or model (the whole
    model; FSDP2's hooks run eagerly between the compiled pieces). Warm-up pays the
    compilation; the record keeps it as compile_s."""
    compile_loss: bool = False
    """torch.compile (inductor) the loss, the cross-entropy with its fp32 upcast, on its own,
    as torchtitan does whenever it compiles (since its PR 1033, 2025-04): fused, the fp32
    logits and their log-softmax are never made, and the step's peak at the loss falls from
    six tensors of the (bf16) logits' size to two."""
    float8: Literal["none", "tensorwise", "rowwise", "rowwise_with_gw_hp"] = "none"
    """Float8 linears (torchao): the blocks' Linears whose dimensions are multiples of 16 run
    their matmuls in float8 with dynamic scales per tensor, per row, or per row with the
    weight gradient in high precision; the embedding and output projection stay in high
    precision (torchtitan's filter). MFU stays against the bf16 peak (torchtitan's way)."""
    expandable_segments: bool = False
    """CUDA's caching allocator with expandable segments (PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:True): one segment per stream that maps pages as it grows, instead
    of one cudaMalloc per segment, so less memory is reserved but unused (fragmentation).
    The worker switches it for the run; the memory estimate models it. CPU runs ignore it."""

    @property
    def compiled(self) -> bool:
        """Anything compiled: the model's blocks, the model, or the loss."""
        return self.compile != "none" or self.compile_loss

    def __post_init__(self) -> None:
        at_least(self, "accumulation_steps", 1)
        if not self.learning_rate > 0:
            raise bad_value("learning_rate", self.learning_rate, "expected a number > 0")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise bad_value("max_grad_norm", self.max_grad_norm, "expected a number > 0 or null")


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """A fault to inject, to check that failures are classified (tests, cluster shakedowns)."""

    kind: Literal["none", "oom", "error", "hang", "exit", "interrupt", "slow_pass"] = "none"
    """oom: a real allocation far beyond memory; error: an exception; hang: stop taking part
    in collectives; exit: the process dies without a word; interrupt: SIGINT to the rank, a
    Ctrl-C that reached the ranks but not fsdp-bench; slow_pass: each step of the run's
    first pass takes 20 times as long (passes that disagree)."""
    rank: int = 0
    """The rank that misbehaves (the others run normally)."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One point of a grid: everything that decides what is run and measured."""

    world_size: int = 1
    """Processes (GPUs) taking part."""
    processes_per_node: int | None = None
    """Processes per node; None puts every rank on one node."""
    strategy: Literal["fsdp", "hsdp", "ddp"] = "fsdp"
    """fsdp: FSDP2 fully_shard over all ranks; hsdp: shard inside groups of
    fsdp.shard_group_size ranks (a node by default), replicate across them (2-D mesh);
    ddp: DistributedDataParallel, the baseline to beat."""
    tp_size: int = 1
    """Ranks per tensor-parallel group: each block's matmuls split over them (torchtitan's
    Llama plan, `job.tensor_parallel`) on the inner dimension of a 2-D mesh (data-parallel
    shard x TP), so a group's ranks share a node; FSDP2 shards over the outer one. 1: none."""
    tp_across_nodes: bool = False
    """Let a tensor-parallel group span whole nodes (tp_size a multiple of the processes per
    node): every matmul's collectives then cross the network. Refused unless set."""
    tp_sequence_parallel: bool = True
    """With tensor parallelism: norms and the residual stream split along the sequence
    between blocks (sequence parallel, torchtitan's default), which divides the activations
    kept outside the matmuls by tp_size; false: replicated."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        at_least(self, "world_size", 1)
        ppn = self.processes_per_node
        if ppn is not None and (ppn < 1 or self.world_size % ppn):
            raise CombinationError(
                "processes_per_node",
                ppn,
                f"must divide world_size {self.world_size} "
                "(nodes = world_size / processes_per_node)",
            )
        replica = self.replica_ranks
        if self.strategy == "hsdp" and (self.world_size % replica or self.world_size == replica):
            raise CombinationError(
                "strategy",
                self.strategy,
                f"hsdp needs at least two replicas of {replica} ranks in world_size "
                f"{self.world_size}: set fsdp.shard_group_size to a proper divisor, or use nodes",
            )
        shard = self.shard_group_size
        if self.model.dtype == "bf16" and self.fsdp.mixed_precision != "bf16":
            raise CombinationError(
                "model.dtype",
                "bf16",
                "bf16 storage computes in bf16: set fsdp.mixed_precision: bf16 as well",
            )
        reshard = self.fsdp.reshard_after_forward
        grouping = str(self.fsdp.grouping)
        if reshard == "all_but_last" and grouping != "block" and not grouping_block_count(grouping):
            raise CombinationError(
                "fsdp.reshard_after_forward",
                reshard,
                f"all_but_last names the last block: it needs grouping block or blocks:K, not "
                f"{grouping}",
            )
        if isinstance(reshard, int) and not isinstance(reshard, bool) and shard % reshard:
            raise CombinationError(
                "fsdp.reshard_after_forward",
                reshard,
                f"an int must divide the shard group size ({shard} ranks): "
                f"allowed true, false, default or one of {divisors(shard)}",
            )
        if self.tp_size != 1:
            check_tensor_parallel(self)
        self._check_train()
        if not 0 <= self.fault.rank < self.world_size:
            raise CombinationError(
                "fault.rank", self.fault.rank, f"expected 0..{self.world_size - 1}"
            )
        if not self.model.is_user_model:
            n_layers = self.model.shape.n_layers
            k = grouping_block_count(str(self.fsdp.grouping))
            if k is not None and k > n_layers:
                raise CombinationError(
                    "fsdp.grouping",
                    self.fsdp.grouping,
                    f"K must be at most the model's {n_layers} blocks",
                )

    def check_device(self, device_type: str) -> None:
        """Settings one kind of device cannot run, refused before anything is launched."""
        if self.fsdp.symm_mem and device_type != "cuda":
            raise CombinationError(
                "fsdp.symm_mem", True, f"needs CUDA (NCCL symmetric memory), not {device_type}"
            )
        float8_gathers = self.train.float8 == "tensorwise" and self.tp_sequence_parallel
        if float8_gathers and self.tp_size > 1 and device_type != "cuda":
            raise CombinationError(
                "train.float8",
                "tensorwise",
                "with tensor parallelism and tp_sequence_parallel gathers float8 activations, "
                f"which gloo cannot carry (no float8 dtype): needs CUDA, not {device_type}; on "
                "the CPU set tp_sequence_parallel: false or train.float8: rowwise",
            )

    def _check_train(self) -> None:
        if self.train.grad_sync == "all_reduce_last" and self.strategy != "hsdp":
            raise CombinationError(
                "train.grad_sync",
                "all_reduce_last",
                f"all-reduces across HSDP's replicas: needs strategy hsdp, not {self.strategy}",
            )
        if self.fsdp.float8_all_gather and self.train.float8 != "tensorwise":
            raise CombinationError(
                "fsdp.float8_all_gather",
                True,
                "needs train.float8: tensorwise (torchao gathers float8 weights with "
                f"tensorwise scales only), not {self.train.float8}",
            )
        if self.train.compile_loss and self.tp_size > 1:
            raise CombinationError(
                "train.compile_loss",
                True,
                "compiles the loss on whole logits: needs tp_size 1, not "
                f"{self.tp_size} (tensor parallelism's loss runs on vocabulary shards)",
            )

    @property
    def nodes(self) -> int:
        return self.world_size // (self.processes_per_node or self.world_size)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each takes its own slice of the batch (the ranks of one
        tensor-parallel group take the same one)."""
        return self.world_size // self.tp_size

    @property
    def replica_ranks(self) -> int:
        """Ranks holding one replica of the model: all of them, except under hsdp
        (fsdp.shard_group_size, a node by default), tensor-parallel groups included."""
        if self.strategy != "hsdp":
            return self.world_size
        return self.fsdp.shard_group_size or self.processes_per_node or self.world_size

    @property
    def shard_group_size(self) -> int:
        """Ranks over which FSDP2 shards parameters: a replica's data-parallel ranks (tensor
        parallelism splits each shard further, over tp_size)."""
        return self.replica_ranks // self.tp_size

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """(world,); for hsdp (replicas, shard group); with TP, tp innermost: (shard, tp) or
        (replicas, shard, tp)."""
        replicas = self.world_size // self.replica_ranks
        shape = (replicas, self.shard_group_size) if replicas > 1 else (self.shard_group_size,)
        return (*shape, self.tp_size) if self.tp_size > 1 else shape

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """Names of `mesh_shape`'s dimensions, by which collectives are counted per dimension."""
        replicated = ("replicate",) if self.world_size > self.replica_ranks else ()
        return (*replicated, "shard", *(("tp",) if self.tp_size > 1 else ()))

    @property
    def run_id(self) -> str:
        """Stable id: a hash of the settings that differ from the defaults."""
        canonical = json.dumps(non_default_fields(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:12]

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one optimizer step over all ranks (a tensor-parallel group's once)."""
        d = self.data
        return self.dp_size * d.micro_batch_size * d.seq_len * self.train.accumulation_steps

    def canonical(self) -> RunConfig:
        """Settings that cannot matter reset to defaults, so equal runs get equal ids.

        Under DDP the FSDP-only knobs (FSDP_ONLY_FIELDS) do nothing;
        outside hsdp the shard group is every rank. With one group for the whole model
        (`grouping: root`), reshard_after_forward false is FSDP2's default: the root group
        is not resharded after forward unless asked explicitly (true, an int;
        torch/distributed/fsdp/_fully_shard/_fsdp_state.py, `_lazy_init`).
        """
        if self.strategy == "fsdp" and self.fsdp.shard_group_size is not None:
            return dataclasses.replace(
                self, fsdp=dataclasses.replace(self.fsdp, shard_group_size=None)
            ).canonical()
        if self.strategy != "ddp":
            if self.fsdp.grouping == "root" and self.fsdp.reshard_after_forward is False:
                fsdp = dataclasses.replace(self.fsdp, reshard_after_forward="default")
                return dataclasses.replace(self, fsdp=fsdp)
            return self
        kept = {
            f.name: getattr(self.fsdp, f.name)
            for f in dataclasses.fields(FsdpConfig)
            if f.name not in FSDP_ONLY_FIELDS
        }
        return dataclasses.replace(self, fsdp=FsdpConfig(**kept))


def alike_key(run: RunConfig) -> str:
    """The run's settings but its world size: runs with one key make the same allocations
    in the same order, the sizes of shards apart, which lets them share a simulation's check
    (`memory.simulate.simulate_alike`)."""
    fields = non_default_fields(run)
    fields.pop("world_size", None)
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))
