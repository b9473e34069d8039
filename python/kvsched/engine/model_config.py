"""The shapes and numerics of a Llama-style decoder, and how a checkpoint's
config maps onto them.

`LlamaConfig` is what the model code reads; `from_hf` reads a Hugging Face
config.json (as a dict). RoPE frequencies come from `rope_inv_freq`, so a
checkpoint's rotary variant is decided here, once. `Gemma3Config` is Gemma 3's
text decoder: a LlamaConfig (so everything that sizes a pool or a mesh from one
reads it unchanged) with the settings Gemma adds, among them each layer's
attention kind (`layer_kinds`: five sliding-window layers to one global).

Strict: a config.json setting that changes what the model computes and that
this model does not implement is refused with `UnsupportedConfig`, naming the
key; it is never read past.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import jax.numpy as jnp
import numpy as np

DTYPES = ("float32", "bfloat16")

# The rotary variants implemented, and the scaling parameters each one reads.
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

# A checkpoint's dtype -> the dtype the model computes in. float16 checkpoints
# run in bfloat16: the same memory as float16, native on TPU and fast on GPU, and
# bfloat16's range cannot overflow where float16 activations can; the weights
# lose three mantissa bits, the precision every bfloat16 checkpoint has.
_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}

# Keys of neighbouring model families (Mistral, Qwen2, Gemma, Granite, MoE, ...)
# that change the computation when set; a Llama config.json has none of them.
_REFUSED_IF_SET = (
    "quantization_config",
    "use_sliding_window",
    "logits_scaling",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "num_local_experts",
    "num_experts",
    "use_qk_norm",
    "qk_layernorm",
    "no_rope_layers",
)


class UnsupportedConfig(ValueError):
    """A checkpoint setting this model does not implement (the message names it)."""


@dataclass(frozen=True)
class LlamaConfig:
    """The shapes of a Llama-style decoder. `from_hf` reads a Llama config.json.

    `rope_type` is "default", "linear" or "llama3"; `rope_scaling` holds that
    variant's parameters as sorted (name, value) pairs (a dict is accepted and
    converted), so the config stays hashable: it is a static argument under jit.
    """

    vocab_size: int = 512
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    ffn_dim: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: str = "float32"  # or "bfloat16"
    name: str = "tiny-llama"
    rope_type: str = "default"
    rope_scaling: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        items = (
            self.rope_scaling.items() if isinstance(self.rope_scaling, dict) else self.rope_scaling
        )
        scaling = tuple(sorted((str(k), float(v)) for k, v in items))
        object.__setattr__(self, "rope_scaling", scaling)
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedConfig(
                f"rope_type={self.rope_type!r} is not implemented "
                f"(implemented: {', '.join(ROPE_TYPES)})"
            )
        need = ROPE_TYPES[self.rope_type]
        if tuple(k for k, _ in scaling) != tuple(sorted(need)):
            raise ValueError(
                f"rope_type {self.rope_type!r} takes exactly the scaling parameters "
                f"{list(need)}, got {dict(scaling)}"
            )

    @classmethod
    def from_hf(
        cls, cfg: dict[str, Any], name: str = "llama", *, dtype: str | None = None
    ) -> LlamaConfig:
        """From a Hugging Face Llama config.json (as a dict), in either format:
        transformers 4 (`rope_theta` and a `rope_scaling` dict) or transformers 5
        (a `rope_parameters` dict holding `rope_type`, `rope_theta` and the
        scaling fields). RoPE "default", "linear" and "llama3" (Llama 3.1 and
        later) are implemented; any other rotary variant, and every other setting
        that changes the computation and is not implemented (model_type other
        than llama, sliding_window, hidden_act other than silu, attention or MLP
        biases, partial rotary, quantization, ...), raises `UnsupportedConfig`
        naming the key.

        dtype: the checkpoint's `dtype` (transformers 5) or `torch_dtype`
        (transformers 4) unless `dtype` is given: "float32" and "bfloat16" are
        kept, "float16" computes in bfloat16 (same memory, no float16 overflow);
        a config that names none computes in float32.

        Metadata that does not change the logits is accepted: architectures,
        token ids, initializer_range, max_position_embeddings, use_cache,
        transformers_version, tie_word_embeddings (the loader falls back to the
        embedding when there is no lm_head), attention_dropout (off at
        inference), pretraining_tp (transformers 4 only sliced the same matmuls).
        """
        _refuse_unimplemented(cfg)
        rope_type, theta, scaling = _rope_from_hf(cfg)

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise UnsupportedConfig(f"config.json has no {key}")
            return cfg[key]

        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}"
            )
        return cls(
            vocab_size=int(need("vocab_size")),
            dim=int(need("hidden_size")),
            n_layers=int(need("num_hidden_layers")),
            n_heads=heads,
            n_kv_heads=kv_heads,
            head_dim=int(cfg.get("head_dim") or int(need("hidden_size")) // heads),
            ffn_dim=int(need("intermediate_size")),
            rope_theta=theta,
            # transformers' LlamaConfig default, for a config.json that omits it
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            dtype=_dtype_from_hf(cfg, dtype),
            name=name,
            rope_type=rope_type,
            rope_scaling=tuple(scaling.items()),  # __post_init__ sorts them
        )

    @property
    def jdtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def scale(self) -> float:
        scale: float = float(self.head_dim) ** -0.5  # (typeshed: float ** float is Any)
        return scale

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window in tokens, 0 for full attention (every
        layer of a Llama model)."""
        return (0,) * self.n_layers

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention kind as kvsched.shapes spells it ("full",
        "sliding_window:W"): what `kvsched.shapes.group_layers` cuts into
        KV-cache groups."""
        return tuple("full" if w == 0 else f"sliding_window:{w}" for w in self.layer_windows)

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct windows of the layers, ascending (0: full attention)."""
        return tuple(sorted(set(self.layer_windows)))

    def layer_inv_freqs(self) -> np.ndarray:
        """Each layer's rotary inverse frequencies [n_layers, head_dim / 2]
        (float32): `rope_inv_freq` for every layer of a Llama model."""
        return np.tile(rope_inv_freq(self), (self.n_layers, 1))


