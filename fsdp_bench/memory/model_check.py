"""Each distinct model of a grid, built and stepped once on fake tensors before anything
launches: the model contract checked, and the training FLOPs per token counted for MFU.

A model that cannot be imported, whose function raises or returns something else than a
`ModelBundle`, whose blocks are not its submodules, whose output is not logits of shape
(batch, seq, vocab), or whose init leaves a parameter NaN (`check_init`), stops the grid with
one line naming `model.name`, before any job starts.
Presets are ours and tested: they are neither built nor counted here (their FLOPs come from
`ModelShape.flops_per_token`).

FLOPs are counted by `torch.utils.flop_counter.FlopCounterMode` over the forward and backward
of one sequence (matrix products and attention; activation-checkpointing recomputation is not
counted, since the model is counted unwrapped: MFU measures useful work, as for presets).
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_bench.config.fsdp import FsdpConfig
from fsdp_bench.config.model import ModelConfig
from fsdp_bench.config.run import RunConfig
from fsdp_bench.config.schema import to_plain
from fsdp_bench.errors import CombinationError, ConfigError, one_line
from fsdp_bench.memory.pool import in_subprocesses
from fsdp_bench.store import Flops

FORMULA = "formula: 6 x matmul params + 12 x layers x dim x seq (PaLM)"
OWN_FORMULA = "the model's own flops_per_token"
COUNTED = "counted: FlopCounterMode, forward + backward on fake tensors"


@dataclass(frozen=True)
class ModelFacts:
    """What building and stepping a model once showed."""

    flops_per_token: dict[int, float]
    """Sequence length -> training FLOPs per token."""
    flops_source: str
    num_params: int
    num_blocks: int
    blocks_path: str | None = None
    """`ModelBundle.blocks_path`: for the generated fully_shard code."""
    tp_refusal: str = ""
    """Why the model cannot run with tp_size > 1 (no plan, a tied output projection); ""
    when it can."""
    tp_sizes: dict[str, int] = field(default_factory=dict)
    """What tp_size must divide (a transformers model's heads, key/value heads, MLP width,
    vocabulary)."""


_checked: dict[str, ModelFacts] = {}
"""Facts by model key (its settings and source digest), for the life of the driver process."""


def run_flops(runs: list[RunConfig], *, in_this_process: bool = False) -> dict[str, Flops]:
    """run_id -> FLOPs per token and where the figure came from; every distinct non-preset
    model is checked first (a `ConfigError` for the first one that breaks the contract).
    `in_this_process`: for a rank, itself a fresh process that imports the user's code."""
    facts = check_models(runs, in_this_process=in_this_process)
    out = {}
    for run in runs:
        seq = run.data.seq_len
        if run.model.is_user_model:
            found = facts[run.run_id]
            out[run.run_id] = Flops(found.flops_per_token[seq], found.flops_source)
        else:
            out[run.run_id] = Flops(run.model.shape.flops_per_token(seq), FORMULA)
    return out


def check_models(
    runs: list[RunConfig], *, again: bool = False, in_this_process: bool = False
) -> dict[str, ModelFacts]:
    """run_id -> the facts of its model, for the runs of non-preset models: each distinct
    model checked once at its sequence lengths, in fresh processes (torch and the user's code
    stay out of the driver, which would keep the module as first imported). `again`: check
    even the models this process checked before (a rerun)."""
    digests = source_digests(runs)
    key_of = {
        run.run_id: _key(run.model, digests[run.model.name])
        for run in runs
        if run.model.is_user_model
    }
    wanted: dict[str, tuple[ModelConfig, set[int]]] = {}
    for run in runs:
        if run.run_id in key_of:
            wanted.setdefault(key_of[run.run_id], (run.model, set()))[1].add(run.data.seq_len)
    missing = {
        key: (model, sorted(seqs))
        for key, (model, seqs) in wanted.items()
        if again or key not in _checked or not seqs <= _checked[key].flops_per_token.keys()
    }
    items = list(missing.values())
    if in_this_process:
        outcomes = {index: check_model(item) for index, item in enumerate(items)}
    else:
        outcomes = dict(in_subprocesses(check_model, items, user_code=True))
    for index, key in enumerate(missing):
        outcome = outcomes[index]
        if isinstance(outcome, str):
            raise ConfigError(outcome)
        _checked[key] = outcome
    facts = {run_id: _checked[key] for run_id, key in key_of.items()}
    for run in runs:
        if run.tp_size > 1 and run.run_id in facts:
            _check_tensor_parallel(run, facts[run.run_id])
    return facts


