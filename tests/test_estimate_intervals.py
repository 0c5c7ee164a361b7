"""The estimate's intervals, its yes / no / maybe against the budget, and the correction it
learns from measured runs (pure logic: records written by hand, estimates built by hand)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

import pytest

from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.config.grid_settings import MemoryConfig
from fsdp_bench.config.run import DataConfig, RunConfig, TrainConfig
from fsdp_bench.config.schema import to_plain
from fsdp_bench.memory.calibration import calibration
from fsdp_bench.memory.device_memory import communicators, outside_terms_gib
from fsdp_bench.memory.error_model import Communicator
from fsdp_bench.memory.estimate import RunEstimate
from fsdp_bench.memory.prediction import fit_probability, fits, predicted_oom
from fsdp_bench.store import ResultStore, RunResult

H100 = "NVIDIA H100 80GB HBM3"


def estimate_of(run: RunConfig, tensors: float, reserved: float) -> RunEstimate:
    return RunEstimate(
        run_id=run.run_id, estimated_peak_gib=tensors, device_type="cuda",
        estimated_allocated_gib=tensors + 0.0625, estimated_reserved_gib=reserved,
        world_size=run.world_size, outside_terms_gib=outside_terms_gib(run, "cuda"),
        torch_version="2.13.0",
    )  # fmt: skip


def measured(
    run: RunConfig, estimate: RunEstimate, reserved: float, device: str = H100
) -> RunResult:
    """A run's record as a sweep writes it: the estimate's raw figures, the measured ones."""
    peaks = estimate.peaks(calibration(MemoryConfig(), None), run, MemoryConfig())
    return RunResult(
        run_id=run.run_id, status="ok", config=to_plain(run), **peaks._asdict(),
        peak_memory_gib=estimate.estimated_allocated_gib, peak_reserved_gib=reserved,
        device_used_peak_gib=reserved + 1.3, provenance={"device_name": device},
    )  # fmt: skip


def test_each_figure_has_an_interval_from_terms_with_sources() -> None:
    run = RunConfig(world_size=8, processes_per_node=8)
    prediction = estimate_of(run, 60.0, 70.0).predict(
        calibration(MemoryConfig(gpu="H100"), None), run
    )
    errors = prediction.errors
    assert errors is not None
    for name in ("allocated", "reserved", "device_used"):
        interval = getattr(errors, name)
        figure = getattr(prediction, f"{name}_gib")
        assert interval.low_gib < figure < interval.high_gib
        assert 2 < interval.half_width_pct(figure) < 15
    assert {t.name for t in prediction.error_terms} >= {"tensors", "fragmentation", "nccl", "nvls"}
    assert all(t.source for t in prediction.error_terms)
    # NVLS buffers (up to 1 GiB, unmeasured) widen only the high end
    assert errors.device_used.high_gib - prediction.device_used_gib > (
        prediction.device_used_gib - errors.device_used.low_gib
    )
    assert any("NVLS" in u for u in prediction.unseen)
    # torch < 2.8 recorded collectives' streams: the fragmentation can be larger
    old = dataclasses.replace(estimate_of(run, 60.0, 70.0), torch_version="2.5.1")
    widened = old.predict(calibration(MemoryConfig(gpu="H100"), None), run).errors
    assert widened is not None and widened.reserved.high_gib > errors.reserved.high_gib


def test_communicators_know_nodes_and_nvls() -> None:
    """HSDP over two nodes of 8: the default group spans them, the shard group is one node
    (NVLS on H100s, none on A100s), the replicate group has one rank per node."""
    run = RunConfig(world_size=16, processes_per_node=8, strategy="hsdp")
    assert communicators(run, "H100") == [
        Communicator(16, across_nodes=True, nvls=True),
        Communicator(8, across_nodes=False, nvls=True),
        Communicator(2, across_nodes=True, nvls=False),
    ]
    assert not any(c.nvls for c in communicators(run, "A100"))
    one_rank = RunConfig(world_size=1)
    assert communicators(one_rank, "H200") == [Communicator(1, False, False)]


def test_fits_is_yes_no_or_maybe_on_the_interval() -> None:
    run = RunConfig(world_size=8, processes_per_node=8)
    estimate = estimate_of(run, 60.0, 70.0)
    prediction = estimate.predict(calibration(MemoryConfig(gpu="H100"), None), run)
    assert prediction.errors is not None
    high, low = prediction.errors.device_used.high_gib, prediction.errors.device_used.low_gib
    assert fits(prediction, MemoryConfig(budget_gib=high + 0.01)) == "yes"
    assert fits(prediction, MemoryConfig(budget_gib=prediction.device_used_gib)) == "maybe"
    assert fits(prediction, MemoryConfig(budget_gib=low - 0.01)) == "no"
    assert fits(prediction, MemoryConfig(budget_gib=high + 1, margin_gib=2)) == "maybe"
    assert fits(prediction, MemoryConfig()) == "?"
    assert predicted_oom(prediction, MemoryConfig(budget_gib=prediction.device_used_gib)) == ""
    reason = predicted_oom(prediction, MemoryConfig(budget_gib=low - 0.01))
    assert reason.startswith(f"predicted_oom: device-used {prediction.device_used_gib:.2f} GiB")
    assert f"at least {low:.2f}" in reason


def test_a_compiled_run_estimated_over_the_budget_is_never_yes() -> None:
    """A compiled run's estimate is no bound: 89 GiB against a 40 GiB budget was printed
    `fits yes`. Simulated from the partition, its interval adds what inductor does on a GPU
    (±8%), with tensor parallelism too; with TP and whole blocks checkpointed, still
    estimated as eager, what compile did to published runs (-25% / +15%)."""
    run = RunConfig(world_size=8, train=TrainConfig(compile="block"))
    prediction = estimate_of(run, 80.0, 89.0).predict(calibration(MemoryConfig(), None), run)
    assert fits(prediction, MemoryConfig(budget_gib=40.0)) == "no"
    assert fits(prediction, MemoryConfig(budget_gib=85.0)) == "maybe"
    eager = dataclasses.replace(run, train=TrainConfig())
    eager_prediction = estimate_of(eager, 80.0, 89.0).predict(
        calibration(MemoryConfig(), None), eager
    )
    assert eager_prediction.errors is not None and prediction.errors is not None
    eager_low = eager_prediction.errors.device_used.low_gib
    assert eager_low - 10 < prediction.errors.device_used.low_gib < eager_low - 2
    with_tp = RunConfig(world_size=8, tp_size=2, train=TrainConfig(compile="block"))
    partitioned = estimate_of(with_tp, 80.0, 89.0).predict(
        calibration(MemoryConfig(), None), with_tp
    )
    assert partitioned.errors is not None
    assert partitioned.errors.device_used.low_gib == pytest.approx(  # TP's communicators aside
        prediction.errors.device_used.low_gib, rel=0.02
    )
    full_ac = dataclasses.replace(with_tp, fsdp=FsdpConfig(activation_checkpointing="block"))
    as_eager = estimate_of(full_ac, 80.0, 89.0).predict(calibration(MemoryConfig(), None), full_ac)
    assert as_eager.errors is not None
    assert as_eager.errors.device_used.low_gib < eager_low - 10


def test_a_loss_compiled_on_a_gpu_reaches_up_to_the_loss_eager() -> None:
    """Inductor's fusion of the loss is measured on CPU only: on a GPU the high end takes the
    step with the loss eager (20 GiB more here), the low end stays the fused figure's."""
    run = RunConfig(world_size=8, train=TrainConfig(compile="block", compile_loss=True))
    known = calibration(MemoryConfig(), None)
    fused = estimate_of(run, 40.0, 44.0)
    bounded = dataclasses.replace(
        fused, eager_loss_allocated_gib=60.0625, eager_loss_reserved_gib=64.0
    )
    before, after = fused.predict(known, run).errors, bounded.predict(known, run).errors
    assert before is not None and after is not None
    assert after.reserved.low_gib == pytest.approx(before.reserved.low_gib)
    assert 64.0 < after.reserved.high_gib < 64.0 + (before.reserved.high_gib - 44.0)
    assert after.allocated.high_gib > 60.0 and after.device_used.high_gib > 65.0
    assert any(t.name == "compiled loss" and t.above_gib == 20.0 for t in after.terms)


