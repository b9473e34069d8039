"""step() + commit() at 256 and 1024 running decode sequences plus 4 prompts in
chunked prefill, beside a pure-Python planner of the same policy (py_planner.py).
kvsched runs with its default prefix cache (every block that fills is named: a
hash per 16 tokens) and without it, which is what the baseline models.

Run: python -m pytest benches/bench_planner.py --benchmark-enable --benchmark-group-by=group
"""

from __future__ import annotations

import numpy as np
import pytest
from py_planner import PyPlanner

import kvsched

BLOCK = 16
MAX_SEQ_LEN = 8192
PROMPT, DECODE_TOKENS = 64, 6000  # decoders never finish during a run
LONG_PROMPT = 7000  # each of the 4 prefills is replaced when it completes
ROUNDS = 400
SAMPLED = np.full(8192, 7, np.int32)


def config(n_decode: int) -> dict:
    per_seq = -(-(PROMPT + DECODE_TOKENS) // BLOCK)
    return dict(
        num_blocks=n_decode * per_seq + 8 * (LONG_PROMPT // BLOCK + 2) + 16,
        block_size=BLOCK,
        max_num_seqs=n_decode + 4,
        # Room for every decode plus the 4 prefill chunks (2048 up to 1,024
        # decoding, as before; scaling.py also runs 4,096).
        max_batched_tokens=max(2048, n_decode + 4 * 256),
        max_seq_len=MAX_SEQ_LEN,
        long_prefill_chunk=256,
    )


class KvschedDriver:
    def __init__(self, n_decode: int, prefix_caching: bool) -> None:
        cfg = config(n_decode)
        self.sched = kvsched.Scheduler(
            kvsched.SchedulerConfig(
                **cfg, overhead_reserve=0.0, max_waiting=8, prefix_caching=prefix_caching
            )
        )
        self.sched.add_tenant(kvsched.TenantConfig("t"))
        self.rng = np.random.default_rng(0)
        self.now = 0.0

    def submit(self, n: int, max_tokens: int) -> None:
        prompt = self.rng.integers(0, 32000, n, dtype=np.int32)
        self.sched.submit("t", prompt, max_tokens, now=self.now)

    def round(self) -> int:
        plan = self.sched.step(now=self.now)
        events = self.sched.commit(plan, SAMPLED[: len(plan)], now=self.now)
        for _ in events.finished:
            self.submit(LONG_PROMPT, 1)
        self.now += 0.02
        return plan.num_decode


class PythonDriver:
    def __init__(self, n_decode: int) -> None:
        self.planner = PyPlanner(**config(n_decode))
        self.rng = np.random.default_rng(0)

    def submit(self, n: int, max_tokens: int) -> None:
        self.planner.submit(self.rng.integers(0, 32000, n, dtype=np.int32), max_tokens)

    def round(self) -> int:
        plan = self.planner.step()
        _, _, finished = self.planner.commit(plan, SAMPLED[: plan.n])
        for _ in finished:
            self.submit(LONG_PROMPT, 1)
        return self.planner.num_decode


def warmed(kind: str, n_decode: int):
    d = (
        PythonDriver(n_decode)
        if kind == "python"
        else KvschedDriver(n_decode, prefix_caching=kind == "kvsched")
    )
    for _ in range(n_decode):
        d.submit(PROMPT, DECODE_TOKENS)
    while d.round() < n_decode:
        pass
    for _ in range(4):
        d.submit(LONG_PROMPT, 1)
    for _ in range(3):
        d.round()
    return d


@pytest.mark.parametrize("kind", ["kvsched", "kvsched_no_prefix_cache", "python"])
@pytest.mark.parametrize("n_decode", [256, 1024])
def test_step_commit(benchmark, kind, n_decode):
    benchmark.group = f"planner: step + commit, {n_decode} decoding + 4 prefilling"
    d = warmed(kind, n_decode)
    benchmark.pedantic(d.round, rounds=ROUNDS, iterations=1, warmup_rounds=10)
    assert d.round() == n_decode, "still all decoding"


def test_python_baseline_plans_exactly_like_kvsched():
    """The baseline implements the same policy: identical arrays, step by step."""
    cfg = dict(num_blocks=400, block_size=8, max_num_seqs=6, max_batched_tokens=48,
               max_seq_len=256, long_prefill_chunk=20)  # fmt: skip
    sched = kvsched.Scheduler(
        kvsched.SchedulerConfig(**cfg, overhead_reserve=0.0, max_waiting=30, prefix_caching=False)
    )
    sched.add_tenant(kvsched.TenantConfig("t"))
    py = PyPlanner(**cfg)
    rng = np.random.default_rng(1)
    for k in range(60):
        if k % 4 == 0:
            for _ in range(3):
                prompt = rng.integers(0, 1000, int(rng.integers(1, 90)), dtype=np.int32)
                max_tokens = int(rng.integers(1, 30))
                sched.submit("t", prompt, max_tokens, now=0.0)
                py.submit(prompt, max_tokens)
        a, b = sched.step(now=0.0), py.step()
        if a is None:
            assert b is None
            continue
        for name in ("token_ids", "positions", "slot_mapping", "cu_q_lens", "kv_lens",
                     "page_indices", "num_seqs", "distribution", "logits_indices",
                     "request_ids"):  # fmt: skip
            assert np.array_equal(getattr(a, name), getattr(b, name)), (k, name)
        sampled = rng.integers(0, 1000, len(a), dtype=np.int32)
        ev = sched.commit(a, sampled, now=0.0)
        ids, toks, finished = py.commit(b, sampled)
        assert ev.request_ids.tolist() == ids and ev.tokens.tolist() == toks
        assert sorted(f.request_id for f in ev.finished) == sorted(finished)
