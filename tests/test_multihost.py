"""The engine on JAX's multi-controller runtime: two local processes x 2 forced
host devices joined with jax.distributed over 127.0.0.1 (tests/multihost_check.py
is what each process runs). Every spawn has a hard timeout and its process group
is killed in a finally, so no process outlives a failure."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax")

import kvsched  # noqa: E402
from kvsched import checkpoint  # noqa: E402
from kvsched.engine import multihost as mh  # noqa: E402
from kvsched.engine.sampling import SamplingParams  # noqa: E402

SCRIPT = Path(__file__).parent / "multihost_check.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_pair(
    mode: str, out: Path, timeout: float, wait_for: tuple[int, ...] = (0, 1)
) -> tuple[list[int | None], list[str], float]:
    """Both processes of `mode`; (return codes, output tails, seconds until the
    processes `wait_for` ended). A process still running then, or at `timeout`,
    is killed (its rc None)."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs, logs = [], []
    t0 = time.monotonic()
    try:
        for pid in (0, 1):
            log = open(out / f"p{pid}.log", "w+")  # noqa: SIM115 - closed in the finally
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, str(SCRIPT), str(pid), str(port), mode, str(out)],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            ))  # fmt: skip
        rcs: list[int | None] = [None, None]
        deadline = t0 + timeout
        while time.monotonic() < deadline and any(rcs[i] is None for i in wait_for):
            rcs = [p.poll() for p in procs]
            time.sleep(0.05)
        return rcs, [_tail(log) for log in logs], time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        for log in logs:
            log.close()


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-3000:]


def read(out: Path, pid: int) -> dict:
    return json.loads((out / f"p{pid}.json").read_text())


# -- the message, without processes -----------------------------------------------------


def test_message_round_trip_and_bounded_shapes():
    ops = [mh.Op(mh.SUBMIT, {"tenant": "t", "now": 0.5}, np.arange(7, dtype=np.int32)),
           mh.Op(mh.CANCEL, {"rid": 3, "now": 0.5})]  # fmt: skip
    msg = mh.encode_message(9, 0.5, ops)
    step, now, got, stop = mh.decode_message(msg + bytes(100))  # padding is ignored
    assert (step, now, stop) == (9, 0.5, False)
    assert [(o.kind, o.meta) for o in got] == [(o.kind, o.meta) for o in ops]
    assert got[0].ints.tolist() == list(range(7))
    assert mh.decode_message(mh.encode_message(1, 0.0, [], stop=True))[3]
    # The tail beyond the inline bytes is padded to a power of two: few shapes.
    assert {mh.tail_bucket(n) for n in range(1, 65_537, 97)} == {2**k for k in range(10, 17)}
    with pytest.raises(kvsched.InternalError, match="bad magic"):
        mh.decode_message(bytes(64))


# -- one process: process 0's inputs, refused or applied ---------------------------------


def one_process(groups: list[str] | None = None, **kw) -> mh.MultiHost:
    cfg = kvsched.SchedulerConfig(num_blocks=512, block_size=4, max_num_seqs=4,
                                  max_batched_tokens=32, max_seq_len=64, max_waiting=64,
                                  overhead_reserve=0.0, kv_cache_groups=groups)  # fmt: skip
    m = mh.MultiHost(mh.SchedulerRunner(kvsched.Scheduler(cfg)), **kw)
    m.add_tenant(kvsched.TenantConfig("t"))
    return m


