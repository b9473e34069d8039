"""The mooncake trace reader and the prefix-cache replay through the real scheduler."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvsched.sim.prefix_replay import replay, tenant_of
from kvsched.sim.traces import (
    MooncakeRequest,
    mooncake_ceiling,
    mooncake_prompt,
    read_mooncake,
)

HEAD = Path(__file__).parent / "data" / "mooncake_head600.jsonl"


def test_equal_hash_ids_are_equal_tokens_and_different_ids_differ():
    a = MooncakeRequest(0.0, 1100, 1, (7, 8, 9))
    b = MooncakeRequest(0.0, 1030, 1, (7, 8, 5))
    pa, pb = mooncake_prompt(a), mooncake_prompt(b)
    assert pa.dtype == np.int32 and len(pa) == 1100 and len(pb) == 1030
    assert np.array_equal(pa[:1024], pb[:1024])
    assert pa[1024] != pb[1024], "another id differs from its first token"
    assert (pa >= 0).all() and (pa < 32000).all()


def test_ceiling_counts_blocks_seen_before_and_weights_partial_blocks():
    reqs = [
        MooncakeRequest(0.0, 1024, 1, (1, 2)),
        MooncakeRequest(1.0, 612, 1, (1, 3)),  # block 1 seen; block 3 holds 100 tokens
    ]
    blocks, tokens = mooncake_ceiling(reqs)
    assert blocks == 1 / 4
    assert tokens == 512 / (1024 + 612)


def test_reader_refuses_lengths_that_do_not_match_the_blocks(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 2000, "output_length": 3,
                               "hash_ids": [1, 2]}) + "\n")  # fmt: skip
    with pytest.raises(ValueError, match="do not match"):
        read_mooncake(bad)
    reqs = read_mooncake(HEAD, limit=5)
    assert len(reqs) == 5 and reqs[0].input_length == 40160 and reqs[0].hash_ids[:2] == (0, 1)


def test_replay_hit_rate_grows_with_the_pool_up_to_the_ceiling():
    reqs = read_mooncake(HEAD)
    _, ceiling = mooncake_ceiling(reqs)
    small, large = replay(reqs, 1 << 18), replay(reqs, 1 << 22)
    for r in (small, large):
        assert r.finished == len(reqs) and r.rejected == 0
        # What the cache did not serve was computed, exactly once (no preemption).
        assert r.prefill_tokens == r.query_tokens - r.hit_tokens
        assert r.query_tokens == sum(q.input_length for q in reqs)
    assert small.token_hit_rate < large.token_hit_rate <= ceiling
    # With the working set in memory, most of what could be hit is.
    assert large.token_hit_rate > 0.7 * ceiling
    assert small.evictions > large.evictions


def test_replay_split_over_tenants_keeps_prefixes_together_and_the_partition_costs_hits():
    reqs = read_mooncake(HEAD)
    # Requests that share a first block (any common prefix) share a tenant.
    by_first: dict[int, int] = {}
    for r in reqs:
        assert by_first.setdefault(r.hash_ids[0], tenant_of(r, 4)) == tenant_of(r, 4)
    shares = [sum(tenant_of(r, 4) == t for r in reqs) for t in range(4)]
    assert min(shares) > len(reqs) // 8, shares
    pool = 1 << 20
    shared = replay(reqs, pool, tenants=4, floors=True)
    parted = replay(reqs, pool, tenants=4, floors=True, partition="tenant")
    for r in (shared, parted):
        assert r.finished + r.rejected == len(reqs)
        assert r.prefill_tokens == r.query_tokens - r.hit_tokens
    assert shared.rejected == parted.rejected == 0
    # Cached blocks kept within each tenant's unused floor are fewer than one
    # LRU over the whole pool keeps: fewer hits, never more here.
    assert 0 < parted.hit_tokens < shared.hit_tokens


# -- the hit rate and its ceiling on the same blocks --------------------------


def test_the_ceiling_is_counted_on_the_caches_blocks_and_bounds_the_hit_rate():
    from kvsched.sim.traces import mooncake_ceiling_at

    reqs = read_mooncake(HEAD, limit=300)
    blocks, tokens = mooncake_ceiling_at(reqs, 16)
    big = replay(reqs, 1 << 24)  # nothing evicted: as close to the ceiling as timing allows
    assert big.evictions == 0
    assert big.query_blocks == sum((r.input_length - 1) // 16 for r in reqs)
    assert big.block_hit_rate <= blocks and big.token_hit_rate <= tokens
    assert big.block_hit_rate > 0.6 * blocks
    # By hand: the second request shares the first 512-token block (32 blocks
    # of 16); its second id differs, so nothing after that is a possible hit.
    a = MooncakeRequest(0.0, 1024, 1, (1, 2))
    b = MooncakeRequest(1.0, 612, 1, (1, 3))
    blocks, tokens = mooncake_ceiling_at([a, b], 16)
    queried = (1024 - 1) // 16 + (612 - 1) // 16  # 63 + 38
    assert blocks == 32 / queried and tokens == 32 * 16 / (1024 + 612)
    with pytest.raises(ValueError, match="does not divide"):
        mooncake_ceiling_at([a], 24)


def test_prefix_replay_prints_the_hit_rate_beside_its_ceiling_on_the_same_blocks(capsys):
    from kvsched.sim import prefix_replay
    from kvsched.sim.traces import mooncake_ceiling_at

    prefix_replay.main([str(HEAD), "--limit", "100", "--pools", "16777216"])
    out = capsys.readouterr().out.splitlines()
    blocks, tokens = mooncake_ceiling_at(read_mooncake(HEAD, limit=100), 16)
    assert "ceiling on 16-token blocks (as the cache counts, the columns below)" in out[1]
    head = out[3].split()
    assert head[:7] == ["pool", "tokens", "cache", "block", "hits", "ceiling", "token"]
    row = out[4].split()
    assert row[3] == f"{blocks:.1%}" and row[5] == f"{tokens:.1%}"
    assert float(row[2].rstrip("%")) <= float(row[3].rstrip("%"))
