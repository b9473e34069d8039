"""kvsched's ragged paged attention kernel for NVIDIA GPUs (Pallas, Triton).

Written for Pallas' Triton backend: no scalar prefetch or DMA there, so the
plan arrays and the cache are plain refs in global memory, read with dynamic
indices. On CPU it runs in Pallas' generic interpreter.

One program per (query block, KV head), where a query block is up to
`block_q` rows of ONE sequence (a decode row is a block of its own;
`program_table` splits the plan on the device before the kernel, into
tokens / block_q + S programs: a static grid per plan shape). The block's rows
and the GQA group's query heads form one [block_q * group, D] operand
(gathered so before the kernel). The program reads its own sequence's pages
only, up to the causal bound of its last row, in KV tiles of `tile_pages`
pages (64 keys by default, `tiling.gpu_tile_pages`): K and V are one gather
load each, and each tile costs one QK and one PV dot for the whole group.
bf16 / fp16 caches: dot operands in that type (tensor cores), f32
accumulation and softmax; f32 caches: f32 operands at HIGHEST (IEEE)
precision. num_stages=3 lets Triton prefetch the next tiles in the loop.
Split-KV (flash-decoding, `kv_splits` > 1, chosen from the plan's shape by
`default_kv_splits`: decode buckets whose slots x KV heads leave SMs idle):
grid (query blocks, KV heads, splits), each split reads its share of the
tiles and writes an f32 partial (accumulator, max, denominator); a reduce in
XLA after the kernel combines them.

Sliding window (`sliding_window` W): a program loads its sequence's pages only
from the one holding its first row's window start (none before it: a window
group's page table holds the null page there) up to its causal bound; a tile
overhanging that span re-loads its last page. Logit soft cap: c * tanh(s / c)
on the scaled logits. Sinks: each row's state starts at its head's sink,
(m, l) = (s_h, 1); with split-KV the reduce adds it as one more partial.

Triton tiles need powers of two: block_size and head_dim (the kernel pads its
M = block_q * group rows to a power of two >= 16 itself). The cache is the
split layout [P, bs, 2*Hkv, D] (kernels/layout.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kvsched.engine.inputs import AttentionInputs
from kvsched.engine.kernels.common import MASK, check_soft_cap, check_window
from kvsched.engine.kernels.reference import token_seq
from kvsched.engine.kernels.tiling import H200_SMS, gpu_block_q, gpu_kv_splits, gpu_tile_pages

HIGHEST = lax.Precision.HIGHEST


def dot_dtype(cache_dtype: jnp.dtype) -> jnp.dtype:
    """The operand type of both dots for a cache of `cache_dtype`: bf16 and fp16
    caches feed the tensor cores in their own type (f32 accumulation; the
    softmax weights are rounded to it for the PV dot, q is cast to it); f32
    caches keep f32 operands at HIGHEST precision (no TF32)."""
    dt = jnp.dtype(cache_dtype)
    return dt if dt in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else jnp.dtype(jnp.float32)


def program_table(cu_q_lens: jax.Array, num_seqs: jax.Array, tokens: int, block_q: int
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """Split each sequence's rows into query blocks of at most `block_q` rows
    that never straddle sequences (a decode row is a block of its own). Returns
    per program (seq, first row, rows; rows 0: no work) and each sequence's
    first program. The program count, tokens // block_q + S rounded up, is a
    function of the plan's shape only (sum over sequences of
    ceil(q_len / block_q) <= tokens / block_q + S), so the grid stays static."""
    s = cu_q_lens.shape[0] - 1
    n = num_seqs[0]
    q_len = jnp.where(jnp.arange(s) < n, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks = (q_len + block_q - 1) // block_q
    ends = jnp.cumsum(blocks)
    starts = ends - blocks
    progs = -(-tokens // block_q) + s
    p = jnp.arange(progs, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, p, side="right"), s - 1).astype(jnp.int32)
    row0 = cu_q_lens[seq] + (p - starts[seq]) * block_q
    rows = jnp.where(p < ends[-1], jnp.minimum(block_q, cu_q_lens[seq + 1] - row0), 0)
    return seq, row0.astype(jnp.int32), rows.astype(jnp.int32), starts.astype(jnp.int32)


def _kernel(seq_ref: jax.Ref, row0_ref: jax.Ref, rows_ref: jax.Ref, kv_lens_ref: jax.Ref,
            pages_ref: jax.Ref, cu_ref: jax.Ref, q_ref: jax.Ref, cache_ref: jax.Ref,
            *refs: jax.Ref, group: int, pages_per_seq: int, scale: float,
            dtype: jnp.dtype, splits: int, tile_pages: int, window: int | None = None,
            soft_cap: float | None = None, has_sinks: bool = False) -> None:  # fmt: skip
    # One program per (query block, KV head). The block's rows of one sequence
    # and the group's query heads form one [block_q * group, D] operand, laid
    # out so on the host: row r is token r // group, query head r % group of
    # this KV head. Each KV tile of `tile_pages` pages (one gather load of K
    # and one of V: row i is page i // bs, slot i % bs) is one QK and one PV dot
    # for the whole group.
    # With `splits` > 1 (split-KV), program (.., .., i) reads the i-th share of
    # the pages and writes its unnormalised accumulator, running max and
    # denominator (stat_refs) for the reduce after the kernel.
    # refs: [sinks_ref ([bm, 1] f32: each row's query head's sink logit; with
    # has_sinks, and only without splits: the reduce adds it otherwise)], o_ref,
    # *stat_refs.
    sinks_ref = refs[0] if has_sinks else None
    o_ref, *stat_refs = refs[1:] if has_sinks else refs
    bs = cache_ref.shape[1]
    bm = q_ref.shape[0]
    kh = pl.program_id(1)
    prog = pl.program_id(0)
    j, row0, nrows = seq_ref[prog], row0_ref[prog], rows_ref[prog]
    kv_len, q_hi = kv_lens_ref[j], cu_ref[j + 1]
    r = lax.div(lax.broadcasted_iota(jnp.int32, (bm, 1), 0), group)  # token in block
    real = r < nrows
    pos = kv_len - (q_hi - (row0 + r))
    # Causal bound: the block's last row sees positions < last; nothing past it
    # is read (a prefill chunk's early blocks stop early).
    last = kv_len - (q_hi - (row0 + nrows))
    n_pages = lax.div(last + bs - 1, bs)
    kt = tile_pages * bs  # keys per tile
    if window is None:
        first = jnp.int32(0)
        n_tiles = jnp.where(nrows > 0, lax.div(last + kt - 1, kt), 0)
    else:
        # Sliding window: pages from the one holding the first row's window
        # start; those before it (the null page in a window group's table) are
        # never loaded.
        first_pos = kv_len - (q_hi - row0)
        first = lax.div(jnp.maximum(first_pos - (window - 1), 0), bs)
        n_tiles = jnp.where(nrows > 0, lax.div(n_pages - first + tile_pages - 1, tile_pages), 0)
    if splits > 1:
        share = lax.div(n_tiles + splits - 1, splits)
        lo = pl.program_id(2) * share
        hi = jnp.minimum(n_tiles, lo + share)
    else:
        lo, hi = jnp.int32(0), n_tiles
    precision = HIGHEST if dtype == jnp.float32 else None
    q = q_ref[...].astype(dtype)
    carry0 = (
        jnp.full((bm, 1), MASK, jnp.float32),
        jnp.zeros((bm, 1), jnp.float32),
        jnp.zeros((bm, q_ref.shape[1]), jnp.float32),
    )
    if sinks_ref is not None:
        # As if one key with the sink's logit and a zero value had been read.
        carry0 = (sinks_ref[...], jnp.ones((bm, 1), jnp.float32), carry0[2])

    def page_body(p: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
        m, denom, acc = carry
        if tile_pages == 1:
            page = pages_ref[j * pages_per_seq + first + p]
            k, v = cache_ref[page, :, 2 * kh, :], cache_ref[page, :, 2 * kh + 1, :]
        else:
            i = lax.broadcasted_iota(jnp.int32, (kt,), 0)
            # Pages past the block's causal span (a tile overhanging it) read its
            # last page again: their keys are past the bound, masked below.
            idx = jnp.minimum(first + p * tile_pages + lax.div(i, bs), n_pages - 1)
            page, slot = pages_ref[j * pages_per_seq + idx], lax.rem(i, bs)
            k, v = cache_ref[page, slot, 2 * kh, :], cache_ref[page, slot, 2 * kh + 1, :]
        key0 = p * kt if window is None else first * bs + p * kt
        key = key0 + lax.broadcasted_iota(jnp.int32, (1, kt), 1)
        ok = real & (key <= pos) & (key < kv_len)
        if window is not None:
            ok = ok & (key > pos - window)
        live = jnp.transpose(key < kv_len)  # [kt, 1]: stale slots past kv_len
        k = k.astype(dtype)
        v = jnp.where(live, v.astype(dtype), 0)
        # Operands in `dtype`, accumulation in f32 (pl.dot's result type).
        s = pltriton.dot(q, k, trans_b=True, precision=precision) * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(ok, s, MASK)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        w = jnp.where(ok, jnp.exp(s - m_new), 0.0)
        acc = alpha * acc + pltriton.dot(w.astype(dtype), v, precision=precision)
        return m_new, alpha * denom + jnp.sum(w, axis=1, keepdims=True), acc

    m, denom, acc = lax.fori_loop(lo, hi, page_body, carry0)
    if splits > 1:
        m_ref, l_ref = stat_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = denom
        return
    # Rows that attend to nothing are 0; a NaN denominator stays NaN.
    out = jnp.where(denom == 0, 0.0, acc / jnp.where(denom == 0, 1.0, denom))
    o_ref[...] = out.astype(o_ref.dtype)


_STATIC = ("scale", "block_q", "interpret", "num_stages", "kv_splits", "tile_pages", "window",
           "soft_cap")  # fmt: skip


@functools.partial(jax.jit, static_argnames=_STATIC)
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
    num_stages: int = 3,
    kv_splits: int = 1,
    tile_pages: int | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    t, hq, d = q.shape
    hkv = cache.shape[2] // 2
    group = hq // hkv
    s, pps = page_indices.shape
    seq, row0, rows, starts = program_table(cu_q_lens, num_seqs, t, block_q)
    progs = seq.shape[0]
    # M: the block's rows x group, padded to a power of two >= 16 (what Triton
    # tiles and tensor-core dots take); padding rows are token >= block_q: masked.
    bm = max(16, pl.next_power_of_2(block_q * group))
    # Host side (XLA, before the kernel): gather each program's rows into
    # [programs, Hkv, block_q * group, D]; rows past a block's end are zero.
    r = jnp.arange(block_q, dtype=jnp.int32)
    tok = jnp.minimum(row0[:, None] + r[None, :], t - 1)  # [progs, block_q]
    qb = jnp.where((r[None, :] < rows[:, None])[:, :, None, None], q[tok], 0)
    qb = qb.reshape(progs, block_q, hkv, group, d).transpose(0, 2, 1, 3, 4)
    qb = qb.reshape(progs, hkv, block_q * group, d)
    if bm > block_q * group:
        qb = jnp.pad(qb, ((0, 0), (0, 0), (0, bm - block_q * group), (0, 0)))
    kernel = functools.partial(_kernel, group=group, pages_per_seq=pps, scale=scale,
                               dtype=dot_dtype(cache.dtype), splits=kv_splits,
                               tile_pages=tile_pages or gpu_tile_pages(cache.shape[1], pps),
                               window=window, soft_cap=soft_cap,
                               has_sinks=sinks is not None and kv_splits == 1)  # fmt: skip

    def full(shape: tuple[int, ...]) -> pl.BlockSpec:
        return pl.BlockSpec(shape, lambda b, h, i: (0,) * len(shape))

    blocks = pl.BlockSpec((None, None, bm, d), lambda b, h, i: (b, h, 0, 0))
    if kv_splits > 1:  # one partial result per split: f32 accumulator, max, denominator

        def part(width: int) -> pl.BlockSpec:
            return pl.BlockSpec((None, None, None, bm, width), lambda b, h, i: (b, h, i, 0, 0))

        out_specs: list[pl.BlockSpec] | pl.BlockSpec = [part(d), part(1), part(1)]
        out_shape: list[jax.ShapeDtypeStruct] | jax.ShapeDtypeStruct = [
            jax.ShapeDtypeStruct((progs, hkv, kv_splits, bm, w), jnp.float32) for w in (d, 1, 1)
        ]
    else:
        out_specs, out_shape = blocks, jax.ShapeDtypeStruct((progs, hkv, bm, d), q.dtype)
    in_specs = [full((progs,))] * 3 + [full((s,)), full((s * pps,)), full((s + 1,)), blocks,
                                       full(cache.shape)]  # fmt: skip
    operands = [seq, row0, rows, kv_lens, page_indices.reshape(s * pps), cu_q_lens, qb, cache]
    if sinks is not None:
        # Row r of KV head h's block is query head h * group + r % group.
        sink = sinks.astype(jnp.float32).reshape(hkv, 1, group)
        sink = jnp.broadcast_to(sink, (hkv, block_q, group)).reshape(hkv, block_q * group)
        sink = jnp.pad(sink, ((0, 0), (0, bm - block_q * group)))[:, :, None]  # [Hkv, bm, 1]
    if sinks is not None and kv_splits == 1:
        operands.append(sink)
        in_specs.append(pl.BlockSpec((None, bm, 1), lambda b, h, i: (h, 0, 0)))
    res = pl.pallas_call(
        kernel,
        grid=(progs, hkv, kv_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        # Triton explicitly (this JAX defaults GPU kernels to Mosaic GPU); with
        # 3 stages (Triton's own default on CUDA) its loop pipeliner keeps the
        # next two pages' tiles in flight while one is computed (8 KiB of
        # shared memory per stage at D=128, bf16, pages of 16).
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=num_stages),
        name="kvsched_ragged_paged_attention_gpu",
    )(*operands)
    if kv_splits > 1:
        # The reduce (flash-decoding): rescale each split's accumulator and
        # denominator to the common max, sum, normalise. A split that read no
        # page holds (MASK, 0, 0) and adds nothing.
        acc, m, denom = res
        m_all = jnp.max(m, axis=2, keepdims=True)
        if sinks is not None:  # the sink: one more partial, (s_h, 1, 0)
            m_all = jnp.maximum(m_all, sink[None, :, None])
        w = jnp.exp(m - m_all)
        denom = jnp.sum(w * denom, axis=2)
        if sinks is not None:
            denom = denom + jnp.exp(sink[None] - m_all[:, :, 0])
        acc = jnp.sum(w * acc, axis=2)
        ob = jnp.where(denom == 0, 0.0, acc / jnp.where(denom == 0, 1.0, denom)).astype(q.dtype)
    else:
        ob = res
    # Back to token rows: token t is row (t - cu[seq]) % block_q of its
    # sequence's program (t - cu[seq]) // block_q; rows past the plan are 0.
    tseq, valid = token_seq(cu_q_lens, num_seqs, t)
    off = jnp.arange(t, dtype=jnp.int32) - cu_q_lens[tseq]
    prog = jnp.clip(starts[tseq] + off // block_q, 0, progs - 1)
    ob = ob[:, :, : block_q * group].reshape(progs, hkv, block_q, group, d)
    out = ob[prog, :, off % block_q]  # [t, hkv, g, d]
    return jnp.where(valid[:, None, None], out.reshape(t, hq, d), 0).astype(q.dtype)


def default_kv_splits(tokens: int, seqs: int, kv_heads: int, pages_per_seq: int,
                      window: int | None = None, page_size: int = 16) -> int:  # fmt: skip
    """Split-KV from the plan's shape (static): `tiling.gpu_kv_splits` with the
    device's SM count where jax reports it, else an H200's 132."""
    units = H200_SMS
    if jax.default_backend() == "gpu":
        units = int(getattr(jax.devices()[0], "core_count", units) or units)
    return gpu_kv_splits(tokens, seqs, kv_heads, pages_per_seq, units, window, page_size)


def ragged_paged_attention_gpu(
    q: jax.Array,
    cache: jax.Array,
    inputs: AttentionInputs,
    *,
    scale: float,
    block_q: int | None = None,
    interpret: bool | None = None,
    kv_splits: int | None = None,
    kv_tile_pages: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """As kernels.tpu.ragged_paged_attention, for NVIDIA GPUs (Triton): q
    [T, Hq, D], cache [P, bs, 2*Hkv, D] -> [T, Hq, D], padding rows 0.
    `block_q` defaults to `tiling.gpu_block_q`, `kv_splits` (split-KV) to
    `default_kv_splits`, `kv_tile_pages` (pages per KV tile) to
    `tiling.gpu_tile_pages`; values below 1 are a ValueError naming the knob.
    `interpret` defaults to True off GPU (Pallas' interpreter).
    `sliding_window` W (None or 0: full): a query block loads its sequence's
    pages from the one holding its first row's window start; `soft_cap`:
    logits c * tanh(logits / c); `sinks` [Hq]: a per-head logit in the
    softmax denominator."""
    window, soft_cap = check_window(sliding_window), check_soft_cap(soft_cap)
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [Hq] = [{q.shape[1]}], got {sinks.shape}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    hkv = cache.shape[-2] // 2
    if q.shape[1] % hkv:
        raise ValueError(f"{q.shape[1]} query heads do not group over {hkv} KV heads")
    if block_q is None:
        block_q = gpu_block_q(q.shape[0], inputs.kv_lens.shape[0], q.shape[1] // hkv)
    if kv_splits is None:
        s, pps = inputs.page_indices.shape
        kv_splits = default_kv_splits(q.shape[0], s, hkv, pps, window, cache.shape[1])
    knobs = {"block_q": block_q, "kv_splits": kv_splits, "kv_tile_pages": kv_tile_pages}
    for name, value in knobs.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    out: jax.Array = _call(q, cache, inputs.kv_lens, inputs.page_indices, inputs.cu_q_lens,
                           inputs.num_seqs, scale=scale, block_q=block_q,
                           interpret=bool(interpret), kv_splits=kv_splits,
                           tile_pages=kv_tile_pages, window=window, soft_cap=soft_cap,
                           sinks=sinks)  # fmt: skip
    return out
