"""An independent reader of KV events, as a router would be: msgpack decoded by
the published schema (vLLM's KV-event batch: `[timestamp, events,
data_parallel_rank]`, each event a map with a "type"), checked field by field,
and applied to the set of blocks a replica holds. It shares no code with the
encoder (rust/pool/events.rs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

msgpack = pytest.importorskip("msgpack")

STORED_KEYS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
               "lora_id", "medium", "lora_name"}  # fmt: skip
STORED_OPTIONAL = {"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
REMOVED_KEYS = {"type", "block_hashes", "medium"}
REMOVED_OPTIONAL = {"group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}


def _hash(h: Any) -> int:
    assert isinstance(h, int) and 0 <= h < 1 << 64, f"a block hash is a uint64, not {h!r}"
    return h


@dataclass
class Replica:
    """What a router knows of one replica: its cached blocks by (group, hash),
    each with the whole token prefix up to its end where the parent chain is
    known (None where a parent was never seen)."""

    block_size: int
    # A removal of a block never stored is an error, unless the stream was
    # cut short (an AllBlocksCleared for an undrained log: routers ignore those).
    strict: bool = True
    blocks: dict[tuple[int, int], tuple[int, ...] | None] = field(default_factory=dict)
    batches: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    extra_keys: list[Any] = field(default_factory=list)  # (hash, key) per stored block
    groups_seen: set[int] = field(default_factory=set)
    ever: set[tuple[int, int]] = field(default_factory=set)  # every block ever stored
    orphans: dict[int, int] = field(default_factory=dict)  # group -> parents never stored

    def apply(self, payload: bytes) -> None:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        assert isinstance(batch, list) and len(batch) == 3, batch
        ts, events, rank = batch
        assert isinstance(ts, float) and ts > 0
        assert isinstance(rank, int) and rank == 0
        assert isinstance(events, list) and events, "a batch is published only with events"
        self.batches += 1
        for e in events:
            self._event(e)

    def _event(self, e: dict[str, Any]) -> None:
        kind = e["type"]
        if kind == "AllBlocksCleared":
            assert set(e) == {"type"}
            self.blocks.clear()
            self.cleared += 1
        elif kind == "BlockStored":
            assert STORED_KEYS <= set(e) <= STORED_KEYS | STORED_OPTIONAL, set(e)
            assert e["block_size"] == self.block_size
            assert e["lora_id"] is None and e["lora_name"] is None and e["medium"] == "GPU"
            hashes = [_hash(h) for h in e["block_hashes"]]
            assert hashes, "BlockStored names at least one block"
            tokens = e["token_ids"]
            assert len(tokens) == len(hashes) * self.block_size
            assert all(isinstance(t, int) and t >= 0 for t in tokens)
            group = e.get("group_idx", 0)
            self.groups_seen.add(group)
            if "extra_keys" in e:
                assert len(e["extra_keys"]) == len(hashes)
                self.extra_keys.extend(zip(hashes, map(tuple, e["extra_keys"]), strict=True))
            parent = e["parent_block_hash"]
            prefix: tuple[int, ...] | None = ()
            if parent is not None:
                prefix = self.blocks.get((group, _hash(parent)))
                if (group, parent) not in self.ever:
                    self.orphans[group] = self.orphans.get(group, 0) + 1
            for i, h in enumerate(hashes):
                block = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
                prefix = None if prefix is None else prefix + block
                assert (group, h) not in self.blocks, f"block {h} of group {group} stored twice"
                self.blocks[(group, h)] = prefix
                self.ever.add((group, h))
                self.stored += 1
        elif kind == "BlockRemoved":
            assert REMOVED_KEYS <= set(e) <= REMOVED_KEYS | REMOVED_OPTIONAL, set(e)
            assert e["medium"] == "GPU"
            group = e.get("group_idx", 0)
            for h in e["block_hashes"]:
                known = (group, _hash(h)) in self.blocks
                assert known or not self.strict, f"removal of unknown block {h}"
                self.blocks.pop((group, h), None)
                self.removed += 1
        else:
            raise AssertionError(f"unknown event type {kind!r}")
