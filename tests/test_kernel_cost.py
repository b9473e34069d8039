"""The kernel cost model (kvsched.engine.kernels.cost): its counts on plans small
enough to count by hand, the bounds a bandwidth-bound kernel meets on the
decode and prefill cases of docs/kernels.md, and its kernel descriptions held
to the Mosaic programs the kernels export for TPU (kvsched's kernels/tpu.py
and JAX's ragged_paged_attention) and to the DMAs kvsched's runs in Pallas'
interpreter. ours_tpu_v1 / ours_gpu_v1 describe kvsched's removed version 1
kernels, kept in the model for comparison."""

from __future__ import annotations

import functools

import pytest

from kvsched.engine.kernels import cost as C
from kvsched.engine.kernels import tiling

# q heads 2, KV heads 1 (group 2), head_dim 8, pages of 4 tokens, bf16:
# one page of every head, K and V, is 4 * 2 * 1 * 8 * 2 = 128 bytes.
SMALL = C.Shapes(q_heads=2, kv_heads=1, head_dim=8, page_size=4)
# A decode (kv 5) then a 3-token chunk (kv 7): rows 0 and 1..3.
MIXED = C.Plan(q_lens=(1, 3), kv_lens=(5, 7))


def test_small_shapes_page_bytes():
    assert SMALL.page_bytes == 128 and SMALL.group == 2
    assert C.LLAMA3_8B.page_bytes == 16 * 16 * 128 * 2 == 64 * 1024


def test_todays_tpu_kernel_counts_by_hand():
    """Version 1's description, block_q 2: block 0 = rows 0, 1 meets both
    sequences, block 1 = rows 2, 3 meets the chunk only; no causal bound, so
    every visit reads the sequence's whole KV: 2 + 2 + 2 pages, one DMA and one
    wait each."""
    c = C.count(MIXED, SMALL, C.ours_tpu_v1(block_q=2))
    assert (c.grid_steps, c.pairs, c.seq_visits) == (2, 3, 4)  # 2 blocks x 2 seqs scanned
    assert (c.kv_blocks, c.dma_starts, c.dma_waits, c.chains) == (6, 6, 6, 3)
    assert c.kv_bytes_moved == 6 * 128
    assert c.kv_bytes_needed == (5 + 7) * 2 * 8 * 2 == 384
    assert c.reread == 2.0
    # M = block_q x group = 4 rows per matmul, 4 keys per page, D 8: 2 matmuls of
    # 2*M*N*D per page and KV head.
    assert c.mxu_flops == 6 * 4 * 4 * 4 * 8
    assert c.useful_flops == 4 * (1 * 2 * 5 * 8 + 3 * 2 * 7 * 8)
    assert c.qo_bytes == 2 * 4 * 2 * 8 * 2  # q in, out back: T=4 rows of 2 heads x 8


def test_jax_kernel_moves_whole_blocks_by_hand():
    """JAX's kernel DMAs pages_per_block pages per block whatever the sequence
    holds (the pages past its end read its first page again)."""
    c = C.count(MIXED, SMALL, C.jax_tpu(pages_per_block=4, block_q=4))
    assert (c.grid_steps, c.pairs, c.seq_visits) == (1, 2, 2)  # sequences carried, not scanned
    assert (c.kv_blocks, c.dma_starts, c.dma_waits, c.chains) == (2, 8, 8, 1)
    assert c.kv_bytes_moved == 8 * 128


def test_target_design_counts_by_hand():
    """One block of 4 rows; M is each sequence's own rows x group (2, then 6);
    one wait per block of 2 pages."""
    c = C.count(MIXED, SMALL, C.target_tpu(pages_per_block=2, block_q=4, depth=1))
    assert (c.kv_blocks, c.dma_starts, c.dma_waits, c.chains) == (2, 4, 2, 1)
    assert c.kv_bytes_moved == 4 * 128
    assert c.mxu_flops == 4 * 2 * 8 * 8 + 4 * 6 * 8 * 8


def test_causal_bound_by_hand():
    """An 8-token chunk ending at 16, blocks of 4 rows: without a causal bound
    each block reads all 4 pages; with it block 0 (positions 8..11) reads 3."""
    plan = C.Plan((8,), (16,))
    assert C.count(plan, SMALL, C.ours_tpu_v1(block_q=4)).kv_bytes_moved == 8 * 128
    target = C.target_tpu(pages_per_block=1, block_q=4, depth=1)
    assert C.count(plan, SMALL, target).kv_bytes_moved == (3 + 4) * 128


def test_tpu_v2_counts_by_hand():
    """block_q 2, blocks of 2 pages: block 0 (rows 0, 1) reads the decode (kv 5:
    2 pages) and the chunk's first row (position 4: bound 5, 2 pages); block 1
    (rows 2, 3) the chunk up to 7 (2 pages). One wait per block, one chain for
    the call (block 1's first block is started during block 0; before the
    cross-step prefetch, a chain per grid step), no scan of every sequence."""
    c = C.count(MIXED, SMALL, C.ours_tpu_v2(block_q=2, pages_per_block=2))
    assert (c.grid_steps, c.pairs, c.seq_visits) == (2, 3, 3)
    assert (c.kv_blocks, c.dma_starts, c.dma_waits, c.chains) == (3, 6, 3, 1)
    assert c.kv_bytes_moved == 6 * 128
    c = C.count(MIXED, SMALL, C.ours_tpu_v2(block_q=2, pages_per_block=2, across_steps=False))
    assert (c.kv_blocks, c.dma_starts, c.dma_waits, c.chains) == (3, 6, 3, 2)
    assert c.kv_bytes_moved == 6 * 128
    # Blocks are always full: 3 pages of a 2-page block re-read the first page.
    c = C.count(MIXED, SMALL, C.ours_tpu_v2(block_q=4, pages_per_block=4))
    assert (c.kv_blocks, c.dma_starts, c.dma_waits, c.chains) == (2, 8, 2, 1)
    # The causal bound: an 8-token chunk ending at 16, blocks of 4 rows.
    v2 = C.ours_tpu_v2(block_q=4, pages_per_block=1)
    assert C.count(C.Plan((8,), (16,)), SMALL, v2).kv_bytes_moved == (3 + 4) * 128


