"""The process around `kvsched serve`: its listening socket, its checkpoint's lock,
its logs, and uvicorn taking signals to drain (`DrainingUvicorn`). No FastAPI
here.

- The socket listens before the model loads, so a port in use fails in a
  second, not after a minute of loading; while the model loads,
  `LoadingResponder` answers on it ("loading"), and uvicorn takes it over once
  the app has started. Nothing is announced as serving before it serves.
- A checkpoint file belongs to one live server: `CheckpointLock` holds an
  exclusive lock beside it for the server's life, and a second server given
  the same file is refused, naming the first one's pid. (Without it two
  servers' drains would overwrite each other's unfinished requests.)
- Logs: JAX's INFO lines (such as the failed search for a TPU on a CPU
  machine) are not a server's; probe endpoints (/health, /ready, /metrics)
  are not access-logged unless asked, so a load balancer's polling does not
  flood the log.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})


class CheckpointInUse(OSError):
    """Another live server holds this checkpoint file."""


class CheckpointLock:
    """An exclusive lock on `<checkpoint>.lock`, held until `release()` or the
    process ends (the kernel drops it then, so a killed server never leaves a
    stale lock)."""

    def __init__(self, checkpoint: Path) -> None:
        self.path = checkpoint.with_name(checkpoint.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> CheckpointLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            checkpoint = self.path.with_name(self.path.name[: -len(".lock")])
            raise CheckpointInUse(
                f"the checkpoint {checkpoint} belongs to another live kvsched serve (pid "
                f"{holder}); give this server its own with --checkpoint PATH"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
            self._fd = None


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on (host, port), so no other server can take the
    port while the model loads (connections wait, or `LoadingResponder` answers
    them). OSError naming the address when it cannot be had (in use, not this
    machine's, a privileged port)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"--host {host}: not an address this machine can listen on ({e})") from None
    # An IPv4 address where the name has one (as uvicorn binds "localhost").
    family, kind, proto, _, address = min(infos, key=lambda i: i[0] != socket.AF_INET)
    sock = socket.socket(family, kind, proto)
    # As uvicorn does: a restart may bind while the last run's connections linger
    # in TIME_WAIT. A socket listening there still keeps the port taken (two
    # bound but not listening would not: hence listen at once).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as e:
        sock.close()
        in_use = e.errno == errno.EADDRINUSE
        hint = " (another server is using it: choose another --port)" if in_use else ""
        refused = OSError(f"cannot listen on {host}:{port}: {e.strerror}{hint}")
        refused.errno = e.errno
        raise refused from None
    return sock


class LoadingResponder:
    """Answers on the listening socket until the server takes it over: every
    request gets 503 {"status": "loading"} (with Retry-After), /health 200 with
    the same body (the process is alive), and the connection is closed. One
    thread, one connection at a time, a second for a whole request head (a slow
    client cannot hold it longer, nor delay the server's start)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvsched-loading", daemon=True)

    def __enter__(self) -> LoadingResponder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.1)
            if not ready:
                continue
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return
            with conn:
                with contextlib.suppress(OSError):
                    self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + 1.0
        head = b""
        while b"\n" not in head and len(head) < 8192 and not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            conn.settimeout(min(left, 0.1))
            try:
                chunk = conn.recv(4096)
            except TimeoutError:
                continue
            if not chunk:
                break
            head += chunk
        parts = head.split(b"\r\n", 1)[0].split()
        path = parts[1].split(b"?", 1)[0] if len(parts) >= 2 else b""
        status = b"200 OK" if path == b"/health" else b"503 Service Unavailable"
        body = b'{"status":"loading"}'
        conn.sendall(
            b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
            b"retry-after: 5\r\nconnection: close\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        # Close the write side and drop what the client still sends for a moment:
        # closing with unread input would reset the connection and lose the answer.
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(0.05)
        with contextlib.suppress(OSError):
            while conn.recv(65536):
                pass


class _NoProbes(logging.Filter):
    """Drops uvicorn's access-log lines for the probe endpoints."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in PROBE_PATHS
        return True


def quiet_probes(enabled: bool = True) -> None:
    """Access-log the probe endpoints or not (idempotent)."""
    access = logging.getLogger("uvicorn.access")
    for f in [f for f in access.filters if isinstance(f, _NoProbes)]:
        access.removeFilter(f)
    if enabled:
        access.addFilter(_NoProbes())


def configure_logging(level: str) -> None:
    """The server's log format and level; JAX's own INFO lines only at debug."""
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    if level.lower() != "debug":
        logging.getLogger("jax").setLevel(logging.WARNING)


class DrainingUvicorn(uvicorn.Server):
    """uvicorn, except that SIGTERM / SIGINT drain the server (OpenAIServer._on_signal)
    instead of stopping it, whatever their number and order, and are not re-raised
    at exit (a drained server exits 0); SIGHUP rereads the tenants file. Never a
    forced exit: that would cut the streams' last chunks and skip the checkpoint."""

    def __init__(self, config: uvicorn.Config, owner: Any) -> None:
        super().__init__(config)
        self.owner = owner

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.owner.listening_message:
            print(self.owner.listening_message, flush=True)  # listening now, not before

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        hup = getattr(signal, "SIGHUP", None)
        if hup is None or threading.current_thread() is not threading.main_thread():
            with super().capture_signals():
                yield
            return
        previous = signal.signal(hup, self.handle_exit)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(hup, previous)

    def handle_exit(self, sig: int, frame: Any) -> None:
        loop = self.owner._loop
        if sig == getattr(signal, "SIGHUP", None):
            if loop is not None:
                loop.call_soon_threadsafe(self.owner._reload_logged)
            return
        if loop is None:  # before the app started: nothing admitted, nothing to drain
            self.should_exit = True
            return
        loop.call_soon_threadsafe(self.owner._on_signal, sig)
