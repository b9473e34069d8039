"""The eviction probe through the public API: with one LRU for
every tenant, tenant b learns from its own cache hits whether tenant a repeated a
cached prompt or sent a new one; with prefix_cache_partition="tenant" everything
b can read of itself is the same either way."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvsched

BS = 4
PROBE = 40  # blocks b primes and probes


def _prompt(blocks: int, seed: int) -> np.ndarray:
    i = np.arange(blocks * BS + 1, dtype=np.int64)
    return (1 + (i * 7 + seed * 131) % 1000).astype(np.int32)


def _run(sched: kvsched.Scheduler, now: float) -> float:
    while sched.live_requests:
        plan = sched.step(now=now)
        assert plan is not None
        sched.commit(plan, np.zeros(len(plan), np.int32), now=now)
        now += 0.01
    return now


def _probe(partition: str, a_repeats: bool) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """b's hits on its 40 blocks, b's own stats, the pool's gauges."""
    sched = kvsched.Scheduler(
        kvsched.SchedulerConfig(
            num_blocks=101,
            block_size=BS,
            max_num_seqs=4,
            max_batched_tokens=64,
            max_seq_len=256,
            overhead_reserve=0.0,
            prefix_cache_partition=partition,  # type: ignore[arg-type]
        )
    )
    sched.add_tenant(kvsched.TenantConfig("a", kv_floor_blocks=59))
    sched.add_tenant(kvsched.TenantConfig("b", kv_floor_blocks=41))
    now = 0.0
    pb, pa = _prompt(PROBE, 1), _prompt(20, 2)
    sched.submit("b", pb, 1, now=now)
    now = _run(sched, now)
    sched.submit("a", pa, 1, now=now)
    now = _run(sched, now)
    sched.submit("a", pa if a_repeats else _prompt(58, 3), 1, now=now)
    now = _run(sched, now)
    before = sched.stats(now=now)["tenants"]["b"]["prefix_cache"]["hit_blocks"]
    sched.submit("b", pb, 1, now=now)
    now = _run(sched, now)
    st = sched.stats(now=now)
    b = dict(st["tenants"]["b"])
    return b["prefix_cache"]["hit_blocks"] - before, b, dict(st["pool"])


def test_shared_lru_leaks_the_other_tenants_allocations():
    hits_repeat, b_repeat, _ = _probe("shared", True)
    hits_new, b_new, _ = _probe("shared", False)
    assert hits_repeat == PROBE
    assert hits_new < PROBE
    assert b_repeat != b_new


@pytest.mark.parametrize("field", ["prefix_cache", "prefill_tokens", "ttft", "e2e"])
def test_partitioned_cache_shows_the_prober_the_same(field: str):
    hits_repeat, b_repeat, pool_repeat = _probe("tenant", True)
    hits_new, b_new, pool_new = _probe("tenant", False)
    assert hits_repeat == hits_new == PROBE
    assert b_repeat[field] == b_new[field]
    assert b_repeat == b_new
    # Pool-wide gauges still show a's usage: they are the operator's.
    assert pool_repeat["evictable"] != pool_new["evictable"]
