"""Extreme values through the public API: knobs at the ends of their ranges
(tenant floors, max_waiting, watermarks), plan shapes and allocations bounded by
the pool (or refused when the process cannot hold them), times that are not a
clock in seconds, and plan arrays nobody but the scheduler can write. Every bad
value is a typed kvsched error, never a PanicException (a BaseException: `except
Exception` would not catch it, so it fails here), and a scheduler built from
extreme knobs stays consistent: after any run of operations, ending what is
still live leaves nothing held. Integer knobs out of range are
test_config_knobs.py's."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
from collections import Counter

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import example, given

import kvsched

from helpers import ids

PLAN_ARRAYS = (
    "token_ids",
    "positions",
    "slot_mapping",
    "cu_q_lens",
    "kv_lens",
    "page_indices",
    "num_seqs",
    "distribution",
    "logits_indices",
)


def _sched(**kw) -> kvsched.Scheduler:
    return kvsched.Scheduler(kvsched.SchedulerConfig(num_blocks=256, block_size=16, **kw))


def _run_all(s: kvsched.Scheduler, now: float = 0.0, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        plan = s.step(now=now)
        if plan is None:
            return
        s.commit(plan, np.full(len(plan), 7, np.int32), now=now)
        now += 0.01


# -- knobs at the ends of their ranges ---------------------------------------------


def test_a_floor_larger_than_any_pool_is_refused_naming_the_bound() -> None:
    with pytest.raises(kvsched.InvalidConfig, match="kv_floor_blocks.*2147483647"):
        kvsched.TenantConfig("z", kv_floor_blocks=2**64 - 1)
    s = _sched()
    s.add_tenant(kvsched.TenantConfig("a", kv_floor_blocks=4))
    before = s.stats(now=0.0)
    # Within int32 but beyond this pool: the pool's own bound.
    with pytest.raises(kvsched.InvalidConfig, match="usable pool has"):
        s.add_tenant(kvsched.TenantConfig("z", kv_floor_blocks=2**31 - 1))
    with pytest.raises(kvsched.InvalidConfig, match="usable pool has"):
        s.update_tenant(kvsched.TenantConfig("a", kv_floor_blocks=2**31 - 1), now=0.0)
    assert s.stats(now=0.0) == before
    assert s.tenant("a").kv_floor_blocks == 4
    # Nothing is stuck: a request runs to the end.
    s.submit("a", ids(20), 5, now=0.0)
    _run_all(s)
    assert s.live_requests == 0


def test_a_huge_max_waiting_leaves_requests_admissible() -> None:
    s = _sched(max_num_seqs=8, max_waiting=2**64 - 8)  # the sum must not wrap to 0
    s.add_tenant(kvsched.TenantConfig("a"))
    for k in range(10):
        s.submit("a", ids(4, start=k * 10 + 1), 4, now=0.0)
    _run_all(s)
    assert s.stats(now=1.0)["tenants"]["a"]["finished"] == 10


def test_a_huge_watermark_reserves_the_final_length_not_a_wrapped_one() -> None:
    s = _sched(admission="overcommit", watermark_blocks=2**64 - 1)
    s.add_tenant(kvsched.TenantConfig("a"))
    s.submit("a", ids(4), 300, now=0.0)  # 304 tokens: 19 blocks
    assert s.stats(now=0.0)["pool"]["reserved"] == 19


# -- plan shapes and allocations bounded by the pool ------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"max_seq_len": 2**31 - 1},
        {"max_num_seqs": 10**8, "max_batched_tokens": 10**8},
        {"max_batched_tokens": 2**31 - 1},
        {"max_batched_tokens": 2**64 - 1, "max_num_seqs": 2**64 - 1},
        {"token_buckets": [16, 2**40], "max_batched_tokens": 2**31 - 1},
    ],
)
def test_absurd_plan_shapes_are_bounded_by_the_pool(kw) -> None:
    cfg = kvsched.SchedulerConfig(num_blocks=1024, block_size=16, **kw)
    s = kvsched.Scheduler(cfg)
    shape = s.plan_shape
    assert shape["max_seqs"] <= 1023 and shape["pages_per_seq"] <= 1023
    assert shape["max_tokens"] <= 1024 * 16 and s.token_buckets[-1] == shape["max_tokens"]
    s.add_tenant(kvsched.TenantConfig("a"))
    s.submit("a", ids(40), 8, now=0.0)
    _run_all(s)
    assert s.live_requests == 0
    s.reconfigure(**kw)  # the same knobs again: not a restart


def _in_subprocess(code: str, limit_bytes: int) -> subprocess.CompletedProcess[str]:
    prelude = textwrap.dedent(
        f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, ({limit_bytes}, {limit_bytes}))
        import kvsched
        """
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "make",
    [
        "kvsched.BlockPool(2**31 - 1, 1)",
        pytest.param(
            "kvsched.Scheduler(kvsched.SchedulerConfig(num_blocks=2**27 - 1, block_size=16))",
            marks=pytest.mark.slow,
        ),
        # The pool fits; its plan buffers (65535 x 65535 pages, twice) do not.
        "kvsched.Scheduler(kvsched.SchedulerConfig(num_blocks=2**16, block_size=16, "
        "max_num_seqs=2**16, max_batched_tokens=2**16, max_seq_len=2**20))",
    ],
)
def test_a_pool_the_process_cannot_hold_is_an_error_not_an_abort(make: str) -> None:
    # 3 GiB of address space: the interpreter, numpy and kvsched fit; a pool
    # of 2**31 pages (8 GiB of refcounts alone) does not.
    code = f"""
    try:
        {make}
    except (MemoryError, kvsched.InvalidConfig) as e:
        print("refused", type(e).__name__, e)
    else:
        print("built")
    """
    r = _in_subprocess(code, 3 << 30)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("refused"), r.stdout + r.stderr[-2000:]


