"""Attention over the paged KV cache, driven by a kvsched step plan.

Every backend computes, for each scheduled token t of sequence s (the tokens of
s are rows cu_q_lens[s]:cu_q_lens[s+1], the last q_len of its kv_lens[s]),
softmax(q_t . K_s^T * scale, causal) . V_s over the first kv_lens[s] positions
of s's pages, with grouped-query attention (query head h reads KV head
h // (Hq / Hkv)). Rows past the plan's tokens are padding: their output is 0.

Backends: `reference` (pure jnp, static shapes), `pallas` (kvsched's kernel for
TPU, pallas_attention.py; on an NVIDIA GPU it picks the Triton variant) and
`pallas_gpu` (the Triton variant, pallas_gpu.py); `oracle_attention` is a
float64 numpy oracle for tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvsched.engine.kv_cache import QuantizedKV, UnsupportedKVDtype, dequantize, is_quantized

MASK = -1e30  # finite: exp(MASK - MASK) would be 1, so masks use where, never arithmetic


@dataclass(frozen=True)
class AttentionInputs:
    """The plan arrays attention reads (all int32)."""

    positions: Any  # [T]
    cu_q_lens: Any  # [S + 1]
    kv_lens: Any  # [S]
    page_indices: Any  # [S, PPS]
    num_seqs: Any  # [1]

    @classmethod
    def from_plan(cls, plan: Any) -> AttentionInputs:
        return cls(
            positions=jnp.asarray(plan.positions),
            cu_q_lens=jnp.asarray(plan.cu_q_lens),
            kv_lens=jnp.asarray(plan.kv_lens),
            page_indices=jnp.asarray(plan.page_indices),
            num_seqs=jnp.asarray(plan.num_seqs),
        )


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
    o = jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)
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


def paged_attention(
    q: jax.Array,
    cache: jax.Array | QuantizedKV,
    inputs: AttentionInputs,
    *,
    scale: float,
    backend: str = "reference",
    mesh: Any = None,
    layer: jax.Array | int | None = None,
    **kw: Any,
) -> jax.Array:
    """Attention for a plan with the named backend ("reference" or "pallas").
    With `layer`, `cache` is the stacked [L, P, bs, 2*Hkv, D] array of every
    layer and layer `layer` is read. With a mesh, the Pallas kernel runs once per
    device on its own KV heads (shard_map); the reference is left to XLA's
    partitioner. An int8 `QuantizedKV` cache is read by the reference only."""
    if backend == "reference":
        return reference_attention(q, cache, inputs, scale=scale, layer=layer)
    if is_quantized(cache) and backend in ("pallas", "pallas_gpu"):
        raise UnsupportedKVDtype(
            f"attention backend {backend!r} cannot read an int8 KV cache: int8 KV is "
            "supported by the reference backend; the Pallas kernels read float caches "
            "(use backend='reference' or a float32/bfloat16 kv_dtype)"
        )
    if backend == "pallas" and mesh is None and jax.default_backend() == "tpu":
        from kvsched.engine.pallas_attention import ragged_paged_attention

        # On TPU the kernel reads the stacked cache at `layer`: no layer is copied
        # out. (The CPU interpreter copies a kernel's whole operands per call, so
        # there one layer's slice is much cheaper.)
        return ragged_paged_attention(q, cache, inputs, scale=scale, layer=layer, **kw)
    if layer is not None:
        # The GPU kernel and the sharded path take one layer's cache.
        cache = jax.lax.dynamic_index_in_dim(cache, layer, axis=0, keepdims=False)
    if backend == "pallas" and mesh is not None:
        from jax.sharding import PartitionSpec as P

        from kvsched.engine.sharding import AXIS

        def local(q_, cache_, *plan):
            return paged_attention(q_, cache_, AttentionInputs(*plan), scale=scale,
                                   backend="pallas", **kw)  # fmt: skip

        plan = (inputs.positions, inputs.cu_q_lens, inputs.kv_lens, inputs.page_indices,
                inputs.num_seqs)  # fmt: skip
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(None, AXIS, None), P(None, None, AXIS, None)) + (P(),) * len(plan),
            out_specs=P(None, AXIS, None),
            check_vma=False,
        )(q, cache, *plan)
    if backend == "pallas" and jax.default_backend() == "gpu":
        backend = "pallas_gpu"
    if backend == "pallas":
        from kvsched.engine.pallas_attention import ragged_paged_attention

        return ragged_paged_attention(q, cache, inputs, scale=scale, **kw)
    if backend == "pallas_gpu":
        from kvsched.engine.pallas_gpu import ragged_paged_attention_gpu

        return ragged_paged_attention_gpu(q, cache, inputs, scale=scale, **kw)
    raise ValueError(f"unknown attention backend {backend!r} (reference, pallas, pallas_gpu)")
