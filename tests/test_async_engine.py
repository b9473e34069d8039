"""AsyncEngine: one step thread, one async stream per request. Streams end with
exactly one final item, submits from other threads and loops are safe, a
consumer that leaves frees its request, the loop sleeps when idle, refusals
map to HTTP, and shutdown ends every stream."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest

pytest.importorskip("jax")

import kvsched  # noqa: E402
from kvsched.engine.model import LlamaConfig, greedy_dense, init_params  # noqa: E402
from kvsched.engine.runner import Engine  # noqa: E402
from kvsched.engine.sampling import SamplingParams  # noqa: E402
from kvsched.serve import AsyncEngine, http_status  # noqa: E402

MODEL = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                    ffn_dim=128)  # fmt: skip
PARAMS = init_params(MODEL, seed=1)


def make(checkpoint_path=None, freeze_gc=False, **cfg) -> AsyncEngine:
    base = dict(num_blocks=160, block_size=4, max_num_seqs=4, max_batched_tokens=32,
                max_seq_len=128, long_prefill_chunk=8, overhead_reserve=0.0,
                max_waiting=16)  # fmt: skip
    eng = Engine.create(MODEL, PARAMS, kvsched.SchedulerConfig(**{**base, **cfg}))
    ae = AsyncEngine(eng, checkpoint_path=checkpoint_path, freeze_gc=freeze_gc)
    ae.start()
    eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
    return ae


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, int(rng.integers(3, 20))).tolist() for _ in range(n)]


@pytest.mark.slow
def test_concurrent_streams_each_end_once_with_the_models_tokens():
    ae = make()

    async def main():
        ps = prompts(8)
        streams = [await ae.generate("t", p, SamplingParams(max_tokens=6)) for p in ps]
        results = await asyncio.gather(*(s.collect() for s in streams))
        return ps, results

    try:
        ps, results = asyncio.run(main())
    finally:
        ae.stop()
    for p, (ids, _text, last) in zip(ps, results, strict=True):
        assert ids == greedy_dense(PARAMS, MODEL, p, 6)
        assert last.finished and last.finish_reason == "length" and last.completion_tokens == 6
    assert ae.scheduler.live_requests == 0


def test_a_step_reaches_its_streams_in_one_call_onto_their_loop():
    """Each hand-over onto a consumer's event loop wakes it through a pipe:
    the engine thread makes one per loop per step, not one per stream."""
    ae = make()
    handed: list[int] = []

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(callback, *args, **kw):
            if getattr(callback, "__name__", "") in ("_put_all", "put_nowait"):
                handed.append(len(args[0]) if args and isinstance(args[0], list) else 1)
            return real(callback, *args, **kw)

        loop.call_soon_threadsafe = counting
        streams = [await ae.generate("t", p, SamplingParams(max_tokens=6)) for p in prompts(4)]
        return await asyncio.gather(*(s.collect() for s in streams))

    try:
        results = asyncio.run(main())
    finally:
        ae.stop()
    assert all(len(ids) == 6 and last.finished for ids, _, last in results)
    assert sum(handed) == 4 * 6, "every output handed over, once"
    assert len(handed) <= ae.steps < 4 * 6, (len(handed), ae.steps)
    assert max(handed) > 1, "several streams' outputs in one hand-over"


@pytest.mark.slow
def test_submits_from_other_threads_and_their_own_loops():
    ae = make()
    out: dict[int, list[int]] = {}

    def client(i: int) -> None:
        async def one():
            s = await ae.generate("t", prompts(1, seed=i)[0], SamplingParams(max_tokens=4))
            ids, _, _ = await s.collect()
            out[i] = ids

        asyncio.run(one())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    ae.stop()
    assert sorted(out) == list(range(6))
    for i, ids in out.items():
        assert ids == greedy_dense(PARAMS, MODEL, prompts(1, seed=i)[0], 4)


@pytest.mark.slow
def test_a_consumer_that_goes_away_frees_its_request():
    ae = make()
    free_before = ae.scheduler.stats()["pool"]["free"]

    async def main():
        s = await ae.generate("t", [1, 2, 3], SamplingParams(max_tokens=120))
        first = asyncio.Event()

        async def read():
            async with s:  # leaving the block early cancels the request
                async for _ in s:
                    first.set()
                    await asyncio.sleep(0.05)  # a slow client

        task = asyncio.create_task(read())
        await first.wait()
        task.cancel()  # the client disconnected
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if ae.scheduler.live_requests == 0:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    st = ae.scheduler.stats()
    ae.stop()
    assert st["running"] == 0 and st["waiting"] == 0
    assert st["pool"]["free"] + st["pool"]["evictable"] >= free_before
    assert st["tenants"]["t"]["cancelled"] == 1


@pytest.mark.slow
def test_the_loop_sleeps_when_idle_and_wakes_on_submit():
    ae = make()
    time.sleep(0.3)
    steps = ae.steps
    time.sleep(0.3)
    assert ae.steps == steps, "no step runs while nothing is live"

    async def main():
        s = await ae.generate("t", [1, 2, 3], SamplingParams(max_tokens=3))
        return await s.collect()

    ids, _, _ = asyncio.run(main())
    ae.stop()
    assert len(ids) == 3 and ae.steps > steps


def test_freeze_gc_freezes_what_is_alive_once_warm_and_only_when_asked():
    """kvsched serve's AsyncEngine(freeze_gc=True): once warm, before the step
    loop runs, what is alive is frozen (the collector stops scanning it);
    the default leaves the collector alone (a custom server's choice)."""
    import gc

    gc.unfreeze()
    try:
        plain = make()
        assert gc.get_freeze_count() == 0, "not asked: nothing frozen"
        plain.stop()
        ae = make(freeze_gc=True)
        assert gc.get_freeze_count() > 0
        ae.stop()
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual


@pytest.mark.slow
def test_refusals_raise_rejected_and_map_to_http():
    ae = make(max_waiting=0, max_num_seqs=1)

    async def main():
        first = await ae.generate("t", [1, 2, 3], SamplingParams(max_tokens=50))
        with pytest.raises(kvsched.Rejected) as e:
            await ae.generate("t", [4, 5, 6], SamplingParams(max_tokens=5))
        await first.cancel()
        return e.value

    err = asyncio.run(main())
    ae.stop()
    assert err.reason == "concurrency"
    status, _headers = http_status(err)
    assert status == 429
    cases = {"rate_limited": 429, "tenant_budget": 429, "pool_full": 429, "shed": 429,
             "draining": 503, "not_ready": 503, "invalid": 400, "too_long": 400,
             "unknown_tenant": 404}  # fmt: skip
    for reason, code in cases.items():
        exc = kvsched.Rejected("x")
        exc.reason, exc.retry_after = reason, 2.2
        assert http_status(exc) == (code, {"Retry-After": "3"})
    exc = kvsched.Rejected("x")
    exc.reason, exc.retry_after = "too_long", None
    assert http_status(exc) == (400, {})


@pytest.mark.slow
def test_shutdown_ends_every_stream_and_writes_the_checkpoint(tmp_path):
    path = tmp_path / "ckpt.jsonl"
    ae = make(checkpoint_path=str(path))

    async def main():
        short = await ae.generate("t", [1, 2, 3], SamplingParams(max_tokens=2))
        longs = [await ae.generate("t", p, SamplingParams(max_tokens=100)) for p in prompts(2)]
        ids, _, _ = await short.collect()
        assert len(ids) == 2
        firsts = [await s.__anext__() for s in longs]  # both are running
        summary = await ae.shutdown(0.0)  # the deadline is now: hand the rest back
        with pytest.raises(kvsched.Rejected) as e:
            await ae.generate("t", [1], SamplingParams(max_tokens=1))
        finals = [(await s.collect())[2] for s in longs]
        assert all(not f.finished for f in firsts)
        return summary, finals, e.value

    summary, finals, refused = asyncio.run(main())
    assert refused.reason == "draining"
    assert [f.finish_reason for f in finals] == ["drain_deadline"] * 2
    assert summary["lifecycle"] == "drained"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert records, "the checkpoint holds what was handed back"


@pytest.mark.slow
def test_the_loop_reports_its_step_and_model_time_to_prometheus():
    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    from kvsched.metrics import EngineLoopCollector

    ae = make()

    async def main():
        s = await ae.generate("t", [1, 2, 3], SamplingParams(max_tokens=5))
        await s.collect()

    asyncio.run(main())
    ae.stop()
    registry = CollectorRegistry()
    registry.register(EngineLoopCollector(ae))
    from prometheus_client import generate_latest

    values = {s.name: s.value for f in text_string_to_metric_families(generate_latest(registry)
              .decode()) for s in f.samples}  # fmt: skip
    assert values["kvsched_engine_steps_total"] == ae.steps >= 5
    assert 0 < values["kvsched_engine_model_seconds_total"] <= values[
        "kvsched_engine_step_seconds_total"]  # fmt: skip


def test_a_reader_that_falls_behind_gets_what_waits_merged():
    """`RequestStream.coalesced()`: outputs already queued when one is read
    come as one (tokens, text and logprobs in order, the last one's ending
    and counts); a reader that keeps up gets them one by one; cancelling
    the reader cancels the request, as plain iteration does."""
    from kvsched.engine.outputs import RequestOutput, TokenLogprob
    from kvsched.serve.async_engine import RequestStream

    class Owner:
        cancelled: list[int] = []

        def _cancel(self, rid: int) -> None:
            self.cancelled.append(rid)

    def out(tok, text, *, lp=None, done=False, n=0):
        return RequestOutput(7, [tok], text, lp, done, "length" if done else None, 3, n)

    async def run() -> None:
        owner = Owner()
        stream = RequestStream(owner, 7, 3, asyncio.get_running_loop())  # type: ignore[arg-type]
        lp = [TokenLogprob(11, -0.5, [(11, -0.5)])]
        for o in (out(10, "a", n=1), out(11, "b", lp=lp, n=2), out(12, "c", n=3)):
            stream._queue.put_nowait(o)
        reader = stream.coalesced()
        first = await reader.__anext__()
        assert (first.token_ids, first.text, first.completion_tokens) == ([10, 11, 12], "abc", 3)
        assert first.logprobs == lp and not first.finished
        stream._queue.put_nowait(out(13, "d", n=4))
        second = await reader.__anext__()
        assert second.token_ids == [13]  # nothing waited: one output, unmerged
        stream._queue.put_nowait(out(14, "e", n=5))
        stream._queue.put_nowait(out(15, "", done=True, n=6))
        last = await reader.__anext__()
        assert last.token_ids == [14, 15] and last.finished and last.finish_reason == "length"
        assert stream.finished and stream.finish_reason == "length"
        with pytest.raises(StopAsyncIteration):
            await reader.__anext__()
        # A reader cancelled while waiting cancels its request.
        other = RequestStream(owner, 8, 3, asyncio.get_running_loop())  # type: ignore[arg-type]
        task = asyncio.ensure_future(other.coalesced().__anext__())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert owner.cancelled == [8]

    asyncio.run(run())
