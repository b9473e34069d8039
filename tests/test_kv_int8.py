"""int8 KV cache: per-token-per-head absmax quantization, writes, the reference
backend reading it (against a float64 oracle on real mixed plans), the Pallas
backends refusing it, and the bytes a token takes."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from engine_helpers import plans  # noqa: E402

import kvsched  # noqa: E402
from kvsched.engine.attention import paged_attention  # noqa: E402
from kvsched.engine.inputs import AttentionInputs  # noqa: E402
from kvsched.engine.kernels.reference import oracle_attention, reference_attention  # noqa: E402
from kvsched.engine.kv_cache import (  # noqa: E402
    KVCacheSpec,
    QuantizedKV,
    UnsupportedKVDtype,
    dequantize,
    init_cache,
    init_caches,
    kv_bytes_per_token,
    quantize,
    write_kv,
    write_kv_layer,
)


def oracle(q, cache, inputs, scale):
    return oracle_attention(
        np.asarray(q, np.float64), cache, np.asarray(inputs.positions),
        np.asarray(inputs.cu_q_lens), np.asarray(inputs.kv_lens), np.asarray(inputs.page_indices),
        int(inputs.num_seqs[0]), scale=scale,
    )  # fmt: skip


def int8_of(cache: jax.Array) -> QuantizedKV:
    """A float cache quantized slot by slot: what int8 writes of the same K/V
    make (each slot's quantization is independent of every other)."""
    return QuantizedKV(*quantize(cache))


def test_round_trip_error_is_at_most_half_a_step():
    rng = np.random.default_rng(0)
    # Heads of very different magnitudes, and outliers: the scale is per (token, head).
    x = rng.standard_normal((64, 6, 64)) * np.exp(rng.uniform(-8, 8, (64, 6, 1)))
    x[3, 2, 5] = 1e4
    x = jnp.asarray(x, jnp.float32)
    q, s = quantize(x)
    assert q.dtype == jnp.int8 and s.dtype == jnp.float32 and s.shape == (64, 6)
    assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) == 127
    np.testing.assert_array_equal(np.max(np.abs(np.asarray(q, np.int32)), axis=-1), 127)
    err = np.abs(np.asarray(x, np.float64) - np.asarray(dequantize(q, s), np.float64))
    bound = np.asarray(s, np.float64)[..., None] / 2
    assert (err <= bound * (1 + 1e-5)).all(), float(np.max(err / bound))
    # A QuantizedKV dequantizes the same way; a float cache passes through.
    np.testing.assert_array_equal(dequantize(QuantizedKV(q, s)), dequantize(q, s))
    assert dequantize(x) is x


def test_a_zero_vector_has_scale_zero_and_no_nan():
    x = jnp.zeros((2, 4, 8), jnp.float32).at[1, 3].set(0.5)
    q, s = quantize(x)
    assert not np.asarray(s)[0].any() and not np.asarray(q)[0].any()
    out = np.asarray(dequantize(q, s))
    assert np.isfinite(out).all() and not out[0].any()
    np.testing.assert_allclose(out[1, 3], 0.5, rtol=1e-6)


def test_spec_accepts_names_and_dtypes_and_sizes_int8_with_its_scales():
    f32 = KVCacheSpec(8, 4, 2, 64, jnp.float32)
    assert f32.dtype == jnp.float32 and not f32.quantized
    assert KVCacheSpec(8, 4, 2, 64, "bfloat16").dtype == jnp.bfloat16
    i8 = KVCacheSpec(8, 4, 2, 64, "int8")
    assert i8 == KVCacheSpec(8, 4, 2, 64, jnp.dtype("int8")) and i8.quantized
    assert f32.bytes_per_token_per_layer == 2 * 2 * 64 * 4 == 1024
    assert i8.bytes_per_token_per_layer == 2 * 2 * (64 + 4) == 272
    assert i8.bytes_per_layer == 8 * 4 * 272
    one, stacked = init_cache(i8), init_caches(i8, 3)
    assert isinstance(one, QuantizedKV) and isinstance(stacked, QuantizedKV)
    assert (one.values.shape, one.values.dtype) == ((8, 4, 4, 64), jnp.int8)
    assert (one.scales.shape, one.scales.dtype) == ((8, 4, 4), jnp.float32)
    assert stacked.values.shape == (3, 8, 4, 4, 64) and stacked.scales.shape == (3, 8, 4, 4)
    assert one.nbytes == i8.bytes_per_layer and stacked.nbytes == 3 * i8.bytes_per_layer
    assert init_caches(f32, 3).nbytes == 3 * f32.bytes_per_layer
    with pytest.raises(ValueError, match="int8"):
        KVCacheSpec(8, 4, 2, 64, "int32")


