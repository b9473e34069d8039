"""Backend "jax": the ragged paged attention kernel JAX ships
(`jax.experimental.pallas.ops.tpu.ragged_paged_attention`), fed from a kvsched
step plan.

On a TPU this is JAX's Pallas kernel with its own tuned block sizes (its
`get_tuned_block_sizes` table, looked up by TPU generation and shapes; in jax
0.10.2 the table covers v5e and v6e, bf16 q and KV, head_dim 128, pages of 16
to 256 and token buckets rounded up to 512-4096: anything else, f32 or a
smaller bucket included, gets its default blocks of 128 pages x 32 queries,
clamped to the plan's shape). JAX's kernel needs head_dim to be a multiple of
128 (head_dim 64 fails in its lowering; attention.resolve_backend keeps
kvsched's kernel there). Off TPU
the kernel cannot run (it is Mosaic-only and, unmodified, fails in the TPU
interpreter of jax 0.10.2: see tests/test_engine_jax_backend.py), so the same
inputs go to JAX's own jnp reference, `ref_ragged_paged_attention`, and CPU
tests exercise the layout conversion the TPU path uses.

The layout conversion, and what it costs per step. JAX's inputs are laid out
as our plan and cache already are:

- q [T, Hq, D], kv_lens [S], page_indices [S, PPS], cu_q_lens [S + 1],
  num_seqs [1] (all int32): the plan's arrays, passed as they are;
- kv_pages [P, page, 2*Hkv, D], K of head h at combined head 2h, V at 2h + 1:
  exactly kvsched's "split" cache layout (kv_cache.py), so no per-step copy of
  the cache and no need to store it differently for this backend.
- The row positions are not passed: JAX derives each row's position as
  kv_len - q_len + i (the last q_len of the sequence's kv_len), which is how
  the scheduler lays out every plan (the tests check it on real plans).

A sliding-window layer (`sliding_window`, with `soft_cap` also passed through
to JAX's) is fed `window_view` of the plan: each sequence's page row shifted
to start at its window's first page and its kv_len shortened to match (an
[S, PPS] gather per layer). Attention only sees position differences, so the
output is the same, and JAX's kernel, which walks a sequence's pages from its
first entry and pads a KV block with that entry, never touches a page behind
the window (in a window group's table the null page 0, garbage); its KV block
is capped at the window's pages (`window_block_sizes`). JAX's kernel has no
attention sinks: a call with them is refused.

Two details differ, both handled without copying the cache:

- The engine stacks every layer's cache, [L, P, page, 2*Hkv, D], and reads
  layer `layer` inside a lax.scan. JAX's kernel takes one layer. Slicing the
  layer out would copy a whole layer's cache per layer per step. Instead the
  stacked cache is viewed as [L*P, page, 2*Hkv, D] (merging the two leading
  dimensions: a free reshape, the minor dimensions being untouched) and the
  page table is offset by layer * P: one int32 add over [S, PPS] per layer.
- A "packed" cache ([P, page, Hkv, 2*D], the layout our own TPU kernel reads
  for head_dim 64) is reshaped to the split view: the same bytes, free on CPU
  and GPU, but a relayout copy on TPU; the engine stores the cache split for
  this backend (runner: kv_layout "auto"; "packed" is refused on TPU).

Padding rows. JAX's kernel writes every row of its output from a scratch
accumulator, and rows past the plan's tokens (cu_q_lens[num_seqs]:) are never
computed: they hold whatever the accumulator last held, not zeros. Our
backends return 0 there, so the output is masked here (one `where` over
[T, Hq, D]). Nothing downstream reads those rows anyway: a row only mixes
with others through attention, which reads the cache, and the model's K/V
writes for padding rows drop (slot past the end); logits are gathered only at
the plan's `logits_indices`, and the runner reads the first num_seqs of them
(tokens and the finite check alike). The mask keeps the backends
interchangeable.

A plan with no sequence (the warmup's padding plans) skips the kernel: with
num_seqs = 0 JAX's kernel would still start its first KV block's DMA at grid
step 0 and never wait for it (harmless or not on hardware: unchecked, so it is
not run).

Not supported by JAX's kernel, hence refused by the dispatch: kvsched's int8
KV cache. JAX's kernel reads int8 or fp8 pages only with one static float
scale per tensor (`k_scale` / `v_scale`), not one scale per token and head.

Cost off TPU: `ref_ragged_paged_attention` is an eager function (a Python
loop over num_seqs, slices sized by each sequence's lengths): it cannot be
traced, so the jitted step reaches it through `jax.pure_callback`, and it
compiles its small ops for each new (q_len, kv_len) it meets. It is a
correctness path, not a fast one. Measured on the 2-core development machine
(shared, jax 0.10.2; one layer, Hq 4, Hkv 2, D 16, plans of 4-6 sequences and
17-32 tokens): about 12-33 ms per call once its shapes are compiled and 3-8 s
the first time a plan's shapes are seen, against 0.3-0.4 ms for the reference
backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as _jax_rpa

from kvsched.engine.inputs import AttentionInputs
from kvsched.engine.kernels.common import check_soft_cap, check_window
from kvsched.engine.kernels.layout import cache_mode
from kvsched.engine.kernels.tiling import window_pages

# JAX's functions are unannotated (mypy --strict would flag each call): typed here.
jax_kernel: Callable[..., jax.Array] = _jax_rpa.ragged_paged_attention
jax_reference: Callable[..., Any] = _jax_rpa.ref_ragged_paged_attention

IMPLS = ("kernel", "reference")


def kernel_layout(
    cache: jax.Array, head_dim: int, layer: jax.Array | int | None = None
) -> tuple[jax.Array, jax.Array | int]:
    """Our cache as JAX's `kv_pages` [pages, page, 2*Hkv, D], and the page id
    offset to add to the plan's page table. A stacked cache [L, P, ...] read at
    `layer` becomes [L*P, ...] with offset layer * P (no copy); a packed cache
    [..., Hkv, 2*D] is viewed split (the same bytes)."""
    if cache.ndim != (4 if layer is None else 5):
        raise ValueError(
            f"cache of rank {cache.ndim}: expected [P, bs, X, W], or [L, P, bs, X, W] with layer"
        )
    *lead, bs, _, _ = cache.shape
    _, hkv = cache_mode(head_dim, cache.shape)  # split, or packed [K_h | V_h] rows
    x, w = 2 * hkv, head_dim
    if layer is None:
        return cache.reshape(lead[0], bs, x, w), 0
    n_layers, pages = lead
    offset = jnp.asarray(layer, jnp.int32) * pages
    return cache.reshape(n_layers * pages, bs, x, w), offset


def mask_padding_rows(out: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """Zero the rows past the plan's tokens (JAX's kernel leaves them as they fall)."""
    rows = jnp.arange(out.shape[0], dtype=jnp.int32)
    real = rows < cu_q_lens[num_seqs[0]]
    return jnp.where(real[:, None, None], out, jnp.zeros((), out.dtype))


def window_view(kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
                num_seqs: jax.Array, window: int, page_size: int
                ) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """The plan as a sliding-window layer's kernel should read it: each
    sequence's page row starts at the page holding its first row's window
    start, floor(max(0, kv_len - q_len - W + 1) / page_size) = f, and its
    kv_len drops by f * page_size. Attention only sees position differences
    (RoPE is applied before K is written; the causal and window masks compare
    positions), so the output is unchanged, and the kernel never reads the
    pages before the window: JAX's kernel walks a sequence's pages from its
    first, and pads a KV block with the row's first page, which in a window
    group's table is the null page (garbage, NaN after a reuse) until shifted.
    Entries past the row's end repeat its last (never read: past kv_len)."""
    s, pps = page_indices.shape
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    live = jnp.arange(s) < num_seqs[0]
    first = jnp.where(live, jnp.maximum(kv_lens - q_lens - (window - 1), 0) // page_size, 0)
    cols = jnp.minimum(first[:, None] + jnp.arange(pps, dtype=jnp.int32)[None, :], pps - 1)
    shifted = jnp.take_along_axis(page_indices, cols, axis=1)
    return kv_lens - first * page_size, shifted


def window_block_sizes(
    q: jax.Array, kv_pages: jax.Array, pages_per_seq: int, window: int
) -> tuple[int, int]:
    """JAX's own tuned (pages per KV block, queries per block) for this call (its
    get_tuned_block_sizes: needs a TPU, or its version faked), with the KV
    block capped at the pages one row's window spans (`tiling.window_pages`):
    JAX's kernel moves whole blocks, so a 128-page block for a 33-page window
    would be three quarters padding."""
    hq_blk, kvh2_blk = _jax_rpa.get_min_heads_per_blk(
        q.shape[1], kv_pages.shape[2], q.dtype, kv_pages.dtype
    )
    bkv, bq = _jax_rpa.get_tuned_block_sizes(
        q.dtype, kv_pages.dtype, hq_blk, kvh2_blk // 2, q.shape[2], kv_pages.shape[1],
        q.shape[0], pages_per_seq,
    )  # fmt: skip
    return min(bkv, window_pages(window, kv_pages.shape[1])), bq


def _reference_on_host(
    *arrays: np.ndarray, scale: float, window: int | None = None, soft_cap: float | None = None
) -> np.ndarray:
    """JAX's reference, eagerly, on the host arrays of one call: [T, Hq, D]
    with its rows (one per real token) at the top, zeros below."""
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs = arrays
    out = np.zeros(q.shape, q.dtype)
    if int(num_seqs[0]) > 0:
        # On the host CPU whatever the platform: JAX work launched from inside a
        # callback onto the device that is running the callback's program can
        # deadlock (a GPU stream waiting on itself).
        with jax.default_device(jax.devices("cpu")[0]):
            real = np.asarray(
                jax_reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                              sm_scale=scale, sliding_window=window, soft_cap=soft_cap)
            )  # fmt: skip
        out[: real.shape[0]] = real
    return out


