"""A real `kvsched serve` process for tests: started on a free localhost port and
waited for until /ready answers 200."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_serve(args: list[str], *, cwd=None, timeout: float = 120.0, env_extra=None):
    """(process, base url) of `kvsched serve <args> --port <free>`, ready. Its
    stdout and stderr are one text pipe (read it when it fails); `env_extra`
    adds to its environment."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT / "python"),
           **(env_extra or {})}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "kvsched", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=cwd)  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"kvsched serve exited: {proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"kvsched serve was not ready in {timeout:.0f} s")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.2)


def free_ports(n: int) -> list[int]:
    """`n` distinct free localhost ports (free when asked: another process may
    take one before it is bound)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
