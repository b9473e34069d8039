"""Capacity and cost: how many tokens of KV fit, how many sequences run at once,
and what serving a load costs three ways.

Memory. KV bytes per token = 2 (K and V) x layers x KV heads x (head_dim x bytes
per element + bytes of scale), the scale being int8 KV's one float32 per token
per KV head (K and V each): 2 x layers x KV heads x (head_dim + 4). `kv_bytes`
is that formula, the one place it is written: the engine sizes its pool and
describes its cache arrays with it too (kvsched.engine.kv_cache, which derives
the element and scale bytes from the dtypes it stores). It lives here, not in
the engine, because this module must import without JAX. Weights take
parameters x bytes per weight (bf16 2, int8 1, int4 0.5). Usable KV = devices x
HBM x (1 - overhead reserve) - weights. Sliding-window layers (Gemma-2's local
layers) keep at most their window of each sequence's tokens, so sequences at
a long context are counted with that bound (`kv_bytes_per_sequence`).
Tensor parallelism is modelled as one device with the devices' summed
memory: right for memory while the devices split the KV heads evenly (weights
always split). Past that each device still holds at least one whole KV head:
n devices over h KV heads store n x ceil(h / n) heads (`ModelShape.kv_copies`),
so 16 devices serving 8 KV heads hold every head twice, and a token's KV costs
twice the formula's bytes (as in vLLM, which replicates KV heads when the
tensor-parallel size exceeds them). A device count that cannot run the model
is refused (`ModelShape.tensor_parallel_error`: query heads and MLP split
evenly, KV heads evenly or in whole copies), as the engine refuses it. Its latency,
the all-reduces between devices, is the step-cost model's
(kvsched.sim.simulator.StepCost), from each preset's interconnect figures.

Cost. Three ways to serve a load of tokens per second: pay-as-you-go per token,
provisioned throughput units (a fixed rate buys a fixed token throughput), and
self-hosting (accelerators by the hour, plus an engineering cost that has no
default: the price of running it yourself is yours to state). Ties go to
pay-as-you-go. `portfolio` sizes a dedicated floor to the median of a load over
time and spills the rest to pay-as-you-go, beside all-dedicated-at-peak and
all-pay-as-you-go, with utilization next to cost: a self-hosted floor idling at
30% is a business case that has quietly inverted.

Presets are public figures (model configs; vendor datasheets, dense bf16);
both tables are plain dicts: add your own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import kvsched


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


@dataclass(frozen=True)
class Capacity:
    model: str
    accelerator: str
    devices: int
    weight_bytes: float
    kv_bytes_per_token: float
    usable_kv_bytes: float
    block_size: int
    kv_blocks: int
    kv_tokens: int
    context: int
    max_concurrent_seqs: int
    """Sequences of `context` tokens that fit at once, sliding-window layers
    keeping only their window (an engine that frees what slid out)."""
    full_context_seqs: int = 0
    """The same if every layer kept every token (as kvsched's pages do: a page
    holds all layers); equal to max_concurrent_seqs without sliding windows."""
    hosts: int = 1
    """Hosts the devices are spread over, `devices` on each: KV and weights
    split evenly, each host holding 1 / hosts of every sequence's KV."""

    @property
    def kv_bytes_per_host(self) -> float:
        return self.usable_kv_bytes / self.hosts

    def scheduler_config(self, **overrides: Any) -> kvsched.SchedulerConfig:
        """The kvsched.SchedulerConfig this capacity calls for (the overhead
        reserve is already taken out of the pool, so the scheduler keeps none)."""
        import kvsched

        kw: dict[str, Any] = dict(
            num_blocks=self.kv_blocks + 1,  # + the null page
            block_size=self.block_size,
            max_seq_len=self.context,
            # kvsched's pages hold every layer: no sliding-window saving here.
            max_num_seqs=min(self.full_context_seqs or self.max_concurrent_seqs, 1024),
            overhead_reserve=0.0,
        )
        kw.update(overrides)
        kw.setdefault("max_batched_tokens", max(kw["max_num_seqs"], 2048))
        return kvsched.SchedulerConfig(**kw)


