"""A small Llama-style decoder: RMSNorm, rotary position embeddings (the
rotate-half layout of Llama checkpoints), grouped-query attention, SwiGLU.

Two forward passes share the layers: `forward_paged` runs one step plan over the
paged KV cache (writing the new K/V, attending through a backend), and
`forward_dense` recomputes a whole sequence with no cache at all, the oracle the
engine's generation is checked against.

Weights are a pytree: `embed`, `final_norm`, `lm_head`, and `layers`, a dict of
arrays stacked over the layer axis, so the layers run under `lax.scan` and one
layer compiles once whatever the depth. The KV caches are stacked the same way
([layers, pages, block, 2*kv_heads, head_dim]) and carried through the scan.
Weights come from `init_params` (seeded, for tests and the demo) or the loaders
(kvsched.engine.loaders: safetensors, GGUF). `weights_checksum` pins the model
version in the metrics.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import TypedDict

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.sharding import Mesh
from jax.typing import ArrayLike

from kvsched.engine.attention import paged_attention
from kvsched.engine.inputs import AttentionInputs
from kvsched.engine.kv_cache import KVCache, write_kv_layer
from kvsched.engine.model_config import LlamaConfig, rope_inv_freq

LayerParams = dict[str, jax.Array]
"""One layer's weights by name (LAYER_WEIGHTS), or every layer's stacked."""


class Params(TypedDict):
    """The model's weights, a pytree (a plain dict at runtime)."""

    embed: jax.Array  # [vocab, dim]
    layers: LayerParams  # LAYER_WEIGHTS, each stacked over the layers: [layers, ...]
    final_norm: jax.Array  # [dim]
    lm_head: jax.Array  # [dim, vocab]


