"""Decoders: a Llama-style one (RMSNorm, rotary position embeddings in the
rotate-half layout of Llama checkpoints, grouped-query attention, SwiGLU) and
Gemma 3's (`Gemma3Config`: (1 + weight) RMSNorms, q/k norms, a scaled
embedding, GELU, norms after attention and MLP, sliding-window layers with their
own RoPE base, tied logits).

Two forward passes share the layers: `forward_paged` runs one step plan over the
paged KV cache (writing the new K/V, attending through a backend), and
`forward_dense` recomputes a whole sequence with no cache at all, the oracle the
engine's generation is checked against.

Weights are a pytree: `embed`, `final_norm`, `lm_head` (None when the logits
come from the embedding), and `layers`, a dict of arrays stacked over the layer
axis, so the layers run under `lax.scan` and one layer compiles once whatever the
depth. The KV caches are stacked the same way ([slots, pages, block,
2*kv_heads, head_dim]) and carried through the scan: a slot per layer, or, for a
model whose layers are cut into KV-cache groups (kvsched.shapes.group_layers), a
slot per layer of a group, each group with its own page table and slot mapping.
What differs between layers (the window, the RoPE frequencies, the group and the
slot) is scanned beside the weights; a layer's attention is picked by
`lax.switch` over the model's distinct windows, static for the kernels.
Weights come from `init_params` (seeded, for tests and the demo) or the loaders
(kvsched.engine.loaders: safetensors, GGUF). `weights_checksum` pins the model
version in the metrics.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.sharding import Mesh
from jax.typing import ArrayLike

from kvsched.engine.attention import paged_attention
from kvsched.engine.inputs import AttentionInputs
from kvsched.engine.kv_cache import KVCache, write_kv_layer
from kvsched.engine.model_config import Gemma3Config, LlamaConfig, rope_inv_freq

if TYPE_CHECKING:
    from kvsched.shapes import KVGroupLayout

LayerParams = dict[str, jax.Array]
"""One layer's weights by name (LAYER_WEIGHTS), or every layer's stacked."""


class Params(TypedDict):
    """The model's weights, a pytree (a plain dict at runtime)."""

    embed: jax.Array  # [vocab, dim]
    layers: LayerParams  # layer_weights(config), each stacked over the layers: [layers, ...]
    final_norm: jax.Array  # [dim]
    lm_head: jax.Array | None  # [dim, vocab]; None: tied, the logits are x @ embed.T


