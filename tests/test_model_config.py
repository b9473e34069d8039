"""LlamaConfig.from_hf reads both Hugging Face config formats (transformers 4:
rope_theta + rope_scaling; transformers 5: rope_parameters) and refuses, naming
the key, every setting that changes the logits and that the model does not
implement. rope_inv_freq's llama3 scaling matches transformers' own."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")

from kvsched.engine.model_config import (  # noqa: E402
    LlamaConfig,
    UnsupportedConfig,
    rope_inv_freq,
)

# A Llama-3.1-8B config.json as transformers 4 wrote it (shapes shrunk).
LLAMA31_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
V4 = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": LLAMA31_SCALING,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 1024,
}
# The same model as transformers 5 writes it.
V5 = {
    **{k: v for k, v in V4.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")},
    "dtype": "bfloat16",
    "head_dim": 128,
    "pad_token_id": None,
    "rope_parameters": {**LLAMA31_SCALING, "rope_theta": 500000.0},
    "transformers_version": "5.0.0",
}
PLAIN = {  # no rope scaling, transformers 5
    **{k: v for k, v in V5.items() if k != "rope_parameters"},
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
}


def test_a_transformers_5_config_is_read_with_its_theta():
    c = LlamaConfig.from_hf(PLAIN)
    assert c.rope_theta == 500000.0, "theta lives in rope_parameters now"
    assert (c.rope_type, c.rope_scaling) == ("default", ())
    assert (c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == (256, 2, 1, 128, 512)
    assert (c.vocab_size, c.n_layers, c.norm_eps) == (1024, 2, 1e-5)


def test_llama3_scaling_is_read_from_both_formats_alike():
    v4, v5 = LlamaConfig.from_hf(V4), LlamaConfig.from_hf(V5)
    assert v4 == v5
    assert v4.rope_type == "llama3" and v4.rope_theta == 500000.0
    assert dict(v4.rope_scaling) == {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192.0,
    }
    hash(v4)  # a static jit argument
    plain = rope_inv_freq(LlamaConfig.from_hf(PLAIN))
    assert not np.allclose(rope_inv_freq(v4), plain), "the scaling changes the frequencies"


def test_the_legacy_type_key_and_linear_scaling_are_read():
    c = LlamaConfig.from_hf({**PLAIN, "rope_parameters": None, "rope_theta": 1e4,
                             "rope_scaling": {"type": "linear", "factor": 4.0}})  # fmt: skip
    assert (c.rope_type, dict(c.rope_scaling)) == ("linear", {"factor": 4.0})
    base = rope_inv_freq(LlamaConfig(**{**c.__dict__, "rope_type": "default", "rope_scaling": ()}))
    np.testing.assert_allclose(rope_inv_freq(c), base / 4.0, rtol=1e-6)


def test_llama3_original_context_falls_back_to_max_position_embeddings():
    partial = {k: v for k, v in LLAMA31_SCALING.items() if k != "original_max_position_embeddings"}
    c = LlamaConfig.from_hf({**V4, "rope_scaling": partial})
    assert dict(c.rope_scaling)["original_max_position_embeddings"] == 131072.0


def test_conflicting_values_are_refused():
    with pytest.raises(UnsupportedConfig, match="rope_theta"):
        LlamaConfig.from_hf({**V5, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedConfig, match="dtype"):
        LlamaConfig.from_hf({**V5, "torch_dtype": "float32"})


def test_incomplete_llama3_scaling_is_refused():
    with pytest.raises(UnsupportedConfig, match="rope_scaling.*low_freq_factor"):
        LlamaConfig.from_hf({**V4, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope", "proportional", "su"])
def test_an_unimplemented_rope_type_is_refused(rope_type):
    scaling = {"rope_type": rope_type, "factor": 4.0, "original_max_position_embeddings": 8192}
    with pytest.raises(UnsupportedConfig, match=f"rope_scaling.*{rope_type}"):
        LlamaConfig.from_hf({**V4, "rope_scaling": scaling})
    with pytest.raises(UnsupportedConfig, match=f"rope_parameters.*{rope_type}"):
        LlamaConfig.from_hf({**V5, "rope_parameters": {**scaling, "rope_theta": 1e4}})


def test_partial_rotary_is_refused():
    with pytest.raises(UnsupportedConfig, match="partial_rotary_factor"):
        LlamaConfig.from_hf({**PLAIN, "partial_rotary_factor": 0.5})
    with pytest.raises(UnsupportedConfig, match="partial_rotary_factor"):
        rope = {**PLAIN["rope_parameters"], "partial_rotary_factor": 0.5}
        LlamaConfig.from_hf({**PLAIN, "rope_parameters": rope})


def test_sliding_window_is_refused():
    with pytest.raises(UnsupportedConfig, match="sliding_window"):
        LlamaConfig.from_hf({**PLAIN, "sliding_window": 4096})
    assert LlamaConfig.from_hf({**PLAIN, "sliding_window": None}) == LlamaConfig.from_hf(PLAIN)


def test_a_mistral_config_is_refused():
    mistral = {**PLAIN, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
               "sliding_window": 4096}  # fmt: skip
    with pytest.raises(UnsupportedConfig, match="model_type='mistral'"):
        LlamaConfig.from_hf(mistral)
    no_type = {k: v for k, v in mistral.items() if k != "model_type"}
    with pytest.raises(UnsupportedConfig, match="sliding_window"):
        LlamaConfig.from_hf(no_type)


@pytest.mark.parametrize("key", ["hidden_act", "hidden_activation"])
def test_an_activation_other_than_silu_is_refused(key):
    with pytest.raises(UnsupportedConfig, match=f"{key}='gelu'"):
        LlamaConfig.from_hf({**PLAIN, key: "gelu"})
    assert LlamaConfig.from_hf({**PLAIN, key: "silu"}) == LlamaConfig.from_hf(PLAIN)


@pytest.mark.parametrize("key", ["attention_bias", "mlp_bias"])
def test_biases_are_refused(key):
    with pytest.raises(UnsupportedConfig, match=key):
        LlamaConfig.from_hf({**PLAIN, key: True})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("quantization_config", {"quant_method": "awq", "bits": 4}),
        ("layer_types", ["full_attention", "sliding_attention"]),
        ("logits_scaling", 8.0),
        ("num_local_experts", 8),
        ("final_logit_softcapping", 30.0),
    ],
)
def test_settings_of_neighbouring_families_are_refused(key, value):
    with pytest.raises(UnsupportedConfig, match=key):
        LlamaConfig.from_hf({**PLAIN, key: value})


def test_harmless_metadata_is_accepted():
    noisy = {**PLAIN, "attention_dropout": 0.1, "pretraining_tp": 2, "use_cache": False,
             "tie_word_embeddings": True, "initializer_range": 0.5, "num_local_experts": 0,
             "layer_types": ["full_attention"] * 2, "_name_or_path": "x", "sliding_window": None,
             "quantization_config": None, "partial_rotary_factor": 1.0}  # fmt: skip
    assert LlamaConfig.from_hf(noisy) == LlamaConfig.from_hf(PLAIN)


def test_the_checkpoint_dtype_is_honoured_unless_overridden():
    assert LlamaConfig.from_hf(V4).dtype == "bfloat16"  # torch_dtype
    assert LlamaConfig.from_hf(V5).dtype == "bfloat16"  # dtype
    assert LlamaConfig.from_hf({**V5, "dtype": "float32"}).dtype == "float32"
    assert LlamaConfig.from_hf({**V5, "dtype": "float16"}).dtype == "bfloat16"
    bare = {k: v for k, v in V5.items() if k != "dtype"}
    assert LlamaConfig.from_hf(bare).dtype == "float32"
    assert LlamaConfig.from_hf(V5, dtype="float32").dtype == "float32"
    with pytest.raises(UnsupportedConfig, match="dtype='float8_e4m3fn'"):
        LlamaConfig.from_hf({**V5, "dtype": "float8_e4m3fn"})
    with pytest.raises(ValueError, match="dtype"):
        LlamaConfig.from_hf(V5, dtype="float16")


def test_a_config_built_by_hand_is_checked():
    with pytest.raises(UnsupportedConfig, match="yarn"):
        LlamaConfig(rope_type="yarn", rope_scaling={"factor": 4.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        LlamaConfig(rope_type="llama3", rope_scaling={"factor": 8.0})
    c = LlamaConfig(rope_type="linear", rope_scaling={"factor": 2.0})
    assert c.rope_scaling == (("factor", 2.0),) and c == LlamaConfig(**c.__dict__)


def _transformers_llama3_inv_freq(theta, head_dim, scaling):
    torch = pytest.importorskip("torch", reason="transformers' llama3 RoPE needs torch")
    transformers = pytest.importorskip("transformers", reason="the reference is transformers'")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters={**scaling, "rope_theta": theta},
    )
    inv, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    assert attention_factor == 1.0, "llama3 RoPE does not scale the attention logits"
    return inv.numpy()


def test_llama3_frequencies_match_transformers_for_llama_3_1_8b():
    ours = rope_inv_freq(LlamaConfig.from_hf(V5))
    theirs = _transformers_llama3_inv_freq(500000.0, 128, LLAMA31_SCALING)
    assert ours.shape == theirs.shape == (64,)
    # all three bands (kept, blended, divided by 8) occur for these parameters
    base = rope_inv_freq(LlamaConfig.from_hf(PLAIN))
    ratio = base / ours
    assert (np.isclose(ratio, 1.0)).any() and (np.isclose(ratio, 8.0)).any()
    assert ((ratio > 1.01) & (ratio < 7.99)).any()
    np.testing.assert_allclose(ours, theirs, rtol=2e-6, atol=0)
