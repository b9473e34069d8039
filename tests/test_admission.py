"""Admission through the Python API: reservations, reasons, bad input, live tenant changes."""

import numpy as np
import pytest

import kvsched

from helpers import ids, rejection_delta, without_rejections


@pytest.fixture
def sched() -> kvsched.Scheduler:
    # 100 allocatable pages, 10 kept back by the overhead reserve: 90 usable.
    s = kvsched.Scheduler(
        kvsched.SchedulerConfig(
            num_blocks=101, block_size=16, max_num_seqs=8, max_seq_len=512, max_waiting=4
        )
    )
    s.add_tenant(kvsched.TenantConfig("gold", tier=0, kv_floor_blocks=30))
    s.add_tenant(kvsched.TenantConfig("bulk", tier=1, kv_cap_blocks=40, max_concurrent=3))
    return s


def test_admission_reserves_the_final_length(sched):
    rid = sched.submit("gold", ids(100), 60, now=0.0)  # 160 tokens = 10 blocks
    st = sched.stats(now=0.0)
    assert st["tenants"]["gold"]["reserved_blocks"] == 10
    assert st["pool"]["reserved"] == 10
    assert st["pool"]["used"] == 0, "pages are drawn lazily, not at admission"
    # gold's floor (30) already covers its 10 blocks: nothing more is promised.
    assert st["pool"]["committed"] == 30
    sched.cancel(rid)
    st = sched.stats(now=0.0)
    assert st["pool"]["reserved"] == 0 and st["tenants"]["gold"]["cancelled"] == 1


def test_floor_is_never_lent(sched):
    # bulk may use 90 - 30 (gold's floor) = 60 usable, but its cap is 40.
    sched.update_tenant(kvsched.TenantConfig("bulk", tier=1, max_concurrent=8), now=0.0)
    for _ in range(3):
        sched.submit("bulk", ids(300), 20, now=0.0)  # 20 blocks each
    with pytest.raises(kvsched.Rejected) as e:
        sched.submit("bulk", ids(10), 6, now=0.0)
    assert e.value.reason == "pool_full" and e.value.retry_after is None
    for _ in range(3):
        sched.submit("gold", ids(150), 10, now=0.0)  # gold gets its 30 blocks
    assert sched.stats(now=0.0)["pool"]["committed"] == 90


REJECTIONS = [
    # (tenant, prompt length, max_tokens, reason)
    ("nobody", 10, 10, "unknown_tenant"),
    ("gold", 0, 10, "invalid"),
    ("gold", 10, 0, "invalid"),
    ("gold", 10, -5, "invalid"),
    ("gold", 500, 13, "too_long"),
    ("gold", 10, 10**30, "too_long"),
    ("bulk", 330, 6, "tenant_budget"),  # 21 blocks on top of the 20 it holds: over its 40
]


@pytest.mark.parametrize("tenant, n, max_tokens, reason", REJECTIONS)
def test_rejections_say_why_and_change_nothing_but_their_counter(
    sched, tenant, n, max_tokens, reason
):
    if reason == "tenant_budget":
        sched.submit("bulk", ids(300), 20, now=0.0)  # bulk holds 20 of its 40
    before = sched.stats(now=0.0)
    with pytest.raises(kvsched.Rejected) as e:
        sched.submit(tenant, ids(n), max_tokens, now=0.0)
    assert e.value.reason == reason
    assert e.value.tenant == tenant
    after = sched.stats(now=0.0)
    assert without_rejections(after) == without_rejections(before)
    assert rejection_delta(before, after) == {reason: 1}
    if tenant in after["tenants"]:
        assert after["tenants"][tenant]["rejected"][reason] == 1


def test_exception_classes_of_rejections(sched):
    with pytest.raises(kvsched.UnknownTenant):
        sched.submit("nobody", ids(4), 4, now=0.0)
    with pytest.raises(kvsched.InvalidRequest):
        sched.submit("gold", ids(0), 4, now=0.0)
    assert issubclass(kvsched.InvalidRequest, kvsched.Rejected)
    assert issubclass(kvsched.Rejected, kvsched.KvSchedError)
    assert set(kvsched.REJECT_REASONS) >= {"shed", "draining", "not_ready", "rate_limited"}


@pytest.mark.parametrize(
    "prompt",
    [
        np.arange(4, dtype=np.int64),
        np.arange(4, dtype=np.float32),
        np.arange(4, dtype=np.uint32),
        np.arange(4, dtype=np.int32).reshape(2, 2),
        [1, 2, 3],
        None,
    ],
    ids=["int64", "float32", "uint32", "2-D", "list", "None"],
)
def test_malformed_prompts_are_invalid_requests_and_change_nothing(sched, prompt):
    before = sched.stats(now=0.0)
    with pytest.raises(kvsched.InvalidRequest, match="1-D numpy int32"):
        sched.submit("gold", prompt, 4, now=0.0)
    # Caught at the boundary before any policy ran: not even a counter moves.
    assert sched.stats(now=0.0) == before