def init_params(config: LlamaConfig, seed: int = 0) -> Params:
    """Seeded random weights, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    c = config

    def w(shape: tuple[int, ...], fan_in: int) -> npt.NDArray[np.float64]:
        out: npt.NDArray[np.float64] = rng.standard_normal(shape) / np.sqrt(fan_in)
        return out

    gemma = isinstance(c, Gemma3Config)
    # Gemma's norms multiply by (1 + weight): weights near 0, not 1.
    norm = (lambda n: 0.1 * rng.standard_normal(n)) if gemma else (lambda n: np.ones((n,)))
    layers = []
    for _ in range(c.n_layers):
        layers.append(
            {
                "attn_norm": norm(c.dim),
                "wq": w((c.dim, c.n_heads * c.head_dim), c.dim),
                "wk": w((c.dim, c.n_kv_heads * c.head_dim), c.dim),
                "wv": w((c.dim, c.n_kv_heads * c.head_dim), c.dim),
                "wo": w((c.n_heads * c.head_dim, c.dim), c.n_heads * c.head_dim),
                "mlp_norm": norm(c.dim),
                "w_gate": w((c.dim, c.ffn_dim), c.dim),
                "w_up": w((c.dim, c.ffn_dim), c.dim),
                "w_down": w((c.ffn_dim, c.dim), c.ffn_dim),
            }
        )
        if gemma:
            layers[-1].update(q_norm=norm(c.head_dim), k_norm=norm(c.head_dim),
                              post_attn_norm=norm(c.dim), post_mlp_norm=norm(c.dim))  # fmt: skip
    # Gemma scales the embedding by sqrt(dim) and reads its logits from it.
    embed = w((c.vocab_size, c.dim), c.dim if gemma else 1)
    return make_params(
        c,
        embed=embed,
        layers=layers,
        final_norm=norm(c.dim),
        lm_head=None if gemma else w((c.dim, c.vocab_size), c.dim),
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
    lm_head: ArrayLike | None,
) -> Params:
    """Params from per-layer weights (numpy or jax, [in, out] projections; the
    names `layer_weights(config)`), stacked over layers and cast to the model's
    dtype; `lm_head` None: the logits are read from the embedding (tied).
    Every tensor must be floating point
    (an int64 or bool array is refused, not cast) and finite once cast (NaN and
    inf survive the cast; a float64 beyond the dtype's range becomes inf):
    InvalidWeights names the one that is not."""
    dt = config.jdtype
    names = layer_weights(config)
    head = () if lm_head is None else (("lm_head", lm_head),)
    for name, a in (("embed", embed), ("final_norm", final_norm), *head,
                    *((f"layers[{i}].{k}", layer[k]) for i, layer in enumerate(layers)
                      for k in names)):  # fmt: skip
        dtype = a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise InvalidWeights(f"{name} is {dtype}: the model's weights are floating point")

    def cast(a: ArrayLike) -> jax.Array:
        return jnp.asarray(np.asarray(a, np.float32) if isinstance(a, np.ndarray) else a, dt)

    # An overflowing cast gives inf, which the check below names; numpy's own
    # overflow warning would only say it less clearly first.
    with np.errstate(over="ignore"):
        stacked = {k: cast(np.stack([np.asarray(layer[k], np.float32) for layer in layers]))
                   for k in names}  # fmt: skip
        out: Params = {"embed": cast(embed), "layers": stacked, "final_norm": cast(final_norm),
                       "lm_head": None if lm_head is None else cast(lm_head)}  # fmt: skip
    # Finite after the cast (one pass per tensor, on the device): NaN and inf
    # survive it, and a float64 beyond the dtype's range becomes inf.
    cast_head = () if out["lm_head"] is None else (("lm_head", out["lm_head"]),)
    for name, w in (("embed", out["embed"]), ("final_norm", out["final_norm"]),
                    *cast_head, *out["layers"].items()):  # fmt: skip
        finite = jnp.isfinite(w)
        if name in names:  # stacked: say which layer
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
GEMMA3_LAYER_WEIGHTS = (*LAYER_WEIGHTS, "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")
"""Gemma 3's layer weights: Llama's (mlp_norm is Gemma's pre-feed-forward norm),
the per-head q and k norms [head_dim], and the norms after attention and after
the MLP [dim]."""


def layer_weights(config: LlamaConfig) -> tuple[str, ...]:
    """The names of one layer's weights for this model."""
    return GEMMA3_LAYER_WEIGHTS if isinstance(config, Gemma3Config) else LAYER_WEIGHTS


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


def gemma_rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: x / rms(x) * (1 + w), in float32, rounded once at the end."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, inv_freq: ArrayLike) -> jax.Array:
    """x [T, H, D] rotated by position (rotate-half layout); inv_freq [D/2]."""
    ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, axis=-1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, axis=-1)[:, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def _is_gemma(c: LlamaConfig) -> bool:
    return isinstance(c, Gemma3Config)


def _mlp(layer: LayerParams, x: jax.Array) -> jax.Array:
    gate = jax.nn.silu(x @ layer["w_gate"])
    return (gate * (x @ layer["w_up"])) @ layer["w_down"]


def _qkv(
    layer: LayerParams,
    c: LlamaConfig,
    h: jax.Array,
    positions: jax.Array,
    inv_freq: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k (normed per head for Gemma, then rotated) and v of the normed input
    h. inv_freq: this layer's RoPE frequencies (default: the model's one set)."""
    t = h.shape[0]
    q = (h @ layer["wq"]).reshape(t, c.n_heads, c.head_dim)
    k = (h @ layer["wk"]).reshape(t, c.n_kv_heads, c.head_dim)
    v = (h @ layer["wv"]).reshape(t, c.n_kv_heads, c.head_dim)
    if _is_gemma(c):
        q = gemma_rms_norm(q, layer["q_norm"], c.norm_eps)
        k = gemma_rms_norm(k, layer["k_norm"], c.norm_eps)
    inv = rope_inv_freq(c) if inv_freq is None else inv_freq
    return rope(q, positions, inv), rope(k, positions, inv), v


def _embed(params: Params, c: LlamaConfig, tokens: jax.Array) -> jax.Array:
    x = params["embed"][tokens]
    if _is_gemma(c):
        # sqrt(dim) rounded to the model's dtype before the product, as Gemma
        # was trained (in bfloat16, sqrt(640) is 25.25, not 25.30).
        x = x * jnp.asarray(c.dim**0.5, x.dtype)
    return x


def _logits(params: Params, c: LlamaConfig, x: jax.Array) -> jax.Array:
    """Logits (float32) of final-normed rows x: lm_head, or the embedding
    (tied), soft-capped when the model says so."""
    head = params["lm_head"]
    logits = (x @ head if head is not None else x @ params["embed"].T).astype(jnp.float32)
    cap = c.final_logit_softcap if isinstance(c, Gemma3Config) else None
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    return logits


def _block(
    c: LlamaConfig, layer: LayerParams, x: jax.Array, attend: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """One decoder layer around `attend` (normed input h -> attention output
    [T, Hq, D], K/V written): attention and MLP, each added to the residual."""
    if not _is_gemma(c):
        h = rms_norm(x, layer["attn_norm"], c.norm_eps)
        x = x + attend(h).reshape(x.shape[0], -1) @ layer["wo"]
        return x + _mlp(layer, rms_norm(x, layer["mlp_norm"], c.norm_eps))
    eps = c.norm_eps
    a = attend(gemma_rms_norm(x, layer["attn_norm"], eps)).reshape(x.shape[0], -1) @ layer["wo"]
    x = x + gemma_rms_norm(a, layer["post_attn_norm"], eps)
    h = gemma_rms_norm(x, layer["mlp_norm"], eps)
    m = (jax.nn.gelu(h @ layer["w_gate"], approximate=True) * (h @ layer["w_up"])) @ layer["w_down"]
    return x + gemma_rms_norm(m, layer["post_mlp_norm"], eps)


def _final_norm(params: Params, c: LlamaConfig, x: jax.Array) -> jax.Array:
    norm = gemma_rms_norm if _is_gemma(c) else rms_norm
    return norm(x, params["final_norm"], c.norm_eps)


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
    kv_layout: KVGroupLayout | None = None,
) -> tuple[jax.Array, KVCache]:
    """One step plan: logits [S, V] at `logits_indices`, and the caches (stacked
    over slots) with this step's K/V written. The layers run under lax.scan with
    the caches in the carry, so each layer's write is in place.

    `kv_layout` (kvsched.shapes.group_layers of `config.layer_kinds`; None: a
    slot per layer, one group) says where each layer's K/V live: layer i writes
    cache slot `layer_slot[i]` at `slot_mapping[g]` ([G, T]) and attends
    through page table `inputs.page_indices[g]` ([G, S, PPS]), g =
    `layer_group[i]`, with its window. With one group the arrays may also be
    the plain [T] and [S, PPS]."""
    c = config
    x = _embed(params, c, token_ids)
    n = c.n_layers
    groups = (0,) * n if kv_layout is None else tuple(kv_layout.layer_group)
    slots = tuple(range(n)) if kv_layout is None else tuple(kv_layout.layer_slot)
    if len(groups) != n:
        raise ValueError(f"kv_layout has {len(groups)} layers, the model {n}")
    if max(groups) == 0:
        # One group: its arrays are picked here, statically, not per layer.
        slot_mapping = slot_mapping if slot_mapping.ndim == 1 else slot_mapping[0]
        if inputs.page_indices.ndim == 3:
            inputs = dataclasses.replace(inputs, page_indices=inputs.page_indices[0])
    windows = c.windows
    per_layer = c.layer_windows
    gemma = _is_gemma(c)

    def attention(q: jax.Array, caches: KVCache, inp: AttentionInputs, slot: jax.Array,
                  window: int) -> jax.Array:  # fmt: skip
        # Llama's call is exactly what it was: no window keyword for a full layer.
        kw: dict[str, Any] = {"sliding_window": window} if window else {}
        return paged_attention(q, caches, inp, scale=c.scale, backend=backend, mesh=mesh,
                               layer=slot, **kw)  # fmt: skip

    def layer_step(
        carry: tuple[jax.Array, KVCache], xs: tuple[LayerParams, dict[str, jax.Array]]
    ) -> tuple[tuple[jax.Array, KVCache], None]:
        x, caches = carry
        layer, at = xs
        if max(groups) == 0:
            sm, inp = slot_mapping, inputs
        else:
            g = at["group"]
            sm = slot_mapping[g]
            inp = dataclasses.replace(inputs, page_indices=inputs.page_indices[g])

        def attend(h: jax.Array) -> jax.Array:
            nonlocal caches
            q, k, v = _qkv(layer, c, h, positions, at["inv_freq"] if gemma else None)
            caches = write_kv_layer(caches, at["slot"], k, v, sm)
            if len(windows) == 1:
                return attention(q, caches, inp, at["slot"], windows[0])
            branches = [functools.partial(attention, window=w) for w in windows]
            return jax.lax.switch(at["branch"], branches, q, caches, inp, at["slot"])

        x = _block(c, layer, x, attend)
        return (x, caches), None

    # Each layer in its own slot (no layout, or one group of every layer): the
    # slot is the layer index, an iota as before groups, so the program is the
    # one such a model ran before.
    own = slots == tuple(range(n))
    at = {"slot": jnp.arange(n, dtype=jnp.int32) if own else jnp.asarray(slots, jnp.int32)}
    if max(groups) > 0:
        at["group"] = jnp.asarray(groups, jnp.int32)
    if len(windows) > 1:
        at["branch"] = jnp.asarray([windows.index(w) for w in per_layer], jnp.int32)
    if gemma:
        at["inv_freq"] = jnp.asarray(c.layer_inv_freqs())
    (x, caches), _ = jax.lax.scan(layer_step, (x, caches), (params["layers"], at))
    x = _final_norm(params, c, x[logits_indices])
    return _logits(params, c, x), caches


def forward_dense(
    params: Params, config: LlamaConfig, tokens: jax.Array, *, rows: jax.Array | None = None
) -> jax.Array:
    """Logits [N, V] for every position of one sequence, recomputed from scratch
    (sliding-window layers masked to their window); with `rows`, only those
    positions' logits [len(rows), V]."""
    c = config
    n = tokens.shape[0]
    positions = jnp.arange(n, dtype=jnp.int32)
    x = _embed(params, c, tokens)
    causal = jnp.tril(jnp.ones((n, n), bool))
    # How far back each query reaches: q - k, for the windows.
    distance = positions[:, None] - positions[None, :]
    g = c.n_heads // c.n_kv_heads
    gemma = _is_gemma(c)

    def layer_step(
        x: jax.Array, xs: tuple[LayerParams, dict[str, jax.Array]]
    ) -> tuple[jax.Array, None]:
        layer, at = xs

        def attend(h: jax.Array) -> jax.Array:
            q, k, v = _qkv(layer, c, h, positions, at["inv_freq"] if gemma else None)
            k = jnp.repeat(k, g, axis=1).astype(jnp.float32)
            v = jnp.repeat(v, g, axis=1).astype(jnp.float32)
            s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k) * c.scale
            allowed = causal
            if "window" in at:
                w = at["window"]
                allowed = causal & ((w == 0) | (distance < w))
            s = jnp.where(allowed[None], s, -jnp.inf)
            return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v).astype(x.dtype)

        return _block(c, layer, x, attend), None

    at: dict[str, jax.Array] = {}
    if any(c.layer_windows):
        at["window"] = jnp.asarray(c.layer_windows, jnp.int32)
    if gemma:
        at["inv_freq"] = jnp.asarray(c.layer_inv_freqs())
    x, _ = jax.lax.scan(layer_step, x, (params["layers"], at))
    if rows is not None:
        x = x[rows]
    return _logits(params, c, _final_norm(params, c, x))


