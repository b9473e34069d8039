"""What KV events cost the step loop: the core's step + commit with events
off, against the same with events on and drained into a batch every step
(`Scheduler.drain_kv_events`), side by side in one run.

    python benches/kv_events.py                    # 256 and 1,024 running decodes
    python benches/kv_events.py --seqs 64 --steps 3000 --repeats 5

Every sequence decodes from a 64-token prompt, so a block fills every 16
steps per sequence (block size 16), a run of them each step. The figures are
the mean microseconds per step (step, commit and drain; each repeat a fresh
scheduler, the two settings alternating) and the bytes a step publishes; the
median over repeats is reported, and the ratio on to off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import kvsched


def run(events: bool, seqs: int, steps: int) -> tuple[float, float]:
    """(mean us per step, bytes per step)."""
    cfg = kvsched.SchedulerConfig(
        num_blocks=seqs * (4 + (64 + steps) // 16) + 64, block_size=16, max_num_seqs=seqs,
        max_batched_tokens=seqs * 4, vocab_size=50_000, max_seq_len=64 + steps + 16,
        overhead_reserve=0.0, max_waiting=seqs,
    )  # fmt: skip
    s = kvsched.Scheduler(cfg)
    s.add_tenant(kvsched.TenantConfig("a"))
    if events:
        s.enable_kv_events()
    rng = np.random.default_rng(0)
    for _ in range(seqs):
        s.submit("a", rng.integers(0, 50_000, 64, dtype=np.int32), steps)
    tokens = np.full(seqs, 7, np.int32)
    warm = steps // 10
    nbytes, t = 0, 0.0
    for k in range(steps):
        t0 = time.perf_counter()
        plan = s.step()
        assert plan is not None
        s.commit(plan, tokens[: len(plan)])
        batch = s.drain_kv_events(time.time())
        if k >= warm:
            t += time.perf_counter() - t0
            nbytes += len(batch) if batch else 0
    return 1e6 * t / (steps - warm), nbytes / (steps - warm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="256,1024", help="running decodes (comma-separated)")
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    out = []
    for seqs in map(int, args.seqs.split(",")):
        got: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.repeats):
            for ev in (False, True):
                got[ev].append(run(ev, seqs, args.steps))
        off = statistics.median(u for u, _ in got[False])
        on = statistics.median(u for u, _ in got[True])
        row = {"seqs": seqs, "us_per_step_off": round(off, 2), "us_per_step_on": round(on, 2),
               "ratio": round(on / off, 3),
               "bytes_per_step": round(statistics.median(b for _, b in got[True]))}  # fmt: skip
        out.append(row)
        print(f"{seqs:>5} sequences: {off:7.2f} us a step without events, {on:7.2f} with "
              f"({on / off:.2f}x), {row['bytes_per_step']} bytes a step")  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
