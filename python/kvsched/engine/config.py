"""The shapes and numerics of a Llama-style decoder, and how a checkpoint's
config maps onto them.

`LlamaConfig` is what the model code reads; `from_hf` reads a Hugging Face
config.json (as a dict). RoPE frequencies come from `rope_inv_freq`, so a
checkpoint's rotary variant is decided here, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class LlamaConfig:
    """The shapes of a Llama-style decoder. `from_hf` reads a Llama config.json."""

    vocab_size: int = 512
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    ffn_dim: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: str = "float32"  # or "bfloat16"
    name: str = "tiny-llama"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "llama") -> LlamaConfig:
        """From a Hugging Face Llama config.json (as a dict). RoPE scaling (the
        "llama3" frequency rescaling of Llama 3.1 and later) is not modelled:
        such a config is refused rather than run with the wrong positions."""
        if cfg.get("rope_scaling"):
            raise ValueError(f"rope_scaling {cfg['rope_scaling']!r} is not supported")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            ffn_dim=cfg["intermediate_size"],
            rope_theta=cfg.get("rope_theta", 10000.0),
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            name=name,
        )

    @property
    def jdtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def scale(self) -> float:
        return float(self.head_dim) ** -0.5


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """The rotary inverse frequencies [head_dim / 2] (float32) for this model."""
    d = config.head_dim
    return (1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))).astype(
        np.float32
    )
