"""GPU check: kvsched's Pallas (Triton) kernel against the reference on an NVIDIA
GPU, and decode attention timed against the HBM bandwidth limit.

    python benches/gpu_check.py                  # on a machine with an NVIDIA GPU
    python benches/gpu_check.py --small          # tiny shapes on CPU: checks the script
                                                 # (--interpret is the same)
    python benches/gpu_check.py --window 512     # a sliding-window layer

1. Correctness: mixed plans (prefill chunks and decodes) made by a real
   kvsched Scheduler, bf16 KV, Llama-3-8B-like heads (32 query, 8 KV, dim 128);
   the kernel's output (`pallas_gpu`, kernels/gpu.py) against the jnp reference.
2. Speed: decode only, S sequences of L cached tokens each (256 x 2048 by
   default: the decode case of docs/kernels.md); the kernel must read every K
   and V once, S * L * 2 * Hkv * D * 2 bytes, so the time is bounded below by
   those bytes / HBM bandwidth. The script reports the median time, the bytes/s it reached and
   that as a share of the bandwidth (`--hbm-tbs`, default 4.8 TB/s: an H200's
   HBM3e), beside the reference, and the cost model's predicted time and share
   for the kernel (kvsched.engine.kernels.cost, device `--model-device`, h200).

With --window W the kernel runs as a sliding-window layer: the checks pass the
window, the decode's page table holds the null page 0 (filled with NaN) before
each sequence's window page, the KV to read is each sequence's last W tokens,
and a non-finite decode output (a page outside the window read) fails the run.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def median_time(f, *args, reps: int, batch: int = 10) -> float:
    """Median over `reps` of the time per call of `batch` back-to-back calls
    (one sync per batch: dispatch overhead overlaps the kernels)."""
    f(*args).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [f(*args) for _ in range(batch)]
        outs[-1].block_until_ready()
        times.append((time.perf_counter() - t0) / batch)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interpret", "--small", action="store_true",
                    help="tiny shapes in the CPU interpreter")  # fmt: skip
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--hbm-tbs", type=float, default=4.8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--model-device", default="h200", help="the cost model's device")
    ap.add_argument("--window", type=int, default=None,
                    help="sliding window W in tokens (default: full attention)")  # fmt: skip
    args = ap.parse_args(argv)
    window = args.window or None

    import jax
    import jax.numpy as jnp

    import kvsched
    from kvsched.engine import AttentionInputs, reference_attention
    from kvsched.engine.kernels import cost, tiling
    from kvsched.engine.kernels.gpu import default_kv_splits, ragged_paged_attention_gpu

    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.interpret:
        print("no NVIDIA GPU visible to jax: the GPU check did not run (use --interpret for a "
              "CPU smoke run of the script)")  # fmt: skip
        return {"ran": False}
    if args.interpret:
        hq, hkv, d, bs, seqs, ctx, reps = 4, 2, 16, 16, 4, 64, 2
    else:
        hq, hkv, d, bs, seqs, ctx, reps = 32, 8, 128, 16, args.seqs, args.context, args.reps
    interpret = not on_gpu
    print(f"device: {jax.devices()[0].device_kind}; heads {hq}/{hkv}, head_dim {d}, pages of {bs}")

    # 1. Correctness on mixed plans from the real scheduler.
    rng = np.random.default_rng(0)
    pages = 4096 if not args.interpret else 256
    sched = kvsched.Scheduler(kvsched.SchedulerConfig(
        num_blocks=pages, block_size=bs, max_num_seqs=8,
        max_batched_tokens=256 if not args.interpret else 64,  # small: a mixed 2nd step
        max_seq_len=1024 if not args.interpret else 128, long_prefill_chunk=96,
    ))  # fmt: skip
    sched.add_tenant(kvsched.TenantConfig("t"))
    for n in (5, 40, 90, 200, 17)[: 5 if not args.interpret else 3]:
        sched.submit("t", rng.integers(0, 1000, n, dtype=np.int32), 8, now=0.0)
    cache = jnp.asarray(rng.standard_normal((pages, bs, 2 * hkv, d)), jnp.bfloat16)
    worst = 0.0
    mixed = False
    for step in range(4):
        plan = sched.step(now=float(step))
        if plan is None:
            break
        mixed |= 0 < plan.num_decode < len(plan)
        q = jnp.asarray(rng.standard_normal((plan.bucket, hq, d)), jnp.bfloat16)
        inputs = AttentionInputs.from_plan(plan)
        want = reference_attention(q, cache, inputs, scale=d**-0.5, sliding_window=window)
        want = want.astype(jnp.float32)
        got = ragged_paged_attention_gpu(q, cache, inputs, scale=d**-0.5, interpret=interpret,
                                         sliding_window=window)  # fmt: skip
        worst = max(worst, float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))))
        sched.commit(plan, np.zeros(len(plan), np.int32), now=float(step))
    tolerance = 3e-2  # bf16 KV and queries
    ok = worst <= tolerance
    kind = f"bf16{', a mixed one' if mixed else ''}"
    print(f"kernel vs reference on mixed plans ({kind}): max abs error {worst:.2e} "
          f"({'within' if ok else 'OVER'} {tolerance})")  # fmt: skip

    # 2. Decode attention against the bandwidth limit.
    per_seq = -(-ctx // bs)
    n_pages = seqs * per_seq + 1
    cache = jnp.asarray(rng.standard_normal((n_pages, bs, 2 * hkv, d)), jnp.bfloat16)
    t = -(-seqs // 16) * 16
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
    kernel = jax.jit(lambda q, c: ragged_paged_attention_gpu(
        q, c, inputs, scale=d**-0.5, interpret=interpret, sliding_window=window))  # fmt: skip
    t_kernel = median_time(kernel, q, cache, reps=reps)
    ref = jax.jit(lambda q, c: reference_attention(q, c, inputs, scale=d**-0.5,
                                                   sliding_window=window))  # fmt: skip
    t_ref = median_time(ref, q, cache, reps=max(1, reps // 4))
    model_plan = cost.Plan((1,) * seqs, (ctx,) * seqs, t, window)
    kv_bytes = seqs * model_plan.keys(0) * 2 * hkv * d * 2
    limit = kv_bytes / (args.hbm_tbs * 1e12)
    # The kernel's description at the sizes it runs with here.
    splits = default_kv_splits(t, seqs, hkv, per_seq, window, bs)
    desc = cost.ours_gpu_v2(tiling.gpu_block_q(t, seqs, hq // hkv), kv_splits=splits,
                            tile_pages=tiling.gpu_tile_pages(bs, per_seq))  # fmt: skip
    model = cost.predict(model_plan, cost.Shapes(hq, hkv, d, bs), desc, args.model_device)
    for f in (kernel, ref):
        if window is not None and not bool(jnp.isfinite(f(q, cache)[:seqs]).all()):
            print("NaN in a decode output: a page outside the window was read")
            ok = False
    span = "" if window is None else f", a window of {window}"
    print(f"decode: {seqs} seqs x {ctx} tokens{span}, {kv_bytes / 1e9:.2f} GB of KV to read")
    print(f"  {'kernel':<10} {'ms':>9} {'GB/s':>9} {'HBM':>7}   {'model ms':>9} {'model HBM':>9}"
          f"  model bound ({args.model_device})")  # fmt: skip
    print(f"  {'pallas_gpu':<10} {t_kernel * 1e3:9.3f} {kv_bytes / t_kernel / 1e9:9.1f} "
          f"{limit / t_kernel:7.1%}   {model.step_s * 1e3:9.3f} {model.hbm_fraction:9.1%}  "
          f"{model.bound}")  # fmt: skip
    print(f"  {'reference':<10} {t_ref * 1e3:9.3f} {kv_bytes / t_ref / 1e9:9.1f} "
          f"{limit / t_ref:7.1%}   {'-':>9} {'-':>9}  -")  # fmt: skip
    return {"ran": True, "ok": ok, "max_error": worst, "mixed": mixed, "kernel_s": t_kernel,
            "reference_s": t_ref, "bandwidth_share": limit / t_kernel, "model_s": model.step_s,
            "model_share": model.hbm_fraction}  # fmt: skip


def exit_code(result: dict) -> int:
    """0: ran and within tolerance; 1: a kernel beyond it; 2: no device to run on."""
    return 2 if not result["ran"] else 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(exit_code(main(sys.argv[1:])))
