"""The engine in its own process: `kvsched serve`'s step loop off the HTTP
front end's interpreter.

With the engine on a thread of the server's process, the step loop shares one
GIL with everything the HTTP side does (parsing, tokenizing, a server-sent
event per stream per token): at 256 streams and a 10 ms device step that left
the device idle 24-36% of the time (benches/overlap.py --parts serve). So, as
vLLM's API server and EngineCore do, the engine runs in a child process:

- **The engine process** (`run_engine_process`, spawned) loads the model,
  warms up, and runs the step loop (`_EngineCore`): it applies submits and
  cancels between steps and sends each step's `StepOutputs` to the front end
  whole, as the engine made it (columns: numpy arrays and a list of texts). Its
  own work per step is the engine's; none of it per stream. A second thread
  answers the front end's calls (a tenant's rate, a tenant change, the
  lifecycle, a drain, /metrics, the checkpoint) at once, not at the next step
  (the process switches threads every 0.5 ms, not Python's default 5 ms, so
  a call waits little for the step loop's GIL). /metrics' scheduler and
  engine-loop families are collected there, where the figures live.
- **The front end** (`EngineClient`, in the server's process) is what
  `OpenAIServer` drives in place of an `AsyncEngine`: the same `generate`,
  `RequestStream`, `start`, `shutdown`, `end_drain_now`, `stop`, `ready`,
  `live`, `stats`, and a `scheduler` that forwards the calls the server makes.
  One thread reads the engine's messages and hands a step's outputs to their
  streams in one call onto each consumer's event loop. It has the model's
  tokenizer and chat template (sent once the model has loaded, without the
  weights), not the model: it never touches JAX's devices.

The two talk over a pipe (`multiprocessing`'s, pickled messages between a
parent and the child it spawned, nothing listening on the network).

When one of them ends, so does the other, and every stream is told: the
engine process exits when the front end's end of the pipe closes (the front
end exited or was killed); the front end, when the engine process dies, ends
every open stream with finish_reason "error", refuses what is queued, and
calls `on_death` (the server then exits with status 1).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import copyreg
import dataclasses
import functools
import gc
import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import kvsched
from kvsched.engine.outputs import RequestOutput, StepOutputs
from kvsched.engine.sampling import SamplingParams
from kvsched.serve.async_engine import RequestStream, deliver
from kvsched.serve.tenants import config_fields

log = logging.getLogger("kvsched.serve")

# The scheduler's methods the front end may call (OpenAIServer, its lifecycle
# and the tenant registry: nothing else crosses).
SCHEDULER_CALLS = frozenset({"rate_wait", "charge_rate", "add_tenant", "update_tenant",
                             "remove_tenant", "tenant", "drain", "ready", "live"})  # fmt: skip
_CORE_CALLS = frozenset({"stats", "checkpoint", "metrics", "lifecycle", "live_requests",
                         "begin_drain"})  # fmt: skip


class EngineGone(RuntimeError):
    """The engine process has stopped or died: nothing more can be asked of it
    (the server answers 503 engine_down)."""


# -- what crosses the pipe -------------------------------------------------------------------


def _tenant_config(name: str, fields: dict[str, Any]) -> kvsched.TenantConfig:
    return kvsched.TenantConfig(name, **fields)


def _reduce_tenant_config(t: kvsched.TenantConfig) -> tuple[Any, ...]:
    return _tenant_config, (t.name, config_fields(t))


# A tenant's config goes to the engine (add_tenant, update_tenant) and back (tenant).
copyreg.pickle(kvsched.TenantConfig, _reduce_tenant_config)


def config_view(cfg: Any) -> SimpleNamespace:
    """A SchedulerConfig's plain settings (numbers, flags, names, lists of
    them), readable like the config: what the front end reads of it."""
    plain = (int, float, bool, str, type(None))
    out = {}
    for name in dir(cfg):
        if name.startswith("_"):
            continue
        value = getattr(cfg, name)
        if isinstance(value, plain) or (
            isinstance(value, list) and all(isinstance(v, plain) for v in value)
        ):
            out[name] = value
    out["ladder"] = bool(getattr(cfg, "ladder", None))  # its rungs stay with the engine
    return SimpleNamespace(**out)


def without_weights(fn: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """`fn` without the weights: a loader's bound `encode_chat` / `encode_prompt`
    holds its whole model (params included); the same method of a copy whose
    params are None encodes alike and pickles small."""
    if isinstance(fn, functools.partial):
        inner = without_weights(fn.func)
        assert inner is not None
        return functools.partial(inner, *fn.args, **fn.keywords)
    owner: Any = getattr(fn, "__self__", None)
    if fn is None or owner is None or not dataclasses.is_dataclass(owner):
        return fn
    if not hasattr(owner, "params") or isinstance(owner, type):
        return fn
    light: Callable[..., Any] = getattr(dataclasses.replace(owner, params=None), fn.__name__)
    return light


@dataclasses.dataclass
class EngineCard:
    """What the front end needs of the loaded model (sent once, after loading)."""

    model_name: str
    aliases: tuple[str, ...]
    tokenizer: Any
    encode_chat: Callable[..., list[int]] | None
    encode_prompt: Callable[[str], list[int]] | None
    sampling_defaults: dict[str, float]
    vocab_size: int
    model_info: dict[str, str]
    compiles: bool
    config: SimpleNamespace
    token_buckets: list[int]


class _EngineView:
    """`EngineClient.engine`: what the server reads of the Engine it does not hold."""

    def __init__(self, card: EngineCard) -> None:
        self.compiles = card.compiles
        self.model = SimpleNamespace(vocab_size=card.vocab_size)
        self._info = card.model_info

    def model_info(self) -> dict[str, str]:
        return dict(self._info)


class SchedulerProxy:
    """The engine's scheduler as the front end reads it: its config (a copy),
    and its calls forwarded to the engine process (SCHEDULER_CALLS)."""

    def __init__(self, client: EngineClient, card: EngineCard) -> None:
        self._client = client
        self.config = card.config
        self.token_buckets = list(card.token_buckets)

    @property
    def lifecycle(self) -> str:
        return str(self._client.call("lifecycle"))

    @property
    def live_requests(self) -> int:
        return int(self._client.call("live_requests"))

    def stats(self) -> dict[str, Any]:
        return dict(self._client.call("stats"))

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in SCHEDULER_CALLS:
            raise AttributeError(f"the engine process's scheduler: {name!r} is not called "
                                 "across the process boundary")  # fmt: skip
        return lambda *args, **kwargs: self._client.call(name, *args, **kwargs)


# -- the engine process ----------------------------------------------------------------------


class _WarmupStopped(Exception):
    pass


class _EngineCore:
    """The step loop in the engine process (see the module)."""

    def __init__(self, engine: Any, conn: Any, registry: Any, *,
                 idle_recheck_s: float = 0.05) -> None:  # fmt: skip
        self.engine = engine
        self.scheduler = engine.scheduler
        self.conn = conn
        self.registry = registry
        self._idle_recheck_s = idle_recheck_s
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the engine: the step, a cancel, the checkpoint
        self._wake = threading.Condition()
        self._commands: list[tuple[Any, ...]] = []
        self._open: set[int] = set()  # admitted for the front end, not yet ended
        self._start: tuple[Any, ...] | None = None
        self._stopping = False
        self._stop_warmup = False
        self.steps = 0
        self.busy_s = 0.0
        self.model_s = 0.0
        # Replies go out on their own thread: the receiving thread must never
        # block on a write (with both pipes full, each side would wait on the
        # other's reader).
        self._replies: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()

    def send(self, msg: tuple[Any, ...]) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def _send_replies(self) -> None:
        while (msg := self._replies.get()) is not None:
            try:
                self.send(msg)
            except OSError:
                return  # the front end is gone
            except Exception as e:  # noqa: BLE001 - a value that does not pickle
                with contextlib.suppress(Exception):
                    self.send(("reply", msg[1], False, RuntimeError(f"reply: {e}")))

    # The receiving thread: calls answered at once, commands queued for the loop.
    def receive(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                kind = msg[0]
                if kind == "call":
                    self._answer(msg[1], msg[2], msg[3], msg[4])
                elif kind == "stop_warmup":
                    self._stop_warmup = True
                else:
                    with self._wake:
                        if kind == "start":
                            self._start = msg
                        elif kind == "stop":
                            self._stopping = True
                        else:  # submit, cancel
                            self._commands.append(msg)
                        self._wake.notify()
        except (EOFError, OSError):
            # The front end is gone (exited, killed): nobody is left to serve.
            with self._wake:
                self._stopping = self._stop_warmup = True
                self._wake.notify()

    def _answer(self, cid: int, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            if name in _CORE_CALLS:
                value = getattr(self, "_call_" + name)(*args, **kwargs)
            elif name in SCHEDULER_CALLS:
                value = getattr(self.scheduler, name)(*args, **kwargs)
                if name == "drain":
                    with self._wake:
                        self._wake.notify()
            else:
                raise AttributeError(f"{name!r} is not an engine call")
        except BaseException as e:  # noqa: BLE001 - the caller gets it
            self._replies.put(("reply", cid, False, _portable(e)))
            return
        self._replies.put(("reply", cid, True, value))

    def _call_stats(self) -> dict[str, Any]:
        loop = {"steps": self.steps, "busy_s": self.busy_s, "model_s": self.model_s,
                "open_streams": len(self._open)}  # fmt: skip
        return {**self.scheduler.stats(), "engine_loop": loop}

    def _call_checkpoint(self, path: str) -> Any:
        with self._lock:
            return self.scheduler.checkpoint(path)

    def _call_metrics(self) -> bytes:
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry))

    def _call_lifecycle(self) -> str:
        return str(self.scheduler.lifecycle)

    def _call_begin_drain(self, deadline: float) -> str:
        """Drain until `deadline` unless a drain has begun (one call: a second
        signal's `drain(now)` cannot fall between a read and a write)."""
        if self.scheduler.lifecycle not in ("draining", "drained"):
            self.scheduler.drain(deadline)
        with self._wake:
            self._wake.notify()
        return str(self.scheduler.lifecycle)

    def _call_live_requests(self) -> int:
        return int(self.scheduler.live_requests)

    # The main thread.
    def serve(self) -> None:
        threading.Thread(target=self.receive, name="kvsched-engine-calls", daemon=True).start()
        threading.Thread(target=self._send_replies, name="kvsched-engine-replies",
                         daemon=True).start()  # fmt: skip
        with self._wake:
            while self._start is None and not self._stopping:
                self._wake.wait()
            if self._stopping or self._start is None:
                return
            warmup = bool(self._start[1])

        def progress(done: int, total: int, what: str) -> None:
            self.send(("progress", done, total, what))
            if self._stop_warmup:
                raise _WarmupStopped

        try:
            if warmup and not self.scheduler.ready():
                self.engine.warmup(progress=progress)
        except _WarmupStopped:
            self.send(("warmup_stopped",))
            return
        except BaseException as e:  # noqa: BLE001 - the front end reports it
            self.send(("warmup_failed", _portable(e)))
            return
        # Warm: what lives now lives as long as the process (see AsyncEngine).
        gc.collect()
        gc.freeze()
        self.send(("started",))
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - the front end tells every stream
            log.exception("the engine loop died")
            with contextlib.suppress(OSError):
                self.send(("died", _portable(e)))

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._commands or self._has_work()):
                    self._wake.wait()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
            idle_but_live = False
            with self._lock:
                if commands:
                    self._apply(commands)
                t0 = time.perf_counter()
                res = self.engine.step()
                if res is not None:
                    self.steps += 1
                    self.busy_s += time.perf_counter() - t0
                    self.model_s += res.model_seconds
                    outputs: StepOutputs = res.outputs
                    if len(outputs):
                        ended = outputs.finished_ids()
                        if ended:
                            self._open.difference_update(ended)
                        self.send(("step", outputs))
                    continue
                idle_but_live = self.scheduler.live_requests > 0
                if not idle_but_live and self._open:
                    # Nothing live and no ending reported: end what is open.
                    ends = [RequestOutput(rid, [], "", None, True, "cancelled")
                            for rid in self._open]  # fmt: skip
                    self._open.clear()
                    self.send(("admitted", [], ends))
            if idle_but_live:
                with self._wake:
                    if not self._commands and not self._stopping:
                        self._wake.wait(self._idle_recheck_s)

    def _apply(self, commands: list[tuple[Any, ...]]) -> None:
        """Under the engine lock, between steps: submits answered (before any
        output of theirs is sent), cancels ended."""
        replies: list[tuple[int, bool, Any]] = []
        ends: list[RequestOutput] = []
        for msg in commands:
            if msg[0] == "submit":
                _, cid, tenant, prompt_ids, params, cache_salt = msg
                try:
                    rid = self.engine.submit(tenant, prompt_ids, params, cache_salt=cache_salt)
                except BaseException as e:  # noqa: BLE001 - the caller gets it
                    replies.append((cid, False, _portable(e)))
                    continue
                self._open.add(rid)
                replies.append((cid, True, rid))
            elif msg[0] == "cancel" and msg[1] in self._open:
                rid = msg[1]
                self._open.discard(rid)
                try:
                    final = self.engine.cancel(rid)
                except kvsched.UnknownRequest:
                    final = None
                ends.append(final or RequestOutput(rid, [], "", None, True, "cancelled"))
        if replies or ends:
            self.send(("admitted", replies, ends))

    def _has_work(self) -> bool:
        return self.scheduler.live_requests > 0 or bool(self._open)


