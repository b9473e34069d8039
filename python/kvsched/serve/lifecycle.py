"""The server's process lifecycle, apart from its routes and responses: warming
up in the background, readiness, the drain (SIGTERM / SIGINT, `begin_drain()`,
`end_at`), a second signal that ends the drain now, tenant reloads (SIGHUP) and
running under uvicorn. `OpenAIServer` (kvsched.serve.server) is this plus its
app; the states and their HTTP answers are described there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI

from kvsched.serve.asgi import guarded_h11
from kvsched.serve.openai_schema import APIError
from kvsched.serve.process import DrainingUvicorn
from kvsched.serve.tenants import TenantsError, load_scheduler_table

if TYPE_CHECKING:
    import kvsched
    from kvsched.serve.async_engine import AsyncEngine
    from kvsched.serve.tenants import TenantRegistry

log = logging.getLogger("kvsched.serve")


class _WarmupStopped(Exception):
    """Raised from the warmup's progress callback when a drain began."""


class ServerLifecycle:
    """Warmup, readiness, drain, signals, reloads and uvicorn for OpenAIServer,
    whose constructor sets the state below."""

    engine: AsyncEngine
    scheduler: kvsched.Scheduler
    tenants: TenantRegistry
    drain_seconds: float
    end_at: float | None
    graceful_exit_s: float
    draining: bool
    drain_deadline: float | None  # time.monotonic()
    drain_summary: dict[str, Any] | None
    drained: asyncio.Event | None
    exit_code: int
    read_timeout_s: float
    max_connections: int | None
    max_head_bytes: int
    warmup_progress: dict[str, Any] | None
    scheduler_table: dict[str, Any] | None
    app: FastAPI
    _drain_task: asyncio.Task[dict[str, Any]] | None
    _loop: asyncio.AbstractEventLoop | None
    _uvicorn: uvicorn.Server | None
    _active: dict[int, Any]  # request id -> its bookkeeping (max_tokens, produced)
    _itl: float
    _warm_error: BaseException | None
    _warm_thread: threading.Thread | None

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self._loop = asyncio.get_running_loop()
        log.info("event loop: %s", type(self._loop).__module__.partition(".")[0])
        self.drained = asyncio.Event()
        if getattr(self.engine, "_error", None) is not None and self._uvicorn is not None:
            log.error("the engine process died before the server started: exiting")
            self.exit_code = 1
            self._uvicorn.should_exit = True
        if not self.engine.ready():
            # Warm up in the background: /health answers at once, /ready once warm.
            self._warm_thread = threading.Thread(target=self._warm, name="kvsched-warmup",
                                                 daemon=True)  # fmt: skip
            self._warm_thread.start()
        housekeeping = asyncio.ensure_future(self._housekeeping())
        fleet = getattr(self, "fleet", None)
        fleet_task = None if fleet is None else asyncio.ensure_future(fleet.run(self))
        try:
            yield
        finally:
            housekeeping.cancel()
            if fleet_task is not None:
                fleet_task.cancel()
            if self._warm_thread is not None and self._warm_thread.is_alive():
                # Stopped before warm (a signal before the app ran): the warmup stops
                # after the program it compiles; the process must not exit under XLA.
                self.draining = True
                await asyncio.to_thread(self._warm_thread.join)
            if self._drain_task is None and self.engine.ready():
                # Stopped without a drain (uvicorn saw every connection close).
                with contextlib.suppress(Exception):
                    self.drain_summary = await self.engine.shutdown(0.0)
            elif self._drain_task is not None and not self._drain_task.done():
                with contextlib.suppress(Exception):
                    await self._drain_task

    def _warm(self) -> None:
        t0 = time.perf_counter()
        if getattr(self.engine.engine, "compiles", True):
            parts = len(self.scheduler.token_buckets) + 1
            log.info("warming up: %d programs to compile (one per token bucket), then one "
                     "synthetic request; /ready answers 200 once warm", parts - 1)  # fmt: skip
        else:  # the stand-in model (kvsched.engine.simulated): one step, nothing compiled
            parts = 1
            log.info("warming up: one step through the simulated device (nothing to "
                     "compile); /ready answers 200 once warm")  # fmt: skip
        self.warmup_progress = {"done": 0, "total": parts, "elapsed_s": 0.0}

        def progress(done: int, total: int, what: str) -> None:
            elapsed = round(time.perf_counter() - t0, 1)
            self.warmup_progress = {"done": done, "total": total, "elapsed_s": elapsed}
            log.info("warmup %d/%d: %s (%.1f s)", done, total, what, elapsed)
            if self.draining:
                raise _WarmupStopped

        try:
            self.engine.start(progress=progress)
            self.warmup_progress = None
            log.info("warm in %.1f s: ready", time.perf_counter() - t0)
        except _WarmupStopped:
            log.info("warmup stopped by the drain")
        except BaseException as e:  # noqa: BLE001 - /health reports it
            self._warm_error = e
            log.exception("warmup failed")

    def live(self) -> bool:
        return self._warm_error is None and self.engine.live()

    def ready(self) -> bool:
        return not self.draining and self.engine.ready()

    def begin_drain(
        self, deadline_s: float | None = None, *, why: str = ""
    ) -> asyncio.Task[dict[str, Any]]:
        """Start draining (idempotent; call on the server's event loop): refuse new
        requests, let running ones go on for `deadline_s` (default drain_seconds),
        end the rest, write the checkpoint, then stop the server."""
        if self._drain_task is None:
            d = self.drain_seconds if deadline_s is None else max(0.0, deadline_s)
            self.draining = True
            self.drain_deadline = time.monotonic() + d
            log.info("draining%s: %d request(s) running, deadline in %.1f s",
                     f" ({why})" if why else "", len(self._active), d)  # fmt: skip
            self._drain_task = asyncio.ensure_future(self._drain(d))
        return self._drain_task

    def request_drain(self, deadline_s: float | None = None) -> None:
        """`begin_drain` from any thread (the server must be running)."""
        if self._loop is None:
            raise RuntimeError("the server is not running")
        self._loop.call_soon_threadsafe(lambda: self.begin_drain(deadline_s, why="requested"))

    async def _drain(self, deadline_s: float) -> dict[str, Any]:
        summary: dict[str, Any] = {}
        try:
            if self._warm_thread is not None and self._warm_thread.is_alive():
                # It stops after the program it is compiling; the process must not
                # exit while XLA runs on that thread.
                await asyncio.to_thread(self._warm_thread.join)
            if not self.engine.ready():
                summary = {"lifecycle": "warming: nothing was admitted"}
            else:
                # Read now, not when the drain was asked for: a second signal that
                # came before this task first ran has moved it to "now".
                left = (self.drain_deadline or time.monotonic()) - time.monotonic()
                summary = await self.engine.shutdown(max(0.0, min(deadline_s, left)))
            log.info("drained: %s", summary)
        except Exception:
            log.exception("the drain failed")
            self.exit_code = 1
            with contextlib.suppress(Exception):  # end the engine all the same
                await asyncio.to_thread(self.engine.stop)
        self.drain_summary = summary
        if self.drained is not None:
            self.drained.set()
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True  # uvicorn lets the last chunks go out
        return summary

    def reload(self) -> str:
        """Reread the tenants file and apply it live; a summary of the changes.
        Raises TenantsError (and changes nothing) when the file is not usable."""
        report = self.tenants.reload(self.scheduler)
        return report.summary()

    def _reload_logged(self) -> None:
        if self._drain_task is not None and self._drain_task.done():
            log.info("SIGHUP after the drain: the engine has stopped, nothing to reload")
            return
        try:
            report = self.tenants.reload(self.scheduler)
        except TenantsError as e:
            log.error("tenants not reloaded (the old ones stay): %s", e)
            return
        except RuntimeError as e:  # the engine's process is gone
            log.error("tenants not reloaded: %s", e)
            return
        if report.errors:  # the rest was applied: say loudly what was not
            log.warning("tenants reloaded in part: %s", report.summary())
        else:
            log.info("tenants reloaded: %s", report.summary())
        if self.scheduler_table is not None and self.tenants.path is not None:
            with contextlib.suppress(TenantsError):  # the tenants were read: it parses
                if load_scheduler_table(self.tenants.path) != self.scheduler_table:
                    log.warning("the [scheduler] table changed: its knobs are read when the "
                                "server starts; restart it to apply them")  # fmt: skip

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            with contextlib.suppress(Exception):
                done = self.tenants.retry_removals(self.scheduler)
                if done.removed:
                    log.info("tenants removed once their last request ended: %s",
                             ", ".join(done.removed))  # fmt: skip
            if self.end_at is not None and self._drain_task is None:
                left = self.end_at - time.time()
                if left <= min(self.drain_seconds, self._needed_s()):
                    self.begin_drain(max(0.0, left), why="end_at")

    def _needed_s(self) -> float:
        """Seconds the running requests still need at the measured pace, plus 1."""
        if not self._active:
            return 1.0
        left = max(a.max_tokens - a.produced for a in self._active.values())
        return 1.0 + max(0, left) * self._itl

    # -- running under uvicorn -------------------------------------------------------------------

    def uvicorn_server(self, host: str = "127.0.0.1", port: int = 8000,
                       **config: Any) -> uvicorn.Server:  # fmt: skip
        """A uvicorn server for this app whose SIGTERM / SIGINT drain (see the module)."""
        config.setdefault("log_level", "info")
        config.setdefault("timeout_graceful_shutdown", self.graceful_exit_s)
        config.setdefault("http", guarded_h11(self.read_timeout_s, self.max_head_bytes))
        # h11 must not give up on a head before the guard does (it would answer 400).
        config.setdefault("h11_max_incomplete_event_size", 2 * self.max_head_bytes)
        # uvicorn answers 503 once `limit_concurrency` connections are open, the
        # requesting one among them: one more, so that max_connections are served.
        limit = None if self.max_connections is None else self.max_connections + 1
        config.setdefault("limit_concurrency", limit)
        cfg = uvicorn.Config(self.app, host=host, port=port, lifespan="on", **config)
        self._uvicorn = DrainingUvicorn(cfg, self)
        return self._uvicorn

    def run(
        self,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        sock: socket.socket | None = None,
        **config: Any,
    ) -> int:
        """Serve until drained; the exit status (0 after a clean drain). `sock`: a
        socket already bound to (host, port) (kvsched.serve.process.bind_socket),
        listened on once the app has started."""
        server = self.uvicorn_server(host, port, **config)
        server.run(sockets=None if sock is None else [sock])
        if not server.started:
            return 1
        return self.exit_code

    def _on_signal(self, sig: int) -> None:
        """On the loop: the first SIGTERM / SIGINT drains; another one ends the
        drain now (its requests handed back, streams ended, checkpoint written);
        once drained, the server is already on its way out."""
        name = signal.Signals(sig).name
        if self._drain_task is None:
            self.begin_drain(why=name)
            return
        if self._drain_task.done():
            log.info("%s: drained already, exiting", name)
            return
        log.warning("%s during the drain: ending the running requests now (each stream "
                    "gets its final chunk; the checkpoint is written)", name)  # fmt: skip
        self.drain_deadline = time.monotonic()
        self.engine.end_drain_now()

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise APIError(503, "the server is draining and admits no new requests",
                           code="draining", headers=self._drain_retry_after())  # fmt: skip
        if self.scheduler.lifecycle in ("cold", "warming") and self._warm_error is None:
            raise APIError(503, "the server is warming up (compiling its programs) and "
                           "admits requests once /ready answers 200", code="not_ready",
                           headers={"Retry-After": str(self._warm_retry_after())})  # fmt: skip

    def _warm_retry_after(self) -> int:
        """Whole seconds the warmup still needs at its pace so far (at least 1)."""
        p = self.warmup_progress
        if not p or not p["done"]:
            return 5
        left = p["elapsed_s"] / p["done"] * (p["total"] - p["done"])
        return max(1, math.ceil(left))

    def _drain_retry_after(self) -> dict[str, str]:
        left = (self.drain_deadline or time.monotonic()) - time.monotonic()
        return {"Retry-After": str(max(1, math.ceil(left)))}
