"""Sliding-window layers, logit soft caps and attention sinks in every attention
backend, on hybrid plans as the core hands them to a window group's layer: each
sequence's page row holds the null page 0 for the blocks behind its window
(and past its end), and page 0 and every page no window reaches hold NaN. The
reference against the float64 oracle; kvsched's TPU kernel (Pallas' TPU
interpreter), its GPU kernel (Pallas' interpreter) and JAX's reference (through
kvsched's window view) against the reference; the TPU kernel's DMAs read back
from the interpreter: none for a page outside the window, as many as the cost
model counts."""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("jax")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kvsched  # noqa: E402
from kvsched.engine import AttentionInputs, paged_attention, reference_attention  # noqa: E402
from kvsched.engine.attention import resolve_backend  # noqa: E402
from kvsched.engine.kernels import cost as C  # noqa: E402
from kvsched.engine.kernels import tiling  # noqa: E402
from kvsched.engine.kernels.common import check_soft_cap, check_window  # noqa: E402
from kvsched.engine.kernels.reference import oracle_attention  # noqa: E402

# Decodes at long context (50 pages of 4, the first dozens null under small
# windows), a 6-token chunk whose rows' windows straddle page edges, a decode
# shorter than most windows, a prompt's first chunk (a fresh or a preempted and
# resumed sequence: positions from 0) and a chunk in the middle of a prompt.
Q_LENS = (1, 6, 1, 9, 1, 5)
KV_LENS = (200, 30, 3, 9, 57, 21)
WINDOWS = (1, 3, 4, 9, 64, 1000)  # below, at and above the page size of 4; above every kv_len


