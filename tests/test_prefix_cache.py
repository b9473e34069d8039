"""Prefix caching through the Python API: hits, namespaces, salts, the secret,
accounting, and cached runs that generate exactly what uncached runs do."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsched

from helpers import FakeEngine, ids, without_rejections

BS = 8


def make(num_blocks: int = 128, tenants=(("a", None),), **kw) -> FakeEngine:
    cfg = dict(num_blocks=num_blocks, block_size=BS, max_num_seqs=4, max_batched_tokens=64,
               max_seq_len=256, overhead_reserve=0.0, max_waiting=8)  # fmt: skip
    cfg.update(kw)
    sched = kvsched.Scheduler(kvsched.SchedulerConfig(**cfg))
    for name, ns in tenants:
        sched.add_tenant(kvsched.TenantConfig(name, prefix_namespace=ns))
    return FakeEngine(sched, cfg["num_blocks"], BS)


def drain(eng: FakeEngine, now: float = 0.0) -> float:
    while eng.sched.live_requests:
        plan, _ = eng.step(now)
        assert plan is not None, "live requests make progress"
        now += 0.01
    return now


def first_positions(eng: FakeEngine, rid: int, now: float) -> list[int]:
    """Positions the first plan that runs `rid` schedules for it."""
    while True:
        plan, _ = eng.step(now)
        now += 0.01
        rids = plan.request_ids.tolist()
        if rid in rids:
            i = rids.index(rid)
            return plan.positions[plan.cu_q_lens[i] : plan.cu_q_lens[i + 1]].tolist()


def test_a_repeated_prompt_runs_only_its_tail_and_generates_the_same():
    eng = make()
    prompt = ids(43, start=100)
    a = eng.submit("a", prompt, 5)
    now = drain(eng)
    b = eng.submit("a", prompt, 5)
    assert first_positions(eng, b, now) == [40, 41, 42], "5 full blocks were cached"
    drain(eng, now + 1)
    fa, fb = eng.finished[a], eng.finished[b]
    assert fb.cached_tokens == 40 and fa.cached_tokens == 0
    assert fa.output_ids.tolist() == fb.output_ids.tolist()
    pc = eng.sched.stats()["tenants"]["a"]["prefix_cache"]
    assert pc == {"query_blocks": 10, "hit_blocks": 5, "query_tokens": 86, "hit_tokens": 40,
                  "hit_rate_blocks": 0.5, "hit_rate_tokens": 40 / 86}  # fmt: skip


@pytest.mark.parametrize(
    ("first", "second", "hit"),
    [
        ("a", "b", False),  # private namespaces
        ("s1", "s2", True),  # the same shared namespace
        ("s1", "x", False),  # another shared namespace
        ("a", "s1", False),  # a tenant's own namespace is not its group's
    ],
)
def test_namespaces(first, second, hit):
    tenants = [("a", None), ("b", None), ("s1", "team"), ("s2", "team"), ("x", "other")]
    eng = make(tenants=tenants)
    prompt = ids(40)
    eng.submit(first, prompt, 2)
    now = drain(eng)
    rid = eng.submit(second, prompt, 2)
    drain(eng, now)
    assert eng.finished[rid].cached_tokens == (32 if hit else 0)


def test_a_salt_as_str_or_bytes_and_a_bad_salt_changes_nothing():
    eng = make()
    prompt = ids(40)
    eng.submit("a", prompt, 2, cache_salt="user-1")
    now = drain(eng)
    same = eng.submit("a", prompt, 2, cache_salt=b"user-1")
    other = eng.submit("a", prompt, 2, cache_salt="user-2")
    plain = eng.submit("a", prompt, 2)
    drain(eng, now)
    assert [eng.finished[r].cached_tokens for r in (same, other, plain)] == [32, 0, 0]
    before = eng.sched.stats(now=0.0)
    with pytest.raises(kvsched.InvalidRequest, match="cache_salt must be str or bytes"):
        eng.sched.submit("a", prompt, 2, cache_salt=7)
    assert without_rejections(eng.sched.stats(now=0.0)) == without_rejections(before)


def test_the_secret_is_16_bytes_never_shown_and_changes_no_plan():
    with pytest.raises(kvsched.InvalidConfig, match="16 bytes"):
        kvsched.SchedulerConfig(prefix_cache_key=b"short")
    key = bytes(range(16))
    cfg = kvsched.SchedulerConfig(prefix_cache_key=key)
    assert cfg.prefix_caching
    assert key.hex() not in repr(cfg) and str(list(key)) not in repr(cfg)
    assert not hasattr(cfg, "prefix_cache_key")

    # Block names depend on the secret; which blocks are equal does not: two
    # schedulers with different secrets plan byte for byte alike.
    plans = []
    for k in (bytes(16), bytes([1] * 16)):
        eng = make(prefix_cache_key=k)
        got = []
        now = 0.0
        for i in range(6):
            eng.submit("a", ids(20 + 7 * (i % 3)), 3)
            plan, _ = eng.step(now)
            now += 0.01
            got.append([a.copy() for a in (plan.token_ids, plan.positions, plan.page_indices)])
        drain(eng, now)
        plans.append(got)
    for x, y in zip(*plans, strict=True):
        for u, v in zip(x, y, strict=True):
            assert np.array_equal(u, v)


def test_caching_off_hits_nothing_and_names_nothing():
    eng = make(prefix_caching=False)
    assert not eng.sched.config.prefix_caching
    eng.submit("a", ids(40), 2)
    now = drain(eng)
    rid = eng.submit("a", ids(40), 2)
    drain(eng, now)
    assert eng.finished[rid].cached_tokens == 0
    pool = eng.sched.stats()["pool"]
    assert (pool["cached"], pool["evictable"], pool["free"]) == (0, 0, pool["total"])


def test_shared_pages_count_once_in_the_pool_and_each_time_against_a_cap():
    # 16 pages; each request reserves 6 blocks (41 + 7 tokens), 5 shareable.
    eng = make(num_blocks=17)
    prompt = ids(41)
    a = eng.submit("a", prompt, 7)
    now = 0.0
    while eng.finished.get(a) is None and len(eng.truth[a]) < 42:
        eng.step(now)
        now += 0.01
    eng.submit("a", prompt, 7)
    eng.submit("a", prompt, 7)
    st_ = eng.sched.stats()
    t = st_["tenants"]["a"]
    assert (t["reserved_blocks"], t["shared_blocks"]) == (18, 10)
    assert st_["pool"]["committed"] == 8 and st_["pool"]["shared"] == 5
    drain(eng, now)
    capped = kvsched.TenantConfig("a", kv_cap_blocks=6)
    eng.sched.update_tenant(capped)
    eng.submit("a", prompt, 7)
    with pytest.raises(kvsched.Rejected) as e:
        eng.sched.submit("a", prompt, 7)
    assert e.value.reason == "tenant_budget"


def test_pool_stats_account_for_evictable_pages():
    eng = make(num_blocks=33)
    eng.submit("a", ids(40), 1)
    drain(eng)
    pool = eng.sched.stats()["pool"]
    assert pool["used"] == 0
    assert pool["cached"] == pool["evictable"] == 5  # 40 prompt + 1 generated, computed
    assert pool["free"] + pool["evictable"] == pool["total"]


@settings(max_examples=25, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(st.integers(1, 60), st.integers(0, 2), st.integers(1, 12)),
        min_size=1,
        max_size=12,
    ),
    pages=st.integers(16, 48),
)
def test_cached_and_uncached_runs_generate_the_same(reqs, pages):
    """Prompts from three families (each a prefix of the longer ones), one at a
    time into a small pool: every output equals the uncached run's."""
    outs = []
    for caching in (True, False):
        eng = make(num_blocks=pages + 1, prefix_caching=caching, max_seq_len=80)
        got = []
        now = 0.0
        for n, fam, m in reqs:
            if -(-(n + m) // BS) > pages:
                continue
            rid = eng.submit("a", ids(n, start=1000 * fam + 1), m)
            now = drain(eng, now)
            got.append(eng.finished[rid].output_ids.tolist())
        pool = eng.sched.stats()["pool"]
        assert pool["used"] == 0 and pool["free"] + pool["evictable"] == pool["total"]
        outs.append(got)
    assert outs[0] == outs[1]
