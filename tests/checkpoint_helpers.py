"""Schedulers and records shared by the checkpoint tests (test_checkpoint_file.py,
test_checkpoint_restore.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

import kvsched

from helpers import ids

# -- a scheduler with one tenant, drained with a request of each kind ---------------

BASE = dict(num_blocks=121, block_size=8, max_num_seqs=4, max_batched_tokens=32,
            max_seq_len=128, overhead_reserve=0.0, max_waiting=16)  # fmt: skip


def make() -> kvsched.Scheduler:
    """A fresh scheduler on BASE with one tenant, "gold"."""
    sched = kvsched.Scheduler(kvsched.SchedulerConfig(**BASE))
    sched.add_tenant(kvsched.TenantConfig("gold"))
    return sched


def drained_with_both_kinds() -> tuple[kvsched.Scheduler, int, int]:
    """A draining scheduler holding one request finished since the drain began
    and one still in flight (with a cache salt and stop tokens)."""
    sched = make()
    short = sched.submit("gold", ids(8), 1, now=0.0)
    long = sched.submit("gold", ids(9, 50), 20, stop_token_ids=[7], cache_salt=b"\x00\xff",
                        now=0.0)  # fmt: skip
    sched.drain(100.0)
    plan = sched.step(now=0.0)
    assert plan is not None
    events = sched.commit(plan, np.full(len(plan), 3, dtype=np.int32), now=0.0)
    assert [f.request_id for f in events.finished] == [short]
    return sched, short, long


# -- a scheduler with history, and records that fit it --------------------------------

CFG = dict(num_blocks=33, block_size=4, max_num_seqs=4, max_batched_tokens=64, max_seq_len=64,
           overhead_reserve=0.0, max_waiting=8)  # fmt: skip
SHARED = list(range(100, 116))  # four full blocks, cached by the warm scheduler


def warm() -> kvsched.Scheduler:
    """A scheduler with history: a finished request whose blocks the prefix
    cache holds, one live request holding 16 blocks (of 32), tenants of every
    kind a record can meet."""
    s = kvsched.Scheduler(kvsched.SchedulerConfig(**CFG))
    s.add_tenant(kvsched.TenantConfig("gold"))
    s.add_tenant(kvsched.TenantConfig("paused", max_concurrent=0))
    s.add_tenant(kvsched.TenantConfig("metered", rate_tokens_per_s=1.0, burst_tokens=10.0))
    s.submit("gold", np.array(SHARED + [1], dtype=np.int32), 1, now=0.0)
    plan = s.step(now=0.0)
    assert plan is not None
    s.commit(plan, np.full(len(plan), 9, dtype=np.int32), now=0.0)
    assert s.live_requests == 0
    s.submit("gold", ids(8, 500), 56, now=0.0)
    return s


def in_flight(
    rid: int,
    tenant: str = "gold",
    prompt: list[int] | None = None,
    max_tokens: int = 6,
    generated: list[int] | None = None,
) -> dict[str, Any]:
    return {"kind": "in_flight", "request_id": rid, "tenant": tenant, "reason": "in_flight",
            "prompt_ids": list(range(rid * 10, rid * 10 + 5)) if prompt is None else prompt,
            "generated_ids": [5] if generated is None else generated, "max_tokens": max_tokens,
            "stop_token_ids": [2], "cache_salt_hex": None, "arrival": 0.25}  # fmt: skip


FINISHED = {"kind": "finished", "request_id": 40, "tenant": "gold", "reason": "length",
            "prompt_len": 3, "output_ids": [7], "arrival": 0.0, "finished": 1.0,
            "cached_tokens": 0}  # fmt: skip


def good_records() -> list[dict[str, Any]]:
    """Three in-flight records that fit the warm scheduler (3 blocks each; one
    shares the cached prefix) and a finished one."""
    return [FINISHED, in_flight(1), in_flight(2, prompt=SHARED + [3]), in_flight(3)]


def state(s: kvsched.Scheduler) -> tuple[Any, ...]:
    """What a refused restore must not change."""
    return s.stats(now=1.0), s.live_requests, s.checkpoint_records()


def run_to_the_end(s: kvsched.Scheduler) -> None:
    """Step until nothing is live; then nothing of the pool is used, reserved
    or committed."""
    now = 1.0
    while s.live_requests:
        plan = s.step(now=now)
        assert plan is not None
        s.commit(plan, np.full(len(plan), 8, dtype=np.int32), now=now)
        now += 0.01
    pool = s.stats(now=now)["pool"]
    assert (pool["used"], pool["reserved"], pool["committed"]) == (0, 0, 0)
