"""The TPU kernel at head dims off the 128-lane width (SmolLM2-135M: 9 query
heads, 3 KV heads, head_dim 64), in both cache layouts ([P, bs, 2*Hkv, D] and
the packed [P, bs, Hkv, 2*D]), and reading one layer of the stacked caches in
place. Interpret mode on CPU; Mosaic lowering for TPU."""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("jax")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from engine_helpers import plans  # noqa: E402

from kvsched.engine import reference_attention  # noqa: E402
from kvsched.engine.kernels.layout import pack_cache  # noqa: E402
from kvsched.engine.kernels.reference import oracle_attention  # noqa: E402
from kvsched.engine.kernels.tpu import _call, ragged_paged_attention  # noqa: E402

# 4 KV pages per block: at these pages of 4 tokens the default would make each
# sequence's whole page row one block; 4 gives several blocks per sequence (the
# chain across them is read in every layout), and the interpreter compiles the
# kernel in about half the time (each block's page DMAs are unrolled).
PPB = 4


def as_layout(cache, layout):
    return pack_cache(cache) if layout == "packed" else cache


@pytest.mark.parametrize(
    ("hq", "hkv", "d", "layout", "block_q", "dtype", "tol"),
    [
        (9, 3, 64, "packed", 8, jnp.float32, 2e-5),  # SmolLM2-135M: GQA 9/3
        (9, 3, 64, "split", 8, jnp.float32, 2e-5),  # the step-plan layout (interpret only)
        (8, 1, 64, "packed", 8, jnp.float32, 2e-5),  # MQA
        (4, 4, 64, "packed", 16, jnp.float32, 2e-5),  # MHA, blocks straddling sequences
        (9, 3, 64, "packed", 8, jnp.bfloat16, 3e-2),
        (4, 2, 32, "packed", 8, jnp.float32, 2e-5),  # rows of 64 lanes
        (4, 2, 96, "packed", 8, jnp.float32, 2e-5),  # rows of 192 lanes
        (4, 2, 128, "packed", 8, jnp.float32, 2e-5),  # K | V split at lane 128
        (4, 2, 256, "split", 8, jnp.float32, 2e-5),
    ],
)
def test_head_dims_match_the_reference_on_mixed_plans(hq, hkv, d, layout, block_q, dtype, tol):
    scale = d**-0.5  # the real head_dim's, whatever the kernel pads to
    seen_mixed = False
    for q, cache, inputs, plan, _ in plans(hq=hq, hkv=hkv, d=d, dtype=dtype, steps=4):
        got = ragged_paged_attention(q, as_layout(cache, layout), inputs, scale=scale,
                                     block_q=block_q, pages_per_block=PPB)  # fmt: skip
        assert got.shape == q.shape and got.dtype == q.dtype
        got = np.asarray(got, np.float64)
        want = np.asarray(reference_attention(q, cache, inputs, scale=scale), np.float64)
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
        assert not got[plan.num_tokens :].any(), "padding rows are zero"
        seen_mixed |= 0 < plan.num_decode < len(plan)
    assert seen_mixed, "decodes and prefill chunks in one plan"