class Case:
    """A window group's inputs for one layer. Each sequence owns pages for its
    blocks [0, ceil(kv_len / bs)); its page row holds those from its first
    row's window page, floor(max(0, kv_len - q_len - W + 1) / bs), on, and 0
    (the null page) before and past the end (`keep_table`: the real page ids
    stay before the window, as in the uniform layout, which keeps every page
    and lets attention apply the window). Pages behind every window and page 0
    hold NaN; slots past kv_len inf. One empty sequence slot and three padding
    rows follow the plan."""

    def __init__(self, window: int | None, *, q_lens=Q_LENS, kv_lens=KV_LENS, bs=4, hq=4,
                 hkv=2, d=16, dtype=jnp.float32, seed=0, keep_table=False):  # fmt: skip
        rng = np.random.default_rng(seed)
        n = len(q_lens)
        slots, pps = n + 1, max(-(-k // bs) for k in kv_lens) + 1
        t = sum(q_lens) + 3
        owned = [-(-k // bs) for k in kv_lens]
        ids = 1 + rng.permutation(sum(owned))
        cache = rng.standard_normal((1 + len(ids), bs, 2 * hkv, d)).astype(np.float32)
        cache[0] = np.nan
        table = np.zeros((slots, pps), np.int32)
        cu = np.zeros(slots + 1, np.int32)
        cu[1 : n + 1] = np.cumsum(q_lens)
        cu[n + 1] = cu[n]
        positions = np.zeros(t, np.int32)
        self.window_pages: set[int] = set()
        at = 0
        for s, (ql, kv) in enumerate(zip(q_lens, kv_lens, strict=True)):
            mine = ids[at : at + owned[s]]
            at += owned[s]
            first = 0 if window is None else max(0, kv - ql - window + 1) // bs
            table[s, : owned[s]] = mine
            if not keep_table:
                table[s, :first] = 0
            cache[mine[:first]] = np.nan  # behind the window: freed, garbage
            self.window_pages |= {int(x) for x in mine[first:]}
            if kv % bs:
                cache[mine[-1], kv % bs :] = np.inf
            positions[cu[s] : cu[s + 1]] = np.arange(kv - ql, kv)
        q = rng.standard_normal((t, hq, d)).astype(np.float32)
        q[cu[n] :] = 0.0
        self.q = jnp.asarray(q, dtype)
        self.cache = jnp.asarray(cache, dtype)
        self.inputs = AttentionInputs(
            positions=jnp.asarray(positions), cu_q_lens=jnp.asarray(cu),
            kv_lens=jnp.asarray(np.asarray([*kv_lens, 0], np.int32)),
            page_indices=jnp.asarray(table), num_seqs=jnp.asarray([n], np.int32),
        )  # fmt: skip
        self.tokens, self.window, self.bs = int(cu[n]), window, bs
        self.plan = C.Plan(tuple(q_lens), tuple(kv_lens), t, window)

    def oracle(self, **kw) -> np.ndarray:
        i = self.inputs
        return oracle_attention(
            np.asarray(self.q, np.float64), np.asarray(self.cache, np.float64),
            np.asarray(i.positions), np.asarray(i.cu_q_lens), np.asarray(i.kv_lens),
            np.asarray(i.page_indices), int(i.num_seqs[0]), scale=0.25,
            sliding_window=self.window, **kw,
        )  # fmt: skip

    def reference(self, **kw) -> np.ndarray:
        out = _reference(self.q, self.cache, self.inputs, sliding_window=self.window, **kw)
        return np.asarray(out, np.float64)


# Jitted: one compile per (window, cap) instead of one per eager op and shape.
_reference = jax.jit(functools.partial(reference_attention, scale=0.25),
                     static_argnames=("sliding_window", "soft_cap"))  # fmt: skip


@functools.cache
def full_oracle(soft_cap: float | None) -> np.ndarray:
    return Case(None).oracle(soft_cap=soft_cap)


def check(got, want, case: Case, tol: float) -> None:
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), "a page outside the window (NaN) was read"
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    assert not got[case.tokens :].any(), "padding rows are zero"


SINKS = jnp.asarray([0.5, -1.0, 2.0, 3.5], jnp.float32)


# -- the arguments -----------------------------------------------------------------


def test_window_cap_and_sinks_arguments_are_checked():
    assert check_window(None) is None and check_window(0) is None
    assert check_window(512) == 512 and check_window(np.int64(7)) == 7
    with pytest.raises(ValueError, match=">= 0"):
        check_window(-1)
    with pytest.raises(ValueError, match="static Python int"):
        check_window(jnp.int32(8))
    with pytest.raises(ValueError, match="static Python int"):
        check_window(8.0)
    assert check_soft_cap(None) is None and check_soft_cap(50) == 50.0
    for bad in (0.0, -30.0):
        with pytest.raises(ValueError, match="> 0"):
            check_soft_cap(bad)
    with pytest.raises(ValueError, match="static"):
        check_soft_cap(jnp.float32(30.0))
    case = Case(4)
    with pytest.raises(ValueError, match="sinks must be"):
        paged_attention(case.q, case.cache, case.inputs, scale=0.25, sinks=SINKS[:3])
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(case.q, case.cache, case.inputs, scale=0.25, sliding_window=-4)
    # JAX's kernel has no sinks: backend jax refuses them, pallas on a TPU keeps
    # kvsched's kernel for them.
    with pytest.raises(kvsched.InvalidConfig, match="no attention sinks"):
        paged_attention(case.q, case.cache, case.inputs, scale=0.25, backend="jax", sinks=SINKS)
    assert resolve_backend("pallas", "tpu", head_dim=128) == "jax_kernel"
    assert resolve_backend("pallas", "tpu", head_dim=128, sinks=True) == "pallas"
    assert resolve_backend("pallas", "gpu", sinks=True) == "pallas_gpu"
    with pytest.raises(kvsched.InvalidConfig, match="no attention sinks"):
        resolve_backend("jax", "cpu", sinks=True)


def test_window_pages_bounds_what_one_rows_window_touches():
    """tiling.window_pages against every window start position by brute force."""
    for w in (1, 3, 4, 5, 16, 17, 512):
        for bs in (1, 4, 16):
            for rows in (1, 2, 7):
                touched = max(len({p // bs for p in range(a, a + w + rows - 1)}) for a in range(bs))
                assert tiling.window_pages(w, bs, rows) == touched
    assert tiling.window_pages(512, 16) == 33


# -- the reference and the oracle ------------------------------------------------


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("soft_cap", [None, 0.8])
def test_reference_matches_the_oracle_on_hybrid_plans(window, soft_cap):
    """Null pages before each window, NaN in them and in every page behind a
    window: finite output equal to the float64 oracle's, which reads only the
    window's keys. A soft cap of 0.8 changes every logit (|q.k| x 0.25 ~ 1)."""
    case = Case(window)
    want = case.oracle(soft_cap=soft_cap)
    check(case.reference(soft_cap=soft_cap), want, case, 2e-5)
    if window < max(KV_LENS):  # the window changes the answer: not full attention
        full = full_oracle(soft_cap)
        assert np.abs(full - want)[: case.tokens].max() > 1e-3


def test_reference_with_sinks_matches_the_oracle():
    """Sinks with a window and a soft cap, and alone on a full layer (the
    denominator grows, nothing else), against the oracle."""
    case = Case(9)
    want = case.oracle(soft_cap=2.0, sinks=np.asarray(SINKS))
    got = case.reference(soft_cap=2.0, sinks=SINKS)
    check(got, want, case, 2e-5)
    assert np.abs(got - case.oracle(soft_cap=2.0))[: case.tokens].max() > 1e-3, "sinks count"
    full = Case(None)
    check(full.reference(sinks=SINKS), full.oracle(sinks=np.asarray(SINKS)), full, 2e-5)


@pytest.mark.slow
def test_reference_window_on_int8_bf16_and_a_stacked_cache():
    """An int8 cache (the reference's alone; the null page's scales NaN) and
    bf16; the stacked [L, P, ...] cache at a traced layer reads that layer's
    window pages."""
    from kvsched.engine.kv_cache import QuantizedKV, dequantize, quantize

    case = Case(9)
    values, scales = quantize(jnp.where(jnp.isfinite(case.cache), case.cache, 0.0))
    scales = scales.at[0].set(jnp.nan)  # the null page: garbage scales too
    qkv = QuantizedKV(values, scales)
    exact = dequantize(values, scales)
    got = _reference(case.q, qkv, case.inputs, sliding_window=9)
    want = _reference(case.q, exact, case.inputs, sliding_window=9)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    bf = Case(9, dtype=jnp.bfloat16)
    check(bf.reference(), bf.oracle(), bf, 3e-2)
    stacked = jnp.stack([jnp.zeros_like(case.cache), case.cache])
    got = _reference(case.q, stacked, case.inputs, layer=jnp.int32(1), sliding_window=9)
    check(got, case.oracle(), case, 2e-5)


def test_the_reference_gathers_only_the_window_pages():
    """The reference's gathers (K/V rows per token) are window_pages(W, bs) pages
    wide with a window, the whole page row without: the pages behind a window
    are never read, and a long context costs the window, not the context."""
    case = Case(9)
    pps = case.inputs.page_indices.shape[1]

    def widths(window):
        jaxpr = jax.make_jaxpr(functools.partial(reference_attention, scale=0.25,
                                                 sliding_window=window))(
            case.q, case.cache, case.inputs
        )  # fmt: skip
        return {tuple(e.outvars[0].aval.shape[:2]) for e in jaxpr.eqns
                if e.primitive.name == "gather" and e.outvars[0].aval.ndim == 5}  # fmt: skip

    t = case.q.shape[0]
    assert widths(9) == {(t, tiling.window_pages(9, 4))} == {(t, 3)}
    assert widths(None) == {(t, pps)} and pps == 51


def test_windows_chosen_per_layer_under_lax_switch():
    """The model's way with static windows in a layer scan: lax.switch over the
    distinct windows picks the right attention per (traced) layer kind."""
    case = Case(9, keep_table=True)
    branches = [functools.partial(paged_attention, scale=0.25, sliding_window=w) for w in (None, 9)]

    @jax.jit
    def run(kind, q, cache, inputs):
        return jax.lax.switch(kind, branches, q, cache, inputs)

    cache = jnp.where(jnp.isfinite(case.cache), case.cache, 0.0)  # full attention reads all
    for kind, w in ((0, None), (1, 9)):
        got = run(jnp.int32(kind), case.q, cache, case.inputs)
        want = _reference(case.q, cache, case.inputs, sliding_window=w)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)


# -- kvsched's TPU kernel (Pallas' TPU interpreter) --------------------------------


@pytest.fixture
def dma_pages(monkeypatch):
    """The page id of every DMA the TPU interpreter starts from the cache (the
    second index of cache.at[layer, page]), while the kernel runs on CPU."""
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"no Pallas TPU interpreter module here: {e}")
    pages: list[int] = []
    start = ipc.dma_start

    def spy(*a, **k):
        (indexer,) = a[5]  # src_transforms: one NDIndexer, (layer, page, ...)
        pages.append(int(indexer.indices[1]))
        return start(*a, **k)

    monkeypatch.setattr(ipc, "dma_start", spy)
    jax.clear_caches()
    yield pages
    jax.clear_caches()


# (window, soft cap, sinks, block_q, pages per block, dtype, keep_table)
TPU_CASES = [
    (3, None, False, 4, 2, jnp.float32, False),  # window < page; a block straddles sequences
    (4, 0.8, False, 8, None, jnp.float32, False),  # window = page, default pages per block
    (9, None, True, 2, 3, jnp.float32, True),  # sinks; real page ids behind the window
    (64, 2.0, True, None, None, jnp.bfloat16, False),  # the shape's defaults, bf16
    (1000, None, False, 16, 4, jnp.float32, False),  # a window past every kv_len: full
]


@pytest.mark.slow
@pytest.mark.parametrize(("window", "cap", "sinks", "block_q", "ppb", "dtype", "keep"), TPU_CASES)
def test_tpu_kernel_reads_only_window_pages_and_matches_the_reference(
    dma_pages, window, cap, sinks, block_q, ppb, dtype, keep
):
    """Every page the kernel DMAs is one of a window's (never page 0, never a
    page behind a window), as many DMAs as the cost model counts for the
    windowed plan, and the output is the reference's."""
    from kvsched.engine.kernels.tpu import ragged_paged_attention

    case = Case(window, dtype=dtype, keep_table=keep)
    kw = {"soft_cap": cap, "sinks": SINKS if sinks else None}
    tol = 3e-2 if dtype == jnp.bfloat16 else 2e-5
    got = ragged_paged_attention(case.q, case.cache, case.inputs, scale=0.25,
                                 sliding_window=window, block_q=block_q, pages_per_block=ppb,
                                 **kw)  # fmt: skip
    check(got, case.reference(**kw), case, tol)
    assert dma_pages and set(dma_pages) <= case.window_pages
    slots, pps = case.inputs.page_indices.shape
    bq = block_q or tiling.tpu_block_q(case.q.shape[0], slots, 2)
    blk = ppb or tiling.tpu_pages_per_block(4, pps, tiling.tpu_decode_path(bq, 2), window, bq)
    model = C.count(case.plan, C.Shapes(4, 2, 16, 4), C.ours_tpu_v2(bq, min(blk, pps)))
    assert len(dma_pages) == model.dma_starts
    full = C.count(C.Plan(case.plan.q_lens, case.plan.kv_lens, case.plan.tokens),
                   C.Shapes(4, 2, 16, 4), C.ours_tpu_v2(bq, min(blk, pps)))  # fmt: skip
    if window < 64:
        assert model.dma_starts < full.dma_starts / 2


@pytest.mark.slow
def test_tpu_kernel_window_on_packed_and_stacked_caches_through_the_dispatch():
    """Backend pallas (the TPU interpreter off TPU) with a window: the stacked
    cache at a traced layer, and the packed layout of head_dim 16."""
    from kvsched.engine.kernels.layout import pack_cache
    from kvsched.engine.kernels.tpu import ragged_paged_attention

    case = Case(9)
    want = case.reference(soft_cap=0.8)
    stacked = jnp.stack([jnp.zeros_like(case.cache), case.cache])
    f = jax.jit(functools.partial(paged_attention, scale=0.25, backend="pallas",
                                  sliding_window=9, soft_cap=0.8))  # fmt: skip
    check(f(case.q, stacked, case.inputs, layer=jnp.int32(1)), want, case, 2e-5)
    got = ragged_paged_attention(case.q, pack_cache(case.cache), case.inputs, scale=0.25,
                                 sliding_window=9, soft_cap=0.8, pages_per_block=3)  # fmt: skip
    check(got, want, case, 2e-5)


# -- kvsched's GPU kernel (Pallas' interpreter) ------------------------------------

# (window, soft cap, sinks, block_q, KV splits, tile pages, dtype, keep_table)
SLOW = pytest.mark.slow
GPU_CASES = [
    (3, None, False, 2, 1, 1, jnp.float32, False),  # the quick tier's case
    pytest.param(4, 0.8, True, None, 1, None, jnp.float32, True, marks=SLOW),
    # split-KV: the sink joins the reduce
    pytest.param(9, None, True, 4, 3, 2, jnp.float32, False, marks=SLOW),
    pytest.param(64, 2.0, False, None, None, None, jnp.bfloat16, False, marks=SLOW),  # defaults
    pytest.param(1000, None, False, 4, 2, 3, jnp.float32, False, marks=SLOW),
]


@pytest.mark.parametrize(
    ("window", "cap", "sinks", "block_q", "splits", "tile", "dtype", "keep"), GPU_CASES
)
def test_gpu_kernel_matches_the_reference_on_hybrid_plans(window, cap, sinks, block_q, splits,
                                                          tile, dtype, keep):  # fmt: skip
    """A page behind a window, if loaded, would put NaN in V at a key the kernel
    keeps (it zeroes V only past kv_len): finite output equal to the
    reference's shows none is."""
    from kvsched.engine.kernels.gpu import ragged_paged_attention_gpu

    case = Case(window, dtype=dtype, keep_table=keep)
    kw = {"soft_cap": cap, "sinks": SINKS if sinks else None}
    tol = 3e-2 if dtype == jnp.bfloat16 else 2e-5
    got = ragged_paged_attention_gpu(case.q, case.cache, case.inputs, scale=0.25,
                                     sliding_window=window, block_q=block_q, kv_splits=splits,
                                     kv_tile_pages=tile, **kw)  # fmt: skip
    check(got, case.reference(**kw), case, tol)


def test_gpu_split_kv_counts_the_window_not_the_page_row():
    """Split-KV from the shape: a decode bucket of one 32k-token sequence gets 16
    splits; under a 128-token window (9 pages of 16) at most 9."""
    assert tiling.gpu_kv_splits(1, 1, 8, 2048) == 16
    assert tiling.gpu_kv_splits(1, 1, 8, 2048, window=128, page_size=16) == 9
    assert tiling.gpu_kv_splits(1, 1, 8, 2048, window=4096, page_size=16) == 16


# -- JAX's kernel (its jnp reference off TPU) through the window view --------------


def test_the_window_view_starts_each_row_at_its_window():
    """kv_len drops by the pages skipped; the page row starts at the first
    window page; nothing a kernel reads (the first ceil(kv_len' / bs) entries)
    is the null page; padding slots are untouched."""
    from kvsched.engine.kernels.jax_rpa import window_view

    case = Case(9)
    i = case.inputs
    kv, table = (np.asarray(a) for a in window_view(i.kv_lens, i.page_indices, i.cu_q_lens,
                                                    i.num_seqs, 9, 4))  # fmt: skip
    full = np.asarray(i.page_indices)
    for s, (ql, k) in enumerate(zip(Q_LENS, KV_LENS, strict=True)):
        first = max(0, k - ql - 8) // 4
        assert kv[s] == k - 4 * first
        used = table[s, : -(-kv[s] // 4)]
        np.testing.assert_array_equal(used, full[s, first : first + len(used)])
        assert (used > 0).all()
    assert kv[-1] == 0 and not table[-1].any()


@pytest.mark.slow
@pytest.mark.parametrize(("window", "cap"), [(3, None), (9, 0.8), (1000, 2.0)])
def test_jax_backend_matches_the_reference_on_hybrid_plans(window, cap):
    """Backend jax off TPU is JAX's own jnp reference (with its sliding_window
    and soft_cap) on the window view of the plan: without the view it would
    read the null pages in [0, kv_len) and return NaN."""
    case = Case(window)
    got = paged_attention(case.q, case.cache, case.inputs, scale=0.25, backend="jax",
                          sliding_window=window, soft_cap=cap)  # fmt: skip
    check(got, case.reference(soft_cap=cap), case, 2e-5)


def test_jax_kernel_blocks_are_capped_at_the_window():
    """With a window and no block sizes, JAX's tuned KV block (128 pages here) is
    capped at the pages one row's window spans; the cost model describes the
    same block."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes

    from kvsched.engine.kernels.jax_rpa import window_block_sizes

    q = jax.ShapeDtypeStruct((256, 32, 128), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((4096, 16, 16, 128), jnp.bfloat16)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tuned_block_sizes, "get_tpu_version", lambda: 5)
        m.setattr(tuned_block_sizes, "get_device_name", lambda *a: "TPU v5")
        assert window_block_sizes(q, pages, 512, 512) == (33, 32)
        assert window_block_sizes(q, pages, 512, 4096) == (128, 32)
    plan = C.Plan.decode(256, 8192, window=512)
    (jax_desc,) = [k for k in C.kernels_for(plan, C.LLAMA3_8B, "tpu-v5e") if "jax" in k.name]
    assert jax_desc.pages_per_block == 33


# -- mesh ----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_sharded_pallas_path_takes_windows_and_sinks():
    """With a mesh, kvsched's kernel runs per device on its heads (shard_map),
    sinks split with the heads: one CPU device here, the same program."""
    from jax.sharding import Mesh

    from kvsched.engine.mesh import AXIS

    case = Case(9)
    mesh = Mesh(np.asarray(jax.devices()[:1]), (AXIS,))
    got = paged_attention(case.q, case.cache, case.inputs, scale=0.25, backend="pallas",
                          mesh=mesh, sliding_window=9, sinks=SINKS, block_q=8)  # fmt: skip
    check(got, case.reference(sinks=SINKS), case, 2e-5)


# -- Gemma 3 270M's attention: 4 query heads, 1 KV head of 256, W = 512 ------------


@pytest.mark.parametrize(
    "backend", ["oracle", pytest.param("pallas", marks=pytest.mark.slow), "pallas_gpu"]
)
def test_gemma3_window_of_512_at_its_shapes(backend):
    """Gemma 3 270M's sliding layers at pages of 16: decodes at 2,000 and 700
    tokens (the first 93 and 11 pages null), a 256-token chunk straddling the
    window at 1,200, a decode shorter than the window, and a first chunk. The
    reference against the oracle; kvsched's kernels (defaults: a 33-page block
    on the TPU decode path) against the reference."""
    case = Case(512, q_lens=(1, 256, 1, 1, 40), kv_lens=(2000, 1200, 700, 300, 40), bs=16,
                hq=4, hkv=1, d=256)  # fmt: skip
    want = case.reference()
    if backend == "oracle":
        check(want, case.oracle(), case, 2e-5)
        return
    got = paged_attention(case.q, case.cache, case.inputs, scale=0.25, backend=backend,
                          sliding_window=512)  # fmt: skip
    check(got, want, case, 2e-5)


# -- the device-check scripts' --window ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tpu_check", "gpu_check"])
def test_the_device_checks_run_a_windowed_layer_small(name, capsys):
    """benches/tpu_check.py and gpu_check.py with --window, small, in the
    interpreters: the checks pass, the decode reads each sequence's last W
    tokens through a page table with the NaN null page behind the window, and
    the cost model's row is the windowed plan's."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benches" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_window", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--small", "--window", "40"])
    out = capsys.readouterr().out
    assert result["ran"] and result["ok"] and module.exit_code(result) == 0, out
    assert "4 seqs x 64 tokens, a window of 40" in out
    assert "NaN" not in out
