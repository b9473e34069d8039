"""The Prometheus exposition, scraped as text and checked against stats()."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvsched
from kvsched.metrics import SchedulerCollector

from helpers import FakeEngine, ids

BS = 8


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from the exposition text."""
    text = generate_latest(registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def served():
    cfg = kvsched.SchedulerConfig(
        num_blocks=65, block_size=BS, max_num_seqs=4, max_batched_tokens=32, max_seq_len=128,
        overhead_reserve=0.0, max_waiting=8,
        ladder=[{"signal": "queue_depth", "engage": 3, "release": 1, "action": "reject_fast"}],
    )  # fmt: skip
    sched = kvsched.Scheduler(cfg)
    sched.add_tenant(kvsched.TenantConfig("gold", tier=0))
    sched.add_tenant(kvsched.TenantConfig("bulk", tier=1, kv_cap_blocks=8))
    eng = FakeEngine(sched, 65, BS)
    now = 0.0
    for k in range(5):  # a queue: the ladder's rung engages, then sheds
        try:
            eng.submit("gold", ids(12, start=7 * k), 3, now=now)
        except kvsched.Rejected:
            pass
    for k in range(6):
        for tenant, prompt, m in (("gold", ids(20, start=1), 5), ("bulk", ids(10, 100 * k), 40)):
            try:  # gold repeats a prompt: cache hits
                eng.submit(tenant, prompt, m, now=now)
            except kvsched.Rejected:
                pass
        for _ in range(3):
            eng.step(now)
            now += 0.01
    with pytest.raises(kvsched.Rejected):
        sched.submit("nobody", ids(4), 1, now=now)
    while sched.live_requests:
        eng.step(now)
        now += 0.01
    return sched, now


def test_scrape_matches_stats(served):
    sched, now = served
    registry = CollectorRegistry()
    collector = SchedulerCollector(sched, model={"name": "tiny-llama", "checksum": "abc123"})
    registry.register(collector)
    collector.record_recompiles(2)
    got = scrape(registry)
    st = sched.stats()

    for t, ts in st["tenants"].items():
        lab = (("tenant", t),)
        assert got[("kvsched_requests_admitted_total", lab)] == ts["admitted"]
        assert got[("kvsched_requests_finished_total", lab)] == ts["finished"]
        assert got[("kvsched_tokens_in_total", lab)] == ts["tokens_in"]
        assert got[("kvsched_tokens_out_total", lab)] == ts["tokens_out"]
        assert got[("kvsched_tenant_reserved_blocks", lab)] == ts["reserved_blocks"]
        assert got[("kvsched_tenant_used_blocks", lab)] == ts["used_blocks"]
        assert (
            got[("kvsched_prefix_cache_hit_tokens_total", lab)] == ts["prefix_cache"]["hit_tokens"]
        )
        for reason, n in ts["rejected"].items():
            key = ("kvsched_requests_rejected_total", (("reason", reason), ("tenant", t)))
            assert got[key] == n
        assert got[("kvsched_ttft_seconds_count", lab)] == ts["ttft"]["count"]
        assert got[("kvsched_ttft_seconds_sum", lab)] == pytest.approx(ts["ttft"]["sum"])
        inf = ("kvsched_inter_token_seconds_bucket", (("le", "+Inf"), ("tenant", t)))
        assert got[inf] == ts["inter_token"]["count"]
    # The load made something worth checking.
    assert st["tenants"]["gold"]["prefix_cache"]["hit_tokens"] > 0
    assert sum(st["tenants"]["bulk"]["rejected"].values()) > 0
    for reason, n in st["rejected"].items():
        assert got[("kvsched_rejected_total", (("reason", reason),))] == n
    assert st["rejected"]["unknown_tenant"] == 1
    for key in ("free", "used", "evictable", "cached", "committed"):
        assert got[(f"kvsched_pool_{key}_blocks", ())] == st["pool"][key]
    assert got[("kvsched_pool_utilization", ())] == st["pool"]["used"] / st["pool"]["total"]
    assert got[("kvsched_steps_total", ())] == st["steps"]
    assert got[("kvsched_displaced_total", ())] == st["displaced"]
    assert got[("kvsched_step_gap_seconds_count", ())] == st["step_gap"]["count"] > 0
    assert got[("kvsched_ladder_level", ())] == st["ladder"]["level"]
    climbs = got[("kvsched_ladder_climbs_total", (("action", "reject_fast"), ("rung", "0")))]
    assert climbs == st["ladder"]["rungs"][0]["climbs"] >= 1
    assert got[("kvsched_lifecycle", (("state", "ready"),))] == 1.0
    assert got[("kvsched_recompiles_total", ())] == 2
    info = ("kvsched_model_info", (("checksum", "abc123"), ("name", "tiny-llama")))
    assert got[info] == 1.0


def test_a_scrape_reflects_new_work_and_recompiles_only_grow(served):
    sched, now = served
    registry = CollectorRegistry()
    collector = SchedulerCollector(sched)
    registry.register(collector)
    before = scrape(registry)[("kvsched_requests_admitted_total", (("tenant", "gold"),))]
    sched.submit("gold", ids(4), 1, now=now)
    after = scrape(registry)[("kvsched_requests_admitted_total", (("tenant", "gold"),))]
    assert after == before + 1
    with pytest.raises(ValueError):
        collector.record_recompiles(-1)
    assert not any(k[0] == "kvsched_model_info" for k in scrape(registry))


def test_every_family_has_one_name_and_openmetrics_parses_it(served):
    from prometheus_client.openmetrics.exposition import generate_latest as om_latest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse

    sched, _ = served
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(sched, model={"name": "m", "checksum": "c"}))
    helps = [
        ln for ln in generate_latest(registry).decode().splitlines() if ln.startswith("# HELP")
    ]
    names = [ln.split()[2] for ln in helps]
    assert len(names) == len(set(names)), "a family name appears twice"
    families = list(om_parse(om_latest(registry).decode()))
    assert len(families) == len(names)


