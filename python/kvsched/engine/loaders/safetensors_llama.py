"""A Hugging Face Llama checkpoint in safetensors (model.layers.N.self_attn.
q_proj.weight, ...): projection weights are stored [out, in] and transposed here.

The file is read by `read_safetensors`, a memory map of the format itself (an
8-byte header length, a JSON header, the raw little-endian tensors), so bfloat16
tensors load as `ml_dtypes.bfloat16` arrays, which `safetensors.numpy` cannot
represent; the params come out in the config's dtype whatever the file holds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvsched.engine.loaders import model_file
from kvsched.engine.model import Params, check_weight, make_params
from kvsched.engine.model_config import LlamaConfig, UnsupportedConfig

LAYER_KEYS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


def load_llama_safetensors(path: str | Path | Sequence[str | Path], config: LlamaConfig) -> Params:
    """Weights from a Llama-format safetensors file, or the shards of one
    checkpoint (a sequence of files; a tensor in two of them is refused),
    float32, bfloat16 or float16 tensors, as params in `config.dtype`. Shapes
    are checked against `config`; a tensor the config does not describe is
    refused."""
    if isinstance(path, str | Path):
        t = read_safetensors(path)
    else:
        files, t = list(path), {}
        for f in files:
            shard = read_safetensors(f)
            both = sorted(set(shard) & set(t))
            if both:
                raise ValueError(f"{f}: tensor {both[0]!r} is in another shard too")
            t.update(shard)
        path = f"{Path(files[0]).parent} ({len(files)} shards)" if files else "no shards"

    def get(name: str, shape: tuple[int, ...], transpose: bool = False) -> np.ndarray:
        if name not in t:
            raise KeyError(f"{path}: no tensor {name!r}")
        a = t[name].T if transpose else t[name]
        if a.shape != shape:
            raise ValueError(f"{path}: {name} has shape {a.shape}, the config says {shape}")
        check_weight(f"{path}: {name}", a)  # NaN or inf: refused, naming the tensor
        return a

    c = config
    q_out, kv_out = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes = {
        "attn_norm": (c.dim,),
        "wq": (c.dim, q_out),
        "wk": (c.dim, kv_out),
        "wv": (c.dim, kv_out),
        "wo": (q_out, c.dim),
        "mlp_norm": (c.dim,),
        "w_gate": (c.dim, c.ffn_dim),
        "w_up": (c.dim, c.ffn_dim),
        "w_down": (c.ffn_dim, c.dim),
    }
    layers = []
    for i in range(c.n_layers):
        layers.append(
            {
                k: get(
                    f"model.layers.{i}.{name}",
                    shapes[k],
                    transpose=k not in ("attn_norm", "mlp_norm"),
                )
                for k, name in LAYER_KEYS.items()
            }
        )
    head = "lm_head.weight" if "lm_head.weight" in t else "model.embed_tokens.weight"
    expected = {
        f"model.layers.{i}.{name}" for i in range(c.n_layers) for name in LAYER_KEYS.values()
    }
    expected |= {"model.embed_tokens.weight", "model.norm.weight", head}
    # Rotary frequency buffers some exporters save are recomputed here.
    extra = {k for k in t if k not in expected and not k.endswith("rotary_emb.inv_freq")}
    if extra:
        raise ValueError(
            f"{path}: {len(extra)} tensors the config does not describe (more layers, "
            f"biases?), e.g. {sorted(extra)[:3]}"
        )
    return make_params(
        c,
        embed=get("model.embed_tokens.weight", (c.vocab_size, c.dim)),
        layers=layers,
        final_norm=get("model.norm.weight", (c.dim,)),
        lm_head=get(head, (c.dim, c.vocab_size), transpose=True),
    )


_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
_MAX_HEADER = 100_000_000  # the format's own limit


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, as read-only numpy arrays over a
    memory map of it (bfloat16 as ml_dtypes.bfloat16). Floating-point tensors
    only: an integer or 8-bit (quantized) tensor is refused, naming it."""
    import ml_dtypes

    path = model_file(path, "safetensors")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a safetensors file (its header is not JSON: {e})") from e
        if not isinstance(header, dict):
            raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)")
    data = (
        np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
        if size > 8 + n
        else np.zeros(0, np.uint8)
    )
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        kind = _DTYPES.get(info["dtype"])
        if kind is None:
            raise UnsupportedConfig(
                f"{path}: tensor {name} is {info['dtype']}: only "
                f"{', '.join(_DTYPES)} tensors are implemented"
            )
        dt = np.dtype(ml_dtypes.bfloat16) if kind == "bfloat16" else np.dtype(kind)
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        if not 0 <= begin <= end <= data.size or end - begin != math.prod(shape) * dt.itemsize:
            raise ValueError(f"{path}: tensor {name}: offsets {begin}..{end} do not fit {shape}")
        out[name] = data[begin:end].view(dt).reshape(shape)
    return out


def save_llama_safetensors(params: Params, path: str | Path) -> None:
    """Write params in the Llama layout (the inverse of the loader)."""
    from safetensors.numpy import save_file

    out = {
        "model.embed_tokens.weight": np.asarray(params["embed"], np.float32),
        "model.norm.weight": np.asarray(params["final_norm"], np.float32),
        "lm_head.weight": np.ascontiguousarray(np.asarray(params["lm_head"], np.float32).T),
    }
    for k, name in LAYER_KEYS.items():
        stacked = np.asarray(params["layers"][k], np.float32)
        for i, a in enumerate(stacked):
            out[f"model.layers.{i}.{name}"] = a if a.ndim == 1 else np.ascontiguousarray(a.T)
    save_file(out, str(path))
