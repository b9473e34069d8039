"""Run by test_multihost.py, once per process: `python multihost_check.py PID PORT MODE OUT`.
Two processes x 2 forced host devices joined with jax.distributed over 127.0.0.1;
each writes what the test checks to OUT/p{PID}.json.

Modes:
- match: the tiny model sharded over the 4 global devices, a mixed workload
  (chunked prefill, a prefix hit, over-commit with preemption, a cancel and a
  tenant update mid-run), a digest check every step.
- desync: no model; process 1 perturbs one prompt token of the third submit;
  the digest check (every 4 steps) must raise HostsDiverged on both.
- kill / stall: no model; process 1 dies (SIGKILL) / hangs at step 5; process 0
  must exit EXIT_PEER_LOST with a checkpoint.
- kill-model: match's workload; process 1 dies at step 10 before its model
  step, so process 0 loses it inside the sharded model's collectives.
"""

import json
import os
import signal
import sys
import time

PID, PORT, MODE, OUT = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=2, process_id=PID,
                           initialization_timeout=60, heartbeat_timeout_seconds=20)  # fmt: skip

import numpy as np  # noqa: E402

import kvsched  # noqa: E402
from kvsched.engine import multihost as mh  # noqa: E402
from kvsched.engine.sampling import SamplingParams  # noqa: E402


def write(result: dict) -> None:
    with open(os.path.join(OUT, f"p{PID}.json"), "w") as f:
        json.dump(result, f)


def collect(res, finished: dict) -> None:
    if res is None:
        return
    for f in res.events.finished:
        finished[f.request_id] = {"reason": f.reason, "out": f.output_ids.tolist(),
                                  "preemptions": f.preemptions,
                                  "cached": f.cached_tokens}  # fmt: skip


def match(kill_at: int | None = None) -> None:
    from kvsched.engine.mesh import make_mesh
    from kvsched.engine.model import LlamaConfig, init_params
    from kvsched.engine.runner import Engine

    model = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4,
                        head_dim=16, ffn_dim=128)  # fmt: skip
    cfg = kvsched.SchedulerConfig(
        num_blocks=28, block_size=4, max_num_seqs=4, max_batched_tokens=32, max_seq_len=64,
        long_prefill_chunk=8, overhead_reserve=0.0, admission="overcommit", max_waiting=8,
    )  # fmt: skip
    eng = Engine.create(model, init_params(model, seed=2), cfg, mesh=make_mesh(4))
    eng.warmup(progress=False)
    m = mh.MultiHost(eng, digest_every=1, timeout_s=60,
                     checkpoint_path=os.path.join(OUT, "checkpoint.jsonl"))  # fmt: skip
    if kill_at is not None and PID == 1:
        # Process 1 dies after taking step kill_at's inputs, before its model step:
        # process 0 is then alone in the model's all-reduces.
        engine_step, steps = eng.step, [0]

        def dying_step(now=None):
            steps[0] += 1
            if steps[0] > kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return engine_step(now)

        eng.step = dying_step
    rng = np.random.default_rng(0)
    shared = rng.integers(1, 256, 16).tolist()
    prompts: dict[int, list[int]] = {}
    finished: dict[int, dict] = {}
    cancelled = -1
    p = SamplingParams(max_tokens=16)
    rejected: list[str] = []

    def submit(tenant: str, prompt: list[int], now: float) -> None:
        try:
            rid = m.submit(tenant, np.asarray(prompt, np.int32), p, now=now)
        except kvsched.Rejected as e:  # the pool is over-committed: refused, with why
            rejected.append(str(e.reason))
            return
        prompts[rid] = prompt

    step = 0
    preempted = 0
    while True:
        now = step * 0.05
        if PID == 0:
            if step == 0:
                m.add_tenant(kvsched.TenantConfig("a"))
                m.add_tenant(kvsched.TenantConfig("b"))
                submit("a", rng.integers(1, 256, 26).tolist(), now)  # chunked prefill
                submit("b", shared + rng.integers(1, 256, 5).tolist(), now)
                submit("a", rng.integers(1, 256, 9).tolist(), now)
            elif step == 4:
                submit("b", shared + rng.integers(1, 256, 7).tolist(), now)  # prefix hit
                m.update_tenant(kvsched.TenantConfig("b", weight=2.0), now=now)
            elif step == 6:
                cancelled = min(r for r in prompts if r not in finished and r != min(prompts))
                m.cancel(cancelled, now=now)
            elif step == 7:
                submit("a", rng.integers(1, 256, 14).tolist(), now)
                submit("b", rng.integers(1, 256, 12).tolist(), now)
            elif step > 7 and not eng.scheduler.live_requests:
                m.close()
        res = mh.exit_on_peer_lost(lambda: m.step(now))  # noqa: B023 - called at once
        if m.stopped:
            break
        collect(res, finished)
        if res is not None and res.plan is not None:
            preempted += len(res.plan.preempted)
        step += 1
    write({
        "devices": len(jax.devices()), "local_devices": len(jax.local_devices()),
        "cache_spec": str(eng.caches.sharding.spec),
        "local_shards": [list(s.data.shape) for s in eng.caches.addressable_shards],
        "prompts": {str(k): v for k, v in prompts.items()},
        "finished": {str(k): v for k, v in finished.items()},
        "cancelled": cancelled, "max_tokens": 16, "rejected": rejected, "steps": m.step_no,
        "digest_checks": sum(1 for t in m.timings if t.digest_s > 0),
        "preempted": preempted, "programs": eng.compiled_programs(),
        "buckets": len(eng.scheduler.token_buckets),
        "max_message": max(t.message_bytes for t in m.timings),
    })  # fmt: skip


