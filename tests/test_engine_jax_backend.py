"""Backend "jax": JAX's ragged paged attention (its Pallas TPU kernel on TPU,
its jnp reference `ref_ragged_paged_attention` elsewhere) fed from our plans and
cache, checked against our reference and the float64 oracle on real mixed plans.

Cost note: off TPU the backend runs JAX's reference eagerly (host callback), and
eager JAX compiles each small op once per new (q_len, kv_len): about 0.1 s per
op on the 2-core CI machine. The plans below are kept few and share their
token shapes (page size does not change them: the page gather runs in numpy) so
the compiled ops are reused across cases.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("jax")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from engine_helpers import plans  # noqa: E402

import kvsched  # noqa: E402
from kvsched.engine import paged_attention, reference_attention  # noqa: E402
from kvsched.engine.attention import resolve_backend, tpu_attention  # noqa: E402
from kvsched.engine.inputs import AttentionInputs  # noqa: E402
from kvsched.engine.kernels.jax_rpa import (  # noqa: E402
    jax_ragged_paged_attention,
    jax_reference,
    kernel_layout,
    mask_padding_rows,
)
from kvsched.engine.kernels.reference import oracle_attention  # noqa: E402
from kvsched.engine.kv_cache import QuantizedKV, UnsupportedKVDtype, quantize  # noqa: E402

SMALL = {"steps": 4, "prompts": (3, 9, 14), "late": ()}  # prefill, mixed, decode; few shapes


def snapshot(gen):
    """The plans as (q, cache copy, inputs, plan): the generator donates its cache."""
    return [(q, jnp.asarray(np.asarray(c)), i, p) for q, c, i, p, _ in gen]


@functools.cache
def small_plans(hq=4, hkv=2, block_size=4, dtype=jnp.float32):
    return snapshot(plans(hq=hq, hkv=hkv, d=16, block_size=block_size, dtype=dtype, **SMALL))


def oracle(q, cache, inputs, scale):
    return oracle_attention(
        np.asarray(q, np.float64), np.asarray(cache, np.float64), np.asarray(inputs.positions),
        np.asarray(inputs.cu_q_lens), np.asarray(inputs.kv_lens), np.asarray(inputs.page_indices),
        int(inputs.num_seqs[0]), scale=scale,
    )  # fmt: skip


def test_jax_derives_the_row_positions_our_plans_carry():
    """JAX's kernel takes no positions: row i of sequence s is at kv_len - q_len + i.
    Every plan the scheduler makes must agree, or the backend would be wrong."""
    checked = 0
    for block_size in (2, 4, 16):
        for _, _, inputs, _, _ in plans(block_size=block_size, steps=10):
            cu, kv = np.asarray(inputs.cu_q_lens), np.asarray(inputs.kv_lens)
            pos = np.asarray(inputs.positions)
            for s in range(int(inputs.num_seqs[0])):
                q_len = cu[s + 1] - cu[s]
                want = kv[s] - q_len + np.arange(q_len)
                np.testing.assert_array_equal(pos[cu[s] : cu[s + 1]], want)
                assert 0 < q_len <= kv[s]  # JAX's dynamic check: q_len <= kv_len
                checked += 1
    assert checked > 40


@pytest.mark.parametrize(
    ("hkv", "block_size"),
    [
        (2, 4),  # GQA
        (2, 2),  # tiny pages
        (2, 16),  # one page holds a whole prompt
        (1, 8),  # MQA
        (4, 4),  # MHA
    ],
)
def test_jax_backend_matches_our_reference_on_mixed_plans(hkv, block_size):
    """Four query heads throughout: the cases share most of their compiled ops."""
    seen_mixed = False
    run = jax.jit(lambda q, c, i: paged_attention(q, c, i, scale=0.25, backend="jax"))
    for q, cache, inputs, plan in small_plans(4, hkv, block_size):
        got = np.asarray(run(q, cache, inputs), np.float64)
        want = np.asarray(reference_attention(q, cache, inputs, scale=0.25), np.float64)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
        n = plan.num_tokens
        want64 = oracle(q, cache, inputs, 0.25)
        np.testing.assert_allclose(got[:n], want64[:n], atol=2e-5, rtol=2e-5)
        assert not got[n:].any(), "padding rows are zero"
        seen_mixed |= 0 < plan.num_decode < len(plan)
    assert seen_mixed, "a plan mixes decodes and prefill chunks"


def test_jax_backend_in_bfloat16_on_a_mixed_plan():
    """bf16 q and cache (the TPU's dtype): JAX's reference casts the
    probabilities to bf16 before the PV product, hence the bf16 tolerance."""
    mixed = [x for x in small_plans(dtype=jnp.bfloat16) if 0 < x[3].num_decode < len(x[3])]
    q, cache, inputs, plan = mixed[0]
    got = np.asarray(paged_attention(q, cache, inputs, scale=0.25, backend="jax"), np.float64)
    want = np.asarray(reference_attention(q, cache, inputs, scale=0.25), np.float64)
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)
    assert not got[plan.num_tokens :].any()


def test_the_stacked_cache_is_read_at_a_traced_layer_without_slicing():
    """The engine's use: the [L, P, ...] cache in a lax.scan, layer traced. The
    view [L*P, ...] plus a page offset reads each layer's own pages."""
    q, cache, inputs, plan = small_plans()[3]
    layers = jnp.stack([cache, -2.0 * cache, cache + 1.0])

    def scan_all(q, layers, inputs):
        def body(carry, i):
            return carry, paged_attention(q, layers, inputs, scale=0.25, backend="jax", layer=i)

        return jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))[1]

    got = np.asarray(jax.jit(scan_all)(q, layers, inputs))
    for i in range(3):
        want = np.asarray(reference_attention(q, layers[i], inputs, scale=0.25))
        np.testing.assert_allclose(got[i], want, atol=2e-5, rtol=2e-5)
    view, offset = kernel_layout(layers, q.shape[-1], jnp.int32(2))
    assert view.shape == (3 * cache.shape[0], *cache.shape[1:])
    assert int(offset) == 2 * cache.shape[0]
    np.testing.assert_array_equal(view[int(offset) + 5], layers[2, 5])


