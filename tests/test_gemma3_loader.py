"""The Gemma 3 GGUF loader on tiny files written here as llama.cpp's converter
writes them (norms stored as 1 + w, no output tensor, a SentencePiece vocabulary):
what it reads back, what it refuses (by name), the quantized path, and the
tokenizer (merges derived from the vocabulary, byte fallback, user-defined and
control tokens, BOS). Where transformers is installed, its GGUF tokenizer gives
the same ids on the same file; where torch is too, its model gives the same
logits (tests/test_gemma3_hf.py has more of that)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("gguf")

import jax.numpy as jnp  # noqa: E402
from gemma3_helpers import spm_vocab, tiny_gguf_config, write_gemma3_gguf  # noqa: E402

from kvsched.engine.loaders.gguf_gemma3 import (  # noqa: E402
    config_from_gguf_gemma3,
    load_gguf_gemma3,
    spm_merges,
)
from kvsched.engine.loaders.gguf_llama import load_gguf  # noqa: E402
from kvsched.engine.model import InvalidWeights, forward_dense, init_params  # noqa: E402
from kvsched.engine.model_config import UnsupportedConfig  # noqa: E402

STRINGS = [
    "hello world",
    "the end of the world",
    "  two spaces,   three and    four",
    "digits 0123456789 and 3.14",
    "line\nbreaks\n\nand\n\n\nmore",
    "naïve café — 你好 🙂 Привет",
    "<start_of_turn>user\nhi<end_of_turn>",
    "<b>bold</b> text",
    "",
    " ",
]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    c = tiny_gguf_config()
    p = init_params(c, seed=4)
    path = tmp_path_factory.mktemp("g3") / "tiny-gemma3.gguf"
    write_gemma3_gguf(path, c, p)
    return path, c, p


def test_a_gemma3_file_loads_back_as_it_was_written(written):
    path, c, p = written
    m = load_gguf(path)  # the Llama entry point hands a gemma3 file over
    assert m.config == c
    assert m.config.layer_kinds == ("sliding_window:8",) * 5 + ("full",)
    assert m.params["lm_head"] is None
    for k, v in p["layers"].items():  # norms come back as w, from the file's 1 + w
        np.testing.assert_allclose(np.asarray(m.params["layers"][k]), np.asarray(v), atol=2e-7)
    np.testing.assert_allclose(np.asarray(m.params["final_norm"]), np.asarray(p["final_norm"]),
                               atol=2e-7)  # fmt: skip
    tokens = jnp.asarray([2, 300, 301, 17, 9, 40, 41, 42, 43, 44, 45, 46], jnp.int32)
    got, want = forward_dense(m.params, c, tokens), forward_dense(p, c, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert (m.bos_token_id, m.eos_token_id, m.add_bos, m.chat_template) == (2, 1, True, None)
    assert m.encode_prompt("hello") == [
        2,
        *m.tokenizer.encode("hello", add_special_tokens=False).ids,
    ]


def test_quantized_projections_dequantize_through_gguf(tmp_path):
    import gguf

    c = tiny_gguf_config()
    p = init_params(c, seed=5)
    path = tmp_path / "q8.gguf"
    write_gemma3_gguf(path, c, p, quantize=gguf.GGMLQuantizationType.Q8_0)
    m = load_gguf_gemma3(path)
    for k in ("wq", "w_down"):
        got, want = np.asarray(m.params["layers"][k]), np.asarray(p["layers"][k])
        assert 0 < np.abs(got - want).max() < 0.02 * np.abs(want).max()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(extra={"gemma3.attn_logit_softcapping": 50.0}), "gemma3.attn_logit_softcapping"),
        (dict(extra={"gemma3.rope.scaling.type": "yarn"}), "rope.scaling.type='yarn'"),
        (dict(drop="blk.3.attn_k_norm.weight"), "blk.3.attn_k_norm.weight"),
        (dict(add={"blk.0.attn_q.bias": np.zeros(512)}), "blk.0.attn_q.bias"),
        (dict(tokenizer_model="gpt2"), "tokenizer.ggml.model='gpt2'"),
    ],
    ids=["attn-softcap", "yarn", "missing-tensor", "bias", "gpt2-vocab"],
)
def test_what_the_engine_does_not_compute_is_refused_by_name(tmp_path, change, match):
    c = tiny_gguf_config()
    path = tmp_path / "refused.gguf"
    write_gemma3_gguf(path, c, init_params(c, seed=0), **change)
    with pytest.raises(UnsupportedConfig, match=match.replace("(", r"\(").replace(".", r"\.")):
        load_gguf(path)


def test_a_non_finite_weight_is_refused_naming_the_tensor(tmp_path):
    c = tiny_gguf_config()
    p = init_params(c, seed=0)
    bad = np.asarray(p["layers"]["w_up"][2]).copy().T
    bad[0, 0] = np.nan
    path = tmp_path / "nan.gguf"
    write_gemma3_gguf(path, c, p, drop="blk.2.ffn_up.weight", add={"blk.2.ffn_up.weight": bad})
    with pytest.raises(InvalidWeights, match="blk.2.ffn_up.weight"):
        load_gguf(path)


def test_settings_gemma_files_carry_are_read(tmp_path):
    c = tiny_gguf_config()
    path = tmp_path / "capped.gguf"
    extra = {"gemma3.final_logit_softcapping": 30.0, "gemma3.rope.scaling.type": "linear",
             "gemma3.rope.scaling.factor": 8.0}  # fmt: skip
    write_gemma3_gguf(path, c, init_params(c, seed=0), extra=extra)
    got = load_gguf(path).config
    assert got == replace(c, final_logit_softcap=30.0, rope_type="linear",
                          rope_scaling={"factor": 8.0})  # fmt: skip


def _reader(**fields):
    return SimpleNamespace(
        fields={k: SimpleNamespace(contents=lambda v=v: v, data=[]) for k, v in fields.items()}
    )


def test_the_27b_model_takes_its_attention_scale_from_the_hidden_size_as_llama_cpp_does():
    base = {"general.architecture": "gemma3", "gemma3.embedding_length": 5376,
            "gemma3.attention.head_count": 32, "gemma3.attention.head_count_kv": 16,
            "gemma3.attention.key_length": 128, "gemma3.feed_forward_length": 21504,
            "gemma3.rope.freq_base": 1e6, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
            "gemma3.attention.sliding_window": 1024, "gemma3.vocab_size": 262144}  # fmt: skip
    big = config_from_gguf_gemma3(_reader(**base, **{"gemma3.block_count": 62}))
    assert big.query_pre_attn_scalar == 168.0  # 5376 / 32
    assert (
        big.layer_kinds.count("full") == 10 and big.layer_kinds.count("sliding_window:1024") == 52
    )
    other = config_from_gguf_gemma3(_reader(**base, **{"gemma3.block_count": 48}))
    assert other.query_pre_attn_scalar == 128.0  # key_length
    with pytest.raises(UnsupportedConfig, match="only 'llama' is implemented|reads 'gemma3'"):
        config_from_gguf_gemma3(_reader(**{**base, "general.architecture": "gemma2"}))


def test_merges_come_from_the_vocabulary_in_file_order():
    sp = "\u2581"
    tokens = ["a", "b", "c", sp, "ab", "bc", sp + "a", "abc", sp + "ab"]
    merges = spm_merges(tokens)
    # "abc" (rank 7) cuts as ab|c and a|bc: the longer left part first
    assert merges == [("a", "b"), ("b", "c"), (sp, "a"), ("ab", "c"), ("a", "bc"),
                      (sp + "a", "b"), (sp, "ab")]  # fmt: skip


def test_the_tokenizer_reads_sentencepiece_text(written):
    path, _, _ = written
    m = load_gguf_gemma3(path)
    tok = m.tokenizer
    vocab = {t: i for i, t in enumerate(spm_vocab()[0])}
    sp = "\u2581"

    def ids(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False).ids

    assert ids("hello world") == [vocab["hello"], vocab[sp + "world"]]
    assert ids("  ") == [vocab["  "]] and ids("   ") == [vocab["   "]]  # space runs, whole
    assert ids("\n\n") == [vocab["\n\n"]]  # user-defined: matched whole
    assert ids("é") == [vocab["<0xC3>"], vocab["<0xA9>"]]  # byte fallback
    assert ids("<end_of_turn>") == [vocab["<end_of_turn>"]]  # control
    assert tok.encode("hi").ids[0] == 2  # BOS when special tokens are asked for
    for s in STRINGS:
        assert tok.decode(ids(s), skip_special_tokens=False) == s
    # user-defined tokens are text, control ones are not
    assert tok.decode([vocab["\n"], vocab["<end_of_turn>"]]) == "\n"
    assert "<end_of_turn>" in m.special_tokens and "\n" not in m.special_tokens


def test_the_tokenizer_gives_transformers_ids(written):
    transformers = pytest.importorskip("transformers")
    path, _, _ = written
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    m = load_gguf_gemma3(path)
    for s in STRINGS:
        assert m.encode_prompt(s) == hf(s)["input_ids"], s
        assert m.tokenizer.encode(s).ids == hf(s)["input_ids"], s
