"""Attention kernels over the paged KV cache, one module each; the dispatch
that picks one by backend name is kvsched.engine.attention. docs/kernels.md
says what each kernel is, what is predicted and what is measured.

- `reference`: pure jnp with static shapes, and the float64 numpy oracle.
- `tpu`: kvsched's ragged paged attention kernel in Pallas for TPU (Mosaic).
- `gpu`: kvsched's kernel in Pallas for NVIDIA GPUs (Triton).
- `jax_rpa`: JAX's own ragged paged attention kernel (TPU) and its jnp
  reference, fed from our plan and cache.
- `common`: what the kernels share (the mask value, query-block padding).
- `layout`: the paged cache layouts (split, packed) and their checks.
- `tiling`: block-size defaults from a plan's shape (no JAX), read by the
  kernels and by `cost`.
- `cost`: the kernel cost model (no JAX).

Kernels import `common`, `layout`, `tiling`, kvsched.engine.inputs and
kvsched.engine.kv_cache, never the dispatch above them. This package imports
none of its modules: the Pallas ones cost a fifth of a second to import and a
reference-only engine never needs them.
"""
