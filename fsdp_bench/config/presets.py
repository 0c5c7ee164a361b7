"""Model shapes and their arithmetic (parameter counts, training FLOPs per token), without torch.

Kept free of torch so that validating a grid and estimating analytically stay instant.
Llama-3 shapes are those of Meta's published model configs (params.json of each release).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A Llama-style decoder: embedding, blocks of RMSNorm + GQA attention + SwiGLU, norm, head."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    tie_embeddings: bool = False
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def block_params(self) -> int:
        """Parameters of one transformer block (attention, MLP, two norms)."""
        kv_dim = self.n_kv_heads * self.head_dim
        attention = self.dim * self.dim * 2 + self.dim * kv_dim * 2
        mlp = 3 * self.dim * self.ffn_dim
        return attention + mlp + 2 * self.dim

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def head_params(self) -> int:
        """The LM head's own parameters: none when it shares the embedding's weight."""
        return 0 if self.tie_embeddings else self.vocab_size * self.dim

    @property
    def num_params(self) -> int:
        return (
            self.embedding_params
            + self.n_layers * self.block_params
            + self.dim  # final norm
            + self.head_params
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), the convention behind MFU.

        6 x (parameters that take part in matmuls, the LM head included, the embedding lookup
        not) + 12 x layers x dim x seq_len for attention scores and values (PaLM, appendix B;
        the same formula as torchtitan and nanoGPT). Recomputation from activation
        checkpointing is deliberately not counted: MFU measures useful work.
        """
        matmul_params = self.n_layers * (self.block_params - 2 * self.dim)
        matmul_params += self.vocab_size * self.dim
        return 6.0 * matmul_params + 12.0 * self.n_layers * self.dim * seq_len


PRESETS: dict[str, ModelShape] = {
    # CPU-sized shapes for tests and the quickstart: seconds per run on one core.
    "tiny": ModelShape(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=1024),
    "small": ModelShape(dim=256, n_layers=4, n_heads=8, n_kv_heads=8, ffn_dim=704, vocab_size=1024),
    # Real shapes (Meta's Llama 3 / 3.1 / 3.2 configurations).
    "llama3-1b": ModelShape(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        vocab_size=128_256,
        tie_embeddings=True,
    ),
    "llama3-3b": ModelShape(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim=8192,
        vocab_size=128_256,
        tie_embeddings=True,
    ),
    "llama3-8b": ModelShape(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14_336, vocab_size=128_256
    ),
    "llama3-70b": ModelShape(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28_672, vocab_size=128_256
    ),
    # Llama-2-7B: the 7B shape the seeds' and notes' arithmetic uses.
    "llama2-7b": ModelShape(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        ffn_dim=11_008,
        vocab_size=32_000,
        rope_theta=10_000.0,
    ),
}

SHAPE_OVERRIDES = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")


def resolve_shape(name: str, **overrides: int | bool | None) -> ModelShape:
    """A preset with the given fields replaced (None means keep the preset's value)."""
    shape = PRESETS[name]
    changes: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(shape, **changes) if changes else shape
