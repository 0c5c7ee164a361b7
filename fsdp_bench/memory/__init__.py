"""Peak memory per rank before anything launches: the seeds' analytic model, a simulation of
the worker's own step on fake tensors and a fake process group at the target world size, and
the estimates of a grid's runs (cached, computed in a pool, judged against the budget)."""

from __future__ import annotations

from fsdp_bench.memory.analytic import AnalyticEstimate, analytic_estimate
from fsdp_bench.memory.estimate import Overhead, RunEstimate, estimate_runs, overhead, predicted_oom

__all__ = [
    "AnalyticEstimate",
    "Overhead",
    "RunEstimate",
    "analytic_estimate",
    "estimate_runs",
    "overhead",
    "predicted_oom",
]
