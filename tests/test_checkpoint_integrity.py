"""Issue 14, checkpoints (F6-F10): a checkpoint is restored whole or not at
all. A damaged file (truncated, a bit flipped, a line duplicated, lines
reordered, two files spliced) is refused with a CheckpointError; a record the
scheduler would refuse refuses the whole restore; in every refusal the
scheduler is left exactly as it was. Only regular files are read, within a
size limit; a crashed writer's temporary file is removed by the next
checkpoint to the same path."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvsched
from kvsched import checkpoint

from helpers import ids

CFG = dict(num_blocks=33, block_size=4, max_num_seqs=4, max_batched_tokens=64, max_seq_len=64,
           overhead_reserve=0.0, max_waiting=8)  # fmt: skip
SHARED = list(range(100, 116))  # four full blocks, cached by the warm scheduler


def warm() -> kvsched.Scheduler:
    """A scheduler with history: a finished request whose blocks the prefix
    cache holds, one live request holding 16 blocks (of 32), tenants of every
    kind a record can meet."""
    s = kvsched.Scheduler(kvsched.SchedulerConfig(**CFG))
    s.add_tenant(kvsched.TenantConfig("gold"))
    s.add_tenant(kvsched.TenantConfig("paused", max_concurrent=0))
    s.add_tenant(kvsched.TenantConfig("metered", rate_tokens_per_s=1.0, burst_tokens=10.0))
    s.submit("gold", np.array(SHARED + [1], dtype=np.int32), 1, now=0.0)
    plan = s.step(now=0.0)
    assert plan is not None
    s.commit(plan, np.full(len(plan), 9, dtype=np.int32), now=0.0)
    assert s.live_requests == 0
    s.submit("gold", ids(8, 500), 56, now=0.0)
    return s


def in_flight(
    rid: int,
    tenant: str = "gold",
    prompt: list[int] | None = None,
    max_tokens: int = 6,
    generated: list[int] | None = None,
) -> dict[str, Any]:
    return {"kind": "in_flight", "request_id": rid, "tenant": tenant, "reason": "in_flight",
            "prompt_ids": list(range(rid * 10, rid * 10 + 5)) if prompt is None else prompt,
            "generated_ids": [5] if generated is None else generated, "max_tokens": max_tokens,
            "stop_token_ids": [2], "cache_salt_hex": None, "arrival": 0.25}  # fmt: skip


FINISHED = {"kind": "finished", "request_id": 40, "tenant": "gold", "reason": "length",
            "prompt_len": 3, "output_ids": [7], "arrival": 0.0, "finished": 1.0,
            "cached_tokens": 0}  # fmt: skip


def good_records() -> list[dict[str, Any]]:
    """Three in-flight records that fit the warm scheduler (3 blocks each; one
    shares the cached prefix) and a finished one."""
    return [FINISHED, in_flight(1), in_flight(2, prompt=SHARED + [3]), in_flight(3)]


def state(s: kvsched.Scheduler) -> tuple[Any, ...]:
    """What a refused restore must not change."""
    return s.stats(now=1.0), s.live_requests, s.checkpoint_records()


# -- each bad record in a file of good ones -------------------------------------

# Records the scheduler would refuse: before issue 14 the others were restored
# and these came back as "refused" outcomes (or, for a record submitted first,
# took the room of the others).
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "unknown tenant": (in_flight(9, tenant="ghost"), "unknown_tenant"),
    "too long": (in_flight(9, prompt=list(range(60)), max_tokens=10), "too_long"),
    "no room": (in_flight(9, max_tokens=59), "pool_full"),
    "paused tenant": (in_flight(9, tenant="paused"), "concurrency"),
    "over its rate": (in_flight(9, tenant="metered", max_tokens=8), "rate_limited"),
}

# Records that can never run: refused whole before issue 14 too (each record
# was checked before any was submitted); here so that every bad record type
# is covered in a file of good ones.
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
    """F7: the others were restored; now none is, and the error names it."""
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


def run_to_the_end(s: kvsched.Scheduler) -> None:
    now = 1.0
    while s.live_requests:
        plan = s.step(now=now)
        assert plan is not None
        s.commit(plan, np.full(len(plan), 8, dtype=np.int32), now=now)
        now += 0.01
    pool = s.stats(now=now)["pool"]
    assert (pool["used"], pool["reserved"], pool["committed"]) == (0, 0, 0)


def test_unknown_tenants_refuse_the_whole_restore_and_each_is_named() -> None:
    """F7: 3 restored and 5 refused was the outcome; now none is restored."""
    s = warm()
    before = state(s)
    records = [in_flight(i, tenant="gold" if i % 3 == 2 else f"t{i}") for i in range(1, 9)]
    with pytest.raises(kvsched.CheckpointError, match="5 of 8 record") as e:
        s.restore_records(records, now=1.0)
    assert e.value.refused == {i: "unknown_tenant" for i in (1, 3, 4, 6, 7)}
    assert state(s) == before


def test_a_duplicated_line_is_refused_by_the_reader_and_by_the_scheduler(tmp_path) -> None:
    """F6: a duplicated line restored the request twice."""
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


# -- damaged files ----------------------------------------------------------------


def written(tmp_path, records: list[dict[str, Any]], name: str) -> bytes:
    path = tmp_path / name
    checkpoint.write_records(path, records, fingerprint="f" * 32)
    return path.read_bytes()


def lines_of(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


@st.composite
def mutations(draw: st.DrawFn, a: bytes, b: bytes) -> tuple[str, bytes]:
    how = draw(st.sampled_from(["truncate", "flip", "duplicate", "reorder", "splice", "drop"]))
    la, lb = lines_of(a), lines_of(b)
    if how == "truncate":
        return how, a[: draw(st.integers(0, len(a) - 1))]
    if how == "flip":
        at, bit = draw(st.integers(0, len(a) - 1)), draw(st.integers(0, 7))
        out = bytearray(a)
        out[at] ^= 1 << bit
        return how, bytes(out)
    if how == "duplicate":
        i, j = draw(st.integers(0, len(la) - 1)), draw(st.integers(0, len(la)))
        return how, b"".join(la[:j] + [la[i]] + la[j:])
    if how == "reorder":
        perm = draw(st.permutations(range(len(la))))
        return how, b"".join(la[k] for k in perm)
    if how == "drop":
        i = draw(st.integers(0, len(la) - 1))
        return how, b"".join(la[:i] + la[i + 1 :])
    # The head of one file, the tail of the other (at least a line of each).
    i, j = draw(st.integers(1, len(la))), draw(st.integers(1, len(lb)))
    return how, b"".join(la[:i] + lb[j:])


def _files(tmp_path_factory) -> tuple[bytes, bytes]:
    d = tmp_path_factory.mktemp("orig")
    a = written(d, good_records(), "a.jsonl")
    b = written(d, [in_flight(5), FINISHED, in_flight(6, prompt=[1, 2, 3])], "b.jsonl")
    return a, b


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[bytes, bytes]:
    return _files(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory) -> tuple[Any, Any]:
    """What restoring the intact file does to a warm scheduler."""
    path = tmp_path_factory.mktemp("ref") / "a.jsonl"
    path.write_bytes(files[0])
    s = warm()
    out = s.restore(path, now=1.0)
    return out, state(s)


@given(data=st.data())
def test_a_damaged_file_is_refused_whole_or_restored_exactly(
    files, reference, tmp_path_factory, data
) -> None:
    """F8: truncated files restored silently with requests missing, bit flips
    restored altered prompts, other damage raised JSONDecodeError or
    RecursionError. Now: a CheckpointError and nothing changed, or (the
    mutation changed nothing) the same restore as the intact file's."""
    a, b = files
    how, mutated = data.draw(mutations(a, b), label="mutation")
    path = tmp_path_factory.mktemp("mut") / "ckpt.jsonl"
    path.write_bytes(mutated)
    s = warm()
    before = state(s)
    try:
        out = s.restore(path, now=1.0)
    except kvsched.CheckpointError as e:
        assert e.refused is None, "a file error, found before any record was submitted"
        assert state(s) == before
        return
    assert mutated == a, f"{how}: a changed file was restored"
    assert (out, state(s)) == reference


