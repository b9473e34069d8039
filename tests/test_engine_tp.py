"""Tensor parallelism on 4 forced host devices (a fresh process: the device
count is fixed when jax starts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")


def run_check(*args: str) -> dict:
    script = Path(__file__).parent / "tp_check.py"
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_kv_heads_shard_over_four_devices_and_generation_is_unchanged(backend):
    r = run_check(backend)
    assert r["devices"] == 4 and r["kv_replicas"] == 1
    assert r["cache_spec"] == "P(None, None, None, 'tp', None)"
    # 4 KV heads -> 8 combined K/V heads, 2 per device: each holds a quarter.
    assert r["shard_shapes"] == [[2, 64, 4, 2, 16]] * 4  # [layers, pages, block, K/V heads, d]
    assert all(r["equal_dense"]), "the same plan drives every shard; tokens equal dense"
    assert r["programs"] == r["buckets"]


# Each backend once with 2 KV heads, where a copy in the wrong place (heads tiled
# rather than repeated) would be read by the wrong query heads.
@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize(("backend", "kv_heads"), [("reference", 1), ("pallas", 2)])
def test_fewer_kv_heads_than_devices_are_copied_and_generation_is_unchanged(backend, kv_heads):
    """2 KV heads (GQA) or 1 (MQA) on 4 devices: each device holds one copy of
    the KV head its query heads read, and greedy tokens equal the dense
    single-device recompute on the weights as given."""
    r = run_check(backend, str(kv_heads))
    assert r["kv_replicas"] == 4 // kv_heads
    assert r["cache_spec"] == "P(None, None, None, 'tp', None)"
    # One K/V head pair per device, and the pool sized for the copies: 64 KiB free
    # per device / (2 layers x 4 tokens x K and V x 16 x 4 bytes of one head per
    # block) = 64 blocks, exactly each device's 64 KiB. (Sized for the heads as
    # given, the pool would be 4 / kv_heads times that: past every device's memory.)
    assert r["pool_source"] == "measured"
    assert r["shard_shapes"] == [[2, 64, 4, 2, 16]] * 4
    assert r["cache_bytes_per_device"] == 1 << 16
    assert all(r["equal_dense"]), "tokens equal dense"
    assert r["checksum_as_given"], "the engine's checksum names the weights as loaded"
    assert r["programs"] == r["buckets"]
    # 6 KV heads on the 4 devices: refused, typed, before a pool is sized.
    assert r["refused"] == ["InvalidConfig", False], r["refused"]


def test_a_mesh_the_heads_cannot_use_is_refused_typed_before_anything_is_built():
    import kvsched
    from kvsched.engine.model import LlamaConfig
    from kvsched.engine.sharding import kv_replicas

    def model(hq: int, hkv: int, ffn: int = 128) -> LlamaConfig:
        return LlamaConfig(n_heads=hq, n_kv_heads=hkv, ffn_dim=ffn, name="m")

    assert kv_replicas(model(8, 4), 4) == 1
    assert kv_replicas(model(8, 8), 2) == 1
    assert kv_replicas(model(32, 8), 16) == 2  # Llama-3-70B's heads on 16 devices
    assert kv_replicas(model(8, 1), 8) == 8
    # The capacity model stores as many copies as the engine makes, wherever it runs.
    from kvsched.capacity import MODELS

    llama = LlamaConfig(n_heads=32, n_kv_heads=8, ffn_dim=14336, head_dim=128, dim=4096)
    for n in (1, 2, 4, 8, 16, 32):
        assert MODELS["llama-3-8b"].kv_copies(n) == kv_replicas(llama, n), n
    for hq, hkv, ffn, n, what in [
        (12, 6, 128, 4, "6 KV heads over 4 devices"),
        (9, 3, 128, 2, "n_heads=9"),
        (8, 4, 100, 8, "ffn_dim=100"),
    ]:
        with pytest.raises(kvsched.InvalidConfig, match=what):
            kv_replicas(model(hq, hkv, ffn), n)


@pytest.mark.slow
def test_copied_heads_are_the_same_attention():
    """replicate_kv_heads on its own: the wide model's dense logits equal the
    original's, and each copy sits next to the head it copies."""
    import numpy as np

    from kvsched.engine.model import LlamaConfig, forward_dense, init_params
    from kvsched.engine.sharding import replicate_kv_heads

    model = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=6, n_kv_heads=2,
                        head_dim=8, ffn_dim=64)  # fmt: skip
    params = init_params(model, seed=1)
    wide, wide_params = replicate_kv_heads(model, params, 3)
    assert wide.n_kv_heads == 6 and model.n_kv_heads == 2
    wk = np.asarray(params["layers"]["wk"]).reshape(2, 32, 2, 8)
    got = np.asarray(wide_params["layers"]["wk"]).reshape(2, 32, 6, 8)
    for j in range(6):
        np.testing.assert_array_equal(got[:, :, j], wk[:, :, j // 3])
    tokens = np.arange(1, 12, dtype=np.int32)
    np.testing.assert_allclose(np.asarray(forward_dense(wide_params, wide, tokens)),
                               np.asarray(forward_dense(params, model, tokens)),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
