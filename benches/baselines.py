"""Pure-Python baselines of the same operations, written the way a careful Python
programmer would (deque free list + dict refcounts; dict-based admission), so the
benchmarks show what the Rust core buys side by side in one run."""

from __future__ import annotations

import math
from collections import deque

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