def test_gpu_v2_counts_by_hand():
    """block_q 2, sequence-aligned: the decode is a block of its own (2 pages
    of kv 5), the 3-row chunk two blocks (rows at positions 4-5: last 6, 2
    pages; position 6: 2 pages); the grid is ceil(4 / 2) + 2 programs; M is
    block_q x group = 4 rows for every page."""
    c = C.count(MIXED, SMALL, C.ours_gpu_v2(block_q=2, tile_pages=1))
    assert (c.grid_steps, c.pairs, c.seq_visits) == (4, 3, 3)
    assert (c.kv_blocks, c.dma_starts, c.dma_waits) == (6, 12, 6)  # K + V loads, one wait
    assert c.kv_bytes_moved == 6 * 128
    assert c.mxu_flops == 6 * 4 * 4 * 4 * 8
    # The causal bound: an 8-token chunk ending at 16 in blocks of 4 reads 3 + 4
    # pages, where the old GPU kernel reads 4 + 4.
    plan = C.Plan((8,), (16,))
    assert C.count(plan, SMALL, C.ours_gpu_v2(block_q=4, tile_pages=1)).kv_bytes_moved == 7 * 128
    assert C.count(plan, SMALL, C.ours_gpu_v1(block_q=4)).kv_bytes_moved == 8 * 128


def test_gpu_v2_kv_tiles_by_hand():
    """Tiles of 3 pages: every (block, head) program of MIXED (2 pages each)
    reads one tile, whole (3 pages, the third past the sequence's end), with one
    wait for its K and V gather loads."""
    c = C.count(MIXED, SMALL, C.ours_gpu_v2(block_q=2, tile_pages=3))
    assert (c.kv_blocks, c.dma_waits) == (3, 3)
    assert c.kv_bytes_moved == 3 * 3 * 128
    assert c.mxu_flops == 3 * 4 * 4 * 12 * 8  # M 4, 12 keys a tile, D 8


def test_gpu_v2_split_kv_by_hand():
    """MIXED, block_q 2, 2 splits: each (block, head) program's 2 pages go to 2
    programs of 1 page; the bytes and dots are unchanged, the grid doubles, each
    busy program starts its own chain, and the f32 partials (M 4 rows x (D 8 +
    max + denominator)) are written and read back once per program."""
    one = C.count(MIXED, SMALL, C.ours_gpu_v2(block_q=2, tile_pages=1))
    two = C.count(MIXED, SMALL, C.ours_gpu_v2(block_q=2, kv_splits=2, tile_pages=1))
    assert (two.kv_bytes_moved, two.mxu_flops, two.kv_blocks) == (
        one.kv_bytes_moved, one.mxu_flops, one.kv_blocks)  # fmt: skip
    assert (two.grid_steps, two.busy_programs, two.chains) == (8, 6, 6)
    assert (one.grid_steps, one.busy_programs, one.chains) == (4, 3, 3)
    assert two.qo_bytes == one.qo_bytes + 2 * 8 * 4 * (8 + 2) * 4
    # 3 splits of 2 pages: the third reads nothing (not busy, no chain).
    three = C.count(MIXED, SMALL, C.ours_gpu_v2(block_q=2, kv_splits=3, tile_pages=1))
    assert (three.grid_steps, three.busy_programs) == (12, 6)


def test_gpu_split_kv_fills_the_sms_for_one_long_sequence():
    """One 32k sequence gives version 1 of the GPU kernel 8 programs. The split
    the kernel picks from the shape (16) gives 128; the model's pipeline term
    shrinks with the busy programs, to over 90% of the H200's HBM bandwidth."""
    plan = C.Plan.decode(1, 32768)
    splits = tiling.gpu_kv_splits(1, 1, 8, 2048)
    assert splits == 16
    old = C.predict(plan, C.LLAMA3_8B, C.ours_gpu_v1(), "h200")
    flat = C.predict(plan, C.LLAMA3_8B, C.ours_gpu_v2(), "h200")
    split = C.predict(plan, C.LLAMA3_8B, C.ours_gpu_v2(kv_splits=splits), "h200")
    assert old.counts.grid_steps == 8 and flat.counts.busy_programs == 8
    assert split.counts.busy_programs == 128
    assert split.t_pipeline == pytest.approx(flat.t_pipeline / 16)
    assert old.hbm_fraction < 0.01 < flat.hbm_fraction < 0.25 < 0.9 < split.hbm_fraction
    # A full decode batch (2048 programs) is not split.
    assert tiling.gpu_kv_splits(256, 256, 8, 128) == 1


def test_gpu_v2_description_matches_the_kernels_program_table():
    """The model's (query block, sequence, rows) are the ones the kernel's own
    program_table makes on real plans, in the same order. (The kernel's grid
    also holds empty programs up to tokens / block_q + the plan's sequence
    SLOTS; the model counts its real sequences: empty programs load nothing.)"""
    pytest.importorskip("jax")
    import numpy as np
    from engine_helpers import plans

    from kvsched.engine.kernels.gpu import program_table

    for block_q in (1, 3):
        for _, _, inputs, plan, _ in plans(steps=6):
            cu = np.asarray(inputs.cu_q_lens)
            n = int(inputs.num_seqs[0])
            model_plan = C.Plan.from_arrays(cu, np.asarray(inputs.kv_lens), n, plan.bucket)
            pairs = [(s, rows) for _, s, rows, _ in C._pairs(model_plan, block_q, True)]
            seq, _, rows, _ = (np.asarray(a) for a in program_table(
                inputs.cu_q_lens, inputs.num_seqs, plan.bucket, block_q))  # fmt: skip
            assert pairs == [(int(s), int(r)) for s, r in zip(seq, rows, strict=True) if r]
            c = C.count(model_plan, C.Shapes(4, 2, 16, 4), C.ours_gpu_v2(block_q=block_q))
            assert c.grid_steps == (len(seq) - len(cu) + 1 + n) * 2


