"""kvsched's ragged paged attention kernel (Pallas, TPU / Mosaic).

One call serves a whole step plan: decode sequences (one query token each) and
prefill chunks (many), ragged in the token dimension, reading K/V from the paged
cache. The grid walks the padded token dimension in blocks of `block_q` rows;
for each block the kernel visits every sequence whose rows meet the block and,
page by page (a DMA of one page from HBM into VMEM), folds the page into an
online softmax per (row, head). Rows of other sequences are masked, so a block
that straddles sequences is still exact; padding rows come out 0.

Written for Mosaic: scalar-prefetched plan arrays in SMEM, the cache left in HBM
(`memory_space=ANY`) and copied a page at a time, 2-D matmuls per KV head, K
and V separated on the loaded value (the interpreter allows only plain ref
indexing). Pages are double-buffered: the DMA of a sequence's next page runs
while the current one is folded in. On CPU it runs in Pallas' TPU interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvsched.engine.attention import MASK, AttentionInputs


def _kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref,
    pages_ref,
    cu_ref,
    nseq_ref,
    # Blocks.
    q_ref,  # [block_q, Hq, D]
    cache_hbm,  # [P, bs, 2*Hkv, D], in HBM
    o_ref,  # [block_q, Hq, D]
    # Scratch.
    kv_buf,  # [2, bs, 2*Hkv, D] VMEM: two page slots (double buffering)
    sem,  # two DMA semaphores, one per slot
    *,
    block_q: int,
    kv_heads: int,
    group: int,
    pages_per_seq: int,
    scale: float,
):
    bs = kv_buf.shape[1]
    d = kv_buf.shape[3]
    rows_per_head = block_q * group
    row0 = pl.program_id(0) * block_q
    # Query row r * group + g is token row0 + r, query head h * group + g.
    # (lax.div: truncating division of non-negative ints; jnp's floor division
    # lowers through sign(), which Mosaic only has per TPU generation.)
    token = row0 + lax.div(lax.broadcasted_iota(jnp.int32, (rows_per_head, 1), 0), group)
    q = q_ref[...].astype(jnp.float32)
    qs = [
        q[:, h * group : (h + 1) * group, :].reshape(rows_per_head, d) * scale
        for h in range(kv_heads)
    ]
    m0 = jnp.full((kv_heads, rows_per_head, 1), MASK, jnp.float32)
    l0 = jnp.zeros((kv_heads, rows_per_head, 1), jnp.float32)
    acc0 = jnp.zeros((kv_heads, rows_per_head, d), jnp.float32)

    def seq_body(j, carry):
        q_lo, q_hi = cu_ref[j], cu_ref[j + 1]
        meets = jnp.logical_and(q_lo < row0 + block_q, q_hi > row0)

        def run(carry):
            kv_len = kv_lens_ref[j]
            in_seq = jnp.logical_and(token >= q_lo, token < q_hi)
            pos = kv_len - (q_hi - token)  # the row's absolute position
            n_pages = lax.div(kv_len + bs - 1, bs)

            def fetch(p, slot):
                page = pages_ref[j * pages_per_seq + p]
                return pltpu.make_async_copy(cache_hbm.at[page], kv_buf.at[slot], sem.at[slot])

            def page_body(p, carry):
                m, denom, acc = carry
                # Double buffering: the next page's DMA runs while this one is used.
                slot = lax.rem(p, 2)

                @pl.when(p + 1 < n_pages)
                def _():
                    fetch(p + 1, 1 - slot).start()

                fetch(p, slot).wait()
                kv = kv_buf[slot].astype(jnp.float32)
                key = p * bs + lax.broadcasted_iota(jnp.int32, (1, bs), 1)
                ok = in_seq & (key <= pos) & (key < kv_len)  # [rows, bs]
                ms, ls, accs = [], [], []
                # Slots past kv_len hold a previous owner's data: zero V there
                # (a 0 weight times inf is NaN); K only meets masked scores.
                live = jnp.transpose(key < kv_len)  # [bs, 1]
                for h in range(kv_heads):
                    k = kv[:, 2 * h, :]
                    v = jnp.where(live, kv[:, 2 * h + 1, :], 0.0)
                    s = lax.dot_general(
                        qs[h], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                    )
                    s = jnp.where(ok, s, MASK)
                    m_new = jnp.maximum(m[h], jnp.max(s, axis=1, keepdims=True))
                    alpha = jnp.exp(m[h] - m_new)
                    w = jnp.where(ok, jnp.exp(s - m_new), 0.0)
                    ls.append(alpha * denom[h] + jnp.sum(w, axis=1, keepdims=True))
                    accs.append(
                        alpha * acc[h]
                        + lax.dot_general(
                            w, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
                        )
                    )
                    ms.append(m_new)
                return jnp.stack(ms), jnp.stack(ls), jnp.stack(accs)

            @pl.when(n_pages > 0)
            def _():
                fetch(0, 0).start()

            return lax.fori_loop(0, n_pages, page_body, carry)

        return lax.cond(meets, run, lambda c: c, carry)

    _, denom, acc = lax.fori_loop(0, nseq_ref[0], seq_body, (m0, l0, acc0))
    out = jnp.where(denom > 0, acc / jnp.where(denom > 0, denom, 1.0), 0.0)  # [Hkv, rows, D]
    for h in range(kv_heads):
        o_ref[:, h * group : (h + 1) * group, :] = (
            out[h].reshape(block_q, group, d).astype(o_ref.dtype)
        )


def on_tpu() -> bool:
    return jax.default_backend() == "tpu"


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "interpret"))
def _call(q, cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, scale, block_q, interpret):
    t, hq, d = q.shape
    _, bs, h2, _ = cache.shape
    hkv = h2 // 2
    s, pps = page_indices.shape
    kernel = functools.partial(
        _kernel, block_q=block_q, kv_heads=hkv, group=hq // hkv, pages_per_seq=pps, scale=scale
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(t // block_q,),
        in_specs=[
            pl.BlockSpec((block_q, hq, d), lambda b, *_: (b, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((block_q, hq, d), lambda b, *_: (b, 0, 0)),
        scratch_shapes=[pltpu.VMEM((2, bs, h2, d), cache.dtype), pltpu.SemaphoreType.DMA((2,))],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="kvsched_ragged_paged_attention",
    )(kv_lens, page_indices.reshape(s * pps), cu_q_lens, num_seqs, q, cache)


def ragged_paged_attention(
    q: jax.Array,
    cache: jax.Array,
    inputs: AttentionInputs,
    *,
    scale: float,
    block_q: int = 8,
    interpret: bool | None = None,
) -> jax.Array:
    """q [T, Hq, D], cache [P, bs, 2*Hkv, D] -> [T, Hq, D]. T need not be a
    multiple of block_q (zero rows pad it; they lie past the plan's tokens and
    come out 0). `interpret` defaults to True off TPU (the TPU interpreter)."""
    if interpret is None:
        interpret = not on_tpu()
    if not interpret and q.shape[-1] % 128:
        raise ValueError(f"head_dim {q.shape[-1]} must be a multiple of 128 on TPU (lane width)")
    return run_padded(_call, q, cache, inputs, scale=scale, block_q=block_q, interpret=interpret)


def run_padded(call, q, cache, inputs: AttentionInputs, *, scale, block_q, interpret):
    """Run a kernel `call` whose grid walks query blocks: check the head
    grouping, pad the rows to a multiple of block_q (the zero rows lie past the
    plan's tokens and come out 0), slice the padding off again."""
    t, hq, _ = q.shape
    hkv = cache.shape[2] // 2
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
    pad = -t % block_q
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0))) if pad else q
    out = call(
        qp, cache, inputs.kv_lens, inputs.page_indices, inputs.cu_q_lens, inputs.num_seqs,
        scale=scale, block_q=block_q, interpret=bool(interpret),
    )  # fmt: skip
    return out[:t] if pad else out