# -- times that are not a clock ----------------------------------------------------


@pytest.mark.parametrize("bad", [1e308, 1e13, float("nan"), float("inf"), -float("inf"), -1.0])
def test_times_that_are_not_clocks_are_refused_everywhere(bad: float) -> None:
    s = _sched()
    s.add_tenant(kvsched.TenantConfig("a", rate_tokens_per_s=100.0))
    rid = s.submit("a", ids(4), 4, now=1.0)
    before = s.stats(now=1.0)
    calls = [
        lambda: s.submit("a", ids(4), 4, now=bad),
        lambda: s.step(now=bad),
        lambda: s.cancel(rid, now=bad),
        lambda: s.stop(rid, now=bad),
        lambda: s.update_tenant(kvsched.TenantConfig("a"), now=bad),
        lambda: s.stats(now=bad),
        lambda: s.pressure(now=bad),
        lambda: s.restore_records([], now=bad),
    ]
    for call in calls:
        with pytest.raises(kvsched.InvalidRequest, match="now"):
            call()
    plan = s.step(now=1.0)
    with pytest.raises(kvsched.InvalidRequest, match="now"):
        s.commit(plan, np.zeros(len(plan), np.int32), now=bad)
    s.commit(plan, np.zeros(len(plan), np.int32), now=1.0)
    assert s.stats(now=1.0)["tenants"]["a"]["admitted"] == before["tenants"]["a"]["admitted"]


def test_a_rate_limit_recovers_from_a_time_far_ahead() -> None:
    s = _sched()
    s.add_tenant(kvsched.TenantConfig("a", rate_tokens_per_s=100.0))
    s.submit("a", ids(4), 90, now=1e11)  # far ahead, within the bound
    with pytest.raises(kvsched.Rejected) as e:
        s.submit("a", ids(4), 90, now=50.0)  # back to the real clock
    assert e.value.reason == "rate_limited"
    wait = e.value.retry_after
    assert wait is not None and 0 < wait < 2, wait
    s.submit("a", ids(4), 90, now=50.0 + wait + 1e-6)


# -- plan arrays nobody but the scheduler writes -----------------------------------


