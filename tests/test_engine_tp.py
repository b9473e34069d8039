"""Tensor parallelism on 4 forced host devices (a fresh process: the device
count is fixed when jax starts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_kv_heads_shard_over_four_devices_and_generation_is_unchanged(backend):
    script = Path(__file__).parent / "tp_check.py"
    done = subprocess.run([sys.executable, str(script), backend], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["devices"] == 4
    assert r["cache_spec"] == "P(None, None, None, 'tp', None)"
    # 4 KV heads -> 8 combined K/V heads, 2 per device: each holds a quarter.
    assert r["shard_shapes"] == [[2, 64, 4, 2, 16]] * 4  # [layers, pages, block, K/V heads, d]
    assert all(r["equal_dense"]), "the same plan drives every shard; tokens equal dense"
    assert r["programs"] == r["buckets"]
