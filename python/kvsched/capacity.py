"""Capacity and cost: how many tokens of KV fit, how many sequences run at once,
and what serving a load costs three ways.

Memory. The model's KV bytes per token come from kvsched.shapes (the formula
the engine uses too). Weights take parameters x bytes per weight (bf16 2, int8
1, int4 0.5). Usable KV = devices x HBM x (1 - overhead reserve) - weights.

Hybrid models (sliding-window or chunked local layers beside full ones) are
priced per request from the layer pattern, two ways side by side. The hybrid
layout (kvsched.shapes.group_layers): pages of Lg layers, a request reserving
ceil(n / B) pages in each full group and at most ceil((W + chunk - 2) / B) + 1
in each window group (kvsched.shapes.reserved_pages). The uniform layout, the
baseline: pages of every layer, ceil(n / B) of them. Sequences of a context
that fit = the pool's pages // one request's. The least any layout could hold,
each layer keeping only the tokens it attends, is `max_concurrent_seqs`.
Tensor parallelism is modelled as one device with the devices' summed memory:
right for memory while the devices split the KV heads evenly (weights always
split); past that each device still holds a whole KV head, and a token's KV
costs `ModelShape.kv_copies` times the formula's bytes. A device count that
cannot run the model is refused, as the engine refuses it. Its latency, the
all-reduces between devices, is the step-cost model's
(kvsched.sim.simulator.StepCost), from each preset's interconnect figures.

Cost. Three ways to serve a load of tokens per second: pay-as-you-go per token,
provisioned throughput units (a fixed rate buys a fixed token throughput), and
self-hosting (accelerators by the hour, plus an engineering cost that has no
default: the price of running it yourself is yours to state). Ties go to
pay-as-you-go. `portfolio` sizes a dedicated floor to the median of a load over
time and spills the rest to pay-as-you-go, beside all-dedicated-at-peak and
all-pay-as-you-go, with utilization next to cost: a self-hosted floor idling at
30% is a business case that has quietly inverted.

The presets (MODELS, ACCELERATORS) are kvsched.shapes'; they are importable
from here too.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

# The simulator's max-rate file, once named here too.
from kvsched.maxrate_result import MaxRate, load_max_rate  # noqa: F401

# The shapes, presets and shared arithmetic live in kvsched.shapes (the engine
# imports them without the planner); they stay importable from here.
from kvsched.shapes import (  # noqa: F401
    ACCELERATORS,
    COLLECTIVE_LATENCY_S,
    FULL,
    GPU_HOST_LINK,
    KV_DTYPES,
    MODELS,
    WEIGHT_BYTES,
    Accelerator,
    CapacityError,
    KVGroupLayout,
    ModelShape,
    kv_bytes,
    reserved_pages_per_group,
    tensor_parallel_misfit,
)

if TYPE_CHECKING:
    import kvsched


@dataclass(frozen=True)
class PoolLayout:
    """The pool under one layout of the KV cache: pages of `layers_per_page`
    layers x block_size tokens, and what one request of the context reserves."""

    layout: KVGroupLayout
    page_bytes: float
    """Bytes of one page (padding slots included) over the whole replica."""
    blocks: int
    """Pages the usable KV bytes hold."""
    group_pages: tuple[int, ...]
    """Pages one request of the context reserves in each group."""
    seqs: int
    """Requests of the context that fit at once: blocks // pages_per_seq."""

    @property
    def layers_per_page(self) -> int:
        return self.layout.layers_per_group

    @property
    def pages_per_seq(self) -> int:
        return sum(self.group_pages)


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
    """Pages of every layer (the uniform layout) the usable bytes hold."""
    kv_tokens: int
    context: int
    max_concurrent_seqs: int
    """Sequences of `context` tokens that fit at once, sliding-window layers
    keeping only their window (an engine that frees what slid out, with no
    reservation slack: the least any layout holds)."""
    full_context_seqs: int = 0
    """The same if every layer kept every token (the uniform layout: kvsched's
    SchedulerConfig today); equal to max_concurrent_seqs without sliding windows."""
    hosts: int = 1
    """Hosts the devices are spread over, `devices` on each: KV and weights
    split evenly, each host holding 1 / hosts of every sequence's KV."""
    chunk: int = 512
    """The long-prefill chunk the hybrid reservation assumes (the scheduler's
    default long_prefill_chunk)."""
    hybrid: PoolLayout | None = None
    """The pool in KV-cache groups (kvsched.shapes.group_layers) and what a
    request reserves in it; the same figures as `uniform` for a model whose
    layers are all full."""
    uniform: PoolLayout | None = None
    """The baseline: one group, every layer kept in full."""

    @property
    def kv_bytes_per_host(self) -> float:
        return self.usable_kv_bytes / self.hosts

    @property
    def hybrid_seqs(self) -> int:
        """Sequences of `context` tokens reserve admission admits at once in
        KV-cache groups."""
        return self.hybrid.seqs if self.hybrid is not None else self.full_context_seqs

    def scheduler_config(
        self, layout: str = "uniform", **overrides: Any
    ) -> kvsched.SchedulerConfig:
        """The kvsched.SchedulerConfig this capacity calls for (the overhead
        reserve is already taken out of the pool, so the scheduler keeps none).
        `layout` "uniform": every layer in every page; "hybrid": the pool in
        KV-cache groups (its kv_cache_groups, and the long_prefill_chunk its
        reservations assume), the same as uniform for a model of full layers."""
        import kvsched

        if layout not in ("uniform", "hybrid"):
            raise ValueError(f"layout: 'uniform' or 'hybrid', not {layout!r}")
        if layout == "hybrid" and self.hybrid is not None:
            if self.hybrid.seqs == 0:
                raise CapacityError(
                    f"{self.model}: its KV-cache groups hold no sequence of {self.context:,} "
                    f"tokens ({self.hybrid.blocks:,} pages, {self.hybrid.pages_per_seq:,} a "
                    "sequence)"
                )
            kw: dict[str, Any] = dict(
                num_blocks=self.hybrid.blocks + 1,  # + the null page
                block_size=self.block_size,
                max_seq_len=self.context,
                max_num_seqs=min(self.hybrid.seqs, 1024),
                overhead_reserve=0.0,
                long_prefill_chunk=self.chunk,
                kv_cache_groups=list(self.hybrid.layout.groups),
            )
            kw.update(overrides)
            kw.setdefault("max_batched_tokens", max(kw["max_num_seqs"], 2048))
            return kvsched.SchedulerConfig(**kw)
        if self.uniform is not None and self.uniform.seqs == 0:
            raise CapacityError(
                f"{self.model}: pages of every layer hold no sequence of {self.context:,} "
                f"tokens ({self.uniform.blocks:,} pages, {self.uniform.pages_per_seq:,} a "
                "sequence); a scheduler of KV-cache groups would hold "
                f"{self.hybrid_seqs:,}"
            )
        kw = dict(
            num_blocks=self.kv_blocks + 1,  # + the null page
            block_size=self.block_size,
            max_seq_len=self.context,
            # The uniform layout: no sliding-window saving here.
            max_num_seqs=min(self.full_context_seqs or self.max_concurrent_seqs, 1024),
            overhead_reserve=0.0,
        )
        kw.update(overrides)
        kw.setdefault("max_batched_tokens", max(kw["max_num_seqs"], 2048))
        return kvsched.SchedulerConfig(**kw)