@pytest.mark.parametrize("max_tokens", [1.5, "4", None])
def test_malformed_max_tokens(sched, max_tokens):
    before = sched.stats(now=0.0)
    with pytest.raises(kvsched.InvalidRequest, match="max_tokens"):
        sched.submit("gold", ids(4), max_tokens, now=0.0)
    assert sched.stats(now=0.0) == before


def test_negative_token_ids_are_invalid(sched):
    with pytest.raises(kvsched.InvalidRequest, match="negative"):
        sched.submit("gold", np.array([1, -2, 3], np.int32), 4, now=0.0)


def test_non_contiguous_prompt_is_read_correctly(sched):
    base = ids(64)
    view = base[::2]  # 32 tokens, strided
    assert not view.flags["C_CONTIGUOUS"]
    sched.submit("gold", view, 32, now=0.0)  # 64 tokens = 4 blocks
    assert sched.stats(now=0.0)["tenants"]["gold"]["reserved_blocks"] == 4


def test_non_finite_now_is_invalid(sched):
    with pytest.raises(kvsched.InvalidRequest, match="finite"):
        sched.submit("gold", ids(4), 4, now=float("nan"))


def test_concurrency_limits(sched):
    bulk = [sched.submit("bulk", ids(4), 4, now=0.0) for _ in range(3)]
    with pytest.raises(kvsched.Rejected) as e:
        sched.submit("bulk", ids(4), 4, now=0.0)
    assert e.value.reason == "concurrency"
    for _ in range(9):  # 12 = max_num_seqs 8 + max_waiting 4
        sched.submit("gold", ids(4), 4, now=0.0)
    # Gold (tier 0) takes the places of bulk's waiting requests,
    # newest first, each ended "shed"; with none left, it is refused.
    for _ in range(3):
        sched.submit("gold", ids(4), 4, now=0.0)
    shed = sched.take_finished()
    assert [(f.request_id, f.reason) for f in shed] == [(b, "shed") for b in reversed(bulk)]
    with pytest.raises(kvsched.Rejected) as e:
        sched.submit("gold", ids(4), 4, now=0.0)
    assert e.value.reason == "concurrency"


def test_rate_limit_retry_after_is_the_exact_wait(sched):
    sched.add_tenant(kvsched.TenantConfig("api", rate_tokens_per_s=100.0, burst_tokens=400.0))
    sched.submit("api", ids(200), 100, now=5.0)  # 300 of 400
    with pytest.raises(kvsched.Rejected) as e:
        sched.submit("api", ids(150), 50, now=5.0)  # needs 200, has 100
    assert e.value.reason == "rate_limited"
    assert e.value.retry_after == pytest.approx(1.0, rel=1e-9)
    with pytest.raises(kvsched.Rejected):
        sched.submit("api", ids(150), 50, now=5.0 + 0.99)
    sched.submit("api", ids(150), 50, now=5.0 + e.value.retry_after)
    # Larger than the bucket: never passes, so no retry_after.
    with pytest.raises(kvsched.Rejected) as e:
        sched.submit("api", ids(400), 1, now=100.0)
    assert e.value.reason == "rate_limited" and e.value.retry_after is None


def test_tenant_fields_change_live_and_are_validated(sched):
    sched.submit("bulk", ids(300), 20, now=0.0)  # 20 blocks
    # A lowered cap only limits new admissions.
    sched.update_tenant(kvsched.TenantConfig("bulk", tier=1, kv_cap_blocks=10), now=0.0)
    assert sched.tenant("bulk").kv_cap_blocks == 10
    assert sched.stats(now=0.0)["tenants"]["bulk"]["reserved_blocks"] == 20
    with pytest.raises(kvsched.Rejected) as e:
        sched.submit("bulk", ids(4), 4, now=0.0)
    assert e.value.reason == "tenant_budget"
    before = sched.stats(now=0.0)
    # gold's floor cannot rise to 71: bulk holds 20 of the 90 usable blocks.
    with pytest.raises(kvsched.InvalidConfig, match="usable pool"):
        sched.update_tenant(kvsched.TenantConfig("gold", kv_floor_blocks=71), now=0.0)
    with pytest.raises(kvsched.InvalidConfig, match="exceeds kv_cap_blocks"):
        kvsched.TenantConfig("x", kv_floor_blocks=5, kv_cap_blocks=4)
    with pytest.raises(kvsched.UnknownTenant):
        sched.update_tenant(kvsched.TenantConfig("nobody"), now=0.0)
    assert sched.stats(now=0.0) == before
    sched.update_tenant(kvsched.TenantConfig("gold", kv_floor_blocks=70), now=0.0)
    assert sched.stats(now=0.0)["pool"]["committed"] == 90


