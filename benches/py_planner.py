"""A pure-Python step planner with kvsched's policy for one tenant in reserve mode:
decodes first, then running prefills in entry order, then new requests FIFO, each
prompt chunk capped by long_prefill_chunk within the step budget; power-of-two
token buckets; the DESIGN.md padding; a persistent page table whose rows are
rewritten only when they change. Written as a careful Python programmer would
(lists, a free-page stack, numpy for the arrays), it is the baseline the planner
benchmark runs beside kvsched, and `bench_planner.py` checks that it produces the
same plans as kvsched."""

from __future__ import annotations

from collections import deque

import numpy as np


class Req:
    __slots__ = ("id", "tokens", "prompt_len", "max_tokens", "pages", "computed", "key")

    def __init__(self, rid: int, prompt: np.ndarray, max_tokens: int) -> None:
        self.id = rid
        self.tokens = prompt.tolist()
        self.prompt_len = len(self.tokens)
        self.max_tokens = max_tokens
        self.pages: list[int] = []
        self.computed = 0
        self.key = 0


class PyPlan:
    pass


class PyPlanner:
    def __init__(self, num_blocks, block_size, max_num_seqs, max_batched_tokens, max_seq_len,
                 long_prefill_chunk) -> None:  # fmt: skip
        self.bs = block_size
        self.s = max_num_seqs
        self.budget = max_batched_tokens
        self.chunk = long_prefill_chunk
        self.pps = -(-max_seq_len // block_size)
        self.pad_slot = num_blocks * block_size
        # A stack, as in kvsched, so pages come out in the same order (1, 2, ...).
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))
        self.buckets = []
        b = 16
        while b < max_batched_tokens:
            self.buckets.append(b)
            b *= 2
        self.buckets.append(max_batched_tokens)
        self.t_max = self.buckets[-1]
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_decode = 0
        self.requests: dict[int, Req] = {}
        self.next_id = 1
        self.next_key = 1
        self.buffers = [self._new_buffers(), self._new_buffers()]
        self.steps = 0
        self.pending = None

    def _new_buffers(self):
        return {
            "token_ids": np.zeros(self.t_max, np.int32),
            "positions": np.zeros(self.t_max, np.int32),
            "slot_mapping": np.full(self.t_max, self.pad_slot, np.int32),
            "cu_q_lens": np.zeros(self.s + 1, np.int32),
            "kv_lens": np.zeros(self.s, np.int32),
            "page_indices": np.zeros((self.s, self.pps), np.int32),
            "num_seqs": np.zeros(1, np.int32),
            "distribution": np.zeros(3, np.int32),
            "logits_indices": np.zeros(self.s, np.int32),
            "rows": [(0, 0)] * self.s,  # (key, pages written) per row
        }

    def submit(self, prompt: np.ndarray, max_tokens: int) -> int:
        if len(prompt) == 0 or max_tokens < 1 or (prompt < 0).any():
            raise ValueError("invalid")
        r = Req(self.next_id, prompt, max_tokens)
        self.next_id += 1
        self.requests[r.id] = r
        self.waiting.append(r)
        return r.id

    def _grow(self, r: Req, length: int) -> None:
        need = -(-length // self.bs) - len(r.pages)
        for _ in range(need):
            r.pages.append(self.free.pop())

    def step(self):
        if self.pending is not None:
            raise RuntimeError("commit first")
        q: list[int] = []
        for r in self.running[: self.num_decode]:
            self._grow(r, r.computed + 1)
            q.append(1)
        used = self.num_decode
        stalled = False
        for r in self.running[self.num_decode :]:
            c = min(len(r.tokens) - r.computed, self.chunk, self.budget - used)
            if c <= 0:
                stalled = True
                break
            self._grow(r, r.computed + c)
            q.append(c)
            used += c
        if not stalled:
            while self.waiting and len(self.running) < self.s:
                r = self.waiting[0]
                c = min(len(r.tokens) - r.computed, self.chunk, self.budget - used)
                if c <= 0:
                    break
                self.waiting.popleft()
                r.key = self.next_key
                self.next_key += 1
                self.running.append(r)
                self._grow(r, r.computed + c)
                q.append(c)
                used += c
        n = len(q)
        if n == 0:
            return None
        b = self.buffers[self.steps % 2]
        tok, posb, slot = b["token_ids"], b["positions"], b["slot_mapping"]
        cu, kvl, table, rows = b["cu_q_lens"], b["kv_lens"], b["page_indices"], b["rows"]
        bs = self.bs
        off = 0
        for i in range(n):
            r, c = self.running[i], q[i]
            start = r.computed
            end = off + c
            tok[off:end] = r.tokens[start : start + c]
            pos = np.arange(start, start + c, dtype=np.int32)
            posb[off:end] = pos
            pages = r.pages
            if c == 1:
                slot[off] = pages[start // bs] * bs + start % bs
            else:
                slot[off:end] = np.asarray(pages, np.int32)[pos // bs] * bs + pos % bs
            cu[i + 1] = end
            kvl[i] = start + c
            key, filled = rows[i]
            if key != r.key or filled < len(pages):
                lo = filled if key == r.key else 0
                table[i, lo : len(pages)] = pages[lo:]
                if key != r.key and filled > len(pages):
                    table[i, len(pages) : filled] = 0
                rows[i] = (r.key, len(pages))
            off = end
        bucket = next(x for x in self.buckets if x >= off)
        tok[off:bucket] = 0
        posb[off:bucket] = 0
        slot[off:bucket] = self.pad_slot
        cu[0] = 0
        cu[n + 1 :] = off
        kvl[n:] = 0
        for i in range(n, self.s):
            key, filled = rows[i]
            if filled:
                table[i, :filled] = 0
                rows[i] = (0, 0)
        b["logits_indices"][:] = np.maximum(cu[1:] - 1, 0)
        b["num_seqs"][0] = n
        b["distribution"][:] = (self.num_decode, self.num_decode, n)
        plan = PyPlan()
        for k in ("token_ids", "positions", "slot_mapping"):
            setattr(plan, k, b[k][:bucket])
        for k in ("cu_q_lens", "kv_lens", "page_indices", "num_seqs", "distribution",
                  "logits_indices"):  # fmt: skip
            setattr(plan, k, b[k])
        plan.request_ids = np.array([r.id for r in self.running[:n]], np.int64)
        plan.q = q
        plan.n = n
        self.steps += 1
        self.pending = plan
        return plan

    def commit(self, plan, sampled: np.ndarray) -> tuple[list[int], list[int], list[int]]:
        if plan is not self.pending or len(sampled) != plan.n:
            raise RuntimeError("stale plan or wrong length")
        self.pending = None
        ids, toks, finished = [], [], []
        promote = []
        values = sampled.tolist()
        for i in range(plan.n):
            r = self.running[i]
            r.computed += plan.q[i]
            if r.computed != len(r.tokens):
                continue
            t = values[i]
            r.tokens.append(t)
            ids.append(r.id)
            toks.append(t)
            if len(r.tokens) - r.prompt_len >= r.max_tokens:
                finished.append(r)
            elif i >= self.num_decode:
                promote.append(r)
        for r in promote:
            self.running.remove(r)
            self.running.insert(self.num_decode, r)
            self.num_decode += 1
        for r in finished:
            self.cancel(r.id)
        return ids, toks, [r.id for r in finished]

    def cancel(self, rid: int) -> None:
        r = self.requests.pop(rid)
        if r in self.waiting:
            self.waiting.remove(r)
        else:
            i = self.running.index(r)
            if i < self.num_decode:
                last = self.num_decode - 1
                self.running[i], self.running[last] = self.running[last], self.running[i]
                self.num_decode -= 1
                del self.running[last]
            else:
                del self.running[i]
        self.free.extend(reversed(r.pages))  # last to first, as kvsched releases
