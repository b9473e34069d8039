"""GPU check: kvsched's Pallas (Triton) kernel against the reference on an NVIDIA
GPU, and decode attention timed against the HBM bandwidth limit.

    python benches/gpu_check.py                  # on a machine with an NVIDIA GPU
    python benches/gpu_check.py --interpret      # tiny shapes on CPU: checks the script

1. Correctness: mixed plans (prefill chunks and decodes) made by a real
   kvsched Scheduler, bf16 KV, Llama-3-8B-like heads (32 query, 8 KV, dim 128);
   the kernel's output against the jnp reference.
2. Speed: decode only, S sequences of L cached tokens each; the kernel must read
   every K and V once, S * L * 2 * Hkv * D * 2 bytes, so the time is bounded
   below by those bytes / HBM bandwidth. The script reports the median time, the
   bytes/s it reached and that as a share of the bandwidth (`--hbm-tbs`,
   default 4.8 TB/s: an H200's HBM3e), beside the reference.
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
    ap.add_argument("--interpret", action="store_true", help="tiny shapes in the CPU interpreter")
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--hbm-tbs", type=float, default=4.8)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import kvsched
    from kvsched.engine import AttentionInputs, reference_attention
    from kvsched.engine.kernels.gpu import ragged_paged_attention_gpu

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
        num_blocks=pages, block_size=bs, max_num_seqs=8, max_batched_tokens=256,
        max_seq_len=1024 if not args.interpret else 128, long_prefill_chunk=96,
    ))  # fmt: skip
    sched.add_tenant(kvsched.TenantConfig("t"))
    for n in (5, 40, 90, 200, 17)[: 5 if not args.interpret else 3]:
        sched.submit("t", rng.integers(0, 1000, n, dtype=np.int32), 8, now=0.0)
    cache = jnp.asarray(rng.standard_normal((pages, bs, 2 * hkv, d)), jnp.bfloat16)
    worst = 0.0
    for step in range(4):
        plan = sched.step(now=float(step))
        if plan is None:
            break
        q = jnp.asarray(rng.standard_normal((plan.bucket, hq, d)), jnp.bfloat16)
        inputs = AttentionInputs.from_plan(plan)
        got = ragged_paged_attention_gpu(q, cache, inputs, scale=d**-0.5, interpret=interpret)
        want = reference_attention(q, cache, inputs, scale=d**-0.5)
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        worst = max(worst, err)
        sched.commit(plan, np.zeros(len(plan), np.int32), now=float(step))
    tolerance = 3e-2  # bf16 KV and queries
    ok = worst <= tolerance
    print(f"kernel vs reference on mixed plans (bf16): max abs error {worst:.2e} "
          f"({'within' if ok else 'OVER'} {tolerance})")  # fmt: skip

    # 2. Decode attention against the bandwidth limit.
    per_seq = -(-ctx // bs)
    n_pages = seqs * per_seq + 1
    cache = jnp.asarray(rng.standard_normal((n_pages, bs, 2 * hkv, d)), jnp.bfloat16)
    t = -(-seqs // 16) * 16
    page_indices = (1 + np.arange(seqs * per_seq, dtype=np.int32)).reshape(seqs, per_seq)
    rng.shuffle(page_indices.reshape(-1))
    inputs = AttentionInputs(
        positions=jnp.asarray(np.full(t, ctx - 1, np.int32)),
        cu_q_lens=jnp.asarray(np.minimum(np.arange(seqs + 1), seqs).astype(np.int32)),
        kv_lens=jnp.asarray(np.full(seqs, ctx, np.int32)),
        page_indices=jnp.asarray(page_indices),
        num_seqs=jnp.asarray([seqs], np.int32),
    )
    q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.bfloat16)
    kernel = jax.jit(lambda q, c: ragged_paged_attention_gpu(q, c, inputs, scale=d**-0.5,
                                                             interpret=interpret))  # fmt: skip
    ref = jax.jit(lambda q, c: reference_attention(q, c, inputs, scale=d**-0.5))
    t_kernel = median_time(kernel, q, cache, reps=reps)
    t_ref = median_time(ref, q, cache, reps=max(1, reps // 4))
    kv_bytes = seqs * ctx * 2 * hkv * d * 2
    limit = kv_bytes / (args.hbm_tbs * 1e12)
    print(f"decode: {seqs} seqs x {ctx} tokens, {kv_bytes / 1e9:.2f} GB of KV")
    print(f"  kernel    {t_kernel * 1e3:8.3f} ms  {kv_bytes / t_kernel / 1e9:8.1f} GB/s  "
          f"{limit / t_kernel:6.1%} of {args.hbm_tbs} TB/s")  # fmt: skip
    print(f"  reference {t_ref * 1e3:8.3f} ms  {kv_bytes / t_ref / 1e9:8.1f} GB/s")
    return {"ran": True, "ok": ok, "max_error": worst, "kernel_s": t_kernel,
            "reference_s": t_ref, "bandwidth_share": limit / t_kernel}  # fmt: skip


if __name__ == "__main__":
    result = main(sys.argv[1:])
    sys.exit(2 if not result["ran"] else 0 if result["ok"] else 1)
