"""The highest load a workload can be served at within its SLOs.

`find_max_rate` searches the arrival-rate multiplier m (arrival times divided
by m) for the largest at which every tenant with an SLO meets its attainment
target (the share of its offered requests served within the SLO; a refusal is
a miss, see `slo`):

1. bracket: from `start` (1x), double while the point meets the targets, or
   halve while it misses, until one multiplier meets them and one misses;
2. bisect between the two (geometric mean: the multiplier is a ratio) until
   they are within `tolerance` (2%) of each other.

Each point runs `seeds` variants of the workload and pools them: a tenant's
attainment is its met requests over its offered requests, all seeds together.
Seed 0 is the workload as given. The other seeds vary only when requests
arrive (every seed offers the same requests, so the point's verdict is about
timing, not about a different mix):

- "shift" (a trace with real arrival times): the trace is rotated in time by
  a random offset, wrapping its end to its start: the same gaps and bursts,
  falling on other requests and at another moment of the run;
- `retimed(rate, burstiness)` (a workload whose times were drawn at a rate):
  fresh gamma gaps at that rate, seed k.

A point stops early once its verdict is certain: when a tenant's misses so far
exceed what the target allows over every seed, the remaining seeds cannot save
it (an overloaded point typically costs one run). So a search costs about
log2(max/start) + log2(log(2)/log(1 + tolerance)) points: ~10 points, most of
the runs at points that pass.

The binding constraint is read at the lowest multiplier that missed: the
tenant furthest below its target there, and the cause of most of its misses
(refused, capped, ttft, itl or gap).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

import kvsched
from kvsched.maxrate_result import MaxRate, load_max_rate  # noqa: F401 (exported)
from kvsched.sim import workloads
from kvsched.sim.scenarios import Scenario
from kvsched.sim.setup import SimEngine
from kvsched.sim.simulator import SERVED, Arrival, SimResult, simulate
from kvsched.sim.slo import ANY, CAUSES, Slo, attainment, slo_of

Vary = Callable[[list[Arrival], int], list[Arrival]]


class MaxRateError(ValueError):
    """The search has no answer: no load, however low, meets the SLOs."""


def shifted(arrivals: list[Arrival], seed: int) -> list[Arrival]:
    """Seed 0: `arrivals` as given; seed k: rotated in time by a random offset
    (uniform over the trace's span plus one mean gap, the end wrapping to the
    start), then sorted."""
    if seed == 0 or len(arrivals) < 2:
        return list(arrivals)
    t = np.array([a.at for a in arrivals])
    span = float(t.max() - t.min())
    if span <= 0:
        return list(arrivals)
    period = span * len(arrivals) / (len(arrivals) - 1)  # one mean gap past the end
    offset = np.random.default_rng(seed).uniform(0.0, period)
    at = (t - t.min() + offset) % period
    order = np.argsort(at, kind="stable")
    return [
        Arrival(float(at[i]), arrivals[i].tenant, arrivals[i].prompt, arrivals[i].max_tokens)
        for i in order
    ]


def retimed(rate: float, burstiness: float = 1.0, seed: int = 0) -> Vary:
    """Seed 0: the arrivals as given; seed k: the same requests, in the same
    order, at fresh gamma-gap times (`workloads.arrival_times`, `rate`
    requests/s, coefficient of variation `burstiness`, seed `seed` + k: pass
    the seed the workload was drawn with, so no variant repeats it)."""

    def vary(arrivals: list[Arrival], k: int) -> list[Arrival]:
        if k == 0:
            return list(arrivals)
        at = workloads.arrival_times(len(arrivals), rate, burstiness=burstiness, seed=seed + k)
        return [
            Arrival(float(t), a.tenant, a.prompt, a.max_tokens)
            for t, a in zip(at, arrivals, strict=True)
        ]

    vary.rate = rate  # type: ignore[attr-defined]  # the workload's rate at 1x
    return vary


@dataclass(frozen=True)
class Point:
    """One multiplier tried: whether every tenant met its target (pooled over
    the seeds run), each tenant's attainment, the worst tenant and cause."""

    multiplier: float
    passed: bool
    attainment: dict[str, float]
    misses: dict[str, dict[str, int]]  # tenant -> cause -> requests
    seeds_run: int
    requests_per_s: float  # offered
    output_tokens_per_s: float  # served, per second of the run
    input_tokens_per_s: float  # prompt tokens of the served requests, per second
    worst: tuple[str, str] | None = None  # (tenant, cause) furthest below target


