"""The example engine: a small Llama-style model served to three tenants through
kvsched, on CPU by default.

    python examples/engine.py [--backend reference|pallas] [--device cpu|tpu|gpu]
                              [--requests N] [--seed S]

Tenants: `chat` (tier 0: short prompts behind one shared system prompt, short
answers), `digest` (tier 1: long documents, short answers), `writer` (tier 2:
short prompts, long outputs). Requests arrive over a few seconds of wall time;
the engine warms up first (every token bucket compiled, one synthetic request
completed), then runs step() -> model -> greedy sampling -> commit() until all
have ended. The table gives, per tenant, what finished and what was refused and
why, time to first token and inter-token time (p50/p99), and output tokens/s.
The model's weights are random (seeded): the tokens are meaningless, the
scheduling and the timings are real.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

TENANTS = {  # name: (tier, prompt tokens, output tokens, share of arrivals)
    "chat": (0, (8, 48), (8, 24), 0.5),
    "digest": (1, (200, 400), (4, 12), 0.25),
    "writer": (2, (8, 32), (60, 120), 0.25),
}
SYSTEM_PROMPT = list(range(100, 164))  # chat's shared 64-token prefix


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main(argv: list[str] | None = None) -> dict[str, dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["reference", "pallas"], default="reference")
    ap.add_argument("--device", choices=["cpu", "tpu", "gpu"], default="cpu")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--seconds", type=float, default=4.0, help="arrivals spread over this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    # The platform must be chosen before jax is imported.
    os.environ.setdefault("JAX_PLATFORMS", {"cpu": "cpu", "tpu": "tpu", "gpu": "cuda"}[args.device])

    import kvsched
    from kvsched.engine.model import LlamaConfig, init_params
    from kvsched.engine.runner import Engine

    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    # Mosaic tiles head_dim by the TPU's 128 lanes: the TPU model has 128-wide heads.
    model = (
        LlamaConfig(dim=256, n_heads=2, n_kv_heads=1, head_dim=128, ffn_dim=512)
        if args.device == "tpu"
        else LlamaConfig()
    )
    params = init_params(model, seed=args.seed)
    engine = Engine.create(
        model,
        params,
        kvsched.SchedulerConfig(
            num_blocks=1025,
            block_size=16,
            max_num_seqs=16,
            max_batched_tokens=256,
            max_seq_len=512,
            long_prefill_chunk=128,
            max_waiting=64,
            ladder="default",
        ),  # fmt: skip
        backend=args.backend,
    )
    sched = engine.scheduler
    sz = engine.sizing
    say(
        f"model {model.name} (weights {engine.checksum}), {args.backend} attention on {args.device}"
    )
    say(
        f"KV pool: {sched.config.num_blocks - 1} pages of {sched.config.block_size} tokens "
        f"({sz.source}"
        + (f", {sz.measured_free_bytes / 2**30:.1f} GiB free" if sz.measured_free_bytes else "")
        + ")"  # fmt: skip
    )
    warm = engine.warmup(progress=not args.quiet)
    programs = engine.compiled_programs()
    say(f"warmup: {programs} programs compiled (one per token bucket) in {warm:.1f} s; ready")
    for name, (tier, *_rest) in TENANTS.items():
        sched.add_tenant(kvsched.TenantConfig(name, tier=tier))

    rng = np.random.default_rng(args.seed)
    names = list(TENANTS)
    shares = np.array([TENANTS[n][3] for n in names])
    offsets = np.sort(rng.uniform(0.0, args.seconds, args.requests))
    arrivals = [(float(t), names[rng.choice(len(names), p=shares / shares.sum())]) for t in offsets]
    rejected: dict[str, dict[str, int]] = {n: {} for n in names}
    finished = []
    start = time.monotonic()
    steps = 0
    while arrivals or sched.live_requests:
        now = time.monotonic()
        while arrivals and start + arrivals[0][0] <= now:
            _, name = arrivals.pop(0)
            _, (plo, phi), (olo, ohi), _ = TENANTS[name]
            prompt = rng.integers(0, model.vocab_size, int(rng.integers(plo, phi))).tolist()
            if name == "chat":
                prompt = SYSTEM_PROMPT + prompt
            try:
                sched.submit(name, np.asarray(prompt, np.int32), int(rng.integers(olo, ohi)))
            except kvsched.Rejected as e:
                rejected[name][e.reason] = rejected[name].get(e.reason, 0) + 1
        res = engine.step()
        if res is None:
            time.sleep(0.002)
            continue
        steps += 1
        finished.extend(res.events.finished)
    elapsed = time.monotonic() - start

    table: dict[str, dict] = {}
    for name in names:
        mine = [f for f in finished if f.tenant == name]
        itl = [(f.finished - f.first_token) / (len(f.output_ids) - 1)
               for f in mine if len(f.output_ids) > 1]  # fmt: skip
        table[name] = {
            "tier": TENANTS[name][0],
            "finished": len(mine),
            "rejected": rejected[name],
            "ttft_p50": percentile([f.ttft for f in mine], 50),
            "ttft_p99": percentile([f.ttft for f in mine], 99),
            "itl_p50": percentile(itl, 50),
            "itl_p99": percentile(itl, 99),
            "tokens_per_s": sum(len(f.output_ids) for f in mine) / elapsed,
            "cached_share": sum(f.cached_tokens for f in mine)
            / max(1, sum(f.prompt_len for f in mine)),
        }
    say(f"{args.requests} requests, {steps} steps in {elapsed:.1f} s")
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
    after = engine.compiled_programs()
    say(f"programs compiled after the run: {after} (no recompilation: {after == programs})")
    table["_run"] = {"programs": programs, "programs_after": after, "steps": steps,
                     "seconds": elapsed}  # fmt: skip
    return table


if __name__ == "__main__":
    main(sys.argv[1:])
