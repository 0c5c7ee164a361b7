"""Peak memory per rank before anything launches: the seeds' analytic model, a simulation of
the worker's own step on fake tensors and a fake process group at the target world size, its
allocations replayed through a model of CUDA's caching allocator, and the estimates of a grid's
runs (cached, computed in a pool) as allocated, reserved and device-used memory, each with its
interval, judged against the budget."""

from __future__ import annotations

from fsdp_bench.memory.analytic import AnalyticEstimate, analytic_estimate
from fsdp_bench.memory.calibration import Calibration, calibration
from fsdp_bench.memory.estimate import RunEstimate, estimate_runs
from fsdp_bench.memory.prediction import Prediction, fits, predicted_oom

__all__ = [
    "AnalyticEstimate",
    "Calibration",
    "Prediction",
    "RunEstimate",
    "analytic_estimate",
    "calibration",
    "estimate_runs",
    "fits",
    "predicted_oom",
]
