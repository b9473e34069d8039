"""Issue 14 leftover: a request whose max_tokens the ladder capped stays
marked capped through a checkpoint file. The in-flight record keeps
asked_max_tokens (format 2, an added field: records without it restore as
before), so the restored request finishes with FinishedRequest.max_tokens_capped
and the caller's asked_max_tokens, not as if it had asked for the cap."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvsched
from kvsched import checkpoint as ckpt

from helpers import ids

CAP_RUNG = {
    "signal": "queue_depth",
    "engage": 1.0,
    "release": 0.5,
    "action": "cap_max_tokens",
    "value": 6,
}


def _config(**kw) -> kvsched.SchedulerConfig:
    return kvsched.SchedulerConfig(num_blocks=200, block_size=8, **kw)


def _run_all(s: kvsched.Scheduler, now: float) -> list[kvsched.FinishedRequest]:
    done = []
    for _ in range(500):
        plan = s.step(now=now)
        if plan is None:
            break
        ev = s.commit(plan, np.full(len(plan), 3, np.int32), now=now)
        done.extend(ev.finished)
        now += 0.01
    assert s.live_requests == 0
    return done


def _capped_checkpoint(tmp_path: Path) -> tuple[Path, int]:
    s = kvsched.Scheduler(_config(ladder=[CAP_RUNG]))
    s.add_tenant(kvsched.TenantConfig("top"))
    s.add_tenant(kvsched.TenantConfig("lo", tier=1))
    s.submit("top", ids(8), 20, now=0.0)  # the cap rung engages at the next submit
    rid = s.submit("lo", ids(8, start=100), 20, now=0.0)
    capped = [e for e in s.take_events() if e["kind"] == "max_tokens_capped"]
    assert [e["request_id"] for e in capped] == [rid]
    plan = s.step(now=0.0)
    s.commit(plan, np.full(len(plan), 3, np.int32), now=0.0)
    path = tmp_path / "ckpt.jsonl"
    s.checkpoint(path)
    return path, rid


def test_a_capped_request_stays_capped_through_a_checkpoint(tmp_path: Path) -> None:
    path, rid = _capped_checkpoint(tmp_path)
    rec = next(r for r in ckpt.read(path).records if r["request_id"] == rid)
    assert (rec["max_tokens"], rec["asked_max_tokens"]) == (6, 20)

    fresh = kvsched.Scheduler(_config())  # no ladder: nothing caps it here
    fresh.add_tenant(kvsched.TenantConfig("top"))
    fresh.add_tenant(kvsched.TenantConfig("lo", tier=1))
    new_id = fresh.restore(path, now=0.0)["restored"][rid]
    done = {f.request_id: f for f in _run_all(fresh, now=0.0)}
    f = done[new_id]
    assert f.max_tokens_capped
    assert (f.asked_max_tokens, f.max_tokens, len(f.output_ids)) == (20, 6, 6)


def test_a_record_without_asked_max_tokens_still_restores() -> None:
    # A record of a file written before the field existed: restored as it
    # always was, not capped.
    s = kvsched.Scheduler(_config())
    s.add_tenant(kvsched.TenantConfig("a"))
    rec = {
        "kind": "in_flight",
        "request_id": 5,
        "tenant": "a",
        "reason": "in_flight",
        "prompt_ids": ids(8).tolist(),
        "generated_ids": [3],
        "max_tokens": 4,
        "stop_token_ids": [],
        "cache_salt_hex": None,
        "arrival": 0.0,
    }
    new_id = s.restore_records([rec], now=0.0)["restored"][5]
    f = {f.request_id: f for f in _run_all(s, now=0.0)}[new_id]
    assert not f.max_tokens_capped
    assert (f.asked_max_tokens, f.max_tokens) == (4, 4)


@pytest.mark.parametrize("asked", [3, -1, "20", 2**64])
def test_a_bad_asked_max_tokens_is_refused_and_changes_nothing(asked: object) -> None:
    s = kvsched.Scheduler(_config())
    s.add_tenant(kvsched.TenantConfig("a"))
    before = s.stats(now=0.0)
    rec = {
        "kind": "in_flight",
        "request_id": 5,
        "tenant": "a",
        "reason": "in_flight",
        "prompt_ids": ids(8).tolist(),
        "generated_ids": [3],
        "max_tokens": 4,
        "asked_max_tokens": asked,
        "stop_token_ids": [],
        "cache_salt_hex": None,
        "arrival": 0.0,
    }
    with pytest.raises(kvsched.InvalidRequest, match="asked_max_tokens"):
        s.restore_records([rec], now=0.0)
    assert s.stats(now=0.0) == before
    assert s.live_requests == 0
    json.dumps(rec)  # the record is one a file could hold
