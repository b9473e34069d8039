"""A cost model for ragged paged attention kernels: what a kernel moves from HBM,
how many DMAs it issues and waits on, what its matmuls cost, and the step time
and share of HBM bandwidth that follow, per device. It makes the performance
claims about kernels/tpu.py, kernels/gpu.py and JAX's `ragged_paged_attention`
falsifiable without hardware: tests fix the counts on hand-computed plans,
check the TPU descriptions against the kernels' exported Mosaic programs
(`mosaic_summary`) and the TPU kernel's counts against the DMAs it runs in
Pallas' interpreter; benches/tpu_check.py / gpu_check.py print the model's
prediction beside the measured time. (The GPU kernel's Triton program is read
back only where the jax CUDA plugin is installed: tests/test_engine_attention.py
checks its loop and dot shapes there; its query blocks are checked against the
kernel's own program_table everywhere.)

Kernels described (`kernels_for`, `table`): kvsched's TPU and GPU kernels
(`ours_tpu_v2`, `ours_gpu_v2`: the designs kernels/tpu.py and kernels/gpu.py
implement), the version 1 designs they replaced (`ours_tpu_v1`,
`ours_gpu_v1`: no longer in the code, kept for comparison), JAX's TPU kernel
(`jax_tpu`) and a design not built (`target_tpu`). docs/kernels.md holds the
prediction table and what has been measured.

Counting (exact, from each kernel's own loops). A kernel is a `KernelDesc`: its
query block rows, KV pages per block, prefetch depth and reach, whether a query
block reads only up to its causal bound, whether every block moves a fixed
number of pages, whether every query block scans every sequence, what forms the
matmul M dimension and the operand precision. `count` walks the plan as the
kernel's grid does: for each query block, each sequence whose rows meet it,
that sequence's KV span (kv_len, or the causal bound of the block's last row),
split into blocks of `pages_per_block` pages. Nothing is sampled or fitted.
A plan's `window` (a sliding-window layer) starts each span at the page of
the window start of the pair's first row (`window_start="block"`: kvsched's
kernels), of the sequence's first row ("seq": JAX's kernel, fed each page
row from its window), or at page 0 ("none": the removed version 1 designs,
which masked); the KV needed and the useful FLOPs count each row's window,
and `Counts.pages_read` the pages the spans cover (a decode at 8k context
under W = 512: 32 of 512).

Timing (a model, with stated constants; see `DEVICES`):

    step = max(bytes / BW, mxu / peak, pipeline, scalar) + chains * L
           + grid_steps * step_overhead

- pipeline: Little's law on the KV blocks. With `prefetch_depth` d >= 1 blocks
  in flight while one is computed, a block of b bytes costs
  max((L + b / BW) / d, its matmul time); with d = 0 (each load waited before
  its use: num_stages=1 on GPU) L + b / BW_program + compute, serialised.
- chains: a prefetch chain starts with an exposed fetch; version 1 of the TPU
  kernel restarts its chain for every (query block, sequence) pair, JAX's
  kernel and kernels/tpu.py prefetch across sequences and grid steps (one
  chain per call; `across_steps=False` describes a chain restarted at every
  grid step, to show what the cross-step prefetch saves).
- scalar: the scalar unit starts and waits on every DMA (`dma_issue_s` each)
  and runs the loops over sequences (`scalar_iter_s` per iteration); it works
  while the DMA engines and the MXU do, so it is a bound of its own.
- mxu: matmul FLOPs padded to the unit's tiles (TPU: M to 8 sublanes, N and K
  to the MXU width, 128 on v5e, 256 on v6e; GPU tensor cores: 16), times the
  passes an f32 matmul takes (assumed 6: bf16x6 emulation; an assumption).
- fraction of HBM bandwidth: the KV that must be read (each sequence's kv_len
  tokens once) over BW, divided by the predicted step: the same figure the
  check scripts report from a measured time.

What is not modelled: VPU/EUP work (the softmax's exp, masks, f32 relayouts),
register spills, VMEM capacity, HBM bank conflicts; they can only make a kernel
slower than predicted. On GPU the model runs one program per SM at a time;
when programs outnumber SMs, several resident per SM would hide more latency
than it credits (the GPU kernel's 32k-token decode has 128 programs for 132
SMs). The
latency constants are the largest unknowns: the first device run
(benches/tpu_check.py, gpu_check.py) calibrates them.

Imports numpy, kvsched.shapes and kernels.tiling at import (no JAX; the
kernels' block sizes come from tiling, as the kernels' own defaults do);
`mosaic_summary` imports jaxlib's MLIR bindings on use, `jax_rpa_block_sizes`
reads JAX's tuned table when jax is installed.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvsched.engine.kernels import tiling
from kvsched.shapes import ACCELERATORS

# -- devices -------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """What the model needs to know about an accelerator. HBM bandwidth and bf16
    peak come from kvsched.shapes' presets; the rest is stated per field."""

    name: str
    platform: Literal["tpu", "gpu"]
    hbm_bytes_per_s: float
    bf16_flops: float
    # TPU: MXU width (N and K tiles) and sublanes (M tile); GPU: the tensor-core
    # tile (16 for bf16 mma) in all three dimensions.
    mxu_width: int
    m_tile: int
    f32_matmul_passes: int  # TPU: an f32 x f32 matmul on the bf16 MXU (assumed)
    f32_flops: float  # GPU: CUDA-core FP32 rate (f32 dots without tensor cores)
    dma_latency_s: float  # TPU: issue to completion of one DMA; GPU: an HBM load
    dma_issue_s: float  # scalar cost of starting or waiting on one DMA
    grid_step_s: float  # per grid step (TPU) / per program (GPU)
    scalar_iter_s: float  # one iteration of a kernel's scalar loop over sequences
    units: int  # programs that run at once: 1 TensorCore (v5e, v6e); SMs (GPU)


