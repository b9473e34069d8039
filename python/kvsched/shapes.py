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

import math
from dataclasses import dataclass


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
    sliding_window: int | None = None
    sliding_layers: int = 0
    # Width of the residual stream: what a tensor-parallel all-reduce carries per
    # token per layer (the step-cost model's collectives). 0: unknown.
    hidden: int = 0
    # Query heads and the MLP's width: which tensor-parallel device counts can
    # run the model (`tensor_parallel_error`). 0: unknown, not checked.
    query_heads: int = 0
    ffn: int = 0

    def kv_bytes_per_sequence(
        self, context: int, dtype_bytes: float = 2, *, kv_dtype: str | None = None,
        block_size: int = 1,
    ) -> float:  # fmt: skip
        """KV bytes one sequence of `context` tokens holds, in pages of
        `block_size` tokens: global layers keep every token, sliding-window
        layers at most the window's."""
        per_layer = self.kv_bytes_per_token(dtype_bytes, kv_dtype=kv_dtype) / self.layers
        full = math.ceil(context / block_size) * block_size
        kept = full
        if self.sliding_layers and self.sliding_window is not None:
            kept = math.ceil(min(context, self.sliding_window) / block_size) * block_size
        glob = self.layers - self.sliding_layers
        return per_layer * (glob * full + self.sliding_layers * kept)

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


class CapacityError(ValueError):
    """The model does not fit, or a cost input is missing or impossible."""
