"""A Gemma 3 GGUF file (llama.cpp's `gemma3` architecture): config, weights and
its SentencePiece-style tokenizer, into the engine's `Gemma3Config` and params.

Weights are read and dequantized by the `gguf` package (F32, F16, BF16 and its
quantized types: Q4_K, Q5_0, Q6_K, Q8_0 in gemma-3-270m-q4_k_m.gguf). llama.cpp's
converter stores every RMSNorm weight as 1 + w (ggml's norm multiplies by the
weight alone); the loader subtracts the 1 again, so the params hold Gemma's own
w and the model multiplies by (1 + w). Q and K are not permuted for this
architecture (llama.cpp rotates Gemma in the rotate-half order), and the output
projection is the embedding (tied) unless the file has an `output.weight`.

What the file does not say, llama.cpp fixes for gemma3 and so does this loader:
layer i is global iff (i + 1) % 6 == 0, local layers rotate with base 10,000
(the file's `rope.freq_base` is the global layers'), and the attention scale is
head_dim ** -0.5 (query_pre_attn_scalar = key_length), except for the 62-layer
27B model, whose scale llama.cpp takes from embedding_length / head_count.

The tokenizer (`tokenizer.ggml.model = "llama"`: a SentencePiece BPE vocabulary
with scores, token types and byte fallback) becomes a `tokenizers` BPE: spaces
normalized to U+2581, merges derived from the vocabulary (every split of a
token into two tokens, ranked by the token's position in the file, which is
the order SentencePiece learned them in; Gemma's scores put its user-defined
tokens elsewhere), unknown characters as their UTF-8 bytes (<0xNN>). Control
tokens are special, user-defined ones (newline runs, HTML tags, space runs)
are matched whole but are text. A base model: no chat template; the file says
whether a prompt starts with BOS (`GGUFModel.encode_prompt`).

Strict, as the Llama loader: another architecture, a gemma3.* setting, a
tensor or a tokenizer setting this engine does not implement is an error
naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvsched.engine.loaders import model_file
from kvsched.engine.loaders.gguf_file import (
    GGUFModel,
    TensorReader,
    _field,
    gguf_model,
    open_gguf,
)
from kvsched.engine.model import Params, make_params
from kvsched.engine.model_config import Gemma3Config, UnsupportedConfig

ARCH = "gemma3"

# llama.cpp's gemma3 hard-codes these (llama-model.cpp): every sixth layer is
# global, local layers rotate at base 10,000.
GLOBAL_EVERY = 6
LOCAL_ROPE_BASE = 10_000.0
LAYERS_27B = 62  # llama.cpp's test for the model whose attention scale differs

_KNOWN_KEYS = {
    f"{ARCH}.{k}"
    for k in (
        "block_count",
        "context_length",
        "embedding_length",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.layer_norm_rms_epsilon",
        "attention.key_length",
        "attention.value_length",  # must equal key_length (checked)
        "attention.sliding_window",
        "rope.freq_base",
        "rope.dimension_count",  # must equal key_length (checked)
        "rope.scaling.type",  # none or linear (checked)
        "rope.scaling.factor",
        "final_logit_softcapping",
        "vocab_size",
    )
}

_LAYER_TENSORS = {  # engine name -> the file's blk.{i}.<name>.weight
    "attn_norm": "attn_norm",
    "wq": "attn_q",
    "wk": "attn_k",
    "wv": "attn_v",
    "wo": "attn_output",
    "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm",
    "post_attn_norm": "post_attention_norm",
    "mlp_norm": "ffn_norm",
    "w_gate": "ffn_gate",
    "w_up": "ffn_up",
    "w_down": "ffn_down",
    "post_mlp_norm": "post_ffw_norm",
}
_NORMS = {"attn_norm", "q_norm", "k_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"}


def config_from_gguf_gemma3(
    reader: Any, *, dtype: str = "float32", name: str | None = None
) -> Gemma3Config:
    """The model's shapes and settings from the file's gemma3.* metadata (strict)."""
    arch = _field(reader, "general.architecture")
    if arch != ARCH:
        raise UnsupportedConfig(f"general.architecture={arch!r}: this loader reads {ARCH!r}")
    for key in reader.fields:
        if key.startswith(f"{ARCH}.") and key not in _KNOWN_KEYS:
            raise UnsupportedConfig(f"{key}={_field(reader, key)!r} is not implemented")

    def get(key: str) -> Any:
        return _field(reader, f"{ARCH}.{key}")

    def need(key: str) -> Any:
        v = get(key)
        if v is None:
            raise UnsupportedConfig(f"the GGUF file has no {ARCH}.{key}")
        return v

    dim = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    head_dim = int(need("attention.key_length"))
    for key in ("attention.value_length", "rope.dimension_count"):
        v = get(key)
        if v is not None and int(v) != head_dim:
            raise UnsupportedConfig(
                f"{ARCH}.{key}={v}: only key_length = {head_dim} is implemented"
            )
    n_layers = int(need("block_count"))
    scaling = get("rope.scaling.type") or "none"
    if scaling not in ("none", "linear"):
        raise UnsupportedConfig(f"{ARCH}.rope.scaling.type={scaling!r} is not implemented")
    factor = float(get("rope.scaling.factor") or 1.0)
    linear = scaling == "linear" and factor != 1.0
    cap = get("final_logit_softcapping")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens.data) if tokens else None)
    if vocab is None:
        raise UnsupportedConfig(f"the GGUF file has neither {ARCH}.vocab_size nor a vocabulary")
    return Gemma3Config(
        vocab_size=int(vocab),
        dim=dim,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=int(get("attention.head_count_kv") or heads),
        head_dim=head_dim,
        ffn_dim=int(need("feed_forward_length")),
        rope_theta=float(need("rope.freq_base")),
        norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        dtype=dtype,
        name=name or str(_field(reader, "general.name") or "gguf-gemma3"),
        rope_type="linear" if linear else "default",
        rope_scaling=(("factor", factor),) if linear else (),
        sliding_window=int(need("attention.sliding_window")),
        global_every=GLOBAL_EVERY,
        rope_local_theta=LOCAL_ROPE_BASE,
        query_pre_attn_scalar=float(dim // heads if n_layers == LAYERS_27B else head_dim),
        final_logit_softcap=None if not cap else float(cap),
    )


def load_gguf_gemma3_params(reader: Any, config: Gemma3Config) -> Params:
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
        "q_norm": (c.head_dim,),
        "k_norm": (c.head_dim,),
        "post_attn_norm": (c.dim,),
        "mlp_norm": (c.dim,),
        "w_gate": (c.ffn_dim, c.dim),
        "w_up": (c.ffn_dim, c.dim),
        "w_down": (c.dim, c.ffn_dim),
        "post_mlp_norm": (c.dim,),
    }
    get = TensorReader(reader)

    layers = []
    for i in range(c.n_layers):
        layer = {}
        for key, short in _LAYER_TENSORS.items():
            a = get(f"blk.{i}.{short}.weight", shapes[key])
            if key in _NORMS:
                a = a - 1.0  # the file holds 1 + w
            layer[key] = a if a.ndim == 1 else a.T  # [out, in] -> [in, out]
        layers.append(layer)
    embed = get("token_embd.weight", (c.vocab_size, c.dim))
    head = get("output.weight", (c.vocab_size, c.dim)).T if "output.weight" in get else None
    final_norm = get("output_norm.weight", (c.dim,)) - 1.0
    get.check_all_used()
    return make_params(c, embed=embed, layers=layers, final_norm=final_norm, lm_head=head)


# -- tokenizer ------------------------------------------------------------------------

_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6  # llama.cpp's token types
SPACE = "\u2581"  # SentencePiece's visible space


def spm_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece BPE vocabulary: every way of cutting
    a token into two tokens of the vocabulary, ordered by the token's position
    (earlier: merged first), a longer left part first among one token's cuts."""
    index = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for rank, token in enumerate(tokens):
        for cut in range(len(token) - 1, 0, -1):  # longest left part first
            left, right = token[:cut], token[cut:]
            if left in index and right in index:
                ranked.append((rank, left, right))
    ranked.sort(key=lambda m: m[0])  # stable: one token's cuts keep their order
    return [(left, right) for _, left, right in ranked]


