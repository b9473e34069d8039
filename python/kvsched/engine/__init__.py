"""The JAX side: paged KV cache arrays and attention backends that consume
kvsched step plans.

Needs `jax` (`pip install "kvsched[engine]"`). Backends take the plan's arrays
as they come out of `Scheduler.step()`:

- `reference`: pure jnp with static shapes; runs anywhere; checked against a
  float64 numpy oracle.
- `pallas`: kvsched's own ragged paged attention kernel (mixed prefill chunks and
  decodes in one call), written for TPU (Mosaic) and run on CPU in Pallas' TPU
  interpret mode.
"""

from kvsched.engine.attention import paged_attention
from kvsched.engine.inputs import AttentionInputs
from kvsched.engine.kernels.reference import reference_attention
from kvsched.engine.kv_cache import KVCacheSpec, init_cache, write_kv

__all__ = [
    "AttentionInputs",
    "KVCacheSpec",
    "init_cache",
    "paged_attention",
    "reference_attention",
    "write_kv",
]
