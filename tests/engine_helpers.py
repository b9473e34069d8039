"""Real step plans with real paged KV, for the attention tests."""

from __future__ import annotations

import zlib

import numpy as np

import kvsched

jax = __import__("pytest").importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kvsched.engine import AttentionInputs, KVCacheSpec, init_cache, write_kv  # noqa: E402


def kv_of(tokens: list[int], pos: np.ndarray, hkv: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic K, V at each position, from the tokens up to it (as a causal
    model's are): equal prefixes have equal KV, so a prefix-cache hit is right."""
    out = []
    for which in (0, 1):
        rows = []
        for p in pos.tolist():
            key = zlib.crc32(np.asarray(tokens[: p + 1], np.int32).tobytes())
            rng = np.random.default_rng((key, int(p), which))
            rows.append(rng.standard_normal((hkv, d)))
        out.append(np.asarray(rows, np.float32).reshape(len(rows), hkv, d))
    return out[0], out[1]


def plans(*, hq=4, hkv=2, d=16, block_size=4, num_blocks=256, steps=8, seed=0, prompts=None,
          dtype=jnp.float32, max_num_seqs=6, max_batched_tokens=32, late=(20, 25)):  # fmt: skip
    """Yield (q, cache, inputs) for consecutive plans of a small mixed workload,
    with every scheduled token's K/V written into the cache first."""
    rng = np.random.default_rng(seed)
    sched = kvsched.Scheduler(
        kvsched.SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_batched_tokens=max_batched_tokens,
            max_seq_len=128,
            long_prefill_chunk=10,
            overhead_reserve=0.0,
            max_waiting=8,
        )  # fmt: skip
    )
    sched.add_tenant(kvsched.TenantConfig("t"))
    shared = rng.integers(0, 1000, 12, dtype=np.int32)
    tokens: dict[int, list[int]] = {}

    def submit(n: int, step: int) -> None:
        prompt = np.concatenate([shared, rng.integers(0, 1000, n, dtype=np.int32)])
        rid = sched.submit("t", prompt, 6, now=float(step))
        tokens[rid] = prompt.tolist()

    for n in prompts or (3, 17, 9, 30, 14):
        submit(n, 0)
    spec = KVCacheSpec(num_blocks, block_size, hkv, d, dtype)
    cache = init_cache(spec)
    for step in range(steps):
        if step == 4:  # later arrivals find the shared prefix cached
            for n in late:
                submit(n, step)
        plan = sched.step(now=float(step))
        if plan is None:
            return
        n_tok = plan.num_tokens
        k = np.zeros((plan.bucket, hkv, d), np.float32)
        v = np.zeros((plan.bucket, hkv, d), np.float32)
        cu = plan.cu_q_lens
        for i, rid in enumerate(plan.request_ids.tolist()):
            pos = plan.positions[cu[i] : cu[i + 1]]
            k[cu[i] : cu[i + 1]], v[cu[i] : cu[i + 1]] = kv_of(tokens[rid], pos, hkv, d)
        cache = write_kv(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(plan.slot_mapping))
        q = rng.standard_normal((plan.bucket, hq, d)).astype(np.float32)
        q[n_tok:] = 0.0
        yield jnp.asarray(q, dtype), cache, AttentionInputs.from_plan(plan), plan, tokens
        events = sched.commit(plan, np.zeros(len(plan), np.int32), now=float(step))
        for rid, tok in zip(events.request_ids.tolist(), events.tokens.tolist(), strict=True):
            tokens[rid].append(tok)
