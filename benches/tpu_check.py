"""TPU check: kvsched's Pallas TPU kernel ("pallas", kernels/tpu.py) and JAX's
(backend "jax") against the reference on a real mixed plan, then decode
attention timed beside the cost model's prediction. Run this first on any TPU
lent to the project.

    python benches/tpu_check.py            # on a TPU host (v5e, v6e)
    python benches/tpu_check.py --small    # tiny shapes, Pallas' interpreter on CPU
    python benches/tpu_check.py --page-size 128   # pages of 64 / 128 (default 16)
    python benches/tpu_check.py --window 512      # a sliding-window layer (Gemma 3's W)

1. Correctness: mixed plans (prefill chunks and decodes) from a real kvsched
   Scheduler, bf16 KV and queries, Llama-3-8B heads (32 query, 8 KV, dim 128);
   each kernel's real rows against the jnp reference. Exit 1 beyond tolerance.
2. Speed: decode only, 256 sequences of 2048 cached tokens (--seqs, --context).
   Every kernel must read each sequence's K and V once, S * L * 2 * Hkv * D * 2
   bytes; a kernel's achieved GB/s is those bytes over its median time, and its
   share of HBM bandwidth is that over the device's (kvsched.capacity's preset).
   Beside each: the cost model's predicted time and share for that kernel on
   this device (kvsched.engine.kernels.cost), so one run checks the model too.

With --window W every kernel runs as a sliding-window layer: the checks pass
the window, the decode's page table holds the null page 0 (filled with NaN)
before each sequence's window page, as a window group's does, the KV to read is
each sequence's last W tokens, and a non-finite decode output (a page outside
the window read) fails the run.

Backend "jax" (JAX's ragged_paged_attention with its tuned block sizes on TPU)
is timed when kvsched.engine.attention knows it; otherwise a note says so. On
CPU (--small) the times are the interpreter's: they check the script, not the
kernel. Exit codes: 0 ok, 1 a kernel beyond tolerance, 2 no TPU (without --small).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

TOLERANCE = 3e-2  # bf16 KV and queries


def median_time(f: Any, *args: Any, reps: int, batch: int) -> float:
    """Median over `reps` of the time per call of `batch` back-to-back calls (one
    sync per batch, so dispatch overlaps the kernels); the first call compiles."""
    f(*args).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [f(*args) for _ in range(batch)]
        outs[-1].block_until_ready()
        times.append((time.perf_counter() - t0) / batch)
    return float(np.median(times))


def model_device(kind: str) -> str | None:
    """The cost model's device for a jax device_kind ("TPU v5 lite", "TPU v6e", ...)."""
    k = kind.lower()
    if "v5 lite" in k or "v5e" in k:
        return "tpu-v5e"
    if "v6 lite" in k or "v6e" in k:
        return "tpu-v6e"
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes in the CPU interpreter")
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--block-q", type=int, default=None,
                    help="kvsched's kernel's query block tokens (default: its own, from the "
                         "plan's shape)")  # fmt: skip
    ap.add_argument("--page-size", type=int, choices=(16, 64, 128), default=16,
                    help="KV page size in tokens (64 and 128: recommended on TPU)")  # fmt: skip
    ap.add_argument("--model-device", default=None,
                    help="cost-model device (tpu-v5e, tpu-v6e); default: the TPU found, "
                         "else tpu-v5e")  # fmt: skip
    ap.add_argument("--window", type=int, default=None,
                    help="sliding window W in tokens (default: full attention)")  # fmt: skip
    args = ap.parse_args(argv)
    window = args.window or None

    import jax
    import jax.numpy as jnp

    import kvsched
    from kvsched.engine import AttentionInputs, paged_attention
    from kvsched.engine.kernels import cost, tiling
    from kvsched.engine.kernels.reference import reference_attention
    from kvsched.engine.kernels.tpu import ragged_paged_attention

    on_tpu = jax.default_backend() == "tpu"
    if not on_tpu and not args.small:
        print("no TPU visible to jax: the TPU check did not run (use --small for a CPU "
              "smoke run of the script)")  # fmt: skip
        return {"ran": False}
    kind = jax.devices()[0].device_kind
    dev_name = args.model_device or model_device(kind) or "tpu-v5e"
    if dev_name not in cost.DEVICES:
        raise SystemExit(f"--model-device must be one of {sorted(cost.DEVICES)}")
    dev = cost.DEVICES[dev_name]
    if args.small:
        hq, hkv, d, bs, seqs, ctx, reps, batch = 4, 2, 128, args.page_size, 4, 64, 1, 1
    else:
        hq, hkv, d, bs = 32, 8, 128, args.page_size
        seqs, ctx, reps, batch = args.seqs, args.context, args.reps, 10
    scale = d**-0.5
    where = "" if on_tpu else "; CPU interpreter: times check the script, not the kernel"
    print(f"device: {kind} (model: {dev_name}, {dev.hbm_bytes_per_s / 1e9:.0f} GB/s); "
          f"heads {hq}/{hkv}, head_dim {d}, pages of {bs}{where}")  # fmt: skip

    def run_jax(q: jax.Array, cache: jax.Array, inputs: AttentionInputs) -> jax.Array | None:
        try:
            out: jax.Array = paged_attention(q, cache, inputs, scale=scale, backend="jax",
                                             sliding_window=window)  # fmt: skip
        except ValueError as e:
            if "unknown attention backend" in str(e):
                return None
            raise
        return out

    # 1. Correctness on mixed plans from the real scheduler.
    rng = np.random.default_rng(0)
    pages = 256 if args.small else 4096
    sched = kvsched.Scheduler(kvsched.SchedulerConfig(
        num_blocks=pages, block_size=bs, max_num_seqs=8,
        max_batched_tokens=64 if args.small else 256,
        max_seq_len=128 if args.small else 1024, long_prefill_chunk=96,
    ))  # fmt: skip
    sched.add_tenant(kvsched.TenantConfig("t"))
    for n in (5, 40, 90, 200, 17)[: 3 if args.small else 5]:
        sched.submit("t", rng.integers(0, 1000, n, dtype=np.int32), 8, now=0.0)
    cache = jnp.asarray(rng.standard_normal((pages, bs, 2 * hkv, d)), jnp.bfloat16)
    worst: dict[str, float] = {"pallas": 0.0}
    jax_known = True
    mixed = False
    for step in range(4):
        plan = sched.step(now=float(step))
        if plan is None:
            break
        is_mixed = 0 < plan.num_decode < len(plan)
        mixed |= is_mixed
        if args.small and not is_mixed:  # the interpreter compiles per shape: one plan
            sched.commit(plan, np.zeros(len(plan), np.int32), now=float(step))
            continue
        n = plan.num_tokens
        q = jnp.asarray(rng.standard_normal((plan.bucket, hq, d)), jnp.bfloat16)
        inputs = AttentionInputs.from_plan(plan)
        want = reference_attention(q, cache, inputs, scale=scale, sliding_window=window)
        want = want.astype(jnp.float32)[:n]
        got = ragged_paged_attention(q, cache, inputs, scale=scale, block_q=args.block_q,
                                     sliding_window=window)  # fmt: skip
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32)[:n] - want)))
        worst["pallas"] = max(worst["pallas"], err)
        if jax_known:
            got_jax = run_jax(q, cache, inputs)
            if got_jax is None:
                jax_known = False
            else:  # its padding rows may hold anything: real rows only
                err = float(jnp.max(jnp.abs(got_jax.astype(jnp.float32)[:n] - want)))
                worst["jax"] = max(worst.get("jax", 0.0), err)
        sched.commit(plan, np.zeros(len(plan), np.int32), now=float(step))
        if args.small:
            break
    if not jax_known:
        print("note: attention backend 'jax' is not in this tree's kvsched.engine.attention: "
              "JAX's kernel is not checked or timed")  # fmt: skip
    ok = all(e <= TOLERANCE for e in worst.values())
    for name, e in worst.items():
        verdict = "within" if e <= TOLERANCE else "OVER"
        print(f"{name} vs reference on mixed plans (bf16{', a mixed one' if mixed else ''}): "
              f"max abs error {e:.2e} ({verdict} {TOLERANCE})")  # fmt: skip

    # 2. Decode attention against the bandwidth and the model.
    per_seq = -(-ctx // bs)
    n_pages = seqs * per_seq + 1
    cache = jnp.asarray(rng.standard_normal((n_pages, bs, 2 * hkv, d)), jnp.bfloat16)
    t = -(-seqs // (args.block_q or 8)) * (args.block_q or 8)  # whole query blocks
    page_indices = (1 + np.arange(seqs * per_seq, dtype=np.int32)).reshape(seqs, per_seq)
    rng.shuffle(page_indices.reshape(-1))
    if window is not None:  # a window group's table: the null page (NaN) behind the window
        page_indices[:, : max(0, ctx - window) // bs] = 0
        cache = cache.at[0].set(jnp.nan)
    inputs = AttentionInputs(
        positions=jnp.asarray(np.full(t, ctx - 1, np.int32)),
        cu_q_lens=jnp.asarray(np.minimum(np.arange(seqs + 1), seqs).astype(np.int32)),
        kv_lens=jnp.asarray(np.full(seqs, ctx, np.int32)),
        page_indices=jnp.asarray(page_indices),
        num_seqs=jnp.asarray([seqs], np.int32),
    )
    q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.bfloat16)
    shapes = cost.Shapes(hq, hkv, d, bs)
    plan_model = cost.Plan((1,) * seqs, (ctx,) * seqs, t, window)
    bkv, bq_jax = cost.jax_rpa_block_sizes(shapes, t, per_seq, dev_name)
    if window is not None:  # capped at the window's pages, as kernels.jax_rpa does
        bkv = min(bkv, tiling.window_pages(window, bs))
    kvh = cost.jax_rpa_kv_heads_per_block(shapes)
    # The kernel's own sizes for this shape, unless --block-q names one.
    bq = args.block_q or tiling.tpu_block_q(t, seqs, hq // hkv)
    ppb = tiling.tpu_pages_per_block(bs, per_seq, tiling.tpu_decode_path(bq, hq // hkv), window,
                                     bq)  # fmt: skip
    runs: list[tuple[str, Any, cost.KernelDesc | None]] = [
        ("pallas", jax.jit(lambda q, c: ragged_paged_attention(
            q, c, inputs, scale=scale, block_q=args.block_q, sliding_window=window)),
         cost.ours_tpu_v2(bq, ppb)),
    ]  # fmt: skip
    if jax_known:
        runs.append(("jax", jax.jit(lambda q, c: paged_attention(
            q, c, inputs, scale=scale, backend="jax", sliding_window=window)),
            cost.jax_tpu(bkv, bq_jax, None if kvh == hkv else kvh)))  # fmt: skip
    ref = jax.jit(lambda q, c: reference_attention(q, c, inputs, scale=scale,
                                                   sliding_window=window))  # fmt: skip
    runs.append(("reference", ref, None))
    kv_bytes = seqs * plan_model.keys(0) * 2 * hkv * d * 2
    span = "" if window is None else f", a window of {window}"
    print(f"decode: {seqs} seqs x {ctx} tokens{span}, {kv_bytes / 1e9:.3f} GB of KV to read")
    print(f"  {'kernel':<10} {'ms':>9} {'GB/s':>9} {'HBM':>7}   {'model ms':>9} {'model HBM':>9}"
          "  model bound")  # fmt: skip
    rows: dict[str, dict[str, float | str]] = {}
    for name, f, desc in runs:
        r = reps if name != "reference" else max(1, reps // 4)
        secs = median_time(f, q, cache, reps=r, batch=batch)
        share = kv_bytes / dev.hbm_bytes_per_s / secs
        row: dict[str, float | str] = {"s": secs, "gbs": kv_bytes / secs / 1e9, "hbm": share}
        line = f"  {name:<10} {secs * 1e3:9.3f} {kv_bytes / secs / 1e9:9.1f} {share:7.1%}"
        if desc is not None:
            p = cost.predict(plan_model, shapes, desc, dev)
            row.update(model_s=p.step_s, model_hbm=p.hbm_fraction, bound=p.bound)
            line += f"   {p.step_s * 1e3:9.3f} {p.hbm_fraction:9.1%}  {p.bound}"
        else:
            line += f"   {'-':>9} {'-':>9}  -"
        rows[name] = row
        print(line)
        if window is not None and not bool(jnp.isfinite(f(q, cache)[:seqs]).all()):
            print(f"  {name}: NaN in the output: a page outside the window was read")
            ok = False
    return {"ran": True, "ok": ok, "max_error": worst, "mixed": mixed, "decode": rows,
            "jax_backend": jax_known, "model_device": dev_name}  # fmt: skip


def exit_code(result: dict) -> int:
    """0: ran and within tolerance; 1: a kernel beyond it; 2: no device to run on."""
    return 2 if not result["ran"] else 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(exit_code(main(sys.argv[1:])))