@pytest.mark.parametrize(
    "kwargs",
    [
        {"weight": 0.0},
        {"weight": float("inf")},
        {"rate_tokens_per_s": -1.0},
        {"burst_tokens": 10.0},
        {"rate_tokens_per_s": 10.0, "burst_tokens": 0.5},
    ],
)
def test_bad_tenant_configs(kwargs):
    with pytest.raises(kvsched.InvalidConfig):
        kvsched.TenantConfig("t", **kwargs)


def test_remove_tenant_with_live_requests_is_refused(sched):
    rid = sched.submit("bulk", ids(4), 4, now=0.0)
    with pytest.raises(kvsched.TenantInUse):
        sched.remove_tenant("bulk")
    sched.cancel(rid)
    sched.remove_tenant("bulk")
    with pytest.raises(kvsched.UnknownTenant):
        sched.remove_tenant("bulk")
    with pytest.raises(kvsched.TenantExists):
        sched.add_tenant(kvsched.TenantConfig("gold"))
    with pytest.raises(kvsched.InvalidConfig, match="floors"):
        sched.add_tenant(kvsched.TenantConfig("big", kv_floor_blocks=61))


def test_unknown_and_double_cancel(sched):
    rid = sched.submit("gold", ids(4), 4, now=0.0)
    sched.cancel(rid)
    before = sched.stats(now=0.0)
    for bad in (rid, 12345):
        with pytest.raises(kvsched.UnknownRequest):
            sched.cancel(bad)
    with pytest.raises(OverflowError):
        sched.cancel(-1)
    assert sched.stats(now=0.0) == before


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_blocks": 1},
        {"block_size": 0},
        {"max_num_seqs": 0},
        {"max_seq_len": 1},
        {"overhead_reserve": 1.0},
        {"overhead_reserve": -0.1},
    ],
)
def test_bad_scheduler_configs(kwargs):
    with pytest.raises(kvsched.InvalidConfig):
        kvsched.SchedulerConfig(**kwargs)


def test_default_config_matches_design():
    c = kvsched.Scheduler().config
    assert (c.num_blocks, c.block_size, c.max_num_seqs, c.max_batched_tokens) == (
        8192,
        16,
        256,
        2048,
    )
    assert (c.max_seq_len, c.overhead_reserve) == (8192, 0.10)


def test_refusals_no_load_change_can_lift_are_marked_permanent():
    """Over the tenant's cap or rate burst, too long, invalid, unknown: permanent,
    no retry_after. The same reasons while the limit is merely in use: not
    permanent, with a retry_after (a server answers the first kind 400, the
    second 429 + Retry-After)."""
    s = kvsched.Scheduler(
        kvsched.SchedulerConfig(num_blocks=101, block_size=16, max_seq_len=512, max_waiting=4)
    )
    s.add_tenant(kvsched.TenantConfig("capped", kv_cap_blocks=8))
    s.add_tenant(kvsched.TenantConfig("rated", rate_tokens_per_s=10, burst_tokens=200))

    def refusal(tenant, n_prompt, max_tokens):
        with pytest.raises(kvsched.Rejected) as err:
            s.submit(tenant, ids(n_prompt), max_tokens, now=0.0)
        return err.value.reason, err.value.permanent, err.value.retry_after

    assert refusal("capped", 100, 140) == ("tenant_budget", True, None)  # 15 blocks > 8
    assert refusal("rated", 100, 331) == ("rate_limited", True, None)  # 431 > burst 200
    assert refusal("rated", 100, 500)[:2] == ("too_long", True)
    assert refusal("nobody", 10, 10)[:2] == ("unknown_tenant", True)
    # Within the limits, only for now: not permanent.
    s.submit("capped", ids(100), 20, now=0.0)  # 8 blocks: the whole cap
    s.submit("rated", ids(100), 90, now=0.0)  # 190 of the 200
    s.step(now=0.0)  # running now: the estimate counts running requests
    reason, permanent, wait = refusal("capped", 10, 10)
    assert (reason, permanent) == ("tenant_budget", False) and wait is not None
    reason, permanent, wait = refusal("rated", 10, 10)
    assert (reason, permanent) == ("rate_limited", False) and wait > 0
    with pytest.raises(kvsched.InvalidRequest) as err:
        s.submit("capped", ids(0), 10, now=0.0)
    assert err.value.permanent
