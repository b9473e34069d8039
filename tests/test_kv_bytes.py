"""KV bytes are counted one way: the capacity model, the cache spec, the pool
sizing and the arrays the engine allocates agree, for float and int8 KV."""

from __future__ import annotations

import sys

import pytest

import kvsched
from kvsched.capacity import KV_DTYPES, ModelShape, kv_bytes

pytest.importorskip("jax")
from kvsched.engine.kv_cache import (  # noqa: E402
    KVCacheSpec,
    init_cache,
    init_caches,
    kv_bytes_per_token,
)
from kvsched.engine.model import init_params  # noqa: E402
from kvsched.engine.model_config import LlamaConfig  # noqa: E402
from kvsched.engine.runner import Engine, kv_bytes_per_block, size_pool  # noqa: E402

MODEL = LlamaConfig(
    vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=64
)
BLOCK, BLOCKS = 4, 10


class _Cpu:
    def memory_stats(self):
        return None


def test_the_formula():
    assert kv_bytes(30, 3, 64, 2) == 2 * 30 * 3 * 64 * 2
    assert kv_bytes(30, 3, 64, 1, 4) == 2 * 30 * 3 * (64 + 4)
    assert kv_bytes(30, 3, 64, 1, 4, tokens=16) == 16 * kv_bytes(30, 3, 64, 1, 4)
    assert isinstance(kv_bytes(1, 1, 8, 2), int)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16", "int8"])
def test_every_user_counts_the_bytes_the_engine_allocates(kv_dtype):
    n_layers, hkv, d = MODEL.n_layers, MODEL.n_kv_heads, MODEL.head_dim
    per_token = kv_bytes_per_token(n_layers, hkv, d, kv_dtype)
    # The capacity model (no JAX) and the engine's cache agree per token...
    shape = ModelShape("tiny", n_layers, hkv, d, 0.0, MODEL.vocab_size)
    assert shape.kv_bytes_per_token(kv_dtype=kv_dtype) == per_token
    # ... the pool sizing per block ...
    cfg = kvsched.SchedulerConfig(num_blocks=BLOCKS, block_size=BLOCK, max_seq_len=32)
    per_block = kv_bytes_per_block(MODEL, BLOCK, kv_dtype)
    assert per_block == BLOCK * per_token
    assert size_pool(MODEL, cfg, kv_dtype, _Cpu()).bytes_per_block == per_block
    # ... the spec per layer ...
    spec = KVCacheSpec(BLOCKS, BLOCK, hkv, d, kv_dtype)
    assert n_layers * spec.bytes_per_token_per_layer == per_token
    assert spec.bytes_per_layer == BLOCKS * BLOCK * spec.bytes_per_token_per_layer
    # ... and the arrays allocated: one layer, the stacked layers, and an engine's.
    assert init_cache(spec).nbytes == spec.bytes_per_layer
    assert init_caches(spec, n_layers).nbytes == BLOCKS * per_block
    eng = Engine(MODEL, init_params(MODEL), kvsched.Scheduler(cfg), kv_dtype=kv_dtype,
                 kv_eval="unchecked")  # fmt: skip
    assert eng.caches.nbytes == BLOCKS * per_block


def test_a_packed_float_cache_holds_the_same_bytes():
    split = KVCacheSpec(BLOCKS, BLOCK, 2, 64, "bfloat16")
    packed = KVCacheSpec(BLOCKS, BLOCK, 2, 64, "bfloat16", packed=True)
    assert init_cache(packed).nbytes == init_cache(split).nbytes == packed.bytes_per_layer


def test_the_capacity_table_names_the_sizes_the_engine_stores():
    for name, (element, scale) in KV_DTYPES.items():
        if name in ("bf16", "fp16"):  # capacity's short names for bfloat16, float16
            continue
        assert kv_bytes_per_token(1, 1, 1, name) == kv_bytes(1, 1, 1, element, scale), name


@pytest.mark.subprocess
def test_capacity_imports_without_jax():
    """The formula lives in kvsched.capacity so that the capacity model and the
    simulator keep working with the core install (no JAX)."""
    import subprocess

    code = (
        "import sys, kvsched.capacity as c; "
        "assert c.kv_bytes(1, 1, 1, 2) == 4; "
        "print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