def test_the_correction_does_not_drift_when_read_back(tmp_path: Path) -> None:
    """Records keep the raw estimate: a measured 20% above it reads back as x 1.2 however
    often the folder is read, and the records of runs decided with it say so. Before, the
    record kept the corrected figure, and 1.2 read back as 1.0 the next time."""
    store = ResultStore(tmp_path)
    memory = MemoryConfig(budget_gib=100.0)
    first = RunConfig(world_size=8)
    estimate = estimate_of(first, 60.0, 70.0)
    store.record(measured(first, estimate, reserved=84.0))
    for seed in (1, 2, 3):
        known = calibration(memory, store)
        run = RunConfig(world_size=8, data=DataConfig(seed=seed))
        correction = known.correction(run)
        assert correction.factor == pytest.approx(1.2)
        peaks = estimate.peaks(known, run, memory)
        assert peaks.estimated_reserved_gib == 70.0  # raw, as the replay made it
        assert peaks.estimate_correction is not None
        assert peaks.estimate_correction["factor"] == pytest.approx(1.2)
        assert estimate.predict(known, run).reserved_gib == pytest.approx(84.0)
        result = RunResult(run_id=run.run_id, status="ok", config=to_plain(run),
                           **peaks._asdict(), peak_reserved_gib=84.0,
                           provenance={"device_name": H100})  # fmt: skip
        store.record(result)
    assert calibration(memory, store).correction(first).run_ids == tuple(
        r.run_id for r in store.results()
    )


