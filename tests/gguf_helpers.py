"""Small GGUF files for tests, written with the gguf package's writer and laid
out as llama.cpp's converter lays out a Llama checkpoint (Q and K rows permuted
for its interleaved RoPE), with a byte-level GPT-2 style vocabulary and a ChatML
template."""

from __future__ import annotations

import numpy as np

from kvsched.engine.model import LlamaConfig

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """A GPT-2 style vocabulary: two special tokens, the 256 byte symbols and a
    few merges."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r"]
    merged = ["he", "ll", "hell", "hello", "Ġw", "or"]
    tokens = ["<|im_start|>", "<|im_end|>"] + alphabet + merged
    types = [3, 3] + [1] * (len(tokens) - 2)
    return tokens, merges, types


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K rows ([out, in]): within each
    head, the two rotary halves are interleaved."""
    out = w.shape[0]
    return w.reshape(n_heads, 2, out // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model: LlamaConfig, params, *, extra=None, arch="llama", drop=None,
               tied=True, chat_template=CHATML, name=None) -> None:  # fmt: skip
    """`params` (the engine's [in, out] layout) as a llama.cpp-style GGUF file."""
    tokens, merges, types = byte_level_vocab()
    assert len(tokens) == model.vocab_size
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(model.n_layers)
    w.add_context_length(256)
    w.add_embedding_length(model.dim)
    w.add_feed_forward_length(model.ffn_dim)
    w.add_head_count(model.n_heads)
    w.add_head_count_kv(model.n_kv_heads)
    w.add_rope_freq_base(model.rope_theta)
    w.add_layer_norm_rms_eps(model.norm_eps)
    w.add_rope_dimension_count(model.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if name is not None:
        w.add_name(name)
    for key, value in (extra or {}).items():
        w.add_float32(key, value)

    def put(name: str, a) -> None:
        if name != drop:
            w.add_tensor(name, np.ascontiguousarray(np.asarray(a, np.float32)))

    put("token_embd.weight", params["embed"])
    put("output_norm.weight", params["final_norm"])
    if not tied:
        put("output.weight", np.asarray(params["lm_head"]).T)
    names = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
             "wo": "attn_output", "mlp_norm": "ffn_norm", "w_gate": "ffn_gate",
             "w_up": "ffn_up", "w_down": "ffn_down"}  # fmt: skip
    for i in range(model.n_layers):
        for key, short in names.items():
            a = np.asarray(params["layers"][key][i], np.float32)
            if a.ndim == 2:
                a = a.T  # [in, out] -> [out, in], as checkpoints store projections
            if key == "wq":
                a = llama_cpp_permute(a, model.n_heads)
            if key == "wk":
                a = llama_cpp_permute(a, model.n_kv_heads)
            put(f"blk.{i}.{short}.weight", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
