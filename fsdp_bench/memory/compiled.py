"""What a compiled region keeps for backward, under fake tensors.

Inductor does not run under FakeTensorMode (pytorch/pytorch#136446, #136586), but what a
compiled region saves for backward is not inductor's choice: AOTAutograd's partitioner picks it
on the joint forward-backward graph, before inductor sees either half (min-cut
rematerialisation, inductor's default, which recomputes cheap pointwise ops in backward instead
of saving their outputs). The simulation compiles the same modules with the same
decompositions and the same partitioner, and runs the two halves as plain operators on fake
tensors, where the recorder and the tracker see them. What inductor adds after the partition,
fusing pointwise chains so their intermediates never exist, is not modelled: those
intermediates live here for one operator each (a bound, of a few activation-sized tensors).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdp_bench.config.run import RunConfig

__all__ = ["compiled_as", "partitioned_backend"]


def compiled_as(run: RunConfig) -> str:
    """How the simulation runs a compiled configuration: "none" (not compiled), "partition"
    (the partitioned graphs) or "eager" (with tensor parallelism, whose DTensor regions
    AOTAutograd cannot save under fake tensors: a DeviceMesh among the saved values)."""
    if run.train.compile == "none":
        return "none"
    return "eager" if run.tp_size > 1 else "partition"


def partitioned_backend() -> Any:
    """A torch.compile backend: inductor's decompositions and partitioner, graphs run eagerly."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    return aot_autograd(
        fw_compiler=boxed_nop,
        bw_compiler=boxed_nop,
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
