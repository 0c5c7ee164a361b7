"""Does a parallel configuration train correctly? One step against a single-process reference.

Seed 000, section 12: one FSDP2 step over R ranks, each with its slice of the batch, must equal
one unsharded step on the whole batch. We compare full gradients (gathered with
`full_tensor()`) and the parameters after one SGD step. SGD, not AdamW: AdamW's first update is
about +-lr per element whatever the gradient's size, so a tiny gradient whose sign flips in the
last bit moves a parameter by 2*lr (measured: 5e-5 after one step); SGD shows the real error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_bench.config.fsdp import grouping_block_count
from fsdp_bench.config.run import RunConfig
from fsdp_bench.errors import one_line
from fsdp_bench.job.failures import classify
from fsdp_bench.job.model.zoo import ModelBundle, build_model
from fsdp_bench.job.parallel.float8 import convert_to_float8
from fsdp_bench.job.parallel.parallelize import materialize, parallelize
from fsdp_bench.job.rendezvous import RankInfo
from fsdp_bench.job.training import (
    autocast_dtype,
    build_loss,
    clip_gradients,
    forward_backward,
    fp32_matmul_precision,
    global_micro_batch,
    rank_batches,
    release,
)
from fsdp_bench.job.watchdog import Watchdog

# fp32: the seed's (rtol, atol), elementwise (measured differences were about 6e-9 for
# gradients, 1.2e-7 after SGD). bf16 compute against the fp32 reference: the relative L2 error
# over all parameters together. Not per parameter: a gradient that is mostly cancellation (the
# first norm weights) is mostly bf16 rounding, 15-70% off in either direction, even against a
# bf16 reference that sums in another order than two ranks do.
FP32_TOLERANCE = (1e-5, 1e-7)
# Tensor parallelism sums each row-parallel matmul's partial products, and the embedding's
# gradient rows, over the TP group in another order than one process does: measured on tiny
# at world size 4 (2 x 2), max abs difference 1.6e-7 (tok_embeddings' gradient), relative L2
# error 4.7e-7 against 2.6e-7 for FSDP2 alone; elementwise, ten times the seed's atol.
FP32_TP_TOLERANCE = (1e-5, 1e-6)
# TF32 matmuls keep a 10-bit mantissa (relative rounding ~5e-4 per product): elementwise
# tolerances are meaningless there too, so the same relative L2 rule as bf16, tighter.
# Float8 (against a single-process run of the same float8 model): each rank scales its own
# slice of the activations and output gradients, the reference the whole batch, so the two
# round them independently. e5m2 (output gradients) keeps 2 mantissa bits, an RMS relative
# rounding of 2^-3/sqrt(3) = 0.072; e4m3 (inputs) 0.036; a weight gradient's products carry
# sqrt(0.072^2 + 0.036^2) = 0.081, two independent roundings differ by sqrt(2) x 0.081 = 0.11.
# The bound is twice that; measured on tiny at world size 2, 3 seeds: 0.082-0.094 tensorwise
# (with or without float8 all-gather), 0.060-0.064 rowwise, 0.051-0.055 rowwise_with_gw_hp,
# against 0.008 for bf16 (tests/test_float8.py runs them).
REL_L2_BOUND = {"bf16": 5e-2, "tf32": 1e-2, "float8": 0.25}


VERIFY_AS_RUN_MAX_PARAMS = 50_000_000
"""Preset models up to this size are verified as they run; larger ones on a scaled copy."""


@dataclass(frozen=True)
class ParityReport:
    ok: bool | None
    """None: the check itself could not run (its reason in `detail`); the run is still timed."""
    grad_max_abs_diff: float | None
    param_max_abs_diff: float | None
    detail: str
    scope: str = "as run"
    """What was compared: the run's own model, or the scaled-down copy (its shape)."""
    dropout_off: bool = False
    """The model has dropout, and the check ran without it (timing keeps it)."""
    fp32_matmul_precision: str = ""
    """What fp32 matmuls ran as during the check (torch's highest / high), to be the run's."""


