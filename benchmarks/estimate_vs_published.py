"""The memory estimate against figures it was not made from: published FSDP/FSDP2 runs, and
runs measured on a GPU (the GPU check's records), each figure beside the estimate of the same
quantity for the same configuration, its interval (`memory.error_model`), whether the figure
falls inside, and the interval's half-width.

    python benchmarks/estimate_vs_published.py          # ~15 minutes on 2 cores

A published row whose configuration the tool cannot express says what is missing. Values a
source leaves out, filled from the code or defaults of the source's project at the time, are
listed per row as inferred; so is the torch the run used (from its date): before 2.8
ProcessGroupNCCL recorded collectives' streams, which the error model widens the fragmentation
for. torchtitan's launcher set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True from
2024-10-22 on (run_train.sh), so its later runs are estimated with expandable segments.

Which quantity a figure is matters: torchtitan's log line prints `reserved_bytes.all.peak`
(torchtitan/components/metrics.py, DeviceMemoryMonitor); "active" counts blocks allocated and
blocks freed but waiting on another stream's events, so it lies between the allocated figure
and that plus the collectives' buffers the streams hold (the all-gather output and the
reduce-scatter input of two groups: the one computing and the one prefetched). Meta's H100s
in these sources have 96 GB (95.04 GiB in their logs).

The error model's widths were set from some of these same figures (the fragmentation of the
published torchtitan runs, the H200's allocated and reserved: the ratios printed below the
tables), so coverage on them is in-sample; so is that of Trainy's two runs, the only
published ones with the loss compiled: the loss's high end (the step with the loss eager,
`error_model.COMPILED_LOSS`) was added after they fell outside the fused figure's interval.
A figure outside its interval is a finding either way. Rows apart from the headline are shown
with why: what the estimate does not model for them (float8, a compiled graph, another
model's code) or a measurement an earlier run spoiled.

The last table shows how the peak moves with world size on one configuration: shards of
parameters, gradients and optimizer state shrink as 1/W, the unsharded groups and the
activations do not.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.config.gpus import CUBLAS_HANDLES, CUBLAS_WORKSPACE_SM90_BYTES
from fsdp_bench.config.grid import expand, parse_grid
from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.run import DataConfig, RunConfig, TrainConfig
from fsdp_bench.memory import error_model
from fsdp_bench.memory.calibration import Calibration
from fsdp_bench.memory.compiled import compiled_as
from fsdp_bench.memory.estimate import RunEstimate, estimate_run
from fsdp_bench.memory.prediction import Prediction
from fsdp_bench.store import GIB

TORCHTITAN_BENCH = "github.com/pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TRAINY = "github.com/pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
PR_165 = "github.com/pytorch/torchtitan/pull/165"
PR_132445 = "github.com/pytorch/pytorch/pull/132445"
PR_382 = "github.com/pytorch/torchtitan/pull/382"
TORCHAO = "github.com/pytorch/ao torchao/float8/README.md (torchtitan PR 808's logs)"
LLAMA_RECIPES = "github.com/meta-llama/llama-recipes/issues/120"
THUNDER_940 = "github.com/Lightning-AI/lightning-thunder/pull/940"
TORCHTUNE = "github.com/meta-pytorch/torchtune README.md"
GPU_CHECK = Path(__file__).parent / "results" / "2026-12-04-h200-gpu-check-2.json"

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
    """What the tool cannot express: with `run` None, why there is no estimate; with a run,
    what the estimate leaves out (the row is shown, apart from the headline)."""
    inferred: str = ""
    """Configuration values the source does not state, filled as described."""
    torch: str = "2.6"
    """The torch the run used, from its date (the release or nightly then)."""
    gpu: str = "H100"


def _llama(
    name: str,
    world_size: int,
    seq: int,
    batch: int,
    ac: str,
    max_grad_norm: float | None = None,
    *,
    expandable: bool = False,
    compile: str = "none",
) -> RunConfig:
    return RunConfig(
        world_size=world_size,
        model=ModelConfig(name=name),
        data=DataConfig(seq_len=seq, micro_batch_size=batch),
        fsdp=FsdpConfig(mixed_precision="bf16", activation_checkpointing=ac,
                        reshard_after_forward="all_but_last"),
        train=TrainConfig(max_grad_norm=max_grad_norm, expandable_segments=expandable,
                          compile=compile),  # type: ignore[arg-type]
    )  # fmt: skip


TITAN_8B = (
    "local batch 2 (the document's 'Local batch size 2'), seq 8192 (llama3_8b.toml then); "
    "'selective activation checkpointing' as torchtitan's default mode, per op; bf16 "
    "parameters with fp32 "
    f"reduction, gradient norm clipped at 1.0 (torchtitan's defaults); {TORCHTITAN_RESHARD}; "
    "AdamW foreach (the implementation then is not stated); expandable segments "
    "(run_train.sh since 2024-10-22); torch 2.6 nightly (2024-12)"
)
T1 = _llama("llama3-8b", 8, 8192, 2, "selective_op", 1.0, expandable=True)
T3 = dataclasses.replace(T1, world_size=128)
COMPILED = dataclasses.replace(T1, train=dataclasses.replace(T1.train, compile="block"))


def _float8(run: RunConfig, recipe: str = "tensorwise") -> RunConfig:
    """`run` with float8 linears; tensorwise with float8 all-gather, as torchtitan's float8
    settings then had it (enable_fsdp_float8_all_gather, precompute_float8_dynamic_scale)."""
    gather = recipe == "tensorwise"
    return dataclasses.replace(
        run,
        fsdp=dataclasses.replace(run.fsdp, float8_all_gather=gather),
        train=dataclasses.replace(run.train, float8=recipe),  # type: ignore[arg-type]
    )


COMPILED_FLOAT8 = _float8(COMPILED)
_TRAINY = _float8(_llama("llama3-8b", 32, 8192, 2, "selective_op", 1.0, expandable=True,
                         compile="block"))  # fmt: skip
TRAINY_8B = dataclasses.replace(
    _TRAINY,
    processes_per_node=8,
    fsdp=dataclasses.replace(_TRAINY.fsdp, reshard_after_forward="default"),
    train=dataclasses.replace(_TRAINY.train, compile_loss=True),
)
TRAINY_8B_64 = dataclasses.replace(TRAINY_8B, world_size=64)
TRAINY_RUNS = (
    "--training.local_batch_size=2, --training.compile, float8 tensorwise with float8 "
    "all-gather and the scale precompute (the command); the loss compiled as well (torchtitan "
    "compiles it with --training.compile since its PR 1033, 2025-04-01); "
    "--float8.force_recompute_fp8_weight_in_bwd not modelled (a workaround that torch's PR "
    "148922 made unneeded; torchao's PR 2356, 2025-06-11, made it do nothing); seq 8192, "
    "selective AC per op, bf16 with fp32 reduction, clipping 1.0 and expandable segments "
    "(llama3_8b.toml and run_train.sh at torchtitan e7c0cae); reshard after forward by "
    "FSDP2's default (torchtitan's 'default' policy since its PR 1094); torch 2.8 nightly "
    "(2025-05-29); torchtitan's memory figure is the peak reserved"
)
T3_COMPILED = dataclasses.replace(COMPILED, world_size=128)
T2 = _float8(_llama("llama3-8b", 8, 32768, 1, "block", 1.0, expandable=True, compile="block"))
TORCHAO_8B = _llama("llama3-8b", 8, 8192, 1, "selective_op", 1.0, expandable=True,
                    compile="block")  # fmt: skip
TORCHAO_RUNS = (
    "torchtitan 0.0.2 as torchao's float8 README ran it: 8 H100s, batch 1, seq 8192, "
    "torch.compile, FSDP2; per-block compile, bf16 with fp32 reduction, clipping 1.0 and "
    f"expandable segments as torchtitan then; {TORCHTITAN_RESHARD}; torch 2.7 nightly"
)


ROW_17 = _llama("llama2-7b", 8, 2048, 8, "block")
ROW_17_SAC = _llama("llama2-7b", 8, 2048, 8, "selective_op")
H100_95_GIB = 95.0396
"""The H100s of PR 165, whose memory figures are percentages of this ('can convert against
95.0396 GiB GPU memory')."""
SAC_THEN = (
    "selective AC per op as torchtitan PR 97 (2024-02-28) had it, the only kind then: keep "
    "the outputs of attention, reduce-scatters and every other matrix product (these figures "
    "were first posted in PR 116 on 2024-03-06; per-layer SAC came with PR 125, opened "
    "2024-03-10)"
)


def _compiled(run: RunConfig) -> RunConfig:
    """`run` with each block compiled (torchtitan's per-block compile under FSDP2)."""
    return dataclasses.replace(run, train=dataclasses.replace(run.train, compile="block"))


ROW_24 = _llama("llama3-8b", 8, 8192, 1, "none")
LITGPT = (
    "litgpt's Llama-2-7B, whose RMSNorm is Python code keeping fp32 copies for backward, as "
    "transformers' LlamaRMSNorm does: estimated as the transformers model of its config "
    "(sweeps/models/llama2-7b.json)"
)
ROW_THUNDER = RunConfig(
    world_size=8,
    model=ModelConfig(
        name="hf:sweeps/models/llama2-7b.json",
        dtype="bf16",
        hf_options={"attn_implementation": "sdpa"},
    ),
    data=DataConfig(seq_len=4096, micro_batch_size=1),
    fsdp=FsdpConfig(mixed_precision="bf16", reshard_after_forward=False),
    train=TrainConfig(optimizer_impl="fused"),
)
ROW_70B = _float8(RunConfig(
    world_size=256,
    processes_per_node=8,
    tp_size=8,
    model=ModelConfig(name="llama3-70b"),
    data=DataConfig(seq_len=8192, micro_batch_size=16),
    fsdp=FsdpConfig(mixed_precision="bf16", activation_checkpointing="block",
                    reshard_after_forward="all_but_last"),
    train=TrainConfig(max_grad_norm=1.0, optimizer_impl="fused", expandable_segments=True,
                      compile="block"),
))  # fmt: skip
FULL_AC_7B = (
    "the model: 'Llama-7B' in torchtitan then, the Llama-2-7B shape (32 heads, 32 key/value "
    f"heads, FFN 11008, vocab 32000); {TORCHTITAN_RESHARD}; AdamW foreach"
)

ROWS = [
    Published("torchtitan T1: Llama-3.1-8B, 8 GPUs, FSDP", TORCHTITAN_BENCH,
              "| FSDP | 5,762 | 82.4 |", "reserved", 82.4, run=T1, inferred=TITAN_8B),
    Published("torchtitan T1: + torch.compile", TORCHTITAN_BENCH,
              "| FSDP + torch.compile | 6,667 | 77.0 |", "reserved", 77.0, run=COMPILED,
              inferred=f"{TITAN_8B}; per-block compile (torchtitan's)"),
    Published("torchtitan T1: + compile + float8", TORCHTITAN_BENCH,
              "| FSDP + torch.compile + Float8 | 8,532 | 76.8 |", "reserved", 76.8,
              run=COMPILED_FLOAT8,
              inferred=f"{TITAN_8B}; float8 tensorwise with float8 all-gather"),
    Published("torchtitan T3: Llama-3.1-8B, 128 GPUs, FSDP", TORCHTITAN_BENCH,
              "128 GPUs ... | FSDP | 5,605 | 67.0 |", "reserved", 67.0, run=T3,
              inferred=TITAN_8B),
    Published("torchtitan T3: + torch.compile", TORCHTITAN_BENCH,
              "128 GPUs ... | FSDP + torch.compile | 6,514 | 62.0 |", "reserved", 62.0,
              run=T3_COMPILED, inferred=f"{TITAN_8B}; per-block compile"),
    Published("torchtitan T3: + compile + float8", TORCHTITAN_BENCH,
              "128 GPUs ... | FSDP + torch.compile + Float8 | 8,380 | 61.8 |", "reserved", 61.8,
              run=_float8(T3_COMPILED),
              inferred=f"{TITAN_8B}; float8 tensorwise with float8 all-gather"),
    Published("torchtitan T2: 8B, seq 32768, full AC, compile, float8", TORCHTITAN_BENCH,
              "| FSDP 8, CP 1 | 32768 | 3,890 | 83.9 |", "reserved", 83.9, run=T2,
              inferred="local batch 1 (the table's), full AC (block), per-block compile, "
                       "float8 tensorwise with float8 all-gather; otherwise as T1"),
    # FSDP 32 x TP 8 itself is expressible: results/2026-12-04-tp-70b-estimate.txt.
    Published("torchtitan T4: Llama-3.1-70B, 256 GPUs, FSDP 32 x TP 8", TORCHTITAN_BENCH,
              "| 2D | 829 | 71.9 |", "reserved", 71.9, run=ROW_70B,
              inferred="local batch 16, seq 8192, full AC, per-block compile, bf16 with fp32 "
                       f"reduction, clipping 1.0, fused AdamW; {TORCHTITAN_RESHARD}; "
                       "expandable segments; 8 GPUs per node; float8 tensorwise with float8 "
                       "all-gather as the 8B rows, and torchao's float8 tensor-parallel styles "
                       "(torchtitan's apply_tp with float8 then)"),
    Published("Trainy: Llama-3.1-8B, 32 H200s, compile + float8", TRAINY,
              "| 4 | 10938 | 47.96 |", "reserved", 47.96, run=TRAINY_8B, gpu="H200",
              torch="2.8",
              inferred=f"4 nodes of 8 H200s, {TRAINY_RUNS}"),
    Published("Trainy: the same on 8 nodes, 64 H200s", TRAINY,
              "| 8 | 10753 | 46.97 |", "reserved", 46.97, run=TRAINY_8B_64, gpu="H200",
              torch="2.8", inferred=f"8 nodes of 8 H200s, {TRAINY_RUNS}"),
    Published("torchtitan PR 165: Llama-7B, 8 GPUs, FSDP1, full AC", PR_165,
              "FSDP1 (AC): 24.81% peak active, 33.82% peak reserved", "reserved", 32.14,
              missing="FSDP1 (the tool runs FSDP2)"),
    Published("torchtitan PR 165: Llama-7B, 8 GPUs, FSDP2, full AC", PR_165,
              "FSDP2 (AC): 23.92% peak active (of 95.04 GiB)", "active", 22.73, ROW_17,
              inferred=FULL_AC_7B, torch="2.3"),
    Published("torchtitan PR 165: the same run, reserved", PR_165,
              "FSDP2 (AC): ... 32.64% peak reserved", "reserved", 31.02, ROW_17,
              inferred=FULL_AC_7B, torch="2.3"),
    Published("torchtitan PR 165: FSDP2, selective AC", PR_165,
              "FSDP2 (SAC): 52.13% peak active", "active", 0.5213 * H100_95_GIB, ROW_17_SAC,
              inferred=f"{FULL_AC_7B}; {SAC_THEN}", torch="2.3"),
    Published("torchtitan PR 165: FSDP2, selective AC, reserved", PR_165,
              "FSDP2 (SAC): ... 62.51% peak reserved", "reserved", 0.6251 * H100_95_GIB,
              ROW_17_SAC, inferred=f"{FULL_AC_7B}; {SAC_THEN}", torch="2.3"),
    Published("torchtitan PR 165: FSDP2, full AC, compile", PR_165,
              "FSDP2 (AC), buffer reuse enabled: 28.90 GiB (30.40%) peak reserved", "reserved",
              28.90, run=_compiled(ROW_17), inferred=f"{FULL_AC_7B}; per-block compile",
              torch="2.3"),
    Published("torchtitan PR 165: FSDP2, selective AC, compile", PR_165,
              "FSDP2 (SAC), buffer reuse enabled: 53.83 GiB (56.64%) peak reserved",
              "reserved", 53.83, run=_compiled(ROW_17_SAC),
              inferred=f"{FULL_AC_7B}; {SAC_THEN}; per-block compile", torch="2.3"),
    Published("torchtitan PR 165: FSDP2, selective AC, compile, batch 16", PR_165,
              "FSDP2 (SAC) with 16 local batch size (doubled), we get 88.23 GiB (92.84%) peak "
              "reserved", "reserved", 88.23,
              run=_compiled(_llama("llama2-7b", 8, 2048, 16, "selective_op")),
              inferred=f"{FULL_AC_7B}; {SAC_THEN}; per-block compile", torch="2.3"),
    Published("torchtitan PR 165: FSDP2, no AC, compile", PR_165,
              "FSDP2 (no AC) ... 90.28 GiB (94.99%) peak reserved", "reserved", 90.28,
              run=_compiled(_llama("llama2-7b", 8, 2048, 8, "none")),
              inferred=f"{FULL_AC_7B}; per-block compile", torch="2.3"),
    Published("pytorch PR 132445: Llama3-8B, 8 GPUs, no AC, batch 1", PR_132445,
              "memory: 77.29GiB(81.32%)", "reserved", 77.29, ROW_24, torch="2.5",
              inferred=f"seq 8192 (llama3_8b.toml then); {TORCHTITAN_RESHARD}; AdamW foreach; "
                       "torch 2.5 nightly (2024-08)"),
    Published("torchtitan PR 382: Llama3-8B, 8 GPUs, op SAC, compile, fused AdamW", PR_382,
              "memory: 68.09GiB(71.65%)", "reserved", 68.09,
              missing="its local batch and sequence length, which the quoted log line does not "
                      "state (the PR's text is not at hand here)"),
    Published("torchao float8 README: Llama3-8B bf16, 8 GPUs, op SAC, compile", TORCHAO,
              "| Llama3-8b | none (bfloat16) | per op SAC | 47.65 |", "reserved", 47.65,
              run=TORCHAO_8B, inferred=TORCHAO_RUNS, torch="2.7"),
    Published("torchao float8 README: tensorwise, float8 all-gather", TORCHAO,
              "| Llama3-8b | tensorwise with float8 all-gather | per op SAC | 47.77 |",
              "reserved", 47.77, run=_float8(TORCHAO_8B), inferred=TORCHAO_RUNS, torch="2.7"),
    Published("torchao float8 README: rowwise, bf16 all-gather", TORCHAO,
              "| Llama3-8b | rowwise with bfloat16 all-gather | per op SAC | 47.79 |",
              "reserved", 47.79, run=_float8(TORCHAO_8B, "rowwise"), inferred=TORCHAO_RUNS,
              torch="2.7"),
    Published("llama-recipes 120: Llama-2-70B, 16 A100s, FSDP1 pure bf16", LLAMA_RECIPES,
              "42 GB allocated, 63 GB reserved", "reserved", 63.0,
              missing="FSDP1 (the tool runs FSDP2)"),
    Published("lightning-thunder PR 940: Llama-2-7B, 8 H100s, FSDP2 eager", THUNDER_940,
              "| eager | N/A (FSDP2) | 9325.13 | 47.45 |", "allocated", 47.45e9 / 2**30,
              run=ROW_THUNDER,
              inferred="seq 4096, batch 1, no AC, reshard_after_forward false (the harness's "
                       "defaults); bf16 storage with fused AdamW; torch 2.5 nightly (2024-08); "
                       f"the model: {LITGPT}", torch="2.5"),
    Published("lightning-thunder PR 940: the same run, the preset's fused RMSNorm", THUNDER_940,
              "| eager | N/A (FSDP2) | 9325.13 | 47.45 |", "allocated", 47.45e9 / 2**30,
              run=dataclasses.replace(ROW_THUNDER, model=ModelConfig(name="llama2-7b",
                                                                     dtype="bf16")),
              missing="the preset's RMSNorm is torch's fused kernel, litgpt's is Python",
              torch="2.5"),
    Published("torchtune README: Llama 3.1 70B full finetune, 8 A100s", TORCHTUNE,
              "| Llama 3.1 70B | Full finetune | 8x A100 | 13.9 GiB ** |", "unknown", 13.9,
              missing="CPU offload with the optimizer in backward; compiled runs' memory"),
]  # fmt: skip

PREDICTED = {"allocated": "allocated", "reserved": "reserved", "device-used": "device_used"}


@dataclass(frozen=True)
class Compared:
    """A figure beside the estimate of the same quantity and its interval."""

    label: str
    run_id: str
    quantity: str
    figure_gib: float
    estimate_gib: float
    low_gib: float
    high_gib: float
    allocated_gib: float
    """The estimate's allocated figure (reserved - allocated: the replay's fragmentation)."""
    apart: str = ""
    """Why the row is kept out of the headline ('' when it is in)."""

    @property
    def error_pct(self) -> float:
        return 100 * (self.estimate_gib - self.figure_gib) / self.figure_gib

    @property
    def inside(self) -> bool:
        return self.low_gib <= self.figure_gib <= self.high_gib

    @property
    def half_width_pct(self) -> float:
        return 100 * (self.high_gib - self.low_gib) / 2 / self.estimate_gib


def compare(label: str, run: RunConfig, quantity: str, gib: float, estimate: RunEstimate,
            gpu: str, apart: str = "") -> Compared:  # fmt: skip
    """The published or measured `gib` of `quantity` beside the prediction's interval. A
    compiled run with tensor parallelism and whole blocks checkpointed is estimated as eager
    (`error_model.COMPILED`): apart."""
    if compiled_as(run) == "eager" and not apart:
        apart = "compiled with tensor parallelism and full AC, estimated as eager"
    prediction = estimate.predict(Calibration(gpu=gpu), run)
    assert prediction.errors is not None, estimate.error
    if quantity == "active":  # at least allocated, at most that and the recorded buffers
        interval = prediction.errors.allocated
        held = _recorded_buffers_gib(estimate) if estimate.records_streams else 0.0
        value, low, high = prediction.allocated_gib, interval.low_gib, interval.high_gib + held
    else:
        name = PREDICTED[quantity]
        interval = getattr(prediction.errors, name)
        value, low, high = getattr(prediction, f"{name}_gib"), interval.low_gib, interval.high_gib
    assert value is not None and prediction.allocated_gib is not None
    return Compared(
        label, run.run_id, quantity, gib, value, low, high, prediction.allocated_gib, apart
    )


def _recorded_buffers_gib(estimate: RunEstimate) -> float:
    """Two groups' all-gather outputs and reduce-scatter inputs (fp32 gradients, twice the
    bf16 parameters): what record_stream can keep active after they are freed."""
    return 2 * 3 * estimate.analytic_terms_gib.get("largest_unsharded_group", 0.0)


def published_rows() -> list[Compared]:
    """Each published row, estimated as the run's torch would have made it."""
    started = time.perf_counter()
    runs = {row.run.run_id: row.run for row in ROWS if row.run is not None}
    estimates = {run_id: estimate_run(run, "cuda") for run_id, run in runs.items()}
    print(f"{len(ROWS)} published figures from {len({r.source for r in ROWS})} sources; "
          f"{sum(r.run is not None for r in ROWS)} estimated "
          f"({time.perf_counter() - started:.0f} s)\n")  # fmt: skip
    compared = []
    for row in ROWS:
        if row.run is None:
            continue
        estimate = dataclasses.replace(estimates[row.run.run_id], torch_version=row.torch)
        compared.append(
            compare(row.label, row.run, row.quantity, row.gib, estimate, row.gpu, row.missing)
        )
    return compared


def measured_rows() -> list[Compared]:
    """The GPU check's runs (an H200, torch 2.11): each measured figure beside the estimate
    made now of the same configuration (its run id rebuilt and checked)."""
    report = json.loads(GPU_CHECK.read_text())
    compared = []
    for part, (base, axes) in GPU_CHECK_GRIDS.items():
        spec = parse_grid({"name": part, "base": base, "axes": axes,
                           "launcher": {"device": "cuda"}}, source=part)  # fmt: skip
        runs = {run.run_id: run for run in expand(spec).runs}
        for record in report["parts"][part]["runs"]:
            if record["status"] != "ok":
                continue
            run = runs[record["run_id"]]  # a KeyError: the grid below is not the check's
            estimate = estimate_run(run, "cuda")
            estimate = dataclasses.replace(
                estimate, torch_version=report["parts"]["environment"]["torch"]
            )
            apart = _measured_apart(run, record)
            for quantity, field in MEASURED.items():
                label = f"H200 {part}: {record['model']} {_describe(run)}"
                compared.append(
                    compare(label, run, quantity, record[field], estimate, "H200", apart)
                )
    return compared


GPU_CHECK_GRIDS: dict[str, tuple[dict[str, Any], Any]] = {
    "models": (
        {"world_size": 1, "model": {"name": "llama3-1b"}, "fsdp": {"mixed_precision": "bf16"},
         "data": {"micro_batch_size": 1, "seq_len": 2048},
         "measure": {"warmup_steps": 2, "timed_steps": 5, "repeats": 3}},
        {"fsdp.activation_checkpointing": ["none", "block"]},
    ),
    "parity": (
        {"world_size": 1, "model": {"name": "small"},
         "data": {"micro_batch_size": 2, "seq_len": 256},
         "measure": {"warmup_steps": 1, "timed_steps": 3, "repeats": 2}},
        [{"fsdp.mixed_precision": ["fp32"], "train.fp32_matmul": ["ieee", "tf32"]},
         {"fsdp.mixed_precision": ["bf16"]}, {"fsdp.cpu_offload": [True]},
         {"strategy": ["ddp"]}],
    ),
    "failures": (
        {"world_size": 1, "model": {"name": "small"},
         "data": {"micro_batch_size": 2, "seq_len": 512},
         "measure": {"warmup_steps": 1, "timed_steps": 3, "repeats": 1}},
        [{"data.seed": [0, 1]}, {"fault.kind": ["oom"]}],
    ),
}  # fmt: skip
"""The grids of benchmarks/gpu_check.py's parts on a GPU, as that report ran them."""
MEASURED = {
    "allocated": "peak_memory_gib",
    "reserved": "peak_reserved_gib",
    "device-used": "device_used_peak_gib",
}


def _measured_apart(run: RunConfig, record: dict[str, Any]) -> str:
    """Why a measured run is not a fair test of the estimate, if it is not."""
    cublas_gib = CUBLAS_HANDLES * CUBLAS_WORKSPACE_SM90_BYTES / GIB
    leftover_gib = (record.get("allocated_at_start_gib") or 0) - cublas_gib
    if leftover_gib > 1 / 1024:  # more than cuBLAS's workspaces alive when it began
        return f"began with {leftover_gib * 1024:.1f} MiB of an earlier run alive"
    return ""


def _describe(run: RunConfig) -> str:
    parts = [run.strategy, run.fsdp.mixed_precision, f"AC {run.fsdp.activation_checkpointing}"]
    if run.fsdp.cpu_offload:
        parts.append("offload")
    if run.data.seed:
        parts.append(f"seed {run.data.seed}")
    return ", ".join(parts)


def print_table(title: str, rows: list[Compared]) -> None:
    print(title)
    print(f"{'':62s} {'quantity':11s} {'figure':>7s} {'estimate':>8s} {'error':>7s} "
          f"{'interval':>15s} {'in':>3s} {'+-%':>5s}")  # fmt: skip
    for row in rows:
        print(
            f"{row.label[:62]:62s} {row.quantity:11s} {row.figure_gib:7.2f} "
            f"{row.estimate_gib:8.2f} {row.error_pct:+6.1f}% "
            f"{row.low_gib:7.2f}-{row.high_gib:<7.2f} {'yes' if row.inside else 'NO':>3s} "
            f"{row.half_width_pct:5.1f}{'   apart: ' + row.apart if row.apart else ''}"
        )


def headline(name: str, rows: list[Compared]) -> None:
    """Coverage and widths over the rows in the headline; the errors once per run (its
    reserved figure where it has several)."""
    kept = [r for r in rows if not r.apart]
    if not kept:
        return
    widths = [r.half_width_pct for r in kept]
    per_run: dict[str, Compared] = {}
    for row in kept:
        if row.run_id not in per_run or row.quantity == "reserved":
            per_run[row.run_id] = row
    errors = [abs(r.error_pct) for r in per_run.values()]
    print(f"{name}: {sum(r.inside for r in kept)} of {len(kept)} figures inside their interval; "
          f"half-width median {statistics.median(widths):.1f}%, widest {max(widths):.1f}%; "
          f"|error| over {len(per_run)} runs median {statistics.median(errors):.1f}%, "
          f"worst {max(errors):.1f}%")  # fmt: skip
    apart = [r for r in rows if r.apart]
    if apart:
        print(f"  apart: {sum(r.inside for r in apart)} of {len(apart)} inside "
              f"({'; '.join(sorted({r.apart for r in apart}))})")  # fmt: skip


def fragmentation(name: str, rows: list[Compared], band: error_model.Band) -> None:
    """What each reserved figure says of the replay's fragmentation (reserved - allocated):
    measured over replayed, the evidence the error model's band was set from (in-sample)."""
    ratios = sorted(
        (r.figure_gib - r.allocated_gib) / (r.estimate_gib - r.allocated_gib)
        for r in rows
        if r.quantity == "reserved" and not r.apart and r.estimate_gib > r.allocated_gib
    )
    shown = ", ".join(f"{ratio:.2f}" for ratio in ratios)
    print(f"fragmentation, {name}: measured / replayed {shown}; the band: x "
          f"{1 - band.below:.2f}-{1 + band.above:.2f}")  # fmt: skip


def not_expressible() -> None:
    """The rows with no estimate, or one that leaves something of the run out, and why."""
    rows = [r for r in ROWS if r.missing]
    print(f"\nNot expressible or not modelled ({len(rows)} of {len(ROWS)} figures):")
    for row in rows:
        shown = "no estimate" if row.run is None else "estimated, apart"
        print(f"- {row.label}: {row.missing} ({shown})")


def sources() -> None:
    print("\nSources and inferred values:")
    for row in ROWS:
        inferred = f"; inferred: {row.inferred}" if row.inferred else ""
        missing = f"; not expressible: {row.missing}" if row.missing and row.run is None else ""
        print(f'- {row.label}: {row.source}, "{row.says}"{inferred}{missing}')


def world_size_table() -> None:
    """Llama-3-8B, bf16, block checkpointing, seq 8192, one sequence per rank."""
    print("\nLlama-3-8B, bf16, full AC, seq 8192, batch 1: the peak by world size (GiB/rank)")
    print(f"{'W':>4s} {'tensors':>8s} {'params':>7s} {'grads':>6s} {'optim':>6s} {'activ':>6s} "
          f"{'temp':>6s} {'reserved':>9s} {'dev-used':>9s}")  # fmt: skip
    for world_size in (8, 32, 128):
        run = _llama("llama3-8b", world_size, 8192, 1, "block")
        estimate = estimate_run(run, "cuda")
        parts = estimate.breakdown_gib
        prediction: Prediction = estimate.predict(Calibration(), run)
        print(
            f"{world_size:4d} {estimate.estimated_peak_gib:8.2f} {parts.get('parameter', 0):7.2f} "
            f"{parts.get('gradient', 0):6.2f} {parts.get('optimizer_state', 0):6.2f} "
            f"{parts.get('activation', 0):6.2f} {parts.get('temp', 0):6.2f} "
            f"{prediction.reserved_gib or 0:9.2f} {prediction.device_used_gib or 0:9.2f}"
        )


def main() -> int:
    published = published_rows()
    print_table("Published runs", published)
    compiled = {row.run.run_id for row in ROWS if row.run and row.run.train.compile != "none"}
    loss = {row.run.run_id for row in ROWS if row.run and row.run.train.compile_loss}
    headline("published, eager", [r for r in published if r.run_id not in compiled])
    headline(
        "published, compiled (simulated from the partition)",
        [r for r in published if r.run_id in compiled - loss],
    )
    headline(
        "published, the loss compiled too (fused as on CPU, the high end eager)",
        [r for r in published if r.run_id in loss],
    )
    measured = measured_rows()
    print()
    print_table(
        "Measured on an H200 (benchmarks/results/2026-12-04-h200-gpu-check-2.json)", measured
    )
    headline("measured", measured)
    print()
    fragmentation("torch >= 2.8 (measured)", measured, error_model.FRAGMENTATION)
    fragmentation("torch < 2.8 (published)", published, error_model.RECORDED_STREAMS)
    print(
        f"tensors: -{error_model.TENSORS.below:.0%} / +{error_model.TENSORS.above:.0%}; "
        f"compiled (partition): -{error_model.PARTITIONED.below:.0%} / "
        f"+{error_model.PARTITIONED.above:.0%}; compiled with TP (as eager): "
        f"-{error_model.COMPILED.below:.0%} / +{error_model.COMPILED.above:.0%}; "
        "the loss compiled on a GPU: up to the step with the loss eager"
    )
    not_expressible()
    sources()
    world_size_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