_dense_jit = jax.jit(forward_dense, static_argnums=(1,))


def greedy_dense(params: Params, config: LlamaConfig, prompt: list[int], n: int) -> list[int]:
    """Generate `n` tokens greedily by full recompute: the engine's oracle. The
    sequence is padded to a multiple of 64 (causal attention: padding after a
    position cannot change its logits), so few programs compile. Gemma's
    (a vocabulary of 262,144) computes the logits of the last position only."""
    tokens = list(prompt)
    for _ in range(n):
        width = -(-len(tokens) // 64) * 64
        padded = jnp.asarray(tokens + [0] * (width - len(tokens)), jnp.int32)
        if _is_gemma(config):
            last = jnp.asarray([len(tokens) - 1], jnp.int32)
            logits = _dense_jit(params, config, padded, rows=last)[0]
        else:
            logits = _dense_jit(params, config, padded)[len(tokens) - 1]
        tokens.append(int(jnp.argmax(logits)))
    return tokens[len(prompt) :]


__all__ = [
    "GEMMA3_LAYER_WEIGHTS",
    "LAYER_WEIGHTS",
    "Gemma3Config",
    "LayerParams",
    "LlamaConfig",
    "Params",
    "forward_dense",
    "forward_paged",
    "gemma_rms_norm",
    "greedy_dense",
    "init_params",
    "layer_params",
    "layer_weights",
    "make_params",
    "InvalidWeights",
    "check_weight",
    "weights_checksum",
]