def no_model_engine(**kw) -> mh.MultiHost:
    cfg = kvsched.SchedulerConfig(num_blocks=256, block_size=4, max_num_seqs=8,
                                  max_batched_tokens=64, max_seq_len=128,
                                  overhead_reserve=0.0)  # fmt: skip
    return mh.MultiHost(mh.SchedulerRunner(kvsched.Scheduler(cfg)), **kw)


def desync() -> None:
    submits = [0]

    def perturb(op: mh.Op) -> mh.Op:
        if op.kind == mh.SUBMIT:
            submits[0] += 1
            if submits[0] == 3:
                op.ints = op.ints.copy()
                op.ints[0] = (op.ints[0] + 1) % 256
        return op

    m = no_model_engine(digest_every=4, perturb=perturb if PID == 1 else None)
    rng = np.random.default_rng(1)
    try:
        for step in range(40):
            if PID == 0:
                if step == 0:
                    m.add_tenant(kvsched.TenantConfig("t"))
                if step in (0, 2, 5):
                    m.submit("t", rng.integers(0, 256, 12), SamplingParams(max_tokens=20),
                             now=step * 0.1)  # fmt: skip
            m.step(step * 0.1)
        write({"error": None})
    except mh.HostsDiverged as e:
        write({"error": type(e).__name__, "step": e.step, "field": e.field, "message": str(e),
               "is_internal": isinstance(e, kvsched.InternalError)})  # fmt: skip


def failure(kind: str) -> None:
    m = no_model_engine(digest_every=2, timeout_s=4.0,
                        checkpoint_path=os.path.join(OUT, "checkpoint.jsonl"))  # fmt: skip
    rng = np.random.default_rng(2)

    def loop() -> None:
        for step in range(400):
            if PID == 0 and step == 0:
                m.add_tenant(kvsched.TenantConfig("t"))
                for _ in range(5):
                    m.submit("t", rng.integers(0, 256, 10), SamplingParams(max_tokens=100),
                             now=0.0)  # fmt: skip
            if PID == 1 and step == 5:
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(600)
            m.step(step * 0.1)
            time.sleep(0.01)

    t0 = time.monotonic()
    mh.exit_on_peer_lost(loop)
    write({"error": None, "seconds": time.monotonic() - t0})


try:
    {"match": match, "kill-model": lambda: match(kill_at=10), "desync": desync,
     "kill": lambda: failure("kill"), "stall": lambda: failure("stall")}[MODE]()  # fmt: skip
except BaseException:
    # Exit at once: the runtime's shutdown barrier would wait for the peer,
    # and the peer would wait in its next collective until its watchdog fires.
    import traceback

    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