def _check_tensor_parallel(run: RunConfig, facts: ModelFacts) -> None:
    """What the model's plan needs of tp_size, one line (the presets' in `RunConfig`)."""
    if facts.tp_refusal:
        raise ConfigError(f"model.name: {run.model.name}: {facts.tp_refusal}")
    for name, size in facts.tp_sizes.items():
        if size % run.tp_size:
            raise CombinationError(
                "tp_size", run.tp_size, f"must divide {run.model.name}'s {name} ({size})"
            )


def _key(model: ModelConfig, digest: str) -> str:
    return json.dumps([to_plain(model), digest], sort_keys=True)


def source_digests(runs: list[RunConfig]) -> dict[str, str]:
    """`model.name` -> `source_digest`, each distinct model's file read once."""
    models = {run.model.name: run.model for run in runs}
    return {name: source_digest(model) for name, model in models.items()}


def source_digest(model: ModelConfig) -> str:
    """A digest of the file a user's model is read from, as it is now: the module `model.name`
    imports, or the `hf:` config.json. The model check's memo and the cached estimates are
    keyed by it, so a model edited between two sweeps of one process (a notebook) or of one
    results folder is checked and estimated again. Files that module imports in turn are not
    followed. "" for presets and for a file not found (the check then says why)."""
    if not model.is_user_model:
        return ""
    path = model.hf_config_file if model.is_hf_model else _module_file(model.name.split(":")[0])
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path else ""
    except OSError:
        return ""


def _module_file(module_name: str) -> Path | None:
    """Where an import of `module_name` would find it now, found without running any of the
    user's code (importlib's `find_spec` imports the parent packages)."""
    search = None
    spec = None
    parts = module_name.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        spec = next((s for s in _specs(name, search) if s is not None), None)
        if spec is None:
            return None
        search = spec.submodule_search_locations
    return Path(spec.origin) if spec is not None and spec.has_location and spec.origin else None


def _specs(name: str, search: Any) -> Iterator[Any]:
    """What each import finder would load `name` from (None where it has nothing)."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is not None:
            try:
                yield find(name, search)
            except Exception:  # a broken finder of someone else's: ask the next one
                continue


def check_model(item: tuple[ModelConfig, list[int]]) -> ModelFacts | str:
    """Build, check and count one model (in a fresh process); the error's one line
    otherwise. A user model's warnings are not our message, and are silenced for the check
    only."""
    model, seq_lens = item
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _check(model, seq_lens)
    except ConfigError as err:
        return one_line(err, 400)
    except Exception as err:  # the user's code: any exception is theirs to see, in one line
        return f"model.name: {model.name}: {type(err).__name__}: {one_line(err, 300)}"


def _check(model: ModelConfig, seq_lens: list[int]) -> ModelFacts:
    from fsdp_bench.job.model.zoo import build_model

    try:
        bundle = build_model(model)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(
            f"model.name: {model.name}: building the model raised "
            f"{type(err).__name__}: {one_line(err, 300)}"
        ) from None
    module = bundle.module
    inside = {id(m) for m in module.modules()}
    if not bundle.blocks:
        raise ConfigError(f"model.name: {model.name}: the bundle's blocks are empty")
    if any(id(block) not in inside or block is module for block in bundle.blocks):
        raise ConfigError(
            f"model.name: {model.name}: the bundle's blocks must be submodules of its module"
        )
    counted = count_flops_per_token(model.name, bundle, seq_lens)
    check_init(model)
    if bundle.flops_per_token is not None:
        flops, source = {seq: float(bundle.flops_per_token(seq)) for seq in seq_lens}, OWN_FORMULA
    else:
        flops, source = counted, COUNTED
    return ModelFacts(
        flops_per_token=flops,
        flops_source=source,
        num_params=sum(p.numel() for p in module.parameters()),
        num_blocks=len(bundle.blocks),
        blocks_path=bundle.blocks_path,
        **_tensor_parallel_facts(bundle),
    )


def _tensor_parallel_facts(bundle: Any) -> dict[str, Any]:
    """`ModelFacts.tp_refusal` and `tp_sizes`: a user's bundle runs TP with its own plan; a
    transformers model with its config's, if it has one (`tensor_parallel.transformers_plan`)."""
    from fsdp_bench.job.parallel.tensor_parallel import transformers_plan

    if bundle.tp_plan is not None:
        return {}
    try:
        transformers_plan(bundle.module)
    except ConfigError as err:
        return {"tp_refusal": str(err).removeprefix("tp_size: ")}
    config = bundle.module.config.get_text_config()
    names = {"num_attention_heads": "attention heads", "num_key_value_heads": "key/value heads",
             "intermediate_size": "MLP width", "vocab_size": "vocabulary"}  # fmt: skip
    sizes = {label: getattr(config, key, None) for key, label in names.items()}
    return {"tp_sizes": {label: size for label, size in sizes.items() if isinstance(size, int)}}


