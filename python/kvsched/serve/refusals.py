"""A refusal as HTTP: `http_status(rejected)` is the status and headers a server
answers a `kvsched.Rejected` with: 429 (rate_limited, tenant_budget,
concurrency, pool_full, shed), 503 (draining, not_ready), 400 (invalid,
too_long, and any permanent refusal: a request over its tenant's cap or rate
burst can never pass), 404 (unknown_tenant), with `Retry-After` (whole seconds,
rounded up) whenever the refusal carries one. No web framework: custom servers
use it as kvsched serve does.
"""

from __future__ import annotations

import math

import kvsched

_STATUS = {
    "rate_limited": 429,
    "tenant_budget": 429,
    "concurrency": 429,
    "pool_full": 429,
    "shed": 429,
    "draining": 503,
    "not_ready": 503,
    "invalid": 400,
    "too_long": 400,
    "unknown_tenant": 404,
}


def http_status(exc: kvsched.Rejected) -> tuple[int, dict[str, str]]:
    """(status, headers) for a refusal; unknown reasons are a 503. A permanent one
    (`Rejected.permanent`: over the tenant's cap or rate burst, say) is a 400
    without Retry-After, whatever its reason: clients retry 429s, forever."""
    status = _STATUS.get(exc.reason or "", 503)
    if getattr(exc, "permanent", False) and status in (429, 503):
        return 400, {}
    headers = {}
    if exc.retry_after is not None and math.isfinite(exc.retry_after):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return status, headers
