"""Tier 0 first under every limit, through the Python API: a higher
tier refused for a global limit that lower tiers hold displaces them (each
ends "shed", with a retry_after, through the terminal events), all or nothing;
the ladder caps max_tokens below the top tier only, and says so in the
FinishedRequest."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

import kvsched

from helpers import ids, without_rejections


def make(num_blocks: int = 401, *, preempt: bool = False, **kw) -> kvsched.Scheduler:
    cfg = {"num_blocks": num_blocks, "block_size": 8, "max_num_seqs": 2, "max_waiting": 2,
           "max_seq_len": 256, "overhead_reserve": 0.0, "prefix_caching": False,
           "preempt_lower_tiers": preempt, "ladder_retry_after_s": 0.75, **kw}  # fmt: skip
    s = kvsched.Scheduler(kvsched.SchedulerConfig(**cfg))
    for name, tier in (("gold", 0), ("silver", 1), ("bulk", 2)):
        s.add_tenant(kvsched.TenantConfig(name, tier=tier))
    return s


def run_all(s: kvsched.Scheduler, now: float = 1.0) -> list[kvsched.FinishedRequest]:
    out: list[kvsched.FinishedRequest] = []
    for k in range(10_000):
        plan = s.step(now=now + k)
        if plan is None:
            out += s.take_finished()
            if not s.live_requests:
                return out
            continue
        out += s.commit(plan, np.ones(len(plan), np.int32), now=now + k).finished
    raise AssertionError("requests still live")


def test_tier_0_takes_a_lower_tiers_waiting_place_and_its_waiter_is_told():
    s = make()
    bulk = [s.submit("bulk", ids(8), 8, now=0.0) for _ in range(2)]
    silver = [s.submit("silver", ids(8), 8, now=0.0) for _ in range(2)]
    # 4 live requests, the cap: a new gold request is not refused "concurrency".
    g = s.submit("gold", ids(8), 8, now=0.5)
    (f,) = s.take_finished()
    # The lowest tier first, the newest of it.
    assert (f.request_id, f.tenant, f.reason) == (bulk[1], "bulk", "shed")
    assert f.retry_after == 0.75 and len(f.output_ids) == 0 and f.finished == 0.5
    assert [e for e in s.take_events() if e["kind"] == "displaced"] == [
        {"kind": "displaced", "request_id": bulk[1], "tenant": "bulk", "by_tenant": "gold",
         "limit": "concurrency", "ran": False, "at": 0.5}
    ]  # fmt: skip
    assert s.stats(now=0.5)["displaced"] == 1
    assert s.stats(now=0.5)["tenants"]["bulk"]["cancelled"] == 1
    # Cancelling the displaced request is not an error: it already ended.
    assert s.cancel(bulk[1], now=0.6) is False
    # Silver (tier 1) displaces bulk, never gold.
    s.submit("silver", ids(8), 8, now=0.7)
    assert [f.request_id for f in s.take_finished()] == [bulk[0]]
    with kvsched_rejected("concurrency"):
        s.submit("silver", ids(8), 8, now=0.8)
    ended = run_all(s)
    assert {f.request_id for f in ended} == {g, *silver, g + 1}
    assert all(f.reason == "length" for f in ended)


class kvsched_rejected:
    """pytest.raises(kvsched.Rejected) that also checks the reason."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        assert isinstance(exc, kvsched.Rejected), f"expected a refusal, got {exc!r}"
        assert exc.reason == self.reason, exc
        return True


def test_not_enough_room_refuses_as_before_and_changes_nothing():
    s = make(num_blocks=41, max_waiting=10)  # 40 usable blocks of 8 tokens
    bulk = s.submit("bulk", ids(40), 40, now=0.0)  # 10 blocks
    s.submit("gold", ids(100), 100, now=0.0)  # 25 blocks
    before = without_rejections(s.stats(now=0.0))
    s.take_events()
    # 16 blocks: even bulk's 10 would leave it short (35 - 10 + 16 > 40).
    with kvsched_rejected("pool_full"):
        s.submit("gold", ids(64), 64, now=0.0)
    assert without_rejections(s.stats(now=0.0)) == before
    assert s.take_finished() == [] and s.take_events() == []
    # 15 blocks fit once bulk's reservation goes: bulk is displaced.
    s.submit("gold", ids(60), 60, now=0.0)
    (f,) = s.take_finished()
    assert (f.request_id, f.reason) == (bulk, "shed")
    (ev,) = [e for e in s.take_events() if e["kind"] == "displaced"]
    assert ev["limit"] == "pool_full"


