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
