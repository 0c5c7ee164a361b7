"""What decides an OOM on a GPU: the device's memory, not the tensors. Three figures per rank
from one estimate, and the budget judged on the last:

    allocated    the tensors, as the caching allocator books them (rounded, unsplit blocks),
                 with cuBLAS's workspaces: torch.cuda.max_memory_allocated
    reserved     the allocator's segments (`allocator.py` replays the simulation's allocations,
                 per stream): torch.cuda.max_memory_reserved
    device-used  reserved + what lives outside the allocator: the CUDA context and loaded
                 kernels, NCCL's buffers per communicator: what the card holds (total - free)

Outside the allocator, each term has a default model (`error_model`, with its sources and
width); measured CUDA runs in the results folder replace it (`calibration`), and
`memory.overhead_gib` overrides it.
"""

from __future__ import annotations

from fsdp_bench.config.gpus import GPUS
from fsdp_bench.config.run import RunConfig
from fsdp_bench.memory.error_model import CONTEXT_GIB, NCCL_COMMUNICATOR_GIB, Communicator


def communicators(run: RunConfig, gpu: str | None = None) -> list[Communicator]:
    """The NCCL communicators a rank of the run's job holds: the default group (the job's own
    collectives; FSDP's 1-D mesh and DDP use it too), HSDP's and TP's mesh dimensions, and the
    post-forward mesh of an integer `reshard_after_forward` (one per job, `post_forward_mesh`).
    The default group counts at any size (one rank's held 0.545 GiB on an H200); further
    groups of one rank issue no collectives and are left out. A group's ranks are `stride`
    apart; ranks fill nodes in order (torchrun, srun)."""
    per_node = run.processes_per_node or run.world_size
    groups = [(run.world_size, 1)]
    if run.strategy == "hsdp" or run.tp_size > 1:  # a group per dimension of the mesh
        stride = 1
        for size in reversed(run.mesh_shape):
            groups.append((size, stride))
            stride *= size
    reshard = run.fsdp.reshard_after_forward
    if run.strategy != "ddp" and type(reshard) is int and 1 < reshard < run.shard_group_size:
        groups.append((reshard, run.tp_size))
    kind = GPUS.get(gpu or "")
    multicast = kind.nvswitch_multicast if kind is not None else True  # unknown: maybe
    found = []
    for index, (size, stride) in enumerate(groups):
        if index and size == 1:
            continue
        on_a_node = min(size, max(1, per_node // stride))
        found.append(Communicator(size, size > on_a_node, multicast and on_a_node > 1))
    return found


def outside_terms_gib(run: RunConfig, device_type: str) -> dict[str, float]:
    """The default model of device memory outside the allocator, by term (none on CPU)."""
    if device_type != "cuda":
        return {}
    return {
        "cuda_context": CONTEXT_GIB,
        "nccl": NCCL_COMMUNICATOR_GIB * len(communicators(run)),
    }