def test_no_plan_array_can_be_made_writeable_again() -> None:
    s = _sched()
    s.add_tenant(kvsched.TenantConfig("a"))
    s.submit("a", ids(20), 4, now=0.0)
    plan = s.step(now=0.0)
    for name in PLAN_ARRAYS:
        arr = getattr(plan, name)
        chain = [arr]
        while isinstance(chain[-1].base, np.ndarray):
            chain.append(chain[-1].base)
        for a in chain:
            with pytest.raises(ValueError):
                a.flags.writeable = True
            with pytest.raises(ValueError, match="read-only"):
                a[...] = 0
    s.commit(plan, np.zeros(len(plan), np.int32), now=0.0)


def test_full_validation_finds_a_row_written_behind_the_schedulers_back() -> None:
    """numpy cannot write the arrays; raw memory can (ctypes). full_validation
    compares rows with the requests' own pages, raises InternalError, and the
    next step rewrites every row."""
    s = kvsched.Scheduler(
        kvsched.SchedulerConfig(num_blocks=64, block_size=4, full_validation=True)
    )
    s.add_tenant(kvsched.TenantConfig("a"))
    s.add_tenant(kvsched.TenantConfig("b"))
    ra = s.submit("a", ids(12), 30, now=0.0)
    s.submit("b", ids(12, start=500), 30, now=0.0)
    p0 = s.step(now=0.0)
    s.commit(p0, np.full(len(p0), 3, np.int32), now=0.0)
    p1 = s.step(now=0.01)
    s.commit(p1, np.full(len(p1), 3, np.int32), now=0.01)
    row_a = p0.request_ids.tolist().index(ra)
    rows = p0.page_indices  # buffer set 0, written again by the next step
    other = int(rows[1 - row_a, 0])
    assert rows[row_a, 0] != other
    addr = rows.ctypes.data + row_a * rows.strides[0]
    ctypes.memmove(addr, np.array([other], np.int32).ctypes.data, 4)
    with pytest.raises(kvsched.InternalError, match="does not hold the request's pages"):
        s.step(now=0.02)
    p2 = s.step(now=0.02)
    assert p2 is not None and int(p2.page_indices[row_a, 0]) != other
    s.commit(p2, np.full(len(p2), 3, np.int32), now=0.02)
    _run_all(s, now=0.03)
    assert s.live_requests == 0


# -- the boundary, searched ----------------------------------------------------------

EXTREMES = [0, 1, 2, 3, 2**31 - 1, 2**31, 2**32, 2**63, 2**64 - 8, 2**64 - 2, 2**64 - 1]
extreme = st.one_of(st.sampled_from(EXTREMES), st.integers(0, 63).map(lambda k: 2**k))
small_or_extreme = st.one_of(st.integers(1, 3000), extreme)
rates = st.one_of(
    st.none(),
    st.sampled_from([0.0, 1e-300, 1e-6, 1.0, 1e15, 1e300, float("inf"), float("nan"), -1.0]),
)


@st.composite
def scheduler_kwargs(draw):
    kw = {
        "num_blocks": draw(st.one_of(st.integers(0, 300), extreme)),
        "block_size": draw(st.one_of(st.integers(0, 33), extreme)),
        "max_num_seqs": draw(small_or_extreme),
        "max_batched_tokens": draw(small_or_extreme),
        "max_seq_len": draw(small_or_extreme),
        "max_waiting": draw(extreme),
        "long_prefill_chunk": draw(extreme),
        "full_validation": True,
    }
    if draw(st.booleans()):
        kw["token_buckets"] = sorted(set(draw(st.lists(extreme, min_size=1, max_size=4))))
    if draw(st.booleans()):
        kw["admission"] = "overcommit"
        kw["watermark_blocks"] = draw(extreme)
    return kw


@st.composite
def tenant_kwargs(draw):
    kw = {
        "tier": draw(st.sampled_from([0, 1, 2**31 - 1, 2**32 - 1])),
        "kv_floor_blocks": draw(st.one_of(st.just(0), extreme)),
        "kv_cap_blocks": draw(st.one_of(st.none(), extreme)),
        "max_concurrent": draw(st.one_of(st.none(), st.sampled_from([0, 1, 2**32 - 1]))),
        "rate_tokens_per_s": draw(rates),
        "max_step_tokens": draw(st.one_of(st.none(), extreme)),
    }
    if kw["rate_tokens_per_s"] is not None:
        kw["burst_tokens"] = draw(rates)
    return kw


ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(0, 1), st.integers(1, 90), extreme),
        st.tuples(st.just("step")),
        st.tuples(st.just("cancel"), st.integers(0, 100)),
        st.tuples(st.just("update"), st.integers(0, 1), tenant_kwargs()),
        st.tuples(st.just("now"), st.sampled_from([0.0, 1e6, 1e12, 1e13, -1.0, float("nan")])),
    ),
    max_size=30,
)


