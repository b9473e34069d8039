"""Readers for request traces. The two public traces ship inside the package,
gzip-compressed, as kvsched/data/traces/ (its README carries their sources,
attribution and licenses); `bundled` names them, `open_trace` reads either
those or any file (plain or .gz).

mooncake_synthetic.jsonl (kvcache-ai/Mooncake, FAST'25; Apache-2.0) names each
512-token block of a prompt by a hash id: equal ids are equal content (and, the
ids being prefix-chained, an equal prefix). The trace has no token ids, so
`mooncake_prompt` builds them: every id gets its own 512 pseudo-random tokens,
the same wherever it appears, so equal ids are equal tokens and different ids
differ somewhere in their 512 (a pseudo-random stream per id).
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import itertools
import json
import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO, Any

import numpy as np

if sys.version_info >= (3, 11):
    from importlib.resources.abc import Traversable
else:  # pragma: no cover
    from importlib.abc import Traversable

MOONCAKE_BLOCK = 512
VOCAB = 32000


BUNDLED = {
    "azure": "azure_code_2023.csv.gz",
    "mooncake": "mooncake_synthetic.jsonl.gz",
}
"""The traces shipped as package data (kvsched/data/traces), by short name."""


def bundled(name: str) -> Traversable:
    """The bundled trace `name` ("azure" or "mooncake"), read through
    importlib.resources: it works from an installed wheel or a zip as well as
    from a checkout."""
    if name not in BUNDLED:
        raise ValueError(f"no bundled trace {name!r}; known: {', '.join(sorted(BUNDLED))}")
    return resources.files("kvsched") / "data" / "traces" / BUNDLED[name]


@contextmanager
def open_trace(path: str | Path | Traversable) -> Iterator[IO[str]]:
    """A trace as text: a path or a package resource, gunzipped when its name
    ends in .gz."""
    src = Path(path) if isinstance(path, str) else path
    with src.open("rb") as raw:
        if src.name.endswith(".gz"):
            with gzip.open(raw, "rt", encoding="utf-8", newline="") as f:
                yield f
        else:
            with io.TextIOWrapper(raw, encoding="utf-8", newline="") as f:
                yield f


@dataclass(frozen=True)
class MooncakeRequest:
    arrival: float
    """Seconds from the start of the trace."""
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_mooncake(
    path: str | Path | Traversable | None = None, limit: int | None = None
) -> list[MooncakeRequest]:
    """The trace's requests in arrival order (the first `limit` of them); the
    bundled mooncake_synthetic trace when `path` is None."""
    path = bundled("mooncake") if path is None else path
    out: list[MooncakeRequest] = []
    with open_trace(path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            r = json.loads(line)
            n, ids = int(r["input_length"]), tuple(int(h) for h in r["hash_ids"])
            if not (ids and (len(ids) - 1) * MOONCAKE_BLOCK < n <= len(ids) * MOONCAKE_BLOCK):
                raise ValueError(f"{path}: {n} tokens do not match {len(ids)} blocks of 512")
            out.append(MooncakeRequest(r["timestamp"] / 1000.0, n, int(r["output_length"]), ids))
    out.sort(key=lambda r: r.arrival)
    return out


def mooncake_prompt(req: MooncakeRequest) -> np.ndarray:
    """int32 token ids for a request: block i holds hash id i's tokens."""
    return hashed_prompt(req.hash_ids, req.input_length)


def mooncake_ceiling(reqs: list[MooncakeRequest]) -> tuple[float, float]:
    """The best any prefix cache could do on this trace: the share of 512-token
    blocks seen before (by any earlier request), and the same share weighted by
    the tokens of each block (a prompt's last block is partial)."""
    seen: set[int] = set()
    blocks = hit_blocks = tokens = hit_tokens = 0
    for r in reqs:
        for i, h in enumerate(r.hash_ids):
            n = min(MOONCAKE_BLOCK, r.input_length - i * MOONCAKE_BLOCK)
            blocks += 1
            tokens += n
            if h in seen:
                hit_blocks += 1
                hit_tokens += n
            seen.add(h)
    return hit_blocks / blocks, hit_tokens / tokens


