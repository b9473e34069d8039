"""The GGUF loader on small files written with the gguf package's writer (tests/gguf_helpers.py),
laid out as llama.cpp's converter lays out a Llama checkpoint (Q and K rows
permuted for its interleaved RoPE): the weights come back as they went in, the
model computes the same logits, the tokenizer and chat template work, and
anything the model does not implement is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")
gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
import jax.numpy as jnp  # noqa: E402
from gguf_helpers import CHATML, write_gguf  # noqa: E402

from kvsched.engine.loaders.gguf_llama import load_gguf, render_chat_template  # noqa: E402
from kvsched.engine.model import LlamaConfig, forward_dense, init_params  # noqa: E402
from kvsched.engine.model_config import UnsupportedConfig  # noqa: E402

MODEL = LlamaConfig(vocab_size=264, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                    ffn_dim=96, rope_theta=10000.0, name="gguf-test")  # fmt: skip


def tied_params(seed: int = 3):
    p = init_params(MODEL, seed=seed)
    return {**p, "lm_head": p["embed"].T}


@pytest.mark.slow
def test_a_llama_cpp_layout_file_loads_back_to_the_same_model(tmp_path):
    params = tied_params()
    path = tmp_path / "m.gguf"
    write_gguf(path, MODEL, params)
    got = load_gguf(path)
    assert (got.config.n_layers, got.config.n_heads, got.config.n_kv_heads) == (2, 4, 2)
    assert got.config.head_dim == 16 and got.config.vocab_size == 264
    for k in params["layers"]:
        np.testing.assert_array_equal(np.asarray(got.params["layers"][k]),
                                      np.asarray(params["layers"][k]), err_msg=k)  # fmt: skip
    tokens = jnp.arange(1, 30, dtype=jnp.int32)
    np.testing.assert_allclose(
        np.asarray(forward_dense(got.params, got.config, tokens)),
        np.asarray(forward_dense(params, MODEL, tokens)),
        rtol=0,
        atol=1e-5,
    )


def test_the_permutation_matters_so_the_check_above_can_fail(tmp_path):
    """Reading Q and K as stored (without undoing llama.cpp's permutation)
    computes different logits: the round trip above is not vacuous."""
    from kvsched.engine.loaders import gguf_llama

    params = tied_params()
    path = tmp_path / "m.gguf"
    write_gguf(path, MODEL, params)
    original = gguf_llama._unpermute
    try:
        gguf_llama._unpermute = lambda w, n: w
        wrong = load_gguf(path)
    finally:
        gguf_llama._unpermute = original
    tokens = jnp.arange(1, 30, dtype=jnp.int32)
    diff = np.abs(np.asarray(forward_dense(wrong.params, MODEL, tokens))
                  - np.asarray(forward_dense(params, MODEL, tokens))).max()  # fmt: skip
    assert diff > 1e-2


def test_an_untied_output_matrix_is_used_when_present(tmp_path):
    params = init_params(MODEL, seed=4)  # lm_head differs from the embedding
    path = tmp_path / "m.gguf"
    write_gguf(path, MODEL, params, tied=False)
    got = load_gguf(path)
    np.testing.assert_array_equal(np.asarray(got.params["lm_head"]),
                                  np.asarray(params["lm_head"]))  # fmt: skip


def test_tokenizer_and_chat_template_come_from_the_file(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, MODEL, tied_params())
    got = load_gguf(path)
    tok = got.tokenizer
    ids = tok.encode("hello world", add_special_tokens=False).ids
    assert tok.decode(ids) == "hello world"
    assert ids[0] == tok.token_to_id("hello"), "the file's merges are applied"
    text = got.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat = got.encode_chat([{"role": "user", "content": "hi"}])
    assert chat[0] == 0 and 1 in chat, "special tokens are single ids, not split into bytes"
    assert (got.bos_token_id, got.eos_token_id) == (0, 1)
    assert got.special_tokens == {"<|im_start|>": 0, "<|im_end|>": 1}


def test_the_chat_template_renders_in_a_sandbox():
    with pytest.raises(Exception, match="unsafe|access"):
        render_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", [])
    with pytest.raises(ValueError, match="role"):
        render_chat_template(CHATML, [{"content": "no role"}])


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"llama.rope.scaling.factor": 8.0}, "llama.rope.scaling.factor"),
        ({"llama.attention.sliding_window": 4096.0}, "sliding_window"),
        ({"llama.attention.layer_norm_epsilon": 1e-5}, "layer_norm_epsilon"),
    ],
)
def test_metadata_the_model_does_not_implement_is_refused_by_name(tmp_path, extra, match):
    path = tmp_path / "m.gguf"
    write_gguf(path, MODEL, tied_params(), extra=extra)
    with pytest.raises(UnsupportedConfig, match=match):
        load_gguf(path)


def test_other_architectures_missing_and_extra_tensors_are_refused(tmp_path):
    params = tied_params()
    p1 = tmp_path / "mistral.gguf"
    write_gguf(p1, MODEL, params, arch="qwen2")
    with pytest.raises(UnsupportedConfig, match="architecture"):
        load_gguf(p1)
    p2 = tmp_path / "missing.gguf"
    write_gguf(p2, MODEL, params, drop="blk.1.ffn_up.weight")
    with pytest.raises(UnsupportedConfig, match="blk.1.ffn_up.weight"):
        load_gguf(p2)


def test_a_bias_tensor_is_refused(tmp_path):
    import gguf as g

    params = tied_params()
    path = tmp_path / "bias.gguf"
    write_gguf(path, MODEL, params)
    # Rewrite with one more tensor: a bias the model has no place for.
    reader = g.GGUFReader(str(path))
    w = g.GGUFWriter(str(tmp_path / "bias2.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        v = field.contents()
        vt = field.types[0]
        if vt == g.GGUFValueType.ARRAY:
            w.add_array(key, v)
        else:
            w.add_key_value(key, v, vt)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))))
    w.add_tensor("blk.0.attn_q.bias", np.zeros(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedConfig, match="attn_q.bias"):
        load_gguf(tmp_path / "bias2.gguf")


def test_the_chat_template_has_what_hugging_face_templates_expect():
    tpl = ("{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
           "{{ m | tojson }}{% endfor %}{{ eos_token }}")  # fmt: skip
    msgs = [{"role": "user", "content": "café"}, {"role": "user", "content": "two"}]
    out = render_chat_template(tpl, msgs, bos_token="<s>", eos_token="</s>")
    assert out == '<s>{"role": "user", "content": "café"}</s>'
