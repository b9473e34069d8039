"""One Scheduler and one BlockPool shared by eight threads: counts stay consistent."""

import threading
from collections import Counter

import numpy as np

import kvsched

from helpers import ids

THREADS = 8
ROUNDS = 400


def test_eight_threads_hammer_submit_and_cancel():
    sched = kvsched.Scheduler(
        kvsched.SchedulerConfig(num_blocks=201, block_size=16, max_num_seqs=32, max_waiting=32)
    )
    for i in range(4):
        sched.add_tenant(kvsched.TenantConfig(f"t{i}", kv_cap_blocks=60))
    admitted = Counter()
    rejected = Counter()
    errors = []
    start = threading.Barrier(THREADS)

    def worker(k: int) -> None:
        rng = np.random.default_rng(k)
        mine: list[int] = []
        local_ok, local_rej = Counter(), Counter()
        start.wait()
        try:
            for _ in range(ROUNDS):
                tenant = f"t{k % 4}"
                if mine and rng.random() < 0.45:
                    sched.cancel(mine.pop(int(rng.integers(len(mine)))))
                    continue
                try:
                    mine.append(sched.submit(tenant, ids(int(rng.integers(1, 100))), 32, now=0.0))
                    local_ok[tenant] += 1
                except kvsched.Rejected as e:
                    local_rej[e.reason] += 1
            for rid in mine:
                sched.cancel(rid)
        except Exception as e:  # surfaced below: a thread must not die silently
            errors.append(e)
        with lock:
            admitted.update(local_ok)
            rejected.update(local_rej)

    lock = threading.Lock()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == []
    st = sched.stats(now=0.0)
    assert st["live_requests"] == 0
    assert st["pool"]["reserved"] == 0 and st["pool"]["committed"] == 0
    for name, t in st["tenants"].items():
        assert t["admitted"] == admitted[name]
        assert t["cancelled"] == admitted[name]
        assert t["live_requests"] == 0
    assert {k: v for k, v in st["rejected"].items() if v} == dict(rejected)
    assert sum(admitted.values()) > 0 and sum(rejected.values()) > 0, "both paths exercised"


def test_eight_threads_share_a_pool():
    pool = kvsched.BlockPool(1025, 16)
    errors = []

    def worker() -> None:
        try:
            for _ in range(300):
                pages = pool.allocate(64)
                pool.retain(pages[:8])
                pool.free(pages)
                pool.free(pages[:8])
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert (pool.free_pages, pool.used, pool.shared) == (1024, 0, 0)
