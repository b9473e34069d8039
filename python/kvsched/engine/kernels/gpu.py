"""The GPU (Triton) variant of kvsched's ragged paged attention kernel.

Same algorithm as kernels/tpu.py (query blocks over the padded token
dimension; per block, every sequence it meets, page by page, into an online
softmax), with one program per (query block, KV head), written for Pallas'
Triton backend: no scalar prefetch or DMA there,
so the plan arrays and the cache are plain refs in global memory, read with
dynamic indices (a page's K and V of one head at a time). Shapes Triton tiles
need powers of two: block_size, head_dim and block_q * (Hq / Hkv) >= 16.
On CPU it runs in Pallas' generic interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kvsched.engine.inputs import AttentionInputs
from kvsched.engine.kernels.common import MASK, run_padded

HIGHEST = lax.Precision.HIGHEST


# A kernel's refs are typed jax.Ref (Pallas hands the kernel references, read and
# written by indexing); the online softmax carries (max, denominator, accumulator)
# per query head of the group.
_Carry = tuple[tuple[jax.Array, jax.Array, jax.Array], ...]


def _kernel(kv_lens_ref: jax.Ref, pages_ref: jax.Ref, cu_ref: jax.Ref, nseq_ref: jax.Ref,
            q_ref: jax.Ref, cache_ref: jax.Ref, o_ref: jax.Ref, *,
            block_q: int, group: int, pages_per_seq: int, scale: float) -> None:  # fmt: skip
    # One program per (query block, KV head): a decode-heavy step still has
    # Hkv times more programs than query blocks to spread over the GPU.
    # Triton lowers no value slicing, stacking or reshapes: every query head is
    # loaded and stored through its own ref index, the carry is a tuple per head.
    bs, d = cache_ref.shape[1], cache_ref.shape[3]
    kh = pl.program_id(1)
    row0 = pl.program_id(0) * block_q
    token = row0 + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    qs = [q_ref[:, g, :].astype(jnp.float32) * scale for g in range(group)]
    carry0 = tuple(
        (
            jnp.full((block_q, 1), MASK, jnp.float32),
            jnp.zeros((block_q, 1), jnp.float32),
            jnp.zeros((block_q, d), jnp.float32),
        )
        for _ in range(group)
    )

    def seq_body(j: jax.Array, carry: _Carry) -> _Carry:
        q_lo, q_hi, kv_len = cu_ref[j], cu_ref[j + 1], kv_lens_ref[j]
        meets = jnp.logical_and(q_lo < row0 + block_q, q_hi > row0)
        in_seq = jnp.logical_and(token >= q_lo, token < q_hi)
        pos = kv_len - (q_hi - token)
        # A sequence that misses the block runs no page (a cond-free skip).
        n_pages = jnp.where(meets, lax.div(kv_len + bs - 1, bs), 0)

        def page_body(p: jax.Array, carry: _Carry) -> _Carry:
            page = pages_ref[j * pages_per_seq + p]
            key = p * bs + lax.broadcasted_iota(jnp.int32, (1, bs), 1)
            ok = in_seq & (key <= pos) & (key < kv_len)
            live = jnp.transpose(key < kv_len)  # [bs, 1]: stale slots past kv_len
            k = cache_ref[page, :, 2 * kh, :].astype(jnp.float32)
            v = jnp.where(live, cache_ref[page, :, 2 * kh + 1, :].astype(jnp.float32), 0.0)
            new = []
            for g in range(group):
                m, denom, acc = carry[g]
                # HIGHEST: f32 dots would otherwise run as TF32 (~1e-3).
                s = jnp.where(ok, pltriton.dot(qs[g], k, trans_b=True, precision=HIGHEST), MASK)
                m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
                alpha = jnp.exp(m - m_new)
                w = jnp.where(ok, jnp.exp(s - m_new), 0.0)
                new.append(
                    (
                        m_new,
                        alpha * denom + jnp.sum(w, axis=1, keepdims=True),
                        alpha * acc + pltriton.dot(w, v, precision=HIGHEST),
                    )
                )
            return tuple(new)

        carry_out: _Carry = lax.fori_loop(0, n_pages, page_body, carry)
        return carry_out

    final = lax.fori_loop(0, nseq_ref[0], seq_body, carry0)
    for g in range(group):
        _, denom, acc = final[g]
        # Rows that attend to nothing (padding) are 0; a NaN denominator (NaN
        # weights or activations) stays NaN, so the engine sees it, not a 0.
        out = jnp.where(denom == 0, 0.0, acc / jnp.where(denom == 0, 1.0, denom))
        o_ref[:, g, :] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "interpret"))
def _call(
    q: jax.Array,
    cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    scale: float,
    block_q: int,
    interpret: bool,
) -> jax.Array:
    t, hq, d = q.shape
    hkv = cache.shape[2] // 2
    group = hq // hkv
    s, pps = page_indices.shape
    kernel = functools.partial(_kernel, block_q=block_q, group=group, pages_per_seq=pps,
                               scale=scale)  # fmt: skip

    def full(shape: tuple[int, ...]) -> pl.BlockSpec:
        return pl.BlockSpec(shape, lambda b, h: (0,) * len(shape))

    heads = pl.BlockSpec((block_q, group, d), lambda b, h: (b, h, 0))
    out: jax.Array = pl.pallas_call(
        kernel,
        grid=(t // block_q, hkv),
        in_specs=[
            full((s,)),
            full((s * pps,)),
            full((s + 1,)),
            full((1,)),
            heads,
            full(cache.shape),
        ],  # fmt: skip
        out_specs=heads,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        # Triton explicitly: this JAX defaults GPU kernels to Mosaic GPU.
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="kvsched_ragged_paged_attention_gpu",
    )(kv_lens, page_indices.reshape(s * pps), cu_q_lens, num_seqs, q, cache)
    return out


def ragged_paged_attention_gpu(
    q: jax.Array,
    cache: jax.Array,
    inputs: AttentionInputs,
    *,
    scale: float,
    block_q: int = 16,
    interpret: bool | None = None,
) -> jax.Array:
    """As kernels.tpu.ragged_paged_attention, for NVIDIA GPUs (Triton)."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return run_padded(_call, q, cache, inputs, scale=scale, block_q=block_q, interpret=interpret)
