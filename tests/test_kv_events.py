"""KV events (issue 31 §1): the prefix cache's changes in vLLM's wire format,
read back by an independent decoder (tests/kv_event_reader.py), must rebuild
exactly the blocks the core holds, with the right tokens, through evictions,
preemption, tenant namespaces, salts, a removed tenant and hybrid groups."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from kv_event_reader import Replica

import kvsched

from serve_helpers import free_ports

BLOCK = 4
SHARED_PREFIX = list(range(100, 100 + 3 * BLOCK + 1))  # a system prompt many requests start with


def _scheduler(
    admission: str, groups: list[str] | None, partition: str = "shared"
) -> kvsched.Scheduler:
    cfg = kvsched.SchedulerConfig(
        num_blocks=48, block_size=BLOCK, max_num_seqs=6, max_batched_tokens=24,
        admission=admission, kv_cache_groups=groups, vocab_size=1000,
        prefix_cache_partition=partition,
    )  # fmt: skip
    s = kvsched.Scheduler(cfg)
    for name, ns in (("a", None), ("b", None), ("c", "team"), ("d", "team"), ("e", None)):
        s.add_tenant(kvsched.TenantConfig(name, prefix_namespace=ns))
    return s


def _run(s: kvsched.Scheduler, seed: int, steps: int = 400) -> tuple[Replica, dict[int, list[int]]]:
    """A random workload; every step's batch applied to a Replica as it is drained."""
    rng = random.Random(seed)
    replica = Replica(BLOCK)
    tokens: dict[int, list[int]] = {}  # request -> prompt and tokens so far
    live: dict[int, str] = {}
    removed_e = False
    for step in range(steps):
        if rng.random() < 0.5 and len(live) < 10:
            tenant = rng.choice("abcd" + ("" if step >= steps // 2 else "e"))
            prompt = SHARED_PREFIX + [rng.randrange(1000) for _ in range(rng.randrange(0, 9))]
            if rng.random() < 0.3:  # a follow-up turn: an earlier request's whole text
                done = [t for t in tokens.values() if len(t) > len(SHARED_PREFIX)]
                if done:
                    prompt = rng.choice(done) + [rng.randrange(1000)]
            salt = "secret" if rng.random() < 0.1 else None
            try:
                rid = s.submit(tenant, np.asarray(prompt, np.int32), rng.randrange(1, 40),
                               cache_salt=salt)  # fmt: skip
            except kvsched.Rejected:
                pass
            else:
                tokens[rid], live[rid] = list(prompt), tenant
        if step >= steps // 2 and not removed_e and not any(t == "e" for t in live.values()):
            s.remove_tenant("e")  # its parked blocks are forgotten: BlockRemoved
            removed_e = True
        if rng.random() < 0.05 and live:
            s.cancel(rng.choice(list(live)))
        plan = s.step()
        if plan is not None:
            events = s.commit(plan, np.asarray([rng.randrange(1000) for _ in range(len(plan))],
                                                np.int32))  # fmt: skip
            for rid, tok in zip(events.request_ids.tolist(), events.tokens.tolist(), strict=True):
                tokens[rid].append(tok)
            for f in events.finished:
                live.pop(f.request_id, None)
        for f in s.take_finished():
            live.pop(f.request_id, None)
        batch = s.drain_kv_events(time.time())
        if batch is not None:
            replica.apply(batch)
    assert s.kv_events_pending() == (0, 0)
    assert removed_e
    return replica, tokens


@pytest.mark.parametrize(
    ("admission", "groups", "partition"),
    [("reserve", None, "shared"), ("overcommit", None, "shared"), ("reserve", None, "tenant"),
     ("overcommit", ["full", "sliding_window:6"], "shared")],
)  # fmt: skip
def test_events_rebuild_the_cached_blocks(admission: str, groups: list[str] | None,
                                          partition: str) -> None:  # fmt: skip
    preemptions = 0
    for seed in range(3):
        s = _scheduler(admission, groups, partition)
        s.enable_kv_events()
        replica, tokens = _run(s, seed)
        core = set(s.cached_blocks_on_wire())
        assert set(replica.blocks) == core
        st = s.stats()
        assert replica.cleared == 1  # the start of the stream, nothing since
        # The run cached, evicted and reused blocks (not a run of no events).
        assert replica.stored > len(core) and replica.removed > 0, (replica.stored, replica.removed)
        assert st["pool"]["cached"] == len(core)
        preemptions += st["preemptions"]
        # Every block whose chain the router saw whole holds the tokens of a
        # real request's prefix, at its place.
        texts = {tuple(t) for t in tokens.values()}
        whole = [p for p in replica.blocks.values() if p is not None]
        assert len(whole) > len(core) // 2
        for prefix in whole:
            assert any(t[: len(prefix)] == prefix for t in texts), prefix
        # Tenant e was removed with nothing running: every block of its
        # namespace it had cached went with it, each one told.
        of_e = {h for h, key in replica.extra_keys if key == ("e",)}
        assert of_e and not of_e & {h for _, h in replica.blocks}
        # A block's parent was stored before it (full attention: a window
        # group's first live block may follow one released behind the window).
        assert replica.orphans.get(0, 0) == 0, replica.orphans
        if groups is not None:
            assert replica.groups_seen == {0, 1}
    assert (preemptions > 0) == (admission == "overcommit"), preemptions


def test_namespaces_reach_the_router_as_extra_keys() -> None:
    s = _scheduler("reserve", None)
    s.enable_kv_events()
    replica = Replica(BLOCK)
    prompt = np.asarray(SHARED_PREFIX, np.int32)  # 3 full blocks and one token

    def serve(tenant: str, salt: str | None = None) -> None:
        s.submit(tenant, prompt, 1, cache_salt=salt)
        while (plan := s.step()) is not None:
            s.commit(plan, np.zeros(len(plan), np.int32))
        batch = s.drain_kv_events(time.time())
        if batch is not None:
            replica.apply(batch)

    for tenant, salt in (("a", None), ("b", None), ("c", None), ("d", None), ("a", "x")):
        serve(tenant, salt)
    keys: dict[tuple[object, ...], set[int]] = {}
    for h, key in replica.extra_keys:
        keys.setdefault(key, set()).add(h)
    names = sorted({k[0] for k in keys})
    assert names == ["a", "b", "team"]
    # a and b: the same tokens, two prefixes (other hashes); c and d share
    # "team": d's request hit c's blocks and stored nothing new.
    assert len(keys[("a",)]) == len(keys[("b",)]) == len(keys[("team",)]) == 3
    assert not keys[("a",)] & keys[("b",)]
    salted = [k for k in keys if len(k) == 2]
    assert len(salted) == 1 and salted[0][0] == "a" and isinstance(salted[0][1], int)
    assert len(replica.blocks) == 4 * 3 == len(s.cached_blocks_on_wire())


def test_events_off_and_caching_off() -> None:
    s = _scheduler("reserve", None)
    rid = s.submit("a", np.asarray(SHARED_PREFIX, np.int32), 2)
    while (plan := s.step()) is not None:
        s.commit(plan, np.zeros(len(plan), np.int32))
    assert s.drain_kv_events(1.0) is None  # never enabled: nothing recorded
    assert s.kv_events_pending() == (0, 0) and rid >= 0
    cfg = kvsched.SchedulerConfig(num_blocks=16, block_size=BLOCK, prefix_caching=False)
    off = kvsched.Scheduler(cfg)
    off.enable_kv_events()
    assert off.drain_kv_events(1.0) is None


def test_an_undrained_log_is_bounded() -> None:
    """Nobody drains: the log keeps at most its bound, then tells the router
    to forget everything (AllBlocksCleared) and goes on from there."""
    cfg = kvsched.SchedulerConfig(num_blocks=16, block_size=1, max_num_seqs=1,
                                  max_batched_tokens=64, vocab_size=1 << 16)  # fmt: skip
    s = kvsched.Scheduler(cfg)
    s.add_tenant(kvsched.TenantConfig("a"))
    s.enable_kv_events()
    rng = np.random.default_rng(0)
    for _ in range(6000):  # ~12 events each (stored and evicted blocks)
        s.submit("a", rng.integers(0, 1 << 16, 12, dtype=np.int32), 1)
        while (plan := s.step()) is not None:
            s.commit(plan, np.zeros(len(plan), np.int32))
    pending, dropped = s.kv_events_pending()
    assert pending <= 1 << 16 and dropped > 0
    replica = Replica(1, strict=False)
    replica.apply(s.drain_kv_events(2.0) or b"")
    assert replica.cleared == 1
    # What was cached after the clear is known; what was before is forgotten,
    # never wrongly credited.
    assert set(replica.blocks) <= set(s.cached_blocks_on_wire())


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.model
def test_kvsched_serve_publishes_kv_events(tmp_path):
    """`kvsched serve --kv-events PORT --kv-events-replay PORT`: a subscriber
    that listens from the start of the load sees every batch in sequence, a
    late one catches up through the replay socket from 0 and gets the same
    bytes, and the blocks its events leave are as many as the server says it
    caches; two tenants' identical prompts are two namespaces."""
    pytest.importorskip("fastapi")
    zmq = pytest.importorskip("zmq")
    httpx = pytest.importorskip("httpx")
    import urllib.request

    from serve_helpers import start_serve
    from smollm2_helpers import smollm2_file

    smollm2_file()  # the stand-in serves SmolLM2's tokenizer
    pub_port, replay_port = free_ports(2)
    toml = tmp_path / "t.toml"
    toml.write_text('[[tenant]]\nname = "red"\napi_key = "sk-red"\n'
                    '[[tenant]]\nname = "blue"\napi_key = "sk-blue"\n')  # fmt: skip
    topic = "kv@pod-0@simulated"
    proc, url = start_serve(["--model", "simulated", "--tenants", str(toml), "--sim-step-ms", "2",
                             "--max-seq-len", "512", "--num-blocks", "96",
                             "--kv-events", str(pub_port), "--kv-events-replay",
                             f"127.0.0.1:{replay_port}", "--kv-events-topic", topic],
                            cwd=tmp_path)  # fmt: skip
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        sub.connect(f"tcp://127.0.0.1:{pub_port}")
        time.sleep(0.5)  # the subscription reaches the publisher
        systems = [" ".join(f"rule {k}.{i}: answer briefly." for i in range(40)) for k in range(4)]
        with httpx.Client(base_url=f"{url}/v1", timeout=60) as client:
            for i in range(24):
                key = "sk-red" if i % 2 == 0 else "sk-blue"
                messages = [{"role": "system", "content": systems[i // 2 % 4]},
                            {"role": "user", "content": f"question {i}"}]  # fmt: skip
                r = client.post("/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                json={"model": "simulated", "max_tokens": 8,
                                      "messages": messages})  # fmt: skip
                assert r.status_code == 200, r.text
                prompt_tokens = r.json()["usage"]["prompt_tokens"]
            # What a KV-aware router asks before it routes: the prompt's tokens.
            rendered = client.post("/chat/completions/render",
                                   headers={"Authorization": f"Bearer {key}"},
                                   json={"model": "simulated", "messages": messages})  # fmt: skip
            assert rendered.status_code == 200, rendered.text
            assert client.post("/chat/completions/render", json={"model": "simulated",
                               "messages": messages}).status_code == 401  # fmt: skip
        time.sleep(0.5)  # the last steps' batches go out
        live: list[tuple[int, bytes]] = []
        while sub.poll(200):
            t, seq, payload = sub.recv_multipart()
            assert t == topic.encode()
            live.append((int.from_bytes(seq, "big"), payload))
        assert len(live) >= 10
        seqs = [s for s, _ in live]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a gap in the sequence"

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed: list[tuple[int, bytes]] = []
        while True:
            assert dealer.poll(5000), "the replay did not end"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == b"\xff" * 8:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert [s for s, _ in replayed] == list(range(len(replayed)))
        assert dict(replayed)[seqs[0]] == live[0][1] and dict(replayed)[seqs[-1]] == live[-1][1]
        assert len(replayed) == seqs[-1] + 1  # nothing published after the live subscriber's last

        replica = Replica(16)
        for _, payload in replayed:
            replica.apply(payload)
        with urllib.request.urlopen(f"{url}/metrics") as r:
            metrics = r.read().decode()
        cached = next(float(ln.split()[1]) for ln in metrics.splitlines()
                      if ln.startswith("kvsched_pool_cached_blocks"))  # fmt: skip
        assert len(replica.blocks) == cached > 0
        assert replica.removed > 0  # 96 pages: the four system prompts do not all fit
        assert {k[0] for _, k in replica.extra_keys} == {"red", "blue"}
        # The rendered ids are the ones the server cached: their whole blocks
        # are a chain the events published (the last request's, still cached).
        ids = rendered.json()["token_ids"]
        assert len(ids) == prompt_tokens
        assert tuple(ids[: len(ids) // 16 * 16]) in set(replica.blocks.values())
        assert replica.cleared == 1
    finally:
        ctx.destroy(linger=0)
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_publishes_over_zmq(overlap: bool) -> None:
    """The engine (the stand-in device, overlapped or not) drains a batch
    each step into a KvEventPublisher; a SUB socket on the other side rebuilds
    exactly the blocks the core holds once the run is over."""
    zmq = pytest.importorskip("zmq")
    from kvsched.engine.sampling import SamplingParams
    from kvsched.engine.simulated import simulated_engine
    from kvsched.serve.kv_events import KvEventPublisher

    cfg = kvsched.SchedulerConfig(num_blocks=40, block_size=BLOCK, max_num_seqs=4,
                                  max_batched_tokens=32, vocab_size=1000)  # fmt: skip
    eng = simulated_engine(cfg, 0.0, overlap=overlap)
    eng.warmup(progress=False)
    for name in ("a", "b"):
        eng.scheduler.add_tenant(kvsched.TenantConfig(name))
    (port,) = free_ports(1)
    pub = KvEventPublisher(str(port), topic="kv")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # the subscription reaches the publisher before the first batch
    eng.publish_kv_events(pub.publish)
    rng = random.Random(0)
    try:
        for i in range(40):
            prompt = SHARED_PREFIX[: rng.randrange(5, len(SHARED_PREFIX))] + [i, i + 1, i + 2]
            eng.submit("ab"[i % 2], np.asarray(prompt, np.int32), SamplingParams(max_tokens=9))
            if i % 4 == 3:
                while eng.scheduler.live_requests:
                    eng.step()
        while eng.scheduler.live_requests:
            eng.step()
        while eng.step() is not None:  # overlapped: the last plan's outputs
            pass
        pub.close()  # everything handed over is sent first
        replica, seqs = Replica(BLOCK), []
        while sub.poll(500):
            topic, seq, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            replica.apply(payload)
        assert seqs == list(range(len(seqs))) and len(seqs) > 10
        assert set(replica.blocks) == set(eng.scheduler.cached_blocks_on_wire())
        assert replica.removed > 0 and replica.cleared == 1
    finally:
        ctx.destroy(linger=0)


def test_publisher_replays_a_long_buffer_to_a_late_reader_and_never_blocks():
    """A replay longer than ZMQ's default high-water mark reaches a reader that
    starts reading late, end marker included; after close (or a dead publisher
    thread) a handover returns at once, counted as dropped."""
    zmq = pytest.importorskip("zmq")
    from kvsched.serve.kv_events import KvEventPublisher

    pub_port, replay_port = free_ports(2)
    pub = KvEventPublisher(str(pub_port), replay_address=str(replay_port), buffer_steps=5000)
    ctx = zmq.Context()
    try:
        for k in range(3000):
            pub.publish(b"batch %d" % k)
        deadline = time.monotonic() + 10
        while pub.published < 3000:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(1.0)  # the reader is late: everything waits in the queues
        got = []
        while True:
            assert dealer.poll(5000), f"the replay stopped after {len(got)} batches"
            _, seq, payload = dealer.recv_multipart()
            if seq == b"\xff" * 8:
                break
            got.append((int.from_bytes(seq, "big"), payload))
        assert [s for s, _ in got] == list(range(3000)) and got[-1][1] == b"batch 2999"
    finally:
        ctx.destroy(linger=0)
        pub.close()
    t0 = time.perf_counter()
    for _ in range(100):
        pub.publish(b"late")
    assert time.perf_counter() - t0 < 1.0 and pub.dropped == 100
