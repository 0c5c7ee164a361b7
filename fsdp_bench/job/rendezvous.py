"""Process-group setup inside a job: who am I, which device, and a collision-free rendezvous.

The rendezvous port is chosen by the operating system on rank 0 (a TCPStore bound to port 0)
and published through a file in the job folder, which every node of a job shares (submitit
requires a shared folder). Two jobs on one node therefore cannot pick the same port, which a
port derived from a job id or a fixed default can.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_bench.store import write_atomic


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    num_nodes: int
    job_id: str
    attempt: int
    """Requeue count: a requeued job rendezvous afresh."""

    @property
    def local_world_size(self) -> int:
        return self.world_size // self.num_nodes


def rank_info() -> RankInfo:
    """This process's place in the job (from submitit's job environment)."""
    import submitit

    env = submitit.JobEnvironment()
    return RankInfo(
        rank=env.global_rank,
        local_rank=env.local_rank,
        world_size=env.num_tasks,
        num_nodes=env.num_nodes,
        job_id=str(env.job_id),
        attempt=int(os.environ.get("SLURM_RESTART_COUNT", "0")),
    )


def pick_device(kind: str, local_rank: int, device_count: int | None = None) -> torch.device:
    """cuda:<LOCAL_RANK> (never the global rank) when CUDA is asked for or available.

    One GPU per rank: two ranks on one GPU make NCCL fail at its first communicator, far from
    the cause, so a local rank without a GPU of its own is an error here."""
    use_cuda = kind == "cuda" or (kind == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    visible = torch.cuda.device_count() if device_count is None else device_count
    if local_rank >= visible:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU of its own: {visible} visible on this node "
            "(one rank per GPU; check processes_per_node / gpus_per_node and "
            "CUDA_VISIBLE_DEVICES)"
        )
    device = torch.device("cuda", local_rank)
    if device_count is None:
        torch.cuda.set_device(device)
    return device


def init_process_group(
    info: RankInfo,
    device: torch.device,
    rendezvous_dir: Path,
    timeout_s: float,
    cpu_collectives: bool = False,
) -> None:
    """NCCL on GPUs, gloo on CPUs; `timeout_s` bounds every collective (a hang becomes an error).

    `cpu_collectives` adds gloo beside NCCL on GPUs, for collectives of CPU tensors: the
    parity check gathers CPU-offloaded shards, which NCCL cannot."""
    store, host = _rendezvous(
        info, rendezvous_dir / f"{info.job_id}.{info.attempt}.json", timeout_s
    )
    # The usual variables, for user model code that reads them (torch itself uses the store).
    os.environ.update(
        RANK=str(info.rank),
        LOCAL_RANK=str(info.local_rank),
        WORLD_SIZE=str(info.world_size),
        LOCAL_WORLD_SIZE=str(info.local_world_size),
        MASTER_ADDR=host,
        MASTER_PORT=str(store.port),
    )
    backend = "gloo"
    if device.type == "cuda":
        backend = "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"
    dist.init_process_group(
        backend,
        store=store,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def _rendezvous(info: RankInfo, address_file: Path, timeout_s: float) -> tuple[dist.TCPStore, str]:
    """The store rank 0 serves, and the host the others reach it at.

    Rank 0 publishes its own hostname (loopback on one node): under a cyclic or arbitrary
    task distribution, rank 0 need not run on the first host of the allocation."""
    timeout = timedelta(seconds=timeout_s)
    if info.rank == 0:
        host = "127.0.0.1" if info.num_nodes == 1 else hostname()
        store = dist.TCPStore(
            host,
            0,
            info.world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
        )
        token = secrets.token_hex(8)
        store.set("fsdp_bench_token", token)
        address = {"host": host, "port": store.port, "token": token}
        write_atomic(address_file, json.dumps(address))
        return store, host
    deadline = time.monotonic() + timeout_s
    while True:
        connected = _try_connect(address_file, info, timeout)
        if connected is not None:
            return connected
        if time.monotonic() > deadline:
            raise TimeoutError(f"rendezvous: rank 0 did not publish {address_file} in {timeout_s}s")
        time.sleep(0.05)


def _try_connect(
    address_file: Path, info: RankInfo, timeout: timedelta
) -> tuple[dist.TCPStore, str] | None:
    """Connect to the store named in the file, if the file is there and not stale."""
    try:
        address = json.loads(address_file.read_text())
    except (OSError, ValueError):
        return None
    try:
        store = dist.TCPStore(
            address["host"],
            address["port"],
            info.world_size,
            is_master=False,
            timeout=timedelta(seconds=10),
        )
        if store.get("fsdp_bench_token").decode() != address["token"]:
            return None
    except (RuntimeError, OSError):
        return None  # a file left by an earlier attempt, pointing at a closed port
    store.set_timeout(timeout)
    return store, address["host"]


def barrier_and_destroy() -> None:
    """A barrier first: tearing down while a peer still works can abort it (seen on gloo)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def hostname() -> str:
    return socket.gethostname()


def cpus_for_rank(info: RankInfo) -> int:
    """What Slurm gave this task, else this machine's cores shared by the ranks on it."""
    allotted = os.environ.get("SLURM_CPUS_PER_TASK")
    if allotted:
        return int(allotted)
    return max(1, (os.cpu_count() or 1) // info.local_world_size)
