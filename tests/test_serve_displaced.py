"""A request a higher tier displaces, as the official openai client sees it.

The server's live-request cap (max_num_seqs + max_waiting) is full of a lower
tier's requests; a tier-0 request then takes the place of the lower tier's newest
queued one. That one was admitted and is now refused after the fact: its client
must hear so (429, code "shed", Retry-After), streamed or not, never a 200 with
an empty answer that looks complete.
"""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("jax")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from test_serve_openai import CONTEXT, PROMPT, Running  # noqa: E402

from kvsched.serve import AsyncEngine  # noqa: E402
from kvsched.serve.server import OpenAIServer, load_model  # noqa: E402
from kvsched.serve.tenants import TenantRegistry, parse_tenants  # noqa: E402

TENANTS = {"tenant": [
    {"name": "gold", "api_key": "sk-gold", "tier": 0},
    {"name": "low", "api_key": "sk-low", "tier": 1},
]}  # fmt: skip
LONG = CONTEXT - len(PROMPT)


@pytest.fixture
def server():
    # Two running places and one waiting place: three live requests at most,
    # with pages for four at full length (the pool is not the limit here).
    m = load_model("tiny", max_seq_len=CONTEXT, max_num_seqs=2, max_batched_tokens=64,
                   max_waiting=1, num_blocks=4 * (CONTEXT // 16) + 1)  # fmt: skip
    eng = AsyncEngine(m.engine)
    eng.start()
    running = Running(OpenAIServer(eng, TenantRegistry(parse_tenants(TENANTS)),
                                   model_name=m.model_name, aliases=m.aliases))  # fmt: skip
    # No ladder: with one waiting place it would shed the low tier at the door,
    # and this test is about a request refused after it was admitted.
    running.server.scheduler.reconfigure(ladder=[])
    yield running
    running.stop()


def wait_for(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_displaced_request_is_told_with_a_429_and_retry_after(server, stream):
    sched = server.server.scheduler

    async def go():
        async with server.async_client("sk-low") as low, server.async_client("sk-gold") as gold:
            await displace(low, gold)

    async def displace(low, gold):
        # Two long low-tier streams take both running places...
        running = []
        for _ in range(2):
            s = await low.completions.create(model="tiny", prompt=PROMPT, max_tokens=LONG,
                                             stream=True)  # fmt: skip
            async for _ in s:
                break
            running.append(s)

        # ...and a third low-tier request waits in the only waiting place.
        async def queued():
            if not stream:
                return await low.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
            s = await low.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                             stream=True)  # fmt: skip
            return [chunk async for chunk in s]

        waiting = asyncio.create_task(queued())
        await asyncio.to_thread(wait_for, lambda: sched.stats()["live_requests"] == 3)
        assert sched.stats()["displaced"] == 0

        # Gold's request is admitted in the waiting one's place.
        answer = asyncio.create_task(
            gold.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        )
        if stream:
            with pytest.raises(openai.APIError) as e:
                await waiting
            assert e.value.code == "shed"
            assert e.value.body["retry_after"] > 0
        else:
            with pytest.raises(openai.RateLimitError) as e:
                await waiting
            assert e.value.code == "shed"
            assert int(e.value.response.headers["retry-after"]) >= 1
        assert sched.stats()["displaced"] == 1
        for s in running:
            await s.close()
        got = await answer
        assert got.usage.completion_tokens == 2
        assert got.choices[0].finish_reason == "length"

    asyncio.run(go())
    assert sum(sched.stats()["tenants"]["gold"]["rejected"].values()) == 0
