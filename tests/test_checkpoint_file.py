"""The checkpoint file (kvsched.checkpoint) and the records behind it: the
scheduler hands out and takes back plain dicts, the module owns the JSON lines
and the durable write."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import kvsched
from kvsched import checkpoint

BASE = dict(num_blocks=121, block_size=8, max_num_seqs=4, max_batched_tokens=32,
            max_seq_len=128, overhead_reserve=0.0, max_waiting=16)  # fmt: skip


def make() -> kvsched.Scheduler:
    sched = kvsched.Scheduler(kvsched.SchedulerConfig(**BASE))
    sched.add_tenant(kvsched.TenantConfig("gold"))
    return sched


def prompt(n: int, start: int = 1) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def drained_with_both_kinds() -> tuple[kvsched.Scheduler, int, int]:
    """A draining scheduler holding one request finished since the drain began
    and one still in flight (with a cache salt and stop tokens)."""
    sched = make()
    short = sched.submit("gold", prompt(8), 1, now=0.0)
    long = sched.submit("gold", prompt(9, 50), 20, stop_token_ids=[7], cache_salt=b"\x00\xff",
                        now=0.0)  # fmt: skip
    sched.drain(100.0)
    plan = sched.step(now=0.0)
    assert plan is not None
    events = sched.commit(plan, np.full(len(plan), 3, dtype=np.int32), now=0.0)
    assert [f.request_id for f in events.finished] == [short]
    return sched, short, long


def test_records_are_plain_dicts_finished_first() -> None:
    sched, short, long = drained_with_both_kinds()
    records = sched.checkpoint_records()
    assert [(r["kind"], r["request_id"]) for r in records] == [
        ("finished", short),
        ("in_flight", long),
    ]
    fin, fly = records
    assert fin["reason"] == "length" and fin["output_ids"] == [3] and fin["prompt_len"] == 8
    assert fly["prompt_ids"] == list(range(50, 59)) and fly["generated_ids"] == [3]
    assert fly["max_tokens"] == 20 and fly["stop_token_ids"] == [7]
    assert fly["cache_salt_hex"] == "00ff" and fly["reason"] == "in_flight"


def test_the_file_is_the_records_one_a_line(tmp_path) -> None:
    sched, _, _ = drained_with_both_kinds()
    path = tmp_path / "ckpt.jsonl"
    counts = sched.checkpoint(path)
    assert counts == {"finished": 1, "in_flight": 1}
    lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
    # A header, the records one a line, a trailer (issue 14: the file says
    # how many records it holds and carries their checksum).
    assert lines[0]["kind"] == "header" and lines[0]["records"] == 2
    assert lines[-1]["kind"] == "trailer" and lines[-1]["records"] == 2
    assert lines[1:-1] == sched.checkpoint_records()
    assert checkpoint.read_records(path) == sched.checkpoint_records()
    # The module and the method are one: save() writes the same bytes.
    other = tmp_path / "again.jsonl"
    assert checkpoint.save(sched, str(other)) == counts
    assert other.read_bytes() == path.read_bytes()


def test_the_file_is_readable_by_its_owner_only(tmp_path) -> None:
    """It holds every tenant's prompts and generated tokens (it was 0644)."""
    sched, _, _ = drained_with_both_kinds()
    old = os.umask(0o022)
    try:
        sched.checkpoint(tmp_path / "ckpt.jsonl")
    finally:
        os.umask(old)
    assert (tmp_path / "ckpt.jsonl").stat().st_mode & 0o777 == 0o600


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


@pytest.mark.parametrize(
    ("line", "match"),
    [([1, 2], "line 3: not an object"), ({"kind": "header"}, "line 3: unknown kind"),
     ({"request_id": 1}, "line 3: unknown kind")],
)  # fmt: skip
def test_a_line_of_no_known_kind_is_refused_before_anything_runs(tmp_path, line, match) -> None:
    # Issue 14: a file the reader cannot take whole is a CheckpointError (it
    # was an InvalidRequest); the lines sit after the header, in a file whose
    # checksum is right, so only the unknown line is wrong.
    sched, _, _ = drained_with_both_kinds()
    path = tmp_path / "ckpt.jsonl"
    checkpoint.write_records(path, [sched.checkpoint_records()[1], line])
    fresh = make()
    with pytest.raises(kvsched.CheckpointError, match=match) as e:
        fresh.restore(path, now=0.0)
    assert e.value.refused is None
    assert fresh.live_requests == 0


def test_blank_lines_are_skipped(tmp_path) -> None:
    sched, _, _ = drained_with_both_kinds()
    path = tmp_path / "ckpt.jsonl"
    records = sched.checkpoint_records()
    checkpoint.write_records(path, records)
    head, first, second, trailer = path.read_text().splitlines()
    path.write_text("\n".join(["", head, first, "  ", second, "", trailer, "", ""]))
    assert checkpoint.read_records(path) == records


def test_the_write_is_durable(tmp_path, monkeypatch) -> None:
    """The file and then its directory are fsync'd, and the target appears by
    rename only: no temporary file is left."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    sched, _, _ = drained_with_both_kinds()
    path = tmp_path / "ckpt.jsonl"
    sched.checkpoint(path)
    assert len(synced) == 2
    assert synced[0].startswith(str(path) + ".") and synced[0].endswith(".tmp")
    assert synced[1] == str(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.jsonl"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch) -> None:
    sched, _, _ = drained_with_both_kinds()
    path = tmp_path / "ckpt.jsonl"
    path.write_text("old\n")

    def fail(src: str, dst: str) -> None:
        raise PermissionError("no rename today")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="checkpoint .*no rename today"):
        sched.checkpoint(path)
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.jsonl"]


def test_an_unreadable_file_is_an_os_error(tmp_path) -> None:
    with pytest.raises(OSError, match="restore"):
        make().restore(tmp_path / "missing.jsonl", now=0.0)
    # Issue 14: bytes that are not a checkpoint are a CheckpointError (they
    # were an OSError, like a file that cannot be opened).
    (tmp_path / "latin1.jsonl").write_bytes(b"\xff\xfe\n")
    with pytest.raises(kvsched.CheckpointError, match="restore .*line 1: not UTF-8"):
        make().restore(tmp_path / "latin1.jsonl", now=0.0)