def test_with_preemption_a_running_lower_tier_request_is_displaced():
    s = make(preempt=True)
    bulk = [s.submit("bulk", ids(8), 20, now=0.0) for _ in range(4)]
    plan = s.step(now=0.0)
    s.commit(plan, np.ones(len(plan), np.int32), now=0.1)
    for _ in range(4):
        s.submit("gold", ids(8), 4, now=0.2)
    shed = s.take_finished()
    assert [f.request_id for f in shed] == bulk[::-1]
    assert all(f.reason == "shed" and f.retry_after == 0.75 for f in shed)
    assert s.stats(now=0.2)["pool"]["used"] == 0
    assert len(run_all(s)) == 4


def test_the_ladder_caps_below_the_top_tier_and_the_finished_request_says_so():
    rung = {"signal": "queue_depth", "engage": 1, "release": 0.5, "action": "cap_max_tokens",
            "value": 3}  # fmt: skip
    s = make(max_waiting=10, ladder=[rung])
    s.submit("bulk", ids(8), 5, now=0.0)
    silver = s.submit("silver", ids(8), 10, now=0.0)  # queue depth 1: the rung engages
    gold = s.submit("gold", ids(8), 10, now=0.0)
    ended = {f.request_id: f for f in run_all(s)}
    fs, fg = ended[silver], ended[gold]
    assert (fs.reason, fs.max_tokens_capped, fs.asked_max_tokens, fs.max_tokens) == (
        "length",
        True,
        10,
        3,
    )
    assert len(fs.output_ids) == 3
    assert (fg.max_tokens_capped, fg.asked_max_tokens, fg.max_tokens) == (False, 10, 10)
    assert len(fg.output_ids) == 10 and fg.retry_after is None


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 2), st.integers(1, 40), st.integers(1, 40)),
        min_size=1,
        max_size=60,
    ),
    pages=st.integers(20, 100),
    preempt=st.booleans(),
)
def test_tier_0_is_never_refused_for_room_lower_tiers_hold(ops, pages, preempt):
    """Random mixes of three tiers: tier 0 is never refused concurrency or
    pool_full while the lower tiers' displaceable requests (not started; any,
    with preemption) would make room; every admitted request ends exactly
    once; the displaced ones end "shed" with a retry_after, never gold's."""
    s = make(num_blocks=pages + 1, preempt=preempt, max_num_seqs=3, max_waiting=4)
    tier = {"gold": 0, "silver": 1, "bulk": 2}
    names = list(tier)
    live: dict[int, tuple[str, int, bool]] = {}  # id -> (tenant, blocks, started)
    admitted, ended = [], {}
    now = 0.0

    def collect(finished):
        for f in finished:
            assert f.request_id not in ended, "one terminal event each"
            ended[f.request_id] = f
            live.pop(f.request_id, None)

    for k, (op, t, n, m) in enumerate(ops):
        now += 0.01
        name = names[t]
        if op <= 2:
            movable = [v for v in live.values() if tier[v[0]] > t and (preempt or not v[2])]
            committed = s.stats(now=now)["pool"]["reserved"]  # no floors here
            try:
                rid = s.submit(name, ids(n, start=k), m, now=now)
            except kvsched.Rejected as e:
                if t == 0 and e.reason in ("concurrency", "pool_full"):
                    room = committed - sum(v[1] for v in movable) + -(-(n + m) // 8) <= pages
                    fits = len(live) - len(movable) < 7 and room
                    assert not fits, f"tier 0 refused {e.reason} with {len(movable)} displaceable"
            else:
                admitted.append(rid)
                live[rid] = (name, -(-(n + m) // 8), False)
            collect(s.take_finished())
        elif op == 3:
            plan = s.step(now=now)
            if plan is not None:
                for rid in plan.request_ids.tolist():
                    if rid in live:
                        live[rid] = (*live[rid][:2], True)
                collect(s.commit(plan, np.ones(len(plan), np.int32), now=now).finished)
            collect(s.take_finished())
        elif admitted:
            rid = admitted[n % len(admitted)]
            if rid in live:
                assert s.cancel(rid, now=now)
                collect(s.take_finished())
    collect(run_all(s, now + 1))
    assert set(ended) == set(admitted)
    shed = [f for f in ended.values() if f.reason == "shed"]
    assert all(f.retry_after == 0.75 and f.tenant != "gold" for f in shed)
    assert s.stats(now=now)["displaced"] == len(shed)
