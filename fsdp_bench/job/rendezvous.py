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

from fsdp_bench.errors import ConfigError
from fsdp_bench.store import write_atomic


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    num_nodes: int
    job_id: str
    attempt: int
    """Requeue or restart count: a requeued job (a restarted group) rendezvous afresh."""
    launcher: str = "submitit"
    """Who started the process: submitit (fsdp-bench's own jobs), torchrun or srun."""

    @property
    def local_world_size(self) -> int:
        return self.world_size // self.num_nodes


def rank_info() -> RankInfo:
    """This process's place, from the environment of whoever started it: submitit's job
    environment (fsdp-bench's jobs), torchrun's (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, TORCHELASTIC_RUN_ID) or a Slurm step's (srun: SLURM_PROCID,
    SLURM_LOCALID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NUM_NODES)."""
    env = os.environ
    if "SUBMITIT_EXECUTOR" in env:
        import submitit

        job = submitit.JobEnvironment()
        return RankInfo(
            rank=job.global_rank,
            local_rank=job.local_rank,
            world_size=job.num_tasks,
            num_nodes=job.num_nodes,
            job_id=str(job.job_id),
            attempt=int(env.get("SLURM_RESTART_COUNT", "0")),
        )
    if "TORCHELASTIC_RUN_ID" in env:
        world_size = int(env["WORLD_SIZE"])
        return RankInfo(
            rank=int(env["RANK"]),
            local_rank=int(env["LOCAL_RANK"]),
            world_size=world_size,
            num_nodes=world_size // int(env["LOCAL_WORLD_SIZE"]),
            job_id=f"torchrun-{env['TORCHELASTIC_RUN_ID']}",
            attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        return RankInfo(
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env["SLURM_LOCALID"]),
            world_size=int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1"))),
            num_nodes=int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1"))),
            job_id=f"{env.get('SLURM_JOB_ID', 'slurm')}.{env['SLURM_STEP_ID']}",
            attempt=int(env.get("SLURM_RESTART_COUNT", "0")),
            launcher="srun",
        )
    raise ConfigError(
        "no launcher environment found: start `fsdp-bench run` with torchrun (RANK, "
        "LOCAL_RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID) or srun (SLURM_PROCID, SLURM_STEP_ID); "
        "`fsdp-bench sweep` starts its own jobs"
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


def device_at_init(device: torch.device) -> tuple[str | None, int | None]:
    """(the GPU's UUID, device memory in use now) on CUDA, (None, None) elsewhere: after the
    group's first collective, what is in use is the CUDA context and NCCL's buffers."""
    if device.type != "cuda":
        return None, None
    free, total = torch.cuda.mem_get_info(device)
    return str(torch.cuda.get_device_properties(device).uuid), total - free


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
    backend = "gloo"
    if device.type == "cuda":
        backend = "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"
    store: dist.Store
    if info.launcher == "torchrun":
        store = _torchrun_store(info, timeout_s)
    else:
        store, host = _rendezvous(
            info, rendezvous_dir / f"{info.job_id}.{info.attempt}.json", timeout_s
        )
        # The usual variables, for user model code that reads them (torch uses the store).
        os.environ.update(
            RANK=str(info.rank),
            LOCAL_RANK=str(info.local_rank),
            WORLD_SIZE=str(info.world_size),
            LOCAL_WORLD_SIZE=str(info.local_world_size),
            MASTER_ADDR=host,
            MASTER_PORT=str(store.port),
        )
    dist.init_process_group(
        backend,
        store=store,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def _torchrun_store(info: RankInfo, timeout_s: float) -> dist.Store:
    """The store torchrun's rendezvous gave (MASTER_ADDR, MASTER_PORT), under a prefix of
    this attempt: the agent's store outlives a restart of the group, and the new group would
    otherwise read the old one's gloo addresses and fail to connect."""
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        info.world_size,
        is_master=info.rank == 0 and not agent_hosts_it,
        timeout=timedelta(seconds=timeout_s),
    )
    return dist.PrefixStore(f"fsdp_bench/attempt_{info.attempt}", base)


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
