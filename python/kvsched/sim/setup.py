"""What the `kvsched simulate` command builds before it replays anything, as
functions a custom study calls the same way: a named workload (arrivals and its
tenants) and the engine it runs on (the scheduler's base configuration, sized
by the capacity model, and the step-cost model).

    arrivals, tenants = named_workload("azure", load=2.0)
    engine = engine_for(arrivals, model="llama-3-8b", accelerator="h100")
    result = simulate(engine.config, tenants, arrivals, engine.cost)

Any trace, a file or records in memory (`traces.read_requests` gives the
format), the same way:

    arrivals, tenants = file_workload("my.csv", rate=5.0)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kvsched
from kvsched.capacity import capacity
from kvsched.sim import workloads
from kvsched.sim.simulator import Arrival, StepCost
from kvsched.sim.traces import HASH_BLOCK, read_azure, read_mooncake, read_requests

# The arrival-rate multiplier `kvsched simulate` uses unless --load is given. On the Azure
# trace at its own rate (2.6 req/s) one H100's pool is seldom short and six of
# the eight scenarios print the same figures; at 2x, promised pages peak at
# ~99% and every scenario but static sees pool_full refusals, so they differ.
DEFAULT_LOAD = {"azure": 2.0}
NAMED = ("azure", "mooncake", "prefill-vs-decode", "burst")
# The prefill-vs-decode mix is the README's chunked-prefill comparison: a
# 2,048-token step budget, where p99 already shows the unchunked stall.
DEFAULT_STEP_BUDGET = {"prefill-vs-decode": 2048}
STEP_BUDGET = 8192


def _check_limit(limit: int | None) -> None:
    # 0 or a negative count read nothing and ended in "no requests" or "the
    # workload is empty", which did not say why.
    if limit is not None and not (isinstance(limit, int) and limit >= 1):
        raise ValueError(f"limit (--limit) is a number of requests >= 1, got {limit!r}")


def named_workload(
    trace: str,
    *,
    load: float | None = None,
    time_scale: float = 1.0,
    limit: int | None = None,
    path: str | None = None,
) -> tuple[list[Arrival], list[kvsched.TenantConfig]]:
    """The arrivals and tenants of a named workload at `load` x its arrival rate
    (None: `DEFAULT_LOAD`). `path` replaces the bundled azure or mooncake file."""
    if trace not in NAMED:
        raise ValueError(f"unknown workload {trace!r}; known: {', '.join(NAMED)}")
    _check_limit(limit)
    if path is not None and trace not in ("azure", "mooncake"):
        # The synthetic workloads read no file: a path given with one was ignored.
        raise ValueError(f"a trace file replaces azure or mooncake; {trace} is synthetic")
    load = DEFAULT_LOAD.get(trace, 1.0) if load is None else load
    scale = time_scale / load if load > 0 else math.nan  # arrival times shrink: load x the rate
    if not (0 < load < math.inf and 0 < time_scale < math.inf and 0 < scale < math.inf):
        # NaN too; an infinite or overflowing scale put arrivals at inf s, where
        # the replay never ended.
        raise ValueError(f"load ({load}) and time scale ({time_scale}) must be finite and > 0 "
                         "(and their ratio finite)")  # fmt: skip
    if trace == "azure":
        arrivals = workloads.azure(read_azure(path, limit), time_scale=scale)
        tenants = [kvsched.TenantConfig("interactive", tier=0),
                   kvsched.TenantConfig("batch", tier=1)]  # fmt: skip
    elif trace == "mooncake":
        arrivals = workloads.mooncake(read_mooncake(path, limit), time_scale=scale)
        tenants = [kvsched.TenantConfig("mooncake")]
    elif trace == "prefill-vs-decode":
        arrivals = workloads.scale_time(workloads.prefill_vs_decode(seconds=20, long_rate=1.0),
                                        scale)  # fmt: skip
        tenants = [kvsched.TenantConfig("chat", tier=0), kvsched.TenantConfig("docs", tier=1)]
    else:
        arrivals = workloads.scale_time(workloads.burst(seconds=40), scale)
        tenants = [kvsched.TenantConfig("gold", tier=0), kvsched.TenantConfig("bulk", tier=1)]
    return arrivals, tenants


def file_workload(
    source: str | Path | Iterable[Mapping[str, Any]],
    *,
    rate: float | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
    load: float = 1.0,
    limit: int | None = None,
    tiers: Mapping[str, int] | None = None,
    hash_block: int = HASH_BLOCK,
) -> tuple[list[Arrival], list[kvsched.TenantConfig]]:
    """The arrivals and tenants of any trace: a CSV or JSON-lines file, or
    records in memory (dicts), with `prompt_tokens`, `output_tokens` and
    optionally `arrival_s`, `tenant`, `hash_ids` (see `traces.read_requests`).

    Arrival times are the trace's own, or drawn at `rate` requests/s (needed
    when the trace has none; when given, it replaces the trace's own):
    gamma gaps of coefficient of variation `burstiness` (1: Poisson), `seed`.
    `load` multiplies the arrival rate. Tenants are the trace's `tenant` names
    in order of first appearance ("default" when the column is absent), each at
    tier `tiers[name]` (0, the most important, unless given); a tier naming no
    tenant of the trace is an error (a typo would otherwise pass unnoticed).

        arrivals, tenants = file_workload("my.csv", rate=5.0)
        arrivals, tenants = file_workload([{"prompt_tokens": 900, "output_tokens": 120}] * 50,
                                          rate=2.0, burstiness=3.0)
    """
    if not (0 < load < math.inf and 0 < 1.0 / load < math.inf):  # NaN too
        raise ValueError(f"load must be a finite multiplier > 0, got {load!r}")
    if rate is None and burstiness != 1.0:
        raise ValueError("burstiness shapes arrivals drawn at a rate: give rate= too")
    _check_limit(limit)
    reqs = read_requests(source, limit=limit, hash_block=hash_block)
    arrivals = workloads.from_trace(reqs, rate=rate, burstiness=burstiness, seed=seed,
                                    time_scale=1.0 / load, hash_block=hash_block)  # fmt: skip
    names = list(dict.fromkeys(r.tenant for r in reqs))
    tiers = dict(tiers or {})
    unknown = sorted(set(tiers) - set(names))
    if unknown:
        raise ValueError(f"tier given for {', '.join(map(repr, unknown))}, not a tenant of the "
                         f"trace (its tenants: {', '.join(names)})")  # fmt: skip
    return arrivals, [kvsched.TenantConfig(n, tier=tiers.get(n, 0)) for n in names]


def parse_tiers(specs: Iterable[str]) -> dict[str, int]:
    """`NAME=TIER` specs (the CLI's `--tier`) -> {name: tier}."""
    out: dict[str, int] = {}
    for spec in specs:
        name, eq, tier = spec.partition("=")
        name = name.strip()
        try:
            level = int(tier)
        except ValueError:
            level = -1
        if not eq or not name or level < 0:
            raise ValueError(f"tier {spec!r}: expected NAME=TIER, TIER an integer >= 0")
        if name in out:
            raise ValueError(f"two tiers for tenant {name!r}")
        out[name] = level
    return out


@dataclass(frozen=True)
class SimEngine:
    """The engine a simulation runs on: the scheduler's base configuration and
    the step-cost model of the same model and accelerators."""

    config: kvsched.SchedulerConfig
    cost: StepCost


def engine_for(
    arrivals: list[Arrival],
    *,
    model: str = "llama-3-8b",
    accelerator: str = "h100",
    devices: int = 1,
    hosts: int = 1,
    context: int = 8192,
    max_num_seqs: int = 128,
    step_budget: int = STEP_BUDGET,
    chunk: int = 2048,
    cost: StepCost | None = None,
    kv_groups: str = "hybrid",
) -> SimEngine:
    """Size the pool with the capacity model (`context` is raised to the longest
    request of `arrivals`, rounded up to 16 tokens) and build the base
    configuration `kvsched simulate` uses: continuous batching, chunked prefill,
    reserve admission, at most 4 x `max_num_seqs` waiting; `hosts` x `devices`
    accelerators (one tensor-parallel replica). `cost` replaces the
    preset step-cost model (a calibrated one, for instance). `kv_groups`:
    the pool in KV-cache groups ("hybrid": a model's window layers keep only
    their window) or every layer in every page ("uniform"); the same for a
    model of full layers."""
    if not arrivals:
        raise ValueError("the workload is empty")
    longest = max(len(a.prompt) + a.max_tokens for a in arrivals)
    context = max(context, -(-longest // 16) * 16)
    cap = capacity(model, accelerator, devices=devices, hosts=hosts, context=context,
                   chunk=chunk)  # fmt: skip
    base = cap.scheduler_config(
        kv_groups, max_num_seqs=max_num_seqs, max_batched_tokens=step_budget,
        long_prefill_chunk=chunk, max_waiting=4 * max_num_seqs,
    )  # fmt: skip
    if cost is None:
        cost = StepCost.preset(model, accelerator, devices=devices, hosts=hosts)
    return SimEngine(base, cost)
