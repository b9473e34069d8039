"""Does the ladder protect tier 0? A window of the Azure code trace squeezed to
several loads, replayed without a ladder and with the default one.

    python benches/tier0_ladder.py [--trace PATH] [--start S] [--seconds S]
                                   [--loads 3,10] [--tenants two|three]

Tenants: "two" splits by prompt length (interactive, tier 0: prompts up to 4096
tokens; batch, tier 1: longer), as `kvsched simulate --trace azure` does;
"three" deals requests round-robin to chat (tier 0), code (tier 1) and batch
(tier 2). Engine: llama-3-8b on one H100 (the simulator's step-cost model),
the scheduler sized by kvsched.capacity as `kvsched simulate` sizes it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import kvsched
from kvsched.capacity import capacity
from kvsched.sim import scenarios, workloads
from kvsched.sim.simulator import StepCost
from kvsched.sim.traces import read_azure

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_code_2023.csv"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(SHARED))
    p.add_argument("--start", type=float, default=600.0)
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--loads", default="3,10")
    p.add_argument("--tenants", choices=["two", "three"], default="two")
    args = p.parse_args()
    if args.tenants == "two":
        names = [("interactive", 0), ("batch", 1)]
        rule = workloads.by_length()
    else:
        names = [("chat", 0), ("code", 1), ("batch", 2)]
        rule = workloads.round_robin([n for n, _ in names])
    tenants = [kvsched.TenantConfig(n, tier=t) for n, t in names]
    full = workloads.azure(read_azure(args.trace), tenant=rule)
    for load in (float(x) for x in args.loads.split(",")):
        arrivals = scenarios.squeezed_window(full, args.start, args.seconds, load)
        longest = max(len(a.prompt) + a.max_tokens for a in arrivals)
        cap = capacity("llama-3-8b", "h100", devices=1, context=max(8192, -(-longest // 16) * 16))
        base = cap.scheduler_config(max_num_seqs=128, max_batched_tokens=8192,
                                    long_prefill_chunk=2048, max_waiting=512)  # fmt: skip
        results = scenarios.ladder_vs_none(base, tenants, arrivals, StepCost.preset())
        print(f"== {len(arrivals)} requests, [{args.start:.0f}, {args.start + args.seconds:.0f}) s "
              f"at {load:g}x")  # fmt: skip
        print(scenarios.table(list(results)))
        for r in results:
            top = r.summary()[names[0][0]]
            print(f"  {r.name}: tier 0 p99 TTFT {top['ttft_p99']:.3f} s, rejected "
                  f"{sum(top['rejected'].values())} {top['rejected']}, capped {top['capped']}, "
                  f"displaced {r.stats['displaced']}")  # fmt: skip


if __name__ == "__main__":
    main()
