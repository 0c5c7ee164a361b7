"""The search benchmark's replay tables are what they say: anchored to the figures they cite,
with the fastest fitting point at the memory edge, and replayable through the real search."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
search_tables: Any = importlib.import_module("search_tables")
search_efficiency: Any = importlib.import_module("search_efficiency")


@pytest.mark.parametrize(
    "world_size, tokens_per_gpu, used_gib", [(8, 5762, 82.4), (128, 5605, 67.0)]
)
def test_the_published_table_passes_through_torchtitans_figures(
    world_size: int, tokens_per_gpu: float, used_gib: float
) -> None:
    """benchmarks/llama3_h100_202412_torchtitan.md: FSDP, local batch 2, selective AC."""
    point = {"world_size": world_size, "fsdp.grouping": "block",
             "fsdp.reshard_after_forward": True, "fsdp.activation_checkpointing": "selective_op",
             "data.micro_batch_size": 2}  # fmt: skip
    truth = search_tables.published_truth(point)
    assert truth.tokens_per_s / world_size == pytest.approx(tokens_per_gpu, rel=1e-3)
    assert truth.device_used_gib == pytest.approx(used_gib, rel=1e-3)


@pytest.mark.parametrize("name", sorted(search_tables.TABLES))
def test_each_tables_fastest_fitting_point_is_at_the_memory_edge(name: str) -> None:
    table = search_efficiency.independent_table(search_tables.TABLES[name])
    best = table.best()
    used = table.truth[best].device_used_gib
    assert 0.95 * table.budget_gib < used <= table.budget_gib
    faster = [r for r in table.runs if table.truth[r].tokens_per_s > table.truth[best].tokens_per_s]
    assert faster and not any(table.fits(r) for r in faster), "what is faster does not fit"


def test_a_replayed_search_launches_its_budget_and_reports_a_run_that_fits() -> None:
    table = search_efficiency.independent_table(search_tables.PUBLISHED)
    outcome = search_efficiency.fsdp_bench_search(table, 20, "+15%", 0)
    assert len(outcome.launched) == 20 == len(set(outcome.launched))
    assert outcome.reported in outcome.launched and table.fits(outcome.reported)
