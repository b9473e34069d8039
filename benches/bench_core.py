"""Pool and admission microbenchmarks, each beside its pure-Python baseline.

Run: python -m pytest benches --benchmark-enable --benchmark-group-by=group
"""

import numpy as np
import pytest
from baselines import PyAdmission, PyBlockPool, PyTenant

import kvsched

NUM_BLOCKS = 8192
BATCH = 1024


def make_pool(kind: str):
    return kvsched.BlockPool(NUM_BLOCKS, 16) if kind == "kvsched" else PyBlockPool(NUM_BLOCKS, 16)


@pytest.mark.parametrize("kind", ["kvsched", "python"])
@pytest.mark.benchmark(group="pool: allocate + free 1 page")
def test_allocate_free_one(benchmark, kind):
    pool = make_pool(kind)

    def once():
        pool.free_one(pool.allocate_one())

    benchmark(once)
    if kind == "kvsched":
        assert pool.used == 0


@pytest.mark.parametrize("kind", ["kvsched", "python"])
@pytest.mark.benchmark(group=f"pool: allocate + free {BATCH} pages in one batch")
def test_allocate_free_batch(benchmark, kind):
    pool = make_pool(kind)

    def once():
        pool.free(pool.allocate(BATCH))

    benchmark(once)
    benchmark.extra_info["pages"] = BATCH
    if kind == "kvsched":
        assert pool.used == 0


def make_admission(kind: str):
    if kind == "kvsched":
        s = kvsched.Scheduler(
            kvsched.SchedulerConfig(
                num_blocks=NUM_BLOCKS, block_size=16, max_num_seqs=256, max_seq_len=8192
            )
        )
        for i in range(8):
            s.add_tenant(kvsched.TenantConfig(f"t{i}", kv_floor_blocks=64, kv_cap_blocks=2048))
        return s
    s = PyAdmission(NUM_BLOCKS, 16, 8192, 256)
    for i in range(8):
        s.tenants[f"t{i}"] = PyTenant(2048, 64)
    return s


@pytest.mark.parametrize("kind", ["kvsched", "python"])
@pytest.mark.benchmark(group="scheduler: submit + cancel (512-token prompt, 8 tenants)")
def test_submit_cancel(benchmark, kind):
    sched = make_admission(kind)
    prompt = np.arange(512, dtype=np.int32)
    # Some load already admitted, as on a live server.
    for i in range(64):
        sched.submit(f"t{i % 8}", prompt, 128, now=0.0)

    def once():
        sched.cancel(sched.submit("t3", prompt, 256, now=1.0))

    benchmark(once)


@pytest.mark.parametrize("queued", [100, 10_000, 50_000])
@pytest.mark.benchmark(group="scheduler: tier-0 submit displacing 1 of N queued tier-1 requests")
def test_displacing_submit(benchmark, queued):
    """A full pool of queued tier-1 requests; a tier-0 submit displaces the
    newest, then the tier-0 request is cancelled and a tier-1 one queued again,
    so each round starts from the same state. The 100-request queue is the
    baseline: the round should cost the same whatever the queue's length (it
    grew by about 7 ns per queued request when every candidate was sorted)."""
    sched = kvsched.Scheduler(
        kvsched.SchedulerConfig(
            num_blocks=2 * queued + 1,
            block_size=16,
            max_num_seqs=64,
            max_seq_len=64,
            max_waiting=queued + 8,
            overhead_reserve=0.0,
        )
    )
    sched.add_tenant(kvsched.TenantConfig("interactive", tier=0))
    sched.add_tenant(kvsched.TenantConfig("batch", tier=1))
    prompts = np.random.default_rng(0).integers(1, 30_000, (queued + 1, 16), dtype=np.int32)
    for p in prompts[:queued]:
        sched.submit("batch", p, 16, now=0.0)  # 2 blocks each: the pool is full

    rounds = []

    def once():
        sched.cancel(sched.submit("interactive", prompts[queued], 16, now=0.0))
        sched.submit("batch", prompts[queued], 16, now=0.0)
        rounds.append(1)

    benchmark(once)
    assert sched.stats()["displaced"] == len(rounds) > 0, "every round displaced one request"
    assert sched.live_requests == queued
    benchmark.extra_info["queued"] = queued
