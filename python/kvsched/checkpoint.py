"""Scheduler checkpoints on disk: the file format, the durable write, and
reading a file back whole or not at all.

Who owns what:

- The scheduler (the Rust core, through the bindings) owns the *records*.
  ``Scheduler.checkpoint_records()`` hands out the requests finished since the
  drain began and every unfinished one as plain dicts, each with a ``"kind"``;
  ``Scheduler.restore_records(records, now=)`` takes in-flight records back,
  all or nothing (below).
- This module owns the *file*: the format below, the durable write and reading
  it back. ``Scheduler.checkpoint(path)`` and ``Scheduler.restore(path, now=)``
  are :func:`save` and :func:`restore` called on the scheduler.

The format (version 2): UTF-8 JSON lines, one JSON object a line.

- Line 1, the header: ``{"kind": "header", "format": "kvsched-checkpoint",
  "version": 2, "records": N, "config_fingerprint": "..."}``. ``records`` is
  how many record lines follow; ``config_fingerprint`` names the
  SchedulerConfig that wrote the file (see :func:`config_fingerprint`).
- N record lines. A record's ``"kind"`` says what it is:

  - ``"finished"``: a request that finished while the scheduler drained
    (request_id, tenant, reason, prompt_len, output_ids, arrival, finished,
    cached_tokens). Restore returns these as they are.
  - ``"in_flight"``: an unfinished request (request_id, tenant, reason,
    prompt_ids, generated_ids, max_tokens, asked_max_tokens, stop_token_ids,
    cache_salt_hex, arrival). Restore submits it again to continue after
    generated_ids. ``asked_max_tokens`` (what the caller asked for: more than
    max_tokens when the ladder capped it) keeps a capped request marked capped;
    it was added within version 2, and a record without it restores as before
    (asked_max_tokens = max_tokens).

- The last line, the trailer: ``{"kind": "trailer", "records": N, "sha256":
  "..."}``, the SHA-256 of the header line and the record lines, each with its
  newline, in file order.

A reader refuses, with :class:`kvsched.CheckpointError` naming what is wrong
and before anything is submitted: a path that is not a regular file (a FIFO, a
device: refused at once, without blocking), a file over ``max_bytes``, bytes
that are not UTF-8 JSON objects, a first line that is not a header (a file
written before version 2 included: nothing in it says whether it is whole), a
format version it does not know, a kind it does not know, a request id that
appears twice, a missing trailer (the file was truncated), a record count that
differs from the header's or the trailer's (lines lost or duplicated), and a
checksum that differs (lines altered, reordered, or spliced from another
file). Blank lines are skipped and are not part of the checksum. The file is
read a line at a time (memory grows with the records kept, not with what a
line or a device could hold: about 6x the file's size for token lists as
Python ints). Other threads run while it reads (the reads release the GIL);
parsing a line holds it for that line only (about 10 ms for 100,000 tokens).

Restore is all or nothing. Every in-flight record is checked before any is
submitted: a record that can never run raises InvalidRequest (its field); a
duplicated id, an unknown tenant, a scheduler that is not ready, a request too
long for it, and -- submitted in order, each seeing the ones before it -- a
request refused for room (pool_full, concurrency, tenant_budget), its rate
limit or the ladder raise CheckpointError with ``refused`` = {request id in the
checkpoint: reason} for every refused record, and no record is restored. There
are no "refused" outcomes any more: a restore that kept the requests that fit
and dropped the rest would lose requests silently unless every caller read
the refusals, and the requests of one checkpoint were admitted together once,
so a scheduler that cannot take all of them is the wrong target (give it more
room, or restore into a larger one). The result keeps its "refused" key, always
empty, for callers that read it.

The write is durable: the text goes to a temporary file in the target's
directory (its own name, ``<target>.<pid>.<ns>.tmp``, so two checkpoints to one
path never mix), which is flushed and fsync'd, renamed over the target, and the
directory is fsync'd so that the rename itself survives a crash. On an error the
temporary file is removed and the target is left as it was. A writer holds an
exclusive lock (flock) on its temporary file until the rename; a writer killed
before it could remove its temporary file leaves it behind, unlocked, and the
next checkpoint to the same path removes every such file (never one a live
writer holds).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from kvsched._core import CheckpointError

if TYPE_CHECKING:
    from kvsched._core import (
        CheckpointCounts,
        FinishedRecord,
        InFlightRecord,
        RestoreResult,
        Scheduler,
    )

    CheckpointRecord = FinishedRecord | InFlightRecord

__all__ = [
    "FORMAT",
    "MAX_BYTES",
    "VERSION",
    "Checkpoint",
    "config_fingerprint",
    "read",
    "read_records",
    "restore",
    "save",
    "write_records",
]

FORMAT = "kvsched-checkpoint"
VERSION = 2
#: The largest file a reader takes unless told otherwise (``max_bytes=``):
#: about 40 million tokens of prompts and outputs.
MAX_BYTES = 256 * 1024 * 1024

# Every kind a record may have, in the order a file holds them.
_KINDS = ("finished", "in_flight")


@dataclass
class Checkpoint:
    """A checkpoint file read back whole: its header and its records."""

    header: dict[str, Any]
    records: list[CheckpointRecord] = field(default_factory=list)

    @property
    def config_fingerprint(self) -> str:
        return str(self.header.get("config_fingerprint", ""))


def config_fingerprint(scheduler: Scheduler) -> str:
    """A short name of `scheduler`'s configuration (SHA-256 of its repr, which
    holds every knob but the prefix-cache key): two schedulers configured
    alike have the same one. Written into the header; ``restore(...,
    same_config=True)`` refuses a file written under another."""
    return hashlib.sha256(repr(scheduler.config).encode()).hexdigest()[:32]


def save(scheduler: Scheduler, path: str | os.PathLike[str]) -> CheckpointCounts:
    """Write `scheduler`'s checkpoint records to `path` (see the module's
    docstring for the format and the durable write). Returns the counts:
    {"finished": n, "in_flight": n}."""
    records = scheduler.checkpoint_records()
    write_records(path, records, fingerprint=config_fingerprint(scheduler))
    return {
        "finished": sum(1 for r in records if r["kind"] == "finished"),
        "in_flight": sum(1 for r in records if r["kind"] == "in_flight"),
    }


def restore(
    scheduler: Scheduler,
    path: str | os.PathLike[str],
    *,
    now: float | None = None,
    max_bytes: int | None = None,
    same_config: bool = False,
) -> RestoreResult:
    """Read the checkpoint at `path` whole and submit its in-flight requests to
    `scheduler` again, all or nothing (see the module's docstring). Returns
    {"restored": {old id: new id}, "refused": {} (always empty), "finished":
    [the finished records]}. `max_bytes` bounds the file (default
    :data:`MAX_BYTES`); `same_config` refuses a file written under another
    configuration (by default a restart may change the config)."""
    ckpt = read(path, max_bytes=max_bytes)
    if same_config and ckpt.config_fingerprint != config_fingerprint(scheduler):
        raise _error(
            f"restore {os.fspath(path)}: written under configuration "
            f"{ckpt.config_fingerprint}, this scheduler's is {config_fingerprint(scheduler)}"
        )
    finished: list[FinishedRecord] = []
    in_flight: list[InFlightRecord] = []
    for r in ckpt.records:
        if r["kind"] == "finished":
            finished.append(r)
        else:
            in_flight.append(r)
    out = scheduler.restore_records(in_flight, now=now)
    return {"restored": out["restored"], "refused": out["refused"], "finished": finished}


def write_records(
    path: str | os.PathLike[str], records: Iterable[CheckpointRecord], *, fingerprint: str = ""
) -> None:
    """Write `records` to `path` as a checkpoint file (header, one record a
    line, trailer), durably. `fingerprint` goes into the header."""
    path = os.fspath(path)
    lines = [json.dumps(r).encode() + b"\n" for r in records]
    header = {"kind": "header", "format": FORMAT, "version": VERSION, "records": len(lines),
              "config_fingerprint": fingerprint}  # fmt: skip
    head = json.dumps(header).encode() + b"\n"
    digest = hashlib.sha256(head)
    for line in lines:
        digest.update(line)
    trailer = {"kind": "trailer", "records": len(lines), "sha256": digest.hexdigest()}
    lines.insert(0, head)
    lines.append(json.dumps(trailer).encode() + b"\n")
    _clean_stale_temporaries(path)
    _write_durably(path, b"".join(lines))


def read_records(
    path: str | os.PathLike[str], *, max_bytes: int | None = None
) -> list[CheckpointRecord]:
    """The records of the checkpoint at `path`, in file order (see
    :func:`read`)."""
    return read(path, max_bytes=max_bytes).records


def read(path: str | os.PathLike[str], *, max_bytes: int | None = None) -> Checkpoint:
    """The checkpoint at `path`, checked whole (see the module's docstring):
    raises CheckpointError for a file that is not a whole, unaltered
    checkpoint, OSError when it cannot be opened. The in-flight records'
    fields are checked by the scheduler."""
    name = os.fspath(path)
    limit = MAX_BYTES if max_bytes is None else max_bytes
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer.
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise OSError(f"restore {name}: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _error(f"restore {name}: not a regular file ({_file_kind(st.st_mode)})")
        if st.st_size > limit:
            raise _error(f"restore {name}: {st.st_size} bytes, over the limit of {limit} "
                         "(max_bytes)")  # fmt: skip
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        try:
            return _parse(name, f, limit)
        except OSError as e:
            raise OSError(f"restore {name}: {e}") from e


def _parse(name: str, f: IO[bytes], limit: int) -> Checkpoint:
    digest = hashlib.sha256()
    header: dict[str, Any] | None = None
    trailer: dict[str, Any] | None = None
    records: list[Any] = []
    first_line: dict[int, int] = {}
    size = 0
    n = 0
    while True:
        # Never more than the limit in one line, however long the line.
        line = f.readline(limit - size + 1)
        if not line:
            break
        size += len(line)
        n += 1
        if size > limit:
            raise _error(f"restore {name}: grew over the limit of {limit} bytes while read")
        if not line.endswith(b"\n"):
            raise _error(f"restore {name}: line {n} has no end: the file is truncated")
        if not line.strip():
            continue
        if trailer is not None:
            raise _error(f"restore {name}: line {n}: more after the trailer")
        rec = _decode(name, n, line)
        kind = rec.get("kind")
        if header is None:
            if kind != "header":
                raise _error(
                    f"restore {name}: line {n}: no header (not a kvsched checkpoint, or "
                    f"one written before format version {VERSION}, which cannot be "
                    "checked whole)"
                )
            header = _check_header(name, n, rec)
            digest.update(line)
        elif kind == "trailer":
            trailer = rec
        elif kind in _KINDS:
            # A record without an integer id is the scheduler's to refuse
            # (InvalidRequest, naming the field), as any bad field is.
            rid = rec.get("request_id")
            if type(rid) is int and rid in first_line:
                raise _error(f"restore {name}: line {n}: request {rid} again (first at line "
                             f"{first_line[rid]}): a duplicated record")  # fmt: skip
            if type(rid) is int:
                first_line[rid] = n
            digest.update(line)
            records.append(rec)
        else:
            raise _error(f"restore {name}: line {n}: unknown kind {kind!r}")
    if header is None:
        raise _error(f"restore {name}: empty: no header")
    want = header["records"]
    if trailer is None:
        raise _error(f"restore {name}: truncated: no trailer after {len(records)} of "
                     f"{want} records")  # fmt: skip
    if trailer.get("records") != want or len(records) != want:
        raise _error(f"restore {name}: {len(records)} records, the header says {want} and "
                     f"the trailer {trailer.get('records')!r}: records lost or "
                     "duplicated")  # fmt: skip
    if trailer.get("sha256") != digest.hexdigest():
        raise _error(f"restore {name}: checksum mismatch: the header or records are not "
                     "the ones written (altered, reordered or spliced)")  # fmt: skip
    return Checkpoint(header=header, records=records)


def _decode(name: str, n: int, line: bytes) -> dict[str, Any]:
    try:
        rec = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise _error(f"restore {name}: line {n}: not UTF-8") from None
    except (ValueError, RecursionError):
        raise _error(f"restore {name}: line {n}: not JSON") from None
    if not isinstance(rec, dict):
        raise _error(f"restore {name}: line {n}: not an object")
    return rec


def _check_header(name: str, n: int, header: dict[str, Any]) -> dict[str, Any]:
    if header.get("format") != FORMAT:
        raise _error(f"restore {name}: line {n}: format {header.get('format')!r}, not {FORMAT!r}")
    version = header.get("version")
    if version != VERSION:
        raise _error(f"restore {name}: format version {version!r}; this reader knows "
                     f"{VERSION} (written by another kvsched?)")  # fmt: skip
    records = header.get("records")
    if type(records) is not int or records < 0:
        raise _error(f"restore {name}: line {n}: bad record count {records!r}")
    return header


def _error(message: str) -> CheckpointError:
    return CheckpointError(message)  # refused: None, a file error


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return kind
    return "not a plain file"


def _temporary_name(path: str) -> str:
    return f"{path}.{os.getpid()}.{time.time_ns()}.tmp"


def _write_durably(path: str, data: bytes) -> None:
    tmp = _temporary_name(path)
    try:
        # 0600: it holds every tenant's prompts and generated tokens.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            # Held until the rename: a cleaner never removes a live writer's file.
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            if os.fstat(f.fileno()).st_nlink == 0:
                # A cleaner took it between our open and our lock: the next
                # checkpoint is the retry.
                raise OSError("the temporary file was removed as stale; try again")
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path) or ".")
    except OSError as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise OSError(f"checkpoint {path}: {e}") from e


def _clean_stale_temporaries(path: str) -> None:
    """Remove the temporary files of writers to `path` that died before they
    could (best effort: a file that cannot be removed stays)."""
    directory, base = os.path.split(path)
    pattern = re.compile(re.escape(base) + r"\.\d+\.\d+\.tmp")
    try:
        names = [n for n in os.listdir(directory or ".") if pattern.fullmatch(n)]
    except OSError:
        return
    for n in names:
        tmp = os.path.join(directory, n)
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live writer holds it
            now = os.stat(tmp, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.remove(tmp)
        except OSError:
            pass
        finally:
            os.close(fd)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
