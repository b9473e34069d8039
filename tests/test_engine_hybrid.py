"""The engine on a hybrid model (sliding-window and full-attention layers in
KV-cache groups), against the dense recompute of the same weights.

A tiny Gemma 3 (two window layers to one global, window 8, pages of 4 tokens,
prefill chunks of 8) generates past its window: chunked prefills straddle the
window's edge, window pages go back while decoding, a prefix hit resumes past
the window, and over-commit preempts and recomputes. Each generated token's
log-probabilities must be the dense model's at that position (the window
masked there), and the hybrid engine must give the uniform one's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvsched

jax = pytest.importorskip("jax")

from kvsched.engine.model import forward_dense, init_params  # noqa: E402
from kvsched.engine.model_config import Gemma3Config  # noqa: E402
from kvsched.engine.runner import Engine  # noqa: E402
from kvsched.engine.sampling import SamplingParams  # noqa: E402

WINDOW = 8
MODEL = Gemma3Config(vocab_size=97, dim=32, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=64,
                     n_layers=6, sliding_window=WINDOW, global_every=3)  # fmt: skip
TOP = 4


@pytest.fixture(scope="module")
def params():
    return init_params(MODEL, seed=3)


def engine(params, kv_groups="hybrid", **knobs) -> Engine:
    cfg = kvsched.SchedulerConfig(**{
        "num_blocks": 200, "block_size": 4, "max_num_seqs": 4, "max_batched_tokens": 32,
        "max_seq_len": 160, "long_prefill_chunk": 8, **knobs,
    })  # fmt: skip
    eng = Engine.create(MODEL, params, cfg, kv_groups=kv_groups, max_logprobs=TOP)
    eng.warmup(progress=False)
    eng.scheduler.add_tenant(kvsched.TenantConfig("a"))
    return eng


def run(eng: Engine, prompts: list[list[int]], max_tokens: int = 14) -> dict[int, dict]:
    """Submit every prompt, step until all end; per request its prompt, tokens
    and each token's top log-probabilities. Checks on the way that no window
    group holds more pages than its share of the reservation allows."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP)
    got = {eng.submit("a", p, sp): {"prompt": p, "tokens": [], "top": []} for p in prompts}
    while eng.scheduler.live_requests:
        res = eng.step()
        for o in res.outputs:
            got[o.request_id]["tokens"] += o.token_ids
            got[o.request_id]["top"] += [t.top for t in o.logprobs or []]
        pool = eng.scheduler.stats()["pool"]
        assert pool["used"] <= pool["reserved"] + pool["cached"]
    assert eng.scheduler.stats()["pool"]["used"] == 0
    return got


def check_dense(params, runs: dict[int, dict]) -> None:
    """Each generated token's top log-probabilities are the dense model's at its
    position, over the prompt and the tokens before it."""
    for r in runs.values():
        seq = r["prompt"] + r["tokens"]
        logits = forward_dense(params, MODEL, jax.numpy.asarray(seq, jax.numpy.int32))
        logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        for k, top in enumerate(r["top"]):
            row = logp[len(r["prompt"]) - 1 + k]
            want = np.argsort(-row)[:TOP]
            assert [i for i, _ in top][:2] == want[:2].tolist()
            np.testing.assert_allclose([v for _, v in top], row[[i for i, _ in top]], atol=2e-4)
        assert r["tokens"] == [int(np.argmax(logp[len(r["prompt"]) - 1 + k]))
                               for k in range(len(r["tokens"]))]  # fmt: skip


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, MODEL.vocab_size, n).tolist() for n in lengths]


@pytest.mark.slow
def test_hybrid_generation_past_the_window_is_the_dense_models(params):
    """Prompts shorter than, across and far past the window, prefilled in chunks
    of 8 that straddle its edge, decoded past it: every token's log-probabilities
    are the dense model's, and the uniform layout (every layer kept in full)
    generates the same tokens."""
    ps = prompts(3, 11, 29, 70)
    hybrid = run(engine(params), ps)
    check_dense(params, hybrid)
    uniform = run(engine(params, "uniform"), ps)
    assert [r["tokens"] for r in hybrid.values()] == [r["tokens"] for r in uniform.values()]


@pytest.mark.slow
def test_a_hybrid_engine_holds_a_fraction_of_the_uniform_pages(params):
    """The hybrid cache holds 2 slots a page (a group of two layers) where the
    uniform one holds 6, and a long request reserves its full group's pages plus
    two window groups' bounds: ceil((8 + 8 - 2) / 4) + 1 = 5 pages each."""
    h, u = engine(params), engine(params, "uniform")
    assert h.caches.shape[0] == 2 and u.caches.shape[0] == 6
    assert h.scheduler.config.kv_cache_groups == ["full", "sliding_window:8", "sliding_window:8"]
    ph = h.submit("a", prompts(100)[0], SamplingParams(max_tokens=20))
    pu = u.submit("a", prompts(100)[0], SamplingParams(max_tokens=20))
    assert h.scheduler.stats()["pool"]["reserved"] == 30 + 2 * 5
    assert u.scheduler.stats()["pool"]["reserved"] == 30
    for eng, rid in ((h, ph), (u, pu)):
        eng.cancel(rid)


@pytest.mark.slow
def test_a_prefix_hit_past_the_window_resumes_with_the_dense_models_tokens(params):
    eng = engine(params)
    p = prompts(45, seed=4)[0]
    first = run(eng, [p])
    again = run(eng, [p])
    stats = eng.scheduler.stats()["tenants"]["a"]
    # The second request hit 44 of its 45 prompt tokens (11 full blocks), past
    # the window in every group.
    assert stats["prefix_cache"]["hit_blocks"] == 11
    check_dense(params, again)
    assert [r["tokens"] for r in first.values()] == [r["tokens"] for r in again.values()]


@pytest.mark.slow
def test_preempted_hybrid_requests_recompute_the_same_tokens(params):
    """Over-committed in a pool too small for all of them, requests are preempted
    (their window pages too) and recomputed from what the cache still holds."""
    # Each reserves its prompt's pages (3 full, 3 in each window group) and one
    # more; at their final 34 tokens each would hold 9 + 2 x 5.
    eng = engine(params, num_blocks=61, admission="overcommit", max_num_seqs=4)
    runs = run(eng, prompts(10, 12, 9, 11, seed=7), max_tokens=24)
    assert eng.scheduler.stats()["preemptions"] > 0
    check_dense(params, runs)
