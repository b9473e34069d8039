"""The reference attention kernels: pure jnp with static shapes (runs anywhere,
reads float and int8 caches), and a float64 numpy oracle for tests.

For each scheduled token t of sequence s (the tokens of s are rows
cu_q_lens[s]:cu_q_lens[s+1], the last q_len of its kv_lens[s]):
softmax(q_t . K_s^T * scale, causal) . V_s over the first kv_lens[s] positions
of s's pages, with grouped-query attention (query head h reads KV head
h // (Hq / Hkv)). Rows past the plan's tokens are padding: their output is 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvsched.engine.inputs import AttentionInputs
from kvsched.engine.kernels.common import MASK
from kvsched.engine.kv_cache import QuantizedKV, dequantize, is_quantized


def token_seq(cu_q_lens: jax.Array, num_seqs: jax.Array, t: int) -> tuple[jax.Array, jax.Array]:
    """For each of `t` token rows: its sequence and whether it is a real token."""
    rows = jnp.arange(t, dtype=jnp.int32)
    n = num_seqs[0]
    # Sequence s owns rows [cu[s], cu[s+1]); padding of cu repeats the last value.
    seq = jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32)
    valid = rows < cu_q_lens[n]
    return jnp.minimum(seq, cu_q_lens.shape[0] - 2), valid


def reference_attention(
    q: jax.Array,
    cache: jax.Array | QuantizedKV,
    inputs: AttentionInputs,
    *,
    scale: float,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """q [T, Hq, D], cache [P, bs, 2*Hkv, D] -> [T, Hq, D]. Static shapes: each
    row gathers its sequence's whole page row, then masks. With `layer`, cache
    is the stacked [L, P, ...] array and layer `layer` is read (one gather: the
    layer is never sliced out whole). An int8 `QuantizedKV` cache gathers the
    rows' pages of values and of scales the same way and dequantizes them to
    float32 before the same math."""
    t, hq, d = q.shape
    # K/V heads per token: 2*Hkv rows of D, or Hkv packed [K | V] rows of 2*D (the
    # same bytes: row-major, the reshape below reads either).
    h2 = cache.shape[-2] * cache.shape[-1] // d
    hkv = h2 // 2
    g = hq // hkv
    seq, valid = token_seq(inputs.cu_q_lens, inputs.num_seqs, t)
    pages = inputs.page_indices[seq]  # [T, PPS]

    def gather(a: jax.Array) -> jax.Array:  # [T, PPS, bs, 2Hkv(, D)]
        return a[pages] if layer is None else a[layer, pages]

    if is_quantized(cache):
        kv = dequantize(gather(cache.values), gather(cache.scales))
    else:
        kv = gather(cache)
    kv = kv.reshape(t, -1, h2, d)  # [T, L, 2Hkv, D]
    k, v = kv[:, :, 0::2, :], kv[:, :, 1::2, :]  # [T, L, Hkv, D]
    qg = q.reshape(t, hkv, g, d).astype(jnp.float32)
    s = jnp.einsum("thgd,tlhd->thgl", qg, k.astype(jnp.float32)) * scale
    key_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    kv_len = inputs.kv_lens[seq]
    allowed = (key_pos[None, :] <= inputs.positions[:, None]) & (key_pos[None, :] < kv_len[:, None])
    allowed = allowed & valid[:, None]
    s = jnp.where(allowed[:, None, None, :], s, MASK)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(allowed[:, None, None, :], jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    # V past kv_len is whatever a page's previous owner left (inf or NaN after an
    # overflow; for int8, a garbage scale): a 0 weight times it would still be
    # NaN, so zero those rows.
    in_seq = key_pos[None, :] < kv_len[:, None]  # [T, L]
    v = jnp.where(in_seq[:, :, None, None], v.astype(jnp.float32), 0.0)
    o = jnp.einsum("thgl,tlhd->thgd", p, v)
    # Rows that attend to nothing (padding) are 0; a NaN denominator (NaN
    # weights or activations) stays NaN, so the engine sees it, not a 0.
    o = jnp.where(denom == 0, 0.0, o / jnp.where(denom == 0, 1.0, denom))
    return o.reshape(t, hq, d).astype(q.dtype)


def oracle_attention(
    q: np.ndarray,
    cache: np.ndarray | QuantizedKV,
    positions: np.ndarray,
    cu_q_lens: np.ndarray,
    kv_lens: np.ndarray,
    page_indices: np.ndarray,
    num_seqs: int,
    *,
    scale: float,
) -> np.ndarray:
    """The same in float64 numpy, one sequence at a time, no tricks. An int8
    `QuantizedKV` cache is dequantized exactly (float64) first."""
    q = np.asarray(q, np.float64)
    if is_quantized(cache):
        values, scales = (np.asarray(a, np.float64) for a in cache)
        cache = values * scales[..., None]
    cache = np.asarray(cache, np.float64)
    t, hq, d = q.shape
    _, bs, h2, _ = cache.shape
    hkv = h2 // 2
    g = hq // hkv
    out = np.zeros((t, hq, d))
    for s in range(num_seqs):
        lo, hi, kv_len = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        pages = page_indices[s][: -(-kv_len // bs)]
        kv = cache[pages].reshape(-1, h2, d)[:kv_len]
        k, v = kv[:, 0::2], kv[:, 1::2]
        for row in range(lo, hi):
            pos = int(positions[row])
            for h in range(hq):
                kh = k[: pos + 1, h // g]
                w = kh @ q[row, h] * scale
                w = np.exp(w - w.max())
                out[row, h] = (w / w.sum()) @ v[: pos + 1, h // g]
    return out
