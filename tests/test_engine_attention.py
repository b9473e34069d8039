"""Attention backends against a float64 oracle, on real mixed step plans."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from engine_helpers import kv_of, plans  # noqa: E402

from kvsched.engine import KVCacheSpec, init_cache, reference_attention, write_kv  # noqa: E402
from kvsched.engine.kernels.reference import oracle_attention  # noqa: E402


def oracle(q, cache, inputs, scale):
    return oracle_attention(
        np.asarray(q, np.float64), np.asarray(cache, np.float64), np.asarray(inputs.positions),
        np.asarray(inputs.cu_q_lens), np.asarray(inputs.kv_lens), np.asarray(inputs.page_indices),
        int(inputs.num_seqs[0]), scale=scale,
    )  # fmt: skip


def test_write_kv_writes_each_token_at_its_slot_and_drops_padding():
    spec = KVCacheSpec(num_blocks=4, block_size=2, kv_heads=1, head_dim=2)
    cache = init_cache(spec)
    k = jnp.arange(6, dtype=jnp.float32).reshape(3, 1, 2)
    v = -k
    pad = spec.num_blocks * spec.block_size
    cache = write_kv(cache, k, v, jnp.asarray([3, 0, pad], jnp.int32))
    flat = np.asarray(cache).reshape(-1, 2, 2)
    assert flat[3].tolist() == [[0, 1], [0, -1]]  # K at head 0, V at head 1
    assert flat[0].tolist() == [[2, 3], [-2, -3]]
    assert np.count_nonzero(flat) == 6, "the padded write vanished; nothing else moved"


@pytest.mark.parametrize(
    ("hq", "hkv", "block_size", "dtype", "tol"),
    [
        (4, 2, 4, jnp.float32, 2e-5),
        (4, 4, 8, jnp.float32, 2e-5),
        (8, 1, 2, jnp.float32, 2e-5),
        (4, 2, 4, jnp.bfloat16, 3e-2),
    ],
)
def test_reference_matches_the_oracle_on_mixed_plans(hq, hkv, block_size, dtype, tol):
    d, scale = 16, 0.25
    seen_mixed = False
    for q, cache, inputs, plan, _ in plans(hq=hq, hkv=hkv, d=d, block_size=block_size, dtype=dtype):
        got = np.asarray(reference_attention(q, cache, inputs, scale=scale), np.float64)
        want = oracle(q, cache, inputs, scale)
        n = plan.num_tokens
        np.testing.assert_allclose(got[:n], want[:n], atol=tol, rtol=tol)
        assert not got[n:].any(), "padding rows are zero"
        seen_mixed |= 0 < plan.num_decode < len(plan)
    assert seen_mixed, "the workload mixes decodes and prefill chunks in one plan"


def test_the_cache_holds_what_each_request_wrote():
    """The plans' paging end to end, cache hits included: each sequence read back
    through its page row is the KV of its own tokens."""
    hkv, d, bs = 2, 8, 4
    hits = 0
    for _, cache, inputs, plan, tokens in plans(hkv=hkv, d=d, block_size=bs):
        c = np.asarray(cache)
        for i, rid in enumerate(plan.request_ids.tolist()):
            kv_len = int(inputs.kv_lens[i])
            pos = np.arange(kv_len)
            rows = np.asarray(inputs.page_indices)[i][pos // bs]
            got = c[rows, pos % bs]
            k, v = kv_of(tokens[rid], pos, hkv, d)
            np.testing.assert_array_equal(got[:, 0::2], k)
            np.testing.assert_array_equal(got[:, 1::2], v)
        hits = max(hits, int(np.sum(np.asarray(plan.positions)[: plan.num_tokens] == 12)))
    assert hits, "a later request started at the cached prefix's end (chunks are 10 long)"


@pytest.mark.parametrize(
    ("hq", "hkv", "block_size", "block_q", "dtype", "tol"),
    [
        (4, 2, 4, 8, jnp.float32, 2e-5),  # GQA, pages of 4
        (2, 2, 8, 16, jnp.float32, 2e-5),  # MHA, a query block straddling sequences
        (8, 1, 2, 8, jnp.float32, 2e-5),  # MQA, tiny pages
        (4, 2, 4, 8, jnp.bfloat16, 3e-2),
    ],
)
def test_pallas_matches_the_reference_on_mixed_plans(hq, hkv, block_size, block_q, dtype, tol):
    from kvsched.engine.kernels.tpu import ragged_paged_attention

    d, scale = 16, 0.25
    for q, cache, inputs, plan, _ in plans(hq=hq, hkv=hkv, d=d, block_size=block_size,
                                           dtype=dtype, steps=6):  # fmt: skip
        got = np.asarray(ragged_paged_attention(q, cache, inputs, scale=scale, block_q=block_q))
        want = np.asarray(reference_attention(q, cache, inputs, scale=scale))
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   atol=tol, rtol=tol)  # fmt: skip
        assert not got[plan.num_tokens :].any(), "padding rows are zero"


@pytest.mark.parametrize("backend", ["reference", "pallas", "pallas_gpu"])
def test_any_bucket_size_and_stale_non_finite_kv_are_harmless(backend):
    """A bucket that is not a multiple of block_q runs, and inf or NaN left in a
    reused page's unused slots does not poison the output (0 x inf)."""
    from kvsched.engine import paged_attention

    q, cache, inputs, plan, _ = next(iter(plans(steps=2)))
    c = np.asarray(cache).copy()
    bs = c.shape[1]
    for i in range(len(plan)):
        kv_len = int(inputs.kv_lens[i])
        row = np.asarray(inputs.page_indices[i])
        for pos in range(kv_len, -(-kv_len // bs) * bs):  # the tail of the last page
            c[row[pos // bs], pos % bs] = np.inf
    c[0] = np.nan  # the padding page
    # A query block that does not divide the bucket (32 rows, blocks of 12).
    kw = {} if backend == "reference" else {"block_q": 12}
    got = np.asarray(paged_attention(q, jnp.asarray(c), inputs, scale=0.25, backend=backend, **kw))
    want = oracle(q, cache, inputs, 0.25)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_pallas_refuses_heads_that_do_not_group():
    from kvsched.engine.kernels.tpu import ragged_paged_attention

    q, cache, inputs, _, _ = next(plans())
    with pytest.raises(ValueError, match="group"):
        ragged_paged_attention(q[:, :3], cache, inputs, scale=1.0)


def test_the_kernel_lowers_to_mosaic_for_tpu():
    """What interpret mode cannot catch: ops Mosaic lacks. (Lowering only; the
    Mosaic compiler itself runs on a TPU host.)"""
    import functools

    import jax
    from jax import export

    from kvsched.engine.kernels.tpu import _call

    t, hq, d, p, bs, hkv, s, pps = 64, 8, 128, 64, 16, 2, 8, 16
    shapes = [((t, hq, d), jnp.bfloat16), ((p, bs, 2 * hkv, d), jnp.bfloat16), ((s,), jnp.int32),
              ((s, pps), jnp.int32), ((s + 1,), jnp.int32), ((1,), jnp.int32)]  # fmt: skip
    args = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in shapes]
    f = jax.jit(functools.partial(_call, scale=0.1, block_q=16, interpret=False))
    text = export.export(f, platforms=["tpu"])(*args).mlir_module()
    assert "tpu_custom_call" in text and "kvsched_ragged_paged_attention" in text


# The TPU kernel's own knobs (kernels/tpu.py): blocks of several pages, one wait
# per block, causal KV bound. bf16: operands stay bf16 (q rounded to bf16 after
# scaling, probabilities rounded to bf16 for PV), f32 accumulation: the
# reference computes in f32 from bf16 inputs, hence 3e-2.
@pytest.mark.parametrize(
    ("hq", "hkv", "block_size", "block_q", "ppb", "dtype", "tol"),
    [
        (4, 2, 4, None, 2, jnp.float32, 2e-5),  # GQA, the shape's default block_q
        (2, 2, 8, 16, 3, jnp.float32, 2e-5),  # MHA, blocks straddling sequences
        (8, 1, 2, 8, 1, jnp.float32, 2e-5),  # MQA, tiny pages, one page per block
        (4, 2, 4, 2, 8, jnp.bfloat16, 3e-2),  # the decode path's M = 8
    ],
)
def test_tpu_v2_matches_the_reference_on_mixed_plans(hq, hkv, block_size, block_q, ppb, dtype,
                                                     tol):  # fmt: skip
    from kvsched.engine.kernels.tpu import ragged_paged_attention

    d, scale = 16, 0.25
    mixed = 0
    for q, cache, inputs, plan, _ in plans(hq=hq, hkv=hkv, d=d, block_size=block_size,
                                           dtype=dtype, steps=4):  # fmt: skip
        kw = {"block_q": block_q, "pages_per_block": ppb}
        got = np.asarray(ragged_paged_attention(q, cache, inputs, scale=scale, **kw))
        want = np.asarray(reference_attention(q, cache, inputs, scale=scale))
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   atol=tol, rtol=tol)  # fmt: skip
        assert not got[plan.num_tokens :].any(), "padding rows are zero"
        mixed += 0 < plan.num_decode < len(plan)
    assert mixed, "a plan mixing decodes and prefill chunks"


@pytest.mark.parametrize(
    ("block_size", "block_q", "dtype", "tol", "min_kv"),
    [(64, None, jnp.float32, 2e-5, 64), (128, 8, jnp.bfloat16, 3e-2, 0)],
)
def test_tpu_v2_matches_the_reference_at_tpu_page_sizes(block_size, block_q, dtype, tol, min_kv):
    """Pages of 64 and 128 tokens (the sizes recommended on TPU) at the default
    pages_per_block (`default_pages_per_block` adapts: 2 pages of 64 per block
    here, one of 128), on small mixed plans: at 64, plans with a sequence past
    one page (a chunk whose causal bound crosses the page boundary, a decode
    whose block re-reads its first page); at 128, a page holds a whole sequence
    and its slots past kv_len are masked, over several grid steps (block_q 8).
    Two interpreter calls per size: each costs seconds."""
    from kvsched.engine.kernels.tpu import ragged_paged_attention

    runs = 0
    for q, cache, inputs, plan, _ in plans(block_size=block_size, num_blocks=12, dtype=dtype,
                                           steps=8, prompts=(3, 70, 9, 30)):  # fmt: skip
        kv = np.asarray(inputs.kv_lens)[: len(plan)]
        if runs == 2 or not 0 < plan.num_decode < len(plan) or kv.max() <= min_kv:
            continue
        got = ragged_paged_attention(q, cache, inputs, scale=0.25, block_q=block_q)
        got = np.asarray(got)
        want = np.asarray(reference_attention(q, cache, inputs, scale=0.25))
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   atol=tol, rtol=tol)  # fmt: skip
        assert not got[plan.num_tokens :].any(), "padding rows are zero"
        runs += 1
    assert runs == 2, "two mixed plans (at 64: with a sequence longer than a page)"


@pytest.mark.parametrize("depth", [1, 3])
def test_tpu_v2_prefetch_chain_crosses_grid_steps(depth):
    """The prefetch chain runs across grid steps: with block_q 1 most grid steps
    hold one or two KV blocks, fewer than `depth`, so the next step's first
    blocks (and, at depth 3, blocks two steps' worth ahead of the wait) are
    started in this step's prologue or loop; trailing padding steps read
    nothing. Against the reference: decodes, a 3-token chunk, an empty slot."""
    from kvsched.engine import AttentionInputs
    from kvsched.engine.kernels.tpu import ragged_paged_attention

    rng = np.random.default_rng(1)
    hq, hkv, d, bs, p, s, pps = 4, 2, 16, 4, 24, 5, 4
    q_lens = [1, 3, 1, 1, 0]
    kv = np.asarray([5, 9, 1, 16, 0], np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = 8  # 6 tokens, 2 padding rows
    positions = np.zeros(t, np.int32)
    for i, ql in enumerate(q_lens):
        positions[cu[i] : cu[i + 1]] = np.arange(kv[i] - ql, kv[i])
    pages = rng.permutation(np.arange(p))[: s * pps].reshape(s, pps).astype(np.int32)
    inputs = AttentionInputs(
        positions=jnp.asarray(positions), cu_q_lens=jnp.asarray(cu), kv_lens=jnp.asarray(kv),
        page_indices=jnp.asarray(pages), num_seqs=jnp.asarray([4], np.int32),
    )  # fmt: skip
    cache = jnp.asarray(rng.standard_normal((p, bs, 2 * hkv, d)), jnp.float32)
    q = np.asarray(rng.standard_normal((t, hq, d)), np.float32)
    q[6:] = 0.0
    q = jnp.asarray(q)
    got = ragged_paged_attention(q, cache, inputs, scale=0.25, block_q=1, pages_per_block=1,
                                    prefetch_depth=depth)  # fmt: skip
    want = reference_attention(q, cache, inputs, scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[6:].any()


def test_tpu_v2_decode_path_matches_jaxs_tpu_decode_kernel():
    """An independent implementation: JAX's own TPU paged_attention (decode only)
    in interpret mode, on a decode batch with the shape's default block_q (2
    rows x group 4 = M 8), blocks of 2 pages crossing sequences, a 1-token and
    a padding slot. bf16 q (pre-scaled for JAX's, which takes no scale) and KV;
    both outputs are bf16, so they agree to an output rounding (3e-2 as above);
    the reference is the third opinion."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as jax_decode

    from kvsched.engine import AttentionInputs
    from kvsched.engine.kernels.tiling import tpu_block_q
    from kvsched.engine.kernels.tpu import ragged_paged_attention

    rng = np.random.default_rng(0)
    s, hq, hkv, d, bs, pps, p, nseq = 8, 8, 2, 128, 16, 4, 40, 7
    kv = np.asarray([17, 64, 1, 33, 50, 5, 48, 0], np.int32)  # slot 7 is padding
    pages = rng.permutation(np.arange(1, p))[: s * pps].reshape(s, pps).astype(np.int32)
    cache = jnp.asarray(rng.standard_normal((p, bs, 2 * hkv, d)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((s, hq, d)), jnp.bfloat16)
    inputs = AttentionInputs(
        positions=jnp.asarray(np.maximum(kv - 1, 0)),
        cu_q_lens=jnp.asarray(np.minimum(np.arange(s + 1), nseq).astype(np.int32)),
        kv_lens=jnp.asarray(kv), page_indices=jnp.asarray(pages),
        num_seqs=jnp.asarray([nseq], np.int32),
    )  # fmt: skip
    scale = d**-0.5
    assert tpu_block_q(s, s, hq // hkv) == 2
    got = ragged_paged_attention(q, cache, inputs, scale=scale, pages_per_block=2)
    got = np.asarray(got, np.float32)
    k_pages = jnp.moveaxis(cache[:, :, 0::2], 2, 0)  # [Hkv, P, bs, D]
    v_pages = jnp.moveaxis(cache[:, :, 1::2], 2, 0)
    q_scaled = (q.astype(jnp.float32) * scale).astype(jnp.bfloat16)[:nseq]
    with pltpu.force_tpu_interpret_mode():
        want = jax_decode(q_scaled, k_pages, v_pages, jnp.asarray(kv[:nseq]),
                          jnp.asarray(pages[:nseq]), pages_per_compute_block=2)  # fmt: skip
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(got[:nseq], want, atol=3e-2, rtol=3e-2)
    ref = np.asarray(reference_attention(q, cache, inputs, scale=scale), np.float32)
    np.testing.assert_allclose(got, ref, atol=3e-2, rtol=3e-2)
    assert not got[nseq:].any(), "the padding slot's row is zero"


def test_tpu_v2_reads_the_packed_layout_and_a_stacked_cache():
    """Packed [P, bs, Hkv, 2*D] (the "row" mode of head_dim 16) and a
    stacked [L, P, ...] cache read at a traced layer, against the reference on
    the split single-layer cache; stale inf past kv_len stays harmless."""
    import functools

    import jax

    from kvsched.engine.kernels.layout import pack_cache
    from kvsched.engine.kernels.tpu import ragged_paged_attention

    for q, cache, inputs, plan, _ in plans(steps=2):
        want = np.asarray(reference_attention(q, cache, inputs, scale=0.25))
        c = np.asarray(cache).copy()
        bs = c.shape[1]
        for i in range(len(plan)):
            kv_len = int(inputs.kv_lens[i])
            row = np.asarray(inputs.page_indices[i])
            for pos in range(kv_len, -(-kv_len // bs) * bs):
                c[row[pos // bs], pos % bs] = np.inf
        packed = pack_cache(jnp.asarray(c))
        got = ragged_paged_attention(q, packed, inputs, scale=0.25, pages_per_block=3)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
        stacked = jnp.stack([jnp.zeros_like(jnp.asarray(c)), jnp.asarray(c)])
        f = jax.jit(functools.partial(ragged_paged_attention, scale=0.25, pages_per_block=2))
        got = f(q, stacked, inputs, layer=jnp.int32(1))
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


def test_tpu_v2_refuses_bad_arguments_by_name():
    from kvsched.engine.kernels.tpu import ragged_paged_attention

    q, cache, inputs, _, _ = next(plans())
    for kw in ({"block_q": 0}, {"pages_per_block": 0}, {"prefetch_depth": 0}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            ragged_paged_attention(q, cache, inputs, scale=1.0, **kw)
    with pytest.raises(ValueError, match="group"):
        ragged_paged_attention(q[:, :3], cache, inputs, scale=1.0)


def test_tpu_v2_picks_the_decode_path_from_the_shape():
    from kvsched.engine.kernels.tiling import tpu_block_q, tpu_pages_per_block

    assert tpu_block_q(256, 256, 4) == 2  # decode: M = 2 x 4 = 8 rows
    assert tpu_block_q(256, 256, 8) == 1
    assert tpu_block_q(256, 256, 3) == 8  # a group that does not divide 8
    assert tpu_block_q(512, 8, 4) == 128  # prefill: 128-token blocks
    assert tpu_block_q(20, 4, 4) == 24
    assert tpu_pages_per_block(16, 128) == 16 and tpu_pages_per_block(64, 2) == 2
    assert tpu_pages_per_block(16, 128, decode=True) == 32
    # Pages of 64 and 128 (TPU): the same 512 / 256 tokens per block, fewer pages.
    assert tpu_pages_per_block(64, 32, decode=True) == 8
    assert tpu_pages_per_block(128, 16, decode=True) == 4
    assert tpu_pages_per_block(128, 16) == 2 and tpu_pages_per_block(128, 1) == 1


@pytest.mark.parametrize(("d", "packed", "bs", "ppb", "window"),
                         [(128, False, 16, 4, None), (64, True, 16, 4, None),
                          (128, False, 64, None, None), (128, False, 128, None, None),
                          (64, True, 128, None, None), (128, False, 16, None, 48),
                          (64, True, 16, 4, 100), (256, False, 64, None, 512)])  # fmt: skip
def test_tpu_v2_lowers_to_mosaic_for_tpu(d, packed, bs, ppb, window):
    """Lowering only (the Mosaic compiler runs on a TPU host): bf16, split at
    head_dim 128 and packed at 64; pages of 16, 64 and 128 tokens (the last two
    with the default pages per block). Windowed layers (with a logit soft cap
    and sinks, at their default or given pages per block; head_dim 256 and
    W = 512 are Gemma 3's) lower too."""
    import functools

    import jax
    from jax import export

    from kvsched.engine.kernels.tpu import _call

    t, hq, p, hkv, s = 64, 8, 64, 2, 8
    pps = 256 // bs
    cache = (p, bs, hkv, 2 * d) if packed else (p, bs, 2 * hkv, d)
    shapes = [((t, hq, d), jnp.bfloat16), (cache, jnp.bfloat16), ((s,), jnp.int32),
              ((s, pps), jnp.int32), ((s + 1,), jnp.int32), ((1,), jnp.int32)]  # fmt: skip
    args = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in shapes]
    kw = {} if window is None else {"window": window, "soft_cap": 50.0}
    f = jax.jit(functools.partial(_call, scale=0.1, block_q=16, pages_per_block=ppb,
                                  interpret=False, **kw))  # fmt: skip
    if window is not None:  # sinks: an [Hq] array operand
        args.append(jax.ShapeDtypeStruct((hq,), jnp.float32))
        f = jax.jit(lambda *a, f=f: f(*a[:-1], sinks=a[-1]))
    text = export.export(f, platforms=["tpu"])(*args).mlir_module()
    assert "tpu_custom_call" in text and "kvsched_ragged_paged_attention" in text


@pytest.mark.parametrize("knob", ["kvsched", "ours"])
def test_pallas_on_tpu_runs_the_kernel_the_knob_names(monkeypatch, knob):
    """KVSCHED_TPU_ATTENTION=kvsched (and its deprecated alias ours) is kvsched's
    kernels/tpu.py: the paged_attention dispatch on a (faked) TPU, with the
    stacked cache at a traced layer, lowered."""
    import functools

    import jax
    from jax import export

    from kvsched.engine import AttentionInputs, paged_attention

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setenv("KVSCHED_TPU_ATTENTION", knob)
    t, hq, d, p, bs, hkv, s, pps = 32, 8, 128, 32, 16, 2, 4, 8
    shapes = [((t, hq, d), jnp.bfloat16), ((2, p, bs, 2 * hkv, d), jnp.bfloat16),
              ((), jnp.int32), ((t,), jnp.int32), ((s + 1,), jnp.int32), ((s,), jnp.int32),
              ((s, pps), jnp.int32), ((1,), jnp.int32)]  # fmt: skip
    args = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in shapes]

    def f(q, cache, layer, *plan):
        return paged_attention(q, cache, AttentionInputs(*plan), scale=0.1, backend="pallas",
                               layer=layer)  # fmt: skip

    text = export.export(jax.jit(functools.partial(f)), platforms=["tpu"])(*args).mlir_module()
    assert "tpu_custom_call" in text and "kvsched_ragged_paged_attention" in text


@pytest.mark.parametrize(("hq", "hkv", "block_q"), [(4, 2, 8), (4, 4, 16), (8, 1, 8)])
def test_the_gpu_variant_matches_the_reference_in_the_interpreter(hq, hkv, block_q):
    from kvsched.engine.kernels.gpu import ragged_paged_attention_gpu

    for q, cache, inputs, _, _ in plans(hq=hq, hkv=hkv, d=16, block_size=4, steps=6):
        got = np.asarray(ragged_paged_attention_gpu(q, cache, inputs, scale=0.25,
                                                    block_q=block_q))  # fmt: skip
        want = np.asarray(reference_attention(q, cache, inputs, scale=0.25))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


# Per cache dtype: f32 caches keep f32 dots at HIGHEST precision (the reference's
# accuracy); bf16 / fp16 caches feed the dots in their own type with f32
# accumulation, and the softmax weights are rounded to it for the PV dot (one
# rounding of ~2^-8 / 2^-11 relative on top of the output's own).
GPU_TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, jnp.float16: 5e-3}


@pytest.mark.parametrize(
    ("hq", "hkv", "block_size", "dtype", "block_q", "tile"),
    [
        (2, 2, 16, jnp.float32, None, None),  # group 1, pages of 16, tiles of 4 pages
        (8, 2, 16, jnp.bfloat16, None, 1),  # group 4, one page per tile
        (8, 1, 32, jnp.bfloat16, None, None),  # group 8, pages of 32
        (8, 2, 32, jnp.float32, 4, 1),  # group 4, several blocks per prefill chunk
        (8, 2, 16, jnp.float16, 2, 3),  # tiles overhanging the page table (8 pages)
        (6, 2, 16, jnp.float32, None, None),  # group 3: M = 5 x 3 rows padded to 16
    ],
)
def test_the_gpu_kernel_matches_the_reference_per_dtype(hq, hkv, block_size, dtype, block_q,
                                                        tile):  # fmt: skip
    """The rebuilt GPU kernel (sequence-aligned query blocks, the GQA group as
    the dot's M, bf16/fp16 tensor-core operands) on mixed plans of decodes and
    prefill chunks, padding rows included."""
    from kvsched.engine.kernels.gpu import ragged_paged_attention_gpu

    tol = GPU_TOL[dtype]
    seen_mixed = False
    for q, cache, inputs, plan, _ in plans(hq=hq, hkv=hkv, d=16, block_size=block_size,
                                           dtype=dtype, steps=6):  # fmt: skip
        got = np.asarray(ragged_paged_attention_gpu(q, cache, inputs, scale=0.25, block_q=block_q,
                                                    kv_tile_pages=tile), np.float64)  # fmt: skip
        want = np.asarray(reference_attention(q, cache, inputs, scale=0.25), np.float64)
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
        assert not got[plan.num_tokens :].any(), "padding rows are zero"
        seen_mixed |= 0 < plan.num_decode < len(plan)
    assert seen_mixed


@pytest.mark.parametrize(
    ("hq", "hkv", "block_size", "dtype", "block_q", "kv_splits"),
    [
        (4, 2, 4, jnp.float32, 2, 2),
        (8, 1, 4, jnp.float32, 1, 3),  # more splits than some sequences have pages
        (8, 2, 16, jnp.bfloat16, 4, 4),
    ],
)
def test_the_gpu_kernel_with_split_kv_matches_the_reference(hq, hkv, block_size, dtype,
                                                            block_q, kv_splits):  # fmt: skip
    """Split-KV (flash-decoding): each program's pages shared over kv_splits
    programs, their f32 partials reduced after the kernel; on the same mixed
    plans (prefill chunks too, and splits that read no page)."""
    from kvsched.engine.kernels.gpu import ragged_paged_attention_gpu

    tol = GPU_TOL[dtype]
    for q, cache, inputs, plan, _ in plans(hq=hq, hkv=hkv, d=16, block_size=block_size,
                                           dtype=dtype, steps=6):  # fmt: skip
        got = np.asarray(ragged_paged_attention_gpu(q, cache, inputs, scale=0.25,
                                                    block_q=block_q, kv_splits=kv_splits),
                         np.float64)  # fmt: skip
        want = np.asarray(reference_attention(q, cache, inputs, scale=0.25), np.float64)
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
        assert not got[plan.num_tokens :].any(), "padding rows are zero"


def test_the_gpu_kernel_refuses_bad_arguments_by_name():
    from kvsched.engine.kernels.gpu import ragged_paged_attention_gpu

    q, cache, inputs, _, _ = next(plans(steps=1))
    with pytest.raises(ValueError, match="group"):
        ragged_paged_attention_gpu(q[:, :3], cache, inputs, scale=1.0)
    for knob in ("block_q", "kv_splits", "kv_tile_pages"):
        with pytest.raises(ValueError, match=f"{knob} must be >= 1, got 0"):
            ragged_paged_attention_gpu(q, cache, inputs, scale=1.0, **{knob: 0})


def test_the_gpu_kernel_picks_split_kv_from_the_plan_shape():
    from kvsched.engine.kernels.gpu import default_kv_splits

    assert default_kv_splits(1, 1, 8, 2048) == 16  # one 32k sequence: 8 -> 128 programs
    assert default_kv_splits(8, 5, 2, 4) == 4  # capped by the pages a sequence can hold
    assert default_kv_splits(256, 256, 8, 128) == 1  # 2048 programs fill the SMs
    assert default_kv_splits(512, 4, 8, 128) == 1  # prefill-heavy bucket: no split


def test_gpu_query_blocks_never_straddle_sequences_and_cover_every_row_once():
    """The program table on real plans: every program's rows lie in one
    sequence, every real row is in exactly one program, a decode row is a block
    of its own, and the program count depends on the plan's shape only."""
    import jax

    from kvsched.engine.kernels.gpu import program_table

    table = jax.jit(program_table, static_argnums=(2, 3))
    counts = set()
    for _, _, inputs, plan, _ in plans(steps=8):
        for block_q in (1, 3, 8):
            cu = np.asarray(inputs.cu_q_lens)
            t, s = plan.bucket, len(cu) - 1
            seq, row0, rows, starts = (np.asarray(a) for a in table(
                inputs.cu_q_lens, inputs.num_seqs, t, block_q))  # fmt: skip
            counts.add((t, s, block_q, len(seq)))
            assert len(seq) == -(-t // block_q) + s
            hits = np.zeros(t, int)
            for j, r0, n in zip(seq, row0, rows, strict=True):
                assert 0 <= n <= block_q
                if n:
                    assert cu[j] <= r0 and r0 + n <= cu[j + 1], "a block stays in its sequence"
                    hits[r0 : r0 + n] += 1
            assert (hits[: plan.num_tokens] == 1).all() and not hits[plan.num_tokens :].any()
            for i in range(plan.num_decode):  # decodes come first, one row each
                assert rows[starts[i]] == 1 and seq[starts[i]] == i
    assert len({c[:3] for c in counts}) == len(counts), "one grid per shape and block size"


def test_the_gpu_kernel_matches_jaxs_gpu_paged_attention_on_decode():
    """An independent kernel: JAX's own Pallas GPU decode kernel (paged K/V
    [Hkv, P, page, D], interpret mode), on a decode batch of varied lengths.
    The shape (8 rows, 5 slots, 2 KV heads) makes ours pick 4 KV splits."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

    from kvsched.engine import AttentionInputs
    from kvsched.engine.kernels.gpu import ragged_paged_attention_gpu

    rng = np.random.default_rng(3)
    seqs, hq, hkv, d, bs, pps = 5, 8, 2, 16, 16, 4
    kv_lens = np.array([1, 17, 64, 33, 40], np.int32)
    pages = 1 + rng.permutation(seqs * pps).reshape(seqs, pps).astype(np.int32)
    cache = rng.standard_normal((seqs * pps + 1, bs, 2 * hkv, d)).astype(np.float32)
    q = rng.standard_normal((8, hq, d)).astype(np.float32)
    q[seqs:] = 0
    inputs = AttentionInputs(
        positions=jnp.asarray(np.pad(kv_lens - 1, (0, 3))),
        cu_q_lens=jnp.asarray(np.arange(seqs + 1, dtype=np.int32)),
        kv_lens=jnp.asarray(kv_lens),
        page_indices=jnp.asarray(pages),
        num_seqs=jnp.asarray([seqs], np.int32),
    )
    got = np.asarray(ragged_paged_attention_gpu(jnp.asarray(q), jnp.asarray(cache), inputs,
                                                scale=1.0))  # fmt: skip
    k = jnp.asarray(cache[:, :, 0::2].transpose(2, 0, 1, 3))  # [Hkv, P, bs, D]
    v = jnp.asarray(cache[:, :, 1::2].transpose(2, 0, 1, 3))
    want = np.asarray(jax_pa.paged_attention(jnp.asarray(q[:seqs]), k, v, jnp.asarray(pages),
                                             jnp.asarray(kv_lens), pages_per_compute_block=2,
                                             k_splits=2, interpret=True))  # fmt: skip
    np.testing.assert_allclose(got[:seqs], want, atol=2e-5, rtol=2e-5)
    assert not got[seqs:].any()


@pytest.mark.parametrize(("window", "kv_splits"), [(None, 1), (48, 1), (48, 4)])
def test_the_gpu_variant_lowers_to_triton_for_cuda(window, kv_splits):
    """Ops Triton lacks (value slices, stacks) fail here, not on the GPU. Needs
    the jax CUDA plugin's Python side (.ci/run installs it without CUDA). A
    windowed layer (with a soft cap and sinks; split-KV too) lowers as well."""
    pytest.importorskip("jax_cuda12_plugin")
    import functools

    import jax
    from jax import export

    from kvsched.engine.kernels.gpu import _call

    t, hq, d, p, bs, hkv, s, pps = 64, 8, 128, 64, 16, 2, 8, 16
    shapes = [((t, hq, d), jnp.bfloat16), ((p, bs, 2 * hkv, d), jnp.bfloat16), ((s,), jnp.int32),
              ((s, pps), jnp.int32), ((s + 1,), jnp.int32), ((1,), jnp.int32)]  # fmt: skip
    args = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in shapes]
    kw = {} if window is None else {"window": window, "soft_cap": 50.0}
    f = jax.jit(functools.partial(_call, scale=0.1, block_q=16, interpret=False,
                                  kv_splits=kv_splits, **kw))  # fmt: skip
    if window is not None:  # sinks: an [Hq] array operand
        args.append(jax.ShapeDtypeStruct((hq,), jnp.float32))
        f = jax.jit(lambda *a, f=f: f(*a[:-1], sinks=a[-1]))
    safety = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = export.export(f, platforms=["cuda"], disabled_checks=safety)(*args).mlir_module()
    assert "__gpu$xla.gpu.triton" in text and "kvsched_ragged_paged_attention_gpu" in text


@pytest.mark.parametrize(
    ("dtype", "operand", "kv_splits", "window"),
    [(jnp.bfloat16, "bf16", 1, None), (jnp.float32, "f32", 1, None),
     (jnp.bfloat16, "bf16", 4, None), (jnp.bfloat16, "bf16", 1, 100), (jnp.float32, "f32", 4, 100)],
)  # fmt: skip
def test_the_gpu_kernel_lowers_to_triton_for_cuda_as_one_kv_loop_of_group_dots(
    monkeypatch, dtype, operand, kv_splits, window
):
    """The Triton program itself (read from Pallas' lowering, needs the jax
    CUDA plugin like the test above): one loop (over the sequence's KV tiles of
    4 pages; no scan over sequences), two dots in it with M = block_q x group rows, bf16
    operands for a bf16 cache (tensor cores) and f32 (IEEE) for an f32 one, each
    accumulating in f32; num_stages 3; with split-KV, three f32 partials out. A
    sliding window changes the loop's bounds, not its body."""
    pytest.importorskip("jax_cuda12_plugin")
    import functools
    import re

    import jax
    from jax import export
    from jax._src.pallas.triton import pallas_call_registration as registration

    from kvsched.engine.kernels.gpu import _call

    programs = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        result = lower(*a, **k)
        programs.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", capture)
    t, hq, d, p, bs, hkv, s, pps, block_q = 64, 8, 128, 64, 16, 2, 8, 16, 4
    kt = 64  # keys per KV tile: 4 pages of 16 (default_tile_pages)
    shapes = [((t, hq, d), dtype), ((p, bs, 2 * hkv, d), dtype), ((s,), jnp.int32),
              ((s, pps), jnp.int32), ((s + 1,), jnp.int32), ((1,), jnp.int32)]  # fmt: skip
    args = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in shapes]
    f = jax.jit(functools.partial(_call, scale=0.1, block_q=block_q, interpret=False,
                                  kv_splits=kv_splits, window=window))  # fmt: skip
    safety = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = export.export(f, platforms=["cuda"], disabled_checks=safety)(*args).mlir_module()
    assert "num_stages = 3" in text
    # Split-KV: the f32 accumulator, max and denominator are stored; else the output.
    stores = re.findall(r"tt\.store .*: tensor<(\d+)x(\d+)x!tt\.ptr<(\w+)>>", asm := programs[0])
    m0 = str(block_q * hq // hkv)
    out = operand if operand == "f32" else "bf16"
    assert stores == ([(m0, str(d), "f32"), (m0, "1", "f32"), (m0, "1", "f32")] if kv_splits > 1
                      else [(m0, str(d), out)])  # fmt: skip
    assert len(programs) == 1
    assert len(re.findall(r"\bscf\.(?:for|while)\b", asm)) == 1, "one loop: the pages"
    dots = re.findall(r"tt\.dot .*?: tensor<(\d+)x(\d+)x(\w+)> \* tensor<(\d+)x(\d+)x(\w+)> "
                      r"-> tensor<(\d+)x(\d+)x(\w+)>", asm)  # fmt: skip
    m = block_q * hq // hkv
    assert dots == [
        (str(m), str(d), operand, str(d), str(kt), operand, str(m), str(kt), "f32"),  # QK
        (str(m), str(kt), operand, str(kt), str(d), operand, str(m), str(d), "f32"),  # PV
    ]
    if operand == "f32":
        assert "tf32" not in asm, "f32 dots stay IEEE (HIGHEST), not TF32"


def test_the_gpu_kernel_lowers_to_triton_for_cuda_with_a_group_of_3():
    """Triton tiles are powers of two: a group of 3 (block_q 5, 15 rows) is padded
    to M = 16 before the kernel."""
    pytest.importorskip("jax_cuda12_plugin")
    import functools

    import jax
    from jax import export

    from kvsched.engine.kernels.gpu import _call

    t, hq, d, p, bs, hkv, s, pps = 32, 6, 64, 32, 16, 2, 4, 8
    shapes = [((t, hq, d), jnp.bfloat16), ((p, bs, 2 * hkv, d), jnp.bfloat16), ((s,), jnp.int32),
              ((s, pps), jnp.int32), ((s + 1,), jnp.int32), ((1,), jnp.int32)]  # fmt: skip
    args = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in shapes]
    f = jax.jit(functools.partial(_call, scale=0.1, block_q=5, interpret=False))
    safety = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = export.export(f, platforms=["cuda"], disabled_checks=safety)(*args).mlir_module()
    assert "__gpu$xla.gpu.triton" in text