def test_a_packed_cache_is_read_as_the_same_bytes():
    from kvsched.engine.kernels.layout import pack_cache

    q, cache, inputs, _ = small_plans()[2]
    got = paged_attention(q, pack_cache(cache), inputs, scale=0.25, backend="jax")
    want = reference_attention(q, cache, inputs, scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_padding_rows_are_masked_and_an_empty_plan_is_zero():
    """JAX's kernel leaves rows past the plan's tokens as its accumulator held
    them: the backend zeroes them. A plan with no sequence (warmup) is all 0."""
    q, cache, inputs, plan = small_plans()[3]
    n = plan.num_tokens
    assert n < q.shape[0], "this plan has padding rows"
    garbage = jnp.full(q.shape, 7.0, q.dtype)
    masked = np.asarray(mask_padding_rows(garbage, inputs.cu_q_lens, inputs.num_seqs))
    assert (masked[:n] == 7.0).all() and not masked[n:].any()
    empty = AttentionInputs(
        inputs.positions, jnp.zeros_like(inputs.cu_q_lens), jnp.zeros_like(inputs.kv_lens),
        jnp.zeros_like(inputs.page_indices), jnp.zeros_like(inputs.num_seqs),
    )  # fmt: skip
    out = jax.jit(lambda q, c, i: paged_attention(q, c, i, scale=0.25, backend="jax"))(
        q, cache, empty
    )
    assert out.shape == q.shape and not np.asarray(out).any()


def test_stale_non_finite_kv_past_kv_len_is_harmless():
    q, cache, inputs, plan = small_plans()[1]
    c = np.asarray(cache).copy()
    bs = c.shape[1]
    for i in range(len(plan)):
        kv_len = int(inputs.kv_lens[i])
        row = np.asarray(inputs.page_indices[i])
        for pos in range(kv_len, -(-kv_len // bs) * bs):  # the tail of the last page
            c[row[pos // bs], pos % bs] = np.inf
    c[0] = np.nan  # the padding page
    got = np.asarray(paged_attention(q, jnp.asarray(c), inputs, scale=0.25, backend="jax"))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, oracle(q, cache, inputs, 0.25), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("layer", [None, 0])
def test_int8_kv_is_refused_like_the_pallas_backends(layer):
    """JAX's kernel reads int8/fp8 pages with one static scale per tensor, not
    kvsched's scale per token and head: refused, clearly."""
    q, cache, inputs, _ = small_plans()[0]
    values, scales = quantize(cache)
    qkv = QuantizedKV(values, scales) if layer is None else QuantizedKV(values[None], scales[None])
    with pytest.raises(UnsupportedKVDtype, match="'jax'.*int8.*reference") as e:
        paged_attention(q, qkv, inputs, scale=0.25, backend="jax", layer=layer)
    assert isinstance(e.value, NotImplementedError)


def test_heads_that_do_not_group_and_bad_impls_are_refused():
    q, cache, inputs, _ = small_plans()[0]
    with pytest.raises(ValueError, match="group"):
        jax_ragged_paged_attention(q[:, :3], cache, inputs, scale=1.0)
    with pytest.raises(ValueError, match="impl"):
        jax_ragged_paged_attention(q, cache, inputs, scale=1.0, impl="fast")
    with pytest.raises(ValueError, match="fit neither"):
        jax_ragged_paged_attention(q[..., :5], cache, inputs, scale=1.0)


def test_which_kernel_pallas_runs_on_tpu_is_a_documented_knob(monkeypatch):
    monkeypatch.delenv("KVSCHED_TPU_ATTENTION", raising=False)
    assert tpu_attention() == "jax"  # the default: a prediction, not a measurement
    assert resolve_backend("pallas", "tpu") == "jax_kernel"
    assert resolve_backend("jax", "tpu") == "jax_kernel"
    assert resolve_backend("jax", "cpu") == "jax_reference"
    assert resolve_backend("pallas", "cpu") == "pallas"  # off TPU the knob changes nothing
    assert resolve_backend("pallas", "gpu") == "pallas_gpu"
    for knob in ("kvsched", "ours", " KVSched "):  # ours: deprecated, same as kvsched
        monkeypatch.setenv("KVSCHED_TPU_ATTENTION", knob)
        assert tpu_attention() == "kvsched"
        assert resolve_backend("pallas", "tpu") == "pallas"
        assert resolve_backend("jax", "tpu") == "jax_kernel"
    monkeypatch.setenv("KVSCHED_TPU_ATTENTION", "fastest")
    with pytest.raises(kvsched.InvalidConfig, match="KVSCHED_TPU_ATTENTION.*jax, kvsched"):
        resolve_backend("pallas", "tpu")
    # Version 1 of kvsched's kernel is gone: its old name says so.
    monkeypatch.setenv("KVSCHED_TPU_ATTENTION", "ours1")
    with pytest.raises(kvsched.InvalidConfig, match="version 1.*removed.*jax, kvsched"):
        resolve_backend("pallas", "tpu")
    monkeypatch.delenv("KVSCHED_TPU_ATTENTION")
    with pytest.raises(kvsched.InvalidConfig, match="unknown attention backend"):
        resolve_backend("triton")
    # JAX's kernel needs head_dim % 128 == 0 (64 fails in its lowering): pallas
    # keeps kvsched's kernel there, jax refuses.
    assert resolve_backend("pallas", "tpu", head_dim=64) == "pallas"
    assert resolve_backend("pallas", "tpu", head_dim=256) == "jax_kernel"
    assert resolve_backend("jax", "cpu", head_dim=64) == "jax_reference"
    with pytest.raises(kvsched.InvalidConfig, match="multiple of 128"):
        resolve_backend("jax", "tpu", head_dim=64)


def test_jax_reference_is_what_the_backend_runs_off_tpu():
    """Off TPU the backend is JAX's own reference on the converted inputs,
    masked: the same numbers as calling it directly."""
    q, cache, inputs, plan = small_plans()[2]
    plan_arrays = (inputs.kv_lens, inputs.page_indices, inputs.cu_q_lens, inputs.num_seqs)
    # numpy in, as the backend's host callback passes them (the same compiled ops)
    direct = np.asarray(jax_reference(*(np.asarray(a) for a in (q, cache, *plan_arrays)),
                                      sm_scale=0.25))  # fmt: skip
    got = np.asarray(paged_attention(q, cache, inputs, scale=0.25, backend="jax"))
    assert direct.shape[0] == plan.num_tokens
    np.testing.assert_array_equal(got[: plan.num_tokens], direct)


def _export_kernel(t, hq, d, p, bs, hkv, s, pps, dtype, layers=None, window=None, soft_cap=None):
    from jax import export

    cache_shape = (p, bs, 2 * hkv, d) if layers is None else (layers, p, bs, 2 * hkv, d)
    shapes = [((t, hq, d), dtype), (cache_shape, dtype), ((t,), jnp.int32), ((s + 1,), jnp.int32),
              ((s,), jnp.int32), ((s, pps), jnp.int32), ((1,), jnp.int32)]  # fmt: skip
    args = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in shapes]

    def f(q, cache, *plan):
        layer = None if layers is None else jnp.int32(1)
        return jax_ragged_paged_attention(
            q, cache, AttentionInputs(*plan), scale=0.1, layer=layer, impl="kernel",
            num_kv_pages_per_block=4, num_queries_per_block=16, sliding_window=window,
            soft_cap=soft_cap,
        )  # fmt: skip

    # JAX's kernel floor-divides, and Mosaic lowers that per TPU generation: it
    # asks the device kind, so the lowering names a TPU (v5e) it is meant for.
    tpu = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=tpu)
    with jax.sharding.use_abstract_mesh(mesh):
        return export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()


@pytest.mark.parametrize(("layers", "window"), [(None, None), (4, None), (None, 48), (4, 100)])
def test_the_jax_kernel_path_lowers_for_tpu(layers, window):
    """The TPU path as the engine calls it (layer view, page offset, the empty-plan
    guard, the padding mask; with a window, the window view of the page table and
    JAX's sliding_window and soft_cap) lowers to JAX's Mosaic kernel. Block sizes
    are given: the tuned table needs a TPU to say which generation it is.
    (Lowering only: Mosaic compiles on a TPU host.)"""
    cap = None if window is None else 30.0
    text = _export_kernel(64, 8, 128, 64, 16, 2, 8, 16, jnp.bfloat16, layers, window, cap)
    assert "tpu_custom_call" in text and "ragged_paged_attention_kernel" in text


def test_jax_kernel_does_not_lower_head_dim_64():
    """Why resolve_backend keeps kvsched's kernel for head_dim 64 on TPU: JAX's
    kernel widens its 128-lane softmax state to head_dim by concatenation."""
    with pytest.raises(AssertionError):
        _export_kernel(64, 8, 64, 64, 16, 2, 8, 16, jnp.bfloat16)


def test_the_jax_kernel_in_the_tpu_interpreter_on_one_small_plan():
    """JAX's kernel itself, in Pallas' TPU interpret mode on CPU. With jax 0.10.2
    it fails unmodified (the interpreter cannot apply a reshape to a buffer
    ref: 'ReshapeTransform' object has no attribute 'indices'): xfail, naming
    the error. If a JAX upgrade makes it run, it must match the reference."""
    from jax.experimental.pallas import tpu as pltpu

    q, cache, inputs, plan = snapshot(plans(hq=4, hkv=2, d=128, block_size=16, steps=1))[0]
    try:
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            got = np.asarray(
                jax_ragged_paged_attention(q, cache, inputs, scale=0.25, impl="kernel",
                                           num_kv_pages_per_block=2, num_queries_per_block=8)
            )  # fmt: skip
    except Exception as e:  # noqa: BLE001 (the interpreter's errors come wrapped)
        if "ReshapeTransform" in str(e) or "TypedInt" in str(e):
            # The error's own last line, not a slice through the traceback text.
            last = str(e).strip().splitlines()[-1]
            pytest.xfail(f"JAX's kernel does not run in the TPU interpreter ({last})")
        raise
    want = np.asarray(reference_attention(q, cache, inputs, scale=0.25))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    assert not got[plan.num_tokens :].any()


def test_the_engine_generates_the_same_greedy_tokens_as_the_reference_backend():
    """The tiny model end to end through backend "jax" (JAX's reference here):
    chunked prefill, a prefix-cache hit, decodes; the same tokens as backend
    "reference" and as dense recompute. Kept short: each new (q_len, kv_len)
    costs JAX's eager reference fresh compiles."""
    from test_engine import MODEL, PARAMS, engine, run

    from kvsched.engine.model import greedy_dense

    rng = np.random.default_rng(5)
    base = rng.integers(0, MODEL.vocab_size, 12).tolist()
    prompts = [base, base[:8] + rng.integers(0, MODEL.vocab_size, 3).tolist()]
    small = {"max_batched_tokens": 16}  # fewer token buckets to warm up
    eng = engine("jax", **small)
    assert eng.attention_kernel == "jax_reference" and eng.spec.shape[-2] == 2 * MODEL.n_kv_heads
    got = run(eng, prompts, 3, sequential=True)
    assert got == run(engine("reference", **small), prompts, 3, sequential=True)
    assert got == [greedy_dense(PARAMS, MODEL, p, 3) for p in prompts]
    st = eng.scheduler.stats()["tenants"]["t"]
    assert st["prefix_cache"]["hit_tokens"] > 0, "the second prompt hit the cached prefix"


def test_the_engine_on_a_tpu_says_which_kernel_and_lays_the_cache_out_for_it(monkeypatch):
    """Engine construction as on a TPU (the platform faked; nothing runs):
    `pallas` resolves to JAX's kernel where head_dim allows, the cache stays in
    JAX's split layout, and what JAX's kernel cannot read is refused up front."""
    from kvsched.engine.model import LlamaConfig, init_params
    from kvsched.engine.runner import Engine

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.delenv("KVSCHED_TPU_ATTENTION", raising=False)
    cfg = kvsched.SchedulerConfig(num_blocks=16, block_size=4, max_num_seqs=2,
                                  max_batched_tokens=16, max_seq_len=32)  # fmt: skip
    wide = LlamaConfig(vocab_size=64, dim=128, n_layers=1, n_heads=2, n_kv_heads=1,
                       head_dim=128, ffn_dim=64)  # fmt: skip
    narrow = LlamaConfig(vocab_size=64, dim=128, n_layers=1, n_heads=2, n_kv_heads=1,
                         head_dim=64, ffn_dim=64)  # fmt: skip

    def make(model, **kw):
        return Engine(model, init_params(model, seed=0), kvsched.Scheduler(cfg), **kw)

    eng = make(wide, backend="pallas")
    assert eng.attention_kernel == "jax_kernel" and eng.spec.shape[-2:] == (2, 128)
    with pytest.raises(kvsched.InvalidConfig, match="packed"):
        make(wide, backend="jax", kv_layout="packed")
    # head_dim 64: kvsched's kernel, on its packed layout; JAX's refused.
    eng = make(narrow, backend="pallas")
    assert eng.attention_kernel == "pallas" and eng.spec.shape[-2:] == (1, 128)
    with pytest.raises(kvsched.InvalidConfig, match="multiple of 128"):
        make(narrow, backend="jax")
    monkeypatch.setenv("KVSCHED_TPU_ATTENTION", "kvsched")
    assert make(wide, backend="pallas").attention_kernel == "pallas"
    with pytest.raises(kvsched.InvalidConfig, match="unknown attention backend"):
        make(wide, backend="mosaic")


def test_the_model_step_lowers_for_tpu_with_jax_tuned_blocks(monkeypatch):
    """The whole paged forward pass as the engine jits it on a TPU (the platform
    faked at trace time: layer scan, in-scan K/V writes, the traced layer's page
    offset), with backend "jax" picking its block sizes from JAX's tuned table
    for a v5e, lowers to one Mosaic kernel inside the scan."""
    from jax import export
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes

    from kvsched.engine.model import LlamaConfig, forward_paged, init_params

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(tuned_block_sizes, "get_tpu_version", lambda: 5)
    monkeypatch.setattr(tuned_block_sizes, "get_device_name", lambda *a: "TPU v5")
    model = LlamaConfig(vocab_size=64, dim=256, n_layers=2, n_heads=2, n_kv_heads=1,
                        head_dim=128, ffn_dim=64)  # fmt: skip
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16),
                          init_params(model, seed=0))  # fmt: skip
    t, s, pps, pages, bs = 32, 4, 8, 33, 16
    caches = jax.ShapeDtypeStruct((2, pages, bs, 2, 128), jnp.bfloat16)
    shapes = [(t,)] * 3 + [(s + 1,), (s,), (s, pps), (1,), (s,)]
    args = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in shapes]

    def step(params, caches, tokens, positions, slots, cu, kv_lens, page_indices, n, logits_at):
        inputs = AttentionInputs(positions, cu, kv_lens, page_indices, n)
        return forward_paged(params, caches, model, tokens, positions, slots, inputs, logits_at,
                             backend="jax")  # fmt: skip

    tpu = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=tpu)
    with jax.sharding.use_abstract_mesh(mesh):
        exported = export.export(jax.jit(step), platforms=["tpu"])(params, caches, *args)
    text = exported.mlir_module()
    assert text.count("ragged_paged_attention_kernel") >= 1 and "tpu_custom_call" in text
    assert "pure_callback" not in text and "callback" not in text.lower()
