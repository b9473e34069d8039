"""Sizing the KV pool: how many pages of KV the free device memory holds.

`size_pool` reads each device's free memory (the backend's figure; none on CPU,
where the configured size stands), holds back the overhead reserve and divides
by the bytes of one page (every layer's K and V, int8's scales included). With
tensor parallelism each device holds its share of every page, so the device
with the least free memory decides; over several processes the least of any
process does (a collective: every process sizes together).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

import kvsched
from kvsched.engine.kv_cache import kv_bytes_per_token
from kvsched.engine.model_config import LlamaConfig


def kv_bytes_per_block(
    model: LlamaConfig, block_size: int, kv_dtype: str, *, layers: int | None = None
) -> int:
    """K and V of `layers` layers (default: all of them) for one page (int8: with
    its per-token-per-head scales). A model cut into KV-cache groups holds one
    group's layers in a page (kvsched.shapes.KVGroupLayout.layers_per_group)."""
    n = model.n_layers if layers is None else layers
    return kv_bytes_per_token(n, model.n_kv_heads, model.head_dim, kv_dtype, tokens=block_size)


def measured_free_bytes(device: jax.Device) -> int | None:
    """Free accelerator memory as the backend reports it (None on CPU or when the
    backend gives no figure)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


@dataclass
class PoolSizing:
    num_blocks: int
    measured_free_bytes: int | None
    bytes_per_block: int
    source: str  # "measured" or "configured"


def size_pool(
    model: LlamaConfig,
    sched_config: kvsched.SchedulerConfig,
    kv_dtype: str,
    device: jax.Device,
    *,
    shards: int = 1,
    devices: list[jax.Device] | None = None,
    layers_per_block: int | None = None,
) -> PoolSizing:
    """Size the KV pool from free device memory less the overhead reserve; where
    the backend gives no figure (CPU), keep the configured size. With tensor
    parallelism each of `shards` devices holds 1/shards of every block, so the
    device with the least free memory decides. `layers_per_block`: the layers a
    page holds (a KV-cache group's; default every layer)."""
    per_block = kv_bytes_per_block(model, sched_config.block_size, kv_dtype,
                                   layers=layers_per_block)  # fmt: skip
    # On several processes (kvsched.engine.multihost) a process can read only its
    # own devices; every process must size the same pool, so the least free
    # memory of any process decides (a collective: every process sizes together).
    here = jax.process_index()
    frees = [measured_free_bytes(d) for d in (devices or [device])
             if getattr(d, "process_index", here) == here]  # fmt: skip
    if any(f is None for f in frees):
        return PoolSizing(sched_config.num_blocks, None, per_block, "configured")
    free = min(f for f in frees if f is not None)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        mib = multihost_utils.process_allgather(np.asarray([free >> 20], np.int32))
        free = int(np.min(mib)) << 20
    usable = int(free * (1.0 - sched_config.overhead_reserve))
    return PoolSizing(max(2, usable * shards // per_block), free, per_block, "measured")
