"""What a compiled region holds, under fake tensors.

Inductor does not run under FakeTensorMode (pytorch/pytorch#136446, #136586), but what a
compiled region saves for backward is not inductor's choice: AOTAutograd's partitioner picks it
on the joint forward-backward graph, before inductor sees either half (min-cut
rematerialisation, inductor's default, which recomputes cheap pointwise ops in backward instead
of saving their outputs). The simulation compiles the same modules with the same
decompositions and the same partitioner, and runs the two halves as operators on fake tensors,
where the recorder and the tracker see them; for the compiled loss with inductor's fusion
modelled as well (`memory.fused`). Nothing here imports torch until a backend is asked for:
the driver reads `compiled_as` without it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from fsdp_bench.config.fsdp import checkpointed_every

if TYPE_CHECKING:
    from fsdp_bench.config.run import RunConfig

__all__ = ["compiled_as", "partitioned_backend"]


def compiled_as(run: RunConfig) -> str:
    """How the simulation runs a compiled configuration: "none" (not compiled), "partition"
    (the partitioned graphs) or "eager" (tensor parallelism with whole blocks checkpointed:
    a compiled checkpoint of DTensor code saves a DeviceMesh for backward, which AOTAutograd
    refuses, in real runs too; without the checkpoint, or with selective_op, it partitions)."""
    if not run.train.compiled:
        return "none"
    whole_blocks = checkpointed_every(run.fsdp.activation_checkpointing) is not None
    return "eager" if run.tp_size > 1 and whole_blocks else "partition"


@functools.cache
def partitioned_backend(fused: bool = False) -> Any:
    """A torch.compile backend: inductor's decompositions and partitioner, each half run as
    operators, with (`fused`) inductor's fused intermediates unseen. One object for each:
    dynamo guards on the backend, and a new one for each step built would compile again."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    from fsdp_bench.memory.fused import run_fused

    return aot_autograd(
        fw_compiler=run_fused if fused else boxed_nop,
        bw_compiler=run_fused if fused else boxed_nop,
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
