"""Tenant rate limits that hold across a fleet of replicas.

A tenant's `rate_tokens_per_s` is enforced by each replica's scheduler (a
token bucket at admission), so N replicas behind a router would give a
tenant N times its rate. With a `[fleet]` table in the tenants file, the
rates in that file are fleet-wide: each replica keeps a share of each
tenant's rate, and the shares follow where the tenant's requests go.

- Every replica counts, per tenant, the tokens its requests asked for
  (prompt + max_tokens, what the bucket charges), admitted or refused, and
  answers them at `GET /fleet/demand` (Bearer: the table's `key`).
- Every `interval_s` it reads its peers' counts, turns each replica's into a
  demand rate (tokens a second, smoothed), and sets its own bucket's rate to
  R x (d_self + e) / (sum of d + N e), where R is the file's rate, N the
  replicas and e a hundredth of an even share (an idle fleet splits evenly).
  The bucket's size stays the file's `burst_tokens`, so any request that fits
  the tenant's budget fits every replica.
- Round robin spreads a tenant's demand and with it the rate (R/N each); a
  KV-aware router that sends one tenant to one replica moves the rate there.
  The fleet admits at most about R a second, and a tenant under R is not
  refused while its replicas' shares follow its demand (they lag by one
  interval; the bucket's burst covers the lag).
- A peer that does not answer for three intervals: the tenant's
  `fleet_unreachable` says what its share becomes, "closed" (the default) an
  even 1/N of R (never more than R in all, a tenant may be refused while a
  replica is lost) or "open" the share as if that peer had no demand (the
  tenant keeps being served; the fleet may admit more than R).

Why this and not a shared store (Redis): admission stays local (no network
round trip per request, nothing to fail per request), and no store to run.
What it gives up: exactness within an interval (a burst can reach each
replica's full bucket at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kvsched

log = logging.getLogger("kvsched.serve")

UNREACHABLE = ("closed", "open")
MISSED_INTERVALS = 3  # a peer silent this long is unreachable
SMOOTHING = 0.5  # weight of the newest interval's demand rate
EVEN_FLOOR = 0.01  # e: this fraction of an even share


@dataclass(frozen=True)
class FleetConfig:
    """The tenants file's `[fleet]` table."""

    peers: tuple[str, ...]
    key: str
    interval_s: float = 0.5
    unreachable: dict[str, str] = field(default_factory=dict)  # tenant -> closed | open

    @classmethod
    def parse(cls, table: Any, tenants: list[dict[str, Any]]) -> FleetConfig:
        if not isinstance(table, dict):
            raise kvsched.InvalidConfig("[fleet]: must be a table")
        unknown = set(table) - {"peers", "key", "interval_s"}
        if unknown:
            raise kvsched.InvalidConfig(f"[fleet]: unknown key(s) {sorted(unknown)} (known: "
                                        "peers, key, interval_s)")  # fmt: skip
        peers = table.get("peers")
        if (not isinstance(peers, list) or not peers
                or not all(isinstance(p, str) and p.startswith(("http://", "https://"))
                           for p in peers)):  # fmt: skip
            raise kvsched.InvalidConfig("[fleet]: peers must list the other replicas' base "
                                        "URLs (http://HOST:PORT)")  # fmt: skip
        key = table.get("key")
        if not isinstance(key, str) or len(key) < 16:
            raise kvsched.InvalidConfig("[fleet]: key must be a secret of 16 characters or "
                                        "more, the same on every replica")  # fmt: skip
        interval = table.get("interval_s", 0.5)
        if not isinstance(interval, int | float) or not 0.05 <= interval <= 60:
            raise kvsched.InvalidConfig(f"[fleet]: interval_s must be 0.05 to 60, not {interval!r}")
        unreachable = {}
        for t in tenants:
            how = t.get("fleet_unreachable", "closed")
            if how not in UNREACHABLE:
                raise kvsched.InvalidConfig(f"tenant {t.get('name')!r}: fleet_unreachable must "
                                            f"be closed or open, not {how!r}")  # fmt: skip
            unreachable[str(t.get("name"))] = how
        return cls(tuple(p.rstrip("/") for p in peers), key, float(interval), unreachable)


def load_fleet_table(path: str | Path) -> FleetConfig | None:
    """The `[fleet]` table of a tenants file, or None when it has none."""
    from kvsched.serve.tenants import TenantsError, _read

    def parse(data: Any) -> FleetConfig | None:
        if "fleet" not in data:
            return None
        tenants = data.get("tenant", [])
        try:
            return FleetConfig.parse(data["fleet"], tenants if isinstance(tenants, list) else [])
        except kvsched.InvalidConfig as e:
            raise TenantsError(str(e)) from None

    return _read(path, parse)


