"""Gemma 3 in the engine, on a tiny random model (no download): the layer
pattern and its KV-cache groups, the RoPE bases, the attention scale, tied and
soft-capped logits, and the paged forward pass (KV-cache groups, sliding
windows, chunked prefill smaller than the window, out-of-window pages returned
and poisoned) against the dense oracle, with checks that the comparisons can
fail (a window that is not applied, a norm read as w instead of 1 + w)."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from gemma3_helpers import HandPlan, tiny_gemma3  # noqa: E402

from kvsched.engine.model import (  # noqa: E402
    GEMMA3_LAYER_WEIGHTS,
    forward_dense,
    forward_paged,
    gemma_rms_norm,
    greedy_dense,
    init_params,
    layer_weights,
    rms_norm,
)
from kvsched.engine.model_config import Gemma3Config, LlamaConfig, rope_inv_freq  # noqa: E402
from kvsched.shapes import group_layers  # noqa: E402

PROMPTS = {0: list(range(3, 40)), 1: [7, 300, 12, 5, 99, 201, 44, 8, 16, 250, 3]}


def _dense_rows(params, config, tokens):
    return np.asarray(forward_dense(params, config, jnp.asarray(tokens, jnp.int32)))


def test_every_sixth_layer_is_global_and_the_groups_follow_the_contract():
    c = Gemma3Config(n_layers=18, sliding_window=512)
    assert [i for i, k in enumerate(c.layer_kinds) if k == "full"] == [5, 11, 17]
    assert set(c.layer_kinds) == {"full", "sliding_window:512"}
    assert c.layer_windows[:6] == (512,) * 5 + (0,)
    assert c.windows == (0, 512)
    layout = group_layers(c.layer_kinds)
    assert layout.layers_per_group == 3
    assert layout.groups == ("full",) + ("sliding_window:512",) * 5
    assert layout.layers_of(0) == (5, 11, 17)
    # Llama: every layer full, one window
    assert LlamaConfig().layer_kinds == ("full", "full") and LlamaConfig().windows == (0,)


def test_the_layer_pattern_is_transformers_layer_types():
    transformers = pytest.importorskip("transformers")
    for n in (6, 18, 26, 34, 62):
        hf = transformers.Gemma3TextConfig(num_hidden_layers=n, sliding_window=512)
        ours = Gemma3Config(n_layers=n, sliding_window=512)
        want = ["full" if t == "full_attention" else "sliding_window:512" for t in hf.layer_types]
        assert list(ours.layer_kinds) == want, n


def test_local_and_global_layers_rotate_at_their_own_bases():
    c = Gemma3Config(n_layers=6, head_dim=16, rope_theta=1e6, rope_local_theta=1e4)
    inv = c.layer_inv_freqs()
    d = np.arange(0, 16, 2) / 16
    np.testing.assert_allclose(inv[5], 1.0 / 1e6**d, rtol=1e-6)  # global
    for i in range(5):
        np.testing.assert_allclose(inv[i], 1.0 / 1e4**d, rtol=1e-6)  # local
    # linear scaling (Gemma 3 4B and up) divides the global layers' only
    scaled = replace(c, rope_type="linear", rope_scaling={"factor": 8.0}).layer_inv_freqs()
    np.testing.assert_allclose(scaled[5], inv[5] / 8, rtol=1e-6)
    np.testing.assert_array_equal(scaled[:5], inv[:5])
    # a Llama model: one set for every layer
    llama = LlamaConfig(n_layers=3)
    np.testing.assert_array_equal(llama.layer_inv_freqs(), np.tile(rope_inv_freq(llama), (3, 1)))


def test_the_attention_scale_is_query_pre_attn_scalar():
    assert Gemma3Config(head_dim=16).scale == 16**-0.5
    assert Gemma3Config(head_dim=16, query_pre_attn_scalar=168.0).scale == 168**-0.5
    with pytest.raises(ValueError, match="sliding_window"):
        Gemma3Config(sliding_window=0)
    with pytest.raises(ValueError, match="final_logit_softcap"):
        Gemma3Config(final_logit_softcap=-1.0)


def test_gemma_norm_multiplies_by_one_plus_the_weight():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 8)), jnp.float32)
    w = jnp.asarray(np.linspace(-0.5, 0.5, 8), jnp.float32)
    np.testing.assert_allclose(gemma_rms_norm(x, w, 1e-6), rms_norm(x, 1.0 + w, 1e-6), rtol=1e-6)


@pytest.mark.slow
def test_params_carry_gemmas_weights_and_tie_the_output_to_the_embedding():
    c = tiny_gemma3()
    p = init_params(c, seed=0)
    assert layer_weights(c) == GEMMA3_LAYER_WEIGHTS
    assert set(p["layers"]) == set(GEMMA3_LAYER_WEIGHTS)
    assert p["layers"]["q_norm"].shape == (c.n_layers, c.head_dim)
    assert p["lm_head"] is None
    tokens = jnp.asarray([5, 9, 200, 31], jnp.int32)
    logits = _dense_rows(p, c, tokens)
    # tied: the same logits as with lm_head = embed^T spelled out
    untied = {**p, "lm_head": p["embed"].T}
    np.testing.assert_allclose(logits, _dense_rows(untied, c, tokens), rtol=1e-5, atol=1e-5)
    # soft cap: c * tanh(logits / c)
    capped = _dense_rows(p, replace(c, final_logit_softcap=2.0), tokens)
    np.testing.assert_allclose(capped, 2.0 * np.tanh(logits / 2.0), rtol=1e-5, atol=1e-6)
    assert np.abs(capped).max() < 2.0


def test_the_window_changes_the_logits_past_it_and_only_there():
    c = tiny_gemma3()
    p = init_params(c, seed=1)
    tokens = PROMPTS[0]
    windowed = _dense_rows(p, c, tokens)
    wide = _dense_rows(p, replace(c, sliding_window=1000), tokens)
    w = c.sliding_window
    np.testing.assert_allclose(windowed[:w], wide[:w], rtol=1e-5, atol=1e-5)
    assert np.abs(windowed[w:] - wide[w:]).max() > 1e-2
    # a norm read as w (not 1 + w) would change everything: the check can fail
    plain = {**p, "layers": {**p["layers"], "post_attn_norm": p["layers"]["post_attn_norm"] + 1}}
    assert np.abs(_dense_rows(plain, c, tokens) - windowed).max() > 1e-2


@pytest.mark.parametrize("uniform", [False, True], ids=["groups", "uniform"])
def test_paged_logits_equal_the_dense_oracle_across_the_window(uniform):
    c = tiny_gemma3()
    p = init_params(c, seed=2)
    tokens = PROMPTS[0]  # 37 tokens: over four windows of 8
    want = _dense_rows(p, c, tokens)
    plan = HandPlan(p, c, uniform=uniform, block_size=4, tokens_per_step=16)
    plan.add(0, tokens)
    got, ends = [], []
    for n in (5, 3, 7, 1, 6, 5, 1, 1, 8):  # chunks of at most the window, then decodes
        got.append(plan.step([(0, n)])[0])
        ends.append(plan.seqs[0].cached - 1)
    np.testing.assert_allclose(np.asarray(got), want[ends], rtol=2e-4, atol=2e-4)
    if not uniform:
        layout = plan.layout
        assert layout.num_groups == 3 and layout.layers_per_group == 2
        # the window groups gave pages back: page 0 stands in their tables
        assert all(0 in plan.seqs[0].tables[g][:4] for g in (1, 2))


@pytest.mark.slow
def test_paged_greedy_equals_dense_greedy_with_several_sequences_and_bf16():
    for dtype in ("float32", "bfloat16"):
        c = tiny_gemma3(dtype=dtype)
        p = init_params(c, seed=3)
        want = {sid: greedy_dense(p, c, prompt, 6) for sid, prompt in PROMPTS.items()}
        for uniform in (False, True):
            plan = HandPlan(p, c, uniform=uniform, tokens_per_step=16)
            assert plan.generate(PROMPTS, 6, chunk=5) == want, (dtype, uniform)


def test_a_kv_layout_of_another_model_is_refused():
    c = tiny_gemma3()
    plan = HandPlan(init_params(c, seed=0), c, tokens_per_step=16)
    other = group_layers(Gemma3Config(n_layers=18).layer_kinds)
    plan._step = functools.partial(forward_paged, config=c, kv_layout=other)
    plan.add(0, [1, 2, 3])
    with pytest.raises(ValueError, match="kv_layout has 18 layers, the model 6"):
        plan.step([(0, 3)])
