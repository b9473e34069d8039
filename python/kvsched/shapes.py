"""Model shapes and accelerator presets, and the arithmetic on them that the
engine, the simulator and the capacity planner share: the KV-bytes formula and
the tensor-parallel split rule, written once.

KV bytes per token = 2 (K and V) x layers x KV heads x (head_dim x bytes per
element + bytes of scale), the scale being int8 KV's one float32 per token per
KV head (K and V each): 2 x layers x KV heads x (head_dim + 4). `kv_bytes` is
that formula: the engine sizes its pool and describes its cache arrays with it
(kvsched.engine.kv_cache, which derives the element and scale bytes from the
dtypes it stores), the capacity model sizes a pool with it. Sliding-window
layers (Gemma-2's local layers) keep at most their window of each sequence's
tokens (`ModelShape.kv_bytes_per_sequence`).

Hybrid attention. A model declares each layer's attention kind
(`ModelShape.layer_types`): "full", "sliding_window:W" (a token at p attends
[max(0, p - W + 1), p]) or "chunked_local:C" (a token at p attends
[floor(p / C) * C, p]). `group_layers` cuts the layers into KV-cache groups
that share one pool of equal pages (each page holds `layers_per_group` layers'
K/V of block_size tokens); `reserved_pages` is what reserve admission holds
for one request under that layout. The engine and the capacity model both
use them.

Tensor parallelism: n devices over h KV heads store n x ceil(h / n) heads
(`ModelShape.kv_copies`), so 16 devices serving 8 KV heads hold every head
twice (as in vLLM, which replicates KV heads when the tensor-parallel size
exceeds them). A device count that cannot run the model is refused
(`tensor_parallel_misfit`, `ModelShape.tensor_parallel_error`: query heads and
MLP split evenly, KV heads evenly or in whole copies), by the engine
(kvsched.engine.sharding) and the capacity model alike.

Presets are public figures (model configs; vendor datasheets, dense bf16); both
tables are plain dicts: add your own. Imports nothing but the standard library,
so the engine and the planner can both depend on it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class CapacityError(ValueError):
    """The model does not fit, or a cost input is missing or impossible."""


def kv_bytes(
    layers: int,
    kv_heads: int,
    head_dim: int,
    element_bytes: float,
    scale_bytes: float = 0,
    *,
    tokens: int = 1,
) -> float:
    """Bytes of KV cache `tokens` tokens take (a page: tokens=block_size): per
    layer, K and V of each KV head, each `head_dim` elements of `element_bytes`
    plus `scale_bytes` of scale (int8 KV's per-token-per-head scale; 0 for float
    KV). Integer inputs give an integer."""
    return tokens * 2 * layers * kv_heads * (head_dim * element_bytes + scale_bytes)


def tensor_parallel_misfit(query_heads: int, kv_heads: int, ffn: int, devices: int) -> str | None:
    """Which part of a model cannot be split over `devices` tensor-parallel
    devices: "query_heads" or "ffn" (they must split evenly; 0 is unknown and
    not checked), "kv_heads" (they must split evenly or divide the device count,
    each head then copied to devices / kv_heads devices), or None. The one rule
    the engine (kvsched.engine.sharding.kv_replicas) and the capacity model
    both apply."""
    for part, value in (("query_heads", query_heads), ("ffn", ffn)):
        if value and value % devices:
            return part
    if kv_heads % devices and devices % kv_heads:
        return "kv_heads"
    return None


# -- attention kinds and KV-cache groups -----------------------------------------------

FULL = "full"
SLIDING_WINDOW = "sliding_window"
CHUNKED_LOCAL = "chunked_local"


def parse_kind(kind: str) -> tuple[str, int | None]:
    """An attention kind string as (name, span): ("full", None),
    ("sliding_window", W) or ("chunked_local", C), W and C positive token
    counts. Anything else is a ValueError that names the string."""
    if not isinstance(kind, str):
        raise ValueError(f"an attention kind is a string, got {kind!r}")
    if kind == FULL:
        return FULL, None
    name, colon, span = kind.partition(":")
    if name not in (SLIDING_WINDOW, CHUNKED_LOCAL) or not colon:
        raise ValueError(
            f"attention kind {kind!r}: expected 'full', 'sliding_window:W' or 'chunked_local:C'"
        )
    # isdigit alone accepts non-ASCII digits, int() accepts spaces and signs.
    if not (span.isascii() and span.isdigit()) or int(span) < 1:
        raise ValueError(f"attention kind {kind!r}: {name}'s span must be a whole number >= 1")
    return name, int(span)


def kind_span(kind: str) -> int | None:
    """Most tokens a layer of this kind attends from one query: W, C, or None
    for full attention (every token)."""
    return parse_kind(kind)[1]


def window_kind(window: int) -> str:
    """The kind string of a sliding window of `window` tokens."""
    return _kind(SLIDING_WINDOW, window)


def chunk_kind(chunk: int) -> str:
    """The kind string of chunked local attention over `chunk`-token chunks."""
    return _kind(CHUNKED_LOCAL, chunk)


def _kind(name: str, span: int) -> str:
    kind = f"{name}:{span}"
    parse_kind(kind)
    return kind


def canonical_kind(kind: str) -> str:
    """The one spelling of a kind ("sliding_window:0512" -> "sliding_window:512"),
    so that equal kinds compare equal as strings."""
    name, span = parse_kind(kind)
    return name if span is None else f"{name}:{span}"


def every_nth_full(layers: int, n: int, window: int) -> tuple[str, ...]:
    """Per-layer kinds of a model whose layer i is full iff (i + 1) % n == 0,
    every other layer a `window`-token sliding window: Gemma 2 and gpt-oss
    (n = 2), Gemma 3 (n = 6), as transformers derives their `layer_types`."""
    if layers < 1 or n < 1:
        raise ValueError(f"layers and n must be >= 1, got {layers} and {n}")
    local = window_kind(window)
    return tuple(FULL if (i + 1) % n == 0 else local for i in range(layers))


@dataclass(frozen=True)
class KVGroupLayout:
    """How a model's layers share the KV pool: one pool of equal pages, each
    page of group g holding `layers_per_group` layers' K/V of block_size tokens
    (padding slots of a group with fewer layers count as memory all the same)."""

    groups: tuple[str, ...]
    """Attention kind of each group; groups[0] is "full"."""
    layers_per_group: int
    """Lg: layer slots in every page."""
    layer_group: tuple[int, ...]
    """Per layer: its group."""
    layer_slot: tuple[int, ...]
    """Per layer: its slot 0..Lg-1 in its group's pages."""

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    def layers_of(self, group: int) -> tuple[int, ...]:
        """The layers of `group`, in slot order."""
        return tuple(sorted((i for i, g in enumerate(self.layer_group) if g == group),
                            key=lambda i: self.layer_slot[i]))  # fmt: skip