def mooncake_ceiling_at(reqs: list[MooncakeRequest], block_size: int) -> tuple[float, float]:
    """`mooncake_ceiling` counted the way the scheduler counts its prefix cache,
    on `block_size`-token blocks (a divisor of 512): a request queries its
    prompt's full blocks but the last token's ((n - 1) // block_size of them),
    and a block is a possible hit when an earlier request's prompt held it whole.
    Returns (the share of queried blocks, hit tokens over prompt tokens), the
    ceilings of ReplayResult.block_hit_rate and token_hit_rate at that size."""
    if block_size < 1 or MOONCAKE_BLOCK % block_size:
        raise ValueError(f"block_size {block_size} does not divide {MOONCAKE_BLOCK}")
    per = MOONCAKE_BLOCK // block_size
    seen: set[tuple[int, int]] = set()
    queried = hits = tokens = 0
    for r in reqs:
        # Block k lies in 512-token block k // per at offset k % per; the ids
        # being prefix-chained, an equal (id, offset) is an equal prefix.
        keys = [(r.hash_ids[k // per], k % per) for k in range(r.input_length // block_size)]
        q = (r.input_length - 1) // block_size
        queried += q
        hits += sum(key in seen for key in keys[:q])
        tokens += r.input_length
        seen.update(keys)
    return hits / max(1, queried), hits * block_size / max(1, tokens)


@dataclass(frozen=True)
class AzureRequest:
    arrival: float
    """Seconds from the first request of the trace."""
    context_tokens: int
    generated_tokens: int


def read_azure(
    path: str | Path | Traversable | None = None, limit: int | None = None
) -> list[AzureRequest]:
    """azure_code_2023.csv (Azure/AzurePublicDataset, CC-BY 4.0): TIMESTAMP,
    ContextTokens, GeneratedTokens, in arrival order; the bundled copy when
    `path` is None."""
    import csv
    from datetime import datetime

    path = bundled("azure") if path is None else path
    rows: list[tuple[datetime, int, int]] = []
    with open_trace(path) as f:
        for i, r in enumerate(csv.DictReader(f)):
            if limit is not None and i >= limit:
                break
            stamp = r["TIMESTAMP"].strip()
            # Seven fractional digits: keep the six datetime parses.
            if "." in stamp:
                head, frac = stamp.split(".", 1)
                stamp = f"{head}.{frac[:6]}"
            rows.append(
                (datetime.fromisoformat(stamp), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
            )
    if not rows:
        return []
    t0 = min(t for t, _, _ in rows)
    out = [AzureRequest((t - t0).total_seconds(), c, g) for t, c, g in rows]
    out.sort(key=lambda r: r.arrival)
    return out


# -- any trace ------------------------------------------------------------------
# A generic request trace, CSV (a header row) or JSON lines (one object a line):
#   prompt_tokens   int >= 1   required
#   output_tokens   int >= 1   required (the request's max_tokens)
#   arrival_s       float >= 0 optional: seconds, in any order (the reader sorts,
#                              stably, and shifts the first to 0); all rows or none
#   tenant          str        optional (default "default"; 1 to 128 bytes)
#   hash_ids        list[int]  optional: the prompt's blocks of HASH_BLOCK (512)
#                              tokens, named as in the Mooncake trace (equal ids,
#                              equal tokens); in CSV "[1, 2, 3]" or "1 2 3"
# Other columns are ignored. A bad value is a TraceError naming the file, line
# and column.

GENERIC_COLUMNS = ("prompt_tokens", "output_tokens", "arrival_s", "tenant", "hash_ids")
REQUIRED_COLUMNS = ("prompt_tokens", "output_tokens")
HASH_BLOCK = MOONCAKE_BLOCK
DEFAULT_TENANT = "default"
IN_MEMORY = "records"


class TraceError(ValueError):
    """A trace file written wrong: the message names the file, the line and the
    column, and what was expected there."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a generic trace."""

    prompt_tokens: int
    output_tokens: int
    arrival_s: float | None = None
    tenant: str = DEFAULT_TENANT
    hash_ids: tuple[int, ...] | None = None
    line: int = 0
    """Where it was read (1-based line of the file; the index + 1 in memory)."""


def _fail(where: str, line: int, column: str, msg: str) -> TraceError:
    unit = "record" if where == IN_MEMORY else "line"  # records in memory: their index + 1
    return TraceError(f"{where}: {unit} {line}, column {column!r}: {msg}")


def _int_value(v: Any) -> int | None:
    """v as an int when it is one (12, "12", 12.0, "12.0"), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        v = v.strip()
        try:
            return int(v)
        except ValueError:
            try:
                v = float(v)
            except ValueError:
                return None
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    return None


def _record(raw: Mapping[str, Any], where: str, line: int, hash_block: int) -> TraceRequest:
    def blank(v: Any) -> bool:
        return v is None or (isinstance(v, str) and not v.strip())

    for col in REQUIRED_COLUMNS:
        if col not in raw:
            raise _fail(where, line, col, "missing (required: prompt_tokens, output_tokens)"
                        + _format_hint(raw))  # fmt: skip
    tokens = []
    for col in REQUIRED_COLUMNS:
        n = None if blank(raw[col]) else _int_value(raw[col])
        if n is None or n < 1:
            raise _fail(where, line, col, f"expected an integer >= 1, got {raw[col]!r}")
        tokens.append(n)
    arrival = None
    if not blank(raw.get("arrival_s")):
        v = raw["arrival_s"]
        try:
            arrival = float(v.strip() if isinstance(v, str) else v)
        except (TypeError, ValueError):
            arrival = None
        if isinstance(v, bool) or arrival is None or not (math.isfinite(arrival) and arrival >= 0):
            raise _fail(where, line, "arrival_s", f"expected seconds >= 0, got {v!r}")
    tenant = DEFAULT_TENANT
    if not blank(raw.get("tenant")):
        tenant = raw["tenant"]
        if not isinstance(tenant, str):
            raise _fail(where, line, "tenant", f"expected a name, got {tenant!r}")
        tenant = tenant.strip()
        if len(tenant.encode()) > 128:
            raise _fail(where, line, "tenant", "a tenant name is 1 to 128 bytes")
    ids = None
    v = raw.get("hash_ids")
    if isinstance(v, str):
        parts = v.strip().strip("[]").replace(",", " ").replace(";", " ").split()
        parsed = [_int_value(p) for p in parts]
        v = parsed if all(p is not None for p in parsed) else v
    if not blank(v) and v != []:
        if not isinstance(v, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**63 for h in v
        ):
            raise _fail(where, line, "hash_ids",
                        f"expected a list of integers from 0 to 2**63-1, got {v!r}")  # fmt: skip
        ids = tuple(v)
        n = tokens[0]
        if not (len(ids) - 1) * hash_block < n <= len(ids) * hash_block:
            raise _fail(
                where, line, "hash_ids",
                f"{len(ids)} ids name blocks of {hash_block} tokens: they hold "
                f"{(len(ids) - 1) * hash_block + 1} to {len(ids) * hash_block} prompt tokens, "
                f"prompt_tokens is {n}",
            )  # fmt: skip
    return TraceRequest(tokens[0], tokens[1], arrival, tenant, ids, line)


def _format_hint(columns: Iterable[str]) -> str:
    """A pointer to --trace azure / mooncake when the columns are theirs."""
    cols = set(columns)
    if {"ContextTokens", "GeneratedTokens"} <= cols:
        return " (this is the Azure trace's format: --trace azure --trace-path FILE)"
    if {"input_length", "output_length"} <= cols:
        return " (this is the Mooncake trace's format: --trace mooncake --trace-path FILE)"
    return ""


def _is_jsonl(name: str, first: str) -> bool:
    stem = name[:-3] if name.endswith(".gz") else name
    if stem.endswith((".jsonl", ".json", ".ndjson")):
        return True
    if stem.endswith(".csv"):
        return False
    return first.lstrip().startswith("{")


def read_requests(
    source: str | Path | Traversable | Iterable[Mapping[str, Any]],
    *,
    limit: int | None = None,
    hash_block: int = HASH_BLOCK,
) -> list[TraceRequest]:
    """A generic trace's requests (the first `limit` of the file): a CSV or
    JSON-lines file (plain or .gz; JSON lines when the name ends in .jsonl,
    .json or .ndjson, CSV when .csv, otherwise told by the first character), or
    records in memory (dicts with the same keys). Arrivals are sorted (stably)
    and shifted so the first is at 0 s; either every request has arrival_s or
    none has. Raises TraceError naming the line and column of the first bad value."""
    if hash_block < 1:
        raise TraceError(f"hash_block must be >= 1 tokens, got {hash_block}")
    out: list[TraceRequest] = []
    if isinstance(source, (str, Path)) or hasattr(source, "joinpath"):
        where = str(source)
        with open_trace(source) as f:  # type: ignore[arg-type]
            first = f.readline()
            rest = itertools.chain([first], f)
            if _is_jsonl(Path(where).name, first):
                for i, text in enumerate(rest, 1):
                    if limit is not None and len(out) >= limit:
                        break
                    if not text.strip():
                        continue
                    if not out and text.lstrip().startswith("["):
                        raise TraceError(f"{where}: line {i}: a JSON array; expected JSON "
                                         "lines, one object a line")  # fmt: skip
                    try:
                        raw = json.loads(text)
                    except json.JSONDecodeError as e:
                        raise TraceError(f"{where}: line {i}: not JSON ({e.msg})") from None
                    if not isinstance(raw, dict):
                        raise TraceError(f"{where}: line {i}: expected a JSON object")
                    out.append(_record(raw, where, i, hash_block))
            else:
                import csv

                reader = csv.reader(rest)
                header = next(reader, None)
                if header is None:
                    raise TraceError(f"{where}: empty file (expected a header row)")
                # A spreadsheet's UTF-8 export starts with a byte-order mark.
                header = [h.strip().lstrip("\ufeff").strip() for h in header]
                for col in REQUIRED_COLUMNS:
                    if col not in header:
                        raise _fail(where, 1, col, f"missing from the header {header}"
                                    + _format_hint(header))  # fmt: skip
                for row in reader:
                    if limit is not None and len(out) >= limit:
                        break
                    if not any(c.strip() for c in row):
                        continue
                    if len(row) != len(header):
                        raise TraceError(f"{where}: line {reader.line_num}: {len(row)} fields, "
                                         f"the header has {len(header)}")  # fmt: skip
                    out.append(_record(dict(zip(header, row, strict=True)), where, reader.line_num,
                                       hash_block))  # fmt: skip
    else:
        where = IN_MEMORY
        for i, raw in enumerate(source, 1):
            if limit is not None and len(out) >= limit:
                break
            if not isinstance(raw, Mapping):
                raise TraceError(f"{where}: record {i}: expected a mapping, got {raw!r}")
            out.append(_record(raw, where, i, hash_block))
    if not out:
        raise TraceError(f"{where}: no requests")
    timed = [r.arrival_s is not None for r in out]
    if any(timed) and not all(timed):
        r = out[timed.index(not timed[0])]
        raise _fail(where, r.line, "arrival_s",
                    "given on some requests only: give it on every request or on none")  # fmt: skip
    if all(timed):
        t0 = min(r.arrival_s for r in out)  # type: ignore[type-var]
        out = [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in out]  # type: ignore[operator]
        out.sort(key=lambda r: r.arrival_s)  # type: ignore[arg-type,return-value]
    return out


def hashed_prompt(hash_ids: Iterable[int], n: int, block: int = MOONCAKE_BLOCK) -> np.ndarray:
    """int32 token ids of an `n`-token prompt whose block i (of `block` tokens)
    holds hash id i's tokens: the same ids give the same tokens, so requests
    sharing leading ids share a prefix."""
    ids = np.asarray(tuple(hash_ids), dtype=np.uint64)[:, None]
    j = np.arange(block, dtype=np.uint64)[None, :]
    # A multiplicative mix of (id, offset), folded into the vocabulary.
    x = (ids * np.uint64(block) + j + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    tokens = ((x >> np.uint64(33)) % np.uint64(VOCAB)).astype(np.int32)
    return tokens.reshape(-1)[:n]
