"""Checkpoint cost (`measure.checkpoint`): Distributed Checkpoint save and load of the sharded
state, timed after the timed steps, with --verify's restore checks at the same world size
and at world size 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from fsdp_bench.config.grid import parse_grid
from fsdp_bench.config.run import RunConfig
from fsdp_bench.errors import ConfigError
from fsdp_bench.job.measure import checkpoint_cost
from fsdp_bench.job.model.zoo import build_model
from fsdp_bench.job.parallel.parallelize import parallelize
from fsdp_bench.job.training import build_optimizer, make_train_step, rank_batches
from fsdp_bench.report import tables
from tests.conftest import sweep, tiny_grid

CPU = torch.device("cpu")


def _trained(mesh: DeviceMesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The tiny model sharded on a one-rank mesh, one optimizer step taken (Adam's state)."""
    run = RunConfig(world_size=1)
    bundle = build_model(run.model)
    model, _ = parallelize(bundle, run, mesh, CPU)
    optimizer = build_optimizer(model, run)
    make_train_step(model, optimizer, rank_batches(run, 0, bundle.vocab_size, CPU), run)()
    return model, optimizer


def test_a_load_that_restores_nothing_is_caught(
    mesh: DeviceMesh, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = _trained(mesh)
    cost = checkpoint_cost.measure_checkpoint(
        model, optimizer, tmp_path / "ok", CPU, keep=True, verify=True
    )
    assert cost.restore_ok is True and cost.reshard_ok is True, cost.detail
    assert (tmp_path / "ok" / ".metadata").is_file() and cost.kept
    state_bytes = sum(4 * p.numel() for p in model.parameters()) * 3  # params, Adam's 2 moments
    assert state_bytes <= cost.num_bytes < 1.5 * state_bytes + 1_000_000
    assert cost.save_s > 0 and cost.load_s > 0

    import torch.distributed.checkpoint as dcp

    monkeypatch.setattr(dcp, "load", lambda *args, **kwargs: None)
    broken = checkpoint_cost.measure_checkpoint(
        model, optimizer, tmp_path / "broken", CPU, keep=False, verify=True
    )
    assert broken.restore_ok is False and broken.reshard_ok is False
    assert broken.detail.startswith("reshard to world size 1: ")
    assert not (tmp_path / "broken").exists(), "removed unless kept"


def test_checkpoint_settings_need_the_checkpoint() -> None:
    grid = {"name": "g", "base": {"measure": {"keep_checkpoint": True}}, "axes": {}}
    with pytest.raises(ConfigError) as info:
        parse_grid(grid, source="grid.yaml")
    assert str(info.value) == (
        "grid.yaml: base.measure.keep_checkpoint: true is not allowed; "
        "needs measure.checkpoint: true (it is false)"
    )


@pytest.mark.slow
def test_a_sweep_records_what_saving_and_restoring_cost(tmp_path: Path) -> None:
    """World size 2, --verify: FSDP2 block and root and the DDP baseline save, restore at 2
    and reshard to 1; one run keeps its files where measure.checkpoint_dir says."""
    kept = tmp_path / "pfs"
    measure = {"warmup_steps": 1, "timed_steps": 1, "repeats": 1, "checkpoint": True}
    axes = [
        {"fsdp.grouping": ["block", "root"]},
        {"strategy": ["ddp"]},
        {"fsdp.grouping": ["linear"], "measure.keep_checkpoint": [True],
         "measure.checkpoint_dir": [str(kept)]},
    ]  # fmt: skip
    _, df = sweep(tmp_path, tiny_grid("ckpt", axes, measure=measure), verify=True)
    assert set(df["status"]) == {"ok"} and len(df) == 4, df[["run_id", "reason"]]
    assert (df["checkpoint_save_s"] > 0).all() and (df["checkpoint_load_s"] > 0).all()
    assert df["checkpoint_restore_ok"].all() and df["checkpoint_reshard_ok"].all()
    assert (df["checkpoint_bytes"] > 0).all() and set(df["reason"]) == {""}
    linear = df[df["grouping"] == "linear"].iloc[0]
    assert linear["checkpoint_dir"] == str(kept / linear["run_id"])
    assert (kept / linear["run_id"] / ".metadata").is_file()
    assert df[df["grouping"] != "linear"]["checkpoint_dir"].isna().all()
    assert not any((tmp_path / "results" / "checkpoints").glob("*")), "removed after loading"
    shown = tables.ranking(df)  # the terminal ranking and the report's table of all runs
    assert {"checkpoint_save_s", "checkpoint_load_s"} <= set(shown.columns)
