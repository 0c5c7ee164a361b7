"""`train.compile`: torch.compile (inductor) per block or of the whole model, under FSDP2 and
DDP, on real gloo jobs; the compilation is recorded apart, and a compiler that cannot work
becomes an error record naming it while the sweep goes on."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.run import DataConfig, RunConfig, TrainConfig
from fsdp_bench.job.measure.allocator_peak import allocator_peak
from fsdp_bench.job.training import build_loss, loss_fn
from fsdp_bench.memory.alloc_trace import recording
from fsdp_bench.memory.compiled import partitioned_backend
from fsdp_bench.memory.estimate import estimate_run
from tests.conftest import sweep, tiny_grid

pytestmark = pytest.mark.slow


def test_compiled_runs_match_eager_and_are_measured_and_estimated(tmp_path: Path) -> None:
    axes = [
        {"train.compile": ["none", "block", "model"]},
        {"train.compile": ["model"], "fsdp.activation_checkpointing": ["block"]},
        {"train.compile": ["block"], "strategy": ["ddp"]},
        {"train.compile": ["none", "block"], "train.compile_loss": [True]},
    ]
    outcome, df = sweep(tmp_path, tiny_grid("compile", axes), verify=True)
    assert outcome.statuses == {"ok": 7}, df[["run_id", "status", "reason"]]
    assert df.parity_ok.all(), df[["compile", "parity_grad_max_abs_diff"]]
    is_compiled = (df.compile != "none") | df.compile_loss
    eager, compiled = df[~is_compiled], df[is_compiled]
    assert eager.compile_s.isna().all()
    # Every compiled run records its compilation. A compiled block or model (dynamo's caches
    # cleared between runs of the job) pays far more than a step of the tiny model; the loss
    # alone is one small graph that inductor's disk cache may already hold, so only recorded.
    assert compiled.compile_s.notna().all(), compiled[["compile", "compile_s"]]
    graphs = compiled[compiled.compile != "none"]
    assert (graphs.compile_s > graphs.step_time_s).all(), graphs[["compile", "compile_s"]]
    # FSDP2's hooks run eagerly between the compiled graphs: the collectives stay eager's.
    fsdp = df[(df.strategy == "fsdp") & (df.activation_checkpointing == "none")]
    for column in ("all_gathers_per_step", "reduce_scatters_per_step"):
        assert fsdp[column].nunique() == 1, fsdp[["compile", column]]
    # Memory: a compiled run's peak is taken at the CPU allocator (inductor's buffers are no
    # tensors the tracker sees, which alone reads less), and the estimate, which runs the
    # partitioned graphs on fake tensors, is within 10% of it, with and without checkpointing.
    df["error"] = df.estimated_peak_gib / df.peak_memory_gib - 1
    shown = df[["compile", "strategy", "activation_checkpointing", "peak_memory_source", "error"]]
    assert (compiled.peak_memory_source == "cpu_allocator").all(), shown
    assert (eager.peak_memory_source == "tracked_tensors").all(), shown
    assert (compiled.tracked_peak_gib < compiled.peak_memory_gib).all(), shown
    assert (df.error.abs() <= 0.10).all(), shown


def test_a_compiler_that_fails_is_an_error_record_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")  # inductor's CPU backend needs a C++ compiler
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # nothing cached
    grid = tiny_grid("no-compiler", [{"train.compile": ["block", "none"]}], world_size=1)
    outcome, df = sweep(tmp_path, grid)
    assert outcome.statuses == {"ok": 1, "error": 1}
    by_mode = df.set_index("compile")
    assert by_mode.loc["none", "status"] == "ok"
    assert by_mode.loc["block", "status"] == "error"
    reason = by_mode.loc["block", "reason"]
    assert "torch.compile failed" in reason and "/nonexistent/g++" in reason, reason


def _loss_peak_in_logits(loss: Any, logits_dtype: torch.dtype, fake: bool) -> float:
    """The peak of a loss's forward and backward above what was alive before, in multiples
    of the logits' size: at the CPU allocator for real tensors, in the simulation's
    recording for fake ones."""
    shape, vocab = (2, 512, 32000), 32000
    logits_bytes = 2 * 512 * 32000 * logits_dtype.itemsize
    with FakeTensorMode() if fake else contextlib.nullcontext():
        leaf = torch.randn(shape, dtype=logits_dtype, requires_grad=True)
        targets = torch.randint(0, vocab, shape[:2])
        for _ in range(2):  # the first compiles
            with recording() if fake else allocator_peak() as seen:
                loss(leaf * 1, targets).backward()  # the logits: made, and freed in backward
            leaf.grad = None
    peak = seen.trace.live_peak()[0] if fake else seen.bytes_above_start
    return peak / logits_bytes


@pytest.mark.parametrize("logits_dtype", [torch.bfloat16, torch.float32])
def test_a_compiled_loss_is_simulated_as_inductor_runs_it(logits_dtype: torch.dtype) -> None:
    """`train.compile_loss`: the cross-entropy with its fp32 upcast, eager and compiled with
    inductor, its peak at the CPU allocator beside the simulation's (the partitioned graphs
    with inductor's fused intermediates unseen), both built by `build_loss`."""
    run = RunConfig(train=TrainConfig(compile_loss=True))
    torch._dynamo.reset()
    real = {
        "eager": _loss_peak_in_logits(loss_fn, logits_dtype, fake=False),
        "compiled": _loss_peak_in_logits(build_loss(run), logits_dtype, fake=False),
    }
    simulated = {
        "eager": _loss_peak_in_logits(loss_fn, logits_dtype, fake=True),
        "compiled": _loss_peak_in_logits(
            build_loss(run, partitioned_backend(fused=True)), logits_dtype, fake=True
        ),
    }
    assert simulated == pytest.approx(real, rel=0.02), (real, simulated)
    # Fused, the fp32 logits and log-softmax never exist: the logits and their gradient, a
    # logits' size or more below eager (four of them for bf16 logits).
    assert real["compiled"] == pytest.approx(2.0, rel=0.02), real
    assert real["eager"] - real["compiled"] >= (3.9 if logits_dtype == torch.bfloat16 else 0.9)


def test_a_loss_compiled_on_cuda_is_also_estimated_eager_for_its_high_end() -> None:
    """On CUDA the fused loss is not measured: its estimate carries the same step with the
    loss eager, which is the eager-loss run's own estimate, and higher."""
    base = RunConfig(
        model=ModelConfig(name="tiny"),
        data=DataConfig(micro_batch_size=2, seq_len=128),
        fsdp=FsdpConfig(mixed_precision="bf16"),
    )
    compiled = dataclasses.replace(base, train=TrainConfig(compile_loss=True))
    bounded, eager = estimate_run(compiled, "cuda"), estimate_run(base, "cuda")
    assert eager.eager_loss_reserved_gib is None and eager.estimated_reserved_gib is not None
    assert bounded.eager_loss_reserved_gib == pytest.approx(eager.estimated_reserved_gib)
    assert bounded.eager_loss_allocated_gib == pytest.approx(eager.estimated_allocated_gib)
    assert bounded.estimated_allocated_gib < bounded.eager_loss_allocated_gib