def test_the_gauges_routers_read_carry_vllms_names_and_the_schedulers_figures():
    """vllm:num_requests_waiting / _running / kv_cache_usage_perc and
    vllm:cache_config_info (what the Gateway API Inference Extension's endpoint
    picker and llm-d read by default), scraped after every step of a load with a
    queue: each is the scheduler's own figure at that moment, labelled as vLLM
    labels it; without a model name, none of them."""
    cfg = kvsched.SchedulerConfig(
        num_blocks=65, block_size=BS, max_num_seqs=2, max_batched_tokens=32, max_seq_len=128,
        overhead_reserve=0.0, max_waiting=8,
    )  # fmt: skip
    sched = kvsched.Scheduler(cfg)
    sched.add_tenant(kvsched.TenantConfig("gold", tier=0))
    eng = FakeEngine(sched, 65, BS)
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(sched, vllm_model_name="smollm2-135m-instruct"))
    plain = CollectorRegistry()
    plain.register(SchedulerCollector(sched))
    for k in range(5):
        eng.submit("gold", ids(20, start=30 * k), 12, now=0.0)
    lab = (("engine", "0"), ("model_name", "smollm2-135m-instruct"))
    seen = []
    now = 0.0
    while sched.live_requests:
        eng.step(now)
        now += 0.01
        got, st = scrape(registry), sched.stats()
        assert got[("vllm:num_requests_waiting", lab)] == st["waiting"]
        assert got[("vllm:num_requests_running", lab)] == st["running"]
        usage = got[("vllm:kv_cache_usage_perc", lab)]
        assert usage == pytest.approx(st["pool"]["used"] / st["pool"]["total"])
        assert 0.0 <= usage <= 1.0
        assert got[("vllm:gpu_cache_usage_perc", lab)] == usage  # the older name
        info = {k: v for (name, k), v in got.items() if name == "vllm:cache_config_info"}
        assert info == {(("block_size", str(BS)), ("enable_prefix_caching", "True"),
                         ("engine", "0"), ("num_gpu_blocks", "65")): 1.0}  # fmt: skip
        assert not any(name.startswith("vllm:") for name, _ in scrape(plain))
        seen.append((st["running"], st["waiting"], usage))
    # Mid-load: running and waiting at once, and pages in use.
    assert any(r == 2 and w > 0 and u > 0 for r, w, u in seen), seen
    assert seen[-1] == (0, 0, 0.0)
