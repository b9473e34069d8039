"""Attention over the paged KV cache, driven by a kvsched step plan: the
dispatch from a backend name to a kernel, and nothing else.

Every backend computes, for each scheduled token t of sequence s (the tokens of
s are rows cu_q_lens[s]:cu_q_lens[s+1], the last q_len of its kv_lens[s]),
softmax(q_t . K_s^T * scale, causal) . V_s over the first kv_lens[s] positions
of s's pages, with grouped-query attention (query head h reads KV head
h // (Hq / Hkv)). Rows past the plan's tokens are padding: their output is 0.

Per layer (static, so each distinct value is its own trace): a sliding window
W (`sliding_window`; None or 0: full), under which a token at position p
attends [max(0, p - W + 1), p] and every backend reads a sequence's pages only
from the one holding its first row's window start (a window group's page table
holds the null page 0, garbage, before that); a logit soft cap (`soft_cap`:
logits = c * tanh(logits / c) before masking); and attention sinks (`sinks`,
an [Hq] array: a learned logit per query head that joins the softmax
denominator only, gpt-oss). Every backend takes the window and the soft cap;
sinks are taken by the reference and kvsched's kernels, not by JAX's (which has
none: backend `jax` refuses them, and `pallas` on a TPU runs kvsched's kernel
for a call with sinks).

Backends: `reference` (pure jnp, static shapes; kernels/reference.py), `pallas`
(kvsched's kernel for TPU, kernels/tpu.py, run in Pallas' TPU interpreter off
TPU; on an NVIDIA GPU it picks the Triton kernel), `pallas_gpu` (kvsched's
Triton kernel, kernels/gpu.py) and `jax` (the ragged paged attention kernel
JAX ships, on TPU; its jnp reference elsewhere; kernels/jax_rpa.py). The
float64 numpy oracle for tests is kernels.reference.oracle_attention.

Which kernel `pallas` runs on a TPU, kvsched's or JAX's, is chosen by the
environment variable KVSCHED_TPU_ATTENTION (`tpu_attention()`):

    KVSCHED_TPU_ATTENTION   pallas on TPU runs
    jax (default)           JAX's ragged_paged_attention (kvsched's where
                            head_dim % 128 != 0: JAX's cannot run there)
    kvsched                 kvsched's kernels/tpu.py
    ours                    deprecated, same as kvsched

Neither kernel has been measured on a TPU; docs/kernels.md has the cost
model's predictions and how to measure (benches/tpu_check.py). Off TPU the
variable changes nothing. It is read when a call is traced: a jitted function
keeps the kernel it was traced with, so set it before the engine (or a
benchmark's jit) first runs. `resolve_backend` names the kernel a backend runs
on a platform. Keyword arguments go to the kernel that runs (`block_q` is
kvsched's, `num_kv_pages_per_block` JAX's).

Import order: this module sits above the kernels (kvsched.engine.kernels), the
plan arrays (inputs) and the mesh axis (mesh), and below the model; it imports
nothing that imports it. The Pallas kernels are imported on first use: the
Pallas TPU and Triton modules cost about 0.2 s to import, which a
reference-only engine (and `import kvsched.engine`) never pays.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import kvsched
from kvsched.engine.inputs import AttentionInputs
from kvsched.engine.kernels.common import check_soft_cap, check_window
from kvsched.engine.kernels.reference import reference_attention
from kvsched.engine.kv_cache import QuantizedKV, UnsupportedKVDtype, is_quantized
from kvsched.engine.mesh import AXIS, CACHE_SPEC, HEADS_SPEC, STACKED_CACHE_SPEC

__all__ = [
    "BACKENDS",
    "AttentionInputs",
    "paged_attention",
    "reference_attention",
    "resolve_backend",
    "tpu_attention",
]

BACKENDS = ("reference", "pallas", "pallas_gpu", "jax")
TPU_ATTENTION_ENV = "KVSCHED_TPU_ATTENTION"
TPU_ATTENTION_CHOICES = ("jax", "kvsched")  # JAX's kernel, kvsched's kernels/tpu.py
TPU_ATTENTION_ALIASES = {"ours": "kvsched"}  # deprecated, same as kvsched
TPU_ATTENTION_DEFAULT = "jax"  # unmeasured: see docs/kernels.md
JAX_KERNEL_HEAD_DIM = 128  # JAX's TPU kernel needs head_dim % 128 == 0


def tpu_attention() -> str:
    """Which kernel backend `pallas` runs on a TPU, from KVSCHED_TPU_ATTENTION:
    "jax" (the default: JAX's ragged_paged_attention) or "kvsched" (kvsched's
    kernels/tpu.py). "ours" is deprecated, same as kvsched (returned as
    "kvsched"). Any other value, "ours1" included (version 1 of kvsched's
    kernel was removed), is kvsched.InvalidConfig."""
    value = os.environ.get(TPU_ATTENTION_ENV, TPU_ATTENTION_DEFAULT).strip().lower()
    value = TPU_ATTENTION_ALIASES.get(value, value)
    if value not in TPU_ATTENTION_CHOICES:
        removed = "version 1 of kvsched's TPU kernel was removed; " if value == "ours1" else ""
        raise kvsched.InvalidConfig(
            f"{TPU_ATTENTION_ENV}={value!r}: {removed}must be one of "
            f"{', '.join(TPU_ATTENTION_CHOICES)} (which kernel the pallas backend runs on a "
            f"TPU; 'ours' is a deprecated alias of 'kvsched')"
        )
    return value


def resolve_backend(backend: str, platform: str | None = None, head_dim: int | None = None,
                    sinks: bool = False) -> str:  # fmt: skip
    """The kernel `backend` runs on `platform` (default: JAX's default
    backend) for heads of `head_dim`: "reference", "pallas" (kvsched's TPU
    kernel; the TPU interpreter off TPU), "pallas_gpu" (kvsched's Triton kernel;
    the interpreter off GPU), "jax_kernel" (JAX's TPU kernel) or
    "jax_reference" (JAX's jnp reference). JAX's kernel needs head_dim to be a
    multiple of 128 (its softmax state is 128 lanes wide; head_dim 64 fails in
    its lowering), so on TPU `pallas` keeps kvsched's kernel for other head
    dims, and `jax` refuses them. With `sinks` (the layer has attention sinks,
    which JAX's kernel lacks) `pallas` keeps kvsched's kernel on TPU and `jax`
    refuses them everywhere. An unknown name, an unsupported head_dim, sinks
    for `jax` or a bad KVSCHED_TPU_ATTENTION is kvsched.InvalidConfig."""
    if backend not in BACKENDS:
        raise kvsched.InvalidConfig(
            f"unknown attention backend {backend!r} ({', '.join(BACKENDS)})"
        )
    platform = platform or jax.default_backend()
    if backend == "jax" and sinks:
        raise kvsched.InvalidConfig(
            "attention backend 'jax': JAX's ragged_paged_attention has no attention sinks "
            "(backend 'pallas' runs kvsched's kernels, which do, and 'reference')"
        )
    jax_fits = (head_dim is None or head_dim % JAX_KERNEL_HEAD_DIM == 0) and not sinks
    if backend == "pallas" and platform == "tpu" and tpu_attention() == "jax" and jax_fits:
        backend = "jax"
    if backend == "pallas" and platform == "gpu":
        return "pallas_gpu"
    if backend == "jax" and platform == "tpu":
        if not jax_fits:
            raise kvsched.InvalidConfig(
                f"attention backend 'jax' on TPU: JAX's kernel needs head_dim to be a multiple "
                f"of {JAX_KERNEL_HEAD_DIM}, not {head_dim} (backend 'pallas' runs kvsched's "
                f"kernel, which reads narrower heads from a packed cache)"
            )
        return "jax_kernel"
    if backend == "jax":
        return "jax_reference"
    return backend


def paged_attention(
    q: jax.Array,
    cache: jax.Array | QuantizedKV,
    inputs: AttentionInputs,
    *,
    scale: float,
    backend: str = "reference",
    mesh: Mesh | None = None,
    layer: jax.Array | int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    **kw: Any,
) -> jax.Array:
    """Attention for a plan with the named backend (one of BACKENDS). With
    `layer`, `cache` is the stacked [L, P, bs, 2*Hkv, D] array of every layer
    and layer `layer` is read. With a mesh, the kernels run once per device on
    their own KV heads (shard_map); the reference is left to XLA's partitioner.
    An int8 `QuantizedKV` cache is read by the reference only. On a TPU,
    `pallas` runs kvsched's kernel or JAX's (`tpu_attention()`); `**kw` goes to
    the kernel that runs. `sliding_window` (a static int; None or 0: full),
    `soft_cap` (a static float or None) and `sinks` ([Hq] or None): see the
    module doc; `inputs.page_indices` is the page table of the layer's KV
    group. A bad window or cap is a ValueError, sinks of the wrong shape too."""
    window, cap = check_window(sliding_window), check_soft_cap(soft_cap)
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [Hq] = [{q.shape[1]}], got {sinks.shape}")
    opts: dict[str, Any] = {"sliding_window": window, "soft_cap": cap, "sinks": sinks}
    if backend == "reference":
        return reference_attention(q, cache, inputs, scale=scale, layer=layer, **opts)
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r} ({', '.join(BACKENDS)})")
    if is_quantized(cache):
        raise UnsupportedKVDtype(
            f"attention backend {backend!r} cannot read an int8 KV cache: int8 KV is "
            "supported by the reference backend; the Pallas kernels (kvsched's and "
            "JAX's) read float caches (use backend='reference' or a float32/bfloat16 "
            "kv_dtype)"
        )
    kernel = resolve_backend(backend, head_dim=q.shape[-1], sinks=sinks is not None)
    if kernel.startswith("jax_"):
        return _jax_attention(q, cache, inputs, scale=scale, mesh=mesh, layer=layer,
                              sliding_window=window, soft_cap=cap, **kw)  # fmt: skip
    if kernel == "pallas" and mesh is None and jax.default_backend() == "tpu":
        from kvsched.engine.kernels.tpu import ragged_paged_attention

        # On TPU the kernel reads the stacked cache at `layer`: no layer is copied
        # out. (The CPU interpreter copies a kernel's whole operands per call, so
        # there one layer's slice is much cheaper.)
        assert not is_quantized(cache)  # refused above
        return ragged_paged_attention(q, cache, inputs, scale=scale, layer=layer, **opts, **kw)
    if layer is not None:
        # The GPU kernel and the sharded path take one layer's cache.
        cache = jax.lax.dynamic_index_in_dim(cache, layer, axis=0, keepdims=False)
    if backend == "pallas" and mesh is not None:
        # Sinks are per query head: each device takes its heads' (zeros when
        # there are none, dropped again below: one traced function either way).
        has_sinks = sinks is not None
        sink_arr = sinks if sinks is not None else jnp.zeros((q.shape[1],), jnp.float32)

        def local(q_: jax.Array, cache_: jax.Array, sinks_: jax.Array, *plan: jax.Array
                  ) -> jax.Array:  # fmt: skip
            return paged_attention(q_, cache_, AttentionInputs(*plan), scale=scale,
                                   backend="pallas", sliding_window=window, soft_cap=cap,
                                   sinks=sinks_ if has_sinks else None, **kw)  # fmt: skip

        plan = inputs.arrays()
        assert not is_quantized(cache)  # refused above
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(HEADS_SPEC, CACHE_SPEC, P(AXIS)) + (P(),) * len(plan),
            out_specs=HEADS_SPEC,
            check_vma=False,
        )(q, cache, sink_arr, *plan)
    if backend == "pallas" and jax.default_backend() == "gpu":
        backend = "pallas_gpu"
    if backend == "pallas":
        from kvsched.engine.kernels.tpu import ragged_paged_attention

        assert not is_quantized(cache)  # refused above
        return ragged_paged_attention(q, cache, inputs, scale=scale, **opts, **kw)
    if backend == "pallas_gpu":
        from kvsched.engine.kernels.gpu import ragged_paged_attention_gpu

        assert not is_quantized(cache)  # refused above
        return ragged_paged_attention_gpu(q, cache, inputs, scale=scale, **opts, **kw)
    raise AssertionError(f"backend {backend!r} resolved to {kernel!r}: not dispatched")


def _jax_attention(
    q: jax.Array,
    cache: jax.Array,
    inputs: AttentionInputs,
    *,
    scale: float,
    mesh: Mesh | None,
    layer: jax.Array | int | None,
    **kw: Any,
) -> jax.Array:
    """Backend "jax" (kernels/jax_rpa.py). The stacked cache is read at `layer`
    in place, sharded or not: no layer is sliced out."""
    from kvsched.engine.kernels.jax_rpa import jax_ragged_paged_attention

    if mesh is None:
        return jax_ragged_paged_attention(q, cache, inputs, scale=scale, layer=layer, **kw)
    stacked = layer is not None
    layer_arr = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)

    def local(q_: jax.Array, cache_: jax.Array, layer_: jax.Array, *plan: jax.Array) -> jax.Array:
        return jax_ragged_paged_attention(
            q_, cache_, AttentionInputs(*plan), scale=scale,
            layer=layer_[0] if stacked else None, **kw,
        )  # fmt: skip

    plan = inputs.arrays()
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(HEADS_SPEC, STACKED_CACHE_SPEC if stacked else CACHE_SPEC, P())
        + (P(),) * len(plan),
        out_specs=HEADS_SPEC,
        check_vma=False,
    )(q, cache, layer_arr, *plan)
