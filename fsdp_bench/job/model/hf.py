"""transformers models as users have them: `model.name: hf:PATH` to a `config.json`.

The model is what `AutoModelForCausalLM.from_config` builds (no weights are read), with the
grid's `hf_overrides` applied to the config and its `hf_options` passed to the constructor.
The `block` grouping unit is the classes the model names in `_no_split_modules`: those
transformers and accelerate wrap for FSDP. transformers is an optional extra, imported only
here and only when a grid names such a model.
"""

from __future__ import annotations

import json
from typing import Any

from fsdp_bench.config.model import ModelConfig
from fsdp_bench.errors import ConfigError, one_line


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "model.name: hf: models need transformers: pip install 'fsdp-bench[hf]'"
        ) from None
    return transformers


def read_hf_config(config: ModelConfig) -> Any:
    """The model's `PretrainedConfig`, overrides applied; one line naming what is wrong."""
    transformers = import_transformers()
    path = config.hf_config_file
    where = f"model.name: {config.name}"
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"{where}: cannot read {path} ({err.strerror})") from None
    except ValueError as err:
        raise ConfigError(f"{where}: {path} is not a JSON config ({one_line(err)})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(f"{where}: {path} has no model_type (not a transformers config.json)")
    try:
        config_class = transformers.AutoConfig.for_model(data["model_type"]).__class__
    except ValueError:
        raise ConfigError(
            f"{where}: model_type {data['model_type']!r} is unknown to transformers "
            f"{transformers.__version__}"
        ) from None
    hf_config = config_class.from_dict(data)
    for key, value in config.hf_overrides.items():
        if not hasattr(hf_config, key):
            raise ConfigError(
                f"model.hf_overrides: {key!r} is not a field of {config_class.__name__}"
            )
        setattr(hf_config, key, value)
    hf_config.use_cache = False  # training: no key/value cache is kept
    # Parameters are stored as the grid says, never as the file's dtype: Hub configs say
    # bfloat16, and transformers builds in it, which trained every hf: run in pure bf16 (no
    # fp32 master weights, bf16 gradients and optimizer state) whatever mixed_precision said.
    for key in ("dtype", "torch_dtype"):  # transformers >= 4.56 names it dtype
        if key in vars(hf_config):
            setattr(hf_config, key, None)
    return hf_config


def build_hf_model(config: ModelConfig) -> tuple[Any, list[Any], int]:
    """The causal LM of the config (parameters wherever the caller's context puts them), its
    blocks and its vocabulary size."""
    transformers = import_transformers()
    hf_config = read_hf_config(config)
    try:
        model = transformers.AutoModelForCausalLM.from_config(hf_config, **config.hf_options)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model.name: {config.name}: {one_line(err, 300)}") from None
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_classes]
    if not blocks:
        raise ConfigError(
            f"model.name: {config.name}: {type(model).__name__} names no block classes "
            "(_no_split_modules), so there is no `block` grouping unit"
        )
    vocab_size = int(hf_config.get_text_config().vocab_size)
    return model, blocks, vocab_size


def num_hidden_layers(config: ModelConfig) -> int | None:
    """The block count the config (with overrides) asks for; None when it has no such field."""
    layers = getattr(read_hf_config(config).get_text_config(), "num_hidden_layers", None)
    return layers if isinstance(layers, int) else None
