"""The training step that is timed, and the synthetic data it eats.

The step is what a user's training loop does per optimizer step and nothing else: K
micro-batches of forward + backward (gradient sync only where the run asks for it), then the
optimizer step.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._guards import detect_fake_mode
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel

from fsdp_bench.config.run import RunConfig
from fsdp_bench.errors import ConfigError, one_line
from fsdp_bench.job.model.zoo import logits_of
from fsdp_bench.job.parallel.float8 import scale_precompute

Batch = tuple[torch.Tensor, torch.Tensor]
Mark = Callable[[str], AbstractContextManager[object]]
"""Wraps each phase of a step ("forward", "backward", "optimizer"), e.g. record_function."""
LossFn = Callable[[object, torch.Tensor], torch.Tensor]
MicroBatchFn = Callable[[torch.Tensor, torch.Tensor], None]
CompileBackend = str | Callable[..., Any] | None
"""What torch.compile compiles with: inductor in a run; None: nothing compiled."""


def global_micro_batch(run: RunConfig, index: int, vocab_size: int) -> Batch:
    """Micro-batch `index` of the whole world (dp_size x micro_batch_size rows), on CPU.

    Every rank can build the same global batch from the seed, so a single-process reference
    can be fed exactly what the ranks saw together (parity checks).
    """
    generator = torch.Generator().manual_seed(run.data.seed * 1_000_003 + index)
    rows = run.dp_size * run.data.micro_batch_size
    tokens = torch.randint(0, vocab_size, (rows, run.data.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def rank_batches(run: RunConfig, rank: int, vocab_size: int, device: torch.device) -> list[Batch]:
    """This rank's contiguous slice of each of the step's micro-batches, on its device: the
    slice of its data-parallel rank (the ranks of a tensor-parallel group, consecutive,
    share one)."""
    b = run.data.micro_batch_size
    dp_rank = rank // run.tp_size
    batches = []
    for index in range(run.train.accumulation_steps):
        inputs, targets = global_micro_batch(run, index, vocab_size)
        rows = slice(dp_rank * b, (dp_rank + 1) * b)
        batches.append((inputs[rows].to(device), targets[rows].to(device)))
    return batches


def loss_fn(output: object, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a model's output (logits, or an object with `.logits`)."""
    return _cross_entropy(logits_of(output), targets)


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_loss(run: RunConfig, compile_backend: CompileBackend = "inductor") -> LossFn:
    """`loss_fn`, its cross-entropy compiled with `compile_backend` when the run compiles the
    loss (`train.compile_loss`; the memory simulation passes its own backend, None where it
    runs the run eagerly)."""
    if not run.train.compile_loss or compile_backend is None:
        return loss_fn
    compiled = torch.compile(_cross_entropy, backend=compile_backend)

    def compiled_loss(output: object, targets: torch.Tensor) -> torch.Tensor:
        return compiled(logits_of(output), targets)

    return compiled_loss


def synchronize(device: torch.device) -> None:
    """Wait until the device has run everything queued (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_fp32_matmul(run: RunConfig, device: torch.device) -> None:
    """TF32 or full fp32 matmuls on CUDA, as the run asks. Through the one public setting,
    `torch.set_float32_matmul_precision`, which torch >= 2.9 maps onto its per-backend
    `fp32_precision` without mixing in the legacy `allow_tf32` flags (mixing them raises)."""
    if device.type == "cuda":
        precision = "high" if run.train.fp32_matmul == "tf32" else "highest"
        torch.set_float32_matmul_precision(precision)


def set_allocator(run: RunConfig, device: torch.device) -> None:
    """CUDA's caching allocator as the run asks (`train.expandable_segments`), switched at run
    time (torch.cuda.memory._set_allocator_settings, what PYTORCH_CUDA_ALLOC_CONF sets at
    start): blocks of the other kind left from an earlier run are not reused, and `release`
    empties the cache between runs anyway."""
    if device.type == "cuda":
        value = "True" if run.train.expandable_segments else "False"
        torch.cuda.memory._set_allocator_settings(f"expandable_segments:{value}")


def fp32_matmul_precision() -> str:
    """What fp32 matmuls run as now: highest (full fp32), high (TF32) or medium (bf16)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:  # a mix of the new and legacy settings made elsewhere
        return "unknown"


def build_optimizer(model: nn.Module, run: RunConfig) -> torch.optim.Optimizer:
    """Created after sharding, so it holds (and updates) the local shards only, with the
    implementation `train.optimizer_impl` names (foreach is torch's default on GPU)."""
    params = list(model.parameters())
    lr = run.train.learning_rate
    impl = run.train.optimizer_impl
    foreach, fused = impl == "foreach", impl == "fused"
    try:
        match run.train.optimizer:
            case "adamw":
                return torch.optim.AdamW(params, lr=lr, foreach=foreach, fused=fused)
            case "sgd":
                return torch.optim.SGD(params, lr=lr, foreach=foreach, fused=fused)
            case other:
                raise ValueError(f"optimizer {other!r}")
    except RuntimeError as err:  # e.g. a fused kernel this device has not
        raise ConfigError(
            f"train.optimizer_impl: {impl} is not available for {run.train.optimizer} on "
            f"{params[0].device.type if params else 'this device'} here ({one_line(err, 160)}); "
            "expected foreach or for_loop"
        ) from None


