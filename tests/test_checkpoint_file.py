"""The checkpoint file (kvsched.checkpoint): the records the scheduler hands out
as plain dicts, the JSON lines between a header and a checksummed trailer, the
durable write (fsync, rename, owner-only, temporary files cleaned up), and what
the reader refuses before any record is submitted: a damaged file (truncated, a
bit flipped, a line duplicated, lines reordered, two files spliced), a line of
no known kind, an unknown version, a file that is not a regular file or is over
the size limit. In every refusal the scheduler is left exactly as it was.
Restore semantics are in test_checkpoint_restore.py."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvsched
from kvsched import checkpoint

from checkpoint_helpers import (
    CFG,
    FINISHED,
    drained_with_both_kinds,
    good_records,
    in_flight,
    make,
    state,
    warm,
)
from helpers import ids

# -- the records and the lines ---------------------------------------------------------


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
    # A header, the records one a line, a trailer (the file says how many
    # records it holds and carries their checksum).
    assert lines[0]["kind"] == "header" and lines[0]["records"] == 2
    assert lines[-1]["kind"] == "trailer" and lines[-1]["records"] == 2
    assert lines[1:-1] == sched.checkpoint_records()
    assert checkpoint.read_records(path) == sched.checkpoint_records()
    # The module and the method are one: save() writes the same bytes.
    other = tmp_path / "again.jsonl"
    assert checkpoint.save(sched, str(other)) == counts
    assert other.read_bytes() == path.read_bytes()


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


def test_blank_lines_are_skipped(tmp_path) -> None:
    sched, _, _ = drained_with_both_kinds()
    path = tmp_path / "ckpt.jsonl"
    records = sched.checkpoint_records()
    checkpoint.write_records(path, records)
    head, first, second, trailer = path.read_text().splitlines()
    path.write_text("\n".join(["", head, first, "  ", second, "", trailer, "", ""]))
    assert checkpoint.read_records(path) == records


# -- the write -------------------------------------------------------------------------


def test_the_file_is_readable_by_its_owner_only(tmp_path) -> None:
    """It holds every tenant's prompts and generated tokens: 0600 under the
    usual umask of 022, not 0644."""
    sched, _, _ = drained_with_both_kinds()
    old = os.umask(0o022)
    try:
        sched.checkpoint(tmp_path / "ckpt.jsonl")
    finally:
        os.umask(old)
    assert (tmp_path / "ckpt.jsonl").stat().st_mode & 0o777 == 0o600


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


def test_a_checkpoint_over_an_existing_one_leaves_no_temporary_file(tmp_path):
    sched = make()
    sched.add_tenant(kvsched.TenantConfig("bulk", tier=1))
    sched.submit("gold", ids(8), 4, now=0.0)
    path = tmp_path / "ckpt.jsonl"
    sched.checkpoint(path)
    sched.checkpoint(path)  # over an existing one
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.jsonl"]
    assert len(checkpoint.read_records(path)) == 1


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


@pytest.mark.subprocess
def test_a_writer_killed_mid_checkpoint_leaves_a_file_the_next_one_removes(tmp_path) -> None:
    """A writer killed (SIGKILL) mid-checkpoint leaves its *.tmp behind; the
    next checkpoint to the same path removes it."""
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


# -- files the reader refuses ------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "match"),
    [([1, 2], "line 3: not an object"), ({"kind": "header"}, "line 3: unknown kind"),
     ({"request_id": 1}, "line 3: unknown kind")],
)  # fmt: skip
def test_a_line_of_no_known_kind_is_refused_before_anything_runs(tmp_path, line, match) -> None:
    # A file the reader cannot take whole is a CheckpointError (not an
    # InvalidRequest, which is for a record); the lines sit after the header, in
    # a file whose checksum is right, so only the unknown line is wrong.
    sched, _, _ = drained_with_both_kinds()
    path = tmp_path / "ckpt.jsonl"
    checkpoint.write_records(path, [sched.checkpoint_records()[1], line])
    fresh = make()
    with pytest.raises(kvsched.CheckpointError, match=match) as e:
        fresh.restore(path, now=0.0)
    assert e.value.refused is None
    assert fresh.live_requests == 0


def test_an_unreadable_file_is_an_os_error(tmp_path) -> None:
    with pytest.raises(OSError, match="restore"):
        make().restore(tmp_path / "missing.jsonl", now=0.0)
    # Bytes that are not a checkpoint are a CheckpointError; an OSError is for
    # a file that cannot be opened.
    (tmp_path / "latin1.jsonl").write_bytes(b"\xff\xfe\n")
    with pytest.raises(kvsched.CheckpointError, match="restore .*line 1: not UTF-8"):
        make().restore(tmp_path / "latin1.jsonl", now=0.0)


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


def test_deeply_nested_or_huge_lines_are_checkpoint_errors(tmp_path) -> None:
    path = tmp_path / "ckpt.jsonl"
    head = written(tmp_path, good_records(), "x.jsonl").splitlines(keepends=True)[0]
    for line in (b"[" * 100_000 + b"\n", b'{"kind": 1e999999}\n', b"9" * 5000 + b"\n"):
        path.write_bytes(head + line)
        with pytest.raises(kvsched.CheckpointError, match="line 2"):
            checkpoint.read(path)


# -- damaged files -------------------------------------------------------------------------


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
    """A file truncated, with a bit flipped, a line duplicated, dropped or
    moved, or spliced from two files: a CheckpointError and nothing changed
    (not a restore with requests missing or prompts altered, nor a
    JSONDecodeError or RecursionError), or, where the mutation changed nothing,
    the same restore as the intact file's."""
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
    """Exhaustively: every cut (at any byte, line boundaries included) and
    every single-bit flip of every seventh byte of the file is refused."""
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


# -- what is read ----------------------------------------------------------------------------


def test_dev_zero_a_directory_and_a_fifo_are_refused_at_once(tmp_path) -> None:
    """Only regular files are read: /dev/zero (it would grow memory without
    bound), a directory and a FIFO (it would block) are refused within 2 s."""
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
    """A file is not read whole into memory to find it too big: a (sparse)
    4 GiB file is refused from its size alone, within 2 s; the limit is a
    module setting and an argument."""
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
