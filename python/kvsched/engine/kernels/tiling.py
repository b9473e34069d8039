"""Tiling defaults of kvsched's attention kernels: query rows per block, KV
pages per DMA block (TPU) or per tile (GPU), and KV splits (GPU), each chosen
from a plan's static shape.

The kernels (kernels/tpu.py, kernels/gpu.py) call these when a size is not
given, and the cost model (kernels/cost.py) calls the same functions to
describe each kernel at the sizes it runs with. Imports nothing (no JAX): the
cost model runs without it.

A bucket is "decode-heavy" when its padded tokens are at most twice its
sequence slots (most query blocks then hold one row per sequence).

A sliding-window layer (window W) reads, per query block, only the pages its
rows' windows span (`window_pages`); the TPU kernel sizes its KV blocks to
that (`tpu_pages_per_block(..., window=W)`), and the GPU kernel's split-KV
counts those pages, not the page row's.
"""

from __future__ import annotations

# -- TPU (kernels/tpu.py) ------------------------------------------------------

SUBLANES = 8  # rows of one TPU vector tile: the matmul M tile
TPU_PREFILL_BLOCK_Q = 128  # query tokens per block outside the decode path
TPU_DECODE_BLOCK_TOKENS = 512  # KV tokens per DMA block on the decode path
TPU_BLOCK_TOKENS = 256  # elsewhere (128-row query blocks need VMEM too)


def window_pages(window: int, page_size: int, rows: int = 1) -> int:
    """The most pages the windows of `rows` consecutive query rows of one
    sequence span: their keys are W + rows - 1 consecutive positions, and n
    consecutive positions touch at most ceil((n - 1) / page_size) + 1 pages
    (33 for a decode row at W = 512, pages of 16)."""
    keys = window + rows - 1
    return (keys + page_size - 2) // page_size + 1


def decode_heavy(tokens: int, seqs: int) -> bool:
    """A bucket of `tokens` padded rows over `seqs` sequence slots is decode-heavy."""
    return tokens <= 2 * seqs


def tpu_block_q(tokens: int, seqs: int, group: int) -> int:
    """Query tokens per block of the TPU kernel: decode-heavy buckets get
    M = block_q x group = 8 rows (one sublane tile: the GQA group is the
    matmul's M) when the group divides 8, else 8 tokens; other buckets 128
    tokens (at most the bucket rounded up to 8)."""
    if decode_heavy(tokens, seqs):
        return SUBLANES // group if SUBLANES % group == 0 else SUBLANES
    return min(TPU_PREFILL_BLOCK_Q, -(-tokens // SUBLANES) * SUBLANES)


def tpu_decode_path(block_q: int, group: int) -> bool:
    """Whether query blocks of `block_q` tokens x `group` heads are the TPU
    kernel's decode path (M of at most one sublane tile)."""
    return block_q * group <= SUBLANES


def tpu_pages_per_block(page_size: int, pages_per_seq: int, decode: bool = False,
                        window: int | None = None, block_q: int = 1) -> int:  # fmt: skip
    """KV pages per DMA block of the TPU kernel: 512 tokens' worth on the decode
    path (32 pages of 16: 2 MiB at Llama-3-8B's heads, 6 MiB of VMEM for three
    slots), 256 tokens otherwise; at least one page, at most a sequence's page
    row. With a sliding `window` (query blocks of `block_q` rows), the pages a
    block's window spans (`window_pages`) in as few blocks as that size allows,
    split evenly; a span up to 1/8 over the size is one block (33 pages of 16
    for a decode at W = 512: one wait, not two blocks of 32 where the second
    re-reads 31 padding pages)."""
    tokens = TPU_DECODE_BLOCK_TOKENS if decode else TPU_BLOCK_TOKENS
    ppb = max(1, tokens // page_size)
    if window is not None:
        # Every block moves its full page count (the wait size is static): a
        # block sized to the window's span wastes at most a page or so per block.
        span = window_pages(window, page_size, block_q)
        blocks = 1 if span <= ppb + ppb // 8 else -(-span // ppb)
        ppb = -(-span // blocks)
    return max(1, min(pages_per_seq, ppb))


# -- GPU (kernels/gpu.py) ------------------------------------------------------

GPU_DECODE_M = 16  # rows (block_q x group) of a decode-heavy query block: one tensor-core tile
GPU_PREFILL_M = 64  # elsewhere: bigger blocks re-read a chunk's KV fewer times
GPU_TILE_KEYS = 64  # KV keys per tile
GPU_MAX_KV_SPLITS = 16
H200_SMS = 132  # the SM count assumed where the device does not report one


def gpu_block_q(tokens: int, seqs: int, group: int) -> int:
    """Query tokens per block of the GPU kernel: M = block_q x group is 16 for
    decode-heavy buckets (most blocks hold one row), 64 otherwise; at least 1."""
    m = GPU_DECODE_M if decode_heavy(tokens, seqs) else GPU_PREFILL_M
    return max(1, m // group)


def gpu_tile_pages(page_size: int, pages_per_seq: int) -> int:
    """KV pages per tile of the GPU kernel: 64 keys (4 pages of 16, 2 of 32), at
    least one page, at most a sequence's pages."""
    return max(1, min(pages_per_seq, GPU_TILE_KEYS // page_size))


def gpu_kv_splits(tokens: int, seqs: int, kv_heads: int, pages_per_seq: int,
                  units: int = H200_SMS, window: int | None = None,
                  page_size: int = 16) -> int:  # fmt: skip
    """Split-KV of the GPU kernel: a decode-heavy bucket whose seqs x kv_heads
    programs leave some of `units` SMs idle gets ceil(units / programs) splits
    (at most 16, at most the pages a row reads: the sequence's page row, or
    with a sliding `window` the pages of `page_size` its window spans);
    otherwise 1. The sequence slots, not the live sequences, decide: the choice
    is static per shape."""
    programs = seqs * kv_heads
    if not decode_heavy(tokens, seqs) or programs >= units:
        return 1
    pages = pages_per_seq
    if window is not None:
        pages = min(pages, window_pages(window, page_size))
    return max(1, min(GPU_MAX_KV_SPLITS, pages, -(-units // programs)))


__all__ = [
    "GPU_DECODE_M", "GPU_MAX_KV_SPLITS", "GPU_PREFILL_M", "GPU_TILE_KEYS", "H200_SMS",
    "SUBLANES", "TPU_BLOCK_TOKENS", "TPU_DECODE_BLOCK_TOKENS", "TPU_PREFILL_BLOCK_Q",
    "decode_heavy", "gpu_block_q", "gpu_kv_splits", "gpu_tile_pages", "tpu_block_q",
    "tpu_decode_path", "tpu_pages_per_block", "window_pages",
]  # fmt: skip