# Constants and their sources. hbm_bytes_per_s and bf16_flops:
# kvsched.shapes.ACCELERATORS (vendor datasheets). mxu_width: JAX's
# jax._src.pallas.mosaic.tpu_info (0.10.2): 128 on v5e, 256 on v6e; sublanes 8.
# H200 FP32 67 TFLOP/s and 132 SMs: NVIDIA's H200 SXM datasheet. The latencies
# and issue costs are ASSUMPTIONS, chosen as orders of magnitude and not yet
# measured on any device: 1 us from issuing a TPU HBM->VMEM DMA to its wait
# returning, 20 ns of scalar work to start or wait on one DMA, 0.6 us for an
# H200 HBM load; 0.35 us per Pallas TPU grid step (the figure the Pallas TPU
# guides give). The first device run of benches/tpu_check.py checks them.
DEVICES: dict[str, Device] = {
    "tpu-v5e": Device(
        "tpu-v5e", "tpu", ACCELERATORS["tpu-v5e"].hbm_bytes_per_s,
        ACCELERATORS["tpu-v5e"].bf16_flops, mxu_width=128, m_tile=8, f32_matmul_passes=6,
        f32_flops=0.0, dma_latency_s=1e-6, dma_issue_s=20e-9, grid_step_s=0.35e-6,
        scalar_iter_s=10e-9, units=1,
    ),
    "tpu-v6e": Device(
        "tpu-v6e", "tpu", ACCELERATORS["tpu-v6e"].hbm_bytes_per_s,
        ACCELERATORS["tpu-v6e"].bf16_flops, mxu_width=256, m_tile=8, f32_matmul_passes=6,
        f32_flops=0.0, dma_latency_s=1e-6, dma_issue_s=20e-9, grid_step_s=0.35e-6,
        scalar_iter_s=10e-9, units=1,
    ),
    "h200": Device(
        "h200", "gpu", ACCELERATORS["h200"].hbm_bytes_per_s, ACCELERATORS["h200"].bf16_flops,
        mxu_width=16, m_tile=16, f32_matmul_passes=1, f32_flops=67e12, dma_latency_s=0.6e-6,
        dma_issue_s=0.0, grid_step_s=0.0, scalar_iter_s=10e-9, units=132,
    ),
}  # fmt: skip


# -- shapes and plans ----------------------------------------------------------


@dataclass(frozen=True)
class Shapes:
    """Attention shapes: heads, head_dim, page size and element bytes."""

    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    kv_bytes: int = 2  # per element of the cache (bf16)
    q_bytes: int = 2  # per element of q and of the output

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def page_bytes(self) -> int:
        """One page of every KV head, K and V: what one page DMA of the TPU kernel moves."""
        return self.page_size * 2 * self.kv_heads * self.head_dim * self.kv_bytes


LLAMA3_8B = Shapes(q_heads=32, kv_heads=8, head_dim=128, page_size=16)


@dataclass(frozen=True)
class Plan:
    """The plan arrays a kernel's cost depends on: each sequence's query rows
    and KV length (rows are laid out in sequence order), the padded token
    count the kernel is called with, and the layer's sliding window (None:
    full attention; a row at position p attends [max(0, p - W + 1), p])."""

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    tokens: int | None = None  # padded rows (the bucket); default: sum(q_lens)
    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError("window must be >= 1 (None: full attention)")
        if len(self.q_lens) != len(self.kv_lens):
            raise ValueError("q_lens and kv_lens need one entry per sequence")
        if any(q < 0 or q > k for q, k in zip(self.q_lens, self.kv_lens, strict=True)):
            raise ValueError("each sequence needs 0 <= q_len <= kv_len")
        if self.tokens is not None and self.tokens < sum(self.q_lens):
            raise ValueError("tokens must cover every sequence's rows")

    @property
    def padded_tokens(self) -> int:
        return sum(self.q_lens) if self.tokens is None else self.tokens

    @classmethod
    def decode(cls, seqs: int, context: int, window: int | None = None) -> Plan:
        return cls((1,) * seqs, (context,) * seqs, window=window)

    @classmethod
    def prefill_chunk(cls, chunk: int, context: int, window: int | None = None) -> Plan:
        """One sequence's chunk of `chunk` tokens ending at `context`."""
        return cls((chunk,), (context,), window=window)

    @classmethod
    def from_arrays(cls, cu_q_lens: Sequence[int], kv_lens: Sequence[int], num_seqs: int,
                    tokens: int | None = None, window: int | None = None) -> Plan:  # fmt: skip
        """From a step plan's arrays (kvsched.StepPlan / AttentionInputs)."""
        cu = [int(x) for x in cu_q_lens[: num_seqs + 1]]
        q = tuple(b - a for a, b in zip(cu, cu[1:], strict=False))
        return cls(q, tuple(int(x) for x in kv_lens[:num_seqs]), tokens, window)

    def first_key(self, pos: int) -> int:
        """The first key position a row at `pos` attends."""
        return 0 if self.window is None else max(0, pos - self.window + 1)

    def keys(self, s: int) -> int:
        """The KV positions sequence s's rows attend, together: from its first
        row's window start to its kv_len (kv_len for full attention)."""
        q, kv = self.q_lens[s], self.kv_lens[s]
        return kv - self.first_key(kv - q)


