"""The JAX side: paged KV cache arrays and attention backends that consume
kvsched step plans.

Needs `jax` (`pip install -e ".[engine]"`). Backends take the plan's arrays
as they come out of `Scheduler.step()`:

- `reference`: pure jnp with static shapes; runs anywhere; checked against a
  float64 numpy oracle.
- `pallas`: kvsched's own ragged paged attention kernel (mixed prefill chunks and
  decodes in one call), written for TPU (Mosaic) and run on CPU in Pallas' TPU
  interpret mode.
- `jax`: JAX's ragged paged attention kernel on TPU, its jnp reference
  elsewhere (kernels/jax_rpa.py).

Modules, in import order (each imports only modules listed before it;
tests/test_engine_imports.py checks the package has no import cycle):

- `model_config`, `inputs` (AttentionInputs, StepInputs: the plan arrays as pytrees),
  `mesh` (the tensor-parallel axis and partition specs), `kv_cache` (cache
  arrays; KV bytes via kvsched.shapes.kv_bytes), `sampling`, `detokenizer`,
  `kv_gate` (the int8 KV gate): no engine imports.
- `kernels/`: `tiling` (block sizes, no JAX), `common`, `layout` (cache
  layouts), then `reference`, `tpu` (Pallas, Mosaic), `gpu` (Pallas, Triton),
  `jax_rpa` (JAX's kernel) and `cost` (the kernel cost model).
- `attention`: backend name -> kernel, nothing else.
- `model` (the Llama forward passes), then `sharding` (weights and caches on
  the mesh) and `loaders/`.
- `runner` (Engine: warmup, the step loop), then `kv_eval` (runs engines to
  produce an int8 KV report) and `multihost` (one Engine per process of JAX's
  multi-controller runtime, fed the same inputs).
"""

from kvsched._extras import require

require("kvsched.engine", "engine", modules=("jax",))  # one line naming the extra, if missing

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