def group_layers(layer_kinds: Sequence[str], *, uniform: bool = False) -> KVGroupLayout:
    """Cut a model's layers (their attention kinds, in layer order) into
    KV-cache groups. Lg = the fewest layers of any one kind; each kind's
    layers, in order, fill groups of Lg (the last group of a kind may keep
    padding slots); full groups first, then the other kinds in order of first
    appearance. A model with no full-attention layer is a ValueError (the
    scheduler's group 0 is full attention). `uniform=True` is the baseline: one
    "full" group of every layer (Lg = the layer count), whatever the kinds
    (windows are still applied by attention, not by memory)."""
    kinds = [canonical_kind(k) for k in layer_kinds]
    if not kinds:
        raise ValueError("a model has at least one layer")
    n = len(kinds)
    if uniform:
        return KVGroupLayout((FULL,), n, (0,) * n, tuple(range(n)))
    if FULL not in kinds:
        raise ValueError(
            f"no full-attention layer among {sorted(set(kinds))}: the KV-cache groups need "
            "group 0 to be full attention (uniform=True keeps every layer in full instead)"
        )
    order = [FULL] + [k for k in dict.fromkeys(kinds) if k != FULL]
    members = {k: [i for i, kind in enumerate(kinds) if kind == k] for k in order}
    lg = min(len(m) for m in members.values())
    groups: list[str] = []
    layer_group = [0] * n
    layer_slot = [0] * n
    for kind in order:
        base = len(groups)
        for j, layer in enumerate(members[kind]):
            layer_group[layer] = base + j // lg
            layer_slot[layer] = j % lg
        groups += [kind] * -(-len(members[kind]) // lg)
    return KVGroupLayout(tuple(groups), lg, tuple(layer_group), tuple(layer_slot))


def group_reserved_pages(kind: str, total_len: int, block_size: int, chunk: int) -> int:
    """Pages one group holds for a request of final length `total_len` under
    reserve admission: a full group every page, ceil(n / B); a window (or
    chunk) of span S never more than a query chunk of `chunk` tokens and its
    span touch at once, min(ceil(n / B), ceil((S + chunk - 2) / B) + 1)."""
    if block_size < 1 or chunk < 1:
        raise ValueError(f"block_size and chunk must be >= 1, got {block_size} and {chunk}")
    if total_len < 0:
        raise ValueError(f"a request's length is >= 0, got {total_len}")
    pages = -(-total_len // block_size)
    span = kind_span(kind)
    if span is None:
        return pages
    # What one step can touch: its chunk of at most c queries and the S - 1
    # positions a window (or a local chunk) reaches back before the first of
    # them, S + c - 1 positions; L positions straddle at most
    # ceil((L - 1) / B) + 1 pages.
    return min(pages, -(-(span + chunk - 2) // block_size) + 1)


def reserved_pages_per_group(
    groups: Sequence[str], prompt_len: int, max_tokens: int, block_size: int, chunk: int
) -> tuple[int, ...]:
    """`group_reserved_pages` of each group for a request of `prompt_len` +
    `max_tokens` tokens, admitted with long-prefill chunk `chunk`."""
    if prompt_len < 0 or max_tokens < 0:
        raise ValueError(f"prompt_len and max_tokens must be >= 0, got {prompt_len}, {max_tokens}")
    n = prompt_len + max_tokens
    return tuple(group_reserved_pages(g, n, block_size, chunk) for g in groups)


def reserved_pages(
    groups: Sequence[str], prompt_len: int, max_tokens: int, block_size: int, chunk: int
) -> int:
    """Pages a request reserves under reserve admission, over all its groups
    (`KVGroupLayout.groups`); a single full group reserves ceil(n / B)."""
    return sum(reserved_pages_per_group(groups, prompt_len, max_tokens, block_size, chunk))


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: float  # parameters
    vocab: int
    # Sliding-window attention (Gemma-2: every other layer attends to the last
    # 4,096 tokens only): those layers keep at most `sliding_window` tokens of
    # KV per sequence, whatever its length. 0 layers: every layer is global.
    # Derived from `layer_types` when that is given (`sliding_window` None when
    # the layers' windows differ); given without it, the sliding layers are
    # taken to be the even ones first (Gemma-2's alternation), then the odd.
    sliding_window: int | None = None
    sliding_layers: int = 0
    # Width of the residual stream: what a tensor-parallel all-reduce carries per
    # token per layer (the step-cost model's collectives). 0: unknown.
    hidden: int = 0
    # Query heads and the MLP's width: which tensor-parallel device counts can
    # run the model (`tensor_parallel_error`). 0: unknown, not checked.
    query_heads: int = 0
    ffn: int = 0
    # Each layer's attention kind ("full", "sliding_window:W",
    # "chunked_local:C"), in layer order: what `kv_layout` groups and the step
    # cost reads. Left out (()), it is derived from the two sliding fields
    # above: every layer full without them.
    layer_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.layer_types:
            kinds = self._kinds_from_sliding_fields()
        else:
            try:
                kinds = tuple(canonical_kind(k) for k in self.layer_types)
            except ValueError as e:
                raise CapacityError(f"{self.name}: {e}") from None
            if len(kinds) != self.layers:
                raise CapacityError(
                    f"{self.name}: {len(kinds)} layer_types for {self.layers} layers"
                )
            windows = [kind_span(k) for k in kinds if k.startswith(SLIDING_WINDOW)]
            derived = (windows[0] if len(set(windows)) == 1 else None), len(windows)
            given = self.sliding_window, self.sliding_layers
            # No sliding layers: the window was never read (as before layer_types).
            if given[1] and given != derived:
                raise CapacityError(
                    f"{self.name}: sliding_window={given[0]}, sliding_layers={given[1]} "
                    f"disagree with layer_types ({derived[1]} layers of window {derived[0]})"
                )
            object.__setattr__(self, "sliding_window", derived[0])
            object.__setattr__(self, "sliding_layers", derived[1])
        object.__setattr__(self, "layer_types", kinds)

    def _kinds_from_sliding_fields(self) -> tuple[str, ...]:
        if not (self.sliding_layers and self.sliding_window is not None):
            return (FULL,) * self.layers
        if not 0 < self.sliding_layers <= self.layers:
            raise CapacityError(
                f"{self.name}: {self.sliding_layers} sliding layers of {self.layers}"
            )
        order = [*range(0, self.layers, 2), *range(1, self.layers, 2)]
        local = set(order[: self.sliding_layers])
        window = window_kind(self.sliding_window)
        return tuple(window if i in local else FULL for i in range(self.layers))

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer attends to less than every token."""
        return any(k != FULL for k in self.layer_types)

    def kv_layout(self, *, uniform: bool = False) -> KVGroupLayout:
        """The KV-cache groups of this model's layers (`group_layers`);
        `uniform=True`: every layer in one full group, the baseline."""
        return group_layers(self.layer_types, uniform=uniform)

    def kinds_summary(self) -> str:
        """The layers by kind, in order of first appearance, full first:
        "10 full, 52 sliding_window:1024"."""
        counts: dict[str, int] = {FULL: 0}
        for k in self.layer_types:
            counts[k] = counts.get(k, 0) + 1
        return ", ".join(f"{n} {k}" for k, n in counts.items() if n)

    def kv_bytes_per_sequence(
        self, context: int, dtype_bytes: float = 2, *, kv_dtype: str | None = None,
        block_size: int = 1,
    ) -> float:  # fmt: skip
        """KV bytes one sequence of `context` tokens holds, in pages of
        `block_size` tokens, each layer keeping only what it attends: global
        layers every token, sliding-window (and chunked local) layers at most
        their span's. The least any layout can hold (no reservation slack,
        no shared pages)."""
        per_layer = self.kv_bytes_per_token(dtype_bytes, kv_dtype=kv_dtype) / self.layers
        kept = 0
        for kind in self.layer_types:
            span = kind_span(kind)
            tokens = context if span is None else min(context, span)
            kept += math.ceil(tokens / block_size) * block_size
        return per_layer * kept

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any] | str | os.PathLike[str], *, name: str | None = None
    ) -> ModelShape:
        """The shape of a Hugging Face model from its config.json (a path, or the
        dict it holds; a multimodal config's `text_config` is read over it):
        num_hidden_layers, num_attention_heads, num_key_value_heads (default:
        the attention heads), head_dim (default hidden_size / heads),
        hidden_size, intermediate_size, vocab_size; the layers' kinds from
        `layer_types` ("full_attention", "sliding_attention" with
        `sliding_window`, "chunked_attention" with `attention_chunk_size`),
        else from `sliding_window_pattern` (layer i full iff (i + 1) % pattern
        == 0, Gemma 3's older configs) or the model type (gemma2 alternates,
        mistral and mixtral slide everywhere). The parameter count is
        estimated from the shapes: embeddings (twice unless tied), attention
        projections, a gated MLP (or its experts and router). What it cannot
        read is a CapacityError naming the key."""
        where = "config"
        if isinstance(config, (str, os.PathLike)):
            path = Path(config)
            where = str(path)
            try:
                data = json.loads(path.read_text())
            except OSError as e:
                raise CapacityError(f"{path}: {e.strerror or e}") from None
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CapacityError(f"{path}: not JSON ({e})") from None
            if name is None:
                # A checkpoint folder names the model: gemma-3-27b-it/config.json.
                stem = path.resolve().parent.name if path.name == "config.json" else path.stem
                name = stem or None
        else:
            data = config
        if not isinstance(data, Mapping):
            raise CapacityError(
                f"{where}: a config.json holds an object, not {type(data).__name__}"
            )
        text = data.get("text_config")
        cfg = {**data, **text} if isinstance(text, Mapping) else dict(data)
        model_type = str(cfg.get("model_type", ""))
        # The keys a model class fills in when a config.json leaves them out.
        cfg = {**_HF_CLASS_DEFAULTS.get(model_type, {}), **cfg}
        if cfg.get("kv_lora_rank") is not None:
            raise CapacityError(
                f"{where}: multi-head latent attention (kv_lora_rank) caches a latent, not "
                "K and V per KV head: its KV bytes are not this model's formula"
            )

        def whole(key: str, default: int | None = None) -> int:
            value = cfg.get(key, default)
            if value is None:
                raise CapacityError(f"{where}: no {key}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CapacityError(f"{where}: {key} must be a whole number >= 1, got {value!r}")
            return value

        layers = whole("num_hidden_layers")
        heads = whole("num_attention_heads")
        hidden = whole("hidden_size")
        kv_heads = whole("num_key_value_heads", heads)
        head_dim = whole("head_dim", hidden // heads or None)
        vocab = whole("vocab_size")
        ffn = whole("intermediate_size")
        kinds = _hf_layer_kinds(cfg, layers, model_type, where, whole)
        experts = 1
        for key in ("num_local_experts", "num_experts", "n_routed_experts"):
            if cfg.get(key) is not None:
                experts = whole(key)
                break
        expert_ffn = ffn
        if experts > 1 and cfg.get("moe_intermediate_size") is not None:
            expert_ffn = whole("moe_intermediate_size")
        embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings", True) else 2)
        attention = hidden * head_dim * 2 * (heads + kv_heads)
        mlp = experts * 3 * hidden * expert_ffn + (hidden * experts if experts > 1 else 0)
        params = float(embeddings + layers * (attention + mlp))
        if name is None:
            name = str(cfg.get("_name_or_path") or "").rstrip("/").split("/")[-1]
        label = name or model_type or "model"
        return cls(label, layers, kv_heads, head_dim, params, vocab, hidden=hidden,
                   query_heads=heads, ffn=ffn, layer_types=kinds)  # fmt: skip

    def kv_bytes_per_token(self, dtype_bytes: float = 2, *, kv_dtype: str | None = None) -> float:
        """K and V of one token over all layers: `dtype_bytes` per element, or a
        named `kv_dtype` (KV_DTYPES), an int8 one with its per-token-per-head scales."""
        if kv_dtype is None:
            return kv_bytes(self.layers, self.kv_heads, self.head_dim, dtype_bytes)
        if kv_dtype not in KV_DTYPES:
            raise CapacityError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
        element, scale = KV_DTYPES[kv_dtype]
        return kv_bytes(self.layers, self.kv_heads, self.head_dim, element, scale)

    def tensor_parallel_error(self, devices: int) -> str | None:
        """Why `devices` tensor-parallel devices cannot run this model, or None.
        The query heads and the MLP must split evenly over them; the KV heads
        must either split evenly or divide the device count (each head is then
        copied to devices / kv_heads devices). What kvsched's engine
        (kvsched.engine.sharding.kv_replicas) accepts, and vLLM. Unknown query
        heads or MLP width (0) are not checked."""
        why = self._tensor_parallel_why(devices)
        if why is None:
            return None
        limit = self.query_heads or 2 * self.kv_heads
        fits = [n for n in range(1, limit + 1) if self._tensor_parallel_why(n) is None]
        return f"{why} (device counts that run it: {', '.join(map(str, fits))})"

    def _tensor_parallel_why(self, devices: int) -> str | None:
        part = tensor_parallel_misfit(self.query_heads, self.kv_heads, self.ffn, devices)
        if part == "kv_heads":
            return (
                f"{self.name}'s {self.kv_heads} KV heads neither split over {devices} devices "
                "nor divide them (for a copy of each head per device)"
            )
        if part is not None:
            what, value = (("query heads", self.query_heads) if part == "query_heads"
                           else ("MLP width", self.ffn))  # fmt: skip
            return f"{self.name}'s {what} ({value}) cannot split evenly over {devices} devices"
        return None

    def kv_copies(self, devices: int) -> float:
        """How many times its KV is stored over `devices` tensor-parallel devices:
        each holds ceil(kv_heads / devices) heads (at least one), so the devices
        store devices x that many heads: 1.0 while they divide the heads evenly,
        devices / kv_heads past them."""
        return devices * math.ceil(self.kv_heads / devices) / self.kv_heads

    def weight_bytes(self, precision: str = "bf16") -> float:
        return self.params * WEIGHT_BYTES[precision]

    def flops_per_token(self) -> float:
        """Forward FLOPs per token, weights only (2 per parameter)."""
        return 2.0 * self.params


@dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float
    # Tensor parallelism's all-reduces: the bytes/s one device's ring traffic
    # moves (half the datasheet's bidirectional per-device figure, see
    # ACCELERATORS) and the fixed cost of one collective (an assumption, not a
    # datasheet figure). 0: no interconnect known (one device only).
    interconnect_bytes_per_s: float = 0.0
    collective_latency_s: float = 0.0
    # Between hosts (`hosts` > 1): the bytes/s one device's share of the
    # inter-host traffic moves. None: the same links as within a host (a TPU
    # slice's ICI spans its hosts); 0: no inter-host figure known.
    host_link_bytes_per_s: float | None = None


# transformers' Gemma3TextConfig defaults: a multimodal Gemma 3 config.json
# (gemma-3-4b-it, gemma-3-27b-it) leaves some of them out of its text_config.
_HF_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
                    "sliding_window_pattern": 6},
}  # fmt: skip
# transformers' layer_types names.
_HF_LAYER_TYPES = {"full_attention": FULL, "sliding_attention": SLIDING_WINDOW,
                   "chunked_attention": CHUNKED_LOCAL}  # fmt: skip


def _hf_layer_kinds(
    cfg: Mapping[str, Any], layers: int, model_type: str, where: str, whole: Any
) -> tuple[str, ...]:
    """The per-layer kinds a config.json declares (ModelShape.from_hf_config)."""
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise CapacityError(f"{where}: layer_types must list the {layers} layers' kinds")
        kinds = []
        for t in types:
            if t not in _HF_LAYER_TYPES:
                raise CapacityError(
                    f"{where}: layer type {t!r} is not one kvsched can size (it knows "
                    f"{', '.join(_HF_LAYER_TYPES)})"
                )
            kind = _HF_LAYER_TYPES[t]
            if kind == SLIDING_WINDOW:
                kind = window_kind(whole("sliding_window"))
            elif kind == CHUNKED_LOCAL:
                kind = chunk_kind(whole("attention_chunk_size"))
            kinds.append(kind)
        return tuple(kinds)
    if cfg.get("sliding_window") is None or cfg.get("use_sliding_window") is False:
        if cfg.get("attention_chunk_size") is not None:
            raise CapacityError(f"{where}: attention_chunk_size without layer_types: which "
                                "layers are chunked is not said")  # fmt: skip
        return (FULL,) * layers
    window = whole("sliding_window")
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and not isinstance(pattern, bool):
        return every_nth_full(layers, whole("sliding_window_pattern"), window)
    if model_type == "gemma2":
        return every_nth_full(layers, 2, window)
    if model_type in ("mistral", "mixtral"):
        return (window_kind(window),) * layers
    raise CapacityError(
        f"{where}: sliding_window={window} but not which layers use it (no layer_types or "
        "sliding_window_pattern): add layer_types"
    )


WEIGHT_BYTES = {"float32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}

# KV cache dtypes: (bytes per element, bytes of scale per token per KV head for K
# and for V). int8 is symmetric absmax with a float32 scale per token and head.
KV_DTYPES: dict[str, tuple[int, int]] = {
    "float32": (4, 0),
    "bf16": (2, 0),
    "bfloat16": (2, 0),
    "fp16": (2, 0),
    "float16": (2, 0),
    "int8": (1, 4),
}

MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-3-8b", 32, 8, 128, 8.03e9, 128256, hidden=4096, query_heads=32,
                   ffn=14336),
        ModelShape("llama-3-70b", 80, 8, 128, 70.6e9, 128256, hidden=8192, query_heads=64,
                   ffn=28672),
        ModelShape("mistral-7b", 32, 8, 128, 7.25e9, 32768, hidden=4096, query_heads=32,
                   ffn=14336),
        ModelShape("qwen2.5-7b", 28, 4, 128, 7.62e9, 152064, hidden=3584, query_heads=28,
                   ffn=18944),
        # Gemma-2 alternates local (4,096-token sliding window) and global layers.
        ModelShape("gemma-2-9b", 42, 8, 256, 9.24e9, 256000, 4096, 21, hidden=3584,
                   query_heads=16, ffn=14336),
        ModelShape("gemma-2-27b", 46, 16, 128, 27.2e9, 256000, 4096, 23, hidden=4608,
                   query_heads=32, ffn=36864),
        # the main job's model
        ModelShape("smollm2-135m", 30, 3, 64, 134.5e6, 49152, hidden=576, query_heads=9,
                   ffn=1536),
        # Gemma 3: layer i global iff (i + 1) % 6 == 0, the rest a sliding window
        # (transformers' Gemma3TextConfig derives layer_types so; llama.cpp
        # hard-codes the same). Shapes as transformers' converter
        # (models/gemma3/convert_gemma3_weights.py, _VARIANTS) gives them:
        # 270m 18 layers, hidden 640, 4 query heads, 1 KV head of 256, MLP 2,048,
        # window 512, vocab 262,144; 27b 62 layers, hidden 5,376, 32 query heads,
        # 16 KV heads of 128, MLP 21,504, window 1,024. Parameters: 270m from
        # those shapes (167.8M embedding + 100.3M in the layers; Google's card
        # says 170M + 100M), 27b Google's 27.4B (the 27.0B of the text model
        # and the 0.4B vision encoder a multimodal server loads too).
        ModelShape("gemma-3-270m", 18, 1, 256, 268e6, 262144, hidden=640, query_heads=4,
                   ffn=2048, layer_types=every_nth_full(18, 6, 512)),
        ModelShape("gemma-3-27b", 62, 16, 128, 27.4e9, 262144, hidden=5376, query_heads=32,
                   ffn=21504, layer_types=every_nth_full(62, 6, 1024)),
        # gpt-oss: even layers a 128-token sliding window, odd ones full
        # (transformers' GptOssConfig: layer_types, sliding_window=128), 64
        # query heads and 8 KV heads of 64, hidden 2,880, experts of 2,880;
        # 20b 24 layers (32 experts), 120b 36 (128). Parameters: OpenAI's model
        # card (20.91B and 116.83B, experts included).
        ModelShape("gpt-oss-20b", 24, 8, 64, 20.91e9, 201088, hidden=2880, query_heads=64,
                   ffn=2880, layer_types=every_nth_full(24, 2, 128)),
        ModelShape("gpt-oss-120b", 36, 8, 64, 116.83e9, 201088, hidden=2880, query_heads=64,
                   ffn=2880, layer_types=every_nth_full(36, 2, 128)),
    )
}  # fmt: skip

# Interconnect: half the bidirectional per-device figure of the datasheet, as
# the bandwidth a ring all-reduce moves per device: Cloud TPU's system
# architecture tables give the ICI bandwidth per chip, bidirectional, as v5e
# 400 GBps, v5p 1,200 GBps, v6e 800 GBps (the chip's links together: a ring
# over one torus axis may get less); NVIDIA's H100 SXM and H200 SXM datasheets
# give NVLink 900 GB/s per GPU, bidirectional. The 10 us per collective is an
# assumption (launch and synchronisation of a small all-reduce), not a figure
# of either datasheet: set your own. Between hosts: a TPU slice's ICI links
# its hosts' chips as it links one host's (the same figure); NVIDIA's DGX
# H100/H200 datasheets give eight 400 Gb/s ConnectX-7 ports, one per GPU:
# 50 GB/s per GPU each way.
COLLECTIVE_LATENCY_S = 10e-6
GPU_HOST_LINK = 50e9
ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("tpu-v5e", 16e9, 819e9, 197e12, 200e9, COLLECTIVE_LATENCY_S),
        Accelerator("tpu-v5p", 95e9, 2765e9, 459e12, 600e9, COLLECTIVE_LATENCY_S),
        Accelerator("tpu-v6e", 32e9, 1640e9, 918e12, 400e9, COLLECTIVE_LATENCY_S),
        Accelerator("h100", 80e9, 3.35e12, 989e12, 450e9, COLLECTIVE_LATENCY_S, GPU_HOST_LINK),
        Accelerator("h200", 141e9, 4.8e12, 989e12, 450e9, COLLECTIVE_LATENCY_S, GPU_HOST_LINK),
    )
}