# -- kernels -------------------------------------------------------------------


@dataclass(frozen=True)
class KernelDesc:
    """A kernel's structure as the cost model reads it (see the module doc).
    A new kernel plugs in by describing its own loops."""

    name: str
    platform: Literal["tpu", "gpu"]
    block_q: int  # query rows (tokens) per grid block
    pages_per_block: int  # KV pages per block: the unit that is waited on, then computed
    prefetch_depth: int  # blocks in flight while one is computed (1: double buffering)
    prefetch_across: bool  # the prefetch chain crosses sequences and grid steps
    causal_bound: bool  # a query block reads KV only up to its last row's position
    fixed_blocks: bool  # every block moves pages_per_block pages (pads with a real page)
    scan_all_seqs: bool  # every query block loops over every sequence (scalar work)
    rows: Literal["block", "seq"]  # matmul M: the block's rows (masked) or the seq's rows
    operands: Literal["f32", "bf16"]  # the QK matmul's operands
    wait_per_page: bool  # one DMA wait per page (else one per block)
    kv_heads_per_program: int | None = None  # None: all KV heads per program (TPU)
    pv_operands: Literal["f32", "bf16"] | None = None  # the PV matmul's (None: as QK)
    # Query blocks hold one sequence's rows each (ceil(q_len / block_q) blocks per
    # sequence, tokens / block_q + S programs); else blocks of the padded rows.
    seq_aligned: bool = False
    # Split-KV (flash-decoding): each (block, head) program's pages are shared
    # over kv_splits programs, whose partial results a reduce step combines.
    kv_splits: int = 1
    # The prefetch chain crosses sequences within a grid step but restarts at
    # each grid step that reads KV: one chain per such step.
    chain_per_step: bool = False
    # Where a sliding-window layer's read of a sequence starts: "block" at the
    # page of the window start of the sequence's first row in the query block,
    # "seq" at that of its first row in the plan (kvsched feeds JAX's kernel
    # each sequence's page row from there), "none" at page 0 (masked).
    window_start: Literal["block", "seq", "none"] = "none"

    @property
    def pv(self) -> str:
        return self.pv_operands or self.operands


def ours_tpu_v1(block_q: int = 8) -> KernelDesc:
    """Version 1 of kvsched's TPU kernel (removed from the code; described here
    for comparison): grid over query blocks of `block_q` rows (8 by default);
    each block loops over every sequence (`fori_loop(0, num_seqs)` with a
    `cond`), and over the pages of those it meets, one page per DMA (all heads,
    [bs, 2*Hkv, D]) and one wait per page; the next page of the same sequence
    is in flight while one is computed (double buffering), the first page of
    each (block, sequence) is fetched and waited cold. q and K/V are upcast to
    f32 before both matmuls; M = block_q x group rows per KV head, all of them
    computed for every sequence the block meets (masked)."""
    return KernelDesc(
        f"kvsched TPU v1 (removed), block_q={block_q}", "tpu", block_q=block_q, pages_per_block=1,
        prefetch_depth=1, prefetch_across=False, causal_bound=False, fixed_blocks=False,
        scan_all_seqs=True, rows="block", operands="f32", wait_per_page=True,
    )  # fmt: skip


def ours_gpu_v1(block_q: int = 16) -> KernelDesc:
    """Version 1 of kvsched's GPU kernel (removed from the code; described here
    for comparison): grid (query blocks of 16 rows, KV heads); each program
    loops over every sequence and the pages of those its block meets,
    loading one head's K and V of one page (two tile loads) per iteration;
    num_stages=1, so each load is waited before its dots (no prefetch); dots
    per query head ([block_q, D] x [D, bs]) in f32 at HIGHEST precision: CUDA
    cores, not tensor cores."""
    return KernelDesc(
        f"kvsched GPU v1 (removed), block_q={block_q}", "gpu", block_q=block_q,
        pages_per_block=1, prefetch_depth=0, prefetch_across=False, causal_bound=False,
        fixed_blocks=False, scan_all_seqs=True, rows="block", operands="f32",
        wait_per_page=True, kv_heads_per_program=1,
    )  # fmt: skip


def ours_gpu_v2(block_q: int = 4, num_stages: int = 3, kv_splits: int = 1,
                tile_pages: int = 4) -> KernelDesc:  # fmt: skip
    """kernels/gpu.py (version 2 of kvsched's GPU kernel): grid (query blocks of
    one sequence, KV heads), ceil(tokens / block_q) + S programs; each program
    reads only its sequence's pages up to its last row's causal bound, in KV
    tiles of `tile_pages` pages of one head (one gather load of K and one of V
    per tile; the last tile reads whole, its pages past the bound masked);
    num_stages=3: Triton's loop pipeliner keeps the next tiles' loads in flight
    while one is computed (depth num_stages - 1; assumed). One QK and one PV
    dot per tile with M = block_q x group rows (block_q=4: M 16 at group 4, the
    decode default), bf16 operands on tensor cores, f32 accumulation.
    `kv_splits` > 1: split-KV, each program's tiles shared over that many
    programs, f32 partials reduced after the kernel."""
    split = f", {kv_splits} KV splits" if kv_splits > 1 else ""
    return KernelDesc(
        f"kvsched pallas_gpu v2 (Triton), block_q={block_q}, {tile_pages}-page tiles{split}",
        "gpu", block_q=block_q, pages_per_block=tile_pages, prefetch_depth=num_stages - 1,
        prefetch_across=False, causal_bound=True, fixed_blocks=True, scan_all_seqs=False,
        rows="block", operands="bf16", wait_per_page=False, kv_heads_per_program=1,
        seq_aligned=True, kv_splits=kv_splits, window_start="block",
    )  # fmt: skip