def test_bytes_per_token_smollm2_135m():
    # 30 layers, 3 KV heads, head_dim 64: 2 x 30 x 3 x 64 x bytes, + 2 x 30 x 3 x 4 of scales.
    f32 = kv_bytes_per_token(30, 3, 64, "float32")
    bf16 = kv_bytes_per_token(30, 3, 64, jnp.bfloat16)
    int8 = kv_bytes_per_token(30, 3, 64, "int8")
    assert (f32, bf16, int8) == (46_080, 23_040, 12_240)
    assert int8 == 2 * 30 * 3 * (64 + 4)
    assert bf16 / int8 == pytest.approx(1.882, abs=1e-3)  # the pool holds ~1.88x the tokens
    per_layer = KVCacheSpec(1, 1, 3, 64, "int8").bytes_per_token_per_layer
    assert int8 == 30 * per_layer
    # The capacity model counts the same bytes.
    from kvsched.capacity import ModelShape

    m = ModelShape("smollm2-135m", 30, 3, 64, 135e6, 49152)
    for name in ("float32", "bfloat16", "int8"):
        assert m.kv_bytes_per_token(kv_dtype=name) == kv_bytes_per_token(30, 3, 64, name)


def test_writes_quantize_and_padding_drops_from_values_and_scales():
    spec = KVCacheSpec(num_blocks=4, block_size=2, kv_heads=1, head_dim=2, dtype="int8")
    cache = init_cache(spec)
    k = jnp.asarray([[[1.0, -0.5]], [[0.0, 0.0]], [[9.0, 9.0]]])  # [3 tokens, 1 head, 2]
    v = jnp.asarray([[[0.25, 0.0]], [[-2.0, 1.0]], [[9.0, 9.0]]])
    pad = spec.num_blocks * spec.block_size
    cache = write_kv(cache, k, v, jnp.asarray([3, 0, pad], jnp.int32))
    assert isinstance(cache, QuantizedKV)
    vals = np.asarray(cache.values).reshape(-1, 2, 2)
    scales = np.asarray(cache.scales).reshape(-1, 2)
    assert vals[3].tolist() == [[127, -64], [127, 0]]  # K at head 0, V at head 1
    np.testing.assert_allclose(scales[3], [1 / 127, 0.25 / 127], rtol=1e-6)
    assert vals[0].tolist() == [[0, 0], [-127, 64]]
    np.testing.assert_allclose(scales[0], [0.0, 2 / 127], rtol=1e-6)
    assert np.count_nonzero(scales) == 3 and np.count_nonzero(vals) == 5, "the pad write vanished"
    assert not vals[-1].any() and not scales[-1].any(), "and did not wrap onto the last slot"
    np.testing.assert_allclose(
        dequantize(cache).reshape(-1, 2, 2)[3], [[1.0, -64 / 127], [0.25, 0.0]], rtol=1e-6
    )


def test_int8_writes_equal_the_float_cache_quantized():
    rng = np.random.default_rng(1)
    spec = KVCacheSpec(num_blocks=6, block_size=4, kv_heads=2, head_dim=16)
    f, i8 = init_cache(spec), init_cache(KVCacheSpec(6, 4, 2, 16, "int8"))
    for _ in range(3):
        k, v = (jnp.asarray(rng.standard_normal((8, 2, 16)), jnp.float32) for _ in "kv")
        slots = jnp.asarray(np.r_[rng.choice(24, 6, replace=False), 24, 24], jnp.int32)
        f, i8 = write_kv(f, k, v, slots), write_kv(i8, k, v, slots)
    want = int8_of(f)
    np.testing.assert_array_equal(i8.values, want.values)
    np.testing.assert_array_equal(i8.scales, want.scales)


