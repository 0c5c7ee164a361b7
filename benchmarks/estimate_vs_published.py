"""The memory estimate against published FSDP/FSDP2 runs: each published figure beside the
estimate of the same quantity for the same configuration, and the error in %.

    python benchmarks/estimate_vs_published.py          # ~3 minutes on 2 cores

A row whose configuration the tool cannot express says what is missing: that list is the
work of the configurations issue. Values a source leaves out and that were filled from the
code or defaults of the source's project at the time are listed per row as inferred.

Which quantity a figure is matters (`memory.device_memory`): torchtitan's log line prints
`reserved_bytes.all.peak` (torchtitan/components/metrics.py, DeviceMemoryMonitor); "active"
counts blocks freed but still waiting on another stream's events (before torch 2.8
ProcessGroupNCCL recorded the streams of collectives' tensors), so it is compared with the
estimated allocated figure, which it can exceed. Meta's H100s in these sources have 96 GB
(95.04 GiB in their logs).

The second table shows how the peak moves with world size on one configuration: shards of
parameters, gradients and optimizer state shrink as 1/W, the unsharded groups and the
activations do not.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.run import DataConfig, FsdpConfig, RunConfig, TrainConfig
from fsdp_bench.memory.device_memory import Calibration
from fsdp_bench.memory.estimate import RunEstimate, estimate_run

TORCHTITAN_BENCH = "github.com/pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TRAINY = "github.com/pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
PR_165 = "github.com/pytorch/torchtitan/pull/165"
PR_132445 = "github.com/pytorch/pytorch/pull/132445"
PR_382 = "github.com/pytorch/torchtitan/pull/382"
TORCHAO = "github.com/pytorch/ao torchao/float8/README.md (torchtitan PR 808's logs)"
LLAMA_RECIPES = "github.com/meta-llama/llama-recipes/issues/120"
THUNDER_940 = "github.com/Lightning-AI/lightning-thunder/pull/940"
TORCHTUNE = "github.com/meta-pytorch/torchtune README.md"

TORCHTITAN_RESHARD = (
    "reshard_after_forward all_but_last (torchtitan's parallelize_llama then: "
    "layer_id < n_layers - 1)"
)


@dataclass(frozen=True)
class Published:
    """One published figure: a run, what was reported, where."""

    label: str
    source: str
    says: str
    """The figure as the source gives it."""
    quantity: str
    """active, allocated, reserved or device-used (what the figure measured)."""
    gib: float
    run: RunConfig | None = None
    """The configuration, where the tool can express it."""
    missing: str = ""
    """What the tool cannot express (with `run` None)."""
    inferred: str = ""
    """Configuration values the source does not state, filled as described."""


def _llama(
    name: str, world_size: int, seq: int, batch: int, ac: str, max_grad_norm: float | None = None
) -> RunConfig:
    return RunConfig(
        world_size=world_size,
        model=ModelConfig(name=name),
        data=DataConfig(seq_len=seq, micro_batch_size=batch),
        fsdp=FsdpConfig(mixed_precision="bf16", activation_checkpointing=ac,
                        reshard_after_forward="all_but_last"),
        train=TrainConfig(max_grad_norm=max_grad_norm),
    )  # fmt: skip


TITAN_8B = (
    "local batch 2 (the document's 'Local batch size 2'), seq 8192 (llama3_8b.toml then); "
    "'selective activation checkpointing' as torchtitan's default mode, per op; bf16 "
    "parameters with fp32 "
    f"reduction, gradient norm clipped at 1.0 (torchtitan's defaults); {TORCHTITAN_RESHARD}; "
    "AdamW foreach (the implementation then is not stated)"
)


ROW_17 = _llama("llama2-7b", 8, 2048, 8, "block")
ROW_24 = _llama("llama3-8b", 8, 8192, 1, "none")
FULL_AC_7B = (
    "the model: 'Llama-7B' in torchtitan then, the Llama-2-7B shape (32 heads, 32 key/value "
    f"heads, FFN 11008, vocab 32000); {TORCHTITAN_RESHARD}; AdamW foreach"
)

ROWS = [
    Published("torchtitan T1: Llama-3.1-8B, 8 GPUs, FSDP", TORCHTITAN_BENCH,
              "| FSDP | 5,762 | 82.4 |", "reserved", 82.4,
              run=_llama("llama3-8b", 8, 8192, 2, "selective_op", 1.0), inferred=TITAN_8B),
    Published("torchtitan T1: + torch.compile", TORCHTITAN_BENCH,
              "| FSDP + torch.compile | 6,667 | 77.0 |", "reserved", 77.0,
              missing="compiled runs' memory (the eager estimate is an upper bound)"),
    Published("torchtitan T1: + compile + float8", TORCHTITAN_BENCH,
              "| FSDP + torch.compile + Float8 | 8,532 | 76.8 |", "reserved", 76.8,
              missing="compiled runs' memory; float8 linears"),
    Published("torchtitan T3: Llama-3.1-8B, 128 GPUs, FSDP", TORCHTITAN_BENCH,
              "128 GPUs ... | FSDP | 5,605 | 67.0 |", "reserved", 67.0,
              run=_llama("llama3-8b", 128, 8192, 2, "selective_op", 1.0), inferred=TITAN_8B),
    Published("torchtitan T2: 8B, seq 32768, full AC, compile, float8", TORCHTITAN_BENCH,
              "| FSDP 8, CP 1 | 32768 | 3,890 | 83.9 |", "reserved", 83.9,
              missing="compiled runs' memory; float8 linears"),
    # FSDP 32 x TP 8 itself is expressible: results/2026-12-04-tp-70b-estimate.txt.
    Published("torchtitan T4: Llama-3.1-70B, 256 GPUs, FSDP 32 x TP 8", TORCHTITAN_BENCH,
              "| 2D | 829 | 71.9 |", "reserved", 71.9,
              missing="compiled runs' memory; float8 linears"),
    Published("Trainy: Llama-3.1-8B, 32 H200s, compile + float8", TRAINY,
              "| 4 | 10938 | 47.96 |", "reserved", 47.96,
              missing="compiled runs' memory; float8 all-gather"),
    Published("torchtitan PR 165: Llama-7B, 8 GPUs, FSDP1, full AC", PR_165,
              "FSDP1 (AC): 24.81% peak active, 33.82% peak reserved", "reserved", 32.14,
              missing="FSDP1 (the tool runs FSDP2)"),
    Published("torchtitan PR 165: Llama-7B, 8 GPUs, FSDP2, full AC", PR_165,
              "FSDP2 (AC): 23.92% peak active (of 95.04 GiB)", "active", 22.73, ROW_17,
              inferred=FULL_AC_7B),
    Published("torchtitan PR 165: the same run, reserved", PR_165,
              "FSDP2 (AC): ... 32.64% peak reserved", "reserved", 31.02, ROW_17,
              inferred=FULL_AC_7B),
    Published("torchtitan PR 165: FSDP2, selective AC", PR_165,
              "FSDP2 (SAC): 52.13% peak active, 62.51% peak reserved", "reserved", 59.41,
              missing="selective AC of a kind the PR does not name"),
    Published("torchtitan PR 165: FSDP2, no AC, compile", PR_165,
              "FSDP2 (no AC) ... 90.28 GiB (94.99%) peak reserved", "reserved", 90.28,
              missing="compiled runs' memory"),
    Published("pytorch PR 132445: Llama3-8B, 8 GPUs, no AC, batch 1", PR_132445,
              "memory: 77.29GiB(81.32%)", "reserved", 77.29, ROW_24,
              inferred=f"seq 8192 (llama3_8b.toml then); {TORCHTITAN_RESHARD}; AdamW foreach"),
    Published("torchtitan PR 382: Llama3-8B, 8 GPUs, op SAC, compile, fused AdamW", PR_382,
              "memory: 68.09GiB(71.65%)", "reserved", 68.09,
              missing="compiled runs' memory (the eager estimate is an upper bound)"),
    Published("torchao float8 README: Llama3-8B bf16, 8 GPUs, op SAC, compile", TORCHAO,
              "| Llama3-8b | none (bfloat16) | per op SAC | 47.65 |", "reserved", 47.65,
              missing="compiled runs' memory (the eager estimate is an upper bound)"),
    Published("llama-recipes 120: Llama-2-70B, 16 A100s, FSDP1 pure bf16", LLAMA_RECIPES,
              "42 GB allocated, 63 GB reserved", "reserved", 63.0,
              missing="FSDP1 (the tool runs FSDP2)"),
    Published("lightning-thunder PR 940: Llama-2-7B, 8 H100s, FSDP2 eager", THUNDER_940,
              "| eager | N/A (FSDP2) | 9325.13 | 47.45 |", "allocated", 47.45e9 / 2**30,
              run=RunConfig(
                  world_size=8,
                  model=ModelConfig(name="llama2-7b", dtype="bf16"),
                  data=DataConfig(seq_len=4096, micro_batch_size=1),
                  fsdp=FsdpConfig(mixed_precision="bf16", reshard_after_forward=False),
                  train=TrainConfig(optimizer_impl="fused"),
              ),
              inferred="seq 4096, batch 1, no AC, reshard_after_forward false (the harness's "
                       "defaults); bf16 storage with fused AdamW"),
    Published("torchtune README: Llama 3.1 70B full finetune, 8 A100s", TORCHTUNE,
              "| Llama 3.1 70B | Full finetune | 8x A100 | 13.9 GiB ** |", "unknown", 13.9,
              missing="CPU offload with the optimizer in backward; compiled runs' memory"),
]  # fmt: skip

ESTIMATE_OF = {
    "active": "estimated_allocated_gib",
    "allocated": "estimated_allocated_gib",
    "reserved": "estimated_reserved_gib",
    "device-used": "estimated_device_used_gib",
}


def estimated(estimate: RunEstimate, quantity: str) -> float | None:
    prediction = estimate.predict(Calibration())
    return dict(prediction.peaks).get(ESTIMATE_OF[quantity])


def published_table() -> list[float]:
    """Prints each row; returns the expressible rows' errors in %."""
    started = time.perf_counter()
    runs = {row.run.run_id: row.run for row in ROWS if row.run is not None}
    estimates = {run_id: estimate_run(run, "cuda") for run_id, run in runs.items()}
    print(f"{len(ROWS)} published figures from {len({r.source for r in ROWS})} sources; "
          f"{sum(r.run is not None for r in ROWS)} expressible (estimated in "
          f"{time.perf_counter() - started:.0f} s)\n")  # fmt: skip
    print(f"{'published run':66s} {'quantity':9s} {'published':>9s} {'estimate':>9s} {'error':>7s}")
    errors = []
    for row in ROWS:
        if row.run is None:
            print(f"{row.label[:66]:66s} {row.quantity:9s} {row.gib:9.2f} {'-':>9s} {'-':>7s}"
                  f"   not expressible: {row.missing}")  # fmt: skip
            continue
        value = estimated(estimates[row.run.run_id], row.quantity)
        assert value is not None
        error = 100 * (value - row.gib) / row.gib
        errors.append(error)
        print(f"{row.label[:66]:66s} {row.quantity:9s} {row.gib:9.2f} {value:9.2f} {error:+6.1f}%")
    print("\nSources and inferred values:")
    for row in ROWS:
        inferred = f"; inferred: {row.inferred}" if row.inferred else ""
        print(f'- {row.label}: {row.source}, "{row.says}"{inferred}')
    return errors


