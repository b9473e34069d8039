"""The simulator's figures, checked against figures computed apart from it: a
workload small enough to work out by hand, and an independent per-token account
of what the scheduler reported on a small trace excerpt under pressure
(preemptions, displacements, refusals). simulate() keeps per-token bookkeeping
out of its step loop (for speed); these tests pin that it still gives exactly
what a loop over every token gives."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvsched
from kvsched.sim import scenarios, simulator, workloads
from kvsched.sim.simulator import Arrival, StepCost, simulate

SCHEDULER = kvsched.Scheduler  # the real one, while a test swaps in Recorder


class SixteenthPerToken:
    """A step costs 1/16 s per scheduled token (exact in binary), nothing for
    the KV it reads; 0.5 s passes while nothing can run."""

    overhead_s = 0.5

    def seconds(self, tokens: int, kv_tokens_read: int) -> float:
        return tokens / 16


def _prompt(n: int, first: int) -> np.ndarray:
    return np.arange(first, first + n, dtype=np.int32)  # distinct: no prefix hits


def test_a_hand_worked_workload_gives_the_figures_worked_by_hand():
    cfg = kvsched.SchedulerConfig(num_blocks=65, block_size=16, max_num_seqs=4,
                                  max_batched_tokens=64, max_seq_len=256,
                                  long_prefill_chunk=64)  # fmt: skip
    arrivals = [
        Arrival(0.0, "y", _prompt(32, 100), 3),
        Arrival(1.0, "x", _prompt(16, 200), 2),
        Arrival(10.0, "y", _prompt(8, 300), 2),
        Arrival(20.0, "x", _prompt(16, 400), 17),
    ]
    tenants = [kvsched.TenantConfig("y"), kvsched.TenantConfig("x")]
    r = simulate(cfg, tenants, arrivals, SixteenthPerToken())  # type: ignore[arg-type]
    # a, b, c, d: the arrivals in order. Step 1 (t=0): a's 32-token prompt,
    # 2 s; a's first token at 2.0. b arrived at 1.0, is submitted at 2.0.
    # Step 2: a decodes + b's 16-token prompt, 17 tokens, 1.0625 s: both get a
    # token at 3.0625. Step 3: both decode, 2 tokens, 0.125 s: 3.1875, a (3
    # tokens) and b (2) finish. Idle until c at 10.0: its 8-token prompt, 0.5 s
    # (10.5); one decode, 1/16 s (10.5625). d at 20.0: its prompt, 1 s (21.0),
    # then 16 decodes of 1/16 s (22.0).
    got = [(x.tenant, x.outcome, x.first_token, x.last_token, x.finished, x.output_len,
            x.max_gap) for x in r.records]  # fmt: skip
    assert got == [
        ("y", "finished", 2.0, 3.1875, 3.1875, 3, 1.0625),
        ("x", "finished", 3.0625, 3.1875, 3.1875, 2, 0.125),
        ("y", "finished", 10.5, 10.5625, 10.5625, 2, 0.0625),
        ("x", "finished", 21.0, 22.0, 22.0, 17, 0.0625),
    ]
    # Every gap, per tenant in the order the tokens came; y had the first gap.
    assert list(r.gaps.items()) == [("y", [1.0625, 0.125, 0.0625]),
                                    ("x", [0.125] + [0.0625] * 16)]  # fmt: skip
    assert (r.steps, r.virtual_s, r.step_errors) == (22, 22.0, 0)
    # The timeline samples after every 16th step: step 16 is d's 10th decode.
    assert r.timeline["t"] == [21.0 + 10 / 16]
    assert r.timeline["ladder_level"] == [0]
    assert 0 < r.timeline["pool_used"][0] <= r.timeline["pool_promised"][0] <= 1
    assert r.summary()["x"]["itl_max"] == 0.125


class Recorder:
    """A kvsched.Scheduler that notes what it told its caller: each commit's
    time and the requests that got a token, and each stats() call's place."""

    log: list[Recorder] = []

    def __init__(self, config: kvsched.SchedulerConfig) -> None:
        self._s = SCHEDULER(config)
        self.submitted: list[int] = []
        self.commits: list[tuple[float, list[int]]] = []
        self.stats_after: list[tuple[int, float | None]] = []
        Recorder.log.append(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s, name)

    def submit(self, *args: Any, **kw: Any) -> int:
        rid = self._s.submit(*args, **kw)
        self.submitted.append(rid)
        return rid

    def commit(self, plan: Any, sampled: Any, *, now: float) -> Any:
        events = self._s.commit(plan, sampled, now=now)
        self.commits.append((now, events.request_ids.tolist()))
        return events

    def stats(self, *, now: float | None = None) -> Any:
        self.stats_after.append((len(self.commits), now))
        return self._s.stats(now=now)


