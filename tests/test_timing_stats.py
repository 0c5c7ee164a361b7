"""Every timed step's time, the 95% interval of the median step time (its coverage on synthetic
step times of a known distribution), and repeats timed until that interval is tight."""

from __future__ import annotations

import random
import statistics
import time

import pytest
import torch

from fsdp_bench.config.grid import parse_grid
from fsdp_bench.config.measure import MeasureConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.errors import ConfigError, FieldError
from fsdp_bench.job.measure.timing import repeat_until_tight, time_repeat, time_steps
from fsdp_bench.job.record import RankOutcome, RunContext, build_result
from fsdp_bench.job.rendezvous import RankInfo
from fsdp_bench.stats import median_interval, median_interval_ranks, summarize_times, within_target
from fsdp_bench.store import EstimatedPeaks, RunResult

COUNTS = {
    "all_gathers": 9, "all_gather_bytes": 900, "reduce_scatters": 5,
    "reduce_scatter_bytes": 500, "all_reduces": 0, "all_reduce_bytes": 0, "other": 0,
    "all_gathers_before_compute": 2,
}  # fmt: skip


def lognormal_steps(rng: random.Random, n: int, sigma: float, median_s: float = 0.1) -> list[float]:
    """n step times whose true median is `median_s` (a lognormal's median is exp(mu))."""
    return [median_s * rng.lognormvariate(0.0, sigma) for _ in range(n)]


def coverage(n: int, trials: int = 2000, seed: int = 0) -> float:
    """How often the interval of n lognormal step times holds their true median."""
    rng = random.Random(seed)
    hits = 0
    for _ in range(trials):
        interval = median_interval(lognormal_steps(rng, n, sigma=0.5))
        assert interval is not None
        hits += interval[0] <= 0.1 <= interval[1]
    return hits / trials


def test_the_interval_covers_the_true_median_of_15_lognormal_steps() -> None:
    assert median_interval_ranks(15) == (4, 12)  # exact coverage 1 - 2 * 576 / 2^15 = 96.5%
    assert coverage(15) >= 0.93


@pytest.mark.parametrize("n", [6, 9, 25, 60])
def test_the_interval_covers_the_true_median_at_other_step_counts(n: int) -> None:
    assert coverage(n, seed=n) >= 0.93


def test_the_interval_is_the_binomial_one_and_works_for_any_count() -> None:
    assert median_interval_ranks(6) == (1, 6)  # 1 - 2 / 64 = 96.9%
    assert median_interval_ranks(10) == (2, 9)  # 1 - 2 * 11 / 1024 = 97.9%
    low, high = median_interval_ranks(5000) or (0, 0)
    assert 2430 < low < 2500 and high == 5001 - low  # ~ n/2 -+ 1.96 sqrt(n)/2, no overflow
    assert median_interval([5.0, 1.0, 4.0, 2.0, 3.0, 6.0]) == (1.0, 6.0)


def test_fewer_than_six_steps_have_no_interval() -> None:
    for n in range(1, 6):
        assert median_interval_ranks(n) is None
        summary = summarize_times([0.1] * n)
        assert summary.ci_low_s is None and summary.ci_half_width_pct is None
        assert not within_target([0.1] * n, 50.0)  # unknown is not tight
    assert not within_target([], 50.0)


def outcome(times: list[float]) -> RankOutcome:
    return RankOutcome(
        hostname="n1", step_times_s=times, tracked_peak_bytes=1, breakdown_bytes={},
        counts=COUNTS, largest_group_bytes=1, num_groups=1, num_params=1, setup_s=1.0,
        warmup_s=0.5,
    )  # fmt: skip


def record(run: RunConfig, per_rank: list[list[float]]) -> RunResult:
    info = RankInfo(rank=0, local_rank=0, world_size=len(per_rank), num_nodes=1, job_id="7",
                    attempt=0)  # fmt: skip
    where = RunContext(torch.device("cpu"), info, "t0", 9.0, EstimatedPeaks())
    return build_result(run, [outcome(t) for t in per_rank], where, {"device_name": "cpu"})