def load_gguf_spm_tokenizer(reader: Any) -> tuple[Any, dict[str, int], dict[str, int]]:
    """A `tokenizers.Tokenizer` for the file's SentencePiece BPE vocabulary, its
    control tokens by name, and its user-defined ones by name. The tokenizer
    adds BOS when asked for special tokens if the file says add_bos_token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "llama":
        raise UnsupportedConfig(
            f"tokenizer.ggml.model={kind!r}: this loader reads 'llama' (SentencePiece BPE)"
        )
    pre = _field(reader, "tokenizer.ggml.pre")
    if pre not in (None, "default"):
        raise UnsupportedConfig(f"tokenizer.ggml.pre={pre!r} is not implemented (default)")
    if _field(reader, "tokenizer.ggml.add_space_prefix"):
        raise UnsupportedConfig("tokenizer.ggml.add_space_prefix=True is not implemented")
    if _field(reader, "tokenizer.ggml.add_eos_token"):
        raise UnsupportedConfig("tokenizer.ggml.add_eos_token=True is not implemented")
    if "tokenizer.ggml.merges" in reader.fields:
        raise UnsupportedConfig("tokenizer.ggml.merges in a 'llama' vocabulary is not implemented")
    tok_field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(tok_field.parts[i]).decode("utf-8") for i in tok_field.data]
    type_field = reader.fields.get("tokenizer.ggml.token_type")
    types = [int(type_field.parts[i][0]) for i in type_field.data] if type_field else []
    if len(types) != len(tokens):
        raise UnsupportedConfig("tokenizer.ggml.token_type does not give every token a type")
    # Runs of spaces are stored as spaces; the text reaches the model with its
    # spaces as U+2581, so they are looked up that way.
    tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    if len(set(tokens)) != len(tokens):
        raise UnsupportedConfig("the vocabulary spells two tokens the same way")
    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=spm_merges(tokens),
        unk_token=tokens[int(unk)] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=any(ty == _BYTE for ty in types),
    )
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    control = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty == _CONTROL}
    user = {
        t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty == _USER_DEFINED
    }
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token") and bos is not None:
        b = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b} $A", pair=f"{b} $A $B", special_tokens=[(b, int(bos))]
        )
    return tok, control, user


def load_gguf_gemma3(
    path: str | Path, *, dtype: str = "float32", name: str | None = None, reader: Any = None
) -> GGUFModel:
    """Config, params and tokenizer from one Gemma 3 GGUF file."""
    if reader is None:
        reader = open_gguf(model_file(path, "GGUF", magic=b"GGUF"))
    config = config_from_gguf_gemma3(reader, dtype=dtype, name=name)
    params = load_gguf_gemma3_params(reader, config)
    tokenizer, control, _ = load_gguf_spm_tokenizer(reader)
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token"))
    return gguf_model(reader, config, params, tokenizer, control, add_bos=add_bos)
