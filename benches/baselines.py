"""Pure-Python baselines of the same operations, written the way a careful Python
programmer would (deque free list + dict refcounts; dict-based admission), so the
benchmarks show what the Rust core buys side by side in one run."""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque

import numpy as np


class PyBlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free_list: deque[int] = deque(range(1, num_blocks))
        self.refcount: dict[int, int] = {}

    def allocate_one(self) -> int:
        page = self.free_list.popleft()
        self.refcount[page] = 1
        return page

    def free_one(self, page: int) -> None:
        rc = self.refcount.get(page, 0)
        if page <= 0 or rc == 0:
            raise ValueError(f"bad free of page {page}")
        if rc == 1:
            del self.refcount[page]
            self.free_list.append(page)
        else:
            self.refcount[page] = rc - 1

    def allocate(self, n: int) -> np.ndarray:
        if n > len(self.free_list):
            raise MemoryError
        pop = self.free_list.popleft
        pages = [pop() for _ in range(n)]
        rc = self.refcount
        for p in pages:
            rc[p] = 1
        return np.array(pages, dtype=np.int32)

    def free(self, pages: np.ndarray) -> None:
        rc = self.refcount
        ids = pages.tolist()
        for p in ids:  # validate first: all or nothing, like the core
            if p <= 0 or p not in rc:
                raise ValueError(f"bad free of page {p}")
        push = self.free_list.append
        for p in ids:
            c = rc[p] - 1
            if c == 0:
                del rc[p]
                push(p)
            else:
                rc[p] = c


class PyTenant:
    def __init__(self, cap: int | None, floor: int = 0) -> None:
        self.cap = cap
        self.floor = floor
        self.reserved = 0
        self.live = 0


class PyAdmission:
    """Final-length admission with caps, floors and a live-request limit."""

    def __init__(self, num_blocks: int, block_size: int, max_seq_len: int, max_live: int) -> None:
        total = num_blocks - 1
        self.usable = total - math.ceil(total * 0.10)
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.max_live = max_live
        self.tenants: dict[str, PyTenant] = {}
        self.requests: dict[int, tuple[str, int, np.ndarray]] = {}
        self.next_id = 1

    def committed(self) -> int:
        return sum(max(t.reserved, t.floor) for t in self.tenants.values())

    def submit(
        self, tenant: str, prompt: np.ndarray, max_tokens: int, now: float | None = None
    ) -> int:
        t = self.tenants.get(tenant)
        if t is None:
            raise KeyError(tenant)
        if not (isinstance(prompt, np.ndarray) and prompt.dtype == np.int32 and prompt.ndim == 1):
            raise TypeError("prompt")
        n = len(prompt)
        if n == 0 or max_tokens < 1 or (prompt < 0).any():
            raise ValueError("invalid")
        final = n + max_tokens
        if final > self.max_seq_len:
            raise ValueError("too_long")
        blocks = -(-final // self.block_size)
        if t.cap is not None and t.reserved + blocks > t.cap:
            raise ValueError("tenant_budget")
        if len(self.requests) >= self.max_live:
            raise ValueError("concurrency")
        grown = max(t.reserved + blocks, t.floor)
        if self.committed() - max(t.reserved, t.floor) + grown > self.usable:
            raise ValueError("pool_full")
        t.reserved += blocks
        t.live += 1
        rid = self.next_id
        self.next_id += 1
        self.requests[rid] = (tenant, blocks, prompt.copy())
        return rid

    def cancel(self, rid: int) -> None:
        tenant, blocks, _ = self.requests.pop(rid)
        t = self.tenants[tenant]
        t.reserved -= blocks
        t.live -= 1


class PyPrefixAdmission(PyAdmission):
    """PyAdmission plus a prefix cache as a careful Python programmer would write
    it: blocks named by keyed BLAKE2b-128 chained from a per-tenant root (the
    same security as the core's keyed SipHash-128), a dict from name to page,
    dict refcounts and an OrderedDict as the LRU of evictable pages."""

    def __init__(self, num_blocks: int, block_size: int, max_seq_len: int, max_live: int) -> None:
        super().__init__(num_blocks, block_size, max_seq_len, max_live)
        self.secret = bytes(range(16))
        self.names: dict[bytes, int] = {}
        self.refcount: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.free_list: deque[int] = deque(range(1, num_blocks))
        self.pages: dict[int, list[int]] = {}

    def root(self, tenant: str) -> bytes:
        return hashlib.blake2b(tenant.encode(), key=self.secret, digest_size=16).digest()

    def lookup(self, tenant: str, prompt: np.ndarray) -> list[int]:
        bs = self.block_size
        parent = self.root(tenant)
        hits = []
        for b in range((len(prompt) - 1) // bs):
            key = hashlib.blake2b(
                parent + prompt[b * bs : (b + 1) * bs].tobytes(), key=self.secret, digest_size=16
            ).digest()
            page = self.names.get(key)
            if page is None:
                break
            hits.append(page)
            parent = key
        return hits

    def warm(self, tenant: str, prompt: np.ndarray) -> None:
        """Name the full blocks of `prompt` as if a request had computed them
        and finished: cached, evictable."""
        bs = self.block_size
        parent = self.root(tenant)
        pages = []
        for b in range(len(prompt) // bs):
            key = hashlib.blake2b(
                parent + prompt[b * bs : (b + 1) * bs].tobytes(), key=self.secret, digest_size=16
            ).digest()
            page = self.free_list.popleft()
            self.names[key] = page
            pages.append(page)
            parent = key
        for p in reversed(pages):
            self.lru[p] = None

    def submit(
        self, tenant: str, prompt: np.ndarray, max_tokens: int, now: float | None = None
    ) -> int:
        hits = self.lookup(tenant, prompt)
        rid = super().submit(tenant, prompt, max_tokens, now)
        rc = self.refcount
        for p in hits:
            c = rc.get(p, 0)
            if c == 0:
                del self.lru[p]
            rc[p] = c + 1
        self.pages[rid] = hits
        return rid

    def cancel(self, rid: int) -> None:
        super().cancel(rid)
        rc = self.refcount
        for p in reversed(self.pages.pop(rid)):
            c = rc[p] - 1
            if c == 0:
                del rc[p]
                self.lru[p] = None
            else:
                rc[p] = c
