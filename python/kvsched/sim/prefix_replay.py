"""Replay mooncake_synthetic.jsonl through the real Scheduler and report the
prefix cache's hit rate at several pool sizes next to the trace's ceiling,
both counted on the cache's 16-token blocks.

Run: python -m kvsched.sim.prefix_replay [TRACE] [--limit N] [--pools TOKENS ...]
         [--tenants N] [--compare-partition]

With --tenants N the trace is split over N tenants by its first block's hash id
(requests that share any prefix share their first block, so they land in the
same tenant and private namespaces cost no hit). --compare-partition replays
each pool three ways, side by side: one shared LRU without floors (the default
configuration), one shared LRU with the pool split into equal floors (and caps),
and prefix_cache_partition="tenant" with the same floors: the first two differ
by what floors do to admission, the last two by what the partition costs.

The engine is a stand-in: sampled tokens are 0 and a step takes
STEP_OVERHEAD_S + tokens * TOKEN_S of virtual time (a fixed launch cost plus a
prefill-bound rate). Timing decides which requests overlap, so it moves the hit
rate a little; the pool size decides what survives to be hit.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

import kvsched
from kvsched.sim.traces import (
    MooncakeRequest,
    mooncake_ceiling,
    mooncake_ceiling_at,
    mooncake_prompt,
    read_mooncake,
)

STEP_OVERHEAD_S = 0.010
TOKEN_S = 25e-6  # 40k tokens/s of prefill
BLOCK_SIZE = 16
DEFAULT_POOLS = (1 << 18, 1 << 20, 1 << 22)  # tokens: 256k, 1M, 4M


@dataclass
class ReplayResult:
    pool_tokens: int
    requests: int
    finished: int
    rejected: int
    query_blocks: int
    hit_blocks: int
    query_tokens: int
    hit_tokens: int
    prefill_tokens: int
    evictions: int
    steps: int
    virtual_s: float
    wall_s: float

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / max(1, self.query_blocks)

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / max(1, self.query_tokens)


def tenant_of(req: MooncakeRequest, tenants: int) -> int:
    """The tenant a request is replayed as, of `tenants`: a multiplicative hash
    of its first block's hash id, so requests that share a prefix (hence their
    first block) go to the same tenant, and tenants get similar shares."""
    return ((req.hash_ids[0] * 0x9E3779B1) >> 7) % tenants


def replay(
    reqs: list[MooncakeRequest],
    pool_tokens: int,
    *,
    max_num_seqs: int = 64,
    max_batched_tokens: int = 8192,
    tenants: int = 1,
    floors: bool = False,
    partition: str = "shared",
) -> ReplayResult:
    """Submit each request at its arrival (again at each step while the pool or
    the queue is full), run steps until every request has ended.

    `tenants` > 1 splits the trace (see `tenant_of`); `floors` gives each tenant
    an equal share of the pool as kv_floor_blocks and kv_cap_blocks (a request
    larger than its share is refused, counted in `rejected`); `partition` is
    the prefix_cache_partition knob ("tenant" keeps each tenant's cached blocks
    within its unused floor, so it goes with floors)."""
    longest = max(r.input_length + r.output_length for r in reqs)
    num_blocks = pool_tokens // BLOCK_SIZE + 1
    sched = kvsched.Scheduler(
        kvsched.SchedulerConfig(
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            max_num_seqs=max_num_seqs,
            max_batched_tokens=max_batched_tokens,
            max_seq_len=-(-longest // BLOCK_SIZE) * BLOCK_SIZE,
            long_prefill_chunk=max_batched_tokens,
            overhead_reserve=0.0,
            max_waiting=4 * max_num_seqs,
            prefix_cache_partition=partition,  # type: ignore[arg-type]
        )
    )
    names = ["mooncake"] if tenants == 1 else [f"mooncake{i}" for i in range(tenants)]
    share = (num_blocks - 1) // tenants
    for name in names:
        if floors:
            sched.add_tenant(kvsched.TenantConfig(name, kv_floor_blocks=share, kv_cap_blocks=share))
        else:
            sched.add_tenant(kvsched.TenantConfig(name))
    who = [names[tenant_of(r, tenants)] for r in reqs]
    t0 = time.perf_counter()
    now, nxt, rejected, finished, steps = 0.0, 0, 0, 0, 0
    sampled = np.zeros(max_num_seqs, np.int32)
    while nxt < len(reqs) or sched.live_requests:
        if not sched.live_requests and nxt < len(reqs):
            now = max(now, reqs[nxt].arrival)
        while nxt < len(reqs) and reqs[nxt].arrival <= now:
            r = reqs[nxt]
            try:
                sched.submit(who[nxt], mooncake_prompt(r), max(1, r.output_length), now=now)
            except kvsched.Rejected as e:
                # A tenant at its cap waits like a full pool, unless the
                # request alone is larger than the cap.
                blocks = -(-(r.input_length + max(1, r.output_length)) // BLOCK_SIZE)
                if e.reason in ("pool_full", "concurrency") or (
                    e.reason == "tenant_budget" and (not floors or blocks <= share)
                ):
                    break  # in line: try again after the next step
                rejected += 1  # never fits this pool
            nxt += 1
        plan = sched.step(now=now)
        if plan is None:
            now += STEP_OVERHEAD_S
            continue
        events = sched.commit(plan, sampled[: len(plan)], now=now)
        finished += len(events.finished)
        steps += 1
        now += STEP_OVERHEAD_S + plan.num_tokens * TOKEN_S
    st = sched.stats(now=now)
    ts = [st["tenants"][name] for name in names]

    def total(key: str) -> int:
        return sum(t["prefix_cache"][key] for t in ts)  # type: ignore[literal-required]

    return ReplayResult(
        pool_tokens=pool_tokens,
        requests=len(reqs),
        finished=finished,
        rejected=rejected,
        query_blocks=total("query_blocks"),
        hit_blocks=total("hit_blocks"),
        query_tokens=total("query_tokens"),
        hit_tokens=total("hit_tokens"),
        prefill_tokens=sum(t["prefill_tokens"] for t in ts),
        evictions=st["pool"]["evictions"],
        steps=steps,
        virtual_s=now,
        wall_s=time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", default=None,
                    help="a Mooncake-format JSONL, plain or .gz (default: the bundled "
                    "mooncake_synthetic trace, package data)")  # fmt: skip
    ap.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    ap.add_argument("--pools", type=int, nargs="+", default=list(DEFAULT_POOLS),
                    help="pool sizes in tokens")  # fmt: skip
    ap.add_argument("--tenants", type=int, default=1,
                    help="split the trace over N tenants by first block")  # fmt: skip
    ap.add_argument("--compare-partition", action="store_true",
                    help="shared LRU vs partitioned by tenant, side by side")  # fmt: skip
    args = ap.parse_args(argv)
    if args.tenants < 1:
        ap.error("--tenants must be at least 1")
    reqs = read_mooncake(args.trace, args.limit)
    ceil_blocks, ceil_tokens = mooncake_ceiling(reqs)
    # The hit columns count the cache's BLOCK_SIZE-token blocks; their ceiling
    # is counted on the same blocks (the trace's 512-token one can be lower
    # than a hit rate, so it is printed apart, for reference only).
    cb, ct = mooncake_ceiling_at(reqs, BLOCK_SIZE)
    print(f"{len(reqs)} requests, {sum(r.input_length for r in reqs) / 1e6:.1f}M prompt tokens")
    print(
        f"ceiling on {BLOCK_SIZE}-token blocks (as the cache counts, the columns below): "
        f"{cb:.1%} of blocks, {ct:.1%} of tokens"
    )
    print(
        f"  (on the trace's 512-token blocks: {ceil_blocks:.1%} of blocks seen before, "
        f"{ceil_tokens:.1%} of tokens; not comparable with {BLOCK_SIZE}-token hit rates)"
    )
    modes = [("shared", False, "shared")]
    if args.compare_partition:
        modes = [("shared", False, "shared"), ("shared+floors", True, "shared"),
                 ("tenant+floors", True, "tenant")]  # fmt: skip
        print(f"{args.tenants} tenants by first block; floors: the pool split equally")
    print(f"{'pool tokens':>12} {'cache':>14} {'block hits':>10} {'ceiling':>8} "
          f"{'token hits':>10} {'ceiling':>8} "
          f"{'prefill':>9} {'evictions':>10} {'rejected':>8} {'steps':>7} "
          f"{'wall s':>7}")  # fmt: skip
    for pool in args.pools:
        for label, floors, partition in modes:
            r = replay(reqs, pool, tenants=args.tenants, floors=floors, partition=partition)
            print(f"{pool:>12,} {label:>14} {r.block_hit_rate:>10.1%} {cb:>8.1%} "
                  f"{r.token_hit_rate:>10.1%} {ct:>8.1%} "
                  f"{r.prefill_tokens / 1e6:>8.1f}M {r.evictions:>10,} {r.rejected:>8} "
                  f"{r.steps:>7,} {r.wall_s:>7.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