def init_params(config: LlamaConfig, seed: int = 0) -> Params:
    """Seeded random weights, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    c = config

    def w(shape: tuple[int, ...], fan_in: int) -> npt.NDArray[np.float64]:
        out: npt.NDArray[np.float64] = rng.standard_normal(shape) / np.sqrt(fan_in)
        return out

    layers = []
    for _ in range(c.n_layers):
        layers.append(
            {
                "attn_norm": np.ones((c.dim,)),
                "wq": w((c.dim, c.n_heads * c.head_dim), c.dim),
                "wk": w((c.dim, c.n_kv_heads * c.head_dim), c.dim),
                "wv": w((c.dim, c.n_kv_heads * c.head_dim), c.dim),
                "wo": w((c.n_heads * c.head_dim, c.dim), c.n_heads * c.head_dim),
                "mlp_norm": np.ones((c.dim,)),
                "w_gate": w((c.dim, c.ffn_dim), c.dim),
                "w_up": w((c.dim, c.ffn_dim), c.dim),
                "w_down": w((c.ffn_dim, c.dim), c.ffn_dim),
            }
        )
    return make_params(
        c,
        embed=w((c.vocab_size, c.dim), 1),
        layers=layers,
        final_norm=np.ones((c.dim,)),
        lm_head=w((c.dim, c.vocab_size), c.dim),
    )


class InvalidWeights(ValueError):
    """Weights the model cannot be served from: a tensor that is not floating
    point (int64, bool: a cast would invent weights), or one holding NaN or inf
    (a NaN projection yields finite, plausible tokens once attention's guards
    zero it out). The message names the tensor."""


def check_weight(name: str, a: ArrayLike) -> None:
    """Refuse a tensor that is not floating point or not finite (InvalidWeights,
    naming it): one isfinite pass over it."""
    dtype = a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise InvalidWeights(f"{name} is {dtype}: the model's weights are floating point")
    finite = np.isfinite(a) if isinstance(a, np.ndarray) else jnp.isfinite(jnp.asarray(a))
    if not bool(finite.all()):
        n = int(finite.size - int(finite.sum()))
        raise InvalidWeights(
            f"{name}: {n} of {finite.size} values are not finite (NaN or inf); "
            "a model cannot be served from them"
        )


def make_params(
    config: LlamaConfig,
    *,
    embed: ArrayLike,
    layers: Sequence[Mapping[str, ArrayLike]],
    final_norm: ArrayLike,
    lm_head: ArrayLike,
) -> Params:
    """Params from per-layer weights (numpy or jax, [in, out] projections), stacked
    over layers and cast to the model's dtype. Every tensor must be floating point
    (an int64 or bool array is refused, not cast) and finite once cast (NaN and
    inf survive the cast; a float64 beyond the dtype's range becomes inf):
    InvalidWeights names the one that is not."""
    dt = config.jdtype
    for name, a in (("embed", embed), ("final_norm", final_norm), ("lm_head", lm_head),
                    *((f"layers[{i}].{k}", layer[k]) for i, layer in enumerate(layers)
                      for k in LAYER_WEIGHTS)):  # fmt: skip
        dtype = a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise InvalidWeights(f"{name} is {dtype}: the model's weights are floating point")

    def cast(a: ArrayLike) -> jax.Array:
        return jnp.asarray(np.asarray(a, np.float32) if isinstance(a, np.ndarray) else a, dt)

    # An overflowing cast gives inf, which the check below names; numpy's own
    # overflow warning would only say it less clearly first.
    with np.errstate(over="ignore"):
        stacked = {k: cast(np.stack([np.asarray(layer[k], np.float32) for layer in layers]))
                   for k in LAYER_WEIGHTS}  # fmt: skip
        out: Params = {"embed": cast(embed), "layers": stacked, "final_norm": cast(final_norm),
                       "lm_head": cast(lm_head)}  # fmt: skip
    # Finite after the cast (one pass per tensor, on the device): NaN and inf
    # survive it, and a float64 beyond the dtype's range becomes inf.
    for name, w in (("embed", out["embed"]), ("final_norm", out["final_norm"]),
                    ("lm_head", out["lm_head"]), *out["layers"].items()):  # fmt: skip
        finite = jnp.isfinite(w)
        if name in LAYER_WEIGHTS:  # stacked: say which layer
            per_layer = np.asarray(finite.reshape(finite.shape[0], -1).all(axis=1))
            if not per_layer.all():
                name = f"layers[{int(np.argmin(per_layer))}].{name}"
                finite = finite[int(np.argmin(per_layer))]
        if not bool(finite.all()):
            n = int(finite.size - int(finite.sum()))
            raise InvalidWeights(
                f"{name}: {n} of {finite.size} values are not finite (NaN or inf) in "
                f"{config.dtype}; a model cannot be served from them"
            )
    return out


LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def layer_params(params: Params, i: int) -> LayerParams:
    """Layer i's weights (a view into the stacked arrays)."""
    return {k: v[i] for k, v in params["layers"].items()}


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


def rope(x: jax.Array, positions: jax.Array, inv_freq: ArrayLike) -> jax.Array:
    """x [T, H, D] rotated by position (rotate-half layout); inv_freq [D/2]."""
    ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, axis=-1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, axis=-1)[:, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def _mlp(layer: LayerParams, x: jax.Array) -> jax.Array:
    gate = jax.nn.silu(x @ layer["w_gate"])
    return (gate * (x @ layer["w_up"])) @ layer["w_down"]


def _qkv(
    layer: LayerParams, c: LlamaConfig, h: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    t = h.shape[0]
    q = (h @ layer["wq"]).reshape(t, c.n_heads, c.head_dim)
    k = (h @ layer["wk"]).reshape(t, c.n_kv_heads, c.head_dim)
    v = (h @ layer["wv"]).reshape(t, c.n_kv_heads, c.head_dim)
    inv = rope_inv_freq(c)
    return rope(q, positions, inv), rope(k, positions, inv), v


def forward_paged(
    params: Params,
    caches: KVCache,
    config: LlamaConfig,
    token_ids: jax.Array,
    positions: jax.Array,
    slot_mapping: jax.Array,
    inputs: AttentionInputs,
    logits_indices: jax.Array,
    *,
    backend: str = "reference",
    mesh: Mesh | None = None,
    return_hidden: bool = False,
) -> tuple[jax.Array, KVCache]:
    """One step plan: logits [S, V] at `logits_indices`, and the caches (stacked
    over layers) with this step's K/V written. The layers run under lax.scan with
    the caches in the carry, so each layer's write is in place."""
    c = config
    x = params["embed"][token_ids]

    def layer_step(
        carry: tuple[jax.Array, KVCache], xs: tuple[LayerParams, jax.Array]
    ) -> tuple[tuple[jax.Array, KVCache], None]:
        x, caches = carry
        layer, i = xs
        h = rms_norm(x, layer["attn_norm"], c.norm_eps)
        q, k, v = _qkv(layer, c, h, positions)
        caches = write_kv_layer(caches, i, k, v, slot_mapping)
        a = paged_attention(q, caches, inputs, scale=c.scale, backend=backend, mesh=mesh,
                            layer=i)  # fmt: skip
        x = x + a.reshape(x.shape[0], -1) @ layer["wo"]
        x = x + _mlp(layer, rms_norm(x, layer["mlp_norm"], c.norm_eps))
        return (x, caches), None

    idx = jnp.arange(c.n_layers, dtype=jnp.int32)
    (x, caches), _ = jax.lax.scan(layer_step, (x, caches), (params["layers"], idx))
    x = rms_norm(x[logits_indices], params["final_norm"], c.norm_eps)
    logits = (x @ params["lm_head"]).astype(jnp.float32)
    return logits, caches


def forward_dense(params: Params, config: LlamaConfig, tokens: jax.Array) -> jax.Array:
    """Logits [N, V] for every position of one sequence, recomputed from scratch."""
    c = config
    n = tokens.shape[0]
    positions = jnp.arange(n, dtype=jnp.int32)
    x = params["embed"][tokens]
    causal = jnp.tril(jnp.ones((n, n), bool))
    g = c.n_heads // c.n_kv_heads

    def layer_step(x: jax.Array, layer: LayerParams) -> tuple[jax.Array, None]:
        h = rms_norm(x, layer["attn_norm"], c.norm_eps)
        q, k, v = _qkv(layer, c, h, positions)
        k = jnp.repeat(k, g, axis=1).astype(jnp.float32)
        v = jnp.repeat(v, g, axis=1).astype(jnp.float32)
        s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k) * c.scale
        s = jnp.where(causal[None], s, -jnp.inf)
        a = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v).astype(x.dtype)
        x = x + a.reshape(n, -1) @ layer["wo"]
        x = x + _mlp(layer, rms_norm(x, layer["mlp_norm"], c.norm_eps))
        return x, None

    x, _ = jax.lax.scan(layer_step, x, params["layers"])
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


__all__ = [
    "LAYER_WEIGHTS",
    "LayerParams",
    "LlamaConfig",
    "Params",
    "forward_dense",
    "forward_paged",
    "greedy_dense",
    "init_params",
    "layer_params",
    "make_params",
    "InvalidWeights",
    "check_weight",
    "weights_checksum",
]