def test_gpu_kernel_counts_per_head_program():
    """One program per (query block, KV head), each loading its head's K and V
    tiles page by page: two loads per page and head."""
    shapes = C.Shapes(q_heads=4, kv_heads=2, head_dim=8, page_size=4)
    c = C.count(MIXED, shapes, C.ours_gpu_v1(block_q=4))
    assert c.grid_steps == 2  # 1 query block x 2 heads
    assert c.kv_blocks == 2 * 4  # (2 + 2 pages) per head
    assert c.dma_starts == c.dma_waits == 2 * 4 * 2
    assert c.kv_bytes_moved == 4 * shapes.page_bytes  # every page once, split over heads


def test_prediction_arithmetic_by_hand():
    """Version 1's TPU description on the small plan, v5e: every term of the formula."""
    dev = C.DEVICES["tpu-v5e"]
    p = C.predict(MIXED, SMALL, C.ours_tpu_v1(block_q=2), "tpu-v5e")
    c = p.counts
    bw, lat = dev.hbm_bytes_per_s, dev.dma_latency_s
    assert p.t_hbm == pytest.approx(c.bytes_moved / bw)
    # f32 matmuls: M 4 -> 8 sublanes, 4 keys -> 128, D 8 -> 128; 6 passes.
    assert c.mxu_flops_padded == c.mxu_f32_flops_padded == 6 * 2 * 2 * 8 * 128 * 128
    assert p.t_mxu == pytest.approx(c.mxu_flops_padded * 6 / dev.bf16_flops)
    per_block = max(lat + 128 / bw, p.t_mxu / 6)
    assert p.t_pipeline == pytest.approx(6 * per_block)
    assert p.t_scalar == pytest.approx(12 * dev.dma_issue_s + 4 * dev.scalar_iter_s)
    assert p.t_fixed == pytest.approx(3 * lat + 2 * dev.grid_step_s)
    assert p.step_s == pytest.approx(max(p.t_hbm, p.t_mxu, p.t_pipeline, p.t_scalar) + p.t_fixed)
    assert p.hbm_fraction == pytest.approx(384 / bw / p.step_s)


DECODE = C.Plan.decode(256, 2048)
PAGES = 256 * 2048 // 16


def ideal_bounds(c: C.Counts, pages_per_block: int, seqs: int = 256) -> tuple[bool, bool]:
    """The decode bounds of a bandwidth-bound kernel: bytes <= 1.1 x the KV to
    read, and DMA blocks (waits on a block) <= pages / pages-per-block +
    sequences."""
    return (
        c.kv_bytes_moved <= 1.1 * c.kv_bytes_needed,
        c.kv_blocks <= PAGES / pages_per_block + seqs,
    )


def test_decode_bounds_hold_for_the_target_and_jax_not_for_todays_kernel():
    needed = 256 * 2048 * 2 * 8 * 128 * 2
    target = C.target_tpu()
    t = C.count(DECODE, C.LLAMA3_8B, target)
    assert t.kv_bytes_needed == needed
    assert ideal_bounds(t, target.pages_per_block) == (True, True)
    assert t.kv_blocks == PAGES // target.pages_per_block
    assert t.dma_waits == t.kv_blocks  # one wait per block

    bkv, bq = C.jax_rpa_block_sizes(C.LLAMA3_8B, 256, 128)
    assert (bkv, bq) == (128, 32) and C.jax_rpa_kv_heads_per_block(C.LLAMA3_8B) == 8
    j = C.count(DECODE, C.LLAMA3_8B, C.jax_tpu(bkv, bq))
    assert ideal_bounds(j, bkv) == (True, True)
    assert (j.kv_blocks, j.dma_starts, j.dma_waits) == (256, PAGES, PAGES)

    # Version 1 reads the KV once (decode rows never straddle blocks), but
    # one page per DMA and a wait per page: 32x the target's DMA blocks, 25x the bound.
    o = C.count(DECODE, C.LLAMA3_8B, C.ours_tpu_v1())
    assert o.kv_bytes_moved == needed
    assert (o.kv_blocks, o.dma_starts, o.dma_waits) == (PAGES, PAGES, PAGES)
    assert ideal_bounds(o, target.pages_per_block) == (True, False)
    assert o.kv_blocks >= 10 * (PAGES / target.pages_per_block + 256)
    assert (o.grid_steps, o.chains, o.seq_visits) == (32, 256, 32 * 256)  # O(T x S) scan
    # M = 8 rows x 4 heads, of which 4 are real: 8x the useful matmul work.
    assert o.mxu_flops == 8 * o.useful_flops


