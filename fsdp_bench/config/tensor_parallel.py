"""What `tp_size` must divide, and what tensor parallelism cannot be combined with: one line
each, when a run is made (the presets'; a transformers or user model's once it is built,
`memory.model_check`). No torch."""

from __future__ import annotations

from typing import Literal, Protocol

from fsdp_bench.config.model import ModelConfig
from fsdp_bench.errors import CombinationError


class _Sequence(Protocol):
    @property
    def seq_len(self) -> int: ...


class TensorParallelRun(Protocol):
    """What the check reads of a run (a `RunConfig`), so this module need not import it."""

    @property
    def tp_size(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def processes_per_node(self) -> int | None: ...
    @property
    def tp_across_nodes(self) -> bool: ...
    @property
    def tp_sequence_parallel(self) -> bool: ...
    @property
    def strategy(self) -> Literal["fsdp", "hsdp", "ddp"]: ...
    @property
    def replica_ranks(self) -> int: ...
    @property
    def model(self) -> ModelConfig: ...
    @property
    def data(self) -> _Sequence: ...


def check_tensor_parallel(run: TensorParallelRun) -> None:
    """What `tp_size` must divide and what it cannot be combined with (yet), one line each."""
    tp = run.tp_size
    if tp < 1 or run.world_size % tp:
        raise CombinationError(
            "tp_size",
            tp,
            f"must divide world_size {run.world_size}: one of {divisors(run.world_size)}",
        )
    ppn = run.processes_per_node
    if ppn is not None and ppn % tp and not (run.tp_across_nodes and tp % ppn == 0):
        how = (
            f"a multiple of processes_per_node {ppn} (whole nodes per group)"
            if run.tp_across_nodes
            else f"a divisor of processes_per_node {ppn}: one of {divisors(ppn)}; a tensor-"
            "parallel group stays inside a node (its collectives are on every matmul) unless "
            "tp_across_nodes: true"
        )
        raise CombinationError("tp_size", tp, f"must be {how}")
    if run.strategy == "ddp":
        raise CombinationError(
            "tp_size", tp, "tensor parallelism runs with strategy fsdp or hsdp, not ddp"
        )
    if run.replica_ranks % tp:
        raise CombinationError(
            "tp_size", tp,
            f"must divide the ranks of one hsdp replica ({run.replica_ranks}: "
            "fsdp.shard_group_size, a node by default)",
        )  # fmt: skip
    if run.model.is_user_model:  # hf: and users' models: checked once built (model_check)
        return
    shape = run.model.shape
    for name, size in (("n_heads", shape.n_heads), ("n_kv_heads", shape.n_kv_heads),
                       ("ffn_dim", shape.ffn_dim), ("vocab_size", shape.vocab_size)):  # fmt: skip
        if size % tp:
            raise CombinationError(
                "tp_size",
                tp,
                f"must divide the model's {name} ({size}): one of {divisors(size, 64)}",
            )
    if shape.tie_embeddings:
        raise CombinationError(
            "tp_size",
            tp,
            "tensor parallelism needs an output projection of its own (tie_embeddings)",
        )
    if run.tp_sequence_parallel and run.data.seq_len % tp:
        raise CombinationError(
            "tp_size", tp, f"sequence parallel splits seq_len {run.data.seq_len}: it must divide it"
        )


def divisors(n: int, up_to: int | None = None) -> str:
    """The divisors of `n` as a list to print (the first ones up to `up_to`)."""
    found = [d for d in range(1, min(n, up_to or n) + 1) if n % d == 0]
    return ", ".join(map(str, found)) + (f" (up to {up_to})" if up_to and n > up_to else "")