def test_every_truncation_and_every_bit_flip_is_refused(files, tmp_path) -> None:
    """The issue's counts, exhaustively: every cut (at any byte, line
    boundaries included) and every single-bit flip of the file is refused."""
    a, _ = files
    path = tmp_path / "ckpt.jsonl"
    s = warm()
    before = state(s)
    damaged = [a[:n] for n in range(len(a))]
    damaged += [a[:i] + bytes([a[i] ^ (1 << bit)]) + a[i + 1 :]
                for i in range(0, len(a), 7) for bit in range(8)]  # fmt: skip
    for d in damaged:
        path.write_bytes(d)
        with pytest.raises(kvsched.CheckpointError):
            s.restore(path, now=1.0)
    assert state(s) == before


def test_deeply_nested_or_huge_lines_are_checkpoint_errors(tmp_path) -> None:
    path = tmp_path / "ckpt.jsonl"
    head = written(tmp_path, good_records(), "x.jsonl").splitlines(keepends=True)[0]
    for line in (b"[" * 100_000 + b"\n", b'{"kind": 1e999999}\n', b"9" * 5000 + b"\n"):
        path.write_bytes(head + line)
        with pytest.raises(kvsched.CheckpointError, match="line 2"):
            checkpoint.read(path)


def test_the_header_names_the_format_version_and_the_config(tmp_path) -> None:
    s = warm()
    path = tmp_path / "ckpt.jsonl"
    s.checkpoint(path)
    head = json.loads(path.read_text().splitlines()[0])
    fingerprint = checkpoint.config_fingerprint(s)
    assert head == {"kind": "header", "format": "kvsched-checkpoint", "version": 2,
                    "records": 1, "config_fingerprint": fingerprint}  # fmt: skip
    assert checkpoint.read(path).config_fingerprint == checkpoint.config_fingerprint(s)
    fresh = kvsched.Scheduler(kvsched.SchedulerConfig(**CFG))
    fresh.add_tenant(kvsched.TenantConfig("gold"))
    assert list(checkpoint.restore(fresh, path, now=1.0, same_config=True)["restored"]) == [2]
    other = kvsched.Scheduler(kvsched.SchedulerConfig(**{**CFG, "num_blocks": 65}))
    other.add_tenant(kvsched.TenantConfig("gold"))
    with pytest.raises(kvsched.CheckpointError, match="configuration"):
        checkpoint.restore(other, path, now=1.0, same_config=True)
    assert other.live_requests == 0
    assert list(checkpoint.restore(other, path, now=1.0)["restored"]) == [2]


