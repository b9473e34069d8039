"""The vocabulary bound in the core (issue 14, F13): with `vocab_size` set, a
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