def verification_run(run: RunConfig) -> tuple[RunConfig, str]:
    """The run whose parity stands for `run`'s, and what it is.

    Every rank builds the whole fp32 reference and trains it on the global batch, so a large
    model verified as it runs fails as the check's own OOM. Its parallel configuration
    (world size, strategy, grouping, resharding, prefetch, precision, offload, accumulation)
    is what parity is about, and that a narrow, shallow copy keeps: 16-wide heads, the same
    ratio of query to key/value heads, the same FFN ratio, at most 4 blocks (2 groups of K
    for blocks:K), a 512-token vocabulary and sequences of at most 128 tokens; with tensor
    parallelism at least tp_size key/value heads."""
    if run.model.is_hf_model:
        return _shallow_hf_run(run)
    if run.model.is_user_model or run.model.shape.num_params <= VERIFY_AS_RUN_MAX_PARAMS:
        return run, "as run"
    shape = run.model.shape
    groups = shape.n_heads // shape.n_kv_heads  # query heads per key/value head
    n_kv_heads = max(run.tp_size, 4 // groups)  # tensor parallelism splits them
    n_heads = n_kv_heads * groups
    dim = n_heads * 16
    per_group = grouping_block_count(str(run.fsdp.grouping))
    n_layers = 2 * per_group if per_group else min(shape.n_layers, 4)
    ffn_dim = max(8, round(shape.ffn_dim / shape.dim * dim / 8) * 8)
    model = dataclasses.replace(
        run.model, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim, vocab_size=min(shape.vocab_size, 512),
    )  # fmt: skip
    data = dataclasses.replace(
        run.data,
        seq_len=min(run.data.seq_len, 128),
        micro_batch_size=min(run.data.micro_batch_size, 2),
    )
    scaled = dataclasses.replace(run, model=model, data=data)
    scope = (
        f"a scaled-down copy: dim {dim}, {n_layers} blocks, {n_heads} heads "
        f"({n_kv_heads} key/value), ffn {ffn_dim}, vocab {model.vocab_size}, "
        f"seq {data.seq_len}"
    )
    return scaled, scope


def _shallow_hf_run(run: RunConfig) -> tuple[RunConfig, str]:
    """A transformers model verified with at most 4 blocks (2 groups of K for blocks:K), as
    wide as it runs; its shape is the model's own business, its depth is not parity's."""
    from fsdp_bench.job.model.hf import num_hidden_layers

    layers = num_hidden_layers(run.model)
    per_group = grouping_block_count(str(run.fsdp.grouping))
    keep = 2 * per_group if per_group else 4
    if layers is None or layers <= keep:
        return run, "as run"
    overrides = {**run.model.hf_overrides, "num_hidden_layers": keep}
    model = dataclasses.replace(run.model, hf_overrides=overrides)
    return dataclasses.replace(run, model=model), f"a shallower copy: {keep} of {layers} blocks"


def check_parity(run: RunConfig, mesh: DeviceMesh, device: torch.device, rank: int) -> ParityReport:
    run = dataclasses.replace(run, train=dataclasses.replace(run.train, optimizer="sgd"))
    torch.manual_seed(run.data.seed)
    model, _ = parallelize(build_model(run.model, device.type), run, mesh, device)
    start = {_plain_name(n): _full(p).clone() for n, p in model.named_parameters()}

    reference_bundle = _reference(run, device)
    reference = reference_bundle.module
    dropout_off = has_dropout(reference)
    if dropout_off:  # no sharded run can repeat one process's dropout masks (seed 000, 12)
        model.eval()
        reference.eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(start[name])
    bf16 = run.fsdp.mixed_precision == "bf16"  # FSDP2's policy, or autocast under DDP
    stored_bf16 = run.model.dtype == "bf16"  # the reference is bf16 too: no fp32 master
    precision = _precision(run, device)

    batches = rank_batches(run, rank, reference_bundle.vocab_size, device)
    tp = run.tp_size > 1  # the logits split by vocabulary, the loss under loss_parallel
    loss = build_loss(run)  # the run's own loss, compiled where it asks
    forward_backward(model, batches, run.train.grad_sync, None, autocast_dtype(run), None, tp,
                     loss=loss)()  # fmt: skip
    global_batches = [
        tuple(t.to(device) for t in global_micro_batch(run, k, reference_bundle.vocab_size))
        for k in range(run.train.accumulation_steps)
    ]
    forward_backward(reference, global_batches, "every")()  # type: ignore[arg-type]
    if run.train.max_grad_norm is not None:  # the total norm over every rank's shards
        clip_gradients(list(model.parameters()), run.train.max_grad_norm, foreach=True)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), run.train.max_grad_norm)

    grads = {
        _plain_name(n): None if p.grad is None else _full(p.grad)
        for n, p in model.named_parameters()
    }
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    tolerance = FP32_TP_TOLERANCE if tp else FP32_TOLERANCE
    grad_ok, grad_diff, grad_detail = _compare(grads, ref_grads, precision, tolerance)

    lr = run.train.learning_rate
    _sgd_step(model, lr)
    params = {_plain_name(n): _full(p) for n, p in model.named_parameters()}
    if bf16 and not stored_bf16:  # the fp32 shards must have moved by -lr x the gradient
        params = {n: p - start[n] for n, p in params.items()}
        ref_params = {n: -lr * g for n, g in ref_grads.items() if g is not None}
    else:
        _sgd_step(reference, lr)
        ref_params = {n: p.detach() for n, p in reference.named_parameters()}
    param_ok, param_diff, param_detail = _compare(params, ref_params, precision, tolerance)
    return ParityReport(
        ok=grad_ok and param_ok,
        grad_max_abs_diff=grad_diff,
        param_max_abs_diff=param_diff,
        detail="; ".join(d for d in (grad_detail, param_detail) if d),
        dropout_off=dropout_off,
        fp32_matmul_precision=fp32_matmul_precision(),
    )


