"""Three tenants share one machine: admission, chunked prefill and fair tiers, end to end.

    python examples/quickstart.py [--requests N] [--seed S]

A seeded burst arrives over a few virtual seconds: `chat` (tier 0, short prompts
behind one shared system prompt, which the prefix cache serves after the first, a KV
floor, steps capped so its tokens keep flowing), `api` (tier 1, a cap and a rate
limit) and `batch` (tier 2, long prompts). The default degradation ladder is on.
The loop is the one a real server runs: `step()` -> the engine -> `commit()`. The
engine here is a stand-in (it samples random tokens and charges a simple per-step
cost: 4 ms + 15 us per token), so the figures show the scheduler's decisions, not a
model's speed. Every request ends finished or
rejected with a reason; the table says which.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import kvsched

TENANTS = [
    kvsched.TenantConfig("chat", tier=0, kv_floor_blocks=300, max_step_tokens=256),
    kvsched.TenantConfig(
        "api", tier=1, kv_cap_blocks=700, rate_tokens_per_s=30_000.0, burst_tokens=40_000.0
    ),
    kvsched.TenantConfig("batch", tier=2, kv_cap_blocks=900, max_concurrent=12),
]
# tenant -> (prompt length range, max_tokens range, share of arrivals)
MIX = {"chat": ((20, 400), (16, 128), 0.5), "api": ((200, 1500), (32, 256), 0.3),
       "batch": ((1500, 3500), (64, 256), 0.2)}  # fmt: skip
STEP_OVERHEAD_S, PER_TOKEN_S = 0.004, 15e-6
SYSTEM_PROMPT = np.arange(1000, 1256, dtype=np.int32)  # chat's shared 256-token prefix


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main(seed: int = 0, n_requests: int = 300, quiet: bool = False) -> dict[str, dict[str, Any]]:
    rng = np.random.default_rng(seed)
    sched = kvsched.Scheduler(
        kvsched.SchedulerConfig(
            num_blocks=2049,
            block_size=16,
            max_num_seqs=64,
            max_batched_tokens=1024,
            max_seq_len=4096,
            max_waiting=64,
            long_prefill_chunk=512,
            ladder="default",
        )  # fmt: skip
    )
    for t in TENANTS:
        sched.add_tenant(t)

    names = list(MIX)
    shares = np.array([MIX[n][2] for n in names])
    arrivals = list(np.sort(rng.uniform(0.0, 3.0, n_requests)))
    rejected: dict[str, dict[str | None, int]] = {n: {} for n in names}
    finished: list[kvsched.FinishedRequest] = []
    owner: dict[int, str] = {}
    now, steps = 0.0, 0
    while arrivals or sched.live_requests:
        while arrivals and arrivals[0] <= now:
            arrivals.pop(0)
            name = names[rng.choice(len(names), p=shares / shares.sum())]
            (plo, phi), (olo, ohi), _ = MIX[name]
            prompt = rng.integers(0, 32_000, int(rng.integers(plo, phi)), dtype=np.int32)
            if name == "chat":
                prompt = np.concatenate([SYSTEM_PROMPT, prompt])
            try:
                rid = sched.submit(name, prompt, int(rng.integers(olo, ohi)), now=now)
                owner[rid] = name
            except kvsched.Rejected as e:
                rejected[name][e.reason] = rejected[name].get(e.reason, 0) + 1
        plan = sched.step(now=now)
        if plan is None:  # idle until the next arrival
            now = arrivals[0] if arrivals else now
            continue
        now += STEP_OVERHEAD_S + PER_TOKEN_S * plan.num_tokens  # the engine's step
        sampled = rng.integers(0, 32_000, len(plan), dtype=np.int32)
        events = sched.commit(plan, sampled, now=now)
        finished.extend(events.finished)
        steps += 1
    finished.extend(sched.take_finished())  # ended outside a commit, not yet delivered
    # A request displaced for a higher tier (reason "shed") was refused after all.
    for f in finished:
        if f.reason == "shed":
            rejected[f.tenant]["displaced"] = rejected[f.tenant].get("displaced", 0) + 1
    finished = [f for f in finished if f.reason != "shed"]

    stats = sched.stats(now=now)
    table: dict[str, dict[str, Any]] = {}
    for name in names:
        mine = [f for f in finished if f.tenant == name]
        itl = [(f.finished - f.first_token) / (len(f.output_ids) - 1)
               for f in mine if len(f.output_ids) > 1]  # fmt: skip
        out_tokens = sum(len(f.output_ids) for f in mine)
        table[name] = {
            "tier": stats["tenants"][name]["tier"],
            "finished": len(mine),
            "rejected": rejected[name],
            "ttft_p50": percentile([f.ttft for f in mine], 50),
            "ttft_p99": percentile([f.ttft for f in mine], 99),
            "itl_p50": percentile(itl, 50),
            "itl_p99": percentile(itl, 99),
            "tokens_per_s": out_tokens / now if now else 0.0,
            "cached_share": sum(f.cached_tokens for f in mine)
            / max(1, sum(f.prompt_len for f in mine)),
        }
    if not quiet:
        pool = stats["pool"]
        print(
            f"{n_requests} requests, {steps} steps, {now:.2f} s of virtual time; "
            f"pool {pool['usable']} usable blocks of {pool['total']}"
        )
        # The overload ladder: which rungs engaged (how often), and whether all of
        # them were released again by the end.
        ladder = stats["ladder"]
        engaged = [f"{r['action']} engaged {r['climbs']} time(s)"
                   for r in ladder["rungs"] if r["climbs"]]  # fmt: skip
        rest = ("all released by the end" if ladder["level"] == 0
                else f"still {ladder['level']} rung(s) up at the end")  # fmt: skip
        print(f"degradation ladder: {', '.join(engaged)}; {rest}" if engaged
              else "degradation ladder: never engaged")  # fmt: skip
        head = (f"{'tenant':<7}{'tier':>5}{'done':>6}  {'TTFT p50/p99 (s)':>17}  "
                f"{'ITL p50/p99 (ms)':>17}{'tok/s':>8}{'cached':>8}  rejected")  # fmt: skip
        print(head)
        print("-" * len(head))
        for name, row in table.items():
            print(f"{name:<7}{row['tier']:>5}{row['finished']:>6}  "
                  f"{row['ttft_p50']:>8.3f}/{row['ttft_p99']:<8.3f}  "
                  f"{row['itl_p50'] * 1e3:>8.1f}/{row['itl_p99'] * 1e3:<8.1f}"
                  f"{row['tokens_per_s']:>8.0f}{row['cached_share']:>8.0%}  "
                  f"{row['rejected'] or '-'}")  # fmt: skip
    return table


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(seed=args.seed, n_requests=args.requests)
