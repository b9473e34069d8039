"""The engine over several processes (JAX's multi-controller runtime): a small
random-weight model whose weights and KV heads are split over every device of
every process, one kvsched Scheduler per process fed the same inputs.

    python examples/multihost.py --local 2        # two local processes, 2 CPU devices each
    python examples/multihost.py --process-id I --processes N --coordinator HOST:PORT

The second form is what runs once per host (on a TPU pod slice: the same
command on every host, I = the host's index, the coordinator = host 0's address;
see the README's "Beyond one host"). Process 0 admits the arrivals of three
tenants (examples/engine.py's workload on the random model), steps, and prints
the per-tenant table; the others replay what it broadcasts. Each process checks
the others' plan digests every step (`--digest-every`); a peer that dies or
stalls ends process 0 with exit status 3 and a checkpoint (`--checkpoint`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent


def _engine_example() -> Any:
    """examples/engine.py, for its workload (tenants, request shapes) and table."""
    spec = importlib.util.spec_from_file_location("kvsched_engine_example", HERE / "engine.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spawn_local(n: int, argv: list[str], timeout: float) -> int:
    """Start `n` local processes of this script (a free port on 127.0.0.1 for the
    coordinator); wait for all with a hard timeout; kill whatever is left."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for i in range(n):
            procs.append(subprocess.Popen(
                [sys.executable, __file__, *argv, "--process-id", str(i), "--processes", str(n),
                 "--coordinator", f"127.0.0.1:{port}"],
                start_new_session=True,
            ))  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if procs[0].poll() not in (None, 0):
                break  # process 0 failed: the others have nobody to follow
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
        if any(c is None for c in codes):
            print(f"multihost: stopped after {timeout:g} s or a failure: exit codes {codes}",
                  file=sys.stderr)  # fmt: skip
            return 1
        return max(abs(c or 0) for c in codes)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]] | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local", type=int, help="start this many local processes and wait")
    ap.add_argument("--process-id", type=int)
    ap.add_argument("--processes", type=int)
    ap.add_argument("--coordinator", help="HOST:PORT of process 0's coordination service")
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                    help="smollm2: SmolLM2-135M-Instruct (9 query / 3 KV heads, MLP "
                    "1536: a device count dividing 3, e.g. --local 3 "
                    "--devices-per-process 1)")  # fmt: skip
    ap.add_argument("--device", choices=["cpu", "tpu", "gpu"], default="cpu")
    ap.add_argument("--devices-per-process", type=int, default=2, help="CPU only (forced)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--seconds", type=float, default=2.0, help="arrivals spread over this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--digest-every", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60.0, help="per collective, seconds")
    ap.add_argument("--checkpoint", default="multihost-checkpoint.jsonl")
    args = ap.parse_args(argv)
    if args.local:
        rest = [a for a in (argv if argv is not None else sys.argv[1:])]
        i = rest.index("--local")
        del rest[i : i + 2]
        sys.exit(spawn_local(args.local, rest, timeout=600))
    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        # CPU collectives between processes (jax.config's jax_cpu_collectives_implementation).
        os.environ["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices_per_process}"
        )
    import jax

    if args.coordinator is None:
        jax.distributed.initialize()  # a TPU pod slice: everything from the environment
    else:
        jax.distributed.initialize(args.coordinator, num_processes=args.processes,
                                   process_id=args.process_id)  # fmt: skip

    import kvsched
    from kvsched.engine import multihost as mh
    from kvsched.engine.mesh import make_mesh
    from kvsched.engine.model import LlamaConfig, init_params
    from kvsched.engine.runner import Engine
    from kvsched.engine.sharding import kv_replicas

    ex = _engine_example()
    p0 = jax.process_index() == 0

    def say(*a: object) -> None:
        if p0:
            print(*a, flush=True)

    # KV heads, query heads and the MLP split over every global device.
    n_dev = len(jax.devices())
    gg = None
    if args.model == "tiny":
        model = LlamaConfig(n_heads=2 * n_dev, n_kv_heads=n_dev, head_dim=32, dim=128,
                            ffn_dim=256)  # fmt: skip
        params = init_params(model, seed=args.seed)
    else:
        args.quiet = not p0
        model, params, gg = ex.build_model(args, say)
        try:
            kv_replicas(model, n_dev)
        except kvsched.InvalidConfig as e:
            sys.exit(str(e))
    sched_config = kvsched.SchedulerConfig(
        num_blocks=1025, block_size=16, max_num_seqs=16, max_batched_tokens=256,
        max_seq_len=512, long_prefill_chunk=128, max_waiting=64, ladder="default",
    )  # fmt: skip
    engine = Engine.create(
        model, params, sched_config, mesh=make_mesh(),
        tokenizer=None if gg is None else gg.tokenizer,
        eos_token_ids=() if gg is None else (gg.eos_token_id,),
    )  # fmt: skip
    warm = engine.warmup(progress=False)
    say(f"{jax.process_count()} processes, {n_dev} devices ({len(jax.local_devices())} per "
        f"process); KV heads {model.n_kv_heads} split over all"
        f"{f' ({engine.kv_replicas} copies each)' if engine.kv_replicas > 1 else ''}; "
        f"warmup {warm:.1f} s")  # fmt: skip
    m = mh.MultiHost(engine, digest_every=args.digest_every, timeout_s=args.timeout,
                     checkpoint_path=args.checkpoint)  # fmt: skip

    if not p0:

        def follow() -> None:
            while not m.stopped:
                m.step()

        mh.exit_on_peer_lost(follow)
        return None

    rng = np.random.default_rng(args.seed)
    names = list(ex.TENANTS)
    for name in names:
        m.add_tenant(kvsched.TenantConfig(name, tier=ex.TENANTS[name][0]))
    shares = np.array([ex.TENANTS[n][1] for n in names])
    offsets = np.sort(rng.uniform(0.0, args.seconds, args.requests))
    arrivals = [(float(t), names[rng.choice(len(names), p=shares / shares.sum())])
                for t in offsets]  # fmt: skip
    rejected: dict[str, dict[str | None, int]] = {n: {} for n in names}
    tenant_of: dict[int, str] = {}
    submitted: dict[int, float] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    n_tokens: dict[int, int] = {}
    ended: dict[int, str | None] = {}
    labels: dict[int, str] = {}
    texts: dict[int, str] = {}
    finished: list[kvsched.FinishedRequest] = []
    start = time.monotonic()

    def serve() -> None:
        while arrivals or engine.scheduler.live_requests:
            while arrivals and start + arrivals[0][0] <= time.monotonic():
                _, name = arrivals.pop(0)
                prompt, sp, label = ex.make_request(name, rng, gg, model)
                try:
                    rid = m.submit(name, prompt, sp)
                except kvsched.Rejected as e:
                    rejected[name][e.reason] = rejected[name].get(e.reason, 0) + 1
                    continue
                tenant_of[rid], submitted[rid], n_tokens[rid] = name, time.monotonic(), 0
                labels[rid], texts[rid] = label, ""
            res = m.step()  # every process steps together, idle or not
            if res is None:
                time.sleep(0.002)
                continue
            finished.extend(res.events.finished)
            stamp = time.monotonic()
            for out in res.outputs:
                texts[out.request_id] += out.text
                if out.token_ids:
                    first.setdefault(out.request_id, stamp)
                    last[out.request_id] = stamp
                    n_tokens[out.request_id] += len(out.token_ids)
                if out.finished:
                    ended[out.request_id] = out.finish_reason
        m.close()

    mh.exit_on_peer_lost(serve)
    elapsed = time.monotonic() - start
    table: dict[str, dict[str, Any]] = {}
    for name in names:
        mine = [r for r, t in tenant_of.items() if t == name and r in ended]
        ttft = [first[r] - submitted[r] for r in mine if r in first]
        itl = [(last[r] - first[r]) / (n_tokens[r] - 1) for r in mine if n_tokens[r] > 1]
        done = [f for f in finished if f.tenant == name]
        table[name] = {
            "tier": ex.TENANTS[name][0], "finished": len(mine), "rejected": rejected[name],
            "ttft_p50": ex.percentile(ttft, 50), "ttft_p99": ex.percentile(ttft, 99),
            "itl_p50": ex.percentile(itl, 50), "itl_p99": ex.percentile(itl, 99),
            "tokens_per_s": sum(n_tokens[r] for r in mine) / elapsed,
            "cached_share": sum(f.cached_tokens for f in done)
            / max(1, sum(f.prompt_len for f in done)),
        }  # fmt: skip
    if gg is not None:
        for rid in sorted(ended)[:3]:
            say(f"[{tenant_of[rid]}] {labels[rid]}\n  -> {texts[rid].strip()!r} ({ended[rid]})")
    t = m.timings
    say(f"{args.requests} requests, {m.step_no} steps in {elapsed:.1f} s; per step: broadcast "
        f"{1e3 * float(np.median([s.broadcast_s for s in t])):.2f} ms (median, "
        f"{int(np.median([s.message_bytes for s in t]))} bytes), digest check "
        f"{1e3 * float(np.median([s.digest_s for s in t])):.2f} ms")  # fmt: skip
    head = (f"{'tenant':<8}{'tier':>5}{'done':>6}  {'TTFT p50/p99 (s)':>17}  "
            f"{'ITL p50/p99 (ms)':>17}{'tok/s':>8}{'cached':>8}  rejected")  # fmt: skip
    say(head)
    say("-" * len(head))
    for name, row in table.items():
        say(f"{name:<8}{row['tier']:>5}{row['finished']:>6}  "
            f"{row['ttft_p50']:>8.3f}/{row['ttft_p99']:<8.3f}  "
            f"{row['itl_p50'] * 1e3:>8.1f}/{row['itl_p99'] * 1e3:<8.1f}"
            f"{row['tokens_per_s']:>8.1f}{row['cached_share']:>8.0%}  "
            f"{row['rejected'] or '-'}")  # fmt: skip
    unended = set(tenant_of) - set(ended)
    if unended:
        sys.exit(f"requests without an ending: {sorted(unended)}")
    return table


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)  # past the runtime's shutdown barrier (every process is done)
