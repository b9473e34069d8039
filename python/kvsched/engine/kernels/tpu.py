"""kvsched's ragged paged attention kernel (Pallas, TPU / Mosaic).

One call serves a whole step plan: decode sequences (one query token each) and
prefill chunks (many), ragged in the token dimension, reading K/V from the paged
cache. The grid walks the padded token dimension in blocks of `block_q` rows;
for each block the kernel visits every sequence whose rows meet the block and,
page by page (a DMA of one page from HBM into VMEM), folds the page into an
online softmax per (row, head). Rows of other sequences are masked, so a block
that straddles sequences is still exact; padding rows come out 0.

Written for Mosaic: scalar-prefetched plan arrays in SMEM, the cache left in HBM
(`memory_space=ANY`) and copied a page at a time, 2-D matmuls per KV head, one
K/V row per head loaded from the page buffer by plain ref indexing (the
interpreter allows nothing fancier). Pages are double-buffered: the DMA of a
sequence's next page runs while the current one is folded in. On CPU it runs in
Pallas' TPU interpret mode.

Query layout. q [T, Hq, D] is regrouped outside the kernel (an XLA transpose of
q, which is small) to [Hkv, T * group, D]: row r * group + g of KV head h is
token r, query head h * group + g. A block is then [Hkv, block_q * group, D], the
GQA group is the matmul's M dimension, and each KV head reads and writes whole
[rows, D] tiles: no reshape or sublane-offset slice inside the kernel. The
output comes back in the same layout and is regrouped to [T, Hq, D].

Head dims that are not a multiple of the 128-lane width (SmolLM2-135M: 64).
TPU tiles the minor dimension of every array by 128 lanes, in HBM as in VMEM.
Padding q with zeros along D leaves q.k unchanged if K is zero-padded too, and
zero-padded V only adds zero output columns to slice off; but padding the cache
per call would copy the whole cache every step, and a cache stored as
[P, bs, 2*Hkv, 64] is already half lane padding in HBM (half the pages the
memory holds, and every page DMA moves the padding). So the kernel reads two
cache layouts, told apart by the cache's last dimension, and never copies the
cache:

- "split", [P, bs, 2*Hkv, D] (the step-plan layout: K of head h at 2h, V at
  2h + 1): K and V are separate rows of D lanes. Lane-dense when D % 128 == 0,
  the only case accepted on a TPU.
- "packed", [P, bs, Hkv, 2*D]: the same bytes in row-major order (K_h, V_h
  adjacent), viewed as one row [K_h | V_h] per head, so for D = 64 a page row
  is exactly 128 lanes and nothing is padded anywhere. This is the layout
  production TPU kernels use for head_dim 64 (tpu-inference's hd64 variant).
  For D % 128 != 0, q is zero-padded per call to 2*D lanes, [q | 0] (cheap: q
  is [T, Hq, D]); then s = [q | 0] . [K | V] = q . K exactly, and
  w . [K | V] = [w.K | w.V], whose right half is the output (the left half is
  discarded). The MXU contracts and produces 128 lanes per pass anyway, so the
  padded halves cost no extra matmul passes at D = 64. For D % 128 == 0 the
  row is split at lane D instead (aligned slices, no padding). On a TPU this
  layout needs 2*D % 128 == 0 (D = 64, 128, 192, ...).

On CPU and GPU the two layouts are a free reshape of each other (`pack_cache`);
on TPU they are different tilings, so an engine serving D = 64 there should
allocate and write its cache packed (write K|V concatenated along lanes at the
slot) and pass it as is. Stale inf/NaN in a slot past kv_len are harmless in
both layouts: V (in packed mode the whole row) is zeroed there before the PV
product and the scores there are masked with `where`. The softmax scale is the
caller's (the real head_dim**-0.5), never derived from the padded width.

Layers. With `layer`, the cache is the engine's stacked [L, P, bs, ...] array
and layer `layer` (a scalar-prefetch argument, traceable inside a lax.scan)
is read page by page from cache.at[layer, page]: the layer is never sliced out
(which would copy a whole layer's cache per layer per step). Without it a
single layer's cache is viewed as L = 1 (a free leading unit dimension).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvsched.engine.inputs import AttentionInputs
from kvsched.engine.kernels.common import MASK, run_padded
from kvsched.engine.kernels.layout import cache_mode, checked_cache_mode, on_tpu

if TYPE_CHECKING:
    # make_async_copy's result type: jax.experimental.pallas.tpu does not export it.
    from jax._src.pallas.mosaic.primitives import AsyncCopyDescriptor

# A kernel's refs (q_ref, cache_hbm, kv_buf, ...) are typed jax.Ref: Pallas hands
# the kernel references, read and written by indexing; the running state of the
# online softmax is a triple of arrays.
_Carry = tuple[jax.Array, jax.Array, jax.Array]


def _kv_rows(
    kv_buf: jax.Ref, slot: jax.Array, h: int, mode: str, d: int
) -> tuple[jax.Array, jax.Array]:
    """K and V rows ([bs, *]) of KV head h from page slot `slot` of the buffer."""
    if mode == "split":  # [bs, 2*Hkv, D]: K at 2h, V at 2h + 1
        return kv_buf[slot, :, 2 * h, :], kv_buf[slot, :, 2 * h + 1, :]
    row = kv_buf[slot, :, h, :]  # [bs, 2*D] = [K_h | V_h]
    if mode == "halves":  # D % 128 == 0: lane-aligned split
        return row[:, :d], row[:, d:]
    return row, row  # "row": q is [q | 0], the output is the right half


def _kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref: jax.Ref,
    pages_ref: jax.Ref,
    cu_ref: jax.Ref,
    nseq_ref: jax.Ref,
    layer_ref: jax.Ref,  # [1]: which layer of the stacked cache
    # Blocks.
    q_ref: jax.Ref,  # [Hkv, block_q * group, QW]
    cache_hbm: jax.Ref,  # [L, P, bs, X, W], in HBM
    o_ref: jax.Ref,  # [Hkv, block_q * group, QW]
    # Scratch.
    kv_buf: jax.Ref,  # [2, bs, X, W] VMEM: two page slots (double buffering)
    sem: jax.Ref,  # two DMA semaphores, one per slot
    *,
    block_q: int,
    kv_heads: int,
    group: int,
    pages_per_seq: int,
    scale: float,
    mode: str,
    head_dim: int,
) -> None:
    bs = kv_buf.shape[1]
    rows = block_q * group
    qw = q_ref.shape[2]
    row0 = pl.program_id(0) * block_q
    # Row r of a KV head's block is token row0 + r // group.
    # (lax.div: truncating division of non-negative ints; jnp's floor division
    # lowers through sign(), which Mosaic only has per TPU generation.)
    token = row0 + lax.div(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group)
    qs = [q_ref[h].astype(jnp.float32) * scale for h in range(kv_heads)]
    layer = layer_ref[0]
    m0 = jnp.full((kv_heads, rows, 1), MASK, jnp.float32)
    l0 = jnp.zeros((kv_heads, rows, 1), jnp.float32)
    acc0 = jnp.zeros((kv_heads, rows, qw), jnp.float32)

    def seq_body(j: jax.Array, carry: _Carry) -> _Carry:
        q_lo, q_hi = cu_ref[j], cu_ref[j + 1]
        meets = jnp.logical_and(q_lo < row0 + block_q, q_hi > row0)

        def run(carry: _Carry) -> _Carry:
            kv_len = kv_lens_ref[j]
            in_seq = jnp.logical_and(token >= q_lo, token < q_hi)
            pos = kv_len - (q_hi - token)  # the row's absolute position
            n_pages = lax.div(kv_len + bs - 1, bs)

            def fetch(p: jax.Array | int, slot: jax.Array | int) -> AsyncCopyDescriptor:
                page = pages_ref[j * pages_per_seq + p]
                return pltpu.make_async_copy(
                    cache_hbm.at[layer, page], kv_buf.at[slot], sem.at[slot]
                )

            def page_body(p: jax.Array, carry: _Carry) -> _Carry:
                m, denom, acc = carry
                # Double buffering: the next page's DMA runs while this one is used.
                slot = lax.rem(p, 2)

                @pl.when(p + 1 < n_pages)
                def _() -> None:
                    fetch(p + 1, 1 - slot).start()

                fetch(p, slot).wait()
                key = p * bs + lax.broadcasted_iota(jnp.int32, (1, bs), 1)
                ok = in_seq & (key <= pos) & (key < kv_len)  # [rows, bs]
                # Slots past kv_len hold a previous owner's data: zero V there
                # (a 0 weight times inf is NaN); K only meets masked scores.
                live = p * bs + lax.broadcasted_iota(jnp.int32, (bs, 1), 0) < kv_len
                ms, ls, accs = [], [], []
                for h in range(kv_heads):
                    k, v = _kv_rows(kv_buf, slot, h, mode, head_dim)
                    v = jnp.where(live, v.astype(jnp.float32), 0.0)
                    k = v if mode == "row" else k.astype(jnp.float32)
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
            def _() -> None:
                fetch(0, 0).start()

            carry_out: _Carry = lax.fori_loop(0, n_pages, page_body, carry)
            return carry_out

        carry_out: _Carry = lax.cond(meets, run, lambda c: c, carry)
        return carry_out

    _, denom, acc = lax.fori_loop(0, nseq_ref[0], seq_body, (m0, l0, acc0))
    # Rows that attend to nothing (padding) are 0; a NaN denominator (NaN
    # weights or activations) stays NaN, so the engine sees it, not a 0.
    out = jnp.where(denom == 0, 0.0, acc / jnp.where(denom == 0, 1.0, denom))  # [Hkv, rows, QW]
    for h in range(kv_heads):
        o_ref[h] = out[h].astype(o_ref.dtype)


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
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """q [T, Hq, D] (T a multiple of block_q), cache [P, bs, X, W] or, with
    `layer`, [L, P, bs, X, W] -> [T, Hq, D]."""
    t, hq, d = q.shape
    if layer is None:
        cache, layer = cache[None], 0  # a leading unit dimension: no copy
    _, _, bs, x, w = cache.shape
    mode, hkv = cache_mode(d, cache.shape)
    g = hq // hkv
    qw = 2 * d if mode == "row" else d
    s, pps = page_indices.shape
    rows = block_q * g
    q3 = q.reshape(t, hkv, g, d).transpose(1, 0, 2, 3).reshape(hkv, t * g, d)
    if qw != d:
        q3 = jnp.pad(q3, ((0, 0), (0, 0), (0, qw - d)))  # [q | 0]: meets K, not V
    kernel = functools.partial(
        _kernel, block_q=block_q, kv_heads=hkv, group=g, pages_per_seq=pps, scale=scale,
        mode=mode, head_dim=d,
    )  # fmt: skip
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(t // block_q,),
        in_specs=[
            pl.BlockSpec((hkv, rows, qw), lambda b, *_: (0, b, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((hkv, rows, qw), lambda b, *_: (0, b, 0)),
        scratch_shapes=[pltpu.VMEM((2, bs, x, w), cache.dtype), pltpu.SemaphoreType.DMA((2,))],
    )
    out: jax.Array = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q3.shape, q.dtype),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="kvsched_ragged_paged_attention",
    )(
        kv_lens, page_indices.reshape(s * pps), cu_q_lens, num_seqs,
        jnp.asarray(layer, jnp.int32).reshape(1), q3, cache,
    )  # fmt: skip
    out = out[..., qw - d :]  # "row": [w.K | w.V] -> w.V
    return out.reshape(hkv, t, g, d).transpose(1, 0, 2, 3).reshape(t, hq, d)


def ragged_paged_attention(
    q: jax.Array,
    cache: jax.Array,
    inputs: AttentionInputs,
    *,
    scale: float,
    block_q: int = 8,
    interpret: bool | None = None,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """q [T, Hq, D], cache [P, bs, 2*Hkv, D] or packed [P, bs, Hkv, 2*D] ->
    [T, Hq, D]. With `layer` (a scalar, may be traced), cache is the stacked
    [L, P, bs, ...] array of every layer and layer `layer` is read in place.
    `scale` is the real head_dim's (padding never changes it). T need not be a
    multiple of block_q (zero rows pad it; they lie past the plan's tokens and
    come out 0). `interpret` defaults to True off TPU (the TPU interpreter)."""
    if interpret is None:
        interpret = not on_tpu()
    _, hkv = checked_cache_mode(q, cache, layer, interpret)
    call = _call if layer is None else functools.partial(_call, layer=layer)
    return run_padded(call, q, cache, inputs, scale=scale, block_q=block_q, interpret=interpret,
                      kv_heads=hkv)  # fmt: skip