def jax_ragged_paged_attention(
    q: jax.Array,
    cache: jax.Array,
    inputs: AttentionInputs,
    *,
    scale: float,
    layer: jax.Array | int | None = None,
    impl: str | None = None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q [T, Hq, D], cache [P, bs, 2*Hkv, D] (or packed [P, bs, Hkv, 2*D]; with
    `layer`, the stacked [L, P, ...] cache read at layer `layer`) -> [T, Hq, D],
    padding rows 0. impl: "kernel" (JAX's Pallas TPU kernel; block sizes from its
    tuned table unless both are given), "reference" (JAX's jnp reference through
    a host callback), or None: the kernel on TPU, the reference elsewhere.

    `sliding_window` W and `soft_cap` go to JAX's (its `sliding_window`,
    `soft_cap`), on the plan seen through `window_view` (each sequence's pages
    from its window's first: none before it is read); with W and no block
    sizes given, the KV block is capped at the window's pages
    (`window_block_sizes`). `sinks`: JAX's kernel has none, a ValueError
    (attention.resolve_backend keeps kvsched's kernels for them)."""
    if sinks is not None:
        raise ValueError(
            "JAX's ragged_paged_attention has no attention sinks: use backend 'pallas' "
            "(kvsched's kernels) or 'reference'"
        )
    window, soft_cap = check_window(sliding_window), check_soft_cap(soft_cap)
    t, hq, d = q.shape
    kv_pages, offset = kernel_layout(cache, d, layer)
    hkv = kv_pages.shape[2] // 2
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
    if impl is None:
        impl = "kernel" if jax.default_backend() == "tpu" else "reference"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, not {impl!r}")
    kv_lens, page_indices = inputs.kv_lens, inputs.page_indices
    if window is not None:
        kv_lens, page_indices = window_view(kv_lens, page_indices, inputs.cu_q_lens,
                                            inputs.num_seqs, window, kv_pages.shape[1])  # fmt: skip
    page_indices = page_indices + offset
    args = (q, kv_pages, kv_lens, page_indices, inputs.cu_q_lens, inputs.num_seqs)
    if impl == "kernel":
        bkv, bq = num_kv_pages_per_block, num_queries_per_block
        if window is not None and (bkv is None or bq is None):
            bkv, bq = window_block_sizes(q, kv_pages, page_indices.shape[1], window)

        def run(args: tuple[jax.Array, ...]) -> jax.Array:
            return jax_kernel(
                *args, sm_scale=scale, num_kv_pages_per_block=bkv, num_queries_per_block=bq,
                vmem_limit_bytes=vmem_limit_bytes, sliding_window=window, soft_cap=soft_cap,
            )  # fmt: skip

        def nothing(args: tuple[jax.Array, ...]) -> jax.Array:
            return jnp.zeros_like(args[0])

        out = lax.cond(inputs.num_seqs[0] > 0, run, nothing, args)
    else:

        def host(*arrays: np.ndarray) -> np.ndarray:
            return _reference_on_host(*arrays, scale=scale, window=window, soft_cap=soft_cap)

        out = jax.pure_callback(host, jax.ShapeDtypeStruct(q.shape, q.dtype), *args)
    return mask_padding_rows(out, inputs.cu_q_lens, inputs.num_seqs)
