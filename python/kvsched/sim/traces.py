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

import gzip
import io
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO

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
    return resources.files("kvsched").joinpath("data", "traces", BUNDLED[name])


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
    ids = np.asarray(req.hash_ids, dtype=np.uint64)[:, None]
    j = np.arange(MOONCAKE_BLOCK, dtype=np.uint64)[None, :]
    # A multiplicative mix of (id, offset), folded into the vocabulary.
    x = (ids * np.uint64(MOONCAKE_BLOCK) + j + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    tokens = ((x >> np.uint64(33)) % np.uint64(VOCAB)).astype(np.int32)
    return tokens.reshape(-1)[: req.input_length]


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
