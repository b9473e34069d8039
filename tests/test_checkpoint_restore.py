"""Restoring a checkpoint (Scheduler.restore, restore_records): all or nothing.
Every record is checked before any is submitted; a malformed record raises
InvalidRequest, a record the scheduler would refuse (unknown tenant, too long,
no room, paused, over its rate) or a duplicated id refuses the whole restore
with a CheckpointError naming each refused record, and in every refusal the
scheduler is left exactly as it was. A restored request continues after the
tokens it had generated, and one whose max_tokens the ladder capped stays
capped. The file itself is test_checkpoint_file.py's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvsched
from kvsched import checkpoint

from checkpoint_helpers import (
    drained_with_both_kinds,
    good_records,
    in_flight,
    make,
    run_to_the_end,
    state,
    warm,
)
from helpers import ids

# -- a good restore ----------------------------------------------------------------------


def test_restore_round_trips_through_the_file(tmp_path) -> None:
    sched, short, long = drained_with_both_kinds()
    path = tmp_path / "ckpt.jsonl"
    sched.checkpoint(path)
    fresh = make()
    out = fresh.restore(path, now=1.0)
    assert out["refused"] == {} and list(out["restored"]) == [long]
    assert [f["request_id"] for f in out["finished"]] == [short]
    assert fresh.live_requests == 1
    # restore() is kvsched.checkpoint.restore on the scheduler.
    again = make()
    assert checkpoint.restore(again, path, now=1.0)["finished"] == out["finished"]


# -- every record is checked before any is submitted --------------------------------------


def test_restore_records_checks_every_record_before_submitting_any() -> None:
    sched, _, _ = drained_with_both_kinds()
    good = sched.checkpoint_records()[1]
    fresh = make()
    bad = {k: v for k, v in good.items() if k != "max_tokens"}
    with pytest.raises(kvsched.InvalidRequest, match="max_tokens"):
        fresh.restore_records([good, bad], now=0.0)
    with pytest.raises(kvsched.InvalidRequest, match="not a dict"):
        fresh.restore_records([good, ["not", "a", "dict"]], now=0.0)
    assert fresh.live_requests == 0, "nothing was submitted"
    out = fresh.restore_records([good], now=0.0)
    assert list(out) == ["restored", "refused"] and list(out["restored"]) == [good["request_id"]]


def test_restore_from_a_file_checks_every_record_before_submitting_any(tmp_path):
    good = {"kind": "in_flight", "request_id": 1, "tenant": "gold", "prompt_ids": [1, 2, 3],
            "generated_ids": [4], "max_tokens": 5, "stop_token_ids": [], "cache_salt_hex": None,
            "arrival": 0.0}  # fmt: skip
    finished = {**good, "request_id": 2, "generated_ids": [4, 5, 6, 7, 8]}
    path = tmp_path / "ckpt.jsonl"
    checkpoint.write_records(path, [good, finished])
    sched = make()
    with pytest.raises(kvsched.InvalidRequest, match="had finished"):
        sched.restore(path, now=0.0)
    assert sched.live_requests == 0, "nothing was submitted"


def test_restore_refuses_bad_records_with_a_typed_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    checkpoint.write_records(bad, [{"kind": "in_flight", "tenant": "gold"}])
    with pytest.raises(kvsched.InvalidRequest, match="request_id"):
        make().restore(bad, now=0.0)
    # A line of no known kind makes the file one the reader cannot take
    # whole: a CheckpointError, not an InvalidRequest.
    checkpoint.write_records(bad, [{"kind": "mystery"}])
    with pytest.raises(kvsched.CheckpointError, match="unknown kind"):
        make().restore(bad, now=0.0)
    np.testing.assert_equal(make().stats(now=0.0)["live_requests"], 0)


# -- each bad record in a file of good ones -----------------------------------------------

# Records the scheduler would refuse at submit. One of them in a file of good
# records refuses the whole restore: the good ones are not restored around it
# (nor, for a record submitted first, squeezed out by it).
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "unknown tenant": (in_flight(9, tenant="ghost"), "unknown_tenant"),
    "too long": (in_flight(9, prompt=list(range(60)), max_tokens=10), "too_long"),
    "no room": (in_flight(9, max_tokens=59), "pool_full"),
    "paused tenant": (in_flight(9, tenant="paused"), "concurrency"),
    "over its rate": (in_flight(9, tenant="metered", max_tokens=8), "rate_limited"),
}

# Records that can never run: refused by the check of every record before any
# is submitted; here so that every bad record type is covered in a file of
# good ones.
MALFORMED: dict[str, tuple[dict[str, Any], str]] = {
    "missing max_tokens": ({k: v for k, v in in_flight(9).items() if k != "max_tokens"},
                           "max_tokens"),
    "already finished": (in_flight(9, max_tokens=1), "had finished"),
    "negative generated id": (in_flight(9, generated=[-4]), "negative"),
    "bad cache salt": ({**in_flight(9), "cache_salt_hex": "zz"}, "salt"),
}  # fmt: skip


def restore_with_one_bad(tmp_path, bad: dict[str, Any], where: int, error: type[Exception],
                         match: str) -> Exception:  # fmt: skip
    """Restore good records with `bad` at `where` from a file: refused with
    `error`, the scheduler unchanged; then the good ones alone restore and run."""
    records = good_records()
    records.insert(where, bad)
    path = tmp_path / "ckpt.jsonl"
    checkpoint.write_records(path, records)
    s = warm()
    before = state(s)
    with pytest.raises(error, match=match) as e:
        s.restore(path, now=1.0)
    assert state(s) == before, "nothing restored, no refusal counted"
    out = s.restore_records([r for r in good_records() if r["kind"] == "in_flight"], now=1.0)
    assert list(out["restored"]) == [1, 2, 3] and out["refused"] == {}
    assert s.live_requests == 4
    run_to_the_end(s)
    return e.value


@pytest.mark.parametrize("kind", list(REFUSED))
@pytest.mark.parametrize("where", [0, 2, 4])
def test_a_record_the_scheduler_would_refuse_restores_nothing(tmp_path, kind, where) -> None:
    """None of the good records is restored either, and the error names the
    refused one with its reason."""
    bad, reason = REFUSED[kind]
    e = restore_with_one_bad(tmp_path, bad, where, kvsched.CheckpointError, reason)
    assert isinstance(e, kvsched.CheckpointError)
    if kind == "no room" and where < 4:
        # Submitted in order: the big one fits and the good ones after it do not.
        assert e.refused is not None and set(e.refused.values()) == {"pool_full"}
    else:
        assert e.refused == {9: reason}


@pytest.mark.parametrize("kind", list(MALFORMED))
@pytest.mark.parametrize("where", [0, 2, 4])
def test_a_malformed_record_restores_nothing(tmp_path, kind, where) -> None:
    bad, match = MALFORMED[kind]
    restore_with_one_bad(tmp_path, bad, where, kvsched.InvalidRequest, match)


def test_unknown_tenants_refuse_the_whole_restore_and_each_is_named() -> None:
    """5 of 8 records name unknown tenants: none of the 8 is restored, and
    `.refused` names each of the 5."""
    s = warm()
    before = state(s)
    records = [in_flight(i, tenant="gold" if i % 3 == 2 else f"t{i}") for i in range(1, 9)]
    with pytest.raises(kvsched.CheckpointError, match="5 of 8 record") as e:
        s.restore_records(records, now=1.0)
    assert e.value.refused == {i: "unknown_tenant" for i in (1, 3, 4, 6, 7)}
    assert state(s) == before


def test_a_duplicated_line_is_refused_by_the_reader_and_by_the_scheduler(tmp_path) -> None:
    """A request is never restored twice: a duplicated line of a file is
    refused by the reader, a duplicated id among records by the scheduler."""
    path = tmp_path / "ckpt.jsonl"
    records = good_records()
    checkpoint.write_records(path, records + [records[1]])
    s = warm()
    before = state(s)
    with pytest.raises(kvsched.CheckpointError, match="request 1 again .*duplicated") as e:
        s.restore(path, now=1.0)
    assert e.value.refused is None
    with pytest.raises(kvsched.CheckpointError, match="duplicate") as e:
        s.restore_records([in_flight(1), in_flight(2), in_flight(1)], now=1.0)
    assert e.value.refused == {1: "duplicate"}
    assert state(s) == before


# -- a request the ladder capped stays capped --------------------------------------------
# The in-flight record keeps asked_max_tokens (format 2, an added field: records
# without it restore as uncapped), so the restored request finishes with
# FinishedRequest.max_tokens_capped and the caller's asked_max_tokens, not as if
# it had asked for the cap.

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
    rec = next(r for r in checkpoint.read(path).records if r["request_id"] == rid)
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
