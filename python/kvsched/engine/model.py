"""A small Llama-style decoder: RMSNorm, rotary position embeddings (the
rotate-half layout of Llama checkpoints), grouped-query attention, SwiGLU.

Two forward passes share the layers: `forward_paged` runs one step plan over the
paged KV cache (writing the new K/V, attending through a backend), and
`forward_dense` recomputes a whole sequence with no cache at all, the oracle the
engine's generation is checked against.

Weights come from `init_params` (seeded, for tests and the demo) or
`load_llama_safetensors` (a Llama-format checkpoint: model.layers.N.self_attn.
q_proj.weight, ...). `weights_checksum` pins the model version in the metrics.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvsched.engine.attention import AttentionInputs, paged_attention
from kvsched.engine.kv_cache import write_kv

Params = dict[str, Any]


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


def init_params(config: LlamaConfig, seed: int = 0) -> Params:
    """Seeded random weights, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    c = config

    def w(shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), c.jdtype)

    layers = []
    for _ in range(c.n_layers):
        layers.append(
            {
                "attn_norm": jnp.ones((c.dim,), c.jdtype),
                "wq": w((c.dim, c.n_heads * c.head_dim), c.dim),
                "wk": w((c.dim, c.n_kv_heads * c.head_dim), c.dim),
                "wv": w((c.dim, c.n_kv_heads * c.head_dim), c.dim),
                "wo": w((c.n_heads * c.head_dim, c.dim), c.n_heads * c.head_dim),
                "mlp_norm": jnp.ones((c.dim,), c.jdtype),
                "w_gate": w((c.dim, c.ffn_dim), c.dim),
                "w_up": w((c.dim, c.ffn_dim), c.dim),
                "w_down": w((c.ffn_dim, c.dim), c.ffn_dim),
            }
        )
    return {
        "embed": w((c.vocab_size, c.dim), 1),
        "layers": layers,
        "final_norm": jnp.ones((c.dim,), c.jdtype),
        "lm_head": w((c.dim, c.vocab_size), c.dim),
    }


def weights_checksum(params: Params) -> str:
    """sha256 over every weight's bytes, in a fixed order (16 hex digits)."""
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(params):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """x [T, H, D] rotated by position (rotate-half layout)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = positions.astype(jnp.float32)[:, None] * inv[None, :]  # [T, D/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, axis=-1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, axis=-1)[:, None, :]
    xf = x.astype(jnp.float32)
    half = d // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def _mlp(layer: Params, x: jax.Array) -> jax.Array:
    gate = jax.nn.silu(x @ layer["w_gate"])
    return (gate * (x @ layer["w_up"])) @ layer["w_down"]


def _qkv(layer: Params, c: LlamaConfig, h: jax.Array, positions: jax.Array):
    t = h.shape[0]
    q = (h @ layer["wq"]).reshape(t, c.n_heads, c.head_dim)
    k = (h @ layer["wk"]).reshape(t, c.n_kv_heads, c.head_dim)
    v = (h @ layer["wv"]).reshape(t, c.n_kv_heads, c.head_dim)
    return rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta), v


def forward_paged(
    params: Params,
    caches: list[jax.Array],
    config: LlamaConfig,
    token_ids: jax.Array,
    positions: jax.Array,
    slot_mapping: jax.Array,
    inputs: AttentionInputs,
    logits_indices: jax.Array,
    *,
    backend: str = "reference",
    mesh: Any = None,
) -> tuple[jax.Array, list[jax.Array]]:
    """One step plan: logits [S, V] at `logits_indices`, and the caches with this
    step's K/V written."""
    c = config
    x = params["embed"][token_ids]
    new_caches = []
    for layer, cache in zip(params["layers"], caches, strict=True):
        h = rms_norm(x, layer["attn_norm"], c.norm_eps)
        q, k, v = _qkv(layer, c, h, positions)
        cache = write_kv(cache, k, v, slot_mapping)
        new_caches.append(cache)
        a = paged_attention(q, cache, inputs, scale=c.scale, backend=backend, mesh=mesh)
        x = x + a.reshape(x.shape[0], -1) @ layer["wo"]
        x = x + _mlp(layer, rms_norm(x, layer["mlp_norm"], c.norm_eps))
    x = rms_norm(x[logits_indices], params["final_norm"], c.norm_eps)
    return (x @ params["lm_head"]).astype(jnp.float32), new_caches


