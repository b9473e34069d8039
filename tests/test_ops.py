"""Operations through the Python API: the ladder, live knobs, lifecycle, drain,
checkpoint and restore."""

from __future__ import annotations

import pytest

import kvsched
from kvsched import checkpoint

from helpers import FakeEngine, ids

BS = 8
BASE = dict(num_blocks=121, block_size=BS, max_num_seqs=4, max_batched_tokens=32,
            max_seq_len=128, overhead_reserve=0.0, max_waiting=16)  # fmt: skip

RUNGS = [
    {"signal": "reserved_share", "engage": 0.5, "release": 0.2, "action": "shed_lowest_tier"},
    {"signal": "queue_depth", "engage": 6, "release": 1, "action": "cap_max_tokens", "value": 6},
]


def make(**kw) -> kvsched.Scheduler:
    sched = kvsched.Scheduler(kvsched.SchedulerConfig(**{**BASE, **kw}))
    sched.add_tenant(kvsched.TenantConfig("gold", tier=0))
    sched.add_tenant(kvsched.TenantConfig("bulk", tier=1))
    return sched


def test_ladder_config_round_trips_and_bad_rungs_are_typed():
    cfg = kvsched.SchedulerConfig(**BASE, ladder=RUNGS, ladder_retry_after_s=0.5)
    assert cfg.ladder == RUNGS and cfg.ladder_retry_after_s == 0.5
    default = kvsched.SchedulerConfig(**BASE, ladder="default").ladder
    assert [r["action"] for r in default] == [
        "shed_lowest_tier", "cap_max_tokens", "max_running", "reject_fast"
    ]  # fmt: skip
    assert kvsched.SchedulerConfig(**BASE).ladder == []
    for bad, match in [
        ([{**RUNGS[0], "release": 0.9}], "flap"),
        ([{**RUNGS[0], "signal": "load"}], "unknown ladder signal"),
        ([{**RUNGS[1], "value": 0}], "cap must be"),
        ([{k: v for k, v in RUNGS[1].items() if k != "value"}], 'missing "value"'),
        ([{**RUNGS[0], "colour": 1}], "unknown key"),
        ("everything", "ladder must be"),
    ]:
        with pytest.raises(kvsched.InvalidConfig, match=match):
            kvsched.SchedulerConfig(**BASE, ladder=bad)


def test_the_ladder_sheds_the_lowest_tier_caps_and_says_so():
    sched = make(ladder=RUNGS, ladder_retry_after_s=0.25)
    # A middle tier: the ladder caps max_tokens below the top tier only.
    sched.update_tenant(kvsched.TenantConfig("bulk", tier=2), now=0.0)
    sched.add_tenant(kvsched.TenantConfig("silver", tier=1))
    for _ in range(4):  # 4 x 16 blocks of 120: past half the pool
        sched.submit("bulk", ids(8), 120, now=0.0)
    with pytest.raises(kvsched.Rejected) as e:
        sched.submit("bulk", ids(8), 8, now=0.0)
    assert (e.value.reason, e.value.retry_after) == ("shed", 0.25)
    gold = sched.submit("gold", ids(8), 8, now=0.0)  # the top tier still gets in
    sched.submit("gold", ids(8), 8, now=0.0)
    events = sched.take_events()
    assert [(ev["kind"], ev["rung"]) for ev in events] == [("rung_engaged", 0)]
    assert events[0]["pressure"]["reserved_share"] >= 0.5
    # Queue depth 6: rung 1 caps the next admission at 6 tokens (of a tier
    # below the top: tier 0 is never capped).
    capped = sched.submit("silver", ids(8), 50, now=0.0)
    events = sched.take_events()
    assert [ev["kind"] for ev in events] == ["rung_engaged", "max_tokens_capped"]
    assert events[1] == {"kind": "max_tokens_capped", "request_id": capped, "tenant": "silver",
                         "asked": 50, "admitted": 6, "at": 0.0}  # fmt: skip
    uncapped = sched.submit("gold", ids(8), 50, now=0.0)
    assert sched.take_events() == []
    st = sched.stats(now=0.0)
    assert st["ladder"]["level"] == 2
    assert [r["climbs"] for r in st["ladder"]["rungs"]] == [1, 1]
    assert st["tenants"]["bulk"]["rejected"]["shed"] == 1
    assert gold != capped and st["events_dropped"] == 0
    # Once the load is gone, both rungs release, in reverse order.
    for rid in range(1, uncapped + 1):
        sched.cancel(rid)
    assert sched.step(now=1.0) is None
    assert [(ev["kind"], ev["rung"]) for ev in sched.take_events()] == [
        ("rung_released", 1), ("rung_released", 0)
    ]  # fmt: skip
    assert sched.stats(now=2.0)["ladder"]["seconds_at_level"] == [0.0, 0.0, 1.0]


