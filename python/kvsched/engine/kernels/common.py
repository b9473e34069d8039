"""What every attention kernel shares: the mask value, the checks on a layer's
window and logit soft cap, and the query-block padding around a kernel call.

Imports no kernel (each kernel imports this), only kvsched.engine.inputs for
the plan arrays.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kvsched.engine.inputs import AttentionInputs

MASK = -1e30  # finite: exp(MASK - MASK) would be 1, so masks use where, never arithmetic


def check_window(sliding_window: Any) -> int | None:
    """A layer's window as the kernels take it: None for full attention (None
    or 0), else the static int W >= 1 (a token at position p attends
    [max(0, p - W + 1), p]). Anything else (a negative or traced value) is a
    ValueError: the window decides the kernels' loop bounds and block sizes,
    so it must be known when the call is traced."""
    if sliding_window is None:
        return None
    try:
        if isinstance(sliding_window, jax.Array):
            raise TypeError
        w = operator.index(sliding_window)
    except TypeError:
        raise ValueError(
            f"sliding_window must be a static Python int (None or 0: full attention), "
            f"not {type(sliding_window).__name__}"
        ) from None
    if w < 0:
        raise ValueError(f"sliding_window must be >= 0 (0: full attention), got {w}")
    return w or None


def check_soft_cap(soft_cap: Any) -> float | None:
    """A logit soft cap as the kernels take it: None, or a static float c > 0
    (logits become c * tanh(logits / c) before masking). 0, negatives and traced
    values are a ValueError."""
    if soft_cap is None:
        return None
    if isinstance(soft_cap, jax.Array):
        raise ValueError("soft_cap must be a static Python float, not a jax array")
    cap = float(soft_cap)
    if not cap > 0:
        raise ValueError(f"soft_cap must be > 0 (None: no cap), got {soft_cap!r}")
    return cap


def window_start(pos: jax.Array, window: int | None) -> jax.Array:
    """The first key position a query at `pos` attends: max(0, pos - W + 1),
    0 for full attention."""
    if window is None:
        return jnp.zeros_like(pos)
    return jnp.maximum(pos - (window - 1), 0)


def run_padded(
    call: Callable[..., jax.Array],
    q: jax.Array,
    cache: jax.Array,
    inputs: AttentionInputs,
    *,
    scale: float,
    block_q: int,
    interpret: bool,
    kv_heads: int | None = None,
) -> jax.Array:
    """Run a kernel `call` whose grid walks query blocks: check the head
    grouping, pad the rows to a multiple of block_q (the zero rows lie past the
    plan's tokens and come out 0), slice the padding off again. `kv_heads`
    defaults to a [..., 2*Hkv, D] cache's."""
    t, hq, _ = q.shape
    hkv = cache.shape[-2] // 2 if kv_heads is None else kv_heads
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
    pad = -t % block_q
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0))) if pad else q
    out = call(
        qp, cache, inputs.kv_lens, inputs.page_indices, inputs.cu_q_lens, inputs.num_seqs,
        scale=scale, block_q=block_q, interpret=bool(interpret),
    )  # fmt: skip
    return out[:t] if pad else out
