"""Load through the HTTP server: 200 concurrent streams from the async openai
client, three tenants on three tiers, on the tiny model (localhost, bounded).
Every request ends with a finish reason or an HTTP error that names its reason;
tier 0 is never refused and waits least; per-tenant client-side TTFT and
inter-token times are printed (pytest -s shows them)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from test_serve_openai import Running  # noqa: E402

import kvsched  # noqa: E402
from kvsched.engine.model import LlamaConfig, init_params  # noqa: E402
from kvsched.engine.runner import Engine  # noqa: E402
from kvsched.serve import AsyncEngine  # noqa: E402
from kvsched.serve.server import OpenAIServer  # noqa: E402
from kvsched.serve.tenants import TenantRegistry, parse_tenants  # noqa: E402

TIERS = {"gold": (0, 40), "silver": (1, 80), "bronze": (2, 80)}  # tier, requests


@pytest.mark.slow
def test_two_hundred_concurrent_streams_all_end_and_tier_zero_is_never_refused():
    model = LlamaConfig()
    cfg = kvsched.SchedulerConfig(num_blocks=1200, block_size=16, max_num_seqs=16,
                                  max_batched_tokens=128, max_seq_len=128, max_waiting=256,
                                  preempt_lower_tiers=True)  # fmt: skip
    eng = AsyncEngine(Engine.create(model, init_params(model, seed=0), cfg))
    eng.start()
    tenants = [{"name": n, "api_key": f"sk-{n}", "tier": t} for n, (t, _) in TIERS.items()]
    # bronze is rate limited: some of its requests are refused with 429 + Retry-After.
    tenants[2].update(rate_tokens_per_s=300.0, burst_tokens=1500.0)
    running = Running(OpenAIServer(eng, TenantRegistry(parse_tenants({"tenant": tenants})),
                                   model_name="tiny-llama"))  # fmt: skip
    rng = np.random.default_rng(0)
    jobs = [(name, rng.integers(1, 500, int(rng.integers(8, 40))).tolist(),
             int(rng.integers(8, 40)))
            for name, (_, n) in TIERS.items() for _ in range(n)]  # fmt: skip
    rng.shuffle(jobs)

    async def one(client, name, prompt, max_tokens):
        rec = {"tenant": name, "sent": time.monotonic(), "chunks": [], "finish": None,
               "error": None}  # fmt: skip
        try:
            stream = await client.completions.create(
                model="tiny-llama", prompt=prompt, max_tokens=max_tokens, stream=True
            )
            async for chunk in stream:
                if chunk.choices:
                    rec["chunks"].append(time.monotonic())
                    rec["finish"] = chunk.choices[0].finish_reason or rec["finish"]
        except openai.APIStatusError as e:
            body = e.body if isinstance(e.body, dict) else {}
            rec["error"] = (e.status_code, body.get("code"),
                            e.response.headers.get("retry-after"))  # fmt: skip
        return rec

    async def main():
        clients = {n: openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key=f"sk-{n}",
                                         max_retries=0, timeout=120) for n in TIERS}  # fmt: skip
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(one(clients[n], n, p, m) for n, p, m in jobs)), timeout=300
            )
        finally:  # unclosed, their finalizers fail later on another test's loop
            for c in clients.values():
                await c.close()

    try:
        records = asyncio.run(main())
    finally:
        running.stop()
        eng.stop()
    assert len(records) == 200
    for r in records:
        assert r["finish"] in ("stop", "length") or r["error"] is not None, r
        if r["error"] is not None:
            status, code, retry_after = r["error"]
            assert (status, code) == (429, "rate_limited") and r["tenant"] == "bronze", r
            assert retry_after is not None and int(retry_after) >= 1
    by = {n: [r for r in records if r["tenant"] == n] for n in TIERS}
    assert all(r["error"] is None for r in by["gold"]), "tier 0 is never refused"
    assert any(r["error"] for r in by["bronze"]), "the rate limit did refuse some"
    ttft = {n: [r["chunks"][0] - r["sent"] for r in rs if r["chunks"]] for n, rs in by.items()}
    itl = {n: [b - a for r in rs for a, b in zip(r["chunks"], r["chunks"][1:], strict=False)]
           for n, rs in by.items()}  # fmt: skip
    for n in TIERS:
        print(
            f"{n:<7} ok {sum(r['error'] is None for r in by[n]):>3}/{len(by[n])}  TTFT p50/p99 "
            f"{np.percentile(ttft[n], 50):.3f}/{np.percentile(ttft[n], 99):.3f} s  ITL p50/p99 "
            f"{np.percentile(itl[n], 50) * 1e3:.1f}/{np.percentile(itl[n], 99) * 1e3:.1f} ms"
        )
    assert np.median(ttft["gold"]) < np.median(ttft["bronze"]), "tier 0 waits least"
    assert eng.scheduler.live_requests == 0