def world_size_table() -> None:
    """Llama-3-8B, bf16, block checkpointing, seq 8192, one sequence per rank."""
    print("\nLlama-3-8B, bf16, full AC, seq 8192, batch 1: the peak by world size (GiB/rank)")
    print(f"{'W':>4s} {'tensors':>8s} {'params':>7s} {'grads':>6s} {'optim':>6s} {'activ':>6s} "
          f"{'temp':>6s} {'reserved':>9s} {'dev-used':>9s}")  # fmt: skip
    for world_size in (8, 32, 128):
        run = _llama("llama3-8b", world_size, 8192, 1, "block")
        estimate = estimate_run(run, "cuda")
        parts = estimate.breakdown_gib
        prediction = estimate.predict(Calibration())
        print(
            f"{world_size:4d} {estimate.estimated_peak_gib:8.2f} {parts.get('parameter', 0):7.2f} "
            f"{parts.get('gradient', 0):6.2f} {parts.get('optimizer_state', 0):6.2f} "
            f"{parts.get('activation', 0):6.2f} {parts.get('temp', 0):6.2f} "
            f"{prediction.reserved_gib or 0:9.2f} {prediction.device_used_gib or 0:9.2f}"
        )


def main() -> int:
    errors = published_table()
    if errors:
        absolute = [abs(e) for e in errors]
        median = statistics.median(absolute)
        print(f"\nexpressible rows: {len(errors)}; median |error| {median:.1f}%, "
              f"worst {max(absolute):.1f}%")  # fmt: skip
    world_size_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
