"""kvsched's ragged paged attention kernel for TPU (Pallas, Mosaic).

One call serves a whole step plan: decode sequences (one query token each) and
prefill chunks (many), ragged in the token dimension, reading K/V from the paged
cache. The grid walks the padded token dimension in query blocks of `block_q`
rows; for each query block the kernel visits the sequences whose rows meet it
and folds their KV, a block of pages at a time, into an online softmax per
(row, head). Rows of other sequences are masked, so a block that straddles
sequences is still exact; padding rows come out 0. On CPU it runs in Pallas'
TPU interpret mode.

Written for Mosaic: scalar-prefetched plan arrays in SMEM, the cache left in HBM
(`memory_space=ANY`) and copied into VMEM by DMA, 2-D matmuls per KV head.

Query layout. q [T, Hq, D] is regrouped outside the kernel (an XLA transpose of
q, which is small) to [Hkv, T * group, D]: row r * group + g of KV head h is
token r, query head h * group + g. A block is then [Hkv, block_q * group, D], the
GQA group is the matmul's M dimension, and each KV head reads and writes whole
[rows, D] tiles: no reshape or sublane-offset slice inside the kernel. The
output comes back in the same layout and is regrouped to [T, Hq, D].

Cache layouts: "split" [P, bs, 2*Hkv, D] and "packed" [P, bs, Hkv, 2*D], told
apart by the last dimension (kernels/layout.py; on a TPU, head dims that are
not a multiple of 128 need the packed one). The cache is never copied.

How KV reaches the MXU:

- KV blocks of `pages_per_block` pages: one DMA per page, all on one semaphore,
  and ONE wait per block (a wait for the whole block's bytes). A block always
  moves `pages_per_block` pages: pages past the sequence's causal span read the
  sequence's first page again (a valid page id) and are masked, so the wait
  size is static.
- The next `prefetch_depth` blocks (2 by default) are in flight while one is
  computed, across sequences and across grid steps: a query block's (sequence,
  KV block) pairs form one flat loop, the pair `prefetch_depth` ahead is
  fetched into a free slot of depth + 1, and past the block's last pair the
  next grid step's first pairs are (that step's j range and causal bounds
  found by the same binary search). The grid is sequential ("arbitrary"
  dimension semantics); a step's first min(depth, its blocks) were started by
  the step before, so only grid step 0 starts cold. The slot of a step's first
  block is carried in SMEM scratch (the flat block count so far, mod slots).
  Padding steps read nothing and start the next step's blocks, if any.
- A query block visits only the sequences that meet it: the first and the end
  are found by binary search over cu_q_lens (O(log S) scalar steps per block),
  not by scanning every sequence.
- Causal KV bound: a query block reads each sequence's pages only up to its
  last row's position in the block (a prefill chunk's early blocks read less).
- Sliding window (`sliding_window` W, static): a query block reads each
  sequence's pages only from the one holding its first row's window start,
  max(0, pos - W + 1): no DMA for a page before it (in a window group's page
  table those entries are the null page 0, garbage), and the padding pages of
  a fixed-size block re-read that first window page. Blocks are sized to the
  pages a query block's windows span (`tiling.tpu_pages_per_block`: one block
  of 33 pages of 16 for a decode at W = 512). Keys before a row's own window
  start are masked like the causal ones.
- Logit soft cap (static c): s = c * tanh(s / c) on the scaled logits before
  masking. Sinks ([Hq], traced): the online softmax starts each row at its
  head's sink, (m, l) = (s_h, 1), as if a key with that logit and a zero
  value had been read, so the sink joins the denominator only.
- Query block size chosen from the static shape (`tiling.tpu_block_q`): a
  decode-heavy bucket (tokens <= 2 x sequence slots) gets block_q x group = 8
  rows (one sublane tile: the GQA group is the matmul's M), others 128 tokens.
- Page sizes: any (the kernel is written per page); 64 and 128 tokens, the
  sizes recommended on TPU (fewer, larger DMAs), are tested in the
  interpreter and lowered. `tiling.tpu_pages_per_block` keeps a block at 512
  tokens on the decode path and 256 otherwise whatever the page size (32, 8
  or 4 pages on the decode path at 16, 64, 128: 2 MiB at Llama-3-8B's heads).
- Operands in the cache's dtype (bf16 stays bf16; an f32 cache stays f32) with
  f32 accumulation (`preferred_element_type`): no f32 upcast of K/V before the
  MXU. q is scaled in f32, then cast to the cache's dtype; the probabilities
  are cast to V's dtype for the PV product.
- The online softmax's state (m, l, acc: [Hkv, rows, 1 | 1 | QW] f32) is VMEM
  scratch, reset at each grid step and read and written per KV head inside
  the block loop, not a loop carry: on the prefill path at Llama-3-8B's heads
  (128 tokens x group 4 = 512 rows, 8 KV heads, D 128), acc alone is
  8 x 512 x 128 x 4 bytes = 2 MiB, 512 vector registers of 4 KiB, far more
  than the register file holds, so as a carry Mosaic would spill it anyway
  (production TPU kernels keep this state in scratch too).
- Each KV head's K and V are loaded by ref indexing of the block buffer (a
  strided ref load per head), the [ppb, bs, D] value reshaped to
  [ppb * bs, D].

Stale inf/NaN in a slot past kv_len are harmless in both layouts: V (in packed
mode the whole row) is zeroed there before the PV product and the scores there
are masked with `where`. The softmax scale is the caller's (the real
head_dim**-0.5), never derived from the padded width.

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
from kvsched.engine.kernels.common import MASK, check_soft_cap, check_window, run_padded
from kvsched.engine.kernels.layout import cache_mode, checked_cache_mode, on_tpu
from kvsched.engine.kernels.tiling import tpu_block_q, tpu_decode_path, tpu_pages_per_block

if TYPE_CHECKING:
    from jax._src.pallas.mosaic.primitives import AsyncCopyDescriptor

# (sequence, block) computed next, this step's (sequence, block) fetched last,
# the next step's (sequence, block) to fetch next.
_Carry = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]


def _kv_block(
    kv_buf: jax.Ref, slot: jax.Array, h: int, mode: str, d: int
) -> tuple[jax.Array, jax.Array]:
    """K and V ([ppb * bs, *]) of KV head h from block slot `slot`."""
    ppb, bs = kv_buf.shape[1], kv_buf.shape[2]
    if mode == "split":  # [ppb, bs, 2*Hkv, D]: K at 2h, V at 2h + 1
        k = kv_buf[slot, :, :, 2 * h, :]
        v = kv_buf[slot, :, :, 2 * h + 1, :]
        return k.reshape(ppb * bs, d), v.reshape(ppb * bs, d)
    row = kv_buf[slot, :, :, h, :]  # [ppb, bs, 2*D] = [K_h | V_h]
    row = row.reshape(ppb * bs, 2 * d)
    if mode == "halves":
        return row[:, :d], row[:, d:]
    return row, row


def _kernel(
    kv_lens_ref: jax.Ref,
    pages_ref: jax.Ref,
    cu_ref: jax.Ref,
    nseq_ref: jax.Ref,
    layer_ref: jax.Ref,
    q_ref: jax.Ref,  # [Hkv, block_q * group, QW]
    cache_hbm: jax.Ref,  # [L, P, bs, X, W], in HBM
    *refs: jax.Ref,
    block_q: int,
    kv_heads: int,
    group: int,
    pages_per_seq: int,
    max_seqs: int,
    depth: int,
    scale: float,
    mode: str,
    head_dim: int,
    window: int | None = None,
    soft_cap: float | None = None,
    has_sinks: bool = False,
) -> None:
    # refs: [sinks_ref: [Hkv, rows, 1] f32, each row's head's sink logit (with
    # has_sinks)], o_ref, kv_buf: [depth + 1, ppb, bs, X, W] VMEM block slots,
    # sem: one DMA semaphore per slot, m_ref / l_ref: [Hkv, rows, 1] f32 VMEM
    # running max and denominator per row, acc_ref: [Hkv, rows, QW] f32 VMEM
    # running numerator, base_ref: [1] i32 SMEM, the slot of this grid step's
    # first block.
    sinks_ref = refs[0] if has_sinks else None
    o_ref, kv_buf, sem, m_ref, l_ref, acc_ref, base_ref = refs[1:] if has_sinks else refs
    ppb, bs = kv_buf.shape[1], kv_buf.shape[2]
    span_keys = ppb * bs
    rows = block_q * group
    row0 = pl.program_id(0) * block_q
    row_end = row0 + block_q
    nseq = nseq_ref[0]
    layer = layer_ref[0]
    token = row0 + lax.div(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group)
    op_dtype = kv_buf.dtype
    qs = [(q_ref[h].astype(jnp.float32) * scale).astype(op_dtype) for h in range(kv_heads)]

    def search(pred_index: int, bound: jax.Array) -> jax.Array:
        """Smallest j in [0, nseq] with cu[j + pred_index] >= bound (+1 for >)."""

        def body(_: int, lohi: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            lo, hi = lohi
            mid = lax.div(lo + hi, 2)
            idx = jnp.minimum(mid + pred_index, max_seqs)
            hit = cu_ref[idx] >= bound
            open_ = lo < hi
            return (jnp.where(open_ & ~hit, mid + 1, lo), jnp.where(open_ & hit, mid, hi))

        steps = max(1, max_seqs.bit_length() + 1)
        lo: jax.Array
        lo, _ = lax.fori_loop(0, steps, body, (jnp.int32(0), nseq), unroll=True)
        return lo

    class Step:
        """The (sequence, KV block) pairs of the query block of rows [r0, r_end):
        the sequences that meet it (binary search), the pages each one reads
        (from its first row's window start, with a sliding window, up to its
        last row in the block: the causal bound), and their count."""

        def __init__(self, r0: jax.Array, r_end: jax.Array) -> None:
            self.r0, self.r_end = r0, r_end
            self.j_lo = search(1, r0 + 1)  # first sequence ending after r0
            self.j_hi = search(0, r_end)  # first sequence starting at or after r_end
            self.total = lax.fori_loop(
                self.j_lo, self.j_hi, lambda j, n: n + self.blocks(j), jnp.int32(0)
            )
            self.j0 = self.skip_empty(self.j_lo)

        def pages(self, j: jax.Array) -> jax.Array:
            """Pages of sequence j this block reads: up to its last row's causal
            bound (0 past the last sequence; the index is clamped so SMEM reads
            stay in bounds, as a `where` evaluates both sides)."""
            jc = jnp.minimum(j, max_seqs - 1)
            q_lo, q_hi = cu_ref[jc], cu_ref[jc + 1]
            last = kv_lens_ref[jc] - (q_hi - jnp.minimum(q_hi, self.r_end))
            span = jnp.where((q_hi > q_lo) & (j < max_seqs), last, 0)
            return lax.div(span + bs - 1, bs)

        def first(self, j: jax.Array) -> jax.Array:
            """The first page of sequence j this block reads: 0, or with a
            sliding window the page holding the window start of j's first row
            in the block (the pages before it, the null page 0 in a window
            group's table, are never read)."""
            if window is None:
                return jnp.int32(0)
            jc = jnp.minimum(j, max_seqs - 1)
            q_hi = cu_ref[jc + 1]
            pos = kv_lens_ref[jc] - (q_hi - jnp.maximum(cu_ref[jc], self.r0))
            return lax.div(jnp.maximum(pos - (window - 1), 0), bs)

        def blocks(self, j: jax.Array) -> jax.Array:
            if window is None:
                return lax.div(self.pages(j) + ppb - 1, ppb)
            n = jnp.maximum(self.pages(j) - self.first(j), 0)
            return lax.div(n + ppb - 1, ppb)

        def skip_empty(self, j: jax.Array) -> jax.Array:
            return lax.while_loop(
                lambda j: (j < self.j_hi) & (self.blocks(j) == 0), lambda j: j + 1, j
            )

        def advance(self, j: jax.Array, i: jax.Array) -> tuple[jax.Array, jax.Array]:
            more = i + 1 < self.blocks(j)
            nj = jnp.where(more, j, self.skip_empty(j + 1))
            return nj, jnp.where(more, i + 1, 0)

    step = pl.program_id(0)
    cur = Step(row0, row_end)
    # The next grid step's query block (none after the last): its first blocks
    # are fetched before this step ends, so it does not start cold.
    nxt = Step(row_end, row_end + block_q)
    last_step = step == pl.num_programs(0) - 1
    total = cur.total
    n_next = jnp.where(last_step, 0, jnp.minimum(depth, nxt.total))
    # This step's first min(depth, total) blocks were started by the previous
    # step (the grid runs in order: "arbitrary" semantics); step 0 starts its own.
    pre = jnp.where(step > 0, jnp.minimum(depth, total), 0)

    def wait(slot: jax.Array) -> None:
        # One wait for the whole block: the semaphore counts the bytes of every
        # page DMA started on it; a descriptor of the block's size waits for all.
        desc: AsyncCopyDescriptor = pltpu.make_async_copy(
            kv_buf.at[slot], kv_buf.at[slot], sem.at[slot]
        )
        desc.wait()

    def fetch(st: Step, j: jax.Array, i: jax.Array, slot: jax.Array) -> None:
        n_pages, first = st.pages(j), st.first(j)
        for p in range(ppb):
            page_no = first + i * ppb + p
            # Past the span: the first page read again (valid, inside the window;
            # masked).
            idx = jnp.where(page_no < n_pages, page_no, first)
            page = pages_ref[j * pages_per_seq + idx]
            pltpu.make_async_copy(
                cache_hbm.at[layer, page], kv_buf.at[slot, p], sem.at[slot]
            ).start()

    # The online softmax's state lives in VMEM scratch, reset per grid step.
    # Sinks: the state starts as if one key with the sink's logit and a zero
    # value had been read (max s_h, denominator exp(s_h - s_h) = 1).
    if sinks_ref is None:
        m_ref[...] = jnp.full(m_ref.shape, MASK, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    else:
        m_ref[...] = sinks_ref[...]
        l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    slots = depth + 1

    # One flat chain over the grid: this step's blocks f = 0 .. total - 1, then
    # the next step's first n_next as f = total + k; block f sits in slot
    # (base + f) % slots, base carried across steps in SMEM, and block f + depth
    # is started while block f is computed.
    @pl.when(step == 0)
    def _() -> None:
        base_ref[0] = 0

    base = base_ref[0]

    def slot_of(f: jax.Array | int) -> jax.Array:
        return lax.rem(base + f, slots)

    # Flat blocks 0 .. depth - 1 not yet in flight: this step's own (step 0
    # only, as `pre` says) and, when this step has fewer than depth blocks, the
    # next step's first. (fj, fi) walks this step's pairs (it ends at pair
    # depth - 1; advancing past the end is harmless: reads are clamped and only
    # pairs below `total` are fetched); (xj, xi) is the next step's next pair.
    def step_next(ahead: jax.Array, xj: jax.Array, xi: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The next step's pair after (xj, xi) if one was just fetched (a cond:
        its scalar search runs only then)."""
        out: tuple[jax.Array, jax.Array] = lax.cond(
            ahead, lambda: nxt.advance(xj, xi), lambda: (xj, xi)
        )
        return out

    fj, fi = cur.j0, jnp.int32(0)
    xj, xi = nxt.j0, jnp.int32(0)
    for f in range(depth):
        if f:
            fj, fi = cur.advance(fj, fi)

        @pl.when((pre <= f) & (f < total))
        def _(fj: jax.Array = fj, fi: jax.Array = fi, f: int = f) -> None:  # traced now
            fetch(cur, fj, fi, slot_of(f))

        ahead = (f >= total) & (f < total + n_next)

        @pl.when(ahead)
        def _(xj: jax.Array = xj, xi: jax.Array = xi, f: int = f) -> None:
            fetch(nxt, xj, xi, slot_of(f))

        xj, xi = step_next(ahead, xj, xi)

    def body(t: jax.Array, carry: _Carry) -> _Carry:
        j, i, fj, fi, xj, xi = carry
        slot = slot_of(t)
        f = t + depth
        nfj, nfi = cur.advance(fj, fi)

        # `depth` blocks ahead: fetched while this one and those between compute;
        # past this step's last, the next step's first ones.
        @pl.when(f < total)
        def _() -> None:
            fetch(cur, nfj, nfi, slot_of(f))

        ahead = (f >= total) & (f < total + n_next)

        @pl.when(ahead)
        def _() -> None:
            fetch(nxt, xj, xi, slot_of(f))

        fj = jnp.where(f < total, nfj, fj)
        fi = jnp.where(f < total, nfi, fi)
        xj, xi = step_next(ahead, xj, xi)
        nj, ni = cur.advance(j, i)
        wait(slot)
        q_lo, q_hi = cu_ref[j], cu_ref[j + 1]
        kv_len = kv_lens_ref[j]
        in_seq = jnp.logical_and(token >= q_lo, token < q_hi)
        pos = kv_len - (q_hi - token)
        key0 = i * span_keys if window is None else (cur.first(j) * bs + i * span_keys)
        key = key0 + lax.broadcasted_iota(jnp.int32, (1, span_keys), 1)
        # Keys past the block's causal span are masked by pos and kv_len (the
        # re-read first page sits past them).
        limit = jnp.minimum(kv_len, cur.pages(j) * bs)
        ok = in_seq & (key <= pos) & (key < limit)
        if window is not None:
            ok = ok & (key > pos - window)
        live = key0 + lax.broadcasted_iota(jnp.int32, (span_keys, 1), 0) < limit
        for h in range(kv_heads):
            k, v = _kv_block(kv_buf, slot, h, mode, head_dim)
            v = jnp.where(live, v, jnp.zeros_like(v))
            k = v if mode == "row" else k
            s = lax.dot_general(
                qs[h], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(ok, s, MASK)
            m_prev = m_ref[h]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            w = jnp.where(ok, jnp.exp(s - m_new), 0.0)
            l_ref[h] = alpha * l_ref[h] + jnp.sum(w, axis=1, keepdims=True)
            pv = lax.dot_general(
                w.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            acc_ref[h] = alpha * acc_ref[h] + pv
            m_ref[h] = m_new
        return nj, ni, fj, fi, xj, xi

    init: _Carry = (cur.j0, jnp.int32(0), fj, fi, xj, xi)
    lax.fori_loop(0, total, body, init)
    base_ref[0] = slot_of(total)
    denom, acc = l_ref[...], acc_ref[...]
    out = jnp.where(denom == 0, 0.0, acc / jnp.where(denom == 0, 1.0, denom))
    for h in range(kv_heads):
        o_ref[h] = out[h].astype(o_ref.dtype)


_STATIC = ("scale", "block_q", "pages_per_block", "prefetch_depth", "interpret", "window",
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
    pages_per_block: int | None = None,
    prefetch_depth: int = 2,
    layer: jax.Array | int | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q [T, Hq, D] (T a multiple of block_q), cache [P, bs, X, W] or, with
    `layer`, [L, P, bs, X, W] -> [T, Hq, D]. `window`, `soft_cap`, `sinks`: as
    ragged_paged_attention's sliding_window, soft_cap, sinks."""
    t, hq, d = q.shape
    if layer is None:
        cache, layer = cache[None], 0
    _, _, bs, x, w = cache.shape
    mode, hkv = cache_mode(d, cache.shape)
    g = hq // hkv
    qw = 2 * d if mode == "row" else d
    s, pps = page_indices.shape
    decode = tpu_decode_path(block_q, g)
    if pages_per_block is None:
        ppb = tpu_pages_per_block(bs, pps, decode, window=window, block_q=block_q)
    else:
        ppb = pages_per_block
    ppb = min(ppb, pps)
    rows = block_q * g
    q3 = q.reshape(t, hkv, g, d).transpose(1, 0, 2, 3).reshape(hkv, t * g, d)
    if qw != d:
        q3 = jnp.pad(q3, ((0, 0), (0, 0), (0, qw - d)))
    kernel = functools.partial(
        _kernel, block_q=block_q, kv_heads=hkv, group=g, pages_per_seq=pps, max_seqs=s,
        depth=prefetch_depth, scale=scale, mode=mode, head_dim=d, window=window,
        soft_cap=soft_cap, has_sinks=sinks is not None,
    )  # fmt: skip
    in_specs = [
        pl.BlockSpec((hkv, rows, qw), lambda b, *_: (0, b, 0)),
        pl.BlockSpec(memory_space=pl.ANY),
    ]
    operands = [q3, cache]
    if sinks is not None:
        # Row r * group + g of KV head h is query head h * group + g: its sink.
        sink_rows = jnp.tile(sinks.astype(jnp.float32).reshape(hkv, g), (1, block_q))
        operands.append(sink_rows.reshape(hkv, rows, 1))
        in_specs.append(pl.BlockSpec((hkv, rows, 1), lambda b, *_: (0, 0, 0)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(t // block_q,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((hkv, rows, qw), lambda b, *_: (0, b, 0)),
        scratch_shapes=[
            pltpu.VMEM((prefetch_depth + 1, ppb, bs, x, w), cache.dtype),
            pltpu.SemaphoreType.DMA((prefetch_depth + 1,)),
            pltpu.VMEM((hkv, rows, 1), jnp.float32),
            pltpu.VMEM((hkv, rows, 1), jnp.float32),
            pltpu.VMEM((hkv, rows, qw), jnp.float32),
            pltpu.SMEM((1,), jnp.int32),
        ],
    )
    out: jax.Array = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q3.shape, q.dtype),
        # Sequential grid: a step's first blocks are started by the step before.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="kvsched_ragged_paged_attention",
    )(
        kv_lens, page_indices.reshape(s * pps), cu_q_lens, num_seqs,
        jnp.asarray(layer, jnp.int32).reshape(1), *operands,
    )  # fmt: skip
    out = out[..., qw - d :]
    return out.reshape(hkv, t, g, d).transpose(1, 0, 2, 3).reshape(t, hq, d)


def ragged_paged_attention(
    q: jax.Array,
    cache: jax.Array,
    inputs: AttentionInputs,
    *,
    scale: float,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    prefetch_depth: int = 2,
    interpret: bool | None = None,
    layer: jax.Array | int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q [T, Hq, D], cache [P, bs, 2*Hkv, D] or packed [P, bs, Hkv, 2*D] ->
    [T, Hq, D]. With `layer` (a scalar, may be traced), cache is the stacked
    [L, P, bs, ...] array of every layer and layer `layer` is read in place.
    `scale` is the real head_dim's (padding never changes it). T need not be a
    multiple of block_q (zero rows pad it; they lie past the plan's tokens and
    come out 0). `block_q` defaults to `tiling.tpu_block_q` of the bucket's
    shape, `pages_per_block` to `tiling.tpu_pages_per_block`; `prefetch_depth`
    blocks are in flight while one is computed (depth + 1 VMEM slots). Values
    below 1 are a ValueError naming the knob. `interpret` defaults to True off
    TPU (the TPU interpreter). `sliding_window` W (None or 0: full attention):
    each sequence's pages are read from the one holding its window's start
    (no DMA before it), blocks sized by `tiling.tpu_pages_per_block`'s window
    rule; `soft_cap`: logits c * tanh(logits / c); `sinks` [Hq]: a per-head
    logit in the softmax denominator."""
    if interpret is None:
        interpret = not on_tpu()
    knobs = (("block_q", block_q), ("pages_per_block", pages_per_block),
             ("prefetch_depth", prefetch_depth))  # fmt: skip
    for name, value in knobs:
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    _, hkv = checked_cache_mode(q, cache, layer, interpret)
    if q.shape[1] % hkv:
        raise ValueError(f"{q.shape[1]} query heads do not group over {hkv} KV heads")
    if block_q is None:
        block_q = tpu_block_q(q.shape[0], inputs.page_indices.shape[0], q.shape[1] // hkv)
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [Hq] = [{q.shape[1]}], got {sinks.shape}")
    call = functools.partial(_call, pages_per_block=pages_per_block,
                             prefetch_depth=prefetch_depth, window=check_window(sliding_window),
                             soft_cap=check_soft_cap(soft_cap), sinks=sinks)  # fmt: skip
    if layer is not None:
        call = functools.partial(call, layer=layer)
    return run_padded(call, q, cache, inputs, scale=scale, block_q=block_q, interpret=interpret,
                      kv_heads=hkv)  # fmt: skip
