"""What model a run trains: a preset with its shape overrides, a transformers config.json
(`hf:PATH`) or a user's function (`package.module:function`). No torch."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fsdp_bench.config.presets import PRESETS, SHAPE_OVERRIDES, ModelShape, resolve_shape
from fsdp_bench.config.schema import bad_value

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
HF_PREFIX = "hf:"


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = "tiny"
    """A preset (tiny, small, llama3-1b, llama3-3b, llama3-8b, llama3-70b, llama2-7b),
    `hf:PATH` to a transformers config.json (or a folder holding one), or
    `package.module:function` returning an `fsdp_bench.ModelBundle`."""
    tie_embeddings: bool | None = None
    """Share the embedding and LM-head weight; None keeps the preset's choice."""
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    vocab_size: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for a user model's function."""
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    """hf: models: config fields to change (e.g. num_hidden_layers: 4 for a quick sweep)."""
    hf_options: dict[str, Any] = field(default_factory=dict)
    """hf: models: keyword arguments for `from_config` (e.g. attn_implementation: sdpa)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype parameters are stored in, and with them gradients and optimizer state: fp32
    (master weights; fsdp.mixed_precision decides the compute dtype) or bf16 (no fp32 copy
    anywhere: half the memory of the state, updates rounded to bf16). Never taken from a
    config.json."""

    def __post_init__(self) -> None:
        if not self.is_hf_model:
            for key in ("hf_overrides", "hf_options"):
                if getattr(self, key):
                    raise bad_value(key, getattr(self, key), "for hf: models only")
        if self.is_user_model:
            self._check_user_model()
            return
        if self.name not in PRESETS:
            raise bad_value(
                "name",
                self.name,
                f"expected one of {', '.join(PRESETS)}, hf:PATH or package.module:function",
            )
        if self.options:
            raise bad_value("options", self.options, "options are for user models only")
        for key in SHAPE_OVERRIDES:
            value = getattr(self, key)
            if value is not None and value < 1:
                raise bad_value(key, value, "expected an integer >= 1")
        shape = self.shape
        if shape.dim % shape.n_heads:
            raise bad_value("n_heads", shape.n_heads, f"must divide dim {shape.dim}")
        if shape.n_heads % shape.n_kv_heads:
            raise bad_value("n_kv_heads", shape.n_kv_heads, f"must divide n_heads {shape.n_heads}")

    def _check_user_model(self) -> None:
        if self.is_hf_model:
            if not self.name[len(HF_PREFIX) :].strip():
                raise bad_value("name", self.name, "expected hf:PATH to a config.json")
            if self.options:
                raise bad_value("options", self.options, "hf: models take hf_options")
            for key in ("dtype", "torch_dtype"):
                if key in self.hf_options:
                    raise bad_value(
                        f"hf_options.{key}",
                        self.hf_options[key],
                        "not allowed: parameters are stored in fp32 and fsdp.mixed_precision "
                        "decides the compute and communication dtype",
                    )
        elif not _IMPORT_PATH.match(self.name):
            raise bad_value(
                "name", self.name, "expected a preset, hf:PATH or package.module:function"
            )
        for key in (*SHAPE_OVERRIDES, "tie_embeddings"):
            if getattr(self, key) is not None:
                hint = " (hf: models: hf_overrides)" if self.is_hf_model else ""
                raise bad_value(key, getattr(self, key), f"for presets only{hint}")

    @property
    def is_user_model(self) -> bool:
        """Not a preset: an import path or a transformers config."""
        return ":" in self.name

    @property
    def is_hf_model(self) -> bool:
        return self.name.startswith(HF_PREFIX)

    @property
    def hf_config_file(self) -> Path:
        """The config.json a `hf:` name points at (the path itself, or config.json inside it)."""
        path = Path(self.name[len(HF_PREFIX) :]).expanduser()
        return path / "config.json" if path.is_dir() else path

    @property
    def shape(self) -> ModelShape:
        """The preset with overrides applied (presets only)."""
        overrides = {k: getattr(self, k) for k in SHAPE_OVERRIDES}
        return resolve_shape(self.name, tie_embeddings=self.tie_embeddings, **overrides)
