"""Serving: `AsyncEngine` (an Engine behind one thread, an async stream per
request) for custom servers, `http_status` for their refusals, and the
OpenAI-compatible server behind `kvsched serve`.

The names are imported when first used: `kvsched serve` imports
kvsched.serve.process and starts its engine process before JAX loads here."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvsched.serve.async_engine import AsyncEngine, RequestStream
    from kvsched.serve.refusals import http_status

_WHERE = {"AsyncEngine": "async_engine", "RequestStream": "async_engine",
          "http_status": "refusals"}  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvsched.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvsched.serve.{module}"), name)


__all__ = ["AsyncEngine", "RequestStream", "http_status"]