def test_bad_inputs_are_refused_typed_and_change_nothing():
    for bad in ({"digest_every": 0}, {"max_message_bytes": 100}, {"timeout_s": 0}):
        with pytest.raises(kvsched.InvalidConfig):
            one_process(**bad)
    m = one_process(max_message_bytes=2048)
    sched = m.runner.scheduler
    for prompt in (np.zeros((2, 3), np.int32), np.array([1.5, 2.0]), np.array([2**40])):
        with pytest.raises(kvsched.InvalidRequest):
            m.submit("t", prompt)
    with pytest.raises(kvsched.InvalidRequest, match="max_message_bytes"):
        m.submit("t", np.arange(600, dtype=np.int32))  # more than one message carries
    with pytest.raises(kvsched.InvalidRequest, match="JSON"):
        m.reconfigure(max_waiting=object())  # nothing another process could rebuild
    assert sched.live_requests == 0 and len(m._log) == 1  # the add_tenant only
    # The log fills: the next input waits for the next step, and nothing was applied.
    p = SamplingParams(max_tokens=4)
    prompt = np.arange(1, 60, dtype=np.int32)
    rids = []
    with pytest.raises(mh.InputLogFull) as e:
        for _ in range(10):
            rids.append(m.submit("t", prompt, p, now=0.0))
    assert e.value.reason == "pool_full" and isinstance(e.value, kvsched.Rejected)
    assert 1 <= len(rids) < 10 and sched.live_requests == len(rids)
    m.step(0.0)
    rids.append(m.submit("t", prompt, p, now=0.0))
    assert rids == list(range(1, len(rids) + 1)) and sched.live_requests == len(rids)
    # A refusal by the scheduler reaches the caller and is logged with its outcome
    # (every process replays it and must be refused alike).
    with pytest.raises(kvsched.UnknownTenant):
        m.submit("nobody", np.arange(1, 5, dtype=np.int32), now=0.0)
    assert m._log[-1].meta["out"] == ["UnknownTenant", "unknown_tenant"]
    m.close()
    assert m.stopped and m.step() is None
    with pytest.raises(kvsched.InvalidState, match="closed"):
        m.submit("t", np.arange(1, 5, dtype=np.int32))


def test_a_step_runs_every_logged_input_in_order_and_digests_each_step():
    m = one_process(digest_every=3)
    p = SamplingParams(max_tokens=8)
    a = m.submit("t", np.arange(1, 9, dtype=np.int32), p, now=0.0)
    m.cancel(a, now=0.0)
    b = m.submit("t", np.arange(1, 9, dtype=np.int32), p, now=0.0)
    m.update_tenant(kvsched.TenantConfig("t", weight=2.0), now=0.0)
    kinds = [op.kind for op in m._log]
    assert kinds == [mh.ADD_TENANT, mh.SUBMIT, mh.CANCEL, mh.SUBMIT, mh.UPDATE_TENANT]
    res = m.step(0.0)
    assert res is not None and res.plan.request_ids.tolist() == [b]
    assert m.timings[-1].ops == 5 and m.timings[-1].message_bytes > mh.INLINE_BYTES
    m.step(0.1)
    m.step(0.2)  # the third step: its digest check ran (one process agrees with itself)
    assert [t.digest_s > 0 for t in m.timings] == [False, False, True]
    assert m.runner.scheduler.tenant("t").weight == 2.0
    # A drain is an input too: every process stops admitting at the same step.
    m.drain(1.0)
    assert m._log[-1].kind == mh.DRAIN
    with pytest.raises(kvsched.Rejected) as e:
        m.submit("t", np.arange(1, 9, dtype=np.int32), p, now=0.3)
    assert e.value.reason == "draining"
    while m.runner.scheduler.lifecycle != "drained":
        m.step(1.0)