_PLAIN_TENANT = {
    "tier": 0,
    "kv_floor_blocks": 0,
    "kv_cap_blocks": None,
    "max_concurrent": None,
    "rate_tokens_per_s": None,
    "max_step_tokens": None,
}


@given(kw=scheduler_kwargs(), tenants=st.lists(tenant_kwargs(), min_size=1, max_size=2), ops=ops)
@example(  # a floor of 2**64 - 1 beside another: the floors' sum must not wrap
    kw={"num_blocks": 256, "block_size": 16, "max_num_seqs": 32, "max_batched_tokens": 2048},
    tenants=[
        {**_PLAIN_TENANT, "kv_floor_blocks": 4},
        {**_PLAIN_TENANT, "kv_floor_blocks": 2**64 - 1},
    ],
    # 20 requests of 15 blocks each, more than the 229 usable: a wrapped sum
    # would hide every reservation of the huge floor's tenant and admit them all.
    ops=[("submit", 1, 90, 150)] * 20 + [("step",)] * 40,
)
def test_extreme_knobs_raise_kvsched_errors_only_and_leave_nothing_held(kw, tenants, ops) -> None:
    """Random operations on a scheduler built from extreme knobs raise typed
    refusals only, and ending every request afterwards leaves nothing held
    (`_run_ops`). Most of these configs are refused and the schedulers built
    admit few requests: the next test runs the same operations on schedulers
    that do."""
    _run_ops(kw, tenants, ops)


def mostly(values: st.SearchStrategy[int]) -> st.SearchStrategy[int]:
    """`values` three times in four, else an extreme."""
    return st.one_of(values, values, values, extreme)


@st.composite
def working_scheduler_kwargs(draw):
    kw = {
        "num_blocks": draw(st.integers(2, 300)),
        "block_size": draw(st.sampled_from([1, 2, 4, 8, 16, 32])),
        "max_num_seqs": draw(st.integers(1, 16)),
        "max_batched_tokens": draw(mostly(st.integers(16, 512))),
        "max_seq_len": draw(st.one_of(st.integers(2, 3000), st.just(2**31 - 1))),
        "max_waiting": draw(mostly(st.integers(0, 16))),
        "long_prefill_chunk": draw(mostly(st.integers(1, 128))),
        "preempt_lower_tiers": draw(st.booleans()),
        "full_validation": True,
    }
    if draw(st.booleans()):
        kw["admission"] = "overcommit"
        kw["watermark_blocks"] = draw(mostly(st.integers(0, 8)))
    return kw


@st.composite
def working_tenant_kwargs(draw):
    return {
        "tier": draw(st.integers(0, 2)),
        "kv_floor_blocks": draw(st.one_of(st.just(0), st.integers(0, 8))),
        "kv_cap_blocks": draw(st.one_of(st.none(), st.integers(1, 300), extreme)),
        "max_concurrent": draw(st.one_of(st.none(), st.integers(1, 8), st.just(2**32 - 1))),
        "max_step_tokens": draw(st.one_of(st.none(), st.integers(1, 256), extreme)),
    }


working_ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(0, 1), st.integers(1, 90),
                  mostly(st.integers(1, 64))),
        st.tuples(st.just("step")),
        st.tuples(st.just("cancel"), st.integers(0, 100)),
        st.tuples(st.just("update"), st.integers(0, 1), working_tenant_kwargs()),
        st.tuples(st.just("now"), st.sampled_from([0.0, 1e6, 1e12, 1e13, -1.0, float("nan")])),
    ),
    max_size=30,
)  # fmt: skip