def _precision(run: RunConfig, device: torch.device) -> str:
    """Which tolerance the comparison takes: REL_L2_BOUND's key, or fp32 (elementwise)."""
    if run.train.float8 != "none":
        return "float8"
    if run.fsdp.mixed_precision == "bf16" or run.fsdp.reduce_dtype == "bf16":
        return "bf16"
    return "tf32" if device.type == "cuda" and run.train.fp32_matmul == "tf32" else "fp32"


def _reference(run: RunConfig, device: torch.device) -> ModelBundle:
    """The single-process model, materialised; with float8, the same float8 model (its
    weights cast from high precision, as an all-gather in bf16 would give them)."""
    bundle = build_model(run.model, device.type)
    if run.train.float8 != "none":
        convert_to_float8(bundle.module, bundle.blocks, run.train.float8, False, device.type)
    materialize(bundle.module, device)
    return bundle


def has_dropout(model: nn.Module) -> bool:
    """Dropout modules with p > 0, or a model config asking for dropout (transformers models
    whose attention applies it functionally while training)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        settings = getattr(getattr(module, "config", None), "__dict__", {})
        if any(
            ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0
            for key, value in settings.items()
        ):
            return True
    return False


def _sgd_step(model: nn.Module, lr: float) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    optimizer.step()


def _compare(
    got: Mapping[str, torch.Tensor | None],
    want: Mapping[str, torch.Tensor | None],
    precision: str,
    tolerance: tuple[float, float] = FP32_TOLERANCE,
) -> tuple[bool, float, str]:
    """(within tolerance, max abs difference, what failed first); `tolerance`: fp32's
    elementwise (rtol, atol)."""
    if got.keys() != want.keys():
        return False, float("inf"), f"parameter names differ: {sorted(got.keys() ^ want.keys())}"
    worst = 0.0
    failures = []
    diff_sq = want_sq = 0.0
    for name, expected in want.items():
        actual = got[name]
        if actual is None or expected is None:
            if actual is not expected:
                failures.append(f"{name}: gradient missing on one side")
            continue
        # on one device: offloaded shards are gathered on the CPU, the reference is not
        actual, expected = actual.float().cpu(), expected.float().cpu()
        diff = (actual - expected).abs()
        worst = max(worst, diff.max().item())
        diff_sq += diff.square().sum().item()
        want_sq += expected.square().sum().item()
        rtol, atol = tolerance
        if precision == "fp32" and not torch.allclose(actual, expected, rtol=rtol, atol=atol):
            failures.append(f"{name}: max abs diff {diff.max().item():.2e}")
    if precision in REL_L2_BOUND:
        relative = (diff_sq / max(want_sq, 1e-30)) ** 0.5
        if relative > REL_L2_BOUND[precision]:
            failures.append(f"relative L2 error {relative:.2e} > {REL_L2_BOUND[precision]}")
    return not failures, worst, failures[0] if failures else ""


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a sharded DTensor is all-gathered)."""
    if isinstance(tensor, DTensor):
        return tensor.full_tensor().detach()
    return tensor.detach()


def _plain_name(name: str) -> str:
    """Parameter names without wrapper prefixes (activation checkpointing, DDP)."""
    name = name.replace("_checkpoint_wrapped_module.", "")
    return name[len("module.") :] if name.startswith("module.") else name


def verify_on_every_rank(
    run: RunConfig,
    mesh: DeviceMesh,
    device: torch.device,
    info: RankInfo,
    watchdog: Watchdog | None = None,
    allowance_s: float = 0.0,
) -> dict[str, Any]:
    """The parity check of a run (on a scaled-down copy for large models), as plain data. Its
    own failure (an error, an OOM of the reference) is reported in the record, never the
    run's status: every rank learns whether any rank's check failed. `watchdog` is armed for
    `allowance_s` meanwhile."""
    checked, scope = verification_run(run)
    if watchdog is not None:
        watchdog.arm("the parity check", allowance_s)
    report = None
    try:
        report = check_parity(checked, mesh, device, info.rank)
        failure = ""
    except Exception as err:  # reported, not raised: see the docstring
        failure = f"rank {info.rank}: {classify(err)}: {one_line(err, 300)}"
    release(device)
    failures: list[str | None] = [None] * info.world_size
    dist.all_gather_object(failures, failure)
    if watchdog is not None:
        watchdog.disarm()
    failed = [f for f in failures if f]
    if failed or report is None:
        detail = "the parity check itself failed (the run is still timed): " + "; ".join(failed)
        report = ParityReport(None, None, None, detail)
    if report.dropout_off:
        scope += "; dropout off"
    return dataclasses.asdict(dataclasses.replace(report, scope=scope))