def forward_backward(
    model: nn.Module,
    batches: list[Batch],
    grad_sync: str,
    before_micro_batch: Callable[[], None] | None = None,
    autocast: torch.dtype | None = None,
    mark: Mark | None = None,
    sharded_logits: bool = False,
    reshard_after_backward: str = "every",
    loss: LossFn = loss_fn,
) -> Callable[[], None]:
    """The step's micro-batches: forward and backward, loss scaled by 1/K; what only the last
    one does (`_last_micro_batch_switches`) switched on or off before each.

    `autocast` is mixed precision for models that FSDP2's MixedPrecisionPolicy does not
    handle (the DDP baseline); `mark` wraps each forward and each backward (a profiled step
    only: the timed loop runs the closure without it). `sharded_logits`: the model returns
    logits split over the vocabulary (tensor parallelism), and the loss and its backward run
    under `loss_parallel`, which never gathers them (torchtitan's loss parallel)."""
    count = len(batches)
    last_only = _last_micro_batch_switches(model, count, grad_sync, reshard_after_backward)

    def loss_of(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # No name for the logits: held through backward they would add their full size.
        return loss(model(inputs), targets)

    if autocast is not None:  # decided once here, not in every micro-batch of the timed loop
        plain_loss, device_type = loss_of, batches[0][0].device.type

        def loss_of(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device_type, dtype=autocast):
                return plain_loss(inputs, targets)

    around = loss_parallel if sharded_logits else contextlib.nullcontext

    def micro_batch(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        (loss_of(inputs, targets) / count).backward()

    def marked_micro_batch(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        assert mark is not None
        with around():
            with mark("forward"):
                scaled = loss_of(inputs, targets) / count
            with mark("backward"):
                scaled.backward()

    one: MicroBatchFn = marked_micro_batch if mark is not None else micro_batch
    if mark is None and sharded_logits:  # decided once, as autocast: nothing more per step
        one = _under_loss_parallel(micro_batch)

    def run_micro_batches() -> None:
        for index, (inputs, targets) in enumerate(batches):
            if before_micro_batch is not None:
                before_micro_batch()
            for switch in last_only:
                switch(index == count - 1)
            one(inputs, targets)

    return run_micro_batches


def _last_micro_batch_switches(
    model: nn.Module, count: int, grad_sync: str, reshard_after_backward: str
) -> list[Callable[[bool], None]]:
    """What is on for the last of `count` micro-batches only, each switched before every one."""
    switches: list[Callable[[bool], None]] = []
    if count > 1 and grad_sync == "last":
        switches.append(functools.partial(_set_gradient_sync, model))
    if count > 1 and isinstance(model, FSDPModule):
        if grad_sync == "all_reduce_last":
            switches.append(model.set_requires_all_reduce)
        if reshard_after_backward == "last":
            switches.append(model.set_reshard_after_backward)
    return switches


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors (moments, step counts where tensors), every parameter's."""
    return [
        value
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    ]


def autocast_dtype(run: RunConfig) -> torch.dtype | None:
    """bf16 autocast for the DDP baseline in bf16 (FSDP2 casts through its own policy)."""
    if run.strategy == "ddp" and run.fsdp.mixed_precision == "bf16":
        return torch.bfloat16
    return None


def _under_loss_parallel(micro_batch: MicroBatchFn) -> MicroBatchFn:
    def wrapped(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        with loss_parallel():
            micro_batch(inputs, targets)

    return wrapped


def make_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[Batch],
    run: RunConfig,
    before_micro_batch: Callable[[], None] | None = None,
    mark: Mark | None = None,
    compile_backend: CompileBackend = "inductor",
) -> Callable[[], None]:
    """One optimizer step as a closure: the exact code the timed loop runs (with `mark`,
    the same step with each phase wrapped, for a profiled step). With float8 all-gather, the
    step ends by computing the next gathers' scales; not under fake tensors (the memory
    simulation), where torchao 0.18 cannot (a DTensor's truth value in its flatten).
    `compile_backend` compiles the loss where the run asks (`build_loss`)."""
    micro_batches = forward_backward(
        model, batches, run.train.grad_sync, before_micro_batch, autocast_dtype(run), mark,
        sharded_logits=run.tp_size > 1,
        reshard_after_backward=run.fsdp.reshard_after_backward,
        loss=build_loss(run, compile_backend),
    )  # fmt: skip

    max_norm = run.train.max_grad_norm
    params = [p for group in optimizer.param_groups for p in group["params"]]
    foreach = run.train.optimizer_impl != "for_loop"

    precompute = (
        scale_precompute(model)
        if run.fsdp.float8_all_gather and detect_fake_mode() is None
        else None
    )

    def update() -> None:
        if max_norm is not None:
            clip_gradients(params, max_norm, foreach)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if precompute is not None:
            precompute()

    def train_step() -> None:
        micro_batches()
        update()

    def marked_train_step() -> None:
        assert mark is not None
        micro_batches()
        with mark("optimizer"):
            update()

    return train_step if mark is None else marked_train_step


def clip_gradients(params: list[torch.Tensor], max_norm: float, foreach: bool) -> None:
    """Scale the gradients so their total 2-norm is at most `max_norm`. The shards' norms
    are summed over the ranks by one all-reduce (their DTensor is partial until then), as
    every rank must scale by the same factor."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, foreach=foreach)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)


def _set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    elif isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = enabled


def release(device: torch.device) -> None:
    """Free what the last run built, so the next one starts from the same state (checked:
    each record carries the memory still allocated when its run began)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        empty_host_cache()  # pinned host blocks (CPU offload's buffers)
        torch.cuda.reset_peak_memory_stats(device)


def empty_host_cache() -> None:
    """Return the pinned host blocks the caching host allocator keeps to the system. The
    public `torch.accelerator.empty_host_cache` is newer than torch 2.11, which has only the
    private `torch._C._host_emptyCache`; with neither, nothing is freed (and nothing fails)."""
    empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(
        torch._C, "_host_emptyCache", None
    )
    if empty is not None:
        empty()