@dataclass(frozen=True)
class Gemma3Config(LlamaConfig):
    """Gemma 3's text decoder (what llama.cpp calls `gemma3`, transformers
    `gemma3_text`). Besides a Llama decoder's shapes it computes:

    - RMSNorm as x / rms(x) * (1 + weight), and norms of q and k per head;
    - the token embedding times sqrt(dim), rounded to the model's dtype first;
    - attention scale `query_pre_attn_scalar ** -0.5` (None: head_dim);
    - a GELU (tanh approximation) gated MLP;
    - norms after attention and after the MLP, before each residual add;
    - layer i global (full attention) iff (i + 1) % `global_every` == 0, the
      others attending their last `sliding_window` positions; global layers
      rotate with `rope_theta` (and `rope_type`'s scaling), local ones with
      `rope_local_theta`, unscaled;
    - logits from the embedding (tied), soft-capped as
      c * tanh(logits / c) when `final_logit_softcap` is c.

    The defaults are a tiny model for tests (one global layer in six).
    """

    n_layers: int = 6
    norm_eps: float = 1e-6
    name: str = "tiny-gemma3"
    sliding_window: int = 16
    global_every: int = 6
    rope_local_theta: float = 10000.0
    query_pre_attn_scalar: float | None = None
    final_logit_softcap: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1 or self.global_every < 1:
            raise ValueError(
                f"sliding_window={self.sliding_window} and global_every={self.global_every} "
                "must be >= 1"
            )
        for key in ("rope_local_theta", "query_pre_attn_scalar", "final_logit_softcap"):
            v = getattr(self, key)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"{key}={v!r} must be positive")

    @property
    def scale(self) -> float:
        scalar = self.query_pre_attn_scalar or self.head_dim
        scale: float = float(scalar) ** -0.5
        return scale

    @property
    def layer_windows(self) -> tuple[int, ...]:
        return tuple(0 if (i + 1) % self.global_every == 0 else self.sliding_window
                     for i in range(self.n_layers))  # fmt: skip

    def layer_inv_freqs(self) -> np.ndarray:
        """Global layers: `rope_inv_freq` (rope_theta, rope_type's scaling);
        local layers: the default rotation at rope_local_theta."""
        local = rope_inv_freq(replace(self, rope_theta=self.rope_local_theta,
                                      rope_type="default", rope_scaling=()))  # fmt: skip
        full = rope_inv_freq(self)
        return np.stack([full if w == 0 else local for w in self.layer_windows])