def test_a_record_keeps_the_slowest_rank_of_every_step_and_its_interval() -> None:
    run = RunConfig(world_size=2, measure=MeasureConfig(timed_steps=4, repeats=2))
    rank0 = [0.10, 0.30, 0.12, 0.11, 0.13, 0.10, 0.14, 0.10]
    rank1 = [0.20, 0.10, 0.11, 0.15, 0.10, 0.12, 0.10, 0.16]
    result = record(run, [rank0, rank1])

    slowest = [0.20, 0.30, 0.12, 0.15, 0.13, 0.12, 0.14, 0.16]
    assert result.step_times_s == slowest and result.timed_repeats == 2
    assert result.step_time_s == statistics.median(slowest) == pytest.approx(0.145)
    assert (result.step_time_min_s, result.step_time_max_s) == (0.12, 0.30)
    assert result.step_time_spread_pct == pytest.approx(100 * 0.18 / 0.145)
    # n = 8: P(B <= 1) = 9/256 is over 2.5%, so the interval is [x(1), x(8)] (99.2%)
    assert median_interval_ranks(8) == (1, 8)
    assert (result.step_time_ci_low_s, result.step_time_ci_high_s) == (0.12, 0.30)
    tokens = run.tokens_per_step
    assert result.tokens_per_s == pytest.approx(tokens / 0.145)
    assert result.tokens_per_s_ci_low == pytest.approx(tokens / 0.30)  # the slow end
    assert result.tokens_per_s_ci_high == pytest.approx(tokens / 0.12)
    assert result.ci_converged is None  # no target
    assert result.timed_s == pytest.approx(sum(slowest))


def test_a_record_says_whether_its_interval_met_the_target() -> None:
    steady = [0.100, 0.101, 0.099, 0.100, 0.102, 0.100]  # interval [0.099, 0.102]: +-1.5%
    for target, converged in ((2.0, True), (1.0, False)):
        measure = MeasureConfig(timed_steps=3, repeats=2, target_ci_pct=target)
        assert record(RunConfig(measure=measure), [steady]).ci_converged is converged


def test_a_record_of_five_steps_has_no_interval() -> None:
    run = RunConfig(measure=MeasureConfig(timed_steps=5, repeats=1, target_ci_pct=5.0))
    result = record(run, [[0.1, 0.1, 0.1, 0.1, 0.1]])
    assert result.step_time_ci_low_s is None and result.tokens_per_s_ci_high is None
    assert result.ci_converged is False and result.step_time_s == 0.1