def forward_dense(params: Params, config: LlamaConfig, tokens: jax.Array) -> jax.Array:
    """Logits [N, V] for every position of one sequence, recomputed from scratch."""
    c = config
    n = tokens.shape[0]
    positions = jnp.arange(n, dtype=jnp.int32)
    x = params["embed"][tokens]
    causal = jnp.tril(jnp.ones((n, n), bool))
    g = c.n_heads // c.n_kv_heads
    for layer in params["layers"]:
        h = rms_norm(x, layer["attn_norm"], c.norm_eps)
        q, k, v = _qkv(layer, c, h, positions)
        k = jnp.repeat(k, g, axis=1).astype(jnp.float32)
        v = jnp.repeat(v, g, axis=1).astype(jnp.float32)
        s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k) * c.scale
        s = jnp.where(causal[None], s, -jnp.inf)
        a = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v).astype(x.dtype)
        x = x + a.reshape(n, -1) @ layer["wo"]
        x = x + _mlp(layer, rms_norm(x, layer["mlp_norm"], c.norm_eps))
    x = rms_norm(x, params["final_norm"], c.norm_eps)
    return (x @ params["lm_head"]).astype(jnp.float32)


_dense_jit = jax.jit(forward_dense, static_argnums=(1,))


def greedy_dense(params: Params, config: LlamaConfig, prompt: list[int], n: int) -> list[int]:
    """Generate `n` tokens greedily by full recompute: the engine's oracle. The
    sequence is padded to a multiple of 64 (causal attention: padding after a
    position cannot change its logits), so few programs compile."""
    tokens = list(prompt)
    for _ in range(n):
        width = -(-len(tokens) // 64) * 64
        padded = jnp.asarray(tokens + [0] * (width - len(tokens)), jnp.int32)
        logits = _dense_jit(params, config, padded)
        tokens.append(int(jnp.argmax(logits[len(tokens) - 1])))
    return tokens[len(prompt) :]


# -- Llama-format checkpoints ---------------------------------------------------------

_LAYER_KEYS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


def load_llama_safetensors(path: str | Path, config: LlamaConfig) -> Params:
    """Weights from a Llama-format safetensors file (projection weights are
    stored [out, in] and transposed here). Shapes are checked against `config`."""
    from safetensors.numpy import load_file

    t = load_file(str(path))

    def get(name: str, shape: tuple[int, ...], transpose: bool = False) -> jax.Array:
        if name not in t:
            raise KeyError(f"{path}: no tensor {name!r}")
        a = t[name].T if transpose else t[name]
        if a.shape != shape:
            raise ValueError(f"{path}: {name} has shape {a.shape}, the config says {shape}")
        return jnp.asarray(a, config.jdtype)

    c = config
    q_out, kv_out = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes = {
        "attn_norm": (c.dim,),
        "wq": (c.dim, q_out),
        "wk": (c.dim, kv_out),
        "wv": (c.dim, kv_out),
        "wo": (q_out, c.dim),
        "mlp_norm": (c.dim,),
        "w_gate": (c.dim, c.ffn_dim),
        "w_up": (c.dim, c.ffn_dim),
        "w_down": (c.ffn_dim, c.dim),
    }
    layers = []
    for i in range(c.n_layers):
        layers.append(
            {
                k: get(
                    f"model.layers.{i}.{name}",
                    shapes[k],
                    transpose=k not in ("attn_norm", "mlp_norm"),
                )
                for k, name in _LAYER_KEYS.items()
            }
        )
    head = "lm_head.weight" if "lm_head.weight" in t else "model.embed_tokens.weight"
    expected = {
        f"model.layers.{i}.{name}" for i in range(c.n_layers) for name in _LAYER_KEYS.values()
    }
    expected |= {"model.embed_tokens.weight", "model.norm.weight", head}
    # Rotary frequency buffers some exporters save are recomputed here.
    extra = {k for k in t if k not in expected and not k.endswith("rotary_emb.inv_freq")}
    if extra:
        raise ValueError(
            f"{path}: {len(extra)} tensors the config does not describe (more layers, "
            f"biases?), e.g. {sorted(extra)[:3]}"
        )
    return {
        "embed": get("model.embed_tokens.weight", (c.vocab_size, c.dim)),
        "layers": layers,
        "final_norm": get("model.norm.weight", (c.dim,)),
        "lm_head": get(head, (c.dim, c.vocab_size), transpose=True),
    }


def save_llama_safetensors(params: Params, path: str | Path) -> None:
    """Write params in the Llama layout (the inverse of the loader)."""
    from safetensors.numpy import save_file

    out = {
        "model.embed_tokens.weight": np.asarray(params["embed"], np.float32),
        "model.norm.weight": np.asarray(params["final_norm"], np.float32),
        "lm_head.weight": np.ascontiguousarray(np.asarray(params["lm_head"], np.float32).T),
    }
    for i, layer in enumerate(params["layers"]):
        for k, name in _LAYER_KEYS.items():
            a = np.asarray(layer[k], np.float32)
            out[f"model.layers.{i}.{name}"] = a if a.ndim == 1 else np.ascontiguousarray(a.T)
    save_file(out, str(path))