def _refuse_unimplemented(cfg: dict[str, Any]) -> None:
    """Raise UnsupportedConfig for a setting that changes the computation."""
    model_type = cfg.get("model_type")
    if model_type not in (None, "llama"):
        raise UnsupportedConfig(f"model_type={model_type!r}: only 'llama' is implemented")
    for key in ("hidden_act", "hidden_activation"):
        act = cfg.get(key)
        if act is not None and act not in ("silu", "swish"):  # swish is silu
            raise UnsupportedConfig(f"{key}={act!r}: only 'silu' is implemented")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise UnsupportedConfig(f"{key}={cfg[key]!r}: biases are not implemented")
    if cfg.get("sliding_window") is not None and cfg.get("use_sliding_window") is not False:
        raise UnsupportedConfig(
            f"sliding_window={cfg['sliding_window']!r}: sliding-window attention is not implemented"
        )
    layer_types = cfg.get("layer_types") or ()
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise UnsupportedConfig(f"layer_types contains {other}: only full_attention is implemented")
    for key in _REFUSED_IF_SET:
        if cfg.get(key):  # None, false, 0 and [] are the families' "off"
            raise UnsupportedConfig(f"{key}={cfg[key]!r} is not implemented")
    prf = cfg.get("partial_rotary_factor")
    if prf is not None and float(prf) != 1.0:
        raise UnsupportedConfig(f"partial_rotary_factor={prf!r}: partial RoPE is not implemented")


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[str, float, dict[str, float]]:
    """(rope_type, theta, scaling parameters) from either config format. Where a
    value is given in more than one place the places must agree."""
    given = [k for k in ("rope_scaling", "rope_parameters") if cfg.get(k)]
    src = "/".join(given) or "rope_parameters"
    merged: dict[str, Any] = {}
    where: dict[str, str] = {}

    def put(key: str, value: Any, origin: str) -> None:
        if value is None:
            return
        if key in merged and merged[key] != value:
            raise UnsupportedConfig(
                f"{where[key]} says {key}={merged[key]!r} but {origin} says {value!r}"
            )
        merged[key], where[key] = value, origin

    for k in given:
        d = cfg[k]
        if not isinstance(d, dict):
            raise UnsupportedConfig(f"{k}={d!r}: expected a dict")
        if any(isinstance(v, dict) for v in d.values()):
            raise UnsupportedConfig(f"{k}: per-layer-type RoPE parameters are not implemented")
        for key, value in d.items():
            put("rope_type" if key == "type" else key, value, f"{k}.{key}")
    put("rope_theta", cfg.get("rope_theta"), "rope_theta")

    rope_type = merged.get("rope_type") or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedConfig(
            f"{src}: rope_type {rope_type!r} is not implemented "
            f"(implemented: {', '.join(ROPE_TYPES)})"
        )
    prf = merged.get("partial_rotary_factor")
    if prf is not None and float(prf) != 1.0:
        raise UnsupportedConfig(f"{src}: partial_rotary_factor={prf!r} is not implemented")
    if rope_type == "llama3":
        # as transformers: a top-level value also counts (here it must agree), and
        # max_position_embeddings is the fallback
        put(
            "original_max_position_embeddings",
            cfg.get("original_max_position_embeddings"),
            "original_max_position_embeddings",
        )
        if "original_max_position_embeddings" not in merged:
            put(
                "original_max_position_embeddings",
                cfg.get("max_position_embeddings"),
                "max_position_embeddings",
            )
    missing = [k for k in ROPE_TYPES[rope_type] if k not in merged]
    if missing:
        raise UnsupportedConfig(f"{src}: rope_type {rope_type!r} needs {', '.join(missing)}")
    # Keys other variants read (attention_factor, beta_fast, ...) are ignored, as
    # transformers' Llama ignores them for these variants.
    scaling = {k: float(merged[k]) for k in ROPE_TYPES[rope_type]}
    bad = [k for k, v in scaling.items() if not (math.isfinite(v) and v > 0)]
    if bad:
        raise UnsupportedConfig(f"{src}: {bad[0]}={scaling[bad[0]]!r} must be positive")
    if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise UnsupportedConfig(f"{src}: high_freq_factor must exceed low_freq_factor")
    theta = float(merged.get("rope_theta", 10000.0))
    if not (math.isfinite(theta) and theta > 0):
        raise UnsupportedConfig(f"rope_theta={theta!r} must be positive")
    return rope_type, theta, scaling


def _dtype_from_hf(cfg: dict[str, Any], override: str | None) -> str:
    if override is not None:
        if override not in DTYPES:
            raise ValueError(f"dtype={override!r}: one of {DTYPES}")
        return override
    found = {}
    for key in ("dtype", "torch_dtype"):
        v = cfg.get(key)
        if v is None:
            continue
        v = str(v).removeprefix("torch.")
        if v not in _HF_DTYPES:
            raise UnsupportedConfig(
                f"{key}={cfg[key]!r}: only {', '.join(_HF_DTYPES)} checkpoints are implemented"
            )
        found[key] = v
    if len(set(found.values())) > 1:
        raise UnsupportedConfig(f"dtype and torch_dtype disagree: {found}")
    return _HF_DTYPES[next(iter(found.values()))] if found else "float32"


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """The rotary inverse frequencies [head_dim / 2] (float32) for this model.

    "linear" divides every frequency by `factor`. "llama3" (Llama 3.1) keeps
    the frequencies whose wavelength is shorter than original_max_position_
    embeddings / high_freq_factor, divides by `factor` those whose wavelength is
    longer than original_max_position_embeddings / low_freq_factor, and blends
    the two in between, linearly in (original context / wavelength). Neither
    scales the attention logits, so only these frequencies change.
    """
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    s = dict(config.rope_scaling)
    if config.rope_type == "linear":
        inv = inv / s["factor"]
    elif config.rope_type == "llama3":
        ctx, factor = s["original_max_position_embeddings"], s["factor"]
        lo, hi = s["low_freq_factor"], s["high_freq_factor"]
        # rotations of each frequency over the original context, mapped to a
        # weight: 0 (<= lo rotations: fully scaled) .. 1 (>= hi rotations: kept)
        rotations = ctx * inv / (2 * math.pi)
        keep = np.clip((rotations - lo) / (hi - lo), 0.0, 1.0)
        inv = keep * inv + (1.0 - keep) * inv / factor
    return inv.astype(np.float32)
