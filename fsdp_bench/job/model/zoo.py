"""The model zoo: a Llama-style decoder, user models by import path, transformers models.

Models are built with their parameters on the meta device (no memory), sharded, then
materialised with `to_empty` and initialised (seed 000, section 11): no rank ever holds a full
copy of a large model. Buffers are built for real on the CPU (rotary tables, causal masks:
small, and computed in constructors that nothing re-runs) and carried through `to_empty`.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.presets import ModelShape
from fsdp_bench.config.run import RunConfig
from fsdp_bench.errors import ConfigError


@dataclass
class ModelBundle:
    """What fsdp-bench needs to know about a model; a user's function returns one.

    The module maps token ids (batch, seq) to logits (batch, seq, vocab_size).
    """

    module: nn.Module
    blocks: list[nn.Module]
    """The repeated units in forward order (transformer blocks): the `block` grouping unit."""
    vocab_size: int
    flops_per_token: Callable[[int], float] | None = None
    """Training FLOPs per token for a sequence length (for MFU); None: counted on fake
    tensors before launch."""
    init: Callable[[nn.Module], None] | None = None
    """Initialises the materialised (sharded) module in place; None: `default_init`."""
    tp_plan: dict[str, Any] | None = None
    """For tensor parallelism (`tp_size`): `parallelize_module`'s plan over `module`, module
    names (`*` matches any) -> ParallelStyle. The module's attention must reshape with -1
    heads (a rank computes its share). None: no plan (presets and transformers models have
    their own)."""

    @property
    def blocks_path(self) -> str | None:
        """Where the blocks live in the module, as one list of them (`model.layers` in a
        Llama of transformers, `transformer.h` in GPT-2): the generated `fully_shard` code
        loops over it. None when they are not the whole of one list."""
        names = {id(m): n for n, m in self.module.named_modules()}
        holders = {names.get(id(b), "").rpartition(".")[0] for b in self.blocks}
        if len(holders) != 1 or "" in holders:
            return None
        holder = holders.pop()
        listed = self.module.get_submodule(holder)
        return holder if list(listed.children()) == list(self.blocks) else None


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, device_type: str = "cpu") -> None:
        super().__init__()
        self.repeat_fp32_gqa = device_type == "cuda"  # see attention_inputs
        self.n_heads = shape.n_heads
        self.n_kv_heads = shape.n_kv_heads
        self.head_dim = shape.head_dim
        self.wq = nn.Linear(shape.dim, shape.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(shape.dim, shape.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(shape.dim, shape.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(shape.n_heads * self.head_dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism a rank computes its share of them
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k, v, gqa = attention_inputs(q, k, v, self.repeat_fp32_gqa)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, repeat_fp32_gqa: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(q, k, v, enable_gqa) for SDPA, heads on dim 1. For CUDA (`repeat_fp32_gqa`), fp32 GQA
    inputs get K/V repeated to every query head: SDPA's memory-efficient kernel takes fp32
    but not enable_gqa, and the math fallback is quadratic in memory and several times
    slower; bf16 keeps enable_gqa (flash takes it). Decided by the device the model is built
    for, not the tensors' own: the memory simulation runs a CUDA run's step on CPU tensors
    and must allocate the repeated K/V as the GPU will."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return q, k, v, False
    if repeat_fp32_gqa and q.dtype == torch.float32:
        return q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), False
    return q, k, v, True


def attention_backend(
    shape: ModelShape, seq_len: int, dtype: torch.dtype, device: torch.device
) -> str:
    """The SDPA kernel the preset's attention gets for this dtype and device (FLASH_ATTENTION,
    EFFICIENT_ATTENTION, CUDNN_ATTENTION, MATH), asked of torch's own dispatcher on a sample
    of one sequence (at most 256 tokens: the choice depends on dtype, head size and GQA)."""
    from torch.nn.attention import SDPBackend

    seq = min(seq_len, 256)
    q = torch.zeros(1, shape.n_heads, seq, shape.head_dim, dtype=dtype, device=device)
    k = torch.zeros(1, shape.n_kv_heads, seq, shape.head_dim, dtype=dtype, device=device)
    q, k, v, gqa = attention_inputs(q, k, k, device.type == "cuda")
    choice = torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=gqa)
    return str(SDPBackend(choice).name)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, shape: ModelShape, device_type: str = "cpu") -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.attention = Attention(shape, device_type)
        self.ffn_norm = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.feed_forward = FeedForward(shape.dim, shape.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Llama-style decoder; `output` shares `tok_embeddings.weight` when tie_embeddings is set.
    `device_type`: where it will run (its attention's kernel choice, `attention_inputs`)."""

    def __init__(self, shape: ModelShape, device_type: str = "cpu") -> None:
        super().__init__()
        self.shape = shape
        self.tok_embeddings = nn.Embedding(shape.vocab_size, shape.dim)
        self.layers = nn.ModuleList(
            TransformerBlock(shape, device_type) for _ in range(shape.n_layers)
        )
        self.norm = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.output = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        cos, sin = _rope_tables(self.shape, tokens.shape[1], x.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic given the torch seed; works on sharded (DTensor) parameters too."""
        std = 0.02
        nn.init.normal_(self.tok_embeddings.weight, std=1.0 if self.shape.tie_embeddings else std)
        if self.shape.tie_embeddings:
            self.tok_embeddings.weight.mul_(std)
        depth_std = std / math.sqrt(2 * self.shape.n_layers)
        blocks = [m for m in self.modules() if isinstance(m, TransformerBlock)]  # even if wrapped
        for layer in blocks:
            for linear in (layer.attention.wq, layer.attention.wk, layer.attention.wv):
                nn.init.normal_(linear.weight, std=std)
            for linear in (layer.feed_forward.w1, layer.feed_forward.w3):
                nn.init.normal_(linear.weight, std=std)
            nn.init.normal_(layer.attention.wo.weight, std=depth_std)
            nn.init.normal_(layer.feed_forward.w2.weight, std=depth_std)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        if not self.shape.tie_embeddings:
            nn.init.normal_(self.output.weight, std=self.shape.dim**-0.5)


def _rope_tables(shape: ModelShape, seq_len: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Rotary cos/sin tables (seq, 1, head_dim/2); cheap next to the blocks, so not cached."""
    half = shape.head_dim // 2
    freqs = 1.0 / (shape.rope_theta ** (torch.arange(half, device=device) / half))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


def build_model(config: ModelConfig, device_type: str = "cpu") -> ModelBundle:
    """Build the model with its parameters on the meta device (no memory is allocated), for
    a run on `device_type` (a preset's attention chooses its kernel inputs by it), its
    parameters in `model.dtype`."""
    with parameters_on_meta():
        if config.is_hf_model:
            from fsdp_bench.job.model.hf import build_hf_model  # transformers: only when asked for

            module, blocks, vocab_size = build_hf_model(config)
            bundle = ModelBundle(module=module, blocks=blocks, vocab_size=vocab_size)
        elif config.is_user_model:
            bundle = _call_user_model(config)
        else:
            shape = config.shape
            model = Transformer(shape, device_type)
            bundle = ModelBundle(
                module=model,
                blocks=list(model.layers),
                vocab_size=shape.vocab_size,
                flops_per_token=shape.flops_per_token,
            )
    if config.dtype == "bf16":
        store_parameters_in(bundle.module, torch.bfloat16)
    return bundle


def store_parameters_in(module: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point parameters in `dtype`, ties kept; buffers as they are (rotary tables
    stay fp32, as transformers keeps them in a bf16 model)."""
    converted: dict[int, nn.Parameter] = {}
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is None or not param.is_floating_point():
                continue
            if id(param) not in converted:
                converted[id(param)] = nn.Parameter(
                    param.detach().to(dtype), requires_grad=param.requires_grad
                )
            owner._parameters[name] = converted[id(param)]


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device as it is registered;
    buffers stay real. (`torch.device("meta")` would make buffers meta too, and a rotary
    table or causal mask computed in a constructor is then lost: `to_empty` leaves garbage.)
    A parameter is allocated uninitialised for an instant, one at a time; its constructor's
    own initialisation then runs on meta, for free."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = param.to("meta")  # a tie made later still points at this one object
            module._parameters[name] = type(param)(meta, requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@torch.no_grad()
def initialize(bundle: ModelBundle, module: nn.Module) -> None:
    """Initialise the materialised `module` (the bundle's, possibly wrapped) as the bundle says.
    Every floating-point parameter is NaN first, so one that no init covers is NaN, always
    (`check_finite` finds it), not whatever the allocator left there, often finite."""
    for param in module.parameters():
        if param.is_floating_point():
            param.fill_(float("nan"))
    (bundle.init or default_init)(module)


@torch.no_grad()
def default_init(module: nn.Module) -> None:
    """The model's own `init_weights` where a submodule has one (the outermost; transformers
    models: their `_init_weights` for every module, then the weight ties), and for every module
    outside those what its constructor ran: `reset_parameters`, or `_reset_parameters` (torch's
    MultiheadAttention and Transformer), children before parents as constructors finish."""
    owners: list[tuple[nn.Module, Callable[[], None]]] = []
    covered: set[int] = set()
    for sub in module.modules():  # parents before children
        init = getattr(sub, "init_weights", None)
        if id(sub) not in covered and callable(init):
            owners.append((sub, init))
            covered.update(id(m) for m in sub.modules())
    for sub in reversed(list(module.modules())):  # each child before its parent
        reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
        if id(sub) not in covered and callable(reset):
            reset()
    for owner, init in owners:
        _forget_hf_marks(owner)
        init()
        owner.__dict__.pop("is_custom_code", None)


def _forget_hf_marks(model: nn.Module) -> None:
    """transformers marks what it initialised (on meta, while building) and skips it later.
    It also takes FSDP2's subclass of the model's class (FSDP<Name>) for remote code, and then
    skips every module without parameters of its own (GPT-2's attention and MLP, whose
    `_init_weights` narrows their output projections): nothing here was loaded, so say it is
    not."""
    for item in (*model.modules(), *model.parameters(), *model.buffers()):
        item.__dict__.pop("_is_hf_initialized", None)
    if callable(getattr(model, "is_custom_code", None)):
        model.__dict__["is_custom_code"] = lambda: False


def check_finite(module: nn.Module) -> list[str]:
    """Names of the parameters and buffers holding NaN or Inf (this rank's shards)."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return [
        name
        for name, tensor in named
        if tensor.is_floating_point() and not bool(torch.isfinite(_local(tensor)).all())
    ]


def check_initialised(config: ModelConfig, model: nn.Module, world_size: int) -> None:
    """Fail the run (every rank alike) when initialisation left NaN or Inf anywhere: the
    timed steps would compute on garbage."""
    found: list[list[str] | None] = [None] * world_size
    dist.all_gather_object(found, check_finite(model))
    bad = sorted({name for names in found for name in names or ()})
    if bad:
        raise ConfigError(
            f"model.name: {config.name}: after initialisation {', '.join(bad[:3])}"
            f"{f' (and {len(bad) - 3} more)' if len(bad) > 3 else ''} hold NaN or Inf; "
            "the model's init does not cover them (give ModelBundle an init)"
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def logits_of(output: object) -> torch.Tensor:
    """The logits a model returned: the tensor itself, or a transformers output's `.logits`."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(
        f"the model returned {type(output).__name__}: expected logits (batch, seq, vocab) "
        "or an object with .logits"
    )


def load_user_model_function(name: str) -> Callable[..., ModelBundle]:
    """Import `package.module:function`; a clear error when it is not there."""
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"model.name: {name}: cannot import {module_name!r} ({err})") from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise ConfigError(f"model.name: {name}: {module_name!r} has no function {attr!r}")
    return function


def _call_user_model(config: ModelConfig) -> ModelBundle:
    bundle = load_user_model_function(config.name)(**config.options)
    if not isinstance(bundle, ModelBundle):
        raise ConfigError(
            f"model.name: {config.name}: returned {type(bundle).__name__}, "
            "expected fsdp_bench.ModelBundle(module=..., blocks=[...], vocab_size=...)"
        )
    return bundle


def sdpa_backend(run: RunConfig, device: torch.device) -> str | None:
    """The attention kernel of a preset model in the run's compute dtype (None: not a
    preset, whose attention is the user's)."""
    if run.model.is_user_model:
        return None
    dtype = torch.bfloat16 if run.fsdp.mixed_precision == "bf16" else torch.float32
    return attention_backend(run.model.shape, run.data.seq_len, dtype, device)