def test_reconfigure_is_live_and_names_restart_only_knobs():
    sched = make()
    restart_only = [
        ("num_blocks", 200),
        ("block_size", 16),
        ("admission", "overcommit"),
        ("prefix_caching", False),
        ("prefix_cache_key", bytes(16)),
        ("max_num_seqs", 8),
        ("max_seq_len", 256),
        ("token_buckets", [32]),
    ]
    for knob, value in restart_only:
        before = sched.stats(now=0.0)
        with pytest.raises(kvsched.RestartRequired, match=knob):
            sched.reconfigure(**{knob: value})
        assert sched.stats(now=0.0) == before
    with pytest.raises(TypeError):
        sched.reconfigure(colour="blue")
    sched.reconfigure(max_num_seqs=2, max_seq_len=64, ladder=RUNGS, max_waiting=3)
    cfg = sched.config
    assert (cfg.max_num_seqs, cfg.max_seq_len, cfg.max_waiting, cfg.ladder) == (2, 64, 3, RUNGS)
    with pytest.raises(kvsched.Rejected) as e:
        sched.submit("gold", ids(60), 10, now=0.0)
    assert e.value.reason == "too_long"
    for _ in range(4):
        sched.submit("gold", ids(8), 4, now=0.0)
    plan = sched.step(now=0.0)
    assert len(plan) == 2, "two run from the next step on"


def test_lifecycle_states_and_refusals():
    sched = make(require_warmup=True)
    assert sched.lifecycle == "cold" and sched.live() and not sched.ready()
    with pytest.raises(kvsched.Rejected) as e:
        sched.submit("gold", ids(8), 4, now=0.0)
    assert e.value.reason == "not_ready"
    sched.begin_warmup()
    assert sched.lifecycle == "warming"
    sched.mark_ready()
    assert sched.ready() and sched.lifecycle == "ready"
    sched.submit("gold", ids(8), 4, now=0.0)
    sched.drain(10.0)
    assert sched.lifecycle == "draining" and sched.live() and not sched.ready()
    with pytest.raises(kvsched.Rejected) as e:
        sched.submit("gold", ids(8), 4, now=0.0)
    assert e.value.reason == "draining"
    with pytest.raises(kvsched.InvalidState, match="mark_ready on a draining"):
        sched.mark_ready()
    with pytest.raises(kvsched.InvalidState, match="begin_warmup on a draining"):
        sched.begin_warmup()
    assert sched.lifecycle == "draining"
    eng = FakeEngine(sched, BASE["num_blocks"], BS)
    eng.truth[1] = ids(8).tolist()
    now = 0.0
    while sched.lifecycle != "drained":
        eng.step(now)
        now += 0.01
    assert not sched.live()
    assert sched.stats(now=now)["rejected"]["not_ready"] == 1


def run_workload(eng: FakeEngine, reqs, until=None, now=0.0):
    rids = [eng.submit(t, ids(n, start=s), m, now=now) for t, n, s, m in reqs]
    steps = 0
    while eng.sched.live_requests and (until is None or steps < until):
        eng.step(now)
        now += 0.01
        steps += 1
    return rids, now


def test_drain_checkpoint_restore_finishes_every_request_with_the_same_tokens(tmp_path):
    reqs = [("gold" if k % 2 else "bulk", 6 + 5 * k, 100 * k + 1, 12 + k) for k in range(8)]
    undisturbed = FakeEngine(make(), BASE["num_blocks"], BS)
    rids, _ = run_workload(undisturbed, reqs)
    want = [undisturbed.finished[r].output_ids.tolist() for r in rids]

    eng = FakeEngine(make(), BASE["num_blocks"], BS)
    rids, now = run_workload(eng, reqs, until=10)
    before_drain = {r: f.output_ids.tolist() for r, f in eng.finished.items()}
    eng.sched.drain(now + 0.04)
    while eng.sched.lifecycle != "drained":
        plan, _ = eng.step(now)
        now += 0.01
    path = tmp_path / "ckpt.jsonl"
    counts = eng.sched.checkpoint(path)
    lines = checkpoint.read_records(path)  # the records, between header and trailer
    assert counts["in_flight"] > 0, "the deadline came first for some"
    assert len(lines) == counts["finished"] + counts["in_flight"]
    assert len(before_drain) + len(lines) == len(reqs), "every request accounted for"
    assert {ln["reason"] for ln in lines if ln["kind"] == "in_flight"} == {"drain_deadline"}

    fresh = FakeEngine(make(), BASE["num_blocks"], BS)
    out = fresh.sched.restore(path, now=0.0)
    assert out["refused"] == {}
    assert len(out["finished"]) == counts["finished"]
    by_old = {ln["request_id"]: ln for ln in lines if ln["kind"] == "in_flight"}
    for old, new in out["restored"].items():
        fresh.truth[new] = by_old[old]["prompt_ids"] + by_old[old]["generated_ids"]
    now = 0.0
    while fresh.sched.live_requests:
        fresh.step(now)
        now += 0.01
    finished_during = {f["request_id"]: f["output_ids"] for f in out["finished"]}
    for i, r in enumerate(rids):
        if r in before_drain:
            got = before_drain[r]
        elif r in finished_during:
            got = finished_during[r]
        else:
            got = fresh.finished[out["restored"][r]].output_ids.tolist()
        assert got == want[i], f"request {i}"


def test_reconfigure_restating_the_config_changes_nothing():
    sched = make(admission="overcommit", watermark_blocks=3, ladder=RUNGS, require_warmup=True,
                 prefix_cache_key=bytes(range(16)), ladder_retry_after_s=0.5)  # fmt: skip
    before = sched.config
    sched.reconfigure()
    sched.reconfigure(admission="overcommit")
    sched.reconfigure(**{k: getattr(before, k) for k in ("max_num_seqs", "ladder", "max_waiting")})
    assert sched.config == before
    assert sched.config.watermark_blocks == 3
