"""Admission on a small multi-tenant burst: who gets in, and why the rest do not.

    python examples/quickstart.py

Three tenants share a pool: `gold` (tier 0, a KV floor), `silver` (tier 1, a cap and a
rate limit) and `batch` (tier 2, long prompts). A seeded burst of requests arrives over
two virtual seconds; admitted requests finish after a service time and release their
reservation. The table shows admissions and rejections by reason per tenant.
"""

from __future__ import annotations

import heapq

import numpy as np

import kvsched

TENANTS = [
    kvsched.TenantConfig("gold", tier=0, kv_floor_blocks=900, max_concurrent=64),
    kvsched.TenantConfig(
        "silver", tier=1, kv_cap_blocks=600, rate_tokens_per_s=40_000.0, burst_tokens=60_000.0
    ),
    kvsched.TenantConfig("batch", tier=2, kv_cap_blocks=800, max_concurrent=16),
]
# tenant -> (prompt length range, max_tokens range, share of arrivals)
MIX = {"gold": ((50, 800), (16, 256), 0.3), "silver": ((200, 2000), (32, 512), 0.4),
       "batch": ((2000, 6000), (64, 1024), 0.3)}  # fmt: skip


def main(seed: int = 0, n_requests: int = 600) -> dict[str, dict[str, int]]:
    rng = np.random.default_rng(seed)
    sched = kvsched.Scheduler(
        kvsched.SchedulerConfig(num_blocks=2049, block_size=16, max_num_seqs=128, max_waiting=128)
    )
    for t in TENANTS:
        sched.add_tenant(t)

    names = list(MIX)
    shares = np.array([MIX[n][2] for n in names])
    arrivals = np.sort(rng.uniform(0.0, 2.0, n_requests))
    finishing: list[tuple[float, int]] = []  # (finish time, request id)
    for now in arrivals:
        while finishing and finishing[0][0] <= now:
            sched.cancel(heapq.heappop(finishing)[1])  # done: release the reservation
        name = names[rng.choice(len(names), p=shares / shares.sum())]
        (plo, phi), (olo, ohi), _ = MIX[name]
        prompt = rng.integers(0, 32_000, int(rng.integers(plo, phi)), dtype=np.int32)
        try:
            rid = sched.submit(name, prompt, int(rng.integers(olo, ohi)), now=float(now))
        except kvsched.Rejected:
            continue  # counted by the scheduler, per tenant and reason
        heapq.heappush(finishing, (float(now) + float(rng.uniform(0.2, 1.5)), rid))

    stats = sched.stats(now=2.0)
    print(f"pool: {stats['pool']['usable']} usable blocks of {stats['pool']['total']}, "
          f"{stats['pool']['reserved']} reserved at the end")  # fmt: skip
    header = f"{'tenant':<8}{'tier':>5}{'admitted':>10}  rejections by reason"
    print(header)
    print("-" * len(header))
    table = {}
    for name, t in stats["tenants"].items():
        rejected = {r: n for r, n in t["rejected"].items() if n}
        table[name] = {"admitted": t["admitted"], **rejected}
        print(f"{name:<8}{t['tier']:>5}{t['admitted']:>10}  {rejected or '-'}")
    return table


if __name__ == "__main__":
    main()