def model_shape(model: str | ModelShape) -> ModelShape:
    """A model preset by name (MODELS), a Hugging Face config.json by path
    (ModelShape.from_hf_config), or the shape itself."""
    if isinstance(model, ModelShape):
        return model
    if model in MODELS:
        return MODELS[model]
    if model.endswith(".json") or os.path.isfile(model):
        return ModelShape.from_hf_config(model)
    raise CapacityError(
        f"unknown model {model!r}: a preset ({', '.join(sorted(MODELS))}) or the path of a "
        "config.json"
    )


def pool_layout(
    m: ModelShape, usable_bytes: float, per_token_bytes: float, *, block_size: int,
    context: int, chunk: int, uniform: bool = False,
) -> PoolLayout:  # fmt: skip
    """The pool of `usable_bytes` under the hybrid (or uniform) layout of
    `m`'s layers, a token of every layer costing `per_token_bytes`, and the
    sequences of `context` tokens (admitted with long-prefill chunk `chunk`)
    it holds under reserve admission."""
    layout = m.kv_layout(uniform=uniform)
    page = per_token_bytes / m.layers * layout.layers_per_group * block_size
    blocks = int(usable_bytes // page)
    group_pages = reserved_pages_per_group(layout.groups, context, 0, block_size, chunk)
    return PoolLayout(layout, page, blocks, group_pages, blocks // sum(group_pages))


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
    chunk: int = 512,
) -> Capacity:
    """KV capacity of a model (a preset, a config.json path or a ModelShape)
    on `hosts` x `devices` accelerators (one tensor-parallel replica: weights
    and KV heads split over all of them, each device holding at least one KV
    head, so that past the model's KV heads they are stored more than once:
    `kv_bytes_per_token` is what the replica stores per token). The KV cache is
    `kv_dtype` (a name in KV_DTYPES, int8 with its scales) or `kv_dtype_bytes`
    per element (no scales); bf16 when neither is given. Sequences of
    `context` tokens are counted in both layouts (`hybrid`, `uniform`), the
    hybrid one reserving for requests admitted with long-prefill chunk
    `chunk`; a context that fits neither is a CapacityError."""
    m = model_shape(model)
    a = ACCELERATORS[accelerator] if isinstance(accelerator, str) else accelerator
    if precision not in WEIGHT_BYTES:
        raise CapacityError(f"precision must be one of {sorted(WEIGHT_BYTES)}, got {precision!r}")
    if (devices < 1 or hosts < 1 or not 0 <= overhead_reserve < 1 or block_size < 1
            or context < 1 or chunk < 1):  # fmt: skip
        raise CapacityError(
            "devices, hosts, block_size, context and chunk must be >= 1, reserve in [0, 1)"
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
    uniform = pool_layout(m, usable, per_token, block_size=block_size, context=context,
                          chunk=chunk, uniform=True)  # fmt: skip
    # KV-cache groups need a full-attention group 0: a model of windows alone
    # (Mistral 7B v0.1) runs in the uniform layout.
    grouped = m.is_hybrid and FULL in m.layer_types
    hybrid = (pool_layout(m, usable, per_token, block_size=block_size, context=context,
                          chunk=chunk) if grouped else uniform)  # fmt: skip
    if max(uniform.seqs, hybrid.seqs) == 0:
        groups = (f" ({hybrid.blocks:,} pages of {hybrid.layers_per_page} layers, "
                  f"{hybrid.pages_per_seq:,} a sequence in KV-cache groups)"
                  if grouped else "")  # fmt: skip
        raise CapacityError(
            f"{m.name} on {where} x {a.name} leaves KV room for {blocks * block_size:,} "
            f"tokens{groups}: not one sequence of {context:,}"
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
            blocks // per_seq_blocks if not m.is_hybrid
            else int(usable // seq_bytes)
        ),
        full_context_seqs=blocks // per_seq_blocks,
        hosts=hosts,
        chunk=chunk,
        hybrid=hybrid,
        uniform=uniform,
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