def test_a_newer_version_or_an_old_headerless_file_is_refused(tmp_path) -> None:
    path = tmp_path / "ckpt.jsonl"
    lines = written(tmp_path, good_records(), "x.jsonl").decode().splitlines(keepends=True)
    head = json.loads(lines[0])
    path.write_text(json.dumps({**head, "version": 3}) + "\n" + "".join(lines[1:]))
    with pytest.raises(kvsched.CheckpointError, match="version 3"):
        checkpoint.read(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in good_records()))  # version 1
    with pytest.raises(kvsched.CheckpointError, match="no header"):
        warm().restore(path, now=1.0)
    path.write_text("")
    with pytest.raises(kvsched.CheckpointError, match="empty"):
        checkpoint.read(path)


# -- what is read -------------------------------------------------------------------


def test_dev_zero_a_directory_and_a_fifo_are_refused_at_once(tmp_path) -> None:
    """F9: /dev/zero grew memory without bound, a FIFO blocked every thread."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in (("/dev/zero", "character device"), (tmp_path, "directory"),
                       (fifo, "FIFO")):  # fmt: skip
        t0 = time.monotonic()
        with pytest.raises(kvsched.CheckpointError, match=f"not a regular file .*{kind}"):
            warm().restore(path, now=1.0)
        assert time.monotonic() - t0 < 2.0


def test_other_threads_run_while_a_restore_waits_on_a_fifo(tmp_path) -> None:
    """Even a FIFO whose writer never writes: the reader never waits on it."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    gaps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=tick)
    t.start()
    try:
        time.sleep(0.02)
        done = threading.Event()

        def restore() -> None:
            with pytest.raises(kvsched.CheckpointError):
                warm().restore(fifo, now=1.0)
            done.set()

        r = threading.Thread(target=restore)
        r.start()
        r.join(5.0)
        assert done.is_set(), "restore returned"
        time.sleep(0.02)
    finally:
        stop.set()
        t.join()
    assert max(gaps) < 1.0


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path, monkeypatch) -> None:
    """F9: a 1 GB file peaked at 7.1 GB RSS. A (sparse) 4 GiB file is refused
    from its size alone; the limit is a module setting and an argument."""
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(4 << 30)
    t0 = time.monotonic()
    with pytest.raises(kvsched.CheckpointError, match="over the limit"):
        warm().restore(big, now=1.0)
    assert time.monotonic() - t0 < 2.0
    path = tmp_path / "ckpt.jsonl"
    checkpoint.write_records(path, good_records())
    size = path.stat().st_size
    with pytest.raises(kvsched.CheckpointError, match="over the limit"):
        checkpoint.read(path, max_bytes=size - 1)
    assert len(checkpoint.read(path, max_bytes=size).records) == 4
    monkeypatch.setattr(checkpoint, "MAX_BYTES", size - 1)
    with pytest.raises(kvsched.CheckpointError, match="over the limit"):
        warm().restore(path, now=1.0)


# -- temporary files ----------------------------------------------------------------


def test_a_crashed_writers_temporary_file_is_removed_by_the_next_checkpoint(tmp_path) -> None:
    path = tmp_path / "ckpt.jsonl"
    stale = tmp_path / "ckpt.jsonl.4242.1700000000000000000.tmp"
    stale.write_text("half a checkpoint")
    held = tmp_path / "ckpt.jsonl.4243.1700000000000000001.tmp"
    other = tmp_path / "other.jsonl.4242.1700000000000000000.tmp"
    other.write_text("another target's")
    with open(held, "w") as live:
        fcntl.flock(live.fileno(), fcntl.LOCK_EX)  # a writer still at work
        warm().checkpoint(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, held.name, other.name])


def test_a_writer_killed_mid_checkpoint_leaves_a_file_the_next_one_removes(tmp_path) -> None:
    """F10: kill -9 during a checkpoint left its *.tmp behind forever."""
    path = tmp_path / "ckpt.jsonl"
    script = (
        "import os, sys, time\n"
        "from kvsched import checkpoint\n"
        "os.replace = lambda a, b: (print('written', flush=True), time.sleep(60))\n"
        "checkpoint.write_records(sys.argv[1], [{'kind': 'finished', 'request_id': 1}])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", script, str(path)], env=env,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
        proc.kill()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].endswith(".tmp") and not path.exists()
    warm().checkpoint(path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert len(checkpoint.read_records(path)) == 1
