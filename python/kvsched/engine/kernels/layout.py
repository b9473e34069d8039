"""The paged KV cache layouts the kernels read, and the checks on them.

TPU tiles the minor dimension of every array by 128 lanes, in HBM as in VMEM.
Padding q with zeros along D leaves q.k unchanged if K is zero-padded too, and
zero-padded V only adds zero output columns to slice off; but padding the cache
per call would copy the whole cache every step, and a cache stored as
[P, bs, 2*Hkv, 64] is already half lane padding in HBM (half the pages the
memory holds, and every page DMA moves the padding). So the TPU kernel reads
two cache layouts, told apart by the cache's last dimension, and never copies
the cache:

- "split", [P, bs, 2*Hkv, D] (the step-plan layout: K of head h at 2h, V at
  2h + 1): K and V are separate rows of D lanes. Lane-dense when D % 128 == 0,
  the only case accepted on a TPU.
- "packed", [P, bs, Hkv, 2*D]: the same bytes in row-major order (K_h, V_h
  adjacent), viewed as one row [K_h | V_h] per head, so for D = 64 a page row
  is exactly 128 lanes and nothing is padded anywhere (the layout production
  TPU kernels use for head_dim 64: tpu-inference's hd64 variant). For
  D % 128 != 0 the kernel reads it in "row" mode: q is zero-padded per call to
  2*D lanes, [q | 0] (cheap: q is [T, Hq, D]); then s = [q | 0] . [K | V] =
  q . K exactly, and w . [K | V] = [w.K | w.V], whose right half is the output
  (the left half is discarded). The MXU contracts and produces 128 lanes per
  pass anyway, so the padded halves cost no extra matmul passes at D = 64. For
  D % 128 == 0 it reads it in "halves" mode: the row is split at lane D
  (aligned slices, no padding). On a TPU this layout needs 2*D % 128 == 0
  (D = 64, 128, 192, ...).

On CPU and GPU the two layouts are a free reshape of each other (`pack_cache`);
on TPU they are different tilings, so an engine serving D = 64 there allocates
and writes its cache packed (K|V concatenated along lanes at the slot) and
passes it as is. JAX's kernel (kernels/jax_rpa.py) reads the split layout; the
GPU kernel and the reference read split caches (the reference reads either).

Imports jax only (no Pallas): the kernels, jax_rpa and tests share it.
"""

from __future__ import annotations

import jax

LANES = 128  # the TPU's lane width: the minor dimension's tile


def on_tpu() -> bool:
    return jax.default_backend() == "tpu"


def cache_mode(head_dim: int, cache_shape: tuple[int, ...]) -> tuple[str, int]:
    """How a cache of this shape is read for queries of `head_dim`: ("split",
    Hkv) for [..., 2*Hkv, D]; ("halves" or "row", Hkv) for the packed
    [..., Hkv, 2*D] ("halves" when D is a multiple of 128)."""
    x, w = cache_shape[-2], cache_shape[-1]
    if w == head_dim:
        if x % 2:
            raise ValueError(f"a [..., 2*Hkv, D] cache needs an even head axis, got {x}")
        return "split", x // 2
    if w == 2 * head_dim:
        return ("halves" if head_dim % LANES == 0 else "row"), x
    raise ValueError(
        f"cache rows of {w} fit neither head_dim {head_dim} ([..., 2*Hkv, D]) "
        f"nor its packed layout ([..., Hkv, 2*D])"
    )


def checked_cache_mode(
    q: jax.Array, cache: jax.Array, layer: jax.Array | int | None, interpret: bool
) -> tuple[str, int]:
    """`cache_mode` for q [T, Hq, D] and a cache of one layer (rank 4) or of
    every layer with `layer` (rank 5); off the interpreter, a ValueError for a
    cache whose rows are not whole multiples of the TPU's lane width."""
    d = q.shape[-1]
    if cache.ndim != (4 if layer is None else 5):
        raise ValueError(
            f"cache of rank {cache.ndim}: expected [P, bs, X, W], or [L, P, bs, X, W] with layer"
        )
    mode, hkv = cache_mode(d, cache.shape)
    if not interpret:
        if mode == "split" and d % LANES:
            raise ValueError(
                f"head_dim {d} with a [P, bs, 2*Hkv, D] cache on TPU: each K or V row is {d} "
                f"lanes, the lane width is {LANES} (the cache would be lane padding in HBM); "
                f"store the cache packed, [P, bs, Hkv, 2*D] (see kernels.layout.pack_cache)"
            )
        if (2 * d) % LANES:
            raise ValueError(
                f"head_dim {d} on TPU: a packed [K | V] row of {2 * d} lanes is not a "
                f"multiple of the {LANES}-lane width (head_dim must be a multiple of 64)"
            )
    return mode, hkv


def pack_cache(cache: jax.Array) -> jax.Array:
    """[..., 2*Hkv, D] -> [..., Hkv, 2*D], [K_h | V_h] per row: the same bytes in
    row-major order (free on CPU / GPU; on TPU a relayout, so allocate it packed)."""
    *lead, x, d = cache.shape
    return cache.reshape(*lead, x // 2, 2 * d)


__all__ = ["LANES", "cache_mode", "checked_cache_mode", "on_tpu", "pack_cache"]
