"""A sweep and a search learn from the runs they measure: points not launched yet are decided
again, with the correction, as each run is recorded (`sweep.Pruner`, `Searcher.on_record`).

On CPU a run's tracked peak is its estimate, so the estimate is made wrong on purpose: the
cached estimates are scaled down by 1.15, as an estimate 15% under the truth would be."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from fsdp_bench.config.grid import expand, load_grid
from fsdp_bench.config.schema import to_plain
from fsdp_bench.memory.calibration import calibration
from fsdp_bench.memory.estimate import estimate_runs
from fsdp_bench.memory.prediction import fits
from fsdp_bench.search import SearchOptions, run_search
from fsdp_bench.store import ResultStore, RunResult
from fsdp_bench.sweep import SweepOptions, run_sweep
from tests.conftest import write_grid

UNDER = 1.15
"""The truth over the estimate."""


def biased_grid(tmp_path: Path, name: str, extra: dict[str, Any]) -> tuple[Any, ResultStore]:
    """A grid of five runs alike in memory (seeds), its estimates cached 15% low, and a budget
    between the low estimate and the truth: each is a `maybe` until one is measured."""
    grid = {
        "name": name,
        "base": {
            "model": {"name": "small"},
            "data": {"seq_len": 128, "micro_batch_size": 2},
            "measure": {"warmup_steps": 1, "timed_steps": 10, "repeats": 2},
        },
        "axes": {"data.seed": [0, 1, 2, 3, 4]},
        **extra,
    }
    spec = load_grid(write_grid(tmp_path, grid))
    store = ResultStore(tmp_path / "results")
    runs = expand(spec).runs
    truth = estimate_runs(runs, store.root / "estimates", device_type="cpu")
    tensors = {e.estimated_peak_gib for e in truth.values()}
    assert len(tensors) == 1  # the seeds change values, not memory
    (true_gib,) = tensors
    assert true_gib is not None
    for path in (store.root / "estimates").glob("*.json"):
        data = json.loads(path.read_text())
        data["estimated_peak_gib"] /= UNDER
        path.write_text(json.dumps(data))
    grid["memory"] = {"budget_gib": true_gib / 1.1}  # 15% under it: maybe; at the truth: no
    return load_grid(write_grid(tmp_path, grid)), store


def test_a_sweep_withdraws_the_runs_its_first_measurement_shows_do_not_fit(
    tmp_path: Path,
) -> None:
    """All five runs are packed into one local job. The first measures 15% above its
    estimate; the driver learns x 1.15 from it and asks the job not to start the runs whose
    corrected interval is now wholly over the budget; the worker records them as skipped.
    (The job's second run may have started by then and is measured.)"""
    spec, store = biased_grid(tmp_path, "redecide", {})
    runs = expand(spec).runs
    before = calibration(spec.memory, None)
    estimates = estimate_runs(runs, store.root / "estimates", device_type="cpu")
    assert {fits(estimates[r.run_id].predict(before, r), spec.memory) for r in runs} == {"maybe"}
    run_sweep(spec, SweepOptions(results_dir=store.root, progress=False))
    records = [store.get(run.run_id) for run in runs]
    assert all(r is not None for r in records)
    measured = sorted((r for r in records if r is not None and r.status == "ok"),
                      key=lambda r: r.provenance["finished_at"])  # fmt: skip
    skipped = [r for r in records if r is not None and r.status == "skipped"]
    statuses = [(r.run_id, r.status) for r in records if r is not None]
    # the job's first run, and at most the one it had started when the driver read the first
    assert 1 <= len(measured) <= 2 and len(skipped) == 5 - len(measured), statuses
    first = measured[0]
    assert first.tracked_peak_gib / first.estimated_peak_gib == pytest.approx(UNDER, rel=0.01)
    for record in skipped:
        assert record.reason.startswith("predicted_oom: device-used")
        assert record.estimate_fits == "no"
        assert record.estimate_correction is not None
        assert record.estimate_correction["factor"] == pytest.approx(UNDER, rel=0.01)
        assert first.run_id in record.estimate_correction["run_ids"]
        assert record.estimated_peak_gib == pytest.approx(first.estimated_peak_gib)  # raw
    assert not list((store.root / "skip").glob("*.json"))  # every request taken or cleared


@dataclasses.dataclass
class _Job:
    job_id: str

    def cancel(self) -> None: ...

    def log_tail(self, rank: int, lines: int = 20) -> str:
        return ""


class MeasuredAbove:
    """A launcher whose runs measure UNDER x their estimate, recorded at once."""

    kind = "replay"
    max_array_size = 1
    max_jobs_in_flight = 1

    def __init__(self, store: ResultStore) -> None:
        self.store = store
        self.launched: list[str] = []

    def check(self, world_size: int, nodes: int) -> None: ...

    def submit(self, specs: list[Any]) -> list[_Job]:
        for spec in specs:
            for run in spec.runs:
                peaks = spec.estimates[run.run_id]
                self.launched.append(run.run_id)
                self.store.record(RunResult(
                    run_id=run.run_id, status="ok", config=to_plain(run), tokens_per_s=1000.0,
                    **peaks._asdict(), tracked_peak_gib=peaks.estimated_peak_gib * UNDER,
                    peak_memory_gib=peaks.estimated_peak_gib * UNDER,
                    provenance={"device_name": "x86_64"},
                ))  # fmt: skip
        return [_Job(str(len(self.launched)))]

    def reattach(self, job_id: str) -> _Job:
        return _Job(job_id)

    def poll(self, jobs: list[_Job]) -> dict[str, str]:
        return {job.job_id: "ENDED" for job in jobs}


def test_a_search_stops_launching_points_its_measurements_show_do_not_fit(
    tmp_path: Path,
) -> None:
    """Every point is a `maybe` on the estimate alone, and was launched before (the search
    read the folder's calibration once, when it started). The first launch measures 15%
    above its estimate; every later point is pruned on the corrected interval."""
    search = {"search": {"trials": 5, "sampler": "random", "seed": 0, "confirm_top_k": 0}}
    spec, store = biased_grid(tmp_path, "redecide-search", search)
    launcher = MeasuredAbove(store)
    outcome = run_search(
        spec, SearchOptions(results_dir=store.root, progress=False), launcher=launcher
    )
    assert len(launcher.launched) == 1, launcher.launched
    assert outcome.counts["pruned"] >= 1
    pruned = [r for r in store.results() if r.status == "skipped"]
    assert pruned and all(r.estimate_fits == "no" for r in pruned)
    assert all(r.estimate_correction["run_ids"] == [launcher.launched[0]] for r in pruned)  # type: ignore[index]
