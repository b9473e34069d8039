"""A hypothesis state machine drives the public API against a pure-Python model.

The model is the admission rule written out plainly: final-length reservations,
caps, floors that are never lent, concurrency limits and a token bucket per
tenant. After every step the scheduler's stats() must equal the model's. The
machine runs a model of one KV-cache group or a hybrid one (window and chunked
groups reserve what their span and the chunk can touch at once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import event
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

import kvsched

from helpers import ids

BLOCK = 8
NUM_BLOCKS = 65  # 64 allocatable
RESERVE = 0.1
USABLE = 64 - math.ceil(64 * RESERVE)
MAX_SEQ_LEN = 200
MAX_LIVE = 6 + 3  # max_num_seqs + max_waiting
NAMES = ["a", "b", "c"]
EPS = 1e-9
CHUNK = 16  # long_prefill_chunk: what a window group's reservation assumes
GROUP_SETS = [
    ["full"],
    ["full", "sliding_window:24"],
    ["full", "sliding_window:8", "chunked_local:40", "full"],
]


def reserved_blocks(groups: list[str], n: int, max_tokens: int) -> int:
    """Pages a request of n + max_tokens tokens reserves: every token in a full
    group; in a window (or chunk) of W, at most the pages W - 1 positions before
    a chunk of CHUNK and the chunk itself touch, ceil((W + CHUNK - 2) / B) + 1."""
    full = -(-(n + max_tokens) // BLOCK)
    pages = 0
    for g in groups:
        span = None if g == "full" else int(g.split(":")[1])
        pages += full if span is None else min(full, -(-(span + CHUNK - 2) // BLOCK) + 1)
    return pages


@dataclass
class Bucket:
    rate: float
    burst: float
    level: float
    last: float | None = None

    def level_at(self, now: float) -> float:
        if self.last is None:
            return self.burst
        return min(self.burst, self.level + self.rate * max(0.0, now - self.last))


@dataclass
class ModelTenant:
    floor: int = 0
    cap: int | None = None
    max_concurrent: int | None = None
    rate: float | None = None
    burst: float | None = None
    bucket: Bucket | None = None
    reserved: int = 0
    live: int = 0
    admitted: int = 0
    cancelled: int = 0
    rejected: dict[str, int] = field(default_factory=dict)

    def config(self, name: str) -> kvsched.TenantConfig:
        return kvsched.TenantConfig(
            name,
            kv_floor_blocks=self.floor,
            kv_cap_blocks=self.cap,
            max_concurrent=self.max_concurrent,
            rate_tokens_per_s=self.rate,
            burst_tokens=self.burst,
        )


class AdmissionMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(groups=st.sampled_from(GROUP_SETS))
    def setup(self, groups):
        self.groups = groups
        self.sched = kvsched.Scheduler(
            kvsched.SchedulerConfig(
                num_blocks=NUM_BLOCKS,
                block_size=BLOCK,
                max_num_seqs=6,
                max_waiting=3,
                max_seq_len=MAX_SEQ_LEN,
                overhead_reserve=RESERVE,
                long_prefill_chunk=CHUNK,
                kv_cache_groups=groups,
            )
        )
        self.now = 0.0
        self.tenants: dict[str, ModelTenant] = {}
        self.live: dict[int, tuple[str, int]] = {}
        self.rejected_total: dict[str, int] = {}
        for name in NAMES[:2]:
            self.tenants[name] = ModelTenant()
            self.sched.add_tenant(kvsched.TenantConfig(name))

    # -- the model's admission rule -------------------------------------------------

    def committed(self, extra_tenant: str | None = None, extra: int = 0) -> int:
        return sum(
            max(t.reserved + (extra if n == extra_tenant else 0), t.floor)
            for n, t in self.tenants.items()
        )

    def expected(self, name: str, n: int, max_tokens: int) -> str | None:
        t = self.tenants.get(name)
        if t is None:
            return "unknown_tenant"
        if n == 0 or max_tokens < 1:
            return "invalid"
        if n + max_tokens > MAX_SEQ_LEN:
            return "too_long"
        blocks = reserved_blocks(self.groups, n, max_tokens)
        # A cap counts every reservation; without one only the pool bounds the
        # tenant (the pool counts pages its requests share once), and no single
        # request may exceed it.
        if (blocks > USABLE) if t.cap is None else (t.reserved + blocks > t.cap):
            return "tenant_budget"
        if (t.max_concurrent is not None and t.live >= t.max_concurrent) or len(
            self.live
        ) >= MAX_LIVE:
            return "concurrency"
        if self.committed(name, blocks) > USABLE:
            return "pool_full"
        if t.bucket is not None:
            cost = float(n + max_tokens)
            if cost > t.bucket.burst * (1 + EPS):
                return "rate_limited"
            if t.bucket.level_at(self.now) + EPS * max(cost, 1.0) < cost:
                return "rate_limited"
        return None

    # -- rules ------------------------------------------------------------------------

    @rule(
        name=st.sampled_from(NAMES),
        floor=st.integers(0, 25),
        cap=st.none() | st.integers(0, 60),
        max_concurrent=st.none() | st.integers(0, 4),
        rate=st.none() | st.sampled_from([50.0, 200.0]),
        burst=st.none() | st.sampled_from([100.0, 400.0]),
    )
    def add_or_update_tenant(self, name, floor, cap, max_concurrent, rate, burst):
        if burst is not None and rate is None:
            rate = 100.0
        cfg = ModelTenant(floor, cap, max_concurrent, rate, burst)
        valid = cap is None or floor <= cap
        if not valid:
            try:
                cfg.config(name)
            except kvsched.InvalidConfig:
                return
            raise AssertionError("floor above cap accepted")
        old = self.tenants.get(name)
        others = self.committed() - (max(old.reserved, old.floor) if old else 0)
        fits = others + max(old.reserved if old else 0, floor) <= USABLE
        try:
            if old is None:
                self.sched.add_tenant(cfg.config(name))
            else:
                self.sched.update_tenant(cfg.config(name), now=self.now)
        except kvsched.InvalidConfig:
            assert not fits
            return
        assert fits
        if old is None:
            if rate is not None:
                b = burst if burst is not None else max(rate, 1.0)
                cfg.bucket = Bucket(rate, b, b)
            self.tenants[name] = cfg
        else:
            level = old.bucket.level_at(self.now) if old.bucket else None
            old.floor, old.cap, old.max_concurrent = floor, cap, max_concurrent
            old.rate, old.burst = rate, burst
            if rate is None:
                old.bucket = None
            else:
                b = burst if burst is not None else max(rate, 1.0)
                if old.bucket is None:
                    old.bucket = Bucket(rate, b, b)
                else:
                    assert level is not None
                    old.bucket.rate, old.bucket.burst = rate, b
                    old.bucket.level = min(level, b)
                    if old.bucket.last is not None:
                        old.bucket.last = max(old.bucket.last, self.now)

    @rule(
        target=requests,
        name=st.sampled_from([*NAMES, "ghost"]),
        n=st.integers(0, 120),
        max_tokens=st.integers(-1, 120),
    )
    def submit(self, name, n, max_tokens):
        want = self.expected(name, n, max_tokens)
        event(f"submit -> {want or 'admitted'}")
        try:
            rid = self.sched.submit(name, ids(n), max_tokens, now=self.now)
        except kvsched.Rejected as e:
            assert e.reason == want, (e, want)
            if name in self.tenants:
                r = self.tenants[name].rejected
                r[e.reason] = r.get(e.reason, 0) + 1
            self.rejected_total[e.reason] = self.rejected_total.get(e.reason, 0) + 1
            return -1
        assert want is None, f"admitted, model says {want}"
        t = self.tenants[name]
        blocks = reserved_blocks(self.groups, n, max_tokens)
        t.reserved += blocks
        t.live += 1
        t.admitted += 1
        if t.bucket is not None:
            cost = float(n + max_tokens)
            level = t.bucket.level_at(self.now)
            t.bucket.level = max(0.0, level - cost)
            t.bucket.last = self.now if t.bucket.last is None else max(t.bucket.last, self.now)
        self.live[rid] = (name, blocks)
        return rid

    @rule(rid=consumes(requests))
    def cancel(self, rid):
        if rid not in self.live:
            try:
                self.sched.cancel(max(rid, 0), now=self.now)
            except kvsched.UnknownRequest:
                return
            raise AssertionError("cancel of a dead id succeeded")
        self.sched.cancel(rid, now=self.now)
        name, blocks = self.live.pop(rid)
        t = self.tenants[name]
        t.reserved -= blocks
        t.live -= 1
        t.cancelled += 1

    @rule(name=st.sampled_from(NAMES))
    def remove_tenant(self, name):
        t = self.tenants.get(name)
        try:
            self.sched.remove_tenant(name)
        except kvsched.UnknownTenant:
            assert t is None
            return
        except kvsched.TenantInUse:
            assert t is not None and t.live > 0
            return
        assert t is not None and t.live == 0
        del self.tenants[name]

    @rule(dt=st.sampled_from([0.0, 0.25, 1.0, 3.0, -0.5]))
    def advance(self, dt):
        self.now = max(0.0, self.now + dt)  # may go back: the bucket must refill nothing

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def stats_match_model(self):
        if not hasattr(self, "sched"):
            return
        s = self.sched.stats(now=self.now)
        assert s["live_requests"] == len(self.live)
        assert s["pool"]["reserved"] == sum(b for _, b in self.live.values())
        assert s["pool"]["committed"] == self.committed()
        assert s["pool"]["committed"] <= s["pool"]["usable"] == USABLE
        assert s["pool"]["used"] == 0  # nothing draws pages without a step
        assert set(s["tenants"]) == set(self.tenants)
        for name, t in self.tenants.items():
            got = s["tenants"][name]
            assert got["reserved_blocks"] == t.reserved
            assert got["live_requests"] == t.live
            assert (got["admitted"], got["cancelled"]) == (t.admitted, t.cancelled)
            assert {k: v for k, v in got["rejected"].items() if v} == t.rejected
            if t.bucket is None:
                assert got["rate_tokens_available"] is None
            else:
                assert math.isclose(
                    got["rate_tokens_available"], t.bucket.level_at(self.now), abs_tol=1e-6
                )
        # Global counters survive tenant removal: they only ever grow.
        assert {k: v for k, v in s["rejected"].items() if v} == self.rejected_total


TestAdmissionMachine = AdmissionMachine.TestCase
