"""Attention over the paged KV cache, driven by a kvsched step plan: the
dispatch from a backend name to a kernel, and nothing else.

Every backend computes, for each scheduled token t of sequence s (the tokens of
s are rows cu_q_lens[s]:cu_q_lens[s+1], the last q_len of its kv_lens[s]),
softmax(q_t . K_s^T * scale, causal) . V_s over the first kv_lens[s] positions
of s's pages, with grouped-query attention (query head h reads KV head
h // (Hq / Hkv)). Rows past the plan's tokens are padding: their output is 0.

Backends: `reference` (pure jnp, static shapes; kernels/reference.py), `pallas`
(kvsched's kernel for TPU, kernels/tpu.py; on an NVIDIA GPU it picks the Triton
variant) and `pallas_gpu` (the Triton variant, kernels/gpu.py). The float64
numpy oracle for tests is kernels.reference.oracle_attention.

Import order: this module sits above the kernels (kvsched.engine.kernels), the
plan arrays (inputs) and the mesh axis (mesh), and below the model; it imports
nothing that imports it. The two Pallas kernels are imported on first use: the
Pallas TPU and Triton modules cost about 0.2 s to import, which a
reference-only engine (and `import kvsched.engine`) never pays.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kvsched.engine.inputs import AttentionInputs
from kvsched.engine.kernels.reference import reference_attention
from kvsched.engine.kv_cache import QuantizedKV, UnsupportedKVDtype, is_quantized
from kvsched.engine.mesh import CACHE_SPEC, HEADS_SPEC

__all__ = ["AttentionInputs", "paged_attention", "reference_attention"]


def paged_attention(
    q: jax.Array,
    cache: jax.Array | QuantizedKV,
    inputs: AttentionInputs,
    *,
    scale: float,
    backend: str = "reference",
    mesh: Mesh | None = None,
    layer: jax.Array | int | None = None,
    **kw: Any,
) -> jax.Array:
    """Attention for a plan with the named backend ("reference" or "pallas").
    With `layer`, `cache` is the stacked [L, P, bs, 2*Hkv, D] array of every
    layer and layer `layer` is read. With a mesh, the Pallas kernel runs once per
    device on its own KV heads (shard_map); the reference is left to XLA's
    partitioner. An int8 `QuantizedKV` cache is read by the reference only."""
    if backend == "reference":
        return reference_attention(q, cache, inputs, scale=scale, layer=layer)
    if is_quantized(cache) and backend in ("pallas", "pallas_gpu"):
        raise UnsupportedKVDtype(
            f"attention backend {backend!r} cannot read an int8 KV cache: int8 KV is "
            "supported by the reference backend; the Pallas kernels read float caches "
            "(use backend='reference' or a float32/bfloat16 kv_dtype)"
        )
    if backend == "pallas" and mesh is None and jax.default_backend() == "tpu":
        from kvsched.engine.kernels.tpu import ragged_paged_attention

        # On TPU the kernel reads the stacked cache at `layer`: no layer is copied
        # out. (The CPU interpreter copies a kernel's whole operands per call, so
        # there one layer's slice is much cheaper.)
        assert not is_quantized(cache)  # refused above
        return ragged_paged_attention(q, cache, inputs, scale=scale, layer=layer, **kw)
    if layer is not None:
        # The GPU kernel and the sharded path take one layer's cache.
        cache = jax.lax.dynamic_index_in_dim(cache, layer, axis=0, keepdims=False)
    if backend == "pallas" and mesh is not None:

        def local(q_: jax.Array, cache_: jax.Array, *plan: jax.Array) -> jax.Array:
            return paged_attention(q_, cache_, AttentionInputs(*plan), scale=scale,
                                   backend="pallas", **kw)  # fmt: skip

        plan = inputs.arrays()
        assert not is_quantized(cache)  # refused above
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(HEADS_SPEC, CACHE_SPEC) + (P(),) * len(plan),
            out_specs=HEADS_SPEC,
            check_vma=False,
        )(q, cache, *plan)
    if backend == "pallas" and jax.default_backend() == "gpu":
        backend = "pallas_gpu"
    if backend == "pallas":
        from kvsched.engine.kernels.tpu import ragged_paged_attention

        assert not is_quantized(cache)  # refused above
        return ragged_paged_attention(q, cache, inputs, scale=scale, **kw)
    if backend == "pallas_gpu":
        from kvsched.engine.kernels.gpu import ragged_paged_attention_gpu

        assert not is_quantized(cache)  # refused above
        return ragged_paged_attention_gpu(q, cache, inputs, scale=scale, **kw)
    raise ValueError(f"unknown attention backend {backend!r} (reference, pallas, pallas_gpu)")
