"""Paged KV cache arrays.

One array per layer, shaped [num_blocks, block_size, 2 * kv_heads, head_dim]
(the engine stacks the layers: [layers, num_blocks, ...], `init_caches`):
K of head h at combined index 2h, V at 2h + 1, so one page holds both and a
kernel fetches a page's K and V in one copy. New K/V are written at the plan's
`slot_mapping` (page * block_size + offset) by a jitted scatter whose cache
argument is donated; padded slots point one past the end and `mode="drop"`
makes their writes vanish (a -1 would wrap and overwrite the last slot).

int8 KV (restart-only, like every KV dtype): the cache is a `QuantizedKV`
pytree of int8 values in the same layout plus one float32 scale per (slot,
combined head), [..., num_blocks, block_size, 2 * kv_heads]. Symmetric absmax
per token and head: scale = max|x| / 127 over head_dim, q = round(x / scale).
Per token, not per page, because a page fills one token at a time over many
steps: a per-page scale would have to requantize the page's earlier tokens
whenever a later one is larger, while a per-token scale makes each write
independent and exact to one rounding (|x - q * scale| <= scale / 2). The scale
is float32, not bf16: at head_dim 64 a (token, head) costs 64 + 4 bytes (1.88x
the tokens of bf16) against 64 + 2 with a bf16 scale (1.94x), 3% more tokens
(1.5% at head_dim 128) bought by a scale whose own rounding (2^-9 relative)
would add up to a quarter step to the largest elements and break the bound.
Being a NamedTuple, the pair flows through jit donation and lax.scan carries as
the single array does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, cast, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from kvsched.shapes import kv_bytes

if TYPE_CHECKING:
    from jax.sharding import NamedSharding
    from typing_extensions import TypeIs  # for mypy only: no runtime dependency

INT8_MAX = 127
SCALE_DTYPE = jnp.dtype(jnp.float32)


class QuantizedKV(NamedTuple):
    """An int8 KV cache: `values` int8 [..., P, bs, 2Hkv, D] and `scales`
    float32 [..., P, bs, 2Hkv]; element = values * scales[..., None]."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The values' shape (what a float cache's shape would be)."""
        return tuple(self.values.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes) + int(self.scales.nbytes)


KVCache = jax.Array | QuantizedKV
"""A KV cache: a float array, or an int8 QuantizedKV."""


class UnsupportedKVDtype(NotImplementedError):
    """A backend that cannot read this KV cache dtype."""


def is_quantized(cache: object) -> TypeIs[QuantizedKV]:
    return isinstance(cache, QuantizedKV)


def _check_dtype(dtype: DTypeLike) -> np.dtype[Any]:
    dt: np.dtype[Any] = jnp.dtype(dtype)
    if jnp.issubdtype(dt, jnp.integer) and dt != jnp.int8:
        raise ValueError(f"KV dtype {dt.name!r}: integer KV is int8 (with per-token scales) only")
    return dt


def element_and_scale_bytes(kv_dtype: DTypeLike) -> tuple[int, int]:
    """How this cache stores one element of `kv_dtype` (its itemsize) and what
    scale each token's K (or V) of one head carries (SCALE_DTYPE for int8, none
    for float KV): the dtype-dependent inputs of the KV-bytes formula."""
    dt = _check_dtype(kv_dtype)
    return dt.itemsize, (SCALE_DTYPE.itemsize if dt == jnp.int8 else 0)


def bytes_per_token_per_head(head_dim: int, kv_dtype: DTypeLike) -> int:
    """One token's K (or V) for one KV head: the elements, plus the scale for int8."""
    return kv_bytes_per_token(1, 1, head_dim, kv_dtype) // 2


def kv_bytes_per_token(
    n_layers: int, n_kv_heads: int, head_dim: int, kv_dtype: DTypeLike, *, tokens: int = 1
) -> int:
    """Bytes of KV cache one token (or `tokens` tokens: a page) takes over all
    layers (K and V, scales included for int8): what the pool is sized by.
    kv_dtype: a name ("float32", "bfloat16", "int8") or a dtype. The formula is
    kvsched.shapes.kv_bytes (written once, there, so the JAX-free capacity
    model counts the same bytes); this cache supplies the dtype's sizes."""
    element, scale = element_and_scale_bytes(kv_dtype)
    return int(kv_bytes(n_layers, n_kv_heads, head_dim, element, scale, tokens=tokens))


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    # A dtype or its name, made a np.dtype by __post_init__; "int8" is a QuantizedKV cache.
    dtype: DTypeLike = jnp.float32
    # [.., kv_heads, 2*head_dim]: the same bytes, one [K_h | V_h] row per head, the
    # layout the TPU kernel reads when head_dim is narrower than its 128 lanes.
    packed: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _check_dtype(self.dtype))
        if self.packed and self.quantized:
            raise UnsupportedKVDtype("an int8 KV cache is not stored packed")

    @property
    def quantized(self) -> bool:
        return bool(self.dtype == jnp.int8)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        if self.packed:
            return (self.num_blocks, self.block_size, self.kv_heads, 2 * self.head_dim)
        return (self.num_blocks, self.block_size, 2 * self.kv_heads, self.head_dim)

    @property
    def scales_shape(self) -> tuple[int, int, int]:
        return (self.num_blocks, self.block_size, 2 * self.kv_heads)

    @property
    def bytes_per_token_per_layer(self) -> int:
        return kv_bytes_per_token(1, self.kv_heads, self.head_dim, self.dtype)

    @property
    def bytes_per_layer(self) -> int:
        """What init_cache allocates (init_caches: layers times this)."""
        return kv_bytes_per_token(
            1, self.kv_heads, self.head_dim, self.dtype, tokens=self.num_blocks * self.block_size
        )