@given(
    kw=working_scheduler_kwargs(),
    tenants=st.lists(working_tenant_kwargs(), min_size=2, max_size=2),
    ops=working_ops,
)
def test_operations_on_working_schedulers_raise_kvsched_errors_only_and_leave_nothing_held(
    kw, tenants, ops
) -> None:
    """The same operations where requests are admitted, run, share prompt
    prefixes (every prompt starts 1, 2, 3, ...), are preempted, displaced and
    cancelled: small pools and limits with an extreme value mixed in."""
    _run_ops(kw, tenants, ops)


def _run_ops(kw, tenants, ops) -> None:
    """Build the scheduler (full_validation on: every step checks its plan
    against the requests' pages) and its tenants, skipping what is refused, run
    `ops`, then `_end_everything`. Every error on the way must be a typed
    refusal, never an InternalError or a PanicException."""
    try:
        cfg = kvsched.SchedulerConfig(**kw)
    except kvsched.InvalidConfig:
        return
    if cfg.num_blocks > 1024 or cfg.num_blocks * cfg.block_size > 1 << 16:
        return  # valid, but more than a test should allocate
    try:
        s = kvsched.Scheduler(cfg)
    except kvsched.InvalidConfig:
        return
    names = ["t0", "t1"]
    for name, tk in zip(names, tenants, strict=False):
        try:
            s.add_tenant(kvsched.TenantConfig(name, **tk))
        except kvsched.InvalidConfig:
            pass
    now, live, issued = 0.0, [], []
    ended: Counter[int] = Counter()  # terminal events delivered, by request id
    for op in ops:
        try:
            if op[0] == "submit":
                rid = s.submit(names[op[1]], ids(op[2]), op[3], now=now)
                live.append(rid)
                issued.append(rid)
            elif op[0] == "step":
                plan = s.step(now=now)
                if plan is not None:
                    events = s.commit(plan, np.full(len(plan), 5, np.int32), now=now)
                    ended.update(f.request_id for f in events.finished)
            elif op[0] == "cancel" and live:
                s.cancel(live.pop(op[1] % len(live)), now=now)
            elif op[0] == "update":
                s.update_tenant(kvsched.TenantConfig(names[op[1]], **op[2]), now=now)
            elif op[0] == "now":
                s.stats(now=op[1])
                now = op[1]
        except kvsched.InternalError:
            raise
        except kvsched.KvSchedError:
            # Typed refusals (a tenant whose config was refused is unknown, a
            # bad time, a rejection); anything else, a PanicException above
            # all, fails the test.
            pass
        now += 0.01
    _end_everything(s, issued, ended, now)


def _end_everything(
    s: kvsched.Scheduler, issued: list[int], ended: Counter[int], now: float
) -> None:
    """Cancel every request still live, then check what must hold once none is:
    nothing running, waiting or planned; no page of the pool used, shared or
    reserved, and nothing promised beyond the tenants' floors; every cached page
    evictable; no tenant holding a page or a request; and every request
    admitted has had its terminal event delivered exactly once."""
    # The fuzz's clock may have run past the bound ([0, 1e12]); any accepted
    # time is fine here (further back re-bases the clock).
    end = min(now, 1e12)
    for rid in issued:
        try:
            s.cancel(rid, now=end)  # False: it had ended on its own
        except kvsched.UnknownRequest:
            pass  # the fuzz cancelled it
    assert s.step(now=end) is None
    ended.update(f.request_id for f in s.take_finished())
    assert s.live_requests == 0
    stats = s.stats(now=end)
    assert (stats["live_requests"], stats["running"], stats["waiting"]) == (0, 0, 0)
    pool = stats["pool"]
    assert (pool["used"], pool["shared"], pool["reserved"]) == (0, 0, 0), pool
    assert pool["committed"] == sum(t["kv_floor_blocks"] for t in stats["tenants"].values())
    assert pool["cached"] == pool["evictable"], pool
    for name, t in stats["tenants"].items():
        held = {k: t[k] for k in ("reserved_blocks", "used_blocks", "shared_blocks",
                                  "live_requests", "waiting", "running")}  # fmt: skip
        assert set(held.values()) == {0}, (name, held)
    assert sorted(ended) == sorted(issued), "a terminal event for every request"
    assert set(ended.values()) <= {1}, "and only one each"