@pytest.mark.parametrize("layout", ["packed", "split"])
def test_stale_non_finite_kv_is_harmless_at_head_dim_64(layout):
    """inf in the unused tail of each last page and NaN in the padding page (in
    the packed layout one row holds K and V, and the zero q lanes meet V too)."""
    q, cache, inputs, plan, _ = list(plans(hq=9, hkv=3, d=64, steps=4))[-1]
    c = np.asarray(cache).copy()
    bs = c.shape[1]
    for i in range(len(plan)):
        kv_len = int(inputs.kv_lens[i])
        row = np.asarray(inputs.page_indices[i])
        for pos in range(kv_len, -(-kv_len // bs) * bs):
            c[row[pos // bs], pos % bs] = np.inf
    c[0] = np.nan
    got = ragged_paged_attention(q, as_layout(jnp.asarray(c), layout), inputs, scale=0.125,
                                 block_q=12, pages_per_block=PPB)  # fmt: skip
    got = np.asarray(got)
    want = oracle_attention(
        np.asarray(q, np.float64), np.asarray(cache, np.float64), np.asarray(inputs.positions),
        np.asarray(inputs.cu_q_lens), np.asarray(inputs.kv_lens), np.asarray(inputs.page_indices),
        int(inputs.num_seqs[0]), scale=0.125,
    )  # fmt: skip
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("d", "layout"), [(64, "packed"), (16, "split")])
def test_a_layer_of_the_stacked_caches_equals_that_layer_sliced(d, layout):
    q, cache, inputs, _, _ = list(plans(hq=9, hkv=3, d=d, steps=4))[-1]
    stacked = jnp.stack([as_layout(cache, layout) * (i + 1) for i in range(3)])

    @jax.jit
    def every_layer(stacked):
        def body(carry, i):  # the engine's shape: a traced layer inside lax.scan
            out = ragged_paged_attention(q, stacked, inputs, scale=0.125, layer=i,
                                         pages_per_block=PPB)  # fmt: skip
            return carry, out

        return jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))[1]

    outs = np.asarray(every_layer(stacked))
    for i in range(3):
        sliced = ragged_paged_attention(q, stacked[i], inputs, scale=0.125, pages_per_block=PPB)
        sliced = np.asarray(sliced)
        np.testing.assert_array_equal(outs[i], sliced)
        want = np.asarray(reference_attention(q, cache * (i + 1), inputs, scale=0.125))
        np.testing.assert_allclose(outs[i], want, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="rank"):
        ragged_paged_attention(q, stacked, inputs, scale=0.125)


@pytest.mark.parametrize(
    ("hq", "hkv", "d", "cache_shape", "layer"),
    [
        (9, 3, 64, (64, 16, 3, 128), False),  # SmolLM2-135M, packed
        (9, 3, 64, (30, 64, 16, 3, 128), True),  # its 30 stacked layers, one read in place
        (8, 2, 128, (30, 64, 16, 4, 128), True),
    ],
)
def test_head_dim_64_lowers_to_mosaic_for_tpu(hq, hkv, d, cache_shape, layer):
    """Lowering only (the Mosaic compiler itself runs on a TPU host)."""
    from jax import export

    t, s, pps = 64, 8, 16
    shapes = [((t, hq, d), jnp.bfloat16), (cache_shape, jnp.bfloat16), ((s,), jnp.int32),
              ((s, pps), jnp.int32), ((s + 1,), jnp.int32), ((1,), jnp.int32)]  # fmt: skip
    args = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in shapes]
    call = functools.partial(_call, scale=d**-0.5, block_q=16, interpret=False)
    if layer:
        args.append(jax.ShapeDtypeStruct((), jnp.int32))
        f = jax.jit(lambda *a: call(*a[:-1], layer=a[-1]))
    else:
        f = jax.jit(call)
    text = export.export(f, platforms=["tpu"])(*args).mlir_module()
    assert "tpu_custom_call" in text and "kvsched_ragged_paged_attention" in text


def test_what_tpu_still_refuses_says_why():
    """Checked before anything runs, so on CPU too (interpret=False)."""
    q, cache, inputs, _, _ = next(plans(hq=9, hkv=3, d=64, steps=1))
    with pytest.raises(ValueError, match="store the cache packed"):
        ragged_paged_attention(q, cache, inputs, scale=0.125, interpret=False)
    q, cache, inputs, _, _ = next(plans(hq=4, hkv=2, d=32, steps=1))
    with pytest.raises(ValueError, match="multiple of 64"):
        ragged_paged_attention(q, pack_cache(cache), inputs, scale=0.125, interpret=False)
    with pytest.raises(ValueError, match="fit neither"):
        ragged_paged_attention(q[..., :24], cache, inputs, scale=0.125)
