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
from kvsched.engine.kernels.layout import cache_mode

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


def _reference_on_host(*arrays: np.ndarray, scale: float) -> np.ndarray:
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
                              sm_scale=scale)
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
) -> jax.Array:
    """q [T, Hq, D], cache [P, bs, 2*Hkv, D] (or packed [P, bs, Hkv, 2*D]; with
    `layer`, the stacked [L, P, ...] cache read at layer `layer`) -> [T, Hq, D],
    padding rows 0. impl: "kernel" (JAX's Pallas TPU kernel; block sizes from its
    tuned table unless both are given), "reference" (JAX's jnp reference through
    a host callback), or None: the kernel on TPU, the reference elsewhere."""
    t, hq, d = q.shape
    kv_pages, offset = kernel_layout(cache, d, layer)
    hkv = kv_pages.shape[2] // 2
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
    if impl is None:
        impl = "kernel" if jax.default_backend() == "tpu" else "reference"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, not {impl!r}")
    page_indices = inputs.page_indices + offset
    args = (q, kv_pages, inputs.kv_lens, page_indices, inputs.cu_q_lens, inputs.num_seqs)
    if impl == "kernel":

        def run(args: tuple[jax.Array, ...]) -> jax.Array:
            return jax_kernel(
                *args, sm_scale=scale, num_kv_pages_per_block=num_kv_pages_per_block,
                num_queries_per_block=num_queries_per_block, vmem_limit_bytes=vmem_limit_bytes,
            )  # fmt: skip

        def nothing(args: tuple[jax.Array, ...]) -> jax.Array:
            return jnp.zeros_like(args[0])

        out = lax.cond(inputs.num_seqs[0] > 0, run, nothing, args)
    else:

        def host(*arrays: np.ndarray) -> np.ndarray:
            return _reference_on_host(*arrays, scale=scale)

        out = jax.pure_callback(host, jax.ShapeDtypeStruct(q.shape, q.dtype), *args)
    return mask_padding_rows(out, inputs.cu_q_lens, inputs.num_seqs)