def test_the_correction_is_as_fine_as_the_runs_allow_and_names_them(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    one_b = RunConfig(world_size=8, model=dataclasses.replace(RunConfig().model, name="llama3-1b"))
    small = RunConfig(world_size=8, model=dataclasses.replace(RunConfig().model, name="small"))
    store.record(measured(one_b, estimate_of(one_b, 20.0, 25.0), reserved=30.0))  # x 1.2
    store.record(measured(small, estimate_of(small, 1.0, 2.0), reserved=1.8))  # x 0.9
    known = calibration(MemoryConfig(), store)
    here = known.correction(one_b)
    assert here.factor == pytest.approx(1.2) and here.run_ids == (one_b.run_id,)
    assert "llama3-1b, world size 8" in here.scope and "NVIDIA H100" in here.scope
    wider = known.correction(dataclasses.replace(one_b, world_size=16))
    assert wider.factor == pytest.approx(1.2) and wider.scope.endswith("llama3-1b, eager")
    other = known.correction(RunConfig(world_size=8))
    assert other.factor == pytest.approx(1.05) and "any model" in other.scope
    compiled = dataclasses.replace(one_b, train=TrainConfig(compile="block"))
    assert known.correction(compiled).factor == 1.0  # eager runs say nothing of compiled ones
    assert "from 1 runs" in here.describe
    # a folder measured on A100s does not correct an estimate for H100s once memory.gpu says
    assert calibration(MemoryConfig(gpu="A100"), store).correction(one_b).factor == 1.0


def test_an_oom_is_evidence_too(tmp_path: Path) -> None:
    """The process held 78 GiB and asked for 2 more: the run needed 80, above its estimate's
    reserved 60 plus what lives outside the allocator: a ratio of at least that, counted in
    the median with the run that measured x 1.0."""
    store = ResultStore(tmp_path)
    memory = MemoryConfig(budget_gib=80.0)
    ok = RunConfig(world_size=8)
    store.record(measured(ok, estimate_of(ok, 50.0, 60.0), reserved=60.0))  # x 1.0
    big = RunConfig(world_size=8, data=DataConfig(micro_batch_size=2))
    estimate = estimate_of(big, 55.0, 60.0)
    peaks = estimate.peaks(calibration(memory, None), big, memory)
    reason = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has "
              "a total capacity of 79.19 GiB of which 1.19 GiB is free. Including non-PyTorch "
              "memory, this process has 78.00 GiB memory in use.")  # fmt: skip
    store.record(RunResult(run_id=big.run_id, status="oom", config=to_plain(big), reason=reason,
                           **peaks._asdict()))  # fmt: skip
    outside = sum(outside_terms_gib(big, "cuda").values())
    correction = calibration(memory, store).correction(ok)
    assert correction.factor == pytest.approx((1.0 + (80.0 - outside) / 60.0) / 2)
    assert big.run_id in correction.run_ids
    injected = dataclasses.replace(big, fault=dataclasses.replace(big.fault, kind="oom"))
    huge = reason.replace("78.00", "500.00")
    store.record(RunResult(run_id=injected.run_id, status="oom", config=to_plain(injected),
                           reason=huge, **peaks._asdict()))  # fmt: skip
    assert calibration(memory, store).correction(ok).factor == pytest.approx(correction.factor)