def jax_rpa_kv_heads_per_block(shapes: Shapes) -> int:
    """KV heads per head block of JAX's ragged_paged_attention (jax 0.10.2's
    get_min_heads_per_blk): the combined K/V heads are split into blocks of one
    sublane tile (8 x the dtype's packing) when they divide evenly, else kept
    whole. Llama-3-8B in bf16: 16 combined heads, one block."""

    def tiled(x: int, packing: int) -> bool:
        return x % packing == 0 and (x // packing in (1, 2, 4, 8) or (x // packing) % 8 == 0)

    kv_pack, q_pack = 4 // shapes.kv_bytes, 4 // shapes.q_bytes
    combined = 2 * shapes.kv_heads
    tile = 8 * kv_pack
    block = tile if combined % tile == 0 else combined
    if tiled(block // 2 * shapes.group, q_pack):
        return block // 2
    return shapes.kv_heads


def jax_rpa_block_sizes(
    shapes: Shapes, tokens: int, pages_per_seq: int, device: str = "tpu-v5e"
) -> tuple[int, int]:
    """(pages per KV block, queries per block) that JAX's ragged_paged_attention
    picks on a TPU: its get_tuned_block_sizes looks the (power-of-two rounded)
    shapes up in its table for the chip and otherwise takes (128, 32), clipped to
    (pages_per_seq, tokens). The table is read from the installed jax when it is
    there (else the default applies). For Llama-3-8B heads with pages of 16 the
    tables hold max_model_len 64 to 256 only, and 512+ tokens: the decode (256
    tokens, 2048) and prefill (512 tokens at 2048) cases of docs/kernels.md
    take the default."""
    bkv, bq = 128, 32
    tuned: Any
    try:
        tuned = importlib.import_module(
            "jax.experimental.pallas.ops.tpu.ragged_paged_attention.tuned_block_sizes"
        )
    except ImportError:  # pragma: no cover - no jax, or a jax without the kernel
        tuned = None
    if tuned is not None:
        kvh = jax_rpa_kv_heads_per_block(shapes)
        key = tuned.simplify_key((
            "bfloat16" if shapes.q_bytes == 2 else "float32",
            "bfloat16" if shapes.kv_bytes == 2 else "float32",
            kvh * shapes.group, kvh, shapes.head_dim, shapes.page_size, tokens, pages_per_seq,
        ))  # fmt: skip
        chip = {"tpu-v5e": "TPU v5", "tpu-v6e": "TPU v6"}.get(device, "")
        bkv, bq = tuned.TUNED_BLOCK_SIZES.get(chip, {}).get(key, (bkv, bq))
    return min(pages_per_seq, bkv), min(tokens, bq)


def jax_tpu(
    pages_per_block: int, block_q: int, kv_heads_per_block: int | None = None
) -> KernelDesc:
    """JAX's jax.experimental.pallas.ops.tpu.ragged_paged_attention (RPA v1):
    grid (head blocks, query blocks); the sequence index is carried, not
    scanned; a KV block is `pages_per_block` page DMAs on one semaphore (pages
    past the sequence's end read its page 0: every block moves the full count),
    each waited; the next block is started before the current one is computed,
    across sequences and grid steps. QK with bf16 operands and f32
    accumulation; PV multiplies the f32 probabilities by bf16 V (the exported
    program's matmul is f32 x bf16: counted as f32). M = block_q x group per KV
    head, every row of the block computed for each sequence it holds; no causal
    bound on the KV read."""
    return KernelDesc(
        f"jax ragged_paged_attention (TPU), {pages_per_block} pages x {block_q} queries", "tpu",
        block_q=block_q, pages_per_block=pages_per_block, prefetch_depth=1,
        prefetch_across=True, causal_bound=False, fixed_blocks=True, scan_all_seqs=False,
        rows="block", operands="bf16", wait_per_page=True, pv_operands="f32",
        kv_heads_per_program=kv_heads_per_block, window_start="seq",
    )  # fmt: skip


def ours_tpu_v2(block_q: int = 2, pages_per_block: int = 32, depth: int = 2,
                across_steps: bool = True) -> KernelDesc:  # fmt: skip
    """kernels/tpu.py (version 2 of kvsched's TPU kernel): grid over query
    blocks of `block_q` rows (tiling.tpu_block_q: block_q x group = 8 for
    decode-heavy buckets, 128 tokens otherwise); each block finds the sequences
    that meet it by binary search (no scan of every sequence) and reads each one's
    pages only up to its last row's causal bound, in blocks of `pages_per_block`
    page DMAs (every block moves the full count: pages past the span re-read the
    sequence's first page) waited once per block; the next `depth` blocks are in
    flight across the block's sequences and across grid steps (the grid runs in
    order; a step's first blocks are started by the step before), one chain per
    call: only grid step 0 starts cold. QK and PV with the cache's dtype as
    operands (bf16) and f32 accumulation; M = block_q x group rows per KV head,
    masked per sequence. `across_steps=False` describes the same kernel with its
    chain restarted (one exposed fetch) at each grid step that reads KV: what
    prefetching across grid steps saves."""
    after = "" if across_steps else ", chain per grid step"
    return KernelDesc(
        f"kvsched pallas v2 (TPU), {pages_per_block} pages x {block_q} queries{after}", "tpu",
        block_q=block_q, pages_per_block=pages_per_block, prefetch_depth=depth,
        prefetch_across=across_steps, causal_bound=True, fixed_blocks=True,
        scan_all_seqs=False, rows="block", operands="bf16", wait_per_page=False,
        chain_per_step=not across_steps, window_start="block",
    )  # fmt: skip


def target_tpu(pages_per_block: int = 32, block_q: int = 128, depth: int = 2) -> KernelDesc:
    """A design NOT built: several pages per block and
    one wait per block, the next `depth` blocks in flight across sequences
    (2 MiB blocks at the Llama-3-8B shapes and pages of 16), M = each
    sequence's own rows x group (the decode path: the GQA group), a causal KV
    bound per query block, bf16 operands. Here to show what the model predicts
    for it; a new kernel should describe itself the same way."""
    return KernelDesc(
        f"target design (not built), {pages_per_block} pages x {block_q} queries", "tpu",
        block_q=block_q, pages_per_block=pages_per_block, prefetch_depth=depth,
        prefetch_across=True, causal_bound=True, fixed_blocks=False, scan_all_seqs=False,
        rows="seq", operands="bf16", wait_per_page=False, window_start="block",
    )  # fmt: skip


# -- counting ------------------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    """What one kernel call does for one plan (all exact counts)."""

    kernel: str
    grid_steps: int  # programs (TPU: grid steps, run one after another)
    seq_visits: int  # iterations of the scalar loop over sequences, all programs
    pairs: int  # (query block, sequence) pairs that read KV
    kv_blocks: int  # KV blocks computed (each fully waited for first)
    dma_starts: int  # DMA descriptors issued (GPU: tile loads)
    dma_waits: int  # DMA waits (GPU: tile loads waited on)
    chains: int  # prefetch chains (each starts with an exposed fetch)
    kv_bytes_moved: int  # K/V bytes read from HBM
    qo_bytes: int  # q read and output written (and split-KV partials out and back)
    kv_bytes_needed: int  # each sequence's attended tokens once (Plan.keys): the floor
    mxu_flops: int  # matmul FLOPs as issued (the kernel's own shapes)
    mxu_flops_padded: int  # padded to the device's tiles (with a device)
    mxu_f32_flops_padded: int  # the part with f32 operands
    useful_flops: int  # 4 x real rows x group x kv_len x head_dim per KV head
    page_bytes: int  # bytes of one page as a DMA moves it
    block_sizes: tuple[int, ...] = field(default=(), repr=False)  # bytes of each KV block
    # Programs that read KV (one per pair and split for sequence-aligned kernels;
    # else the grid): the GPU model's programs that can run at once.
    busy_programs: int = 0
    # Pages (every KV head's K and V) the kernel reads, summed over its (query
    # block, sequence) pairs: what its spans cover, without the padding pages of
    # fixed-size blocks (kv_bytes_moved counts those).
    pages_read: int = 0

    @property
    def bytes_moved(self) -> int:
        return self.kv_bytes_moved + self.qo_bytes

    @property
    def reread(self) -> float:
        """KV bytes moved over the KV that must be read."""
        return self.kv_bytes_moved / self.kv_bytes_needed if self.kv_bytes_needed else 0.0


def _pairs(plan: Plan, block_q: int, seq_aligned: bool = False) -> list[tuple[int, int, int, int]]:
    """(query block, sequence, rows of the sequence in the block, KV position of
    the sequence's last row in the block) for every pair that meets. With
    `seq_aligned`, each sequence's rows are split into blocks of their own."""
    out = []
    lo = 0
    if seq_aligned:
        b = 0
        for s, (ql, kv) in enumerate(zip(plan.q_lens, plan.kv_lens, strict=True)):
            for start in range(0, ql, block_q):
                rows = min(block_q, ql - start)
                out.append((b, s, rows, kv - (ql - start - rows)))
                b += 1
        return out
    nblocks = -(-plan.padded_tokens // block_q)
    for s, (ql, kv) in enumerate(zip(plan.q_lens, plan.kv_lens, strict=True)):
        hi = lo + ql
        if ql:
            for b in range(lo // block_q, min(nblocks, -(-hi // block_q))):
                b_lo, b_hi = b * block_q, (b + 1) * block_q
                rows = min(hi, b_hi) - max(lo, b_lo)
                last = kv - (hi - min(hi, b_hi))  # last row's position + 1
                out.append((b, s, rows, last))
        lo = hi
    return out


def _pad(x: int, tile: int) -> int:
    return -(-x // tile) * tile


def count(plan: Plan, shapes: Shapes, kernel: KernelDesc, device: Device | None = None) -> Counts:
    """Walk `plan` the way `kernel`'s grid and loops do and count. With a
    `device`, matmul FLOPs are also padded to its tiles."""
    if shapes.q_heads % shapes.kv_heads:
        raise ValueError(f"{shapes.q_heads} query heads do not group over {shapes.kv_heads}")
    ps, d, g, hkv = shapes.page_size, shapes.head_dim, shapes.group, shapes.kv_heads
    heads_per_program = kernel.kv_heads_per_program or hkv
    head_programs = hkv // heads_per_program
    nblocks = -(-plan.padded_tokens // kernel.block_q)
    if kernel.seq_aligned:  # the static grid: at most one partial block per sequence
        nblocks += len(plan.q_lens)
    page_bytes = shapes.page_bytes
    head_page_bytes = page_bytes // head_programs  # what one program moves per page
    pairs = _pairs(plan, kernel.block_q, kernel.seq_aligned)
    kv_blocks = dma_starts = dma_waits = moved_pages = 0
    flops = padded = padded_f32 = 0
    chains = busy = 0
    steps_reading: set[int] = set()
    sizes: list[int] = []
    pages_read = 0
    for _b, _s, rows, last in pairs:
        span = last if kernel.causal_bound else plan.kv_lens[_s]
        if kernel.window_start == "block":  # the pair's first row: position last - rows
            first = plan.first_key(last - rows) // ps
        elif kernel.window_start == "seq":
            first = plan.first_key(plan.kv_lens[_s] - plan.q_lens[_s]) // ps
        else:
            first = 0
        pages = -(-span // ps) - first
        pages_read += pages
        nblk = -(-pages // kernel.pages_per_block)
        for i in range(nblk):
            n = (
                kernel.pages_per_block
                if kernel.fixed_blocks
                else min(kernel.pages_per_block, pages - i * kernel.pages_per_block)
            )
            moved_pages += n * head_programs
            sizes.extend([n * head_page_bytes] * head_programs)
            kv_blocks += head_programs
            per_dma = 2 if kernel.platform == "gpu" else 1  # GPU: a K and a V tile load
            dma_starts += n * per_dma * head_programs
            dma_waits += (n * per_dma if kernel.wait_per_page else 1) * head_programs
            m = (kernel.block_q if kernel.rows == "block" else rows) * g
            keys = n * ps
            flops += 4 * m * keys * d * hkv
            if device is not None:
                for dt in (kernel.operands, kernel.pv):  # QK, then PV: 2*m*keys*d each
                    if device.platform == "tpu":
                        mt, nt = device.m_tile, device.mxu_width
                        f = 2 * _pad(m, mt) * _pad(keys, nt) * _pad(d, nt) * hkv
                    elif dt == "f32":  # CUDA cores: the Triton tile as issued
                        f = 2 * m * keys * d * hkv
                    else:
                        t = device.m_tile
                        f = 2 * _pad(m, t) * _pad(keys, t) * _pad(d, t) * hkv
                    padded += f
                    padded_f32 += f if dt == "f32" else 0
        # Split-KV: the KV blocks go to ceil(blocks / share) programs, each its own
        # chain.
        share = -(-nblk // kernel.kv_splits)
        parts = -(-nblk // share) if nblk else 0
        busy += parts * head_programs
        if nblk:
            chains += 0 if kernel.prefetch_across else head_programs * parts
            steps_reading.add(_b)
    if kernel.chain_per_step:
        chains = len(steps_reading) * head_programs
    if kernel.prefetch_across and kv_blocks:
        chains = 1
    needed = sum(plan.keys(s) * 2 * hkv * d * shapes.kv_bytes for s in range(len(plan.kv_lens)))
    if plan.window is None:
        useful = sum(4 * q * g * kv * d * hkv
                     for q, kv in zip(plan.q_lens, plan.kv_lens, strict=True))  # fmt: skip
    else:  # each row's own keys: min(position + 1, W)
        useful = sum(4 * g * min(p + 1, plan.window) * d * hkv
                     for q, kv in zip(plan.q_lens, plan.kv_lens, strict=True)
                     for p in range(kv - q, kv))  # fmt: skip
    grid_steps = nblocks * head_programs * kernel.kv_splits
    seq_visits = (nblocks * head_programs * len(plan.q_lens) if kernel.scan_all_seqs
                  else len(pairs) * head_programs)  # fmt: skip
    qo = 2 * plan.padded_tokens * shapes.q_heads * d * shapes.q_bytes
    if kernel.kv_splits > 1:  # f32 partials (accumulator, max, denominator) out and back in
        qo += 2 * grid_steps * kernel.block_q * g * (d + 2) * 4
    return Counts(
        kernel=kernel.name, grid_steps=grid_steps, seq_visits=seq_visits, pairs=len(pairs),
        kv_blocks=kv_blocks, dma_starts=dma_starts, dma_waits=dma_waits, chains=chains,
        kv_bytes_moved=moved_pages * head_page_bytes, qo_bytes=qo, kv_bytes_needed=needed,
        mxu_flops=flops, mxu_flops_padded=padded, mxu_f32_flops_padded=padded_f32,
        useful_flops=useful, page_bytes=page_bytes,
        block_sizes=tuple(sizes), busy_programs=busy if kernel.seq_aligned else grid_steps,
        pages_read=pages_read,
    )  # fmt: skip


# -- timing --------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    counts: Counts
    device: str
    t_hbm: float  # bytes moved / bandwidth
    t_mxu: float  # padded matmul FLOPs / peak (x f32 passes)
    t_pipeline: float  # the KV blocks through a depth-limited pipeline
    t_scalar: float  # DMA starts and waits, loops over sequences (scalar unit)
    t_fixed: float  # not overlapped: chains' cold first fetches, grid steps
    step_s: float
    bound: str  # which term of the max dominates
    hbm_bytes_per_s: float  # the device's

    @property
    def achieved_bytes_per_s(self) -> float:
        """Bytes the kernel moves per second at the predicted step time."""
        return self.counts.bytes_moved / self.step_s

    @property
    def hbm_fraction(self) -> float:
        """Share of the device's HBM bandwidth counted on the KV that must be read
        (what the check scripts report from a measured time)."""
        return self.counts.kv_bytes_needed / self.hbm_bytes_per_s / self.step_s


def predict(plan: Plan, shapes: Shapes, kernel: KernelDesc, device: str | Device) -> Prediction:
    """The predicted step time of `kernel` on `plan` (see the module doc)."""
    dev = DEVICES[device] if isinstance(device, str) else device
    c = count(plan, shapes, kernel, dev)
    bw = dev.hbm_bytes_per_s
    f32, bf16 = c.mxu_f32_flops_padded, c.mxu_flops_padded - c.mxu_f32_flops_padded
    if dev.platform == "tpu":
        t_mxu = (bf16 + f32 * dev.f32_matmul_passes) / dev.bf16_flops
    else:
        t_mxu = bf16 / dev.bf16_flops + f32 / dev.f32_flops
    t_hbm = c.bytes_moved / bw
    lat = dev.dma_latency_s
    blocks = np.asarray(c.block_sizes, np.float64)
    # Each block's share of the matmul time (blocks of one kernel have equal shapes
    # per page, so by pages is exact enough): compute per block.
    per_block_compute = t_mxu * blocks / blocks.sum() if blocks.size else blocks
    concurrent = max(1, min(dev.units, c.busy_programs or c.grid_steps))
    if kernel.prefetch_depth >= 1:
        per_block = np.maximum((lat + blocks / bw) / kernel.prefetch_depth, per_block_compute)
        t_pipe = float(per_block.sum()) / concurrent
    else:  # every load waited before its use; programs share the bandwidth, and
        # each computes on its own unit (an SM) at 1/units of the device's rate
        per_block = lat + blocks / (bw / concurrent) + per_block_compute * dev.units
        t_pipe = float(per_block.sum()) / concurrent
    # The scalar unit issues and waits on DMAs and runs the loops over sequences
    # while the DMA engines and the MXU work: its own bound, not added.
    t_scalar = ((c.dma_starts + c.dma_waits) * dev.dma_issue_s
                + c.seq_visits * dev.scalar_iter_s) / concurrent  # fmt: skip
    # A chain's first fetch is waited cold (depth 0 counts every fetch above).
    first = lat if kernel.prefetch_depth else 0.0
    t_fixed = (c.chains * first + c.grid_steps * dev.grid_step_s) / concurrent
    terms = {"hbm": t_hbm, "mxu": t_mxu, "latency": t_pipe, "scalar": t_scalar}
    bound = max(terms, key=terms.__getitem__)
    step = max(terms.values()) + t_fixed
    return Prediction(c, dev.name, t_hbm, t_mxu, t_pipe, t_scalar, t_fixed, step, bound, bw)


def kernels_for(plan: Plan, shapes: Shapes, device: str) -> list[KernelDesc]:
    """The kernels the table compares on a device: kvsched's version 1 and the
    kernel the code runs (version 2, at the block sizes kernels.tiling picks),
    JAX's (TPU) with the block sizes it picks there, and the target design
    (TPU)."""
    w, ps = plan.window, shapes.page_size
    if DEVICES[device].platform == "gpu":
        bq = tiling.gpu_block_q(plan.padded_tokens, len(plan.q_lens), shapes.group)
        pps = max(-(-kv // ps) for kv in plan.kv_lens)
        splits = tiling.gpu_kv_splits(plan.padded_tokens, len(plan.q_lens), shapes.kv_heads,
                                      pps, DEVICES[device].units, w, ps)  # fmt: skip
        tiles = tiling.gpu_tile_pages(ps, pps)
        return [ours_gpu_v1(), ours_gpu_v2(bq, kv_splits=splits, tile_pages=tiles)]
    pps = max(-(-kv // ps) for kv in plan.kv_lens)
    bkv, bq = jax_rpa_block_sizes(shapes, plan.padded_tokens, pps, device)
    if w is not None:  # kernels.jax_rpa.window_block_sizes
        bkv = min(bkv, tiling.window_pages(w, ps))
    kvh = jax_rpa_kv_heads_per_block(shapes)
    bq2 = tiling.tpu_block_q(plan.padded_tokens, len(plan.q_lens), shapes.group)
    decode = tiling.tpu_decode_path(bq2, shapes.group)
    v2 = ours_tpu_v2(bq2, tiling.tpu_pages_per_block(ps, pps, decode, w, bq2))
    return [ours_tpu_v1(), v2, jax_tpu(bkv, bq, None if kvh == shapes.kv_heads else kvh),
            target_tpu()]  # fmt: skip


def table(
    plans: dict[str, Plan],
    shapes: Shapes = LLAMA3_8B,
    devices: Sequence[str] = ("tpu-v5e", "tpu-v6e", "h200"),
) -> list[dict[str, object]]:
    """One row per (plan, kernel, device): the counts and the prediction."""
    rows: list[dict[str, object]] = []
    for pname, plan in plans.items():
        for dname in devices:
            for k in kernels_for(plan, shapes, dname):
                p = predict(plan, shapes, k, dname)
                c = p.counts
                rows.append({
                    "plan": pname, "device": dname, "kernel": k.name,
                    "kv_gb_moved": c.kv_bytes_moved / 1e9, "reread": c.reread,
                    "kv_blocks": c.kv_blocks, "dma_starts": c.dma_starts,
                    "step_ms": p.step_s * 1e3, "bound": p.bound,
                    "hbm_fraction": p.hbm_fraction,
                })  # fmt: skip
    return rows


def format_table(rows: list[dict[str, object]]) -> str:
    """The rows as a Markdown table."""
    head = ("| plan | device | kernel | KV moved (GB) | x needed | KV blocks | DMAs "
            "| step (ms) | bound | HBM share |")  # fmt: skip
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r['plan']} | {r['device']} | {r['kernel']} | {r['kv_gb_moved']:.3f} "
            f"| {r['reread']:.1f} | {r['kv_blocks']:,} | {r['dma_starts']:,} "
            f"| {r['step_ms']:.3f} | {r['bound']} | {r['hbm_fraction']:.1%} |"
        )
    return "\n".join(lines)


# -- the exported program --------------------------------------------------------


@dataclass(frozen=True)
class MosaicOp:
    op: str  # "enqueue_dma", "wait_dma", "matmul"
    loop: int  # id of the innermost enclosing scf loop (-1: none)
    depth: int  # enclosing scf.for / scf.while loops
    shapes: tuple[tuple[int, ...], ...]  # DMA: (transfer,); matmul: (lhs, rhs, out)
    dtypes: tuple[str, ...]  # DMA: (element moved,); matmul: (lhs, rhs)


@dataclass(frozen=True)
class MosaicSummary:
    name: str
    grid: tuple[int, ...]
    ops: tuple[MosaicOp, ...]

    def loops_with(self, op: str) -> dict[int, list[MosaicOp]]:
        """Every op of each innermost loop that holds `op`, by loop id."""
        ids = {o.loop for o in self.ops if o.op == op}
        return {i: [o for o in self.ops if o.loop == i] for i in sorted(ids)}


_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i8": 1}


def memref_bytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * _BYTES[dtype]


def _shape(t: str) -> tuple[tuple[int, ...], str]:
    *dims, dt = t.split("x")
    return tuple(int(x) for x in dims), dt


def mosaic_summary(exported_mlir: str) -> MosaicSummary:
    """The DMA and matmul ops of the (first) Mosaic kernel in an exported program
    (`jax.export(..., platforms=["tpu"]).mlir_module()`), each with its loop
    nesting: the custom call's serialized body is decoded with jaxlib's MLIR
    bindings and the tpu dialect, then read as text. Uses private jax modules
    (jax._src.lib.tpu); raises RuntimeError if they are not there."""
    import base64
    import json

    try:
        from jax._src.interpreters import mlir as jmlir
        from jax._src.lib import tpu  # type: ignore[attr-defined]
        from jaxlib.mlir import ir
        from jaxlib.mlir.passmanager import PassManager
    except ImportError as e:  # pragma: no cover - depends on the jax build
        raise RuntimeError(f"cannot read Mosaic programs with this jax: {e}") from e
    m = re.search(r'backend_config = "(.*?)"[,}]', exported_mlir)
    if m is None:
        raise RuntimeError("no tpu_custom_call with a backend_config in the program")
    config = json.loads(m.group(1).replace("\\22", '"').replace("\\5C", "\\"))
    body = base64.b64decode(config["custom_call_config"]["body"])
    ctx = jmlir.make_ir_context()
    tpu.register_dialect(ctx)
    with ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(body)
        PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
        text = str(module)
    return _summarise(text)


def _summarise(text: str) -> MosaicSummary:
    func = re.search(r"func\.func @(\w+)\(.*?iteration_bounds = array<i64(: [\d, ]+)?>", text)
    name = func.group(1) if func else "?"
    grid = tuple(int(x) for x in func.group(2)[1:].split(",")) if func and func.group(2) else ()
    stack: list[tuple[int, int]] = []  # (indent, loop id)
    next_id = 0
    ops: list[MosaicOp] = []
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        s = line.strip()
        # A loop ends at the "}" at its own indent ("} do {" continues a while).
        if stack and s.startswith("}") and not s.endswith("{") and indent <= stack[-1][0]:
            stack.pop()
        loop = stack[-1][1] if stack else -1
        if "tpu.enqueue_dma" in s:
            mt = re.search(r"source\(%\S+ : memref<([^,>]+)", s)
            if mt:
                shp, dt = _shape(mt.group(1))
                ops.append(MosaicOp("enqueue_dma", loop, len(stack), (shp,), (dt,)))
        elif "tpu.wait_dma" in s:
            mt = re.search(r"src\(%\S+ : memref<([^,>]+)", s)
            shp, dt = _shape(mt.group(1)) if mt else ((), "")
            ops.append(MosaicOp("wait_dma", loop, len(stack), (shp,), (dt,)))
        elif "tpu.matmul" in s:
            types = re.findall(r"vector<([^>]+)>", s.split(" : ", 1)[1])
            (lhs, dl), (rhs, dr), (out, _) = _shape(types[0]), _shape(types[1]), _shape(types[-1])
            ops.append(MosaicOp("matmul", loop, len(stack), (lhs, rhs, out), (dl, dr)))
        if re.search(r"\bscf\.(for|while)\b", s) and s.endswith("{"):
            stack.append((indent, next_id))
            next_id += 1
    return MosaicSummary(name, grid, tuple(ops))


__all__ = [
    "DEVICES", "LLAMA3_8B", "Counts", "Device", "KernelDesc", "MosaicSummary", "Plan",
    "Prediction", "Shapes", "count", "format_table", "jax_rpa_block_sizes",
    "jax_rpa_kv_heads_per_block", "jax_tpu", "kernels_for", "mosaic_summary", "ours_gpu_v1",
    "ours_gpu_v2", "ours_tpu_v1", "ours_tpu_v2", "predict", "table", "target_tpu",
]  # fmt: skip
