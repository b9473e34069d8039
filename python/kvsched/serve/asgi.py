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
