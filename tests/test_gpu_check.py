"""benchmarks/gpu_check.py, the one command for a lent GPU: kept working on CPU, and able to
fail."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from fsdp_bench.job.measure.timing import time_repeat
from tests.conftest import REPO

GPU_CHECK = REPO / "benchmarks" / "gpu_check.py"


def gpu_check_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_failing_part_fails_the_check_and_the_report_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One part whose expectation does not hold, one that raises, one that passes: exit 1,
    and the summary, the markdown and the JSON name both failures; the passing part and the
    environment are still reported."""
    check = gpu_check_module()

    def oom_misread(_: Any) -> dict[str, Any]:
        result: dict[str, Any] = {"injected_oom_recorded_as": ["error"]}
        check.expect(result, "the injected OOM recorded as oom", False)
        check.expect(result, "the twins share a peak", True)
        return result

    def broken(_: Any) -> dict[str, Any]:
        raise RuntimeError("no backend type associated with device type cpu")

    def fine(_: Any) -> dict[str, Any]:
        result: dict[str, Any] = {}
        check.expect(result, "it holds", True)
        return result

    parts = [check.PARTS[0], ("failures", oom_misread), ("harness", broken), ("timer", fine)]
    monkeypatch.setattr(check, "PARTS", parts)
    assert check.main(["--device", "cpu", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["summary"].startswith(
        "FAILED: failures (the injected OOM recorded as oom); harness (error)"
    )
    assert report["cuda_initialised_here"] is False
    assert list(report["parts"]) == ["environment", "failures", "harness", "timer"]
    text = (tmp_path / "gpu_check.md").read_text()
    assert "## failures: FAILED" in text and "- [ ] the injected OOM recorded as oom" in text
    assert "## harness: FAILED" in text and "no backend type associated" in text
    assert "## timer: passed" in text and "## environment: passed" in text


def test_a_spent_time_budget_skips_the_parts_left_and_says_the_check_is_incomplete(
    tmp_path: Path,
) -> None:
    command = [sys.executable, str(GPU_CHECK), "--device", "cpu", "--out", str(tmp_path),
               "--budget-s", "0", "--only", "models"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert list(parts) == ["environment", "models"]  # the environment always runs
    assert parts["models"]["skipped"].startswith("the time budget (0 s)")
    assert "## models: skipped" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow
def test_the_gpu_check_runs_on_cpu_and_every_part_passes(tmp_path: Path) -> None:
    command = [sys.executable, str(GPU_CHECK), "--device", "cpu", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert done.returncode == 0, report["summary"] + done.stderr[-3000:]
    parts = report["parts"]
    verdicts = {name: gpu_check_module().verdict(part) for name, part in parts.items()}
    cuda_only = ("timer", "multi_gpu", "allocator")
    applicable = {n for n in verdicts if n not in cuda_only}
    assert verdicts == {**dict.fromkeys(applicable, "passed"),
                        **dict.fromkeys(cuda_only, "not applicable")}  # fmt: skip
    assert all(parts[name]["expectations"] for name in applicable - {"environment"})
    assert report["cuda_initialised_here"] is False
    breakdown = parts["step_breakdown"]["runs"]
    assert {(r["world_size"], r["status"]) for r in breakdown} == {(1, "ok"), (2, "ok")}
    assert set(parts["step_breakdown"]["rank0_trace_files"]) == {"rank0.json"}  # no CUDA snapshot
    assert [r["fp32_matmul"] for r in parts["parity"]["runs"]].count("tf32") == 1
    text = (tmp_path / "gpu_check.md").read_text()
    assert all(f"## {name}: " in text for name in parts)


def test_the_timer_check_holds_for_the_workers_timing_and_fails_one_that_misses_the_work(
    one_rank_group: None,
) -> None:
    """The worker's own timing (`timing.time_repeat`) against the wall clock around the same
    steps, synchronised at both ends: equal within the bounds. A timer that saw only the
    steps' launch (events on a stream the work does not run on) is far outside them: here
    the work runs in threads, as on a GPU behind the CPU, which the synchronisation joins."""
    check = gpu_check_module()
    cpu = torch.device("cpu")
    queued: list[threading.Thread] = []

    def step() -> None:
        time.sleep(0.05)

    def honest(step: Any, steps: int) -> list[float]:
        return list(time_repeat(step, steps, cpu))

    def launch_only(step: Any, steps: int) -> list[float]:
        def launch() -> None:
            queued.append(threading.Thread(target=step))
            queued[-1].start()

        return list(time_repeat(launch, steps, cpu))

    def synchronize() -> None:
        while queued:
            queued.pop().join()

    for timer, holds in ((honest, True), (launch_only, False)):
        found = check.timer_verdict(check.compare_timers(step, timer, synchronize, 3, 2))
        assert list(found["expectations"].values()) == [holds], found["wall_over_events"]
