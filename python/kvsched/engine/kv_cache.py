"""Paged KV cache arrays.

One array per layer, shaped [num_blocks, block_size, 2 * kv_heads, head_dim]
(the engine stacks the layers: [layers, num_blocks, ...], `init_caches`):
K of head h at combined index 2h, V at 2h + 1, so one page holds both and a
kernel fetches a page's K and V in one copy. New K/V are written at the plan's
`slot_mapping` (page * block_size + offset) by a jitted scatter whose cache
argument is donated; padded slots point one past the end and `mode="drop"`
makes their writes vanish (a -1 would wrap and overwrite the last slot).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: jnp.dtype = jnp.float32

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.block_size, 2 * self.kv_heads, self.head_dim)

    @property
    def bytes_per_layer(self) -> int:
        return (
            self.num_blocks
            * self.block_size
            * 2
            * self.kv_heads
            * self.head_dim
            * jnp.dtype(self.dtype).itemsize
        )


def init_cache(spec: KVCacheSpec) -> jax.Array:
    """A zeroed cache for one layer."""
    return jnp.zeros(spec.shape, spec.dtype)


def init_caches(spec: KVCacheSpec, layers: int) -> jax.Array:
    """Zeroed caches for every layer, stacked: [layers, *spec.shape]."""
    return jnp.zeros((layers, *spec.shape), spec.dtype)


def interleave_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """[T, Hkv, D] K and V -> [T, 2 * Hkv, D] with K at even, V at odd heads."""
    t, h, d = k.shape
    return jnp.stack([k, v], axis=2).reshape(t, 2 * h, d)


@partial(jax.jit, donate_argnums=(0,))
def write_kv(cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Write K, V ([T, Hkv, D]) of each scheduled token at its slot; return the
    cache (donated: updated in place where the backend allows)."""
    nb, bs, h2, d = cache.shape
    flat = cache.reshape(nb * bs, h2, d)
    kv = interleave_kv(k, v).astype(cache.dtype)
    flat = flat.at[slot_mapping].set(kv, mode="drop")
    return flat.reshape(nb, bs, h2, d)


def write_kv_layer(
    caches: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> jax.Array:
    """Write layer `layer`'s new K, V into the stacked caches [L, P, bs, 2Hkv, D]
    (traced inside the model's layer scan: one scatter into the carried array)."""
    nl, nb, bs, h2, d = caches.shape
    flat = caches.reshape(nl, nb * bs, h2, d)
    kv = interleave_kv(k, v).astype(caches.dtype)
    flat = flat.at[layer, slot_mapping].set(kv, mode="drop")
    return flat.reshape(nl, nb, bs, h2, d)