def _zeros(spec: KVCacheSpec, lead: tuple[int, ...]) -> jax.Array | QuantizedKV:
    if spec.quantized:
        return QuantizedKV(
            jnp.zeros((*lead, *spec.shape), jnp.int8),
            jnp.zeros((*lead, *spec.scales_shape), SCALE_DTYPE),
        )
    return jnp.zeros((*lead, *spec.shape), spec.dtype)


def init_cache(spec: KVCacheSpec) -> jax.Array | QuantizedKV:
    """A zeroed cache for one layer (a QuantizedKV for int8)."""
    return _zeros(spec, ())


def init_caches(spec: KVCacheSpec, layers: int) -> jax.Array | QuantizedKV:
    """Zeroed caches for every layer, stacked: [layers, *spec.shape] (both arrays
    of a QuantizedKV get the layer axis)."""
    return _zeros(spec, (layers,))


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric absmax int8 over the last axis: (int8 values, float32 scales of
    shape x.shape[:-1]). An all-zero vector gets scale 0 and values 0."""
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) / INT8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(xf / safe[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale.astype(SCALE_DTYPE)


@overload
def dequantize(
    cache: QuantizedKV | jax.Array, scales: None = None, dtype: DTypeLike = jnp.float32
) -> jax.Array: ...


@overload
def dequantize(
    cache: jax.Array, scales: jax.Array, dtype: DTypeLike = jnp.float32
) -> jax.Array: ...


def dequantize(
    cache: QuantizedKV | jax.Array, scales: jax.Array | None = None, dtype: DTypeLike = jnp.float32
) -> jax.Array:
    """values * scales[..., None] as `dtype`: `dequantize(qkv)` or
    `dequantize(values, scales)`. A float cache is returned as it is."""
    if scales is None:
        if not is_quantized(cache):
            return cache
        cache, scales = cache
    values = cast("jax.Array", cache)  # given `scales`, `cache` is the values (the overloads)
    return (values.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]).astype(dtype)


def interleave_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """[T, Hkv, D] K and V -> [T, 2 * Hkv, D] with K at even, V at odd heads."""
    t, h, d = k.shape
    return jnp.stack([k, v], axis=2).reshape(t, 2 * h, d)


@partial(jax.jit, donate_argnums=(0,))
def write_kv(
    cache: jax.Array | QuantizedKV, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> jax.Array | QuantizedKV:
    """Write K, V ([T, Hkv, D]) of each scheduled token at its slot; return the
    cache (donated: updated in place where the backend allows). An int8 cache
    quantizes on write; padding slots drop from values and scales alike."""
    kv = interleave_kv(k, v)
    if is_quantized(cache):
        values, scales = cache
        nb, bs, h2, d = values.shape
        q, s = quantize(kv)
        values = values.reshape(nb * bs, h2, d).at[slot_mapping].set(q, mode="drop")
        scales = scales.reshape(nb * bs, h2).at[slot_mapping].set(s, mode="drop")
        return QuantizedKV(values.reshape(nb, bs, h2, d), scales.reshape(nb, bs, h2))
    nb, bs, h2, d = cache.shape
    kv = kv.reshape(kv.shape[0], h2, d)  # a packed cache: [K_h | V_h] rows, same bytes
    flat = cache.reshape(nb * bs, h2, d)
    flat = flat.at[slot_mapping].set(kv.astype(cache.dtype), mode="drop")
    return flat.reshape(nb, bs, h2, d)


def write_kv_layer(
    caches: jax.Array | QuantizedKV,
    layer: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
) -> jax.Array | QuantizedKV:
    """Write layer `layer`'s new K, V into the stacked caches [L, P, bs, 2Hkv, D]
    (traced inside the model's layer scan: one scatter into the carried array,
    two for an int8 cache: values and scales)."""
    kv = interleave_kv(k, v)
    if is_quantized(caches):
        values, scales = caches
        nl, nb, bs, h2, d = values.shape
        q, s = quantize(kv)
        values = values.reshape(nl, nb * bs, h2, d).at[layer, slot_mapping].set(q, mode="drop")
        scales = scales.reshape(nl, nb * bs, h2).at[layer, slot_mapping].set(s, mode="drop")
        return QuantizedKV(values.reshape(nl, nb, bs, h2, d), scales.reshape(nl, nb, bs, h2))
    nl, nb, bs, h2, d = caches.shape
    kv = kv.reshape(kv.shape[0], h2, d)  # a packed cache: [K_h | V_h] rows, same bytes
    flat = caches.reshape(nl, nb * bs, h2, d)
    flat = flat.at[layer, slot_mapping].set(kv.astype(caches.dtype), mode="drop")
    return flat.reshape(nl, nb, bs, h2, d)


def cache_sharding(cache: jax.Array | QuantizedKV, values_sharding: NamedSharding) -> Any:
    """The sharding pytree for `cache` given its values' NamedSharding: a
    QuantizedKV's scales split like the values, less the head_dim axis. (Any: a
    NamedSharding, or a QuantizedKV whose two fields hold shardings, not arrays.)"""
    if not is_quantized(cache):
        return values_sharding
    from jax.sharding import NamedSharding, PartitionSpec

    spec = tuple(values_sharding.spec) + (None,) * (cache.values.ndim - len(values_sharding.spec))
    scales_sharding = NamedSharding(values_sharding.mesh, PartitionSpec(*spec[:-1]))
    # QuantizedKV(values_sharding, scales_sharding), built as the pytree it is: its
    # fields are typed as the arrays a cache holds.
    return jax.tree.unflatten(jax.tree.structure(cache), [values_sharding, scales_sharding])