def test_stacked_layer_write_equals_a_per_layer_write_and_donates():
    rng = np.random.default_rng(2)
    spec = KVCacheSpec(num_blocks=5, block_size=4, kv_heads=2, head_dim=8, dtype="int8")
    k, v = (jnp.asarray(rng.standard_normal((6, 2, 8)), jnp.bfloat16) for _ in "kv")
    slots = jnp.asarray([0, 7, 19, 20, 20, 3], jnp.int32)  # 20: padding
    one = write_kv(init_cache(spec), k, v, slots)

    @jax.jit
    def layer_write(caches, layer):
        return write_kv_layer(caches, layer, k, v, slots)

    stacked = layer_write(init_caches(spec, 3), jnp.int32(1))
    np.testing.assert_array_equal(stacked.values[1], one.values)
    np.testing.assert_array_equal(stacked.scales[1], one.scales)
    for other in (0, 2):
        assert not np.asarray(stacked.values[other]).any()
        assert not np.asarray(stacked.scales[other]).any()

    # write_kv donates both arrays of the pytree.
    before = init_cache(spec)
    after = write_kv(before, k, v, slots)
    assert before.values.is_deleted() and before.scales.is_deleted()
    np.testing.assert_array_equal(after.values, one.values)


@pytest.mark.slow
@pytest.mark.parametrize(("hq", "hkv", "block_size"), [(4, 2, 4), (8, 1, 2)])
def test_reference_reads_int8_like_the_oracle_on_mixed_plans(hq, hkv, block_size):
    d, scale = 16, 0.25
    seen_mixed, worst = False, 0.0
    for q, cache, inputs, plan, _ in plans(hq=hq, hkv=hkv, d=d, block_size=block_size):
        qkv = int8_of(cache)
        got = np.asarray(reference_attention(q, qkv, inputs, scale=scale), np.float64)
        n = plan.num_tokens
        # Against the oracle on the dequantized cache: the same numbers, float64.
        np.testing.assert_allclose(got[:n], oracle(q, qkv, inputs, scale)[:n], atol=1e-5,
                                   rtol=1e-5)  # fmt: skip
        assert not got[n:].any(), "padding rows are zero"
        # Against the unquantized cache: the quantization error.
        exact = oracle(q, np.asarray(cache, np.float64), inputs, scale)
        worst = max(worst, float(np.max(np.abs(got[:n] - exact[:n]))))
        # The stacked form with `layer` reads the same.
        stacked = QuantizedKV(*(jnp.stack([jnp.zeros_like(a), a]) for a in qkv))
        via = paged_attention(q, stacked, inputs, scale=scale, backend="reference", layer=1)
        np.testing.assert_array_equal(np.asarray(via, np.float64), got)
        seen_mixed |= 0 < plan.num_decode < len(plan)
    assert seen_mixed, "the workload mixes decodes and prefill chunks in one plan"
    # Unit-variance K/V, int8 steps of ~3/127: outputs move by ~1e-2 at most.
    print(f"int8 vs f32 KV, hq={hq} hkv={hkv}: max |error| {worst:.2e}")
    assert worst < 2e-2


