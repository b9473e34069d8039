"""The reference attention kernels: pure jnp with static shapes (runs anywhere,
reads float and int8 caches), and a float64 numpy oracle for tests.

For each scheduled token t of sequence s (the tokens of s are rows
cu_q_lens[s]:cu_q_lens[s+1], the last q_len of its kv_lens[s]):
softmax(q_t . K_s^T * scale, causal) . V_s over the first kv_lens[s] positions
of s's pages, with grouped-query attention (query head h reads KV head
h // (Hq / Hkv)). Rows past the plan's tokens are padding: their output is 0.
A sliding-window layer (W) attends keys [max(0, pos - W + 1), pos] only, a
soft cap squashes the logits, sinks add a per-head logit to the denominator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvsched.engine.inputs import AttentionInputs
from kvsched.engine.kernels.common import MASK, check_soft_cap, check_window, window_start
from kvsched.engine.kernels.tiling import window_pages
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
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q [T, Hq, D], cache [P, bs, 2*Hkv, D] -> [T, Hq, D]. Static shapes: each
    row gathers its sequence's whole page row, then masks. With `layer`, cache
    is the stacked [L, P, ...] array and layer `layer` is read (one gather: the
    layer is never sliced out whole). An int8 `QuantizedKV` cache gathers the
    rows' pages of values and of scales the same way and dequantizes them to
    float32 before the same math.

    With `sliding_window` W, each row gathers only the `tiling.window_pages(W,
    bs)` pages from its window's first (the page holding max(0, pos - W + 1)):
    pages before it (the null page 0 of a window group's table) are never
    read. `soft_cap` c: logits = c * tanh(logits / c) before masking. `sinks`
    [Hq]: a learned logit per query head that joins the softmax denominator
    only (gpt-oss)."""
    window, soft_cap = check_window(sliding_window), check_soft_cap(soft_cap)
    t, hq, d = q.shape
    # K/V heads per token: 2*Hkv rows of D, or Hkv packed [K | V] rows of 2*D (the
    # same bytes: row-major, the reshape below reads either).
    h2 = cache.shape[-2] * cache.shape[-1] // d
    hkv = h2 // 2
    g = hq // hkv
    bs = cache.shape[-3]
    seq, valid = token_seq(inputs.cu_q_lens, inputs.num_seqs, t)
    pos = inputs.positions
    pps = inputs.page_indices.shape[1]
    if window is None:
        pages = inputs.page_indices[seq]  # [T, PPS]
        key_pos = jnp.arange(pps * bs, dtype=jnp.int32)[None, :]  # [1, L]
    else:
        # The row's window starts in page `first`; it spans at most n pages.
        # Blocks past the page row (a window near its end) read its last entry
        # again: their keys lie past kv_len and are masked.
        n = min(pps, window_pages(window, bs))
        first = window_start(pos, window) // bs
        blocks = jnp.minimum(first[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :], pps - 1)
        pages = inputs.page_indices[seq[:, None], blocks]  # [T, n]
        key_pos = first[:, None] * bs + jnp.arange(n * bs, dtype=jnp.int32)[None, :]  # [T, L]

    def gather(a: jax.Array) -> jax.Array:  # [T, n, bs, 2Hkv(, D)]
        return a[pages] if layer is None else a[layer, pages]

    if is_quantized(cache):
        kv = dequantize(gather(cache.values), gather(cache.scales))
    else:
        kv = gather(cache)
    kv = kv.reshape(t, -1, h2, d)  # [T, n * bs, 2Hkv, D]
    k, v = kv[:, :, 0::2, :], kv[:, :, 1::2, :]  # [T, L, Hkv, D]
    qg = q.reshape(t, hkv, g, d).astype(jnp.float32)
    s = jnp.einsum("thgd,tlhd->thgl", qg, k.astype(jnp.float32)) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    kv_len = inputs.kv_lens[seq]
    in_seq = key_pos < kv_len[:, None]  # [T, L]
    allowed = (key_pos <= pos[:, None]) & in_seq & valid[:, None]
    if window is not None:
        allowed = allowed & (key_pos >= window_start(pos, window)[:, None])
    s = jnp.where(allowed[:, None, None, :], s, MASK)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, hkv, g, 1)
        m = jnp.maximum(m, sink)
    p = jnp.where(allowed[:, None, None, :], jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        # The sink's weight joins the denominator only (no value row).
        denom = denom + jnp.exp(sink - m)
    # V past kv_len is whatever a page's previous owner left (inf or NaN after an
    # overflow; for int8, a garbage scale): a 0 weight times it would still be
    # NaN, so zero those rows (the window's first page holds this sequence's
    # own earlier tokens before the window start: finite).
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
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """The same in float64 numpy, one sequence at a time, no tricks. An int8
    `QuantizedKV` cache is dequantized exactly (float64) first. A row at
    position p attends keys [max(0, p - W + 1), p] with `sliding_window` W (None
    or 0: [0, p]); only the pages holding those keys are read."""
    window = check_window(sliding_window)
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
        for row in range(lo, hi):
            pos = int(positions[row])
            start = 0 if window is None else max(0, pos - window + 1)
            keys = np.arange(start, min(pos + 1, kv_len))
            kv = cache[page_indices[s][keys // bs], keys % bs]  # [keys, 2Hkv, D]
            k, v = kv[:, 0::2], kv[:, 1::2]
            for h in range(hq):
                w = k[:, h // g] @ q[row, h] * scale
                if soft_cap is not None:
                    w = soft_cap * np.tanh(w / soft_cap)
                top = w.max() if sinks is None else max(w.max(), float(sinks[h]))
                e = np.exp(w - top)
                denom = e.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - top))
                out[row, h] = (e / denom) @ v[:, h // g]
    return out
