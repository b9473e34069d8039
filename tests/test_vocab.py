"""The vocabulary bound in the core: with `vocab_size` set, a
prompt id outside the vocabulary is refused at submit (`invalid`, nothing
admitted), a sampled one at commit (InvalidState, the plan still pending), a
generated one in a checkpoint at restore (nothing restored). The engine sets it
from its model."""

from __future__ import annotations

import numpy as np
import pytest

import kvsched

VOCAB = 512


def sched(vocab: int | None = VOCAB) -> kvsched.Scheduler:
    s = kvsched.Scheduler(kvsched.SchedulerConfig(num_blocks=64, block_size=16, vocab_size=vocab))
    s.add_tenant(kvsched.TenantConfig("a"))
    return s


def ids(*xs: int) -> np.ndarray:
    return np.asarray(xs, dtype=np.int32)


def test_the_knob_is_restart_only_and_at_least_one():
    s = sched()
    assert s.config.vocab_size == VOCAB
    with pytest.raises(kvsched.RestartRequired, match="vocab_size"):
        s.reconfigure(vocab_size=VOCAB + 1)
    with pytest.raises(kvsched.InvalidConfig, match="vocab_size"):
        kvsched.SchedulerConfig(vocab_size=0)
    assert kvsched.SchedulerConfig().vocab_size is None


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 1, 10**6, 2**31 - 1])
def test_a_prompt_id_outside_the_vocabulary_is_refused_and_changes_nothing(bad):
    s = sched()
    before = s.stats(now=0.0)
    with pytest.raises(
        kvsched.InvalidRequest, match=f"prompt token 2 is {bad}, outside the vocabulary of {VOCAB}"
    ):
        s.submit("a", ids(1, VOCAB - 1, bad, 3), 4, now=0.0)
    after = s.stats(now=0.0)
    assert after["live_requests"] == before["live_requests"] == 0
    assert after["pool"] == before["pool"]
    rejected = after["tenants"]["a"]["rejected"]
    assert {k: v for k, v in rejected.items() if v} == {"invalid": 1}
    # The last id of the vocabulary is fine; without a vocabulary any id is.
    s.submit("a", ids(VOCAB - 1), 1, now=0.0)
    sched(None).submit("a", ids(bad), 1, now=0.0)


def test_a_sampled_id_outside_the_vocabulary_is_refused_at_commit():
    s = sched()
    rid = s.submit("a", ids(1, 2, 3), 4, now=0.0)
    plan = s.step(now=0.0)
    with pytest.raises(kvsched.InvalidState, match=f"sampled id {VOCAB} of sequence 0 is outside"):
        s.commit(plan, ids(VOCAB), now=0.0)
    # Nothing changed: the same plan commits with a good id.
    ev = s.commit(plan, ids(VOCAB - 1), now=0.0)
    assert list(ev.request_ids) == [rid] and list(ev.tokens) == [VOCAB - 1]


def test_a_checkpoint_with_an_id_outside_the_vocabulary_restores_nothing():
    src = sched(None)
    src.submit("a", ids(1, 2), 8, now=0.0)
    plan = src.step(now=0.0)
    src.commit(plan, ids(VOCAB + 7), now=0.0)  # no vocabulary there
    records = src.checkpoint_records()
    dst = sched()
    with pytest.raises(kvsched.KvSchedError, match=f"generated token 0 is {VOCAB + 7}"):
        dst.restore_records(records, now=1.0)
    assert dst.stats(now=1.0)["live_requests"] == 0


@pytest.mark.parametrize("vocab", [None, 65_536, 65_537, 200_000])
def test_prefix_hits_are_the_same_whatever_width_the_names_use(vocab):
    # Up to 65,536 ids a block is named from two bytes a token, beyond from
    # four: which prompts share which prefix must not change, edge ids included.
    s = kvsched.Scheduler(kvsched.SchedulerConfig(num_blocks=256, block_size=4,
                                                  vocab_size=vocab))  # fmt: skip
    s.add_tenant(kvsched.TenantConfig("a"))
    top = 65_535 if vocab is None else min(vocab, 1 << 20) - 1
    base = np.array([0, top, 1, top - 1, 256, 255, 7, 8, top, 0, 3, 5, 9], np.int32)
    # Equal up to 8 tokens; a swap of two tokens (the same bytes, in a
    # different order); the same ids with one changed by 1 << 8 (a byte over).
    prompts = [base, base.copy(), base.copy(), base.copy()]
    prompts[2][[4, 5]] = prompts[2][[5, 4]]
    prompts[3][9] = 1 << 8
    hits = []
    for p in prompts:
        s.submit("a", p, 2, now=0.0)
        done = []
        while s.live_requests:
            plan = s.step(now=0.0)
            done += s.commit(plan, np.zeros(len(plan), np.int32), now=0.0).finished
        hits.append(done[0].cached_tokens)
    assert hits == [0, 12, 4, 8]