INIT_CHECK_SHARD_BYTES = 256 * 2**20
"""The model's init is checked on rank 0's shards of a fake world sized so that its
parameters take about this much memory: real values, a few seconds, for any model size."""


def check_init(model: ModelConfig) -> None:
    """Initialise the model as a rank would (materialised, then its init or the default one)
    and refuse it, in one line, when a parameter is left NaN or Inf: `models.initialize`
    makes every parameter NaN first, so one that no init covers always shows. Presets are
    initialised by our own code; a user's model otherwise fails every run, a minute each."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_bench.job.model.zoo import build_model, check_finite, initialize
    from fsdp_bench.job.parallel.parallelize import materialize, wrap_on_meta
    from fsdp_bench.memory.fake import fake_world

    bundle = build_model(model)
    num_bytes = sum(p.numel() * p.element_size() for p in bundle.module.parameters())
    world_size = max(1, min(1024, -(-num_bytes // INIT_CHECK_SHARD_BYTES)))
    precision = "bf16" if model.dtype == "bf16" else FsdpConfig().mixed_precision  # bf16 storage
    run = RunConfig(world_size=world_size, model=model, fsdp=FsdpConfig(mixed_precision=precision))
    with fake_world(world_size):
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
        cpu = torch.device("cpu")
        torch.manual_seed(run.data.seed)
        sharded, _ = wrap_on_meta(bundle, run, mesh, cpu)
        materialize(sharded, cpu)
        initialize(bundle, sharded)
        bad = check_finite(sharded)
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise ConfigError(
            f"model.name: {model.name}: after initialisation {', '.join(bad[:3])}{more} hold "
            "NaN or Inf: no init covers them (give ModelBundle an init that sets every "
            "parameter; PyTorch modules get their own reset_parameters)"
        )


def count_flops_per_token(name: str, bundle: Any, seq_lens: list[int]) -> dict[int, float]:
    """Training FLOPs per token of one sequence, forward and backward, on fake tensors."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from fsdp_bench.job.parallel.parallelize import materialize
    from fsdp_bench.memory.fake import fake_tensors

    flops = {}
    with fake_tensors():
        materialize(bundle.module, torch.device("cpu"))
        for seq_len in seq_lens:
            tokens = torch.randint(0, bundle.vocab_size, (1, seq_len + 1))
            with FlopCounterMode(display=False, custom_mapping=_attention_flops()) as counter:
                _step(name, bundle, tokens)
            flops[seq_len] = float(counter.get_total_flops()) / seq_len
    return flops


def _attention_flops() -> dict[Any, Any]:
    """Model FLOPs of fused attention: the forward's two products, and twice that backward
    (the convention of MFU and of the presets' formula, full rather than causal attention).
    torch's own table counts the backward kernels' recomputation of the scores too (hardware
    FLOPs, 2.5x the forward) and leaves the CPU flash kernels out altogether. Counted from the
    shapes here: torch 2.11's own formula refuses grouped-query attention."""
    import torch

    def forward(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        # Shapes, not tensors: (batch, query heads, query length, head dim); key and value
        # may have fewer heads (GQA), each shared by a group of query heads.
        batch, heads, query_len, head_dim = query
        key_len, value_dim = key[-2], value[-1]
        return 2 * batch * heads * query_len * key_len * (head_dim + value_dim)

    def backward(grad: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        return 2 * forward(query, key, value)

    aten = torch.ops.aten
    kernels = [
        "flash_attention_for_cpu",
        "flash_attention",
        "efficient_attention",
        "cudnn_attention",
    ]
    mapping = {}
    for kernel in kernels:
        for suffix, formula in (("", forward), ("_backward", backward)):
            name = f"_scaled_dot_product_{kernel}{suffix}"
            if hasattr(aten, name):
                mapping[getattr(aten, name)] = formula
    return mapping


def _step(name: str, bundle: Any, tokens: Any) -> None:
    """Forward and backward of one sequence, the output checked against the contract."""
    from fsdp_bench.job.model.zoo import logits_of
    from fsdp_bench.job.training import loss_fn

    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    output = bundle.module(inputs)
    try:
        logits = logits_of(output)
    except TypeError as err:
        raise ConfigError(f"model.name: {name}: {one_line(err)}") from None
    want = (1, inputs.shape[1], bundle.vocab_size)
    if tuple(logits.shape) != want:
        raise ConfigError(
            f"model.name: {name}: the model's logits have shape {tuple(logits.shape)} for "
            f"{inputs.shape[1]} tokens; expected (batch, seq, vocab_size) = {want}"
        )
    loss_fn(output, targets).backward()