def nominal_rate(arrivals: list[Arrival]) -> float:
    """Requests per second of `arrivals`: (n - 1) gaps over the span from first
    to last (0 when they all arrive at once)."""
    if len(arrivals) < 2:
        return 0.0
    span = arrivals[-1].at - arrivals[0].at
    return (len(arrivals) - 1) / span if span > 0 else 0.0


def find_max_rate(
    arrivals: list[Arrival],
    tenants: Iterable[kvsched.TenantConfig],
    engine: SimEngine,
    slos: Mapping[str, Slo],
    *,
    target: float = 0.99,
    seeds: int = 3,
    vary: str | Vary = "shift",
    scenario: Scenario | None = None,
    start: float = 1.0,
    tolerance: float = 0.02,
    max_multiplier: float = 1024.0,
    min_multiplier: float = 1 / 1024,
    base_rate: float | None = None,
    trace: str = "",
    progress: Callable[[Point], None] | None = None,
) -> MaxRate:
    """The highest arrival-rate multiplier of `arrivals` (at 1x: as given) at
    which every tenant with an SLO in `slos` (named, or `*`) serves at least
    `target` of its offered requests within it, on `engine` (`setup.engine_for`)
    in `scenario` (default continuous batching: `engine.config` unchanged).

    `vary`: how seeds 1.. differ from the workload ("shift", "none", or a
    function (arrivals, seed) -> arrivals such as `retimed(rate)`).
    `base_rate`: the workload's requests/s at 1x (default: the rate of
    `retimed(rate)`, else `nominal_rate`).
    Raises MaxRateError when even `min_multiplier` misses, ValueError on bad
    arguments (an SLO for a tenant the workload does not have, for one)."""
    t0 = time.perf_counter()
    tenants = list(tenants)
    if not arrivals:
        raise ValueError("the workload is empty")
    if not (0 < target <= 1):
        raise ValueError(f"the attainment target is a share in (0, 1], got {target!r}")
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    if not (tolerance > 0 and 0 < min_multiplier <= max_multiplier < math.inf):
        raise ValueError("need tolerance > 0 and 0 < min_multiplier <= max_multiplier < inf")
    if not (min_multiplier <= start <= max_multiplier):
        raise ValueError(f"the search starts at {start:g}x, outside {min_multiplier:g}x to "
                         f"{max_multiplier:g}x")  # fmt: skip
    if len(arrivals) < 2 or min(a.at for a in arrivals) == max(a.at for a in arrivals):
        # A multiplier divides the arrival times: here it changes nothing, and
        # a search would climb to its limit and report a rate of 0 req/s.
        raise ValueError(f"the workload's {len(arrivals)} request(s) arrive at one instant: "
                         "no arrival rate to multiply (draw arrivals at a rate: --rate, "
                         "or file_workload(rate=...))")  # fmt: skip
    names = sorted({a.tenant for a in arrivals})
    unknown = sorted(set(slos) - set(names) - {ANY})
    if unknown:
        raise ValueError(f"SLO for {', '.join(map(repr, unknown))}, not a tenant of the "
                         f"workload (its tenants: {', '.join(names)})")  # fmt: skip
    judged = [t for t in names if slo_of(t, slos) is not None]
    if not judged:
        raise ValueError("no tenant of the workload has an SLO: nothing to search for")
    vary_fn: Vary
    if vary == "shift":
        vary_fn, vary_name = shifted, "shift"
    elif vary == "none":
        vary_fn, vary_name = (lambda a, seed: list(a)), "none"
    elif callable(vary):
        vary_fn, vary_name = vary, getattr(vary, "__name__", "custom")
        vary_name = "retimed" if vary_name == "vary" else vary_name
    else:
        raise ValueError(f"vary must be 'shift', 'none' or a function, got {vary!r}")
    scenario = scenario or Scenario("continuous")
    config = engine.config.replace(**scenario.overrides)
    if base_rate is None:
        base_rate = getattr(vary_fn, "rate", None) or nominal_rate(arrivals)
    rate1 = base_rate
    variants = [vary_fn(arrivals, s) for s in range(seeds)]
    offered = {t: sum(a.tenant == t for a in arrivals) for t in judged}  # per seed
    points: list[Point] = []
    runs = 0

    def run(m: float, seed: int) -> SimResult:
        nonlocal runs
        runs += 1
        return simulate(config, tenants, workloads.scale_time(variants[seed], 1.0 / m),
                        engine.cost, name=scenario.name,
                        static_batching=scenario.static_batching)  # fmt: skip

    def evaluate(m: float) -> Point:
        met = dict.fromkeys(judged, 0)
        misses = {t: dict.fromkeys(CAUSES, 0) for t in judged}
        out_tok = in_tok = virtual = 0.0
        done = 0
        failed = False
        for seed in range(seeds):
            r = run(m, seed)
            done += 1
            served = [x for x in r.records if x.outcome in SERVED]
            out_tok += sum(x.output_len for x in served)
            in_tok += sum(x.prompt_len for x in served)
            virtual += r.virtual_s
            for t, att in attainment(r, slos).items():
                met[t] += att.met
                for cause, k in att.misses.items():
                    misses[t][cause] += k
            # Certain to miss: more misses than the target allows over all seeds.
            if any(sum(misses[t].values()) > (1 - target) * offered[t] * seeds + 1e-9
                   for t in judged):  # fmt: skip
                failed = True
                break
        share = {t: met[t] / (offered[t] * done) if offered[t] else 1.0 for t in judged}
        passed = not failed and all(share[t] >= target - 1e-12 for t in judged)
        worst = None
        if not passed:
            t = min(judged, key=lambda t: (share[t], t))
            cause = max(CAUSES, key=lambda c: (misses[t][c], -CAUSES.index(c)))
            worst = (t, cause)
        p = Point(m, passed, share, misses, done, rate1 * m,
                  out_tok / max(virtual, 1e-9), in_tok / max(virtual, 1e-9), worst)  # fmt: skip
        points.append(p)
        if progress is not None:
            progress(p)
        return p

    lo: Point | None = None
    hi: Point | None = None
    p = evaluate(start)
    if p.passed:
        lo = p
        while hi is None and lo.multiplier * 2 <= max_multiplier:
            p = evaluate(lo.multiplier * 2)
            if p.passed:
                lo = p
            else:
                hi = p
    else:
        hi = p
        while lo is None:
            if hi.multiplier / 2 < min_multiplier:
                t, cause = hi.worst or ("?", "?")
                raise MaxRateError(
                    f"no load meets the SLOs: even at {hi.multiplier:g}x the workload's rate "
                    f"{t} serves {hi.attainment[t]:.1%} within its SLO ({slo_of(t, slos)}; "
                    f"most misses: {cause}), below the {target:.1%} target"
                )
            p = evaluate(hi.multiplier / 2)
            if p.passed:
                lo = p
            else:
                hi = p
    while hi is not None and hi.multiplier / lo.multiplier > 1 + tolerance:
        p = evaluate(math.sqrt(lo.multiplier * hi.multiplier))
        if p.passed:
            lo = p
        else:
            hi = p
    binding = None if hi is None or hi.worst is None else {
        "tenant": hi.worst[0], "constraint": hi.worst[1]}  # fmt: skip
    return MaxRate(
        multiplier=lo.multiplier,
        requests_per_s=lo.requests_per_s,
        output_tokens_per_s=lo.output_tokens_per_s,
        input_tokens_per_s=lo.input_tokens_per_s,
        model=engine.cost.model.name,
        accelerator=engine.cost.accelerator.name,
        devices=engine.cost.devices,
        trace=trace,
        attainment_target=target,
        binding=binding,
        slos={t: str(slo_of(t, slos)) for t in judged},
        upper=None if hi is None else hi.multiplier,
        seeds=seeds,
        variation=vary_name,
        scenario=scenario.name,
        attainment=dict(lo.attainment),
        points=[
            {
                "multiplier": q.multiplier,
                "passed": q.passed,
                "attainment": q.attainment,
                "seeds_run": q.seeds_run,
                "worst": None if q.worst is None else list(q.worst),
            }
            for q in points
        ],  # fmt: skip
        runs=runs,
        wall_s=time.perf_counter() - t0,
    )
