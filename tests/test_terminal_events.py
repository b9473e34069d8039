"""Terminal events and retry_after through the public API.

Every admitted request ends with exactly one FinishedRequest the engine loop
sees: a commit's `finished` (its own finishes, and first the requests ended
outside it since the last delivery), or `take_finished()` when step() had
nothing to run. Every refusal that can pass later says when to retry.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

import kvsched
from kvsched import checkpoint

from helpers import ids

DT = 0.01
BASE = dict(num_blocks=121, block_size=8, max_num_seqs=4, max_batched_tokens=64,
            max_seq_len=128, overhead_reserve=0.0, max_waiting=4)  # fmt: skip


def make(**kw) -> kvsched.Scheduler:
    sched = kvsched.Scheduler(kvsched.SchedulerConfig(**{**BASE, **kw}))
    sched.add_tenant(kvsched.TenantConfig("a"))
    sched.add_tenant(kvsched.TenantConfig("b"))
    return sched


class Loop:
    """An engine loop: step, sample token 7 for everyone, commit; take_finished
    when there was nothing to run. Collects every terminal event it sees."""

    def __init__(self, sched: kvsched.Scheduler) -> None:
        self.sched = sched
        self.now = 0.0
        self.ended: list[kvsched.FinishedRequest] = []

    def step(self) -> kvsched.StepEvents | None:
        plan = self.sched.step(now=self.now)
        if plan is None:
            self.ended += self.sched.take_finished()
            self.now += DT
            return None
        events = self.sched.commit(plan, np.full(len(plan), 7, np.int32), now=self.now)
        self.ended += events.finished
        self.now += DT
        return events

    def by_id(self) -> dict[int, kvsched.FinishedRequest]:
        out = {f.request_id: f for f in self.ended}
        assert len(out) == len(self.ended), "a request ended twice"
        return out


def test_a_drain_deadline_ends_each_unfinished_request_with_its_tokens_so_far(tmp_path):
    sched = make()
    loop = Loop(sched)
    a = sched.submit("a", ids(8), 50, now=0.0)
    b = sched.submit("b", ids(9), 50, now=0.0)
    for _ in range(5):
        loop.step()
    sched.drain(loop.now)
    deadline = loop.now
    assert loop.step() is None and sched.lifecycle == "drained"
    got = loop.by_id()
    assert set(got) == {a, b}
    for f in got.values():
        assert f.reason == "drain_deadline"
        assert f.output_ids.tolist() == [7] * 5
        assert f.finished == deadline
    assert sched.take_finished() == []
    # The checkpoint holds them as before.
    counts = sched.checkpoint(tmp_path / "ckpt.jsonl")
    assert counts == {"finished": 0, "in_flight": 2}
    lines = checkpoint.read_records(tmp_path / "ckpt.jsonl")  # between header and trailer
    assert {ln["request_id"]: (ln["reason"], ln["generated_ids"]) for ln in lines} == {
        a: ("drain_deadline", [7] * 5), b: ("drain_deadline", [7] * 5)
    }  # fmt: skip
    st_ = sched.stats(now=loop.now)["tenants"]
    assert (st_["a"]["finished"], st_["a"]["cancelled"]) == (0, 1)


def test_a_cancel_ends_with_one_cancelled_event_delivered_by_the_next_commit():
    sched = make()
    loop = Loop(sched)
    a = sched.submit("a", ids(8), 50, now=0.0)
    b = sched.submit("a", ids(9), 50, now=0.0)
    for _ in range(3):
        loop.step()
    assert sched.cancel(a, now=loop.now) is True
    events = loop.step()
    assert events is not None and events.request_ids.tolist() == [b]
    (f,) = events.finished
    assert (f.request_id, f.reason, f.output_ids.tolist()) == (a, "cancelled", [7] * 3)
    assert f.e2e == pytest.approx(0.03)
    assert sched.take_finished() == [], "the commit delivered it"
    assert loop.step().finished == [], "once"
    t = sched.stats(now=loop.now)["tenants"]["a"]
    assert (t["finished"], t["cancelled"], t["e2e"]["count"]) == (0, 1, 0)


def test_stop_ends_a_request_as_finished_and_take_finished_delivers_it_once():
    sched = make()
    loop = Loop(sched)
    a = sched.submit("a", ids(8), 50, now=0.0)
    for _ in range(4):
        loop.step()
    assert sched.stop(a, now=loop.now) is True
    assert sched.live_requests == 0
    (f,) = sched.take_finished()
    assert (f.request_id, f.reason, f.output_ids.tolist()) == (a, "stop", [7] * 4)
    assert f.ttft == 0.0 and f.finished == loop.now
    assert sched.take_finished() == []
    assert loop.step() is None and loop.ended == []
    t = sched.stats(now=loop.now)["tenants"]["a"]
    assert (t["finished"], t["cancelled"], t["e2e"]["count"]) == (1, 0, 1)
    assert sched.stats(now=loop.now)["pool"]["used"] == 0


def test_cancelling_a_request_that_already_ended_is_false_not_an_error():
    sched = make()
    loop = Loop(sched)
    done = sched.submit("a", ids(8), 2, now=0.0)
    while done not in loop.by_id():
        loop.step()
    before = sched.stats(now=0.0)
    assert sched.cancel(done) is False
    assert sched.stop(done) is False
    assert sched.stats(now=0.0) == before and sched.take_finished() == []
    # Never issued, or already ended by the caller: UnknownRequest.
    live = sched.submit("a", ids(8), 20, now=0.0)
    for bad in (0, live + 1):
        with pytest.raises(kvsched.UnknownRequest):
            sched.cancel(bad)
        with pytest.raises(kvsched.UnknownRequest):
            sched.stop(bad)
    assert sched.cancel(live) is True
    with pytest.raises(kvsched.UnknownRequest):
        sched.stop(live)
    assert len(sched.take_finished()) == 1


ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from("ab"), st.integers(1, 30), st.integers(1, 20)),
        st.tuples(st.just("step"), st.just(0), st.just(0), st.just(0)),
        st.tuples(st.sampled_from(["cancel", "stop"]), st.just(0), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("drain"), st.just(0), st.integers(0, 10), st.just(0)),
    ),
    max_size=60,
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(actions=ACTIONS, stop_token=st.booleans())
def test_every_request_ends_exactly_once_with_the_reason_it_ended_for(actions, stop_token):
    sched = make(max_num_seqs=3, max_waiting=3)
    loop = Loop(sched)
    admitted: list[int] = []
    ended_by_caller: dict[int, str] = {}
    for kind, tenant, x, y in actions:
        if kind == "submit":
            stops = [7] if stop_token and x % 3 == 0 else None
            try:
                admitted.append(sched.submit(tenant, ids(x), y, stop_token_ids=stops, now=loop.now))
            except kvsched.Rejected as e:
                assert e.reason in kvsched.REJECT_REASONS
        elif kind == "step":
            loop.step()
        elif kind in ("cancel", "stop") and admitted:
            rid = admitted[x % len(admitted)]
            try:
                ended = getattr(sched, kind)(rid, now=loop.now)
            except kvsched.UnknownRequest:
                assert rid in ended_by_caller, "only a request the caller ended is unknown"
                continue
            if ended:
                ended_by_caller[rid] = "cancelled" if kind == "cancel" else "stop"
            else:
                assert rid not in ended_by_caller
        elif kind == "drain":
            sched.drain(loop.now + x * DT)
    sched.drain(loop.now + 0.05)
    while sched.lifecycle != "drained":
        loop.step()
    loop.ended += sched.take_finished()
    got = loop.by_id()
    assert sorted(got) == sorted(admitted), "every request ends exactly once"
    for rid, f in got.items():
        if rid in ended_by_caller:
            assert f.reason == ended_by_caller[rid]
        else:
            assert f.reason in ("length", "stop", "drain_deadline")
        if f.reason == "length":
            assert len(f.output_ids) > 0
    s = sched.stats(now=loop.now)
    assert s["live_requests"] == 0 and s["pool"]["used"] == 0
    finished = sum(t["finished"] for t in s["tenants"].values())
    assert finished == sum(f.reason in ("length", "stop") for f in got.values())


# -- retry_after -----------------------------------------------------------------------


def refusal(sched: kvsched.Scheduler, tenant: str, n: int, m: int, now: float) -> kvsched.Rejected:
    with pytest.raises(kvsched.Rejected) as e:
        sched.submit(tenant, ids(n), m, now=now)
    return e.value


def test_retry_after_hint_is_a_live_knob():
    cfg = kvsched.SchedulerConfig(**BASE)
    assert cfg.retry_after_hint_s == 1.0 and "retry_after_hint_s=1.0" in repr(cfg)
    cfg = cfg.replace(retry_after_hint_s=2.5)
    assert cfg.retry_after_hint_s == 2.5 and cfg.replace().retry_after_hint_s == 2.5
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(kvsched.InvalidConfig, match="retry_after_hint_s"):
            kvsched.SchedulerConfig(retry_after_hint_s=bad)
    sched = kvsched.Scheduler(kvsched.SchedulerConfig(**BASE, require_warmup=True))
    sched.add_tenant(kvsched.TenantConfig("a"))
    assert (refusal(sched, "a", 8, 4, 0.0).retry_after) == 1.0
    sched.reconfigure(retry_after_hint_s=4.0)
    assert sched.config.retry_after_hint_s == 4.0
    e = refusal(sched, "a", 8, 4, 0.0)
    assert (e.reason, e.retry_after) == ("not_ready", 4.0)


def running(**kw) -> tuple[kvsched.Scheduler, Loop]:
    """Tenant "a" (cap 30 blocks, 2 live requests at most) runs two requests,
    10 steps in (DT apart, so the step period is measured): one of 6 blocks
    with 30 steps to go, one of 14 blocks with 90."""
    sched = kvsched.Scheduler(kvsched.SchedulerConfig(**{**BASE, **kw}))
    sched.add_tenant(kvsched.TenantConfig("a", kv_cap_blocks=30, max_concurrent=2))
    sched.add_tenant(kvsched.TenantConfig("c"))
    loop = Loop(sched)
    sched.submit("a", ids(8), 40, now=0.0)
    sched.submit("a", ids(8), 100, now=0.0)
    for _ in range(10):
        loop.step()
    return sched, loop


def test_capacity_refusals_estimate_when_the_running_requests_make_room():
    sched, loop = running()
    now = loop.now
    # a's own limit: one of its two must end, the first in 30 steps.
    e = refusal(sched, "a", 8, 4, now)
    assert e.reason == "concurrency" and e.retry_after == pytest.approx(30 * DT)
    # a's cap: 20 of 30 held, 11 blocks more need 1 freed: the 6-block one.
    e = refusal(sched, "a", 80, 8, now)
    assert e.reason == "tenant_budget" and e.retry_after == pytest.approx(30 * DT)
    # The scheduler's limit: 2 live of 2.
    sched.reconfigure(max_num_seqs=2, max_waiting=0)
    e = refusal(sched, "c", 8, 4, now)
    assert e.reason == "concurrency" and e.retry_after == pytest.approx(30 * DT)
    sched.reconfigure(max_num_seqs=4, max_waiting=4)
    # The pool: 120 usable, a holds 20, d's unused floor 90: 10 free; 16 blocks
    # need 6 freed: the 6-block one.
    sched.add_tenant(kvsched.TenantConfig("d", kv_floor_blocks=90))
    e = refusal(sched, "c", 8, 120, now)
    assert e.reason == "pool_full" and e.retry_after == pytest.approx(30 * DT)
    # The estimate shrinks as they run.
    for k in range(1, 6):
        loop.step()
        e = refusal(sched, "c", 8, 120, loop.now)
        assert e.reason == "pool_full" and e.retry_after == pytest.approx((30 - k) * DT)


def test_capacity_refusals_before_a_step_period_is_measured_get_the_hint():
    sched = kvsched.Scheduler(kvsched.SchedulerConfig(**BASE, retry_after_hint_s=0.5))
    sched.add_tenant(kvsched.TenantConfig("a", max_concurrent=1))
    sched.submit("a", ids(8), 40, now=0.0)
    sched.step(now=0.0)  # running, but one step measures no period
    e = refusal(sched, "a", 8, 4, 0.0)
    assert (e.reason, e.retry_after) == ("concurrency", 0.5)


def test_rate_limit_shed_and_draining_say_when():
    sched = kvsched.Scheduler(kvsched.SchedulerConfig(
        **BASE, ladder_retry_after_s=0.75,
        ladder=[{"signal": "reserved_share", "engage": 0.5, "release": 0.2,
                 "action": "shed_lowest_tier"}]))  # fmt: skip
    sched.add_tenant(kvsched.TenantConfig("gold", rate_tokens_per_s=100.0, burst_tokens=100.0))
    sched.add_tenant(kvsched.TenantConfig("bulk", tier=1))
    sched.submit("gold", ids(40), 40, now=0.0)  # 80 of the 100-token bucket
    e = refusal(sched, "gold", 20, 20, 0.0)  # 40 tokens: 20 more, at 100/s
    assert e.reason == "rate_limited" and e.retry_after == pytest.approx(0.2)
    for _ in range(4):
        sched.submit("bulk", ids(8), 120, now=0.0)  # 4 x 16 blocks: past half the pool
    e = refusal(sched, "bulk", 8, 8, 0.0)
    assert (e.reason, e.retry_after) == ("shed", 0.75)
    sched.drain(100.0)
    e = refusal(sched, "gold", 8, 4, 0.0)
    assert (e.reason, e.retry_after) == ("draining", 1.0)


def test_refusals_that_can_never_pass_have_no_retry_after():
    sched, loop = running()
    sched.add_tenant(kvsched.TenantConfig("small", kv_cap_blocks=10))
    sched.add_tenant(kvsched.TenantConfig("slow", rate_tokens_per_s=10.0, burst_tokens=50.0))
    for tenant, n, m, reason in [
        ("nobody", 8, 4, "unknown_tenant"),
        ("a", 0, 4, "invalid"),
        ("a", 8, 0, "invalid"),
        ("a", 100, 100, "too_long"),
        ("small", 80, 8, "tenant_budget"),  # 11 blocks: over its cap, ever
        ("slow", 40, 20, "rate_limited"),  # 60 tokens: over its burst, ever
    ]:
        e = refusal(sched, tenant, n, m, loop.now)
        assert (e.reason, e.retry_after) == (reason, None)