def test_decode_and_prefill_for_tpu_v2():
    """The TPU kernel's description at its defaults for the decode case
    (block_q 2: M = 8, 32 pages per block, two in flight): the KV read once, in
    1024 blocks of 2 MiB, one wait each, within the decode bounds; 128 grid
    steps and one chain for the call (a cold chain per grid step without the
    cross-step prefetch). A
    512-token chunk at 2k in blocks of 128 rows (16 pages per block) reads up
    to each block's causal bound (104, 112, 120, 128 pages, rounded up to whole
    blocks of 16)."""
    bq = tiling.tpu_block_q(256, 256, C.LLAMA3_8B.group)
    ppb = tiling.tpu_pages_per_block(16, 128, decode=True)
    assert (bq, ppb) == (2, 32)
    v = C.count(DECODE, C.LLAMA3_8B, C.ours_tpu_v2(bq, ppb))
    assert ideal_bounds(v, ppb) == (True, True)
    assert (v.kv_blocks, v.dma_starts, v.dma_waits) == (PAGES // ppb, PAGES, PAGES // ppb)
    assert (v.grid_steps, v.chains, v.seq_visits) == (128, 1, 256)
    before = C.count(DECODE, C.LLAMA3_8B, C.ours_tpu_v2(bq, ppb, across_steps=False))
    assert (before.grid_steps, before.chains, before.seq_visits) == (128, 128, 256)
    assert before.kv_bytes_moved == v.kv_bytes_moved and before.dma_starts == v.dma_starts
    assert v.mxu_flops == 2 * v.useful_flops  # M = 8 rows, 4 of them real
    plan = C.Plan.prefill_chunk(512, 2048)
    ppb = tiling.tpu_pages_per_block(16, 128)
    assert ppb == 16
    p = C.count(plan, C.LLAMA3_8B, C.ours_tpu_v2(tiling.tpu_block_q(512, 1, 4), ppb))
    assert p.kv_blocks == 7 + 7 + 8 + 8 and p.kv_bytes_moved == 30 * 16 * 65536
    for dev in ("tpu-v5e", "tpu-v6e"):
        ours = C.predict(DECODE, C.LLAMA3_8B, C.ours_tpu_v1(), dev)
        new = C.predict(DECODE, C.LLAMA3_8B, C.ours_tpu_v2(bq, 32), dev)
        target = C.predict(DECODE, C.LLAMA3_8B, C.target_tpu(), dev)
        assert ours.hbm_fraction * 5 < new.hbm_fraction < target.hbm_fraction
        before = C.predict(plan, C.LLAMA3_8B, C.ours_tpu_v1(), dev)
        after = C.predict(plan, C.LLAMA3_8B, C.ours_tpu_v2(128, ppb), dev)
        assert after.step_s * 50 < before.step_s


def test_tpu_v2_decode_at_tpu_page_sizes():
    """The decode case (256 x 2k, Llama-3-8B heads) on v5e with pages of 16, 64
    and 128 tokens at version 2's default pages per block (32, 8, 4: 512 tokens,
    2 MiB per block at every size): the same 1024 blocks and waits and the same
    bytes; only the page DMAs drop (32768, 8192, 4096). The predicted HBM share
    does not change with the page size: the step is bandwidth bound (2.63 ms of
    HBM time) and the scalar unit's DMA issue work, its own bound under the
    stated 20 ns per DMA start or wait (0.68 ms at pages of 16, 0.19 at 64, 0.10
    at 128), stays below it. Larger pages buy headroom against that assumed
    constant, not a different prediction."""
    import dataclasses

    shares = []
    for ps, ppb in ((16, 32), (64, 8), (128, 4)):
        shapes = dataclasses.replace(C.LLAMA3_8B, page_size=ps)
        pages = 256 * 2048 // ps
        bq = tiling.tpu_block_q(256, 256, shapes.group)
        assert tiling.tpu_pages_per_block(ps, 2048 // ps, decode=True) == ppb
        p = C.predict(DECODE, shapes, C.ours_tpu_v2(bq, ppb), "tpu-v5e")
        c = p.counts
        assert (c.dma_starts, c.dma_waits, c.kv_blocks) == (pages, 1024, 1024)
        assert c.kv_bytes_moved == c.kv_bytes_needed and set(c.block_sizes) == {2 << 20}
        assert p.bound == "hbm" and p.t_scalar < p.t_hbm
        shares.append(p.hbm_fraction)
        # Without the cross-step prefetch: 128 grid steps, each with a cold first
        # fetch; with it, only the first. 127 exposed DMA latencies saved.
        v2_before = C.ours_tpu_v2(bq, ppb, across_steps=False)
        before = C.predict(DECODE, shapes, v2_before, "tpu-v5e")
        lat = C.DEVICES["tpu-v5e"].dma_latency_s
        assert before.step_s - p.step_s == pytest.approx(127 * lat)
        assert before.hbm_fraction < p.hbm_fraction
    assert shares[0] == pytest.approx(shares[1]) == pytest.approx(shares[2])


def test_decode_predictions_order_the_kernels():
    """Under the stated constants: version 1 of the TPU kernel is latency bound,
    far from the bandwidth (a few percent); the target design is bandwidth
    bound. The exact figures are in docs/kernels.md's table."""
    for dev in ("tpu-v5e", "tpu-v6e"):
        ours = C.predict(DECODE, C.LLAMA3_8B, C.ours_tpu_v1(), dev)
        target = C.predict(DECODE, C.LLAMA3_8B, C.target_tpu(), dev)
        jax_ = C.predict(DECODE, C.LLAMA3_8B, C.jax_tpu(128, 32), dev)
        assert ours.bound == "latency" and ours.hbm_fraction < 0.10
        assert target.bound == "hbm" and target.hbm_fraction > 0.9
        assert ours.hbm_fraction < jax_.hbm_fraction < target.hbm_fraction
        # Latency bound: 32768 page DMAs, each L + 64 KiB / BW, one in flight.
        d = C.DEVICES[dev]
        assert ours.t_pipeline == pytest.approx(
            PAGES * max(d.dma_latency_s + 65536 / d.hbm_bytes_per_s, ours.t_mxu / PAGES)
        )
    gpu = C.predict(DECODE, C.LLAMA3_8B, C.ours_gpu_v1(), "h200")
    assert gpu.bound == "latency" and gpu.hbm_fraction < 0.25
    # The GPU kernel (version 2) reads each page once per KV head (no re-read),
    # M 16 instead of 16 x 4 dots, 4-page tiles two ahead: bandwidth bound in
    # the model. One page per tile would stay latency bound (74%).
    v2 = C.predict(DECODE, C.LLAMA3_8B, C.ours_gpu_v2(), "h200")
    assert v2.counts.reread == 1.0 and v2.counts.kv_blocks == PAGES * 8 // 4
    assert v2.bound == "hbm" and v2.hbm_fraction > 0.95
    page = C.predict(DECODE, C.LLAMA3_8B, C.ours_gpu_v2(tile_pages=1), "h200")
    assert page.bound == "latency" and 0.7 < page.hbm_fraction < 0.8


def test_prefill_chunk_rereads_per_query_block():
    """A 512-token chunk at 2k context: version 1 re-reads all 128 pages for
    each of 64 8-row blocks (512 MiB to use 8 MiB); a causal bound reads, per
    128-row block, only the pages up to its last row."""
    plan = C.Plan.prefill_chunk(512, 2048)
    o = C.count(plan, C.LLAMA3_8B, C.ours_tpu_v1())
    assert o.kv_bytes_needed == 8 * 2**20
    assert o.kv_bytes_moved == 64 * 128 * 65536 == 512 * 2**20
    assert o.reread == 64
    t = C.count(plan, C.LLAMA3_8B, C.target_tpu())
    causal_pages = sum(-(-(1536 + 128 * (b + 1)) // 16) for b in range(4))
    assert causal_pages == 104 + 112 + 120 + 128
    assert t.kv_bytes_moved == causal_pages * 65536
    j = C.count(plan, C.LLAMA3_8B, C.jax_tpu(128, 32))  # no causal bound either
    assert j.kv_bytes_moved == 16 * 128 * 65536


def test_windowed_counts_by_hand():
    """A window of 3 on a decode (kv 13: position 12 attends 10..12) and a
    3-token chunk ending at 15 (positions 12..14), pages of 4: every kernel
    starts a sequence's read at the page of its window, page 2, not page 0.
    kvsched's TPU kernel, block_q 2, one page per block: block 0 reads pages 2-3
    of the decode and of the chunk's first row, block 1 (positions 13, 14)
    pages 2-3: 6 pages where full attention reads 12. JAX's kernel (the page
    row shifted to the sequence's window, no causal bound): 2 + 2 pages of 8.
    The GPU kernel, sequence-aligned blocks of 2: 2 + 2 + 1 (the chunk's last
    row, position 14, starts at page 3). The KV needed: 3 + 5 tokens."""
    full = C.Plan((1, 3), (13, 15))
    win = C.Plan((1, 3), (13, 15), window=3)
    tpu = C.ours_tpu_v2(block_q=2, pages_per_block=1)
    c, f = C.count(win, SMALL, tpu), C.count(full, SMALL, tpu)
    assert (c.pages_read, c.kv_blocks, c.kv_bytes_moved) == (6, 6, 6 * 128)
    assert (f.pages_read, f.kv_blocks, f.kv_bytes_moved) == (12, 12, 12 * 128)
    assert c.kv_bytes_needed == (3 + 5) * 2 * 8 * 2 and f.kv_bytes_needed == (13 + 15) * 32
    assert c.useful_flops == 4 * 2 * (3 + 3 * 3) * 8  # each row attends 3 keys
    j = C.count(win, SMALL, C.jax_tpu(pages_per_block=2, block_q=4))
    assert (j.pages_read, j.kv_blocks, j.kv_bytes_moved) == (4, 2, 4 * 128)
    assert C.count(full, SMALL, C.jax_tpu(pages_per_block=2, block_q=4)).kv_bytes_moved == 8 * 128
    g = C.count(win, SMALL, C.ours_gpu_v2(block_q=2, tile_pages=1))
    assert (g.pages_read, g.kv_bytes_moved) == (5, 5 * 128)
    # Version 1 (removed) never skipped anything: a window changes only the need.
    assert C.count(win, SMALL, C.ours_tpu_v1(2)).kv_bytes_moved == C.count(
        full, SMALL, C.ours_tpu_v1(2)).kv_bytes_moved  # fmt: skip
    with pytest.raises(ValueError, match="window"):
        C.Plan((1,), (4,), window=0)


def test_a_windowed_decode_at_8k_reads_a_sixteenth_of_the_pages():
    """The issue's figure: 256 decodes at 8k context under a 512-token window,
    pages of 16 (Llama-3-8B heads), at the block sizes each kernel picks for
    the windowed layer. Each reads 32 of a sequence's 512 pages, 1/16 of what
    the full layer reads; kvsched's TPU kernel and JAX's move one block of 33
    pages per decode (window_pages: a window not aligned to pages spans 33; the
    33rd DMA of an aligned one re-reads the first), 33/512 of the full layer's
    bytes; the GPU kernel's 4-page tiles load exactly 32. The predicted step
    drops with the bytes: the decode stays bandwidth bound on kvsched's
    kernels."""
    full, win = C.Plan.decode(256, 8192), C.Plan.decode(256, 8192, window=512)
    pages = 256 * 8192 // 16
    assert win.keys(0) == 512
    for dev in ("tpu-v5e", "tpu-v6e", "h200"):
        for k_full, k_win in zip(C.kernels_for(full, C.LLAMA3_8B, dev),
                                 C.kernels_for(win, C.LLAMA3_8B, dev), strict=True):  # fmt: skip
            if "removed" in k_win.name:  # version 1 reads everything, masked
                continue
            f = C.count(full, C.LLAMA3_8B, k_full)
            w = C.count(win, C.LLAMA3_8B, k_win)
            assert f.pages_read == pages and w.pages_read * 16 == pages, k_win.name
            assert w.kv_bytes_needed * 16 == f.kv_bytes_needed == f.kv_bytes_moved
            assert w.kv_bytes_moved * 512 <= f.kv_bytes_moved * 33, k_win.name
            pf, pw = C.predict(full, C.LLAMA3_8B, k_full, dev), C.predict(win, C.LLAMA3_8B, k_win,
                                                                          dev)  # fmt: skip
            assert pw.step_s * 8 < pf.step_s, k_win.name
    v2 = C.kernels_for(win, C.LLAMA3_8B, "tpu-v5e")[1]
    assert v2.pages_per_block == 33 and v2.window_start == "block"
    c = C.count(win, C.LLAMA3_8B, v2)
    assert (c.kv_blocks, c.dma_starts) == (256, 256 * 33)
    p = C.predict(win, C.LLAMA3_8B, v2, "tpu-v5e")
    assert p.bound == "hbm" and p.hbm_fraction > 0.85
    gpu = C.count(win, C.LLAMA3_8B, C.kernels_for(win, C.LLAMA3_8B, "h200")[1])
    assert gpu.kv_bytes_moved * 16 == C.count(full, C.LLAMA3_8B, C.ours_gpu_v2()).kv_bytes_moved


def test_windowed_tpu_blocks_fit_the_window():
    """tpu_pages_per_block with a window: a block holds the pages one query
    block's windows span when that is within 1/8 of the default size (33 pages
    of 16 for a decode at W = 512), else the span in even blocks (a 128-row
    prefill block at W = 512: 41 pages, 3 blocks of 14); a small window one
    small block (W = 128: 9 pages); a window past the default size keeps it."""
    assert tiling.tpu_pages_per_block(16, 512, decode=True, window=512, block_q=2) == 33
    assert tiling.tpu_pages_per_block(16, 512, window=512, block_q=128) == 14
    assert tiling.tpu_pages_per_block(16, 512, decode=True, window=128, block_q=2) == 9
    assert tiling.tpu_pages_per_block(16, 512, window=4096, block_q=128) == 16
    assert tiling.tpu_pages_per_block(16, 4, decode=True, window=512, block_q=2) == 4


def test_plans_from_arrays_and_bad_plans():
    p = C.Plan.from_arrays([0, 1, 4, 4], [5, 7, 0], num_seqs=2, tokens=8)
    assert (p.q_lens, p.kv_lens, p.padded_tokens) == ((1, 3), (5, 7), 8)
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        C.Plan((4,), (3,))
    with pytest.raises(ValueError, match="one entry per sequence"):
        C.Plan((1,), (3, 4))
    with pytest.raises(ValueError, match="cover"):
        C.Plan((4,), (4,), tokens=2)
    with pytest.raises(ValueError, match="group"):
        C.count(MIXED, C.Shapes(3, 2, 8, 4), C.ours_tpu_v1())


def test_table_has_every_kernel_and_device():
    rows = C.table({"decode": C.Plan.decode(4, 64)}, C.Shapes(8, 2, 128, 16))
    assert {(r["device"], r["kernel"].split(",")[0]) for r in rows} == {
        (d, k)
        for d in ("tpu-v5e", "tpu-v6e")
        for k in (
            "kvsched TPU v1 (removed)",
            "kvsched pallas v2 (TPU)",
            "jax ragged_paged_attention (TPU)",
            "target design (not built)",
        )
    } | {("h200", "kvsched GPU v1 (removed)"), ("h200", "kvsched pallas_gpu v2 (Triton)")}
    text = C.format_table(rows)
    assert text.count("\n") == len(rows) + 1 and "HBM share" in text


def test_the_table_in_docs_kernels_md_is_the_models():
    """docs/kernels.md prints the model's table for its two cases: regenerated
    here, so a change to the model or the tiling defaults shows up there."""
    from pathlib import Path

    plans = {"decode 256x2k": C.Plan.decode(256, 2048),
             "prefill 512@2k": C.Plan.prefill_chunk(512, 2048)}  # fmt: skip
    doc = (Path(__file__).resolve().parents[1] / "docs" / "kernels.md").read_text()
    assert C.format_table(C.table(plans)) in doc


def test_the_window_table_in_docs_kernels_md_is_the_models():
    """docs/kernels.md's sliding-window table, regenerated."""
    from pathlib import Path

    plans = {"decode 256x8k": C.Plan.decode(256, 8192),
             "decode 256x8k W512": C.Plan.decode(256, 8192, window=512),
             "prefill 512@8k W512": C.Plan.prefill_chunk(512, 8192, window=512)}  # fmt: skip
    doc = (Path(__file__).resolve().parents[1] / "docs" / "kernels.md").read_text()
    assert C.format_table(C.table(plans)) in doc


# -- the exported programs -------------------------------------------------------

T, HQ, D, P, BS, HKV, S, PPS = 64, 8, 128, 64, 16, 2, 8, 16


def _export(f):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax import export

    shapes = [((T, HQ, D), jnp.bfloat16), ((P, BS, 2 * HKV, D), jnp.bfloat16),
              ((S,), jnp.int32), ((S, PPS), jnp.int32), ((S + 1,), jnp.int32),
              ((1,), jnp.int32)]  # fmt: skip
    args = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in shapes]
    text = export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
    try:
        return C.mosaic_summary(text)
    except RuntimeError as e:  # pragma: no cover - a jax without the private modules
        pytest.skip(str(e))


@pytest.mark.parametrize("window", [None, 48])
def test_tpu_v2_description_matches_its_mosaic_program(window):
    """The TPU kernel lowered for TPU: in each loop that waits, one wait for a
    whole block of pages_per_block pages and two exclusive sites of pages_per_block
    page DMAs each (the block `prefetch_depth` ahead in this grid step, or past
    its last block the next grid step's first: the chain crosses grid steps;
    how many run is the interpreter test's count); bf16 QK and PV with M =
    block_q x group and N (QK) = the block's keys; outside the loops, the first
    `prefetch_depth` blocks of the chain (this step's own on step 0, else the
    next step's when this one has fewer), the same two sites per block. A
    sliding window moves where each sequence's blocks start, nothing else."""
    pytest.importorskip("jax")
    from kvsched.engine.kernels.tpu import _call

    block_q, ppb = 16, 4
    m = _export(functools.partial(_call, scale=0.1, block_q=block_q, pages_per_block=ppb,
                                  interpret=False, window=window))  # fmt: skip
    desc = C.ours_tpu_v2(block_q, ppb)
    shapes = C.Shapes(HQ, HKV, D, BS)
    plan = C.Plan((1,) * S, (PPS * BS,) * S, T)
    assert m.name == "kvsched_ragged_paged_attention"
    assert m.grid == (C.count(plan, shapes, desc).grid_steps,) == (T // block_q,)
    bodies = m.loops_with("wait_dma")
    assert bodies and not desc.wait_per_page
    for ops in bodies.values():
        kinds = [o.op for o in ops]
        assert kinds.count("wait_dma") == 1 and kinds.count("enqueue_dma") == 2 * ppb
        for o in ops:
            if o.op == "wait_dma":
                assert C.memref_bytes(o.shapes[0], o.dtypes[0]) == ppb * shapes.page_bytes
            if o.op == "enqueue_dma":
                assert C.memref_bytes(o.shapes[0], o.dtypes[0]) == shapes.page_bytes
        mm = [o for o in ops if o.op == "matmul"]
        assert len(mm) == 2 * HKV
        for o in mm:
            assert o.dtypes == ("bf16", "bf16") == (desc.operands, desc.pv)
            assert o.shapes[2][0] == block_q * shapes.group
        assert {o.shapes[2][1] for o in mm[::2]} == {ppb * BS}  # QK: [M, keys of the block]
    cold = [o for o in m.ops if o.op == "enqueue_dma" and o.depth == 0]
    assert len(cold) == 2 * desc.prefetch_depth * ppb == 4 * ppb
    assert desc.prefetch_across and not desc.chain_per_step
    assert C.count(plan, shapes, desc).chains == 1


def test_jax_kernel_description_matches_its_mosaic_program():
    """JAX's ragged_paged_attention lowered for TPU (its tuned-size lookup needs a
    TPU, so block sizes are given; its lowering asks for the chip, so v5e's
    description is registered for the CPU backend): pages_per_block page DMAs
    started and waited per KV block, bf16 QK, f32 x bf16 PV, M = queries x group,
    N = pages_per_block x page_size, and one cold start before all loops."""
    pytest.importorskip("jax")
    try:
        from jax._src.pallas.mosaic import tpu_info
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
            ragged_paged_attention,
        )
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"JAX's ragged_paged_attention is not in this jax: {e}")
    bkv, bq = 4, 16
    desc = C.jax_tpu(bkv, bq)
    previous = tpu_info.registry.get("cpu")
    tpu_info.registry["cpu"] = functools.partial(
        tpu_info._get_tpu_info_impl, tpu_info.ChipVersion.TPU_V5E, 1
    )
    clear = getattr(tpu_info.get_tpu_info, "cache_clear", lambda: None)
    clear()
    try:
        rpa = functools.partial(
            ragged_paged_attention, sm_scale=0.1, num_kv_pages_per_block=bkv,
            num_queries_per_block=bq,
        )  # fmt: skip
        m = _export(rpa)
    finally:
        if previous is None:
            tpu_info.registry.pop("cpu", None)
        else:
            tpu_info.registry["cpu"] = previous
        clear()  # no v5e answer stays cached for the CPU backend
    shapes = C.Shapes(HQ, HKV, D, BS)
    assert m.grid == (1, T // bq)  # (head blocks, query blocks)
    bodies = m.loops_with("wait_dma")
    assert len(bodies) == 1
    (ops,) = bodies.values()
    kinds = [o.op for o in ops]
    assert kinds.count("wait_dma") == desc.pages_per_block == bkv  # a wait per page
    assert kinds.count("enqueue_dma") == bkv  # the next block, prefetched in the loop
    assert all(C.memref_bytes(o.shapes[0], o.dtypes[0]) == shapes.page_bytes
               for o in ops if o.op != "matmul")  # fmt: skip
    qk = [o for o in ops if o.op == "matmul" and o.dtypes == ("bf16", "bf16")]
    pv = [o for o in ops if o.op == "matmul" and o.dtypes[0] == "f32"]
    assert len(qk) == len(pv) == HKV and desc.operands == "bf16" and desc.pv == "f32"
    for o in qk:
        assert o.shapes[2] == (bq * shapes.group, bkv * BS)  # [M, keys of the block]
    first = [o for o in m.ops if o.op == "enqueue_dma" and o.depth == 0]
    assert len(first) == bkv and desc.prefetch_across  # one chain: started before the loops


# -- the kernel as it runs (Pallas' TPU interpreter) -----------------------------


@pytest.fixture
def dma_log(monkeypatch):
    """Every DMA the TPU interpreter starts, and the bytes of every wait, while
    the kernel runs on CPU: the interpreter calls these two host functions per
    DMA (a private module; the test skips without it). Caches are cleared so the
    kernel is traced again through the counting wrappers."""
    jax = pytest.importorskip("jax")
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"no Pallas TPU interpreter module here: {e}")
    log: dict[str, list[int]] = {"starts": [], "waits": [], "order": []}
    start, wait = ipc.dma_start, ipc.dma_wait

    def counted_start(*a, **k):
        log["starts"].append(1)
        log["order"].append(0)
        return start(*a, **k)

    def counted_wait(token, device_id, local_core_id, sem_id, size, **k):
        log["waits"].append(int(size))
        log["order"].append(1)
        return wait(token, device_id, local_core_id, sem_id, size, **k)

    monkeypatch.setattr(ipc, "dma_start", counted_start)
    monkeypatch.setattr(ipc, "dma_wait", counted_wait)
    jax.clear_caches()
    yield log
    jax.clear_caches()


def started_before_each_wait(order: list[int], pages_per_block: int) -> list[int]:
    """From the interpreter's sequence of DMA starts (0) and waits (1): the KV
    blocks started (pages_per_block DMAs each) before each wait."""
    out, starts = [], 0
    for e in order:
        if e:
            out.append(starts // pages_per_block)
        else:
            starts += 1
    return out


def test_tpu_v2_counts_are_what_it_does_in_the_interpreter(dma_log):
    """The TPU kernel in the interpreter: on the hand-counted plan, then on real
    mixed plans at the shape's default block_q and at block_q 8, the DMAs it starts,
    its waits (one per block) and the bytes they wait for are the model's, and
    the blocks started before each wait are those of one chain over the whole
    grid (depth 2: the block waited and the two after it, across grid steps)."""
    import jax.numpy as jnp
    import numpy as np
    from engine_helpers import plans

    from kvsched.engine import AttentionInputs
    from kvsched.engine.kernels.tpu import ragged_paged_attention

    inputs = AttentionInputs(
        positions=jnp.asarray([4, 4, 5, 6], jnp.int32),
        cu_q_lens=jnp.asarray([0, 1, 4], jnp.int32),
        kv_lens=jnp.asarray([5, 7], jnp.int32),
        page_indices=jnp.asarray([[1, 2], [3, 4]], jnp.int32),
        num_seqs=jnp.asarray([2], jnp.int32),
    )
    q = jnp.ones((4, 2, 8), jnp.bfloat16)
    cache = jnp.ones((5, 4, 2, 8), jnp.bfloat16)
    ragged_paged_attention(q, cache, inputs, scale=0.5, block_q=2, pages_per_block=2)
    want = C.count(MIXED, SMALL, C.ours_tpu_v2(block_q=2, pages_per_block=2))
    assert (len(dma_log["starts"]), len(dma_log["waits"])) == (want.dma_starts, want.dma_waits)
    assert dma_log["waits"] == [2 * 128] * 3 and want.kv_bytes_moved == 6 * 128
    # One chain across both grid steps: grid step 1's block was started before
    # step 0 waited on its first (a chain per step would have started 2 blocks).
    assert started_before_each_wait(dma_log["order"], 2) == [3, 3, 3] and want.chains == 1

    shapes = C.Shapes(q_heads=4, kv_heads=2, head_dim=16, page_size=4)
    seen = mixed = 0
    for q, cache, inputs, plan, _ in plans(dtype=jnp.bfloat16, steps=4):
        mixed += 0 < plan.num_decode < len(plan)
        model = C.Plan.from_arrays(np.asarray(inputs.cu_q_lens), np.asarray(inputs.kv_lens),
                                   int(inputs.num_seqs[0]), tokens=q.shape[0])  # fmt: skip
        # The Rust planner's positions agree with the model's row layout.
        pos = np.asarray(inputs.positions)
        ends = np.cumsum(model.q_lens)
        assert [int(pos[e - 1]) + 1 for e in ends if e] == [
            k for k, ql in zip(model.kv_lens, model.q_lens, strict=True) if ql
        ]
        slots, pps = inputs.page_indices.shape
        for bq in (None, 8):
            dma_log["starts"].clear()
            dma_log["waits"].clear()
            dma_log["order"].clear()
            out = ragged_paged_attention(q, cache, inputs, scale=0.25, block_q=bq,
                                            pages_per_block=3)  # fmt: skip
            out.block_until_ready()
            block_q = bq or tiling.tpu_block_q(q.shape[0], slots, shapes.group)
            c = C.count(model, shapes, C.ours_tpu_v2(block_q, min(3, pps)))
            assert (len(dma_log["starts"]), len(dma_log["waits"])) == (c.dma_starts, c.dma_waits)
            assert sum(dma_log["waits"]) == c.kv_bytes_moved
            assert set(dma_log["waits"]) <= {min(3, pps) * shapes.page_bytes}
            # Blocks in flight at each wait, across grid steps: the chain's.
            n = c.kv_blocks
            want_chain = [min(k + 3, n) for k in range(n)]  # depth 2, + the block waited
            assert started_before_each_wait(dma_log["order"], min(3, pps)) == want_chain
            seen += c.dma_starts > 0
    assert seen >= 6 and mixed, "plans that read KV, one of them mixed"


def test_jax_block_sizes_are_what_its_tuned_table_gives():
    """jax_rpa_block_sizes and jax_rpa_kv_heads_per_block against JAX's own
    functions (its get_tuned_block_sizes asks for a TPU, so its table is read
    directly here): the Llama-3-8B decode key is in neither the v5 nor the v6
    table, so the default (128 pages, 32 queries) applies, clipped; an 8/4-head
    shape with pages of 64 is in the v6 table."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    try:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as t
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"JAX's ragged_paged_attention is not in this jax: {e}")
    for hq, hkv in ((32, 8), (8, 4), (16, 16), (12, 2), (64, 8)):
        shapes = C.Shapes(hq, hkv, 128, 16)
        qh, ch = rpa.get_min_heads_per_blk(hq, 2 * hkv, jnp.bfloat16, jnp.bfloat16)
        assert C.jax_rpa_kv_heads_per_block(shapes) == ch // 2 and qh == ch // 2 * shapes.group
    s = C.LLAMA3_8B
    for tokens, pps in ((256, 128), (512, 128), (16, 4)):
        key = t.simplify_key((jnp.bfloat16, jnp.bfloat16, 32, 8, 128, 16, tokens, pps))
        for table in t.TUNED_BLOCK_SIZES.values():
            assert key not in table
        for dev in ("tpu-v5e", "tpu-v6e"):
            got = C.jax_rpa_block_sizes(s, tokens, pps, dev)
            assert got == (min(pps, 128), min(tokens, 32))
    # Keys that are in the tables: 8/4 heads with pages of 64, and Llama-3-8B's
    # heads at a short max_model_len (8 pages of 16 = 128 tokens, 512 tokens).
    hit = C.Shapes(8, 4, 128, 64)
    for dev, chip in (("tpu-v5e", "TPU v5"), ("tpu-v6e", "TPU v6")):
        table = t.TUNED_BLOCK_SIZES[chip]
        bkv, bq = table[("bfloat16", "bfloat16", 8, 4, 128, 64, 2048, 512)]
        assert C.jax_rpa_block_sizes(hit, 2048, 8, dev) == (min(8, bkv), min(2048, bq))
        bkv, bq = table[("bfloat16", "bfloat16", 32, 8, 128, 16, 512, 128)]
        assert C.jax_rpa_block_sizes(s, 512, 8, dev) == (min(8, bkv), min(512, bq))