@pytest.mark.parametrize("groups", [None, ["full", "sliding_window:6", "sliding_window:6"]])
def test_a_follower_replaying_every_kind_of_input_stays_in_step_with_process_0(tmp_path, groups):
    """Tenant removal, reconfiguration, drain, updates and refusals as a second
    process sees them: decoded from process 0's broadcast and replayed on a
    scheduler built the same way. Every step's digest row (the replayed
    outcomes, the plan with every KV-cache group's tables, the tokens) equals
    process 0's, and so do the tenants, the knobs and how the drain ends; for a
    hybrid model too."""
    m0 = one_process(groups, digest_every=10**6)
    # The follower: the same scheduler, no input of its own (it replays process 0's
    # add_tenant("t") with the rest).
    m1 = mh.MultiHost(mh.SchedulerRunner(kvsched.Scheduler(m0.runner.scheduler.config)),
                      digest_every=10**6)  # fmt: skip
    sent: list[list[mh.Op]] = []
    broadcast = m0._broadcast

    def capture(now, stop):
        got = broadcast(now, stop)
        sent.append(got[1])  # the ops as decoded from the bytes every process receives
        return got

    m0._broadcast = capture
    ended: dict[int, list] = {0: [], 1: []}

    def step(now: float) -> None:
        res0 = m0.step(now)
        for op in sent[-1]:
            m1._replay(op)
        res1 = m1.runner.step(now)
        m1._record(res1)
        m1.step_no += 1
        assert m1._rows[-1].tolist() == m0._rows[-1].tolist(), f"step {m0.step_no - 1}"
        for pid, res in ((0, res0), (1, res1)):
            if res is not None:
                ended[pid] += [(f.request_id, f.reason, f.output_ids.tolist())
                               for f in res.events.finished]  # fmt: skip

    p = SamplingParams(max_tokens=6)
    a = {
        "tier": 1,
        "kv_floor_blocks": 8,
        "kv_cap_blocks": 200,
        "max_concurrent": 4,
        "rate_tokens_per_s": 5000.0,
        "burst_tokens": 900.5,
        "weight": 0.75,
        "max_step_tokens": 24,
        "prefix_namespace": "ns",
    }  # every knob away from its default
    m0.add_tenant(kvsched.TenantConfig("a", **a))
    m0.add_tenant(kvsched.TenantConfig("b"))
    for i in range(4):
        m0.submit("a", np.arange(1 + i, 20 + i, dtype=np.int32), p, now=0.0)
    rb = m0.submit("b", np.arange(3, 30, dtype=np.int32), p, now=0.0)
    step(0.0)
    m0.update_tenant(kvsched.TenantConfig("a", **{**a, "weight": 3.0, "max_concurrent": 5}),
                     now=0.1)  # fmt: skip
    with pytest.raises(kvsched.TenantInUse):  # refused alike on every process
        m0.remove_tenant("b")
    m0.reconfigure(max_batched_tokens=16, long_prefill_chunk=8,
                   ladder=[{"signal": "queue_depth", "engage": 50, "release": 10,
                            "action": "reject_fast"}])  # fmt: skip
    with pytest.raises(kvsched.RestartRequired):
        m0.reconfigure(num_blocks=64)
    step(0.1)
    m0.cancel(rb, now=0.2)
    step(0.2)
    m0.remove_tenant("b")  # its only request is gone: removed everywhere
    with pytest.raises(kvsched.UnknownTenant):
        m0.submit("b", np.arange(1, 5, dtype=np.int32), now=0.3)
    m0.submit("a", np.arange(40, 60, dtype=np.int32), SamplingParams(max_tokens=40), now=0.3)
    step(0.3)
    m0.drain(1.0)
    with pytest.raises(kvsched.Rejected):
        m0.submit("a", np.arange(1, 5, dtype=np.int32), now=0.4)
    for t in (0.4, 0.5, 0.6, 0.7, 0.8, 1.0):
        step(t)
    s0, s1 = m0.runner.scheduler, m1.runner.scheduler
    assert s0.lifecycle == s1.lifecycle == "drained"
    for s in (s0, s1):
        with pytest.raises(kvsched.UnknownTenant):
            s.tenant("b")
    for k in mh._TENANT_KNOBS:
        assert getattr(s1.tenant("a"), k) == getattr(s0.tenant("a"), k), k
    assert s0.tenant("a").weight == 3.0 and s0.tenant("a").max_concurrent == 5
    assert repr(s1.config) == repr(s0.config) and s0.config.max_batched_tokens == 16
    assert s0.config.ladder and s0.config.num_blocks == 512
    assert ended[1] == ended[0]
    reasons = sorted(r for _, r, _ in ended[0])
    assert reasons[0] == "cancelled" and set(reasons[1:]) == {"length"}
    # What the drain handed back, as each process would checkpoint it.
    (tmp_path / "p0").mkdir()
    (tmp_path / "p1").mkdir()
    counts = [s.checkpoint(tmp_path / f"p{i}" / "ck.jsonl") for i, s in enumerate((s0, s1))]
    assert counts[1] == counts[0] and counts[0]["in_flight"] >= 1
    records = [checkpoint.read(tmp_path / f"p{i}" / "ck.jsonl").records for i in (0, 1)]
    assert records[1] == records[0]
    handed_back = {r["request_id"] for r in records[0] if r["kind"] == "in_flight"}
    assert handed_back | {rid for rid, _, _ in ended[0]} == set(range(1, 7)), "none lost"
    m0.close()


