"""Where a step's time goes (`step_trace`, `intervals`): the decomposition on hand-built
timelines, and on real profiled steps of a two-rank gloo job."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from fsdp_bench.job.measure.intervals import length, uncovered, union
from fsdp_bench.job.measure.memory_timeline import MAX_POINTS, TimelineSampler
from fsdp_bench.job.measure.step_trace import (
    MARK_PREFIX,
    PhaseClock,
    TimelineEvent,
    breakdown,
    timeline_from_trace,
)
from fsdp_bench.job.measure.tracker import TensorMemoryTracker
from fsdp_bench.memory.fake import fake_world
from fsdp_bench.report import figure_data, tables
from tests.conftest import REPO, sweep, tiny_grid

MAIN, GLOO = 1, 2


def test_intervals_merge_and_subtract() -> None:
    assert union([(0, 1), (0.5, 2), (3, 4), (4, 5), (6, 6)]) == [(0, 2), (3, 5)]
    assert length([(0, 1), (0.5, 2)]) == 2
    assert uncovered([(0, 10)], [(2, 3), (5, 7)]) == 7
    assert uncovered([(0, 10)], []) == 10 and uncovered([(0, 10)], [(-1, 11)]) == 0
    assert uncovered([(0, 2), (4, 6)], [(1, 1.5), (1.8, 4.5), (5, 5.5)]) == pytest.approx(2.3)


def _cpu(name: str, start: float, end: float, thread: int = MAIN) -> TimelineEvent:
    return TimelineEvent(name, start, end, thread, on_device=False)


def test_cpu_breakdown_counts_what_the_main_thread_did_not_cover() -> None:
    """An all-gather before any compute (exposed whole), one under the forward's matmul
    (hidden), a reduce-scatter half under the backward's."""
    events = [
        _cpu(MARK_PREFIX + "forward", 0, 400),
        _cpu("gloo:all_gather", 0, 100, GLOO),
        _cpu("aten::mm", 100, 300),
        _cpu("gloo:all_gather", 150, 250, GLOO),
        _cpu(MARK_PREFIX + "backward", 400, 900),
        _cpu("aten::mm", 400, 800),
        _cpu("gloo:reduce_scatter", 700, 900, GLOO),
        _cpu(MARK_PREFIX + "optimizer", 900, 1000),
        _cpu("aten::_foreach_add_", 900, 1000, GLOO),  # another thread: not main's compute
    ]
    found = breakdown(events, on_cuda=False)
    assert (found.forward_s, found.backward_s, found.optimizer_s) == (400e-6, 500e-6, 100e-6)
    assert found.step_s == pytest.approx(1000e-6)
    assert found.comm_s == pytest.approx(400e-6)
    assert found.exposed_comm_s == pytest.approx(200e-6)
    assert found.comm_hidden_pct == pytest.approx(50.0)
    assert found.all_gather_s == [100e-6, 100e-6] and found.all_gather_exposed_s == [100e-6, 0.0]


def test_cuda_breakdown_reads_nccl_kernels_against_kernels_not_annotations() -> None:
    """A CUDA step's trace (tests/data, in torch.profiler's format): the NCCL kernel half
    under a matmul. The device-side annotations (FSDP::pre_forward over all of it, the
    nccl: range, Optimizer.step over idle time) are neither compute nor communication:
    counted as kernels, nothing would be exposed and communication would grow."""
    events = timeline_from_trace(REPO / "tests" / "data" / "cuda_step_trace.json")
    assert sum(e.annotation and e.on_device for e in events) == 4
    phases = {"forward": 290e-6, "backward": 0.0, "optimizer": 100e-6, "step": 390e-6}
    found = breakdown(events, on_cuda=True, phase_s=phases)
    assert found.comm_s == pytest.approx(100e-6) and found.exposed_comm_s == pytest.approx(50e-6)
    assert found.all_gather_s == [pytest.approx(100e-6)]
    assert found.all_gather_exposed_s == [pytest.approx(50e-6)]
    assert (found.forward_s, found.optimizer_s, found.step_s) == (290e-6, 100e-6, 390e-6)
    assert breakdown([], on_cuda=False).comm_hidden_pct is None


@dataclass
class FakeEvent:
    """A timing event that reads a clock the test moves (CUDA events need a GPU)."""

    clock: list[float]
    at_ms: float | None = None

    def record(self) -> None:
        self.at_ms = self.clock[0]

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at_ms is not None and end.at_ms is not None
        return end.at_ms - self.at_ms