def per_token(rec: Recorder, tenant_of: dict[int, str]) -> tuple[dict, dict]:
    """First and last token time and longest gap per request id, and every
    gap per tenant, by walking the commits token by token."""
    seen: dict[int, list[float]] = {}  # id: [first, last, max gap]
    gaps: dict[str, list[float]] = {}
    for now, ids in rec.commits:
        for rid in ids:
            if rid not in seen:
                seen[rid] = [now, now, 0.0]
                continue
            gap = now - seen[rid][1]
            gaps.setdefault(tenant_of[rid], []).append(gap)
            seen[rid][1] = now
            seen[rid][2] = max(seen[rid][2], gap)
    return seen, gaps


@pytest.mark.parametrize("scenario", ["overcommit", "ladder", "static"])
def test_token_figures_equal_a_per_token_account_on_a_workload_under_pressure(
    monkeypatch, scenario
):
    """155 requests of 256 output tokens in 10 s, a 4x burst in the middle, on
    a pool of 1,200 pages: the scheduler preempts and displaces (overcommit),
    sheds (ladder) and refuses, and static batching holds requests client-side."""
    arrivals = workloads.burst(seconds=10, base_rate=8, burst_factor=4, burst=(3, 6), output=256)
    base = kvsched.SchedulerConfig(num_blocks=1201, block_size=16, max_num_seqs=32,
                                   max_batched_tokens=2048, max_seq_len=4096,
                                   long_prefill_chunk=1024, max_waiting=64)  # fmt: skip
    tenants = [kvsched.TenantConfig("gold", tier=0), kvsched.TenantConfig("bulk", tier=1)]
    (sc,) = [s for s in scenarios.standard(base) if s.name == scenario]
    monkeypatch.setattr(kvsched, "Scheduler", Recorder)
    Recorder.log.clear()
    cost = StepCost.preset("llama-3-8b", "h100")
    r = simulate(base.replace(**sc.overrides), tenants, arrivals, cost,
                 static_batching=sc.static_batching)  # fmt: skip
    (rec,) = Recorder.log
    assert r.step_errors == 0 and r.steps == len(rec.commits)
    # Admitted requests, in the order they were submitted (records keep arrival
    # order, and requests are submitted in arrival order, static batching too).
    admitted = [x for x in r.records if x.outcome in ("finished", "capped", "rejected:displaced")]
    assert len(admitted) == len(rec.submitted)
    tenant_of = {rid: x.tenant for rid, x in zip(rec.submitted, admitted, strict=True)}
    seen, gaps = per_token(rec, tenant_of)
    for rid, x in zip(rec.submitted, admitted, strict=True):
        first, last, longest = seen.get(rid, [None, None, 0.0])
        assert (x.first_token, x.last_token, x.max_gap) == (first, last, longest), x
    for x in r.records:
        if x not in admitted:  # refused at submit: no token
            assert (x.first_token, x.last_token, x.max_gap) == (None, None, 0.0), x
    assert list(r.gaps.items()) == list(gaps.items())
    # The timeline: one sample after every 16th commit, at its time.
    samples = rec.stats_after[:-1]  # the last: the final stats
    assert [n for n, _ in samples] == list(range(16, r.steps + 1, 16))
    assert r.timeline["t"] == [rec.commits[n - 1][0] for n, _ in samples]
    assert r.timeline["t"] == [now for _, now in samples]
    # The workload did put the scheduler under pressure.
    outcomes = {x.outcome for x in r.records}
    if scenario == "overcommit":
        assert r.preemptions > 0 and "rejected:displaced" in outcomes, outcomes
    if scenario == "ladder":
        assert "rejected:shed" in outcomes, outcomes
    if scenario == "static":
        assert outcomes == {"finished"} and r.steps > 2000


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


def test_the_step_loop_logs_tokens_without_touching_each():
    """simulate() hands each commit's request_ids to the token log whole (one
    append a step), not a Python loop per token."""
    log = simulator._TokenLog()
    log.ids.append(np.array([5, 7], np.int64))
    log.at.append(1.5)
    log.ids.append(np.array([7], np.int64))
    log.at.append(2.25)
    x = simulator.RequestRecord("a", 0.0, 4)
    y = simulator.RequestRecord("b", 0.0, 4)
    assert log.apply({5: x, 7: y}) == {"b": [0.75]}
    assert (x.first_token, x.last_token, x.max_gap) == (1.5, 1.5, 0.0)
    assert (y.first_token, y.last_token, y.max_gap) == (1.5, 2.25, 0.75)
