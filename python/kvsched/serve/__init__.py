"""Serving: `AsyncEngine` (an Engine behind one thread, an async stream per
request) for custom servers, `http_status` for their refusals, and the
OpenAI-compatible server behind `kvsched serve`."""

from kvsched.serve.async_engine import AsyncEngine, RequestStream
from kvsched.serve.refusals import http_status

__all__ = ["AsyncEngine", "RequestStream", "http_status"]