def _portable(e: BaseException) -> BaseException:
    """`e`, or a RuntimeError saying what it was when it does not pickle."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001 - any failure to cross
        return RuntimeError(f"{type(e).__name__}: {e}")
    return e


def run_engine_process(conn: Any, load: Callable[[], Any], *, log_level: str = "info") -> None:
    """The engine process's body (started by kvsched.serve.engine_spawn):
    `load()` returns (the cold Engine, its EngineCard, the Prometheus registry
    of its collectors); then the step loop until the front end says stop or
    goes away."""
    from kvsched.serve import process

    process.configure_logging(log_level)
    sys.setswitchinterval(0.0005)  # the calls' thread waits less for the step loop's GIL
    try:
        engine, card, registry = load()
    except BaseException as e:  # noqa: BLE001 - the front end reports it, with its type
        conn.send(("load_failed", _portable(e)))
        return
    conn.send(("loaded", card))
    core = _EngineCore(engine, conn, registry)
    from kvsched.metrics import EngineLoopCollector

    registry.register(EngineLoopCollector(core))
    core.serve()
    with contextlib.suppress(OSError):
        core.send(("stopped",))
    publisher = getattr(engine, "kv_event_publisher", None)
    if publisher is not None:  # the last steps' KV events go out (a second at most)
        publisher.close()
    # Nothing is left to do (the checkpoint, if any, is written): skip the
    # interpreter's teardown of JAX, which the front end would wait for.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- the front end ---------------------------------------------------------------------------


class EngineClient:
    """The engine process, driven from the server's process (see the module).
    `spawned`: the engine process and this end of its pipe, as
    kvsched.serve.engine_spawn.spawn_engine started it with a picklable
    `load` (kvsched.cli.serve's; `engine_spawn.start_engine_client` does
    both); construction returns once it has loaded, or raises what loading
    raised."""

    remote = True

    def __init__(self, spawned: tuple[Any, Any], *, checkpoint_path: str | None = None,
                 log_level: str = "info", load_timeout_s: float | None = None) -> None:  # fmt: skip
        self._proc, self._conn = spawned
        # At exit, however it comes (a failed drain, an exception), close the
        # pipe first: the engine process exits on it. (multiprocessing's own
        # exit handler, which runs after this one, would send it a SIGTERM it
        # ignores and wait for it forever.)
        atexit.register(self._at_exit)
        self.checkpoint_path = checkpoint_path
        self.on_death: Callable[[BaseException], None] | None = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the tables below
        self._ids = itertools.count(1)
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._submits: dict[int, tuple[RequestStream, asyncio.Future[int]]] = {}
        self._abandoned: set[int] = set()  # submits whose caller went away
        self._streams: dict[int, RequestStream] = {}
        self._events: queue.Queue[tuple[Any, ...]] = queue.Queue()  # start()'s
        self._started = False
        self._stopping = False
        self._closed = False  # the reader has ended: no reply will come
        self._end_drain_now = False
        self._error: BaseException | None = None
        msg = self._recv_startup(load_timeout_s)
        if msg[0] == "load_failed":
            self._proc.join(timeout=10)
            raise msg[1]
        self.card: EngineCard = msg[1]
        self.tokenizer = self.card.tokenizer
        self.engine = _EngineView(self.card)
        self.scheduler = SchedulerProxy(self, self.card)
        self._reader = threading.Thread(target=self._read, name="kvsched-engine-reader",
                                        daemon=True)  # fmt: skip
        self._reader.start()

    def _recv_startup(self, timeout_s: float | None) -> tuple[Any, ...]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self._conn.poll(0.2):
                try:
                    return tuple(self._conn.recv())
                except EOFError:
                    pass
            elif self._proc.is_alive() and (deadline is None or time.monotonic() < deadline):
                continue
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.kill()
                raise RuntimeError(f"the engine process did not load the model in {timeout_s} s")
            raise RuntimeError(f"the engine process exited while loading the model "
                               f"(exit code {self._proc.exitcode})")  # fmt: skip

    # -- the pipe ---------------------------------------------------------------------------

    def _at_exit(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.close()
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()

    def _send(self, msg: tuple[Any, ...]) -> None:
        if self._error is not None:
            raise EngineGone("the engine process is gone") from self._error
        with self._send_lock:
            self._conn.send(msg)

    def call(self, name: str, *args: Any, timeout: float | None = 30.0, **kwargs: Any) -> Any:
        """Call `name` in the engine process and wait for its answer (it is
        answered between two of the step loop's bytecodes, not after a step).
        EngineGone when the engine process has stopped, died, or not answered
        within `timeout` seconds."""
        fut = self._call_future(name, args, kwargs)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise EngineGone(f"the engine process did not answer {name!r} in {timeout} s") from None

    async def acall(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.wrap_future(self._call_future(name, args, kwargs))

    def _call_future(self, name: str, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> concurrent.futures.Future[Any]:  # fmt: skip
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        cid = next(self._ids)
        with self._lock:
            if self._error is not None:
                raise EngineGone("the engine process is gone") from self._error
            if self._closed:
                raise EngineGone("the engine process has stopped")
            self._calls[cid] = fut
        try:
            self._send(("call", cid, name, args, kwargs))
        except (OSError, RuntimeError) as e:
            with self._lock:
                self._calls.pop(cid, None)
            raise EngineGone("the engine process is gone") from e
        return fut

    def _read(self) -> None:
        """The reader thread: every message from the engine process, in order.
        It never writes to the pipe (a reader blocked on a write, with the
        engine blocked writing to it, would hang both)."""
        try:
            while True:
                msg = self._conn.recv()
                kind = msg[0]
                if kind == "step":
                    self._deliver(msg[1])
                elif kind == "admitted":
                    self._admitted(msg[1], msg[2])
                elif kind == "reply":
                    with self._lock:
                        fut = self._calls.pop(msg[1], None)
                    if fut is not None and not fut.done():  # done: its caller cancelled
                        with contextlib.suppress(concurrent.futures.InvalidStateError):
                            if msg[2]:
                                fut.set_result(msg[3])
                            else:
                                fut.set_exception(msg[3])
                elif kind == "died":
                    self._die(RuntimeError(f"the engine loop died: {msg[1]}"))
                    return
                elif kind == "stopped":
                    return
                else:  # progress, started, warmup_stopped, warmup_failed: start()'s
                    self._events.put(msg)
        except (EOFError, OSError):
            if not self._stopping:
                self._proc.join(timeout=1)
                self._die(RuntimeError(f"the engine process exited (exit code "
                                       f"{self._proc.exitcode})"))  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - no stream may wait on a dead reader
            log.exception("reading from the engine process failed")
            self._die(RuntimeError(f"reading from the engine process failed: {e!r}"))
        finally:
            self._close_reader()

    def _close_reader(self) -> None:
        """No reply will come any more: calls still waiting, and later ones,
        get EngineGone; start() hears of it."""
        with self._lock:
            self._closed = True
            calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    fut.set_exception(EngineGone("the engine process has stopped"))
        self._events.put(("closed",))

    def _admitted(self, replies: list[tuple[int, bool, Any]], ends: list[RequestOutput]) -> None:
        cancels = []
        with self._lock:
            for cid, ok, value in replies:
                entry = self._submits.pop(cid, None)
                abandoned = cid in self._abandoned
                self._abandoned.discard(cid)
                if entry is None:  # refused already (stop() emptied the table)
                    continue
                stream, fut = entry
                if ok:
                    stream.request_id = value
                    if abandoned:
                        cancels.append((stream._loop, value))
                    else:
                        self._streams[value] = stream
                    _resolve(fut, value, None)
                else:
                    _resolve(fut, None, value)
        for loop, rid in cancels:
            # Sent from the caller's loop, not this thread (see _read).
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._cancel, rid)
        self._deliver(ends)

    def _deliver(self, outputs: Any) -> None:
        """A step's outputs to their streams: one call onto each consumer's loop."""
        with self._lock:
            deliver(self._streams, outputs)

    def _die(self, error: BaseException) -> None:
        """The engine process is gone: every stream ends with "error", every
        waiting submit and call is refused, and `on_death` hears of it."""
        if self._error is not None:
            return
        self._error = error
        log.error("%s: ending every stream", error)
        self._close_all("error", lambda: EngineGone(str(error)))
        self._events.put(("died", error))
        if self.on_death is not None:
            self.on_death(error)

    def _close_all(self, reason: kvsched.FinishReason,
                   refusal: Callable[[], BaseException]) -> None:  # fmt: skip
        with self._lock:
            streams, self._streams = self._streams, {}
            submits, self._submits = self._submits, {}
            calls, self._calls = self._calls, {}
            self._abandoned.clear()
        self._deliver_to(streams, reason)
        for _stream, fut in submits.values():
            _resolve(fut, None, refusal())
        for call in calls.values():
            if not call.done():
                call.set_exception(RuntimeError("the engine process has stopped"))

    @staticmethod
    def _deliver_to(streams: dict[int, RequestStream], reason: kvsched.FinishReason) -> None:
        for rid, stream in streams.items():
            stream._deliver(RequestOutput(rid, [], "", None, True, reason))

    # -- lifecycle ----------------------------------------------------------------------

    def start(self, *, warmup: bool = True,
              progress: Callable[[int, int, str], None] | None = None) -> None:  # fmt: skip
        """Warm the engine up (in its process), then start its step loop.
        `progress(done, total, what)` hears of each part; if it raises, the
        warmup stops after the part it is on, and this raises the same."""
        if self._started:
            return
        self._send(("start", warmup))
        stopped: BaseException | None = None
        while True:
            msg = self._events.get()
            kind = msg[0]
            if kind == "progress" and progress is not None and stopped is None:
                try:
                    progress(msg[1], msg[2], msg[3])
                except BaseException as e:  # noqa: BLE001 - raised once the engine stops
                    stopped = e
                    self._send(("stop_warmup",))
            elif kind == "started":
                self._started = True
                if stopped is not None:
                    raise stopped
                return
            elif kind == "warmup_stopped":
                raise stopped or RuntimeError("the warmup was stopped")
            elif kind in ("warmup_failed", "died"):
                raise msg[1]
            elif kind == "closed":
                raise EngineGone("the engine process stopped during the warmup")

    def ready(self) -> bool:
        if not self._started or self._error is not None or self._stopping:
            return False
        try:
            return bool(self.call("ready", timeout=5))
        except RuntimeError:
            return False

    def live(self) -> bool:
        if self._error is not None or not self._proc.is_alive():
            return False
        try:
            return bool(self.call("live", timeout=5))
        except RuntimeError:
            return False

    def stats(self) -> dict[str, Any]:
        return dict(self.call("stats"))

    def metrics_text(self) -> bytes:
        """The engine process's /metrics families (scheduler, engine loop)."""
        try:
            return bytes(self.call("metrics"))
        except RuntimeError:
            return b""

    async def shutdown(self, deadline_s: float, *, now: float | None = None) -> dict[str, Any]:
        """As AsyncEngine.shutdown: drain, wait for every stream to end (the
        deadline hands back the rest), write the checkpoint, stop the engine."""
        t0 = time.monotonic() if now is None else now
        await self.acall("begin_drain", t0 + deadline_s)
        if self._end_drain_now:  # a second signal came while that call was out
            await self.acall("drain", time.monotonic())
        while self._error is None:
            if not self._streams and await self.acall("live_requests") == 0:
                break
            await asyncio.sleep(0.01)
        summary: dict[str, Any] = {"lifecycle": await self.acall("lifecycle")}
        if self.checkpoint_path is not None:
            summary["checkpoint"] = await self.acall("checkpoint", self.checkpoint_path)
        await asyncio.to_thread(self.stop)
        return summary

    def end_drain_now(self) -> None:
        if self._stopping or self._error is not None:
            return  # drained and stopped already, or gone
        self._end_drain_now = True  # shutdown() reads it after its begin_drain
        with contextlib.suppress(RuntimeError):
            if self.call("lifecycle") == "draining":
                self.call("drain", time.monotonic())

    def stop(self) -> None:
        """Stop the engine process (streams still open end as cancelled, and
        submits still waiting are refused)."""
        if not self._stopping:
            self._stopping = True
            with contextlib.suppress(OSError, RuntimeError):
                self._send(("stop",))
            self._proc.join(timeout=60)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=5)
        self._close_all("cancelled", _stopped)

    # -- requests -----------------------------------------------------------------------

    async def generate(self, tenant: str, prompt_ids: Any, params: SamplingParams | None = None,
                       *, cache_salt: str | bytes | None = None) -> RequestStream:  # fmt: skip
        """As AsyncEngine.generate: admit a request, its stream of outputs;
        kvsched.Rejected when it is refused."""
        if self._error is not None:
            raise EngineGone("the engine loop died") from self._error
        if not self._started:
            raise RuntimeError("EngineClient.start() first")
        if self._stopping:
            raise _stopped()
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, -1, len(prompt_ids), loop)  # type: ignore[arg-type]
        fut: asyncio.Future[int] = loop.create_future()
        cid = next(self._ids)
        with self._lock:
            self._submits[cid] = (stream, fut)
        ids = prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else list(prompt_ids)
        try:
            self._send(("submit", cid, tenant, ids, params, cache_salt))
        except (OSError, RuntimeError):
            with self._lock:
                self._submits.pop(cid, None)
            raise RuntimeError("the engine loop died") from self._error
        try:
            stream.request_id = await fut  # raises Rejected
        except asyncio.CancelledError:
            with self._lock:
                if cid in self._submits:
                    self._abandoned.add(cid)  # cancelled as soon as it is admitted
            if stream.request_id >= 0:
                self._cancel(stream.request_id)
            raise
        return stream

    def _cancel(self, rid: int) -> None:
        if rid >= 0:
            with contextlib.suppress(OSError, RuntimeError):
                self._send(("cancel", rid))


def _stopped() -> kvsched.Rejected:
    exc = kvsched.Rejected("the engine has stopped")
    exc.reason, exc.retry_after = "draining", None
    return exc


def _resolve(fut: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    """Settle an asyncio future from another thread (nothing if its loop closed)."""

    def settle() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    with contextlib.suppress(RuntimeError):
        fut.get_loop().call_soon_threadsafe(settle)


__all__ = [
    "EngineCard",
    "EngineClient",
    "SchedulerProxy",
    "config_view",
    "run_engine_process",
    "without_weights",
]