# -- two processes ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_processes_generate_what_one_dense_process_does(tmp_path):
    """Greedy generation of a mixed workload on the tiny model sharded over 2 x 2
    devices equals the single-process dense recompute token for token, and the
    digests agree at every step."""
    rcs, logs, _ = run_pair("match", tmp_path, timeout=150)
    assert rcs == [0, 0], logs
    p0, p1 = read(tmp_path, 0), read(tmp_path, 1)
    assert p0["devices"] == 4 and p0["local_devices"] == 2
    assert p0["cache_spec"] == "P(None, None, None, 'tp', None)"
    # 4 KV heads -> 8 combined K/V heads over 4 global devices: 2 per local shard.
    assert p0["local_shards"] == [[2, 28, 4, 2, 16]] * 2
    assert p0["finished"] == p1["finished"], "every host committed the same tokens"
    assert p0["digest_checks"] == p0["steps"] == p1["digest_checks"]
    assert p0["programs"] == p0["buckets"], "nothing recompiled after warmup"
    assert p0["preempted"] > 0, "over-commit preempted (and recomputed) a request"
    assert p0["rejected"] == ["pool_full"], "over-commit refused one arrival, with its reason"

    from kvsched.engine.model import LlamaConfig, greedy_dense, init_params

    model = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4,
                        head_dim=16, ffn_dim=128)  # fmt: skip
    params = init_params(model, seed=2)
    fin, cancelled = p0["finished"], str(p0["cancelled"])
    assert set(fin) == set(p0["prompts"]), "every request ended and its ending reached host 0"
    assert any(f["cached"] > 0 for f in fin.values()), "a prefix hit"
    for rid, prompt in p0["prompts"].items():
        dense = greedy_dense(params, model, prompt, p0["max_tokens"])
        if rid == cancelled:
            assert fin[rid]["reason"] == "cancelled"
            assert fin[rid]["out"] == dense[: len(fin[rid]["out"])]
        else:
            assert fin[rid]["reason"] == "length"
            assert fin[rid]["out"] == dense, f"request {rid}"


@pytest.mark.subprocess
def test_a_perturbed_input_is_caught_at_the_next_digest_check_on_both_hosts(tmp_path):
    rcs, logs, _ = run_pair("desync", tmp_path, timeout=60)
    assert rcs == [0, 0], logs
    for pid in (0, 1):
        r = read(tmp_path, pid)
        assert r["error"] == "HostsDiverged" and r["is_internal"], r
        # The third submit (step 5) carried a different first token on process 1:
        # its prefill is planned at step 5, checked with steps 4-7.
        assert (r["step"], r["field"]) == (5, "token_ids"), r


@pytest.mark.subprocess
@pytest.mark.parametrize("kind", ["kill", pytest.param("stall", marks=pytest.mark.slow)])
def test_a_lost_peer_ends_host_0_with_an_error_and_a_checkpoint(tmp_path, kind):
    rcs, logs, seconds = run_pair(kind, tmp_path, timeout=60, wait_for=(0,))
    if kind == "kill":
        assert rcs[1] == -signal.SIGKILL, logs[1]
    # Process 0 ended on its own, with the peer-lost status and one clear line.
    assert rcs[0] == mh.EXIT_PEER_LOST, logs[0]
    assert "kvsched multihost: step" in logs[0] and "checkpoint written" in logs[0], logs[0]
    assert seconds < 45, "within the watchdog's timeout (4 s) and start-up"
    ck = checkpoint.read(tmp_path / "checkpoint.jsonl")
    in_flight = [r for r in ck.records if r["kind"] == "in_flight"]
    assert len(in_flight) == 5 and all(r["generated_ids"] for r in in_flight)


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_peer_lost_inside_the_sharded_model_step_ends_host_0_with_a_checkpoint(tmp_path):
    rcs, logs, seconds = run_pair("kill-model", tmp_path, timeout=150, wait_for=(0,))
    assert rcs[1] == -signal.SIGKILL, logs[1]
    assert rcs[0] == mh.EXIT_PEER_LOST, logs[0]
    # Overlapped, the model step is dispatched and its all-reduces awaited at
    # the next blocking collective: the model step's own wait or the digest
    # check that follows it (every step here).
    failed = re.search(r"step 1[01]: (model step|digest check) failed", logs[0])
    assert failed and "checkpoint written" in logs[0], logs[0]
    ck = checkpoint.read(tmp_path / "checkpoint.jsonl")
    assert any(r["kind"] == "in_flight" and r["generated_ids"] for r in ck.records)
