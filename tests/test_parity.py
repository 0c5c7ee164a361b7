"""Seed 000, section 12: an FSDP2 step over two ranks equals a single-process step on the whole
batch (`--verify`), on a pairwise covering set of grouping x reshard x prefetch x
accumulation/sync: every pair of two knobs' values appears in some run (12 runs instead of the
108 of the full product; all 336 of a wider product agreed when first measured, and so did
the 36 runs of every grouping x reshard x accumulation, see ../shared/notes)."""

from __future__ import annotations

import itertools

import pandas as pd
import pytest
import torch

from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.run import DataConfig, RunConfig
from fsdp_bench.job.parity import _compare, verification_run
from tests.conftest import sweep, tiny_grid

pytestmark = pytest.mark.slow

GROUPINGS = ["root", "block", "blocks:2", "linear"]
RESHARD = ["default", True, False]
PREFETCH = ["implicit", 1, 2]
ACCUMULATION = [(1, "every"), (2, "every"), (2, "last")]  # K=1 with last is K=1 with every
COVERING = [
    (grouping, reshard, PREFETCH[(g + r) % 3], ACCUMULATION[(g + 2 * r) % 3])
    for g, grouping in enumerate(GROUPINGS)
    for r, reshard in enumerate(RESHARD)
]
"""Every grouping x reshard; prefetch and accumulation as two orthogonal Latin squares over
them, so that every pair of any two knobs' values appears (a covering array of strength 2)."""


@pytest.fixture(scope="module")
def verified(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    folder = tmp_path_factory.mktemp("parity")
    measure = {"warmup_steps": 1, "timed_steps": 1, "repeats": 1}
    grid = tiny_grid(
        "parity",
        [
            *(
                {
                    "fsdp.grouping": [grouping],
                    "fsdp.reshard_after_forward": [reshard],
                    "fsdp.prefetch": [prefetch],
                    "train.accumulation_steps": [steps],
                    "train.grad_sync": [sync],
                }
                for grouping, reshard, prefetch, (steps, sync) in COVERING
            ),
            # The other knobs, one at a time, and the DDP baseline.
            {"fsdp.mixed_precision": ["bf16"], "fsdp.grouping": ["root", "linear"]},
            {"fsdp.activation_checkpointing": ["block"], "fsdp.grouping": ["block", "blocks:2"]},
            {"fsdp.cpu_offload": [True]},
            {"model.tie_embeddings": [False], "fsdp.grouping": ["root", "linear"]},
            {"strategy": ["ddp"]},
            {"strategy": ["ddp"], "train.accumulation_steps": [2], "train.grad_sync": ["last"]},
        ],
        model={"name": "tiny", "tie_embeddings": True},
        measure=measure,
    )
    _, df = sweep(folder, grid, verify=True)
    return df


def _as_run(combo: tuple[object, ...]) -> tuple[object, ...]:
    """A combination as its run has it: one group for the whole model with reshard false is
    FSDP2's default (`RunConfig.canonical`)."""
    grouping, reshard, *rest = combo
    return (grouping, "default" if (grouping, reshard) == ("root", "False") else reshard, *rest)


def test_every_fp32_combination_matches_single_process(verified: pd.DataFrame) -> None:
    fp32 = verified[(verified.mixed_precision == "fp32") & (verified.strategy == "fsdp")]
    combos = {_as_run((g, str(r), str(p), a)) for g, r, p, a in COVERING}
    seen = {
        (
            r.grouping,
            str(r.reshard_after_forward),
            str(r.prefetch),
            (r.accumulation_steps, r.grad_sync),
        )
        for r in fp32.itertuples()
        if r.activation_checkpointing == "none" and r.tie_embeddings is True and not r.cpu_offload
    }
    assert combos <= seen
    for i, j in itertools.combinations(range(4), 2):  # every pair of two knobs' values
        assert {(c[i], c[j]) for c in seen} == {
            (c[i], c[j])
            for c in map(
                _as_run,
                itertools.product(GROUPINGS, map(str, RESHARD), map(str, PREFETCH), ACCUMULATION),
            )
        }
    failed = fp32[(fp32.status != "ok") | (fp32.parity_ok != True)]  # noqa: E712
    assert failed.empty, failed[["grouping", "reshard_after_forward", "prefetch", "reason"]]
    # Measured bound on this machine: gradients agree to ~1e-8, parameters after SGD to ~1e-7.
    assert fp32.parity_grad_max_abs_diff.max() < 1e-6
    assert fp32.parity_param_max_abs_diff.max() < 1e-6


def test_other_knobs_and_ddp_match(verified: pd.DataFrame) -> None:
    others = verified[
        (verified.mixed_precision == "bf16")
        | (verified.activation_checkpointing == "block")
        | (verified.strategy == "ddp")
        | (verified.cpu_offload == True)  # noqa: E712
        | (verified.tie_embeddings == False)  # noqa: E712
    ]
    assert len(others) == 2 + 2 + 2 + 1 + 2
    failed = others[(others.status != "ok") | (others.parity_ok != True)]  # noqa: E712
    assert failed.empty, failed[["grouping", "mixed_precision", "strategy", "reason"]]


def test_the_check_can_fail() -> None:
    want = {"w": torch.ones(4, 4)}
    ok, diff, _ = _compare({"w": torch.ones(4, 4)}, want, "fp32")
    assert ok and diff == 0
    bad = torch.ones(4, 4)
    bad[1, 2] += 1e-4
    ok, diff, detail = _compare({"w": bad}, want, "fp32")
    assert not ok and diff == pytest.approx(1e-4, rel=1e-2) and detail.startswith("w: max abs diff")
    ok, _, detail = _compare({"w": torch.ones(4, 4) * 1.1}, want, "bf16")
    assert not ok and "relative L2 error 1.00e-01" in detail
    ok, _, _ = _compare({"w": torch.ones(4, 4) * 1.01}, want, "bf16")
    assert ok
    ok, _, detail = _compare({"w": torch.ones(4, 4) * 1.02}, want, "tf32")  # 2e-2 > 1e-2
    assert not ok and "relative L2 error 2.00e-02 > 0.01" in detail
    ok, _, _ = _compare({"w": bad}, want, "tf32")  # 1e-4 in one element passes under TF32
    assert ok


def test_large_models_are_verified_on_a_scaled_down_copy() -> None:
    run = RunConfig(
        world_size=8,
        model=ModelConfig(name="llama3-8b"),
        data=DataConfig(micro_batch_size=4, seq_len=8192),
        fsdp=FsdpConfig(grouping="blocks:2", reshard_after_forward=4, prefetch=2),
    )
    checked, scope = verification_run(run)
    shape = checked.model.shape
    assert shape.num_params < 1e6 and scope.startswith("a scaled-down copy: dim 64, 4 blocks")
    assert shape.n_heads // shape.n_kv_heads == 4  # Llama-3-8B's 32 / 8 query groups
    assert (checked.world_size, checked.fsdp, checked.train) == (8, run.fsdp, run.train)
    assert (checked.data.seq_len, checked.data.micro_batch_size) == (128, 2)
    small = RunConfig(world_size=2)
    assert verification_run(small) == (small, "as run")