def test_runs_that_stray_from_their_correction_widen_the_interval(tmp_path: Path) -> None:
    """Three runs measured 0.9, 1.0 and 1.1 x their estimates: the median corrects nothing,
    and their scatter (twice the standard deviation of ln ratio) widens every interval, so a
    run estimated just over the budget is `maybe`, with its chance to fit."""
    store = ResultStore(tmp_path)
    memory = MemoryConfig(budget_gib=62.0)
    run = RunConfig(world_size=8, data=DataConfig(micro_batch_size=4))
    estimate = estimate_of(run, 60.0, 66.0)
    before = estimate.predict(calibration(memory, store), run)
    assert fits(before, memory) == "no" and fit_probability(before, memory) < 0.05
    for seed, ratio in enumerate((0.9, 1.0, 1.1), 1):
        other = RunConfig(world_size=8, data=DataConfig(seed=seed))
        store.record(measured(other, estimate_of(other, 60.0, 66.0), reserved=66.0 * ratio))
    known = calibration(memory, store)
    correction = known.correction(run)
    logs = [math.log(r) for r in (0.9, 1.0, 1.1)]
    assert correction.factor == pytest.approx(1.0)
    assert correction.scatter == pytest.approx(math.expm1(2 * statistics.stdev(logs)))
    after = estimate.predict(known, run)
    assert after.errors is not None and before.errors is not None
    assert after.errors.device_used.low_gib < before.errors.device_used.low_gib - 5
    assert "measured scatter" in {term.name for term in after.errors.terms}
    assert fits(after, memory) == "maybe" and 0.05 < fit_probability(after, memory) < 0.5
    assert "scatter ±22%" in correction.describe


def test_a_cpu_run_is_corrected_on_its_tensors(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    run = RunConfig(world_size=2)
    estimate = RunEstimate(run_id=run.run_id, estimated_peak_gib=1.0, world_size=2)
    peaks = estimate.peaks(calibration(MemoryConfig(), None), run, MemoryConfig())
    assert peaks.estimated_device_used_gib == 1.0
    assert peaks.estimated_device_used_low_gib == pytest.approx(0.94)
    store.record(RunResult(run_id=run.run_id, status="ok", config=to_plain(run),
                           **peaks._asdict(), tracked_peak_gib=1.15,
                           provenance={"device_name": "x86_64"}))  # fmt: skip
    later = RunConfig(world_size=2, fsdp=FsdpConfig(grouping="root"))
    prediction = estimate.predict(calibration(MemoryConfig(), store), later)
    assert prediction.device_used_gib == pytest.approx(1.15)


def test_memory_outside_the_allocator_is_learned_per_world_size(tmp_path: Path) -> None:
    """Device-used minus reserved measured at world size 8 replaces the context and NCCL terms
    there (median, with the range as its interval); at 64 ranks the runs have other
    communicators, and the default model stands."""
    store = ResultStore(tmp_path)
    for seed, gap in enumerate((1.2, 1.5, 2.1)):
        run = RunConfig(world_size=8, data=DataConfig(seed=seed))
        result = measured(run, estimate_of(run, 20.0, 25.0), reserved=25.0)
        store.record(dataclasses.replace(result, device_used_peak_gib=25.0 + gap))
    known = calibration(MemoryConfig(), store)
    here = RunConfig(world_size=8, data=DataConfig(seed=9))
    prediction = estimate_of(here, 20.0, 25.0).predict(known, here)
    assert prediction.device_used_gib == pytest.approx(25.0 + 1.5)
    assert prediction.errors is not None
    assert prediction.errors.device_used.high_gib >= 25.0 + 2.1
    assert "3 CUDA runs at world size 8" in prediction.sources["outside"]
    wide = RunConfig(world_size=64)
    default = estimate_of(wide, 20.0, 25.0).predict(known, wide)
    assert default.sources["outside"] == "model"
