"""The multi-host protocol's cost per step, without a model: two local processes
(jax.distributed over 127.0.0.1, CPU collectives over gloo), one Scheduler each,
at 64 and 1,024 running sequences.

    python benches/multihost.py --local 2          # both processes, a table on stdout
    python benches/multihost.py --process-id I --coordinator HOST:PORT   # one of them

Per size: the burst step that admits every sequence, then steady decode steps
where host 0 admits one request and cancels one (the batch stays full). Reported:
the bytes broadcast (padding included) and the encoded inputs, the broadcast's
and the replay's time, the digest (hashing the plan, and the allgather that
compares it), and for comparison the plan arrays' bytes and the time to
broadcast that many bytes instead.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

SIZES = (64, 1024)
STEADY_STEPS = 40


def spawn(n: int, timeout: float) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for i in range(n):
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--process-id", str(i), "--processes", str(n),
                 "--coordinator", f"127.0.0.1:{port}"],
                start_new_session=True,
            ))  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        return max(p.poll() or 0 for p in procs) if all(p.poll() is not None for p in procs) else 1
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def ms(xs: list[float]) -> str:
    return f"{1e3 * statistics.median(xs):.2f} (p90 {1e3 * sorted(xs)[int(0.9 * len(xs))]:.2f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--local", type=int, help="start this many local processes")
    ap.add_argument("--process-id", type=int)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--coordinator")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    if args.local:
        sys.exit(spawn(args.local, args.timeout))

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=args.processes,
                               process_id=args.process_id, initialization_timeout=60)  # fmt: skip
    import numpy as np
    from jax.experimental import multihost_utils

    import kvsched
    from kvsched.engine import multihost as mh
    from kvsched.engine.sampling import SamplingParams

    p0 = args.process_id == 0
    rows = []
    for n in SIZES:
        cfg = kvsched.SchedulerConfig(
            num_blocks=n * 40 + 1, block_size=16, max_num_seqs=n, max_batched_tokens=2 * n,
            max_seq_len=1024, overhead_reserve=0.0, max_waiting=4 * n, prefix_caching=False,
        )  # fmt: skip
        m = mh.MultiHost(mh.SchedulerRunner(kvsched.Scheduler(cfg)), digest_every=1,
                         timeout_s=120)  # fmt: skip
        rng = np.random.default_rng(0)
        params = SamplingParams(max_tokens=512)
        live: list[int] = []
        t = 0.0
        if p0:
            m.add_tenant(kvsched.TenantConfig("t"))
            live += [m.submit("t", rng.integers(0, 256, 64), params, now=t) for _ in range(n)]
        m.step(t)
        burst = m.timings[-1]
        # Until every sequence has finished its prefill and decodes.
        while True:
            t += 0.02
            res = m.step(t)
            if res is not None and res.plan is not None and res.plan.num_decode == n:
                break
        plan = res.plan
        plan_bytes = sum(np.asarray(getattr(plan, f)).nbytes for f in mh.PLAN_FIELDS)
        first = len(m.timings)
        hashing = []
        for _ in range(STEADY_STEPS):
            t += 0.02
            if p0:
                m.cancel(live.pop(0), now=t)
                live.append(m.submit("t", rng.integers(0, 256, 64), params, now=t))
            res = m.step(t)
            if res is not None and res.plan is not None:
                h1 = time.perf_counter()  # what the step's digest row costs to hash
                for f in mh.PLAN_FIELDS:
                    mh._hash(getattr(res.plan, f))
                hashing.append(time.perf_counter() - h1)
        steady = m.timings[first:]
        # The same steps broadcasting the plan arrays instead (padded as the tail is).
        buf = np.zeros(mh.tail_bucket(plan_bytes), np.uint8)
        plan_bcast = []
        for _ in range(20):
            b0 = time.perf_counter()
            np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=p0))
            plan_bcast.append(time.perf_counter() - b0)
        # An idle step: nothing arrived, only `now`.
        idle = []
        for _ in range(20):
            t += 0.02
            m.step(t)
            idle.append(m.timings[-1].broadcast_s)
        if p0:
            m.close()
        else:
            while not m.stopped:
                m.step()
        rows.append({
            "process": args.process_id, "running": n,
            "burst_ops": burst.ops, "burst_body_bytes": burst.body_bytes,
            "burst_message_bytes": burst.message_bytes,
            "burst_broadcast_ms": round(1e3 * burst.broadcast_s, 2),
            "burst_apply_ms": round(1e3 * burst.apply_s, 2),
            "steady_body_bytes": statistics.median(s.body_bytes for s in steady),
            "steady_message_bytes": statistics.median(s.message_bytes for s in steady),
            "steady_broadcast_ms": ms([s.broadcast_s for s in steady]),
            "steady_apply_ms": ms([s.apply_s for s in steady]),
            "idle_broadcast_ms": ms(idle),
            "digest_hash_ms": ms(hashing), "digest_allgather_ms": ms([s.digest_s for s in steady]),
            "plan_bytes": plan_bytes, "plan_message_bytes": int(buf.size),
            "plan_broadcast_ms": ms(plan_bcast),
        })  # fmt: skip
    for r in rows:
        print(json.dumps(r))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