class FakeRanks:
    """Ranks that time the same repeats: rank r's step times of each repeat are drawn ahead,
    `agree` gives every rank the slowest of all (what the all-reduce does)."""

    def __init__(self, per_rank_sigma: list[float], steps: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.tables = [
            [lognormal_steps(rng, steps, sigma) for _ in range(100)] for sigma in per_rank_sigma
        ]
        self.agreed = 0

    def run(self, rank: int, measure: MeasureConfig) -> list[list[float]]:
        repeat_of: list[int] = []

        def time_one(index: int) -> list[float]:
            repeat_of.append(index)
            return self.tables[rank][index - 1]

        def agree(times: list[float]) -> list[float]:
            self.agreed += 1
            index = repeat_of[-1] - 1
            return [max(t) for t in zip(*(table[index] for table in self.tables), strict=True)]

        return repeat_until_tight(time_one, measure, agree)


def test_repeats_stop_at_the_target_on_a_steady_step() -> None:
    measure = MeasureConfig(timed_steps=5, repeats=3, target_ci_pct=2.0, max_repeats=10)
    assert len(FakeRanks([0.002], steps=5).run(0, measure)) == 3  # tight at once
    # one step per repeat: no interval before 6 steps, so 6 repeats, then tight
    one_step = MeasureConfig(timed_steps=1, repeats=3, target_ci_pct=2.0, max_repeats=10)
    assert len(FakeRanks([0.002], steps=1).run(0, one_step)) == 6


def test_repeats_go_on_to_the_maximum_on_a_noisy_step() -> None:
    measure = MeasureConfig(timed_steps=5, repeats=3, target_ci_pct=2.0, max_repeats=8)
    repeats = FakeRanks([0.5], steps=5).run(0, measure)
    assert len(repeats) == 8
    assert not within_target([t for r in repeats for t in r], 2.0)
    default_limit = MeasureConfig(timed_steps=5, repeats=3, target_ci_pct=2.0)
    assert len(FakeRanks([0.5], steps=5).run(0, default_limit)) == 9  # 3 x repeats


def test_repeats_stop_in_between_when_the_step_is_moderately_noisy() -> None:
    measure = MeasureConfig(timed_steps=5, repeats=2, target_ci_pct=3.0, max_repeats=40)
    repeats = FakeRanks([0.05], steps=5, seed=3).run(0, measure)
    flat = [t for r in repeats for t in r]
    assert 2 < len(repeats) < 40 and within_target(flat, 3.0)
    assert not within_target(flat[:-5], 3.0)  # one repeat fewer was not enough


def test_every_rank_decides_on_the_slowest_rank_and_stops_after_the_same_repeat() -> None:
    measure = MeasureConfig(timed_steps=5, repeats=3, target_ci_pct=2.0, max_repeats=7)
    ranks = FakeRanks([0.002, 0.5], steps=5)  # rank 0 steady, rank 1 noisy
    counts = [len(ranks.run(rank, measure)) for rank in (0, 1)]
    assert counts == [7, 7]  # rank 0 alone would have stopped after 3
    assert len(FakeRanks([0.002], steps=5).run(0, measure)) == 3


def test_without_a_target_a_run_takes_exactly_its_repeats_and_no_collective() -> None:
    ranks = FakeRanks([0.5], steps=5)
    assert len(ranks.run(0, MeasureConfig(timed_steps=5, repeats=4, max_repeats=9))) == 4
    assert ranks.agreed == 0


@pytest.mark.parametrize(
    ("measure", "message"),
    [
        ({"target_ci_pct": 0}, "base.measure.target_ci_pct: 0.0 is not allowed; "
         "expected a number > 0 (percent) or null"),
        ({"target_ci_pct": -2}, "base.measure.target_ci_pct: -2.0 is not allowed; "
         "expected a number > 0 (percent) or null"),
        ({"target_ci_pct": "tight"}, "base.measure.target_ci_pct: 'tight' is not allowed; "
         "expected a number or null"),
        ({"repeats": 3, "max_repeats": 2}, "base.measure.max_repeats: 2 is not allowed; "
         "expected an integer >= repeats (3) or null (3 x repeats)"),
        ({"max_repeats": 2.5}, "base.measure.max_repeats: 2.5 is not allowed; "
         "expected an integer or null"),
    ],
)  # fmt: skip
def test_bad_measure_settings_are_one_line_errors(measure: dict[str, object], message: str) -> None:
    grid = {"name": "g", "base": {"measure": measure}, "axes": {"data.seed": [0]}}
    with pytest.raises(ConfigError) as info:
        parse_grid(grid, source="grid.yaml")
    assert str(info.value) == f"grid.yaml: {message}"


def test_measure_settings_in_python_and_their_repeat_limit() -> None:
    with pytest.raises(FieldError, match="max_repeats: 1 is not allowed"):
        MeasureConfig(repeats=2, max_repeats=1)
    assert MeasureConfig(repeats=4).repeat_limit == 4  # no target: exactly repeats
    assert MeasureConfig(repeats=4, max_repeats=9).repeat_limit == 4
    assert MeasureConfig(repeats=4, target_ci_pct=2.0).repeat_limit == 12
    assert MeasureConfig(repeats=4, target_ci_pct=2.0, max_repeats=5).repeat_limit == 5
    assert RunConfig().run_id == RunConfig(measure=MeasureConfig()).run_id  # ids unchanged


def test_a_real_rank_times_every_step_and_stops_where_the_rule_says(one_rank_group: None) -> None:
    measure = MeasureConfig(timed_steps=4, repeats=2, target_ci_pct=5.0, max_repeats=5)
    armed: list[int] = []
    repeats = time_steps(lambda: time.sleep(0.002), measure, torch.device("cpu"), armed.append)
    assert armed == list(range(1, len(repeats) + 1))  # the watchdog is armed for each repeat
    assert all(len(r) == 4 and min(r) >= 0.002 for r in repeats)
    flat = [t for r in repeats for t in r]
    tight_before = any(within_target(flat[: 4 * k], 5.0) for k in range(2, len(repeats)))
    assert not tight_before and (len(repeats) == 5 or within_target(flat, 5.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_cuda_steps_are_timed_by_events_that_add_up_to_the_repeat(one_rank_group: None) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    cycles = 10_000_000  # a few ms of GPU time, launched in microseconds
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize(device)
    begin = time.perf_counter()
    times = time_repeat(lambda: torch.cuda._sleep(cycles), 6, device)
    wall_s = time.perf_counter() - begin
    assert len(times) == 6 and min(times) > 0.5 * max(times) > 0
    assert sum(times) == pytest.approx(wall_s, rel=0.2)  # the GPU's time, not the launches'
