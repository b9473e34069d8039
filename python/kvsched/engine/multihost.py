"""The engine on JAX's multi-controller runtime: one deterministic Scheduler per
host, fed the same inputs in the same order (docs/DESIGN.md, "Beyond one host").

Every process runs this module over its own engine (an `Engine` whose mesh spans
the global devices, or a `SchedulerRunner` with no model). Process 0 admits:
its `submit`, `cancel`, tenant and knob calls apply at once to its own engine and
go into an input log with their outcome. `step(now)` broadcasts the log and
`now` from process 0 (`multihost_utils.broadcast_one_to_all`); the other
processes replay the log in order, then every process steps, runs the sharded
model and commits the same tokens. Each step's digest (the replayed outcomes,
the plan arrays, the committed tokens) is compared across processes every
`digest_every` steps; a difference raises `HostsDiverged` on every process.
Every collective runs under a watchdog: a peer that dies or stalls ends this
process with `EXIT_PEER_LOST` after process 0 has written a checkpoint.

Call order on every process: build the engine (same config, same weights),
`warmup()`, wrap it in `MultiHost`, then loop on `step()`. Process 0 calls
`close()` when done (broadcasts "stop"); the others' `step()` then returns None
and `stopped` is true.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

import kvsched
from kvsched.engine.runner import RequestOutput, StepResult
from kvsched.engine.sampling import SamplingParams

EXIT_PEER_LOST = 3  # the exit status of a process whose peer died or stalled

MAGIC = b"KVMH"
HEADER = struct.Struct("<4sIQdII")  # magic, flags, step, now, n_ops, body length
INLINE_BYTES = 512  # the first broadcast of every step: header + start of the body
MIN_TAIL_BYTES = 1024
FLAG_STOP = 1

# op kinds
SUBMIT, CANCEL, ADD_TENANT, UPDATE_TENANT, REMOVE_TENANT, RECONFIGURE, DRAIN = range(1, 8)
_OP = struct.Struct("<BII")  # kind, JSON length, int32 count

# What each step's digest covers, in the order a difference is reported.
PLAN_FIELDS = (
    "request_ids", "token_ids", "positions", "slot_mapping", "cu_q_lens", "kv_lens",
    "page_indices", "num_seqs", "logits_indices", "samples", "group_page_indices",
    "group_slot_mapping",
)  # fmt: skip
DIGEST_FIELDS = ("inputs", *PLAN_FIELDS, "sampled")


class HostsDiverged(kvsched.InternalError):
    """Two processes computed different steps (different inputs, or a bug):
    raised on every process at the digest check, naming the first step and field
    that differ. The engine must stop: its hosts no longer agree."""

    def __init__(self, step: int, field: str, processes: list[int]) -> None:
        super().__init__(
            f"hosts diverged at step {step}: field {field!r} differs between processes "
            f"{processes} (the engine stops: its schedulers no longer agree)"
        )
        self.step = step
        self.field = field
        self.processes = processes


class PeerLost(kvsched.InternalError):
    """A collective with the other processes failed or timed out: a peer died or
    stalled."""


class InputLogFull(kvsched.Rejected):
    """Process 0's input log for the next step is at `max_message_bytes`: the
    input was not applied (retry after the next step)."""


# -- the input log as bytes -------------------------------------------------------------


@dataclass
class Op:
    """One input of process 0's log: its kind, its arguments and outcome (JSON),
    and a prompt (int32) for a submit."""

    kind: int
    meta: dict[str, Any]
    ints: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, np.int32))

    def encode(self) -> bytes:
        meta = json.dumps(self.meta, separators=(",", ":"), sort_keys=True).encode()
        ints = np.ascontiguousarray(self.ints, dtype="<i4")
        return _OP.pack(self.kind, len(meta), ints.size) + meta + ints.tobytes()


def encode_message(step: int, now: float, ops: list[Op], *, stop: bool = False) -> bytes:
    body = b"".join(op.encode() for op in ops)
    flags = FLAG_STOP if stop else 0
    return HEADER.pack(MAGIC, flags, step, now, len(ops), len(body)) + body


def decode_message(data: bytes) -> tuple[int, float, list[Op], bool]:
    """(step, now, ops, stop) of an encoded message (trailing padding ignored)."""
    magic, flags, step, now, n_ops, n_body = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise PeerLost(f"input message: bad magic {magic!r} (not a kvsched message)")
    at, end, ops = HEADER.size, HEADER.size + n_body, []
    for _ in range(n_ops):
        kind, n_meta, n_ints = _OP.unpack_from(data, at)
        at += _OP.size
        meta = json.loads(data[at : at + n_meta])
        at += n_meta
        ints = np.frombuffer(data, dtype="<i4", count=n_ints, offset=at).astype(np.int32)
        at += 4 * n_ints
        ops.append(Op(kind, meta, ints))
    if at != end:
        raise PeerLost(f"input message: body of {n_body} bytes, ops read {at - HEADER.size}")
    return step, now, ops, bool(flags & FLAG_STOP)


def tail_bucket(n: int) -> int:
    """The padded size of a body's tail beyond the inline bytes: a power of two
    (at least MIN_TAIL_BYTES), so the broadcast compiles few shapes."""
    size = MIN_TAIL_BYTES
    while size < n:
        size *= 2
    return size


_TENANT_KNOBS = ("tier", "kv_floor_blocks", "kv_cap_blocks", "max_concurrent",
                 "rate_tokens_per_s", "burst_tokens", "weight", "max_step_tokens",
                 "prefix_namespace")  # fmt: skip


def _tenant_meta(cfg: kvsched.TenantConfig) -> dict[str, Any]:
    return {"name": cfg.name, "kw": {k: getattr(cfg, k) for k in _TENANT_KNOBS}}


def _tenant_of(meta: dict[str, Any]) -> kvsched.TenantConfig:
    return kvsched.TenantConfig(meta["name"], **meta["kw"])


def _outcome(exc: BaseException | None, value: Any = None) -> Any:
    """What a call ended with, comparable across processes."""
    if exc is None:
        return value
    return [type(exc).__name__, getattr(exc, "reason", None)]


# -- what is stepped --------------------------------------------------------------------


class Runner(Protocol):
    """What MultiHost drives: Engine, or SchedulerRunner."""

    scheduler: kvsched.Scheduler

    def submit(
        self,
        tenant: str,
        prompt_ids: Any,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | bytes | None = None,
        now: float | None = None,
    ) -> int: ...

    def cancel(self, request_id: int, *, now: float | None = None) -> RequestOutput | None: ...

    def step(self, now: float | None = None) -> StepResult | None: ...


class SchedulerRunner:
    """A Runner with no model: each sampled token is a function of the request id
    and the position (deterministic, the same on every process). For measuring
    the broadcast and the replay at batch sizes the tiny model cannot reach, and
    for tests of the protocol itself."""

    def __init__(self, scheduler: kvsched.Scheduler, vocab_size: int = 256) -> None:
        self.scheduler = scheduler
        self.vocab_size = vocab_size

    def submit(
        self,
        tenant: str,
        prompt_ids: Any,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | bytes | None = None,
        now: float | None = None,
    ) -> int:
        params = params or SamplingParams()
        stop = list(params.stop_token_ids) or None
        prompt = np.asarray(prompt_ids, np.int32)
        return self.scheduler.submit(tenant, prompt, params.max_tokens, stop_token_ids=stop,
                                     cache_salt=cache_salt, now=now)  # fmt: skip

    def cancel(self, request_id: int, *, now: float | None = None) -> RequestOutput | None:
        self.scheduler.cancel(request_id, now=now)
        return None

    def step(self, now: float | None = None) -> StepResult | None:
        t0 = time.perf_counter()
        plan = self.scheduler.step(now=now)
        if plan is None:
            self.scheduler.take_finished()
            return None
        n = len(plan)
        rows = plan.logits_indices[:n]
        sampled = ((plan.positions[rows].astype(np.int64) * 31 + plan.request_ids * 7)
                   % self.vocab_size).astype(np.int32)  # fmt: skip
        events = self.scheduler.commit(plan, sampled, now=now)
        return StepResult(plan, events, time.perf_counter() - t0)


# -- collectives under a watchdog ------------------------------------------------------


class _Watchdog:
    """Ends the process if a collective runs past its deadline (a peer that died
    without closing its connections, or stalls): `on_expiry` first (process 0's
    checkpoint), then a one-line error and os._exit(EXIT_PEER_LOST)."""

    def __init__(self, timeout_s: float, on_expiry: Callable[[str], None]) -> None:
        self.timeout_s = timeout_s
        self.on_expiry = on_expiry
        self._what: str | None = None
        self._deadline = 0.0
        self._cv = threading.Condition()
        threading.Thread(target=self._watch, name="kvsched-multihost-watchdog",
                         daemon=True).start()  # fmt: skip

    def arm(self, what: str) -> None:
        with self._cv:
            self._what, self._deadline = what, time.monotonic() + self.timeout_s
            self._cv.notify()

    def disarm(self) -> None:
        with self._cv:
            self._what = None

    def _watch(self) -> None:
        while True:
            with self._cv:
                while self._what is None:
                    self._cv.wait()
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                what = self._what
            msg = f"{what}: no answer from the other processes within {self.timeout_s:g} s"
            try:
                self.on_expiry(msg)
            finally:
                print(f"kvsched multihost: {msg}; exiting", file=sys.stderr, flush=True)
                os._exit(EXIT_PEER_LOST)


# -- the replicated engine ---------------------------------------------------------------


@dataclass
class StepTiming:
    """Per step: the broadcast (bytes, seconds), the replay and the digest check."""

    step: int
    message_bytes: int  # what the broadcast carried, padding included
    body_bytes: int  # the encoded inputs
    ops: int
    broadcast_s: float
    apply_s: float
    digest_s: float = 0.0


class MultiHost:
    """One replicated engine over `jax.process_count()` processes (see the module
    docstring). `runner` is this process's Engine (mesh over the global devices,
    warmed up) or SchedulerRunner; every process builds it the same way."""

    def __init__(
        self,
        runner: Runner,
        *,
        digest_every: int = 1,
        max_message_bytes: int = 1 << 20,
        timeout_s: float = 60.0,
        checkpoint_path: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] | None = None,
        perturb: Callable[[Op], Op] | None = None,
    ) -> None:
        import jax
        from jax.experimental import multihost_utils

        if digest_every < 1:
            raise kvsched.InvalidConfig(f"digest_every must be at least 1, not {digest_every}")
        if max_message_bytes < INLINE_BYTES:
            raise kvsched.InvalidConfig(f"max_message_bytes must be at least {INLINE_BYTES}")
        if not timeout_s > 0:
            raise kvsched.InvalidConfig(f"timeout_s must be positive, not {timeout_s}")
        self.runner = runner
        self.process = jax.process_index()
        self.processes = jax.process_count()
        self.digest_every = digest_every
        self.max_message_bytes = max_message_bytes
        self.checkpoint_path = checkpoint_path
        self._mu = multihost_utils
        t0 = time.monotonic()
        self.clock = clock or (lambda: time.monotonic() - t0)
        self.perturb = perturb  # a test hook: changes this process's copy of each op
        self.step_no = 0
        self.stopped = False
        self.timings: deque[StepTiming] = deque(maxlen=10_000)  # the latest steps'
        self.failed: Exception | None = None  # a divergence or a lost peer: no more steps
        self._log: list[Op] = []
        self._log_bytes = 0
        self._lock = threading.RLock()
        self._rows: list[npt.NDArray[np.int32]] = []
        self._inputs_hash = hashlib.blake2b(digest_size=8)
        self._saved = False
        self._watchdog = _Watchdog(timeout_s, self._on_lost)
        self._check_config()

    def _check_config(self) -> None:
        """Every process must run the same scheduler configuration (a pool sized
        differently plans differently): compared once, at the start."""
        cfg = repr(self.runner.scheduler.config).encode()
        row = np.asarray([self.runner.scheduler.live_requests, *_words(_hash(
            np.frombuffer(cfg, np.uint8)))], np.int64).astype(np.uint32).view(np.int32)  # fmt: skip
        every = np.asarray(self._collective("configuration check",
                                            lambda: self._mu.process_allgather(row)))  # fmt: skip
        differ = [p for p in range(every.shape[0]) if (every[p] != every[0]).any()]
        if differ:
            raise HostsDiverged(0, "scheduler config", [0, *differ])

    # -- process 0: the outside world's calls ---------------------------------------

    def _admit(self, op: Op, call: Callable[[], Any]) -> Any:
        if self.process != 0:
            raise kvsched.InvalidState(
                f"process {self.process}: only process 0 takes inputs (the others replay "
                "what it broadcasts)"
            )
        if self.stopped:
            raise kvsched.InvalidState("the multi-host engine is closed")
        with self._lock:
            try:
                size = len(op.encode()) + 64  # room for the outcome
            except (TypeError, ValueError) as e:  # json: not a plain value
                raise kvsched.InvalidRequest(
                    f"an input process 0 cannot send to the others (JSON values only): {e}"
                ) from None
            if HEADER.size + size > self.max_message_bytes:
                raise kvsched.InvalidRequest(
                    f"this input encodes to {size} bytes, more than one step's message may "
                    f"carry (max_message_bytes={self.max_message_bytes})"
                )
            if HEADER.size + self._log_bytes + size > self.max_message_bytes:
                err = InputLogFull(
                    f"this step's input log is at {self._log_bytes} of "
                    f"{self.max_message_bytes} bytes (max_message_bytes): retry after the "
                    "next step"
                )
                err.reason = "pool_full"
                raise err
            try:
                value = call()
            except kvsched.KvSchedError as exc:
                op.meta["out"] = _outcome(exc)
                self._append(op)
                raise
            op.meta["out"] = _outcome(None, value if isinstance(value, int | bool) else None)
            self._append(op)
            return value

    def _append(self, op: Op) -> None:
        self._log.append(op)
        self._log_bytes += len(op.encode())
        self._inputs_hash.update(json.dumps(op.meta["out"]).encode())

    def submit(
        self,
        tenant: str,
        prompt_ids: Any,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | bytes | None = None,
        now: float | None = None,
    ) -> int:
        """Process 0: admit a request (Engine.submit's errors); returns its id."""
        now = self.clock() if now is None else now
        prompt = np.asarray(prompt_ids)
        fits = prompt.ndim == 1 and (
            prompt.size == 0
            or (np.issubdtype(prompt.dtype, np.integer)
                and int(prompt.min()) >= -(2**31) and int(prompt.max()) < 2**31)
        )  # fmt: skip
        if not fits:  # refused before anything changes: no op in the log
            raise kvsched.InvalidRequest("prompt_ids: a 1-D sequence of integer token ids "
                                         "(int32)")  # fmt: skip
        params = params or SamplingParams()
        salt = {"hex": cache_salt.hex()} if isinstance(cache_salt, bytes) else cache_salt
        meta = {"tenant": tenant, "params": dataclasses.asdict(params), "salt": salt,
                "now": now}  # fmt: skip
        op = Op(SUBMIT, meta, prompt.astype(np.int32))
        rid: int = self._admit(op, lambda: self.runner.submit(
            tenant, op.ints, params, cache_salt=cache_salt, now=now))  # fmt: skip
        return rid

    def cancel(self, request_id: int, *, now: float | None = None) -> RequestOutput | None:
        """Process 0: cancel a request; its final output, as Engine.cancel."""
        now = self.clock() if now is None else now
        out: list[RequestOutput | None] = []

        def call() -> bool:
            out.append(self.runner.cancel(request_id, now=now))
            return out[0] is not None

        self._admit(Op(CANCEL, {"rid": request_id, "now": now}), call)
        return out[0]

    def add_tenant(self, config: kvsched.TenantConfig) -> None:
        """Process 0: Scheduler.add_tenant on every process."""
        self._admit(Op(ADD_TENANT, _tenant_meta(config)),
                    lambda: self.runner.scheduler.add_tenant(config))  # fmt: skip

    def update_tenant(self, config: kvsched.TenantConfig, *, now: float | None = None) -> None:
        """Process 0: Scheduler.update_tenant on every process."""
        now = self.clock() if now is None else now
        self._admit(Op(UPDATE_TENANT, {**_tenant_meta(config), "now": now}),
                    lambda: self.runner.scheduler.update_tenant(config, now=now))  # fmt: skip

    def remove_tenant(self, name: str) -> None:
        """Process 0: Scheduler.remove_tenant on every process."""
        self._admit(Op(REMOVE_TENANT, {"name": name}),
                    lambda: self.runner.scheduler.remove_tenant(name))  # fmt: skip

    def reconfigure(self, **knobs: Any) -> None:
        """Process 0: Scheduler.reconfigure on every process (JSON-able knobs)."""
        self._admit(Op(RECONFIGURE, {"knobs": knobs}),
                    lambda: self.runner.scheduler.reconfigure(**knobs))  # fmt: skip

    def drain(self, deadline: float) -> None:
        """Process 0: Scheduler.drain on every process (stop admitting; the step at
        or after `deadline` hands back what is unfinished, each with its ending).
        Then `close()`, and `runner.scheduler.checkpoint(path)` on process 0."""
        self._admit(Op(DRAIN, {"deadline": deadline}),
                    lambda: self.runner.scheduler.drain(deadline))  # fmt: skip

    # -- every process: replaying and stepping ----------------------------------------

    def _replay(self, op: Op) -> None:
        """Apply one op of process 0's log here, as process 0 did."""
        if self.perturb is not None:
            op = self.perturb(op)
        m, r = op.meta, self.runner
        exc: BaseException | None = None
        value: Any = None
        try:
            if op.kind == SUBMIT:
                params = SamplingParams(**m["params"])
                salt = m["salt"]
                if isinstance(salt, dict):
                    salt = bytes.fromhex(salt["hex"])
                value = r.submit(m["tenant"], op.ints, params, cache_salt=salt,
                                 now=m["now"])  # fmt: skip
            elif op.kind == CANCEL:
                value = r.cancel(m["rid"], now=m["now"]) is not None
            elif op.kind == ADD_TENANT:
                r.scheduler.add_tenant(_tenant_of(m))
            elif op.kind == UPDATE_TENANT:
                r.scheduler.update_tenant(_tenant_of(m), now=m["now"])
            elif op.kind == REMOVE_TENANT:
                r.scheduler.remove_tenant(m["name"])
            elif op.kind == RECONFIGURE:
                r.scheduler.reconfigure(**m["knobs"])
            elif op.kind == DRAIN:
                r.scheduler.drain(m["deadline"])
            else:
                raise PeerLost(f"input message: unknown op kind {op.kind}")
        except PeerLost:
            raise
        except kvsched.KvSchedError as e:
            exc = e
        # A different outcome than process 0's shows in the "inputs" digest.
        self._inputs_hash.update(json.dumps(_outcome(exc, value)).encode())

    def _collective(self, what: str, fn: Callable[[], Any]) -> Any:
        self._watchdog.arm(f"step {self.step_no}: {what}")
        try:
            return fn()
        except kvsched.KvSchedError:
            raise
        except Exception as e:  # the runtime's error for a peer gone (gloo: closed)
            msg = f"step {self.step_no}: {what} failed: {str(e).splitlines()[0][:300]}"
            self._on_lost(msg)
            raise PeerLost(msg) from e
        finally:
            self._watchdog.disarm()

    def _bcast(self, what: str, buf: npt.NDArray[np.uint8]) -> bytes:
        source = self.process == 0
        # np.asarray inside: the collective's result is awaited under the watchdog too.
        got: npt.NDArray[Any] = self._collective(
            what, lambda: np.asarray(self._mu.broadcast_one_to_all(buf, is_source=source))
        )
        return got.astype(np.uint8).tobytes()

    def _broadcast(self, now: float, stop: bool) -> tuple[float, list[Op], bool, int, int]:
        """Process 0 sends, every process receives: (now, ops, stop, bytes, body)."""
        msg = b""
        if self.process == 0:
            with self._lock:
                msg = encode_message(self.step_no, now, self._log, stop=stop)
                self._log, self._log_bytes = [], 0
        head = np.zeros(INLINE_BYTES, np.uint8)
        first = msg[:INLINE_BYTES]
        head[: len(first)] = np.frombuffer(first, np.uint8)
        data = self._bcast("input broadcast", head)
        n_body = HEADER.unpack_from(data)[5]
        rest, sent = HEADER.size + n_body - INLINE_BYTES, INLINE_BYTES
        if rest > 0:
            tail = np.zeros(tail_bucket(rest), np.uint8)
            if self.process == 0:
                tail[:rest] = np.frombuffer(msg[INLINE_BYTES:], np.uint8)
            data = data + self._bcast("input broadcast (tail)", tail)[:rest]
            sent += tail.size
        step, now, ops, stop = decode_message(data)
        if step != self.step_no:
            raise PeerLost(f"input message for step {step} received at step {self.step_no}")
        return now, ops, stop, sent, n_body

    def step(self, now: float | None = None) -> StepResult | None:
        """One step on every process (collective: all must call it). Process 0
        broadcasts its inputs and `now` (its clock when None); the others ignore
        `now`. Returns the runner's StepResult (None: nothing ran; after
        process 0's `close`, None and `stopped`)."""
        if self.failed is not None:
            raise kvsched.InvalidState(f"the multi-host engine has stopped: {self.failed}")
        if self.stopped:
            return None
        return self._step(now, stop=False)

    def close(self) -> None:
        """Process 0: tell the others to stop (their `step` returns None and
        `stopped` becomes true), after a last digest check."""
        if self.process == 0 and not self.stopped:
            self._step(None, stop=True)

    def _step(self, now: float | None, stop: bool) -> StepResult | None:
        # Process 0's inputs from other threads wait for the step to end: one
        # applied between the plan and the commit would reach the others a step
        # later than it reached this scheduler.
        with self._lock:
            try:
                return self._step_locked(now, stop)
            except (HostsDiverged, PeerLost) as e:
                self.failed = e
                raise

    def _step_locked(self, now: float | None, stop: bool) -> StepResult | None:
        t0 = time.perf_counter()
        if self.process == 0:
            now = self.clock() if now is None else now
        now, ops, stop, sent, body = self._broadcast(now or 0.0, stop)
        t1 = time.perf_counter()
        if self.process != 0:
            for op in ops:
                self._replay(op)
        t2 = time.perf_counter()
        timing = StepTiming(self.step_no, sent, body, len(ops), t1 - t0, t2 - t1)
        self.timings.append(timing)
        # The model step holds the mesh's collectives (its all-reduces): watched too.
        result = None if stop else self._collective("model step", lambda: self.runner.step(now))
        self._record(result)
        self.step_no += 1
        if stop or len(self._rows) >= self.digest_every:
            t3 = time.perf_counter()
            self._check_digests()
            timing.digest_s = time.perf_counter() - t3
        if stop:
            self.stopped = True
        return result

    def _record(self, result: StepResult | None) -> None:
        row = [self.step_no, *_words(self._inputs_hash.digest())]
        self._inputs_hash = hashlib.blake2b(digest_size=8)
        plan = None if result is None else result.plan
        for name in PLAN_FIELDS:
            row += _words(_hash(None if plan is None else getattr(plan, name)))
        row += _words(_hash(None if result is None else np.asarray(result.events.tokens)))
        self._rows.append(np.asarray(row, np.int64).astype(np.uint32).view(np.int32))

    def _check_digests(self) -> None:
        """Compare the rows since the last check with every process's; raise
        HostsDiverged (on every process: all see the same gathered rows)."""
        rows = np.full((self.digest_every, 1 + 2 * len(DIGEST_FIELDS)), -1, np.int32)
        n = min(len(self._rows), self.digest_every)
        if n:
            rows[:n] = np.stack(self._rows[-n:])
        self._rows = []
        every = np.asarray(
            self._collective("digest check", lambda: self._mu.process_allgather(rows))
        )
        if (every == every[0]).all():
            return
        for i in range(rows.shape[0]):
            for f, name in enumerate(DIGEST_FIELDS):
                col = every[:, i, 1 + 2 * f : 3 + 2 * f]
                differ = [p for p in range(every.shape[0]) if (col[p] != col[0]).any()]
                if differ:
                    raise HostsDiverged(int(every[0, i, 0]), name, [0, *differ])
        raise HostsDiverged(int(every[0, 0, 0]), "step", list(range(every.shape[0])))

    # -- failure ---------------------------------------------------------------------

    def _on_lost(self, msg: str) -> None:
        """A peer is gone: process 0 writes its checkpoint (once)."""
        if self.process != 0 or self.checkpoint_path is None or self._saved:
            return
        self._saved = True
        try:
            counts = self.runner.scheduler.checkpoint(self.checkpoint_path)
            print(f"kvsched multihost: {msg}; checkpoint written to {self.checkpoint_path} "
                  f"({counts['in_flight']} in flight)", file=sys.stderr, flush=True)  # fmt: skip
        except Exception as e:  # the error is reported, the exit follows
            print(f"kvsched multihost: {msg}; checkpoint failed: {e}", file=sys.stderr,
                  flush=True)  # fmt: skip


def _hash(arr: Any) -> bytes:
    h = hashlib.blake2b(digest_size=8)
    if arr is not None:
        a = np.ascontiguousarray(arr)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.digest()


def _words(d: bytes) -> list[int]:
    return list(struct.unpack("<II", d))


def exit_on_peer_lost(fn: Callable[[], Any]) -> Any:
    """Run `fn`; a PeerLost ends the process with EXIT_PEER_LOST and the error on
    stderr, without the runtime's shutdown barrier (which would abort waiting for
    the dead peer). For a process's main loop."""
    try:
        return fn()
    except PeerLost as e:
        print(f"kvsched multihost: {e}", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_LOST)
