"""The engine's Gemma 3 against transformers' own Gemma3ForCausalLM on tiny random
models (float32, eager attention), past the sliding window:

- a model built from a Gemma3TextConfig with every setting away from its usual
  value (query_pre_attn_scalar != head_dim, a final logit soft cap, linear RoPE
  scaling on the global layers, a global layer every third), its weights copied
  into the engine's params: forward_dense's logits equal transformers';
- a tiny GGUF written as llama.cpp writes one, loaded by both (transformers'
  GGUF loader, kvsched's): the same logits and the same tokenizer ids.

The first shows it can fail: with the window ignored, or the attention scale
taken from head_dim, the logits are far off. Skips without torch and transformers (not kvsched
dependencies), as tests/test_hf_peer.py does."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("jax")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from gemma3_helpers import tiny_gguf_config, write_gemma3_gguf  # noqa: E402

from kvsched.engine.loaders.gguf_gemma3 import load_gguf_gemma3  # noqa: E402
from kvsched.engine.model import forward_dense, init_params, make_params  # noqa: E402
from kvsched.engine.model_config import Gemma3Config  # noqa: E402

N_TOKENS = 40  # five windows of 8
F32_TOL = 2e-4

_HF_LAYER = {
    "attn_norm": "input_layernorm",
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
    "post_attn_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm",
    "w_gate": "mlp.gate_proj",
    "w_up": "mlp.up_proj",
    "w_down": "mlp.down_proj",
    "post_mlp_norm": "post_feedforward_layernorm",
}


def _randomize(model) -> None:
    """Unit-scale weights and norms away from 0, so every setting shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, p.shape[1] ** -0.5)
            else:
                sharp = 3.0 if ("q_proj" in name or "k_proj" in name) else 1.0
                p.normal_(0.0, sharp * p.shape[1] ** -0.5)


def _params_from(model, config: Gemma3Config):
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    layers = []
    for i in range(config.n_layers):
        layer = {}
        for ours, theirs in _HF_LAYER.items():
            w = sd[f"model.layers.{i}.{theirs}.weight"]
            layer[ours] = w if w.ndim == 1 else w.T
        layers.append(layer)
    return make_params(config, embed=sd["model.embed_tokens.weight"], layers=layers,
                       final_norm=sd["model.norm.weight"], lm_head=None)  # fmt: skip


@pytest.mark.slow
def test_forward_dense_is_transformers_gemma3_with_every_setting_moved():
    hf_cfg = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        sliding_window_pattern=3, query_pre_attn_scalar=24, final_logit_softcapping=5.0,
        max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 700.0},
        },
    )  # fmt: skip
    model = transformers.Gemma3ForCausalLM(hf_cfg).eval()
    model.set_attn_implementation("eager")
    _randomize(model)
    ours = Gemma3Config(
        vocab_size=300, dim=48, ffn_dim=96, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16,
        sliding_window=8, global_every=3, query_pre_attn_scalar=24.0, final_logit_softcap=5.0,
        rope_theta=50_000.0, rope_type="linear", rope_scaling={"factor": 4.0},
        rope_local_theta=700.0, norm_eps=1e-6,
    )  # fmt: skip
    assert list(ours.layer_kinds) == [
        "full" if t == "full_attention" else "sliding_window:8" for t in hf_cfg.layer_types
    ]
    tokens = torch.randint(0, 300, (N_TOKENS,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens[None]).logits[0].float().numpy()
    params = _params_from(model, ours)
    ids = jnp.asarray(tokens.numpy(), jnp.int32)
    got = np.asarray(forward_dense(params, ours, ids))
    np.testing.assert_allclose(got, want, atol=F32_TOL * np.abs(want).max(), rtol=0)
    # the check can fail: no window, or head_dim's scale, is far off
    for wrong in (replace(ours, sliding_window=1000), replace(ours, query_pre_attn_scalar=None)):
        off = np.asarray(forward_dense(params, wrong, ids))
        assert np.abs(off - want).max() > 50 * F32_TOL * np.abs(want).max()


def test_a_tiny_gguf_reads_the_same_in_transformers_and_kvsched(tmp_path):
    pytest.importorskip("accelerate", reason="transformers loads GGUF models with accelerate")
    c = tiny_gguf_config()
    path = tmp_path / "tiny-gemma3.gguf"
    write_gemma3_gguf(path, c, init_params(c, seed=7))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    assert hf.config.sliding_window == c.sliding_window
    ours = load_gguf_gemma3(path)
    text = "hello world, the end of the world is at 10:30 in the morning"
    ids = ours.encode_prompt(text)
    assert ids == hf_tok(text)["input_ids"]
    assert len(ids) > 2 * c.sliding_window
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float().numpy()
    got = np.asarray(forward_dense(ours.params, ours.config, jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(got, want, atol=F32_TOL * np.abs(want).max(), rtol=0)
