"""A tiny random Gemma 3 through the whole engine (the scheduler's KV-cache
groups, its plans, the runner's jitted step): greedy generation equals the
dense oracle, with chunked prefill smaller than the window and prefix-cache
hits longer than it, in KV-cache groups and in the uniform baseline."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")

from gemma3_helpers import tiny_gemma3  # noqa: E402

import kvsched  # noqa: E402
from kvsched.engine.model import greedy_dense, init_params  # noqa: E402
from kvsched.engine.runner import Engine  # noqa: E402

MODEL = tiny_gemma3(vocab_size=256)  # window 8, layers 2 and 5 global
PARAMS = init_params(MODEL, seed=1)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, 40).tolist()
    return [base, base[:36] + rng.integers(0, 256, 6).tolist(),
            base + rng.integers(0, 256, 3).tolist(), rng.integers(0, 256, 25).tolist()]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kv_groups", ["hybrid", "uniform"])
def test_the_engine_generates_the_dense_oracles_tokens(kv_groups):
    cfg = kvsched.SchedulerConfig(num_blocks=96, block_size=4, max_num_seqs=4,
                                  max_batched_tokens=32, max_seq_len=96, long_prefill_chunk=6,
                                  overhead_reserve=0.0, max_waiting=8)  # fmt: skip
    eng = Engine.create(MODEL, PARAMS, cfg, backend="reference", kv_groups=kv_groups)
    want_groups = ("full",) + ("sliding_window:8",) * 2 if kv_groups == "hybrid" else ("full",)
    assert eng.group_layout.groups == want_groups
    eng.warmup(progress=False)
    eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
    out: dict[int, list[int]] = {}
    order = []
    for p in _prompts():  # one after another: the later ones hit the cache
        order.append(eng.scheduler.submit("t", np.asarray(p, np.int32), 10, now=0.0))
        while eng.scheduler.live_requests:
            for f in eng.step(now=0.0).events.finished:
                out[f.request_id] = f.output_ids.tolist()
    want = [greedy_dense(PARAMS, MODEL, p, 10) for p in _prompts()]
    assert [out[r] for r in order] == want
    hits = eng.scheduler.stats()["tenants"]["t"]["prefix_cache"]["hit_tokens"]
    assert hits > 2 * MODEL.sliding_window  # hits reach past the window
