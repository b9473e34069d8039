"""StepPlan.kv_tokens: the KV tokens a step reads, summed by the extension."""

from __future__ import annotations

import numpy as np

import kvsched


def _prompt(n: int, first: int) -> np.ndarray:
    return np.arange(first, first + n, dtype=np.int32)  # distinct: no prefix hits


def test_a_plan_counts_the_kv_tokens_its_step_reads():
    """StepPlan.kv_tokens is kv_lens summed over the plan's sequences (the
    simulator's step cost reads it rather than summing the array each step)."""
    cfg = kvsched.SchedulerConfig(num_blocks=101, block_size=16, max_num_seqs=8,
                                  max_batched_tokens=64, max_seq_len=256)  # fmt: skip
    s = kvsched.Scheduler(cfg)
    s.add_tenant(kvsched.TenantConfig("t"))
    for i, n in enumerate((10, 30, 50)):
        s.submit("t", _prompt(n, 1000 * (i + 1)), 4, now=0.0)
    sampled = np.zeros(8, np.int32)
    seen = []
    while (plan := s.step(now=0.0)) is not None:
        k = len(plan)
        assert plan.kv_tokens == int(np.asarray(plan.kv_lens)[:k].sum())
        seen.append((plan.num_decode, plan.num_tokens, plan.kv_tokens))
        s.commit(plan, sampled[:k], now=0.0)
    # 64-token budget: 10 + 30 + 24 of 50; then decodes + the last 26; then decodes.
    assert seen[0] == (0, 64, 64)
    assert seen[1] == (2, 28, 11 + 31 + 50)
    assert len(seen) == 5 and seen[-1][0] == 1
