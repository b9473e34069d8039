"""`AsyncEngine`: an `Engine` behind one background thread, with one async stream
per request.

The step loop runs on its own thread: it steps while the scheduler holds work
and sleeps on a condition when there is none (no polling), woken by the next
submit. `await generate(...)` admits a request at once (a refusal raises
`kvsched.Rejected` in the caller) and returns a `RequestStream`, an async
iterator of the request's `RequestOutput`s (new token ids, new text, logprobs)
ending in exactly one item with `finished=True` and its `finish_reason`.
Submits and cancels come from any thread or event loop and never block it: they
are queued, and the step thread applies them between two steps (so a submit
waits at most one step, without holding up the caller's event loop). The step
thread registers a request's stream in the same place it submits it, so no
output, not even a finish in the very next step, is lost. A consumer that goes away cancels its
request, which frees its pages: read the stream inside `async with stream:`
(leaving the block early cancels it), or call `await stream.cancel()`.

`shutdown(deadline_s)` stops admission (the scheduler drains), lets running
requests finish until the deadline, ends every stream (requests handed back at
the deadline end with finish_reason "drain_deadline") and writes the checkpoint.

What an HTTP server answers for a refusal is kvsched.serve.refusals'.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypedDict

import kvsched
from kvsched.engine.outputs import merge_outputs
from kvsched.engine.runner import Engine, RequestOutput
from kvsched.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from kvsched._core import SchedulerStats  # the stub's TypedDict (no runtime class)

    class AsyncEngineStats(SchedulerStats):
        """`AsyncEngine.stats()`: the scheduler's stats and the loop's own."""

        engine_loop: EngineLoopStats


class EngineLoopStats(TypedDict):
    steps: int  # engine steps that ran a plan
    busy_s: float  # seconds in those steps
    model_s: float  # of which in the jitted model step and sampling
    open_streams: int


# A queued command: ("submit", (tenant, prompt_ids, params, cache_salt, stream), its
# future) or ("cancel", request id, None).
_Command = tuple[str, Any, concurrent.futures.Future[int] | None]


class RequestStream:
    """One request's outputs, as an async iterator (see the module)."""

    def __init__(self, owner: AsyncEngine, request_id: int, prompt_tokens: int,
                 loop: asyncio.AbstractEventLoop) -> None:  # fmt: skip
        self._owner = owner
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False
        self.finish_reason: kvsched.FinishReason | None = None

    def _deliver(self, out: RequestOutput) -> None:
        """Called on the engine thread. A consumer whose event loop has closed is
        gone: its output is dropped (it must never stop the engine)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, out)
        except RuntimeError:  # the loop is closed
            pass

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self._queue.get()
        except asyncio.CancelledError:
            await self.cancel()  # the consumer went away: free the request
            raise
        if out.finished:
            self.finished, self.finish_reason = True, out.finish_reason
        return out

    async def coalesced(self) -> AsyncIterator[RequestOutput]:
        """The stream's outputs as iterating it gives them, except that the
        outputs already waiting when one is read come merged into it
        (`merge_outputs`): a reader that keeps up gets one output per token;
        one that falls behind (a server writing an event per output to
        hundreds of streams) catches up in fewer, larger ones, without
        a timer adding latency to any token."""
        queue = self._queue
        async for out in self:
            while not out.finished and not queue.empty():
                out = merge_outputs(out, queue.get_nowait())
                if out.finished:
                    self.finished, self.finish_reason = True, out.finish_reason
            yield out

    async def aclose(self) -> None:
        await self.cancel()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Leaving the block before the final output (an error, a cancelled task,
        a client that disconnected) cancels the request."""
        await self.cancel()

    async def cancel(self) -> None:
        """End the request now (its pages are freed); later iteration yields its
        final output if it has not been read yet."""
        if not self.finished:
            self._owner._cancel(self.request_id)

    async def collect(self) -> tuple[list[int], str, RequestOutput]:
        """Drain the stream: (all token ids, all text, the final output)."""
        ids: list[int] = []
        text = []
        last = None
        async for out in self:
            ids += out.token_ids
            text.append(out.text)
            last = out
        assert last is not None
        return ids, "".join(text), last


def _put_all(batch: list[tuple[RequestStream, RequestOutput]]) -> None:
    """On a consumer's event loop: a step's outputs into their streams' queues."""
    for stream, out in batch:
        stream._queue.put_nowait(out)


