"""What saving and restoring a run's training state costs, through Distributed Checkpoint.

After the timed steps, off the timed path, every rank saves its shards of the model and of
the optimizer state with `torch.distributed.checkpoint` (one file per rank and the metadata,
as a sharded training job saves; seed 000, section 10), then loads them back into the same
model and optimizer. Each phase ends when the slowest rank ends it (the record takes the
largest rank's time); `checkpoint_bytes` is what the folder holds.

With `--verify` two restores are checked: at the same world size (parameters and optimizer
state overwritten first, so that a load that restores nothing fails), and at world size 1
(rank 0 alone loads the files the N ranks wrote into full tensors and compares each with the
full parameter gathered from the shards: the reshard a user does to evaluate or to resume on
fewer GPUs). Their failure is reported in the record, never the run's status.
"""

from __future__ import annotations

import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_bench.config.run import RunConfig
from fsdp_bench.errors import one_line
from fsdp_bench.job.training import synchronize


@dataclass
class CheckpointCost:
    save_s: float
    load_s: float
    num_bytes: int
    """On disk, every rank's file and the metadata (rank 0's count; 0 on other ranks)."""
    folder: str
    kept: bool
    restore_ok: bool | None = None
    """--verify: the same world size restored every parameter and optimizer state tensor."""
    reshard_ok: bool | None = None
    """--verify: world size 1 loaded every parameter as the shards held it."""
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def checkpoint_cost(
    run: RunConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    results_root: Path,
    device: torch.device,
    verify: bool,
) -> dict[str, Any]:
    """`measure_checkpoint` in the run's own folder under measure.checkpoint_dir (default:
    checkpoints/ in the results folder), as plain data for the record. Its own failure (a
    full disk, say) is reported there, never as the run's status."""
    where = run.measure.checkpoint_dir or results_root / "checkpoints"
    folder = Path(where) / run.run_id
    keep = run.measure.keep_checkpoint
    try:
        return measure_checkpoint(model, optimizer, folder, device, keep, verify).as_dict()
    except Exception as err:  # DCP raises one CheckpointException on every rank
        return {"folder": str(folder), "detail": f"checkpoint failed: {one_line(err)}"}


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def _restore(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )


def _local_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a (nested) state dict, as this rank holds it (a DTensor's shard)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return [state.to_local()]
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in _local_tensors(state[key])]
    if isinstance(state, (list, tuple)):
        return [t for item in state for t in _local_tensors(item)]
    return []


def _timed(device: torch.device, action: Callable[[], object]) -> float:
    dist.barrier()
    synchronize(device)
    start = time.perf_counter()
    action()
    synchronize(device)
    return time.perf_counter() - start


def measure_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    folder: Path,
    device: torch.device,
    keep: bool,
    verify: bool,
) -> CheckpointCost:
    """Save, then load back, the run's sharded state in `folder` (emptied first); every
    rank. Removes the folder afterwards unless `keep`."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    state = _state(model, optimizer)
    # Host copies: a second copy of the state on the device could be what runs out of memory.
    saved = [t.detach().to("cpu", copy=True) for t in _local_tensors(state)] if verify else []
    save_s = _timed(device, lambda: dcp.save(state, checkpoint_id=str(folder)))
    num_bytes = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if rank == 0 else 0
    if verify:
        with torch.no_grad():
            for tensor in _local_tensors(state):
                if tensor.is_floating_point():
                    tensor.fill_(float("nan"))
                else:
                    tensor.zero_()

    def load() -> None:
        dcp.load(state, checkpoint_id=str(folder))
        _restore(model, optimizer, state)

    load_s = _timed(device, load)
    cost = CheckpointCost(save_s, load_s, num_bytes, str(folder), keep)
    if verify:
        restored = _local_tensors(_state(model, optimizer))
        same = len(restored) == len(saved) and all(
            torch.equal(a.cpu(), b) for a, b in zip(restored, saved, strict=True)
        )
        cost.restore_ok = _all_ranks(same, device)
        cost.reshard_ok, cost.detail = _reshard_to_one(model, folder, device)
    dist.barrier()
    if rank == 0 and not keep:
        shutil.rmtree(folder, ignore_errors=True)
    return cost


def _all_ranks(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(flag)
    return int(flag.item()) == 0


def _reshard_to_one(model: nn.Module, folder: Path, device: torch.device) -> tuple[bool, str]:
    """Rank 0 loads each parameter from the checkpoint alone (no process group: a world of
    one) and compares it with the full parameter gathered from every rank's shard, one
    parameter at a time (a whole model at once would not fit beside the run's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    mismatched: list[str] = []
    state = get_model_state_dict(model)
    for name in sorted(state):
        value = state[name]
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if rank != 0 or not isinstance(full, torch.Tensor):
            continue
        loaded = {"model": {name: torch.empty_like(full, device="cpu")}}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(loaded, checkpoint_id=str(folder), no_dist=True)
        if not torch.equal(loaded["model"][name], full.detach().cpu()):
            mismatched.append(name)
    ok = _all_ranks(not mismatched, device)
    if ok:
        return True, ""
    names = ", ".join(mismatched[:3]) + (" ..." if len(mismatched) > 3 else "")
    return False, f"reshard to world size 1: {len(mismatched)} parameters differ ({names})"
