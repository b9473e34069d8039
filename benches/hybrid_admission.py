"""How many requests a fixed KV budget admits for a hybrid model, in KV-cache
groups against the same model kept in full: the real scheduler, reserve mode.

    python benches/hybrid_admission.py                       # Gemma 3 270M, 8 GiB
    python benches/hybrid_admission.py --model gemma-3-27b --gib 60

The model's layer pattern comes from kvsched.shapes (its preset), cut into
groups by `group_layers`; a page holds one group's layers (hybrid) or every
layer (uniform), so the same bytes make more, smaller pages for the hybrid
layout. At each context length, requests of that final length (prompt plus
256 new tokens) are submitted until admission refuses; the table gives how
many were admitted each way, and what the capacity model predicts.
"""

from __future__ import annotations

import argparse

import numpy as np

import kvsched
from kvsched.shapes import MODELS, group_layers, kv_bytes, reserved_pages


def admitted(groups: list[str], num_blocks: int, block: int, chunk: int, length: int) -> int:
    """Requests of `length` tokens the scheduler admits before refusing one."""
    sched = kvsched.Scheduler(kvsched.SchedulerConfig(
        num_blocks=num_blocks + 1, block_size=block, long_prefill_chunk=chunk,
        max_seq_len=length, max_num_seqs=64, max_waiting=1 << 20, overhead_reserve=0.0,
        prefix_caching=False, kv_cache_groups=groups,
    ))  # fmt: skip
    sched.add_tenant(kvsched.TenantConfig("t"))
    prompt = np.ones(length - 256, np.int32)
    n = 0
    while True:
        try:
            sched.submit("t", prompt, max_tokens=256, now=0.0)
        except kvsched.Rejected as e:
            # tenant_budget: one request is larger than the whole pool.
            assert e.reason in ("pool_full", "tenant_budget"), e
            return n
        n += 1


def main(argv: list[str] | None = None) -> list[dict[str, int]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m", choices=sorted(MODELS))
    ap.add_argument("--gib", type=float, default=8.0, help="KV bytes, GiB (bfloat16 KV)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512, help="long_prefill_chunk")
    ap.add_argument("--lengths", default="2048,8192,32768")
    args = ap.parse_args(argv)
    shape = MODELS[args.model]
    budget = int(args.gib * 2**30)
    rows = []
    print(f"{args.model}: {args.gib:g} GiB of bfloat16 KV, pages of {args.block_size} tokens, "
          f"prefill chunk {args.chunk}")  # fmt: skip
    print(f"{'context':>8} {'hybrid':>8} {'uniform':>8} {'ratio':>6} {'formula':>8}")
    for length in (int(x) for x in args.lengths.split(",")):
        row = {"context": length}
        for name, uniform in (("hybrid", False), ("uniform", True)):
            layout = group_layers(shape.layer_types, uniform=uniform)
            page = int(kv_bytes(layout.layers_per_group, shape.kv_heads, shape.head_dim, 2,
                                tokens=args.block_size))  # fmt: skip
            pages = budget // page
            groups = list(layout.groups)
            row[name] = admitted(groups, pages, args.block_size, args.chunk, length)
            per = reserved_pages(groups, length - 256, 256, args.block_size, args.chunk)
            row[f"{name}_formula"] = pages // per
        ratio = row["hybrid"] / max(row["uniform"], 1)
        formula = row["hybrid_formula"] / max(row["uniform_formula"], 1)
        print(f"{length:>8} {row['hybrid']:>8} {row['uniform']:>8} {ratio:>5.2f}x {formula:>7.2f}x")
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
