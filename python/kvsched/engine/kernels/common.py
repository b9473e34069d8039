"""What every attention kernel shares: the mask value and the query-block
padding around a kernel call.

Imports no kernel (each kernel imports this), only kvsched.engine.inputs for
the plan arrays.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from kvsched.engine.inputs import AttentionInputs

MASK = -1e30  # finite: exp(MASK - MASK) would be 1, so masks use where, never arithmetic


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