def test_stale_scales_and_values_past_kv_len_are_harmless():
    """A reused page's unused slots keep a previous owner's int8 values and scales
    (a scale can be inf or NaN after an overflow): rows past kv_len are zeroed."""
    q, cache, inputs, plan, _ = next(iter(plans(steps=2)))
    qkv = int8_of(cache)
    vals, scales = np.asarray(qkv.values).copy(), np.asarray(qkv.scales).copy()
    bs = vals.shape[1]
    for i in range(len(plan)):
        kv_len = int(inputs.kv_lens[i])
        row = np.asarray(inputs.page_indices[i])
        for pos in range(kv_len, -(-kv_len // bs) * bs):  # the tail of the last page
            vals[row[pos // bs], pos % bs] = 127
            scales[row[pos // bs], pos % bs] = np.inf
    vals[0], scales[0] = -127, np.nan  # the padding page
    stale = QuantizedKV(jnp.asarray(vals), jnp.asarray(scales))
    got = np.asarray(paged_attention(q, stale, inputs, scale=0.25, backend="reference"))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, oracle(q, qkv, inputs, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["pallas", "pallas_gpu"])
@pytest.mark.parametrize("layer", [None, 0])
def test_the_pallas_backends_refuse_int8_clearly(backend, layer):
    q, cache, inputs, _, _ = next(iter(plans(steps=1)))
    qkv = int8_of(cache)
    if layer is not None:
        qkv = QuantizedKV(*(a[None] for a in qkv))
    with pytest.raises(UnsupportedKVDtype, match=f"{backend!r}.*int8.*reference") as e:
        paged_attention(q, qkv, inputs, scale=0.25, backend=backend, layer=layer)
    assert isinstance(e.value, NotImplementedError)


def test_jit_donation_and_a_layer_scan_carry_the_pytree():
    """The model's shape of use: stacked int8 caches in a lax.scan carry, each
    layer writing then reading through `layer`, under jit with the caches donated."""
    hq, hkv, d, nl = 4, 2, 16, 3
    rng = np.random.default_rng(3)
    steps = list(plans(hq=hq, hkv=hkv, d=d, steps=3))
    q, _, inputs, plan, _ = steps[-1]
    t = q.shape[0]
    ks = jnp.asarray(rng.standard_normal((nl, t, hkv, d)), jnp.float32)
    vs = jnp.asarray(rng.standard_normal((nl, t, hkv, d)), jnp.float32)
    slots = jnp.asarray(plan.slot_mapping)

    def step(caches, q, ks, vs, plan_arrays):
        inputs = AttentionInputs(*plan_arrays)

        def body(caches, xs):
            i, k, v = xs
            caches = write_kv_layer(caches, i, k, v, slots)
            out = paged_attention(q, caches, inputs, scale=0.25, backend="reference", layer=i)
            return caches, out

        return jax.lax.scan(body, caches, (jnp.arange(nl, dtype=jnp.int32), ks, vs))

    spec = KVCacheSpec(256, 4, hkv, d, "int8")
    start = QuantizedKV(*(jnp.broadcast_to(a, (nl, *a.shape)) for a in int8_of(steps[-1][1])))
    start = jax.tree.map(jnp.array, start)  # owned copies, donated below
    expect_layers = []
    for i in range(nl):  # layer by layer, outside any scan
        one = write_kv(QuantizedKV(start.values[i], start.scales[i]), ks[i], vs[i], slots)
        expect_layers.append((one, reference_attention(q, one, inputs, scale=0.25)))
    caches, outs = jax.jit(step, donate_argnums=(0,))(
        start, q, ks, vs, (inputs.positions, inputs.cu_q_lens, inputs.kv_lens,
                           inputs.page_indices, inputs.num_seqs)
    )  # fmt: skip
    assert start.values.is_deleted() and start.scales.is_deleted(), "donated"
    assert isinstance(caches, QuantizedKV) and caches.values.shape == (nl, *spec.shape)
    for i, (one, out) in enumerate(expect_layers):
        np.testing.assert_array_equal(caches.values[i], one.values)
        np.testing.assert_array_equal(caches.scales[i], one.scales)
        np.testing.assert_allclose(outs[i], out, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_the_model_step_runs_on_int8_kv_close_to_float():
    """forward_paged (layers under lax.scan) over int8 caches vs float32 caches on
    the same plans: the logits stay close."""
    from kvsched.engine.model import LlamaConfig, forward_paged, init_params

    model = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=16, ffn_dim=128)  # fmt: skip
    params = init_params(model, seed=1)
    cfg = kvsched.SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4,
                                  max_batched_tokens=32, max_seq_len=64, long_prefill_chunk=8,
                                  overhead_reserve=0.0)  # fmt: skip
    sched = kvsched.Scheduler(cfg)
    sched.add_tenant(kvsched.TenantConfig("t"))
    rng = np.random.default_rng(4)
    for n in (5, 19, 11):
        sched.submit("t", rng.integers(0, 256, n).astype(np.int32), 4, now=0.0)

    @jax.jit
    def fwd(caches, plan_arrays):
        token_ids, positions, slots, cu, kv_lens, pages, num_seqs, logits_idx = plan_arrays
        inputs = AttentionInputs(positions, cu, kv_lens, pages, num_seqs)
        return forward_paged(params, caches, model, token_ids, positions, slots, inputs,
                             logits_idx)  # fmt: skip

    f32 = init_caches(KVCacheSpec(64, 4, 2, 16, "float32"), model.n_layers)
    i8 = init_caches(KVCacheSpec(64, 4, 2, 16, "int8"), model.n_layers)
    worst = 0.0
    for step in range(6):
        plan = sched.step(now=float(step))
        if plan is None:
            break
        arrays = tuple(jnp.asarray(a) for a in (
            plan.token_ids, plan.positions, plan.slot_mapping, plan.cu_q_lens, plan.kv_lens,
            plan.page_indices, plan.num_seqs, plan.logits_indices))  # fmt: skip
        want, f32 = fwd(f32, arrays)
        got, i8 = fwd(i8, arrays)
        assert isinstance(i8, QuantizedKV)
        n = len(plan)
        want, got = np.asarray(want)[:n], np.asarray(got)[:n]
        worst = max(worst, float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
        sched.commit(plan, want.argmax(-1).astype(np.int32), now=float(step))
    print(f"int8 vs f32 KV logits: max |error| / max |logit| = {worst:.2e}")
    assert worst < 2e-2