def test_the_phase_clock_sums_each_phase_over_micro_batches() -> None:
    """Two micro-batches, then the optimizer, each phase lasting what the device says."""
    clock = [0.0]
    phases = PhaseClock(lambda: FakeEvent(clock))
    for phase, lasts_ms in [("forward", 3), ("backward", 6), ("forward", 2), ("backward", 5),
                            ("optimizer", 1)]:  # fmt: skip
        with phases(phase):
            clock[0] += lasts_ms
    assert phases.seconds() == pytest.approx(
        {"forward": 5e-3, "backward": 11e-3, "optimizer": 1e-3, "step": 17e-3}
    )


@pytest.mark.slow
def test_a_two_rank_step_is_broken_down_its_memory_drawn_and_its_trace_kept(
    tmp_path: Path,
) -> None:
    measure = {"warmup_steps": 2, "timed_steps": 2, "repeats": 1, "trace": True}
    axes = {"fsdp.grouping": ["root", "block"]}
    _, df = sweep(tmp_path, tiny_grid("trace", axes, measure=measure))
    assert set(df["status"]) == {"ok"}, df[["run_id", "reason"]]
    for _, run in df.iterrows():
        phases = run["forward_s"] + run["backward_s"] + run["optimizer_s"]
        assert 0.9 * run["profiled_step_s"] <= phases <= run["profiled_step_s"] * 1.0001
        assert 0 < run["exposed_comm_s"] <= run["comm_s"] * 1.0001
        assert len(run["all_gather_group_gb_s"]) == run["all_gathers_per_step"]
        assert all(gb_s > 0 for gb_s in run["all_gather_group_gb_s"])
        check_timeline(run)
        for rank in (0, 1):
            trace = tmp_path / "results" / "traces" / run["run_id"] / f"rank{rank}.json"
            names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
            assert {MARK_PREFIX + p for p in ("forward", "backward", "optimizer")} <= names
        # rank 0's kept trace, read back, breaks down as the profiler's live events did
        trace = tmp_path / "results" / "traces" / run["run_id"] / "rank0.json"
        again = breakdown(timeline_from_trace(trace), on_cuda=False)
        for name in ("forward_s", "backward_s", "optimizer_s", "comm_s", "exposed_comm_s"):
            assert getattr(again, name) == pytest.approx(run[name], rel=1e-3, abs=1e-6), name
    root = df[df["grouping"] == "root"].iloc[0]
    first_s, first_exposed_s = root["all_gather_s"][0], root["all_gather_exposed_s"][0]
    assert first_exposed_s == pytest.approx(first_s, rel=0.1), "nothing to hide it behind"
    shown = tables.step_table(figure_data.step_phases(df))
    assert list(shown.columns) == [
        "configuration",
        "forward ms",
        "backward ms",
        "optimizer ms",
        "communication ms",
        "exposed communication ms",
        "hidden",
    ]
    assert len(shown) == 2 and all(cell.endswith("%") for cell in shown["hidden"])


def check_timeline(run: pd.Series) -> None:
    """Rank 0's memory timeline: its peak is the tracked peak, every collective is on it."""
    timeline = run["memory_timeline"]
    tracked_bytes = run["tracked_peak_gib"] * 2**30  # the largest rank's
    assert 0.95 * tracked_bytes <= timeline["peak_bytes"] <= tracked_bytes * 1.0001
    assert max(p[1] for p in timeline["points"]) == timeline["peak_bytes"], "kept exactly"
    indices = [p[0] for p in timeline["points"]]
    assert indices == sorted(indices) and len(indices) <= MAX_POINTS < timeline["num_ops"]
    kinds = [kind for _, kind in timeline["collectives"]]
    assert kinds.count("all_gather") == run["all_gathers_per_step"]
    assert kinds.count("reduce_scatter") == run["reduce_scatters_per_step"]
    assert run["memory_peak_at"] == timeline["peak_at"]
    assert timeline["peak_at"].endswith((" forward", " backward", "loss", "optimizer"))


def test_the_memory_timeline_reaches_a_peak_inside_dtensors_operators() -> None:
    """The loss on logits split by vocabulary (`loss_parallel`) peaks inside DTensor's own
    operators (the shifted logits beside their exponentials): sampled only after each DTensor
    operator, the timeline's peak fell two logits-sized tensors short (12 of 20 MiB)."""
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        local = torch.randn(256, 4096, requires_grad=True)  # 4 MiB of this rank's vocabulary
        logits = DTensor.from_local(local, mesh, [Shard(1)])
        targets = torch.randint(0, 8192, (256,))
        tracker = TensorMemoryTracker()
        sampler = TimelineSampler(tracker, "cpu")
        with tracker, sampler, loss_parallel():
            F.cross_entropy(logits, targets).backward()
    tracked_bytes = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert sampler.timeline().peak_bytes == tracked_bytes