def with_rate(config: kvsched.TenantConfig, rate: float) -> kvsched.TenantConfig:
    """`config` with its bucket's rate `rate` (its size as configured: the
    file's burst, or one second of the file's rate)."""
    from kvsched.serve.tenants import config_fields

    fields = config_fields(config)
    base = config.rate_tokens_per_s
    assert base is not None
    fields["burst_tokens"] = config.burst_tokens or max(1.0, base)
    fields["rate_tokens_per_s"] = rate
    return kvsched.TenantConfig(config.name, **fields)


@dataclass
class _Source:
    """One replica's demand as this one sees it."""

    totals: dict[str, float] = field(default_factory=dict)
    at: float | None = None
    rates: dict[str, float] = field(default_factory=dict)
    last_ok: float = 0.0

    def update(self, totals: dict[str, float], now: float) -> None:
        if self.at is not None and now > self.at:
            dt = now - self.at
            for name, total in totals.items():
                fresh = max(0.0, total - self.totals.get(name, 0.0)) / dt
                old = self.rates.get(name)
                self.rates[name] = fresh if old is None else (
                    SMOOTHING * fresh + (1 - SMOOTHING) * old)  # fmt: skip
        self.totals, self.at, self.last_ok = dict(totals), now, now


class FleetBudget:
    """This replica's side of fleet-wide rates (see the module's doc)."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.demand: dict[str, float] = {}  # tenant -> tokens asked here since start
        # tenant -> (the file's config, the share of its rate applied here)
        self.applied: dict[str, tuple[kvsched.TenantConfig, float]] = {}
        self.unreachable_peers = 0
        self._self = _Source()
        self._peers = {p: _Source() for p in config.peers}

    def note(self, tenant: str, tokens: int) -> None:
        """A request of `tenant` asked for `tokens` here (admitted or not)."""
        self.demand[tenant] = self.demand.get(tenant, 0.0) + tokens

    def authorized(self, header: str) -> bool:
        scheme, _, key = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            key.strip().encode(), self.config.key.encode())  # fmt: skip

    def shares_now(self, names: list[str], now: float) -> dict[str, float]:
        """Each tenant's share of its rate for this replica, from the demand
        rates seen so far."""
        n = 1 + len(self._peers)
        gone = [p for p, s in self._peers.items()
                if now - s.last_ok > MISSED_INTERVALS * self.config.interval_s]  # fmt: skip
        self.unreachable_peers = len(gone)
        out = {}
        for name in names:
            if gone and self.config.unreachable.get(name, "closed") == "closed":
                out[name] = 1.0 / n
                continue
            floor = EVEN_FLOOR / n
            mine = self._self.rates.get(name, 0.0)
            known = [s.rates.get(name, 0.0) for p, s in self._peers.items() if p not in gone]
            total = mine + sum(known)
            # Normalised by the rates known: an idle fleet splits evenly.
            scale = max(total, 1e-9)
            out[name] = (mine / scale + floor) / (1.0 + n * floor) if total > 0 else 1.0 / n
        return out

    async def run(self, server: Any) -> None:
        """Every interval: read the peers, set this replica's shares."""
        import httpx

        headers = {"Authorization": f"Bearer {self.config.key}"}
        timeout = max(0.05, self.config.interval_s * 0.8)
        async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
            while True:
                t0 = time.monotonic()
                self._self.update(self.demand, t0)

                async def read(peer: str, client: httpx.AsyncClient = client) -> None:
                    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                        r = await client.get(f"{peer}/fleet/demand")
                        if r.status_code == 200:
                            totals = {str(k): float(v) for k, v in r.json()["demand"].items()}
                            self._peers[peer].update(totals, time.monotonic())

                await asyncio.gather(*(read(p) for p in self._peers))
                try:
                    await self.apply(server, time.monotonic())
                except Exception:  # noqa: BLE001 - logged; the next interval tries again
                    log.exception("fleet budget: the shares were not applied")
                await asyncio.sleep(max(0.0, self.config.interval_s - (time.monotonic() - t0)))

    async def apply(self, server: Any, now: float) -> None:
        """Set each rate-limited tenant's share here (where it moved, or the
        file was reloaded since)."""
        entries = {e.name: e.config for e in server.tenants.entries()
                   if e.config.rate_tokens_per_s is not None}  # fmt: skip
        for name, share in self.shares_now(list(entries), now).items():
            config = entries[name]
            old = self.applied.get(name)
            if old is not None and old[0] is config and math.isclose(old[1], share, rel_tol=0.02):
                continue
            rate = config.rate_tokens_per_s * share
            try:  # the engine may be in another process: off the event loop
                await asyncio.to_thread(server.scheduler.update_tenant, with_rate(config, rate))
            except (kvsched.UnknownTenant, kvsched.InvalidConfig) as e:
                log.warning("fleet budget: tenant %r not updated: %s", name, e)
                continue
            self.applied[name] = (config, share)
