"""step() / commit() through the Python API: the plan contract, chunked prefill,
buffer lifetime, determinism, preemption, and bad input to commit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsched

from helpers import FakeEngine, ids, sample_of


def make(num_blocks=257, block_size=8, **kw) -> tuple[kvsched.Scheduler, FakeEngine]:
    cfg = dict(
        max_num_seqs=8, max_batched_tokens=64, max_seq_len=256, max_waiting=32,
        full_validation=True,
    )  # fmt: skip
    cfg.update(kw)
    sched = kvsched.Scheduler(
        kvsched.SchedulerConfig(num_blocks=num_blocks, block_size=block_size, **cfg)
    )
    return sched, FakeEngine(sched, num_blocks, block_size)


def drain(engine: FakeEngine, now: float = 0.0, max_steps: int = 10_000) -> float:
    for _ in range(max_steps):
        if engine.sched.live_requests == 0:
            return now
        engine.step(now)
        now += 0.01
    raise AssertionError("requests still live")


def test_a_request_runs_to_max_tokens_and_frees_everything():
    sched, eng = make()
    sched.add_tenant(kvsched.TenantConfig("a"))
    rid = eng.submit("a", ids(20), 6, now=0.0)
    plan, events = eng.step(0.0)
    assert plan.request_ids.tolist() == [rid] and plan.samples.tolist() == [True]
    assert plan.num_tokens == 20 and plan.bucket == 32 and plan.num_decode == 0
    assert events.request_ids.tolist() == [rid]
    assert events.tokens.tolist() == [sample_of(np.asarray(eng.truth[rid][:20]))]
    drain(eng, 0.01)
    f = eng.finished[rid]
    assert f.reason == "length" and len(f.output_ids) == 6
    assert f.output_ids.tolist() == eng.truth[rid][20:]
    st_ = sched.stats(now=1.0)
    assert st_["pool"]["used"] == 0 and st_["pool"]["reserved"] == 0
    t = st_["tenants"]["a"]
    assert (t["tokens_in"], t["tokens_out"], t["finished"]) == (20, 6, 1)
    assert t["ttft"]["count"] == 1 and t["inter_token"]["count"] == 5


def test_stop_token_finishes_early():
    sched, eng = make()
    sched.add_tenant(kvsched.TenantConfig("a"))
    prompt = ids(12)
    first = sample_of(prompt)
    rid = eng.submit("a", prompt, 50, stop_token_ids=[first, 3], now=0.0)
    _, events = eng.step(0.0)
    (f,) = events.finished
    assert (f.request_id, f.reason, f.output_ids.tolist()) == (rid, "stop", [first])


def test_idle_scheduler_returns_no_plan():
    sched, _ = make()
    assert sched.step(now=0.0) is None


def test_plan_arrays_are_read_only():
    sched, eng = make()
    sched.add_tenant(kvsched.TenantConfig("a"))
    eng.submit("a", ids(5), 2, now=0.0)
    plan = sched.step(now=0.0)
    for name in ("token_ids", "slot_mapping", "page_indices", "cu_q_lens", "kv_lens"):
        arr = getattr(plan, name)
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = 1
        base = arr if arr.base is None else arr.base  # the view's base is frozen too
        with pytest.raises(ValueError, match="read-only"):
            base[0] = 1


def test_plan_arrays_live_until_the_second_step_after():
    """The documented lifetime: two buffer sets alternate."""
    sched, eng = make()
    sched.add_tenant(kvsched.TenantConfig("a"))
    for k in range(3):
        eng.submit("a", ids(10 + 7 * k, start=k * 100), 20, now=0.0)
    p0, _ = eng.step(0.0)
    snap = {k: getattr(p0, k).copy() for k in ("token_ids", "kv_lens", "page_indices")}
    p1, _ = eng.step(0.01)  # written into the other buffer set
    for k, v in snap.items():
        assert np.array_equal(getattr(p0, k), v), f"{k} changed one step later"
    assert not np.shares_memory(p0.kv_lens, p1.kv_lens)
    p2, _ = eng.step(0.02)  # reuses p0's buffers
    assert np.shares_memory(p0.kv_lens, p2.kv_lens)
    assert not np.array_equal(p0.kv_lens, snap["kv_lens"])


def test_chunked_prefill_gives_the_same_tokens_and_outputs_as_unchunked():
    def run(chunk: int, budget: int):
        sched, eng = make(long_prefill_chunk=chunk, max_batched_tokens=budget)
        sched.add_tenant(kvsched.TenantConfig("a"))
        seen: dict[int, list[tuple[int, int]]] = {}
        for k in range(5):
            eng.submit("a", ids(30 + 40 * k, start=7 * k), 9, now=0.0)
        now = 0.0
        while sched.live_requests:
            plan, _ = eng.step(now)
            cu = plan.cu_q_lens
            for i, rid in enumerate(plan.request_ids.tolist()):
                s = slice(cu[i], cu[i + 1])
                seen.setdefault(rid, []).extend(
                    zip(plan.positions[s].tolist(), plan.token_ids[s].tolist(), strict=True)
                )
            now += 0.01
        outputs = {rid: f.output_ids.tolist() for rid, f in eng.finished.items()}
        return seen, outputs, eng.plans

    chunked, out_c, steps_c = run(chunk=16, budget=32)
    whole, out_w, steps_w = run(chunk=256, budget=256)
    assert chunked == whole
    assert out_c == out_w and len(out_c) == 5
    assert steps_c > steps_w, "the small budget really did chunk"


def test_decodes_are_never_stalled_by_a_long_prefill():
    sched, eng = make(long_prefill_chunk=16, max_batched_tokens=32)
    sched.add_tenant(kvsched.TenantConfig("a"))
    short = [eng.submit("a", ids(4, start=k), 60, now=0.0) for k in range(4)]
    eng.step(0.0)
    long = eng.submit("a", ids(240, start=500), 2, now=0.0)
    now = 0.01
    while len(eng.truth[long]) == 240:
        plan, _ = eng.step(now)
        decoding = set(plan.request_ids[: plan.num_decode].tolist())
        assert decoding >= {r for r in short if r not in eng.finished}
        now += 0.01


def test_same_calls_give_byte_identical_plans():
    def run() -> list[bytes]:
        sched, eng = make(long_prefill_chunk=24)
        sched.add_tenant(kvsched.TenantConfig("a", weight=2.0))
        sched.add_tenant(kvsched.TenantConfig("b", tier=1))
        out = []
        for i in range(40):
            if i % 3 == 0:
                eng.submit("a" if i % 2 else "b", ids(10 + i, start=i), 5 + i % 4, now=i * 0.01)
            plan, _ = eng.step(i * 0.01)
            if plan is not None:
                out.append(
                    b"".join(
                        np.ascontiguousarray(getattr(plan, k)).tobytes()
                        for k in (
                            "token_ids",
                            "positions",
                            "slot_mapping",
                            "cu_q_lens",
                            "kv_lens",
                            "page_indices",
                            "num_seqs",
                            "distribution",
                            "logits_indices",
                            "request_ids",
                        )
                    )
                )
        return out

    assert run() == run()


def test_bad_commits_raise_and_change_nothing():
    sched, eng = make()
    sched.add_tenant(kvsched.TenantConfig("a"))
    eng.submit("a", ids(8), 4, now=0.0)
    eng.submit("a", ids(9), 4, now=0.0)
    plan = sched.step(now=0.0)
    before = sched.stats(now=0.0)
    # InvalidState, not a Rejected: a bad commit refuses no request.
    assert not issubclass(kvsched.InvalidState, kvsched.Rejected)
    assert issubclass(kvsched.InvalidState, kvsched.KvSchedError)
    with pytest.raises(kvsched.InvalidState, match="2 sequences"):
        sched.commit(plan, np.zeros(1, np.int32), now=0.0)
    with pytest.raises(kvsched.InvalidState, match="int32"):
        sched.commit(plan, np.zeros(2, np.int64), now=0.0)
    with pytest.raises(kvsched.InvalidState, match="negative"):
        sched.commit(plan, np.array([1, -1], np.int32), now=0.0)
    other, _ = make()
    other.add_tenant(kvsched.TenantConfig("a"))
    other.submit("a", ids(8), 4, now=0.0)
    foreign = other.step(now=0.0)
    with pytest.raises(kvsched.StalePlan):
        sched.commit(foreign, np.zeros(1, np.int32), now=0.0)
    with pytest.raises(kvsched.StalePlan, match="commit it first"):
        sched.step(now=0.0)
    assert sched.stats(now=0.0) == before
    sched.commit(plan, np.array([5, 6], np.int32), now=0.0)
    with pytest.raises(kvsched.StalePlan):
        sched.commit(plan, np.array([5, 6], np.int32), now=0.0)


def test_cancel_between_step_and_commit():
    sched, eng = make()
    sched.add_tenant(kvsched.TenantConfig("a"))
    a = eng.submit("a", ids(8), 4, now=0.0)
    b = eng.submit("a", ids(9), 4, now=0.0)
    plan = sched.step(now=0.0)
    sched.cancel(a)
    events = sched.commit(plan, np.array([5, 6], np.int32), now=0.0)
    assert events.request_ids.tolist() == [b]
    assert sched.stats(now=0.0)["tenants"]["a"]["cancelled"] == 1


def test_max_step_tokens_caps_steps_while_the_tenant_runs():
    sched, eng = make(max_batched_tokens=128, long_prefill_chunk=128, max_seq_len=1024,
                      num_blocks=513)  # fmt: skip
    sched.add_tenant(kvsched.TenantConfig("chat", max_step_tokens=24))
    sched.add_tenant(kvsched.TenantConfig("batch"))
    chat = eng.submit("chat", ids(6), 12, now=0.0)
    eng.submit("batch", ids(900), 2, now=0.0)
    now = 0.0
    while chat not in eng.finished:
        plan, _ = eng.step(now)
        assert plan.num_tokens <= 24
        now += 0.01
    plan, _ = eng.step(now)
    assert plan.num_tokens > 24


def test_overcommit_preempts_and_streams_match_an_unpressured_run():
    def run(**kw):
        sched, eng = make(**kw)
        sched.add_tenant(kvsched.TenantConfig("hi", tier=0))
        sched.add_tenant(kvsched.TenantConfig("lo", tier=1))
        for k in range(10):
            eng.submit("hi" if k % 3 == 0 else "lo", ids(20 + 5 * k, start=k * 50), 50, now=0.0)
        drain(eng)
        outputs = {rid: f.output_ids.tolist() for rid, f in eng.finished.items()}
        return sched.stats(now=100.0), outputs

    roomy, expected = run(num_blocks=1025)
    assert roomy["preemptions"] == 0
    tight, got = run(num_blocks=81, overhead_reserve=0.0, admission="overcommit")
    assert tight["preemptions"] > 0
    assert tight["tenants"]["lo"]["preemptions"] >= tight["tenants"]["hi"]["preemptions"]
    assert got == expected


def test_priority_preemption_is_opt_in_and_keeps_the_victims_place():
    for opt_in in (False, True):
        sched, eng = make(max_num_seqs=2, preempt_lower_tiers=opt_in)
        sched.add_tenant(kvsched.TenantConfig("gold", tier=0))
        sched.add_tenant(kvsched.TenantConfig("bulk", tier=1))
        b = [eng.submit("bulk", ids(6, start=k * 10), 40, now=0.0) for k in range(3)]
        for k in range(3):
            eng.step(k * 0.01)
        g = eng.submit("gold", ids(6, start=999), 3, now=0.05)
        plan, events = eng.step(0.05)
        if not opt_in:
            assert g not in plan.request_ids and events.preempted == []
            continue
        assert plan.preempted == [b[1]] and events.preempted == [b[1]]
        assert g in plan.request_ids.tolist()
        drain(eng, 0.06)
        assert eng.finished[b[1]].preemptions == 1


@settings(max_examples=25)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.integers(1, 90),
            st.integers(1, 40),
            st.integers(0, 30),
            st.booleans(),
        ),
        min_size=1,
        max_size=30,
    ),
    st.sampled_from(["reserve", "overcommit"]),
)
def test_random_workloads_every_plan_is_well_formed_and_every_request_ends(reqs, admission):
    sched, eng = make(
        num_blocks=97, max_num_seqs=4, max_batched_tokens=32, long_prefill_chunk=12,
        max_seq_len=160, max_waiting=6, admission=admission, preempt_lower_tiers=True,
    )  # fmt: skip
    for name, tier in (("a", 0), ("b", 1), ("c", 1)):
        sched.add_tenant(kvsched.TenantConfig(name, tier=tier, max_concurrent=4))
    outcome: dict[int, str] = {}
    rejected = 0
    pending = sorted(enumerate(reqs), key=lambda x: x[1][3])
    step = 0
    while pending or sched.live_requests:
        while pending and pending[0][1][3] <= step:
            k, (name, n, m, _, cancel) = pending.pop(0)
            try:
                rid = eng.submit(name, ids(n, start=k * 97), m, now=step * 0.01)
            except kvsched.Rejected as e:
                assert e.reason in kvsched.REJECT_REASONS
                rejected += 1
                continue
            if cancel and k % 2:
                sched.cancel(rid)
                outcome[rid] = "cancelled"
        eng.step(step * 0.01)  # checks the contract and the KV it reads
        step += 1
        assert step < 5000
    for rid, f in eng.finished.items():
        outcome[rid] = f.reason
        assert f.output_ids.tolist() == eng.truth[rid][f.prompt_len :]
    assert len(outcome) + rejected == len(reqs), "every request ends exactly once"
    s = sched.stats(now=0.0)
    assert s["pool"]["used"] == 0 and s["live_requests"] == 0
