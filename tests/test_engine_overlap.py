"""Overlapped scheduling through the engine: every request gets the same
tokens, logprobs and endings with overlap on (the default) as with it off.

Each workload runs twice, `Engine(overlap=False)` and `overlap=True`: greedy
and seeded sampled rows side by side, logprobs, stop tokens (known one step
late overlapped), over-commit preemption, a cancel while a step is in flight,
a drain deadline; stop strings on the real model.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("jax")

import kvsched  # noqa: E402
from kvsched.engine.model import LlamaConfig, init_params  # noqa: E402
from kvsched.engine.runner import Engine  # noqa: E402
from kvsched.engine.sampling import SamplingParams  # noqa: E402

MODEL = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                    ffn_dim=128)  # fmt: skip
PARAMS = init_params(MODEL, seed=1)
CFG = dict(num_blocks=96, block_size=4, max_num_seqs=4, max_batched_tokens=32, max_seq_len=96,
           long_prefill_chunk=8, overhead_reserve=0.0, max_waiting=16)  # fmt: skip

pytestmark = pytest.mark.slow


def engine(overlap: bool, **cfg) -> Engine:
    eng = Engine.create(MODEL, PARAMS, kvsched.SchedulerConfig(**{**CFG, **cfg}), overlap=overlap,
                        max_logprobs=3)  # fmt: skip
    eng.warmup(progress=False)
    eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
    eng.scheduler.add_tenant(kvsched.TenantConfig("low", tier=1))
    return eng


def drive(eng: Engine, jobs, *, act=None) -> dict[int, dict]:
    """Submit (tenant, prompt, params) jobs, step to the end (`act(eng, step,
    rids)` after each step, returning outputs of its own, a cancel's); per
    request: tokens, logprobs, finish reason."""
    rids = [eng.submit(t, p, sp) for t, p, sp in jobs]
    got = {r: {"tokens": [], "logprobs": [], "reason": None} for r in rids}
    step = 0
    acted = []
    while eng.scheduler.live_requests:
        res = eng.step()
        assert res is not None
        for o in [*res.outputs, *acted]:
            g = got[o.request_id]
            g["tokens"] += o.token_ids
            g["logprobs"] += [(t.token_id, round(t.logprob, 4)) for t in o.logprobs or []]
            if o.finished:
                assert g["reason"] is None, "ended twice"
                g["reason"] = o.finish_reason
        acted = act(eng, step, rids) if act is not None else []
        step += 1
    while (res := eng.step()) is not None:  # anything still in flight ends quietly
        assert all(not o.token_ids for o in res.outputs)
    assert all(g["reason"] for g in got.values()), "every request ends, and is told"
    return got


def both(jobs, act=None, **cfg) -> tuple[dict, dict]:
    serial = drive(engine(False, **cfg), jobs, act=act)
    overlapped = drive(engine(True, **cfg), jobs, act=act)
    return serial, overlapped


def jobs(n: int, seed: int = 0, **params):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        sp = SamplingParams(max_tokens=int(rng.integers(3, 20)), logprobs=2,
                            temperature=0.0 if k % 2 else 0.9, seed=k, **params)  # fmt: skip
        out.append(("t", rng.integers(1, 256, int(rng.integers(2, 30))).tolist(), sp))
    return out


def test_greedy_and_seeded_requests_get_the_same_tokens_and_logprobs():
    serial, overlapped = both(jobs(8))
    assert serial == overlapped


def test_stop_tokens_end_requests_alike_one_step_late():
    """Stop tokens a hash of the model will hit (every tenth id): overlapped,
    the step after the stop is computed and dropped, never emitted."""
    serial, overlapped = both(jobs(8, seed=3, stop_token_ids=tuple(range(0, 256, 10))))
    assert serial == overlapped
    assert any(r["reason"] == "stop" for r in serial.values()), "no stop token was hit"


def test_preempted_requests_recompute_the_same_tokens():
    """Six requests reserve 3 pages each and grow to 12: over-committed in 32
    pages, they are preempted and recomputed."""
    rng = np.random.default_rng(5)
    work = [("t", rng.integers(1, 256, 6).tolist(),
             SamplingParams(max_tokens=40, logprobs=2, temperature=0.9 * (k % 2), seed=k))
            for k in range(6)]  # fmt: skip
    preempted = []

    def act(eng, step, rids):
        preempted.append(eng.scheduler.stats()["preemptions"])
        return []

    serial, overlapped = both(work, act=act, num_blocks=33, admission="overcommit")
    assert serial == overlapped
    assert preempted[-1] > 0, "nothing was preempted"


def test_a_cancel_and_a_drain_deadline_mid_stream_end_requests_the_same_way():
    def act(eng, step, rids):
        if step == 5:
            eng.scheduler.drain(time.monotonic())  # the next step hands back the rest
        return [eng.cancel(rids[1])] if step == 3 else []

    serial, overlapped = both(jobs(6, seed=7), act=act)
    reasons = [r["reason"] for r in serial.values()]
    assert "cancelled" in reasons and "drain_deadline" in reasons
    # Overlapped, a request ended between a step's dispatch and its resolve
    # does not get that step's token: the rest is the same.
    for rid, s in serial.items():
        o = overlapped[rid]
        assert o["reason"] == s["reason"]
        assert s["tokens"][: len(o["tokens"])] == o["tokens"]
        assert len(s["tokens"]) - len(o["tokens"]) <= 1


@pytest.mark.model
def test_stop_strings_on_the_real_model_end_alike():
    from smollm2_helpers import smollm2

    gg = smollm2()
    cfg = kvsched.SchedulerConfig(num_blocks=129, block_size=16, max_num_seqs=4,
                                  max_batched_tokens=64, max_seq_len=256, long_prefill_chunk=64,
                                  overhead_reserve=0.0)  # fmt: skip
    results = []
    for overlap in (False, True):
        eng = Engine.create(gg.config, gg.params, cfg, tokenizer=gg.tokenizer,
                            eos_token_ids=(gg.eos_token_id,), overlap=overlap)  # fmt: skip
        eng.warmup(progress=False)
        eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
        qs = ["What is the capital of France?", "Name three colours.", "Count to ten."]
        texts: dict[int, list] = {}
        for q in qs:
            sp = SamplingParams(max_tokens=40, temperature=0.0, stop=(",", " is"))
            rid = eng.submit("t", gg.encode_chat([{"role": "user", "content": q}]), sp)
            texts[rid] = []
        while eng.scheduler.live_requests:
            for o in eng.step().outputs:
                texts[o.request_id].append((o.text, o.finish_reason))
        results.append(texts)
    assert results[0] == results[1]
    assert any(t[-1][1] == "stop" for t in results[0].values())