def capacity(
    model: str | ModelShape,
    accelerator: str | Accelerator,
    *,
    devices: int = 1,
    precision: str = "bf16",
    kv_dtype_bytes: float | None = None,
    kv_dtype: str | None = None,
    overhead_reserve: float = 0.10,
    block_size: int = 16,
    context: int = 8192,
    hosts: int = 1,
) -> Capacity:
    """KV capacity of a model on `hosts` x `devices` accelerators (one tensor-
    parallel replica: weights and KV heads split over all of them, each device
    holding at least one KV head, so that past the model's KV heads they are
    stored more than once: `kv_bytes_per_token` is what the replica stores per
    token). The KV cache is `kv_dtype` (a name in KV_DTYPES, int8 with its
    scales) or `kv_dtype_bytes` per element (no scales); bf16 when neither is
    given."""
    m = MODELS[model] if isinstance(model, str) else model
    a = ACCELERATORS[accelerator] if isinstance(accelerator, str) else accelerator
    if precision not in WEIGHT_BYTES:
        raise CapacityError(f"precision must be one of {sorted(WEIGHT_BYTES)}, got {precision!r}")
    if (devices < 1 or hosts < 1 or not 0 <= overhead_reserve < 1 or block_size < 1
            or context < 1):  # fmt: skip
        raise CapacityError(
            "devices, hosts, block_size and context must be >= 1, reserve in [0, 1)"
        )
    if kv_dtype is not None and kv_dtype_bytes is not None:
        raise CapacityError("give kv_dtype or kv_dtype_bytes, not both")
    weights = m.weight_bytes(precision)
    usable = hosts * devices * a.hbm_bytes * (1 - overhead_reserve) - weights
    where = f"{hosts} hosts x {devices}" if hosts > 1 else f"{devices}"
    why = m.tensor_parallel_error(hosts * devices)
    if why is not None:
        raise CapacityError(f"{where} x {a.name}: {why}")
    if usable <= 0:
        raise CapacityError(
            f"{m.name} at {precision} ({weights / 1e9:.1f} GB) does not fit {where} x "
            f"{a.name} ({a.hbm_bytes / 1e9:.0f} GB, {overhead_reserve:.0%} reserved)"
        )
    copies = m.kv_copies(hosts * devices)
    if kv_dtype is None:
        per_token = m.kv_bytes_per_token(2 if kv_dtype_bytes is None else kv_dtype_bytes)
    else:
        per_token = m.kv_bytes_per_token(kv_dtype=kv_dtype)
    per_token *= copies
    blocks = int(usable // (per_token * block_size))
    per_seq_blocks = math.ceil(context / block_size)
    if kv_dtype is None:
        seq_bytes = m.kv_bytes_per_sequence(context, 2 if kv_dtype_bytes is None
                                            else kv_dtype_bytes, block_size=block_size)  # fmt: skip
    else:
        seq_bytes = m.kv_bytes_per_sequence(context, kv_dtype=kv_dtype, block_size=block_size)
    seq_bytes *= copies
    if blocks < per_seq_blocks:
        raise CapacityError(
            f"{m.name} on {where} x {a.name} leaves KV room for {blocks * block_size:,} "
            f"tokens: not one sequence of {context:,}"
        )
    return Capacity(
        model=m.name,
        accelerator=a.name,
        devices=devices,
        weight_bytes=weights,
        kv_bytes_per_token=per_token,
        usable_kv_bytes=usable,
        block_size=block_size,
        kv_blocks=blocks,
        kv_tokens=blocks * block_size,
        context=context,
        # Whole pages: the same figure as blocks // per_seq_blocks without windows.
        max_concurrent_seqs=(
            blocks // per_seq_blocks if not m.sliding_layers
            else int(usable // seq_bytes)
        ),
        full_context_seqs=blocks // per_seq_blocks,
        hosts=hosts,
    )  # fmt: skip


# -- cost ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Prices:
    payg_per_mtok: float  # pay-as-you-go, per million tokens
    ptu_per_hour: float | None = None  # one provisioned throughput unit
    ptu_tokens_per_s: float | None = None  # what one unit sustains
    device_per_hour: float | None = None  # one accelerator, self-hosted
    device_tokens_per_s: float | None = None  # what one accelerator sustains
    engineering_per_hour: float | None = None  # running it yourself; no default


@dataclass(frozen=True)
class Option:
    name: str
    per_hour: float
    units: int
    utilization: float


def compare(load_tokens_per_s: float, prices: Prices) -> list[Option]:
    """Hourly cost of serving a steady load three ways, cheapest first; ties
    go to pay-as-you-go."""
    if load_tokens_per_s < 0:
        raise CapacityError("load must be >= 0")
    out = [Option("pay_as_you_go", load_tokens_per_s * 3600 / 1e6 * prices.payg_per_mtok, 0, 1.0)]
    if (prices.ptu_per_hour is None) != (prices.ptu_tokens_per_s is None):
        raise CapacityError("provisioned units need both ptu_per_hour and ptu_tokens_per_s")
    if prices.device_per_hour is None and prices.device_tokens_per_s is not None:
        raise CapacityError("self-hosting needs device_per_hour with device_tokens_per_s")
    if prices.ptu_per_hour is not None:
        if not prices.ptu_tokens_per_s:
            raise CapacityError("provisioned units need ptu_tokens_per_s")
        units = max(1, math.ceil(load_tokens_per_s / prices.ptu_tokens_per_s))
        util = load_tokens_per_s / (units * prices.ptu_tokens_per_s)
        out.append(Option("provisioned", units * prices.ptu_per_hour, units, util))
    if prices.device_per_hour is not None:
        out.append(_self_hosted(load_tokens_per_s, prices))
    order = {"pay_as_you_go": 0, "provisioned": 1, "self_hosted": 2}
    return sorted(out, key=lambda o: (round(o.per_hour, 9), order[o.name]))


def _self_hosted(load: float, prices: Prices, units: int | None = None) -> Option:
    if prices.engineering_per_hour is None:
        raise CapacityError(
            "self-hosting needs engineering_per_hour: the people who run it cost money, and "
            "no default is honest (0 makes self-hosting look cheaper than it is)"
        )
    if not prices.device_tokens_per_s or prices.device_per_hour is None:
        raise CapacityError("self-hosting needs device_per_hour and device_tokens_per_s")
    n = units if units is not None else max(1, math.ceil(load / prices.device_tokens_per_s))
    util = min(1.0, load / (n * prices.device_tokens_per_s))
    return Option("self_hosted", n * prices.device_per_hour + prices.engineering_per_hour, n, util)


@dataclass(frozen=True)
class Portfolio:
    name: str
    cost: float  # over the whole load series
    dedicated_units: int
    utilization: float  # of the dedicated units (1.0 when there are none)


def load_series(
    arrivals_s: np.ndarray | list[float], tokens: np.ndarray | list[float], bucket_s: float
) -> np.ndarray:
    """Tokens/s in consecutive buckets of `bucket_s` seconds, from arrival times
    and each request's tokens (prompt + output): a trace's load over time."""
    at, tok = np.asarray(arrivals_s, float), np.asarray(tokens, float)
    if bucket_s <= 0:
        raise CapacityError("bucket_s must be > 0")
    if at.size == 0:
        return np.zeros(0)
    if (at < 0).any():
        raise CapacityError("arrival times must be seconds from the start of the trace (>= 0)")
    idx = (at // bucket_s).astype(int)
    return np.bincount(idx, weights=tok) / bucket_s


def portfolio(
    load: np.ndarray | list[float], prices: Prices, *, hours_per_point: float = 1.0
) -> list[Portfolio]:
    """For a load (tokens/s, one value per `hours_per_point` hours): a
    self-hosted floor sized to the median with the rest on pay-as-you-go,
    beside all self-hosted at peak and all pay-as-you-go. Cheapest first (ties
    to pay-as-you-go)."""
    load = np.asarray(load, float)
    if load.size == 0 or (load < 0).any():
        raise CapacityError("load must be a non-empty series of tokens/s >= 0")
    hours = hours_per_point

    def payg(tps: float) -> float:
        return tps * 3600 * hours / 1e6 * prices.payg_per_mtok

    cap = prices.device_tokens_per_s
    _self_hosted(0.0, prices, units=1)  # checks the self-hosting inputs
    assert cap and prices.device_per_hour is not None and prices.engineering_per_hour is not None
    hourly = prices.device_per_hour
    engineering = prices.engineering_per_hour

    def dedicated(units: int) -> Portfolio:
        served = np.minimum(load, units * cap)
        spill = load - served
        fixed = units * hourly + (engineering if units else 0.0)
        cost = float(len(load) * hours * fixed + sum(payg(x) for x in spill))
        util = float(served.sum() / (units * cap * len(load))) if units else 1.0
        return Portfolio("", cost, units, util)

    floor = dedicated(math.ceil(float(np.median(load)) / cap))
    peak = dedicated(math.ceil(float(load.max()) / cap))
    all_payg = Portfolio("all_pay_as_you_go", float(sum(payg(x) for x in load)), 0, 1.0)
    out = [
        all_payg,
        Portfolio("median_floor_plus_spill", floor.cost, floor.dedicated_units, floor.utilization),
        Portfolio("all_dedicated_at_peak", peak.cost, peak.dedicated_units, peak.utilization),
    ]
    order = {p.name: i for i, p in enumerate(out)}
    return sorted(out, key=lambda p: (round(p.cost, 6), order[p.name]))


# -- the simulator's max rate as a replica's throughput ----------------------------------


@dataclass(frozen=True)
class MaxRate:
    """What `kvsched simulate --find-max-rate --json FILE` found: the highest
    load at which every tenant met its SLO attainment target, on `devices` x
    `accelerator` serving `model`."""

    path: str
    model: str
    accelerator: str
    devices: int
    multiplier: float
    requests_per_s: float
    input_tokens_per_s: float
    output_tokens_per_s: float
    trace: str
    attainment_target: float
    binding: str  # "<tenant> <constraint>"; "" when no load tried missed the SLOs

    @property
    def tokens_per_s(self) -> float:
        """Prompt + output tokens/s of one replica (the devices together): the
        tokens a cost --load counts, as `load_series` does."""
        return self.input_tokens_per_s + self.output_tokens_per_s

    def describe(self) -> str:
        # No binding: the search met the SLOs up to its limit and stopped there,
        # so the replica was never shown to miss: its rate is a floor, not a max.
        bound = (f"binding {self.binding}" if self.binding else
                 f"no binding: every load up to the search's limit {self.multiplier:g}x met "
                 "the SLOs, so this is a lower bound on what a replica sustains")  # fmt: skip
        return (
            f"the simulator's max rate ({self.path}: trace {self.trace}, "
            f"{self.multiplier:g}x = {self.requests_per_s:,.2f} req/s at attainment "
            f"{self.attainment_target:g}, {bound})"
        )


def load_max_rate(path: str, *, model: str, accelerator: str, devices: int) -> MaxRate:
    """Read a max-rate JSON file; refuse (CapacityError) one for another model,
    accelerator or device count than the one costed, or one with no rate."""
    import json

    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CapacityError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise CapacityError(f"{path}: not a max-rate result (a JSON object expected)")
    try:
        binding = data.get("binding")
        mr = MaxRate(
            path=str(path), model=str(data["model"]), accelerator=str(data["accelerator"]),
            devices=int(data["devices"]), multiplier=float(data["multiplier"]),
            requests_per_s=float(data["requests_per_s"]),
            input_tokens_per_s=float(data["input_tokens_per_s"]),
            output_tokens_per_s=float(data["output_tokens_per_s"]),
            trace=str(data.get("trace", "?")),
            attainment_target=float(data.get("attainment_target", float("nan"))),
            binding="" if binding is None else f"{binding['tenant']} {binding['constraint']}",
        )  # fmt: skip
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CapacityError(f"{path}: not a max-rate result (missing or bad {e})") from None
    for what, mine, theirs in (("model", model, mr.model),
                               ("accelerator", accelerator, mr.accelerator),
                               ("devices", devices, mr.devices)):  # fmt: skip
        if mine != theirs:
            raise CapacityError(
                f"{path} is the max rate of {mr.devices} x {mr.accelerator} serving "
                f"{mr.model}, not of {devices} x {accelerator} serving {model} ({what} "
                "differs): simulate this configuration's max rate"
            )
    if not (mr.tokens_per_s > 0 and math.isfinite(mr.tokens_per_s)):
        raise CapacityError(
            f"{path}: the max rate sustains {mr.tokens_per_s:g} tokens/s (no load met the "
            "SLOs?): nothing to cost a replica at"
        )
    return mr