def deliver(streams: dict[int, RequestStream], outputs: Iterable[RequestOutput]) -> None:
    """Hand a step's outputs to their streams (`streams`: request id -> stream;
    a stream whose output is its last is taken out of it), in one call onto
    each consumer's event loop, not one per stream: each such call wakes the
    loop through its self-pipe. The caller holds whatever guards `streams`."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
    for out in outputs:
        stream = streams.get(out.request_id)
        if stream is None:
            continue
        if out.finished:
            del streams[out.request_id]
        batch = by_loop.get(stream._loop)
        if batch is None:
            batch = by_loop[stream._loop] = []
        batch.append((stream, out))
    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: its consumers left
            loop.call_soon_threadsafe(_put_all, batch)


class AsyncEngine:
    """An Engine driven by one background thread (see the module)."""

    def __init__(self, engine: Engine, *, checkpoint_path: str | None = None,
                 idle_recheck_s: float = 0.05, freeze_gc: bool = False) -> None:  # fmt: skip
        """`freeze_gc`: once warm, before the step loop starts, freeze what is
        alive (`gc.freeze`: the model, compiled programs, tokenizer, app live as
        long as the process), so the collections the step loop's allocations
        trigger scan young objects only. For a process that serves and exits
        (`kvsched serve`): what is frozen is never collected."""
        self.engine = engine
        self.freeze_gc = freeze_gc
        self.scheduler = engine.scheduler
        self.tokenizer = engine.tokenizer
        self.checkpoint_path = checkpoint_path
        # While requests are live but none can run this instant (nothing today;
        # kept for time-driven scheduler states), the loop rechecks this often.
        self._idle_recheck_s = idle_recheck_s
        self._lock = threading.Lock()  # the engine and the stream table (the step thread's)
        self._qlock = threading.Lock()  # the command queue: held for microseconds
        self._wake = threading.Condition(self._qlock)
        self._commands: list[_Command] = []
        self._streams: dict[int, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self.steps = 0
        self.busy_s = 0.0  # wall time spent in engine steps
        self.model_s = 0.0  # of which in the model (the rest: scheduling, text, Python)

    # -- lifecycle ----------------------------------------------------------------------

    def start(
        self, *, warmup: bool = True, progress: Callable[[int, int, str], None] | None = None
    ) -> None:
        """Warm the engine up if it is not ready, then start the step loop.
        `progress(done, total, what)` hears of each part of the warmup
        (Engine.warmup; if it raises, the warmup stops and so does this)."""
        if self._thread is not None:
            return
        if warmup and not self.scheduler.ready():
            self.engine.warmup(progress=progress or False)
        if self.freeze_gc:
            gc.collect()
            gc.freeze()
        self._thread = threading.Thread(target=self._run, name="kvsched-engine", daemon=True)
        self._thread.start()

    def ready(self) -> bool:
        return self.scheduler.ready() and self._thread is not None and self._error is None

    def live(self) -> bool:
        return self._error is None and self.scheduler.live()

    async def shutdown(self, deadline_s: float, *, now: float | None = None) -> dict[str, Any]:
        """Drain: refuse new requests, let running ones finish for `deadline_s`,
        end every stream, write the checkpoint (if a path was given), stop the
        loop. Returns what happened."""
        t0 = time.monotonic() if now is None else now
        if self.scheduler.lifecycle not in ("draining", "drained"):
            self.scheduler.drain(t0 + deadline_s)  # the Scheduler is thread-safe
        with self._wake:
            self._wake.notify()
        while True:
            done = not self._streams and self.scheduler.live_requests == 0
            if done or self._error is not None:
                break
            await asyncio.sleep(0.01)
        summary: dict[str, Any] = {"lifecycle": self.scheduler.lifecycle}
        if self.checkpoint_path is not None:
            with self._lock:
                summary["checkpoint"] = self.scheduler.checkpoint(self.checkpoint_path)
        self.stop()
        return summary

    def end_drain_now(self) -> None:
        """During a drain: move its deadline to now, so the next step hands every
        unfinished request back ("drain_deadline") and `shutdown` goes on to end
        the streams and write the checkpoint (a second SIGTERM, say)."""
        if self.scheduler.lifecycle == "draining":
            self.scheduler.drain(time.monotonic())
            with self._wake:
                self._wake.notify()

    def stop(self) -> None:
        """Stop the loop thread (streams still open are ended as cancelled, and
        submits still queued are refused)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self._close_all("cancelled", lambda: kvsched.Rejected("the engine has stopped"))

    def _close_all(
        self, reason: kvsched.FinishReason, refusal: Callable[[], BaseException]
    ) -> None:
        """End every open stream with `reason` and refuse every queued submit."""
        with self._lock:
            for rid in list(self._streams):
                self._end(rid, reason)
            with self._qlock:
                pending, self._commands = self._commands, []
            for _kind, _args, done in pending:
                if done is not None and not done.done():
                    done.set_exception(refusal())

    # -- requests -----------------------------------------------------------------------

    async def generate(
        self,
        tenant: str,
        prompt_ids: Any,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | bytes | None = None,
    ) -> RequestStream:
        """Admit a request; its stream of outputs. Raises kvsched.Rejected (and
        its subclasses) when it is refused; nothing is admitted then."""
        if self._error is not None:
            raise RuntimeError("the engine loop died") from self._error
        if self._thread is None:
            raise RuntimeError("AsyncEngine.start() first")
        if self._stopping:
            # No loop to apply it: the scheduler answers directly (after a
            # shutdown it refuses with "draining"); anything it admitted anyway
            # is taken back at once.
            with self._lock:
                rid = self.engine.submit(tenant, prompt_ids, params, cache_salt=cache_salt)
                self.engine.cancel(rid)
            exc = kvsched.Rejected("the engine has stopped")
            exc.reason, exc.retry_after = "draining", None
            raise exc
        stream = RequestStream(self, -1, len(prompt_ids), asyncio.get_running_loop())
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._command("submit", (tenant, prompt_ids, params, cache_salt, stream), done)
        stream.request_id = await asyncio.wrap_future(done)  # raises Rejected
        return stream

    def _command(self, kind: str, args: Any, done: concurrent.futures.Future[int] | None) -> None:
        with self._wake:
            self._commands.append((kind, args, done))
            self._wake.notify()

    def _cancel(self, rid: int) -> None:
        self._command("cancel", rid, None)

    def _apply(self, commands: list[_Command]) -> None:
        """On the step thread, between steps, under the engine lock."""
        for kind, args, done in commands:
            if kind == "submit":
                tenant, prompt_ids, params, cache_salt, stream = args
                assert done is not None  # a submit always carries its future
                try:
                    rid = self.engine.submit(tenant, prompt_ids, params, cache_salt=cache_salt)
                except BaseException as e:  # noqa: BLE001 - the caller gets it
                    done.set_exception(e)
                    continue
                stream.request_id = rid
                self._streams[rid] = stream
                done.set_result(rid)
            elif kind == "cancel" and args in self._streams:
                try:
                    final = self.engine.cancel(args)
                except kvsched.UnknownRequest:
                    final = None
                self._streams.pop(args)._deliver(
                    final or RequestOutput(args, [], "", None, True, "cancelled")
                )

    def _end(self, rid: int, reason: kvsched.FinishReason) -> None:
        """Under the lock: end a stream that never got its final output."""
        stream = self._streams.pop(rid, None)
        if stream is not None:
            stream._deliver(RequestOutput(rid, [], "", None, True, reason))

    # -- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (self._stopping or self._commands or self._has_work()):
                        self._wake.wait()
                    if self._stopping:
                        return
                    commands, self._commands = self._commands, []
                with self._lock:
                    self._apply(commands)
                    t0 = time.perf_counter()
                    res = self.engine.step()
                    if res is not None:
                        self.steps += 1
                        self.busy_s += time.perf_counter() - t0
                        self.model_s += res.model_seconds
                        self._deliver_step(res.outputs)
                        continue
                    idle_but_live = self.scheduler.live_requests > 0
                    if not idle_but_live:
                        # Nothing live and no ending reported: a stream left
                        # open now would wait forever, so end it.
                        for rid in list(self._streams):
                            self._end(rid, "cancelled")
                if idle_but_live:
                    # Live but nothing can run this instant: recheck shortly.
                    with self._wake:
                        if not self._commands and not self._stopping:
                            self._wake.wait(self._idle_recheck_s)
        except BaseException as e:  # noqa: BLE001 - every stream must hear of it
            self._error = e
            self._close_all("error", lambda: RuntimeError("the engine loop died"))

    def _deliver_step(self, outputs: Iterable[RequestOutput]) -> None:
        """Under the lock: hand a step's outputs to their streams."""
        deliver(self._streams, outputs)

    def _has_work(self) -> bool:
        # Read without the engine lock: the scheduler's count is thread-safe, and
        # the stream table only changes on this thread.
        return self.scheduler.live_requests > 0 or bool(self._streams)

    def stats(self) -> AsyncEngineStats:
        st = self.scheduler.stats()
        loop: EngineLoopStats = {
            "steps": self.steps,
            "busy_s": self.busy_s,
            "model_s": self.model_s,
            "open_streams": len(self._streams),
        }
        return {**st, "engine_loop": loop}
