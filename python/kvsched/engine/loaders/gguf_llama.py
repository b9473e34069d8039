"""A Llama-architecture GGUF file: config, weights, tokenizer and chat template
(`load_gguf` hands a Gemma 3 file to kvsched.engine.loaders.gguf_gemma3).

Weights are read and dequantized by the `gguf` package (its reader and its
numpy dequantization of Q4_0/Q4_1/Q8_0/... blocks), into f32 or bf16 params.
Layout: GGUF stores a [out, in] projection as ggml shape [in, out], which the
reader hands back as a row-major [out, in] array, so projections are transposed
to the engine's [in, out]. llama.cpp's converter also permutes the rows of Q and
K within each head, from the rotate-half RoPE layout of Hugging Face checkpoints
to the interleaved (adjacent pairs) one llama.cpp rotates; `_unpermute` undoes
that so the engine's rotate-half RoPE computes what the original model did.

The tokenizer is a `tokenizers.Tokenizer` (byte-level BPE) built from the
file's vocabulary and merges; the chat template is the file's Jinja template
rendered with jinja2's sandbox. Strict: an architecture, a tensor or a
tokenizer kind this engine does not implement is an error naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np

from kvsched.engine.loaders import model_file
from kvsched.engine.loaders.gguf_file import (
    GGUFModel,
    TensorReader,
    _field,
    encode_chat,
    encode_text,
    gguf_model,
    open_gguf,
    read_metadata,
    render_chat_template,
)
from kvsched.engine.model import Params, make_params
from kvsched.engine.model_config import LlamaConfig, UnsupportedConfig

_LAYER_TENSORS = {
    "attn_norm": "attn_norm",
    "wq": "attn_q",
    "wk": "attn_k",
    "wv": "attn_v",
    "wo": "attn_output",
    "mlp_norm": "ffn_norm",
    "w_gate": "ffn_gate",
    "w_up": "ffn_up",
    "w_down": "ffn_down",
}

# The llama.* metadata this engine implements; any other llama.* key (RoPE
# scaling, sliding windows, experts, LayerNorm, clamping, ...) changes what the
# model computes and is refused by name rather than ignored.
_KNOWN_LLAMA_KEYS = {
    "llama.block_count",
    "llama.context_length",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.attention.key_length",  # must equal head_dim (checked)
    "llama.attention.value_length",
    "llama.rope.freq_base",
    "llama.rope.dimension_count",  # must equal head_dim (checked)
    "llama.vocab_size",
}


def config_from_gguf(
    reader: Any, *, dtype: str = "float32", name: str | None = None
) -> LlamaConfig:
    """The model's shapes from the file's llama.* metadata (strict)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedConfig(f"general.architecture={arch!r}: only 'llama' is implemented")
    for key in reader.fields:
        if key.startswith("llama.") and key not in _KNOWN_LLAMA_KEYS:
            raise UnsupportedConfig(f"{key}={_field(reader, key)!r} is not implemented")

    def need(key: str) -> Any:
        v = _field(reader, key)
        if v is None:
            raise UnsupportedConfig(f"the GGUF file has no {key}")
        return v

    dim = int(need("llama.embedding_length"))
    heads = int(need("llama.attention.head_count"))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv") or heads)
    head_dim = dim // heads
    for key in ("llama.rope.dimension_count", "llama.attention.key_length",
                "llama.attention.value_length"):  # fmt: skip
        v = _field(reader, key)
        if v is not None and int(v) != head_dim:
            raise UnsupportedConfig(
                f"{key}={v}: only head_dim = embedding_length / head_count = {head_dim} "
                "is implemented"
            )
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, "llama.vocab_size") or (len(tokens.data) if tokens else None)
    if vocab is None:
        raise UnsupportedConfig("the GGUF file has neither llama.vocab_size nor a vocabulary")
    return LlamaConfig(
        vocab_size=int(vocab),
        dim=dim,
        n_layers=int(need("llama.block_count")),
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_dim=int(need("llama.feed_forward_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base") or 10000.0),
        norm_eps=float(need("llama.attention.layer_norm_rms_epsilon")),
        dtype=dtype,
        name=name or str(_field(reader, "general.name") or "gguf-llama"),
    )


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows [out, in] of Q or K back from llama.cpp's interleaved RoPE order to
    the rotate-half order: within each head, llama.cpp's row 2i + j is the
    original row j * (head_dim / 2) + i."""
    out, inp = w.shape
    rows: np.ndarray = w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2)
    return rows.reshape(out, inp)


def load_gguf_params(reader: Any, config: LlamaConfig) -> Params:
    """Dequantized weights in the engine's layout; every tensor in the file must
    be one the model uses, with the shape the config implies."""
    c = config
    q_out, kv_out = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes = {  # [out, in] as stored
        "attn_norm": (c.dim,),
        "wq": (q_out, c.dim),
        "wk": (kv_out, c.dim),
        "wv": (kv_out, c.dim),
        "wo": (c.dim, q_out),
        "mlp_norm": (c.dim,),
        "w_gate": (c.ffn_dim, c.dim),
        "w_up": (c.ffn_dim, c.dim),
        "w_down": (c.dim, c.ffn_dim),
    }
    get = TensorReader(reader)

    layers = []
    for i in range(c.n_layers):
        layer = {}
        for key, short in _LAYER_TENSORS.items():
            a = get(f"blk.{i}.{short}.weight", shapes[key])
            if key == "wq":
                a = _unpermute(a, c.n_heads)
            elif key == "wk":
                a = _unpermute(a, c.n_kv_heads)
            layer[key] = a if a.ndim == 1 else a.T  # [out, in] -> [in, out]
        layers.append(layer)
    embed = get("token_embd.weight", (c.vocab_size, c.dim))
    head = get("output.weight", (c.vocab_size, c.dim)) if "output.weight" in get else embed
    final_norm = get("output_norm.weight", (c.dim,))
    if "rope_freqs.weight" in get:
        raise UnsupportedConfig("rope_freqs.weight (scaled RoPE frequencies) is not implemented")
    get.check_all_used()
    return make_params(c, embed=embed, layers=layers, final_norm=final_norm, lm_head=head.T)


# -- tokenizer ------------------------------------------------------------------------

_CONTROL = 3  # llama.cpp's token type for special (control) tokens
_USER_DEFINED = 4


def load_gguf_tokenizer(reader: Any) -> tuple[Any, dict[str, int]]:
    """A byte-level BPE `tokenizers.Tokenizer` from the file's gpt2-style vocabulary,
    and its special tokens by name. The pre-tokenizer follows the file's
    `tokenizer.ggml.pre`: "smollm" splits every digit on its own before GPT-2's
    byte-level split; "gpt2" (and no value) is the byte-level split alone."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedConfig(f"tokenizer.ggml.model={kind!r}: only 'gpt2' (byte-level BPE)")
    pre = _field(reader, "tokenizer.ggml.pre") or "gpt2"
    tok_field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(tok_field.parts[i]).decode("utf-8") for i in tok_field.data]
    merge_field = reader.fields["tokenizer.ggml.merges"]
    # Each merge is "left right": split once, a pair (a malformed one reaches
    # tokenizers' BPE as it is, which refuses it).
    merges = cast("list[tuple[str, str]]",
                  [tuple(bytes(merge_field.parts[i]).decode("utf-8").split(" ", 1))
                   for i in merge_field.data])  # fmt: skip
    type_field = reader.fields.get("tokenizer.ggml.token_type")
    types = [int(type_field.parts[i][0]) for i in type_field.data] if type_field else []
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre == "gpt2":
        tok.pre_tokenizer = byte_level
    else:
        raise UnsupportedConfig(f"tokenizer.ggml.pre={pre!r} is not implemented (smollm, gpt2)")
    tok.decoder = decoders.ByteLevel()
    special = {tokens[i]: i for i, ty in enumerate(types) if ty in (_CONTROL, _USER_DEFINED)}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok, special


def load_gguf(path: str | Path, *, dtype: str = "float32", name: str | None = None) -> GGUFModel:
    """Config, params, tokenizer and chat template from one GGUF file: a Llama
    one, or a Gemma 3 one (kvsched.engine.loaders.gguf_gemma3)."""
    reader = open_gguf(model_file(path, "GGUF", magic=b"GGUF"))
    if _field(reader, "general.architecture") == "gemma3":
        from kvsched.engine.loaders.gguf_gemma3 import load_gguf_gemma3

        return load_gguf_gemma3(path, dtype=dtype, name=name, reader=reader)
    config = config_from_gguf(reader, dtype=dtype, name=name)
    params = load_gguf_params(reader, config)
    tokenizer, special = load_gguf_tokenizer(reader)
    return gguf_model(reader, config, params, tokenizer, special)


__all__ = [
    "GGUFModel",
    "config_from_gguf",
    "encode_chat",
    "encode_text",
    "load_gguf",
    "load_gguf_params",
    "load_gguf_tokenizer",
    "read_metadata",
    "render_chat_template",
]
