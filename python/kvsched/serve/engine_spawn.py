"""Starting `kvsched serve`'s engine process (kvsched.serve.engine_process)
from a light module: the front end starts it before it imports the server
(and JAX), so the two load in parallel. Imports only the standard library
here; the engine process imports the engine."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any


def start_engine_client(load: Any, **kwargs: Any) -> Any:
    """An EngineClient over a new engine process that calls `load()` (see
    kvsched.serve.engine_process); keywords go to EngineClient."""
    from kvsched.serve.engine_process import EngineClient

    return EngineClient(spawn_engine(load, log_level=kwargs.get("log_level", "info")),
                        **kwargs)  # fmt: skip


def spawn_engine(load: Any, *, log_level: str = "info") -> tuple[Any, Any]:
    """Start `kvsched serve`'s engine process (kvsched.serve.engine_process)
    now, from this light module, so it loads while this process imports the
    server: (its multiprocessing Process, this end of their pipe)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_engine_main, args=(child, load, log_level, os.getpid()),
                       name="kvsched-engine", daemon=True)  # fmt: skip
    proc.start()
    child.close()
    return proc, conn


def _engine_main(conn: Any, load: Any, log_level: str, parent: int) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        # The front end takes the signals (a Ctrl-C reaches the whole process
        # group) and tells this process what to do.
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(parent)
    from kvsched.serve.engine_process import run_engine_process

    run_engine_process(conn, load, log_level=log_level)


def die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this process when `parent` (the front end) dies,
    whatever it is doing (loading a model takes minutes and holds an
    accelerator's memory, with nobody left to serve). Elsewhere the closed
    pipe ends it, once loaded."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if parent and os.getppid() != parent:  # it died before the line above
        os._exit(1)
