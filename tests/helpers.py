"""Small helpers shared by the tests."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np


def ids(n: int, start: int = 1) -> np.ndarray:
    """A prompt of `n` int32 token ids."""
    return np.arange(start, start + n, dtype=np.int32)


def without_rejections(stats: dict[str, Any]) -> dict[str, Any]:
    """stats() with every rejection counter removed: what a rejection must not change."""
    out = copy.deepcopy(stats)
    out.pop("rejected")
    for t in out["tenants"].values():
        t.pop("rejected")
    return out


def rejection_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """Which global rejection counters moved, and by how much."""
    return {
        r: after["rejected"][r] - before["rejected"][r]
        for r in after["rejected"]
        if after["rejected"][r] != before["rejected"][r]
    }


def sample_of(tokens: np.ndarray) -> int:
    """The fake model: a token that depends on the whole sequence (FNV-1a hash)."""
    h = 0xCBF29CE484222325
    for t in tokens.tolist():
        h = ((h ^ (t & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h % 50_000


def check_plan_contract(plan, shape: dict[str, int], num_blocks: int) -> None:
    """The StepPlan contract of DESIGN.md, checked independently of the core."""
    n, t = len(plan), plan.bucket
    bs, pps, s = shape["block_size"], shape["pages_per_seq"], shape["max_seqs"]
    arrays = [
        plan.token_ids,
        plan.positions,
        plan.slot_mapping,
        plan.cu_q_lens,
        plan.kv_lens,
        plan.page_indices,
        plan.num_seqs,
        plan.distribution,
        plan.logits_indices,
    ]
    assert all(a.dtype == np.int32 for a in arrays)
    assert plan.token_ids.shape == plan.positions.shape == plan.slot_mapping.shape == (t,)
    assert plan.cu_q_lens.shape == (s + 1,) and plan.kv_lens.shape == (s,)
    assert plan.page_indices.shape == (s, pps) and plan.logits_indices.shape == (s,)
    assert plan.num_seqs.tolist() == [n]
    nd = plan.num_decode
    assert plan.distribution.tolist() == [nd, nd, n]
    cu = plan.cu_q_lens
    assert cu[0] == 0 and cu[n] == plan.num_tokens <= t
    assert (cu[n:] == cu[n]).all(), "cu_q_lens padding repeats the last value"
    q = np.diff(cu[: n + 1])
    assert (q >= 1).all() and (q[:nd] == 1).all(), "decodes first, one token each"
    assert (q <= plan.kv_lens[:n]).all()
    assert (plan.kv_lens[n:] == 0).all()
    assert (plan.page_indices[n:] == 0).all(), "padding rows are page 0"
    assert (plan.logits_indices[:n] == cu[1 : n + 1] - 1).all()
    pad = slice(plan.num_tokens, t)
    assert (plan.token_ids[pad] == 0).all() and (plan.positions[pad] == 0).all()
    assert (plan.slot_mapping[pad] == num_blocks * bs).all(), "padded writes are dropped"
    slots = plan.slot_mapping[: plan.num_tokens]
    assert len(np.unique(slots)) == len(slots), "no slot written twice"
    for i in range(n):
        kv = int(plan.kv_lens[i])
        row = plan.page_indices[i]
        used = -(-kv // bs)
        assert (row[:used] > 0).all() and (row[used:] == 0).all()
        pos = plan.positions[cu[i] : cu[i + 1]]
        assert pos.tolist() == list(range(kv - len(pos), kv))
        assert (plan.slot_mapping[cu[i] : cu[i + 1]] == row[pos // bs] * bs + pos % bs).all()


class FakeEngine:
    """Runs plans like a real engine: writes each token at its slot, reads each
    sequence back through its page row, samples a hash of what it read. The caller
    keeps the truth (prompt + outputs) and `run` checks every read against it."""

    def __init__(self, sched, num_blocks: int, block_size: int) -> None:
        self.sched = sched
        self.bs = block_size
        self.num_blocks = num_blocks
        self.kv = np.full(num_blocks * block_size + 1, -1, np.int64)  # +1: padding slot
        self.truth: dict[int, list[int]] = {}
        self.finished: dict[int, Any] = {}
        self.plans = 0

    def submit(self, tenant: str, prompt: np.ndarray, max_tokens: int, **kw) -> int:
        rid = self.sched.submit(tenant, prompt, max_tokens, **kw)
        self.truth[rid] = prompt.tolist()
        return rid

    def step(self, now: float, check_contract: bool = True):
        plan = self.sched.step(now=now)
        if plan is None:
            return None, None
        self.plans += 1
        if check_contract:
            check_plan_contract(plan, self.sched.plan_shape, self.num_blocks)
        self.kv[plan.slot_mapping] = plan.token_ids
        sampled = np.zeros(len(plan), np.int32)
        cu = plan.cu_q_lens
        for i, rid in enumerate(plan.request_ids.tolist()):
            kv_len = int(plan.kv_lens[i])
            pos = np.arange(kv_len)
            read = self.kv[plan.page_indices[i][pos // self.bs] * self.bs + pos % self.bs]
            assert read.tolist() == self.truth[rid][:kv_len], f"request {rid} read wrong KV"
            assert cu[i + 1] - cu[i] >= 1
            sampled[i] = sample_of(read)
        events = self.sched.commit(plan, sampled, now=now)
        for rid, tok in zip(events.request_ids.tolist(), events.tokens.tolist(), strict=True):
            self.truth[rid].append(tok)
        for f in events.finished:
            self.finished[f.request_id] = f
        return plan, events
