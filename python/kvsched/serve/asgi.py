"""The server's ASGI pieces: server-sent events, and HTTP metrics middleware."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HTTP_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ROUTES = ("/v1/models", "/v1/models/{model_id}", "/v1/completions", "/v1/chat/completions",
          "/v1/completions/render", "/v1/chat/completions/render", "/fleet/demand",
          "/health", "/ready", "/metrics")  # fmt: skip
# Label values come from closed sets whatever a client sends (a method is any
# token HTTP allows, a path anything): anything else is "other".
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def sse_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class HTTPMetrics:
    """Pure ASGI middleware: request counts and latencies by route template,
    method and status, each label from a closed set (unknown paths and methods
    are "other"; statuses are the server's own). For a stream the latency is the
    whole stream."""

    def __init__(self, app: ASGIApp, requests: Counter, latency: Histogram) -> None:
        self.app = app
        self.requests = requests
        self.latency = latency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or scope.get("path", "")
            label = path if path in ROUTES else "other"
            method = scope.get("method", "")
            labels = (label, method if method in METHODS else "other", str(status[0]))
            self.requests.labels(*labels).inc()
            self.latency.labels(*labels).observe(time.perf_counter() - t0)


class SSEResponse(StreamingResponse):
    """Server-sent events from an async iterator of bytes. A client that goes away
    (noticed at once, also while no event is due) ends the iteration; `on_close`
    then runs whatever happened, shielded from cancellation."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Any]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                try:
                    await send({"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers})  # fmt: skip
                    async for chunk in self.events:
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})  # fmt: skip
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:
                    pass  # the client is gone
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    await self.events.aclose()  # type: ignore[attr-defined]
                await self.on_close()


def guarded_h11(read_timeout_s: float = 30.0, max_head_bytes: int = 64 * 1024) -> type:
    """uvicorn's h11 protocol with the limits a public server needs that uvicorn
    lacks (pass as `uvicorn.Config(http=...)`):

    - a deadline on reading each request, head and body: `read_timeout_s` from
      its first byte (or from the connection's start) until it is whole. A
      client that sends nothing, or trickles, gets 408 and is closed (uvicorn
      only times out idle keep-alive connections, so a silent or slowloris
      socket was held for ever);
    - a request head over `max_head_bytes` (a 200 KB Authorization header) is
      answered 431, not reset: the answer is sent, the write side closed, and
      what the client is still sending is read and dropped for a moment so the
      answer is not lost to a TCP reset.

    The end of a client's input still ends its request, as in uvicorn: TCP
    cannot tell a half-close (shutdown(SHUT_WR)) from a client that has gone
    until a write fails, and a request nobody waits for must free its pages at
    once rather than run to its end.
    """
    import asyncio

    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._deadline: asyncio.TimerHandle | None = None
            self._dropping = False
            self._head, self._tail = 0, b""  # bytes of an unfinished request head
            self._arm()

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(read_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def data_received(self, data: bytes) -> None:
            if self._dropping:
                return
            if self.conn.their_state is h11.IDLE:
                # The head ends at the first blank line; the body after it is not
                # the head's (it has its own limit). 3 bytes carried over: the end
                # may straddle two reads.
                seen = self._tail + data
                ends = [(i, len(m)) for m in (b"\r\n\r\n", b"\n\n") if (i := seen.find(m)) >= 0]
                end, mark = min(ends) if ends else (-1, 0)  # h11 also takes bare-LF heads
                size = self._head + (len(data) if end < 0 else end + mark - len(self._tail))
                if size > max_head_bytes:
                    self._refuse(431, b"Request Header Fields Too Large")
                    return
                self._head, self._tail = (size, (self._tail + data)[-3:]) if end < 0 else (0, b"")
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.IDLE or state is h11.SEND_BODY:
                self._arm()  # a request has begun and is not whole yet
            else:
                self._disarm()

        def _expired(self) -> None:
            self._deadline = None
            state = self.conn.their_state
            if self.transport.is_closing() or state not in (h11.IDLE, h11.SEND_BODY):
                return
            if state is h11.IDLE and self.cycle is not None and not self._head:
                return  # between requests: uvicorn's keep-alive timeout owns this
            if self.cycle is not None:
                self.cycle.disconnected = True  # the app hears the request is gone
                self.cycle.message_event.set()
            self._refuse(408, b"Request Timeout")

        def _refuse(self, status: int, reason: bytes) -> None:
            self._disarm()
            if self.conn.our_state is h11.IDLE and (self.cycle is None or not
                                                    self.cycle.response_started):  # fmt: skip
                self.transport.write(b"HTTP/1.1 %d %s\r\nconnection: close\r\n"
                                     b"content-length: 0\r\n\r\n" % (status, reason))  # fmt: skip
            self._dropping = True
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(1.0, self.transport.close)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol
