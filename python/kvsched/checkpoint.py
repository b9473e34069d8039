"""Scheduler checkpoints on disk: the file format and the durable write.

Who owns what:

- The scheduler (the Rust core, through the bindings) owns the *records*.
  ``Scheduler.checkpoint_records()`` hands out the requests finished since the
  drain began and every unfinished one as plain dicts, each with a ``"kind"``;
  ``Scheduler.restore_records(records, now=)`` takes in-flight records back,
  checks every one before submitting any (a bad record raises InvalidRequest
  and nothing changes) and submits them again.
- This module owns the *file*: the format below, the durable write and reading
  it back. ``Scheduler.checkpoint(path)`` and ``Scheduler.restore(path, now=)``
  are :func:`save` and :func:`restore` called on the scheduler.

The format: UTF-8 JSON lines, one record (a JSON object) a line, blank lines
ignored. A record's ``"kind"`` says what it is:

- ``"finished"``: a request that finished while the scheduler drained
  (request_id, tenant, reason, prompt_len, output_ids, arrival, finished,
  cached_tokens). Restore returns these as they are.
- ``"in_flight"``: an unfinished request (request_id, tenant, reason,
  prompt_ids, generated_ids, max_tokens, stop_token_ids, cache_salt_hex,
  arrival). Restore submits it again to continue after generated_ids.

A reader refuses a kind it does not know, so a file that needs more than this
reader knows is never half understood. That is where the format grows: a
later version can add a first line of a new kind (a header with a format
version and a checksum of the records, for an all-or-nothing restore) and a
reader that knows it, in :data:`_KINDS` and :func:`read_records`.

The write is durable: the text goes to a temporary file in the target's
directory (its own name, so two checkpoints to one path never mix), which is
flushed and fsync'd, renamed over the target, and the directory is fsync'd so
that the rename itself survives a crash. On an error the temporary file is
removed and the target is left as it was.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvsched._core import InvalidRequest

if TYPE_CHECKING:
    from kvsched._core import (
        CheckpointCounts,
        FinishedRecord,
        InFlightRecord,
        RestoreResult,
        Scheduler,
    )

    CheckpointRecord = FinishedRecord | InFlightRecord

__all__ = ["read_records", "restore", "save", "write_records"]

# Every kind a record may have, in the order a file holds them.
_KINDS = ("finished", "in_flight")


def save(scheduler: Scheduler, path: str | os.PathLike[str]) -> CheckpointCounts:
    """Write `scheduler`'s checkpoint records to `path` (see the module's
    docstring for the format and the durable write). Returns the counts:
    {"finished": n, "in_flight": n}."""
    records = scheduler.checkpoint_records()
    write_records(path, records)
    return {
        "finished": sum(1 for r in records if r["kind"] == "finished"),
        "in_flight": sum(1 for r in records if r["kind"] == "in_flight"),
    }


def restore(
    scheduler: Scheduler, path: str | os.PathLike[str], *, now: float | None = None
) -> RestoreResult:
    """Read the checkpoint at `path` and submit its in-flight requests to
    `scheduler` again (every record is checked before any is submitted).
    Returns {"restored": {old id: new id}, "refused": {old id: reason},
    "finished": [the finished records]}."""
    records = read_records(path)
    finished: list[FinishedRecord] = []
    in_flight: list[InFlightRecord] = []
    for r in records:
        if r["kind"] == "finished":
            finished.append(r)
        else:
            in_flight.append(r)
    out = scheduler.restore_records(in_flight, now=now)
    return {"restored": out["restored"], "refused": out["refused"], "finished": finished}


def write_records(path: str | os.PathLike[str], records: Iterable[CheckpointRecord]) -> None:
    """Write `records` as JSON lines to `path`, durably."""
    path = os.fspath(path)
    text = "".join(json.dumps(r) + "\n" for r in records)
    tmp = f"{path}.{os.getpid()}.{time.time_ns()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
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


def read_records(path: str | os.PathLike[str]) -> list[CheckpointRecord]:
    """The records of the checkpoint at `path`, in file order. Raises OSError
    when it cannot be read, InvalidRequest for a line that is not a JSON object
    or a record of an unknown kind (json.JSONDecodeError for a line that is not
    JSON). The in-flight records' fields are checked by the scheduler."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise OSError(f"restore {os.fspath(path)}: {e}") from e
    records: list[Any] = []
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if not isinstance(rec, dict):
            raise InvalidRequest(f"invalid request: checkpoint line {n}: not an object")
        kind = rec.get("kind", "")
        if kind not in _KINDS:
            raise InvalidRequest(f"invalid request: checkpoint line {n}: unknown kind {kind!r}")
        records.append(rec)
    return records


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
