"""Heterogeneous tenants as a bin-packing gain: a prefill-heavy tenant and a
decode-heavy one served together on one machine, against the two ways of
keeping them apart.

The tenants (`workloads.prefill_vs_decode`, Poisson): `docs`, 30,000-token
prompts and 16-token answers (compute-bound prefill), and `chat`, 200-token
prompts and 1,000-token answers (decode: bound by reading weights and KV).

The arrangements, on a machine of `devices` accelerators (2 by default):
- together: one engine on the whole machine (tensor parallel over every
  device) serves both tenants; a step carries chat's decodes beside a chunk of
  a docs prefill, so the decodes use the bandwidth a compute-bound prefill
  leaves idle. Its steps pay tensor parallelism's all-reduces (the step-cost
  model charges them, `StepCost.allreduce_seconds`), which the arrangements
  on half the devices pay less of (none on one device each), so:
- replicas: mixing with less tensor parallelism: two engines of half the
  devices, as apart, each serving both tenants (every other request of each).
  Against apart it isolates the gain of mixing from the engine's size.
- apart: each tenant alone on half the machine, half the *devices* (an engine
  of devices/2: its own step-cost model and its own pool, sized by the
  capacity model for devices/2). Half the devices, not half the pool, because
  that is a machine one can build: two engines, each with its own copy of the
  weights (so the two pools hold less KV than the whole machine's one), each
  step paying its own weight read. Splitting the pool of one engine would
  still share its steps, which is mixing.
- sliced: the whole machine alternates between the tenants in fixed windows
  of `window` seconds (docs first). A request arriving in the other tenant's
  window waits for its own; a request in flight pauses while the other tenant
  runs and resumes where it stopped. Modelled by replaying each tenant alone
  on the whole machine in its own clock, which only runs in its windows, and
  mapping every time back to the wall clock. Optimistic for slicing: switching
  costs nothing, and each tenant keeps the whole pool (as if the other's KV
  moved out and back for free). A request whose tokens straddle a switch gets
  `window` + its longest pause as its longest pause (at most one pause more
  than the truth; any gap target under `window` is missed either way).

Every offered request is in each arrangement's books: served, or refused
with its reason. Per tenant: SLO attainment (`slo.attainment`), goodput,
requests and tokens (prompt + output) served per second of the run. The gain
of mixing: the highest load (of a grid of arrival-rate multipliers) at which
every tenant meets its SLO attainment target, each mixing arrangement
(together, replicas) against each separating one (apart, sliced), and the
throughput it carries.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvsched
from kvsched.sim import workloads
from kvsched.sim.setup import DEFAULT_STEP_BUDGET, engine_for
from kvsched.sim.simulator import SERVED, Arrival, RequestRecord, SimResult, StepCost, simulate
from kvsched.sim.slo import Attainment, Slo, attainment, check_tenants

ARRANGEMENTS = ("together", "replicas", "apart", "sliced")
MIXING = ("together", "replicas")
DEFAULT_SLOS = ("chat:ttft=1,itl=0.1,gap=0.2", "docs:ttft=10")
DEFAULT_LOADS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)
DEFAULT_TARGET = 0.95
STEP_BUDGET = DEFAULT_STEP_BUDGET["prefill-vs-decode"]


@dataclass(frozen=True)
class MixWorkload:
    """The two tenants' shape and their rates at load 1 (requests/s)."""

    seconds: float = 60.0
    docs_rate: float = 0.5
    chat_rate: float = 6.0
    docs_prompt: int = 30_000
    chat_prompt: int = 200
    chat_output: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        # A rate of 0 drew no gap (ZeroDivisionError deep in the generator); a
        # NaN or negative one, nonsense arrivals.
        for name in ("seconds", "docs_rate", "chat_rate"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v < math.inf):  # NaN too
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        for name in ("docs_prompt", "chat_prompt", "chat_output"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name} must be a whole number of tokens >= 1, got {v!r}")

    def arrivals(self, load: float = 1.0) -> list[Arrival]:
        """`load` x the rates over `seconds`: the load-1 stream of
        `seconds` x `load` compressed `load` times, so a higher load adds
        requests to the same ones rather than drawing new ones."""
        if not (0 < load < math.inf and self.seconds > 0):  # NaN too; inf drew forever
            raise ValueError(f"load ({load}) must be finite and > 0, seconds ({self.seconds}) > 0")
        base = workloads.prefill_vs_decode(
            seconds=self.seconds * load, long_prompt=self.docs_prompt, long_rate=self.docs_rate,
            chat_rate=self.chat_rate, chat_prompt=self.chat_prompt,
            chat_output=self.chat_output, seed=self.seed,
        )  # fmt: skip
        return workloads.scale_time(base, 1.0 / load)

    def tenants(self, tiers: tuple[int, int] = (0, 0)) -> list[kvsched.TenantConfig]:
        """chat and docs, both tier 0 unless given: the comparison is of packing,
        not of one tenant displacing the other."""
        return [kvsched.TenantConfig("chat", tier=tiers[0]),
                kvsched.TenantConfig("docs", tier=tiers[1])]  # fmt: skip

    def describe(self) -> str:
        return (f"docs {self.docs_rate:g} req/s ({self.docs_prompt:,}-token prompts, 16 out) "
                f"and chat {self.chat_rate:g} req/s ({self.chat_prompt:,}-token prompts, "
                f"{self.chat_output:,} out) at load 1, Poisson, {self.seconds:g} s, "
                f"seed {self.seed}")  # fmt: skip


@dataclass
class Arrangement:
    name: str  # one of ARRANGEMENTS
    machine: str  # what runs it, in words
    result: SimResult  # every tenant's records, wall-clock times
    attainment: dict[str, Attainment]


def _own_clock(t: float, slot: int, window: float) -> float:
    """Wall time -> the clock of the tenant in `slot` (0 or 1), which runs only
    in its windows [(2k + slot) W, (2k + slot + 1) W)."""
    s = t - slot * window
    if s <= 0:
        return 0.0
    k = int(s // (2 * window))
    return k * window + min(s - 2 * k * window, window)


def _wall_clock(tau: float, slot: int, window: float) -> float:
    k = int(tau // window)
    return slot * window + 2 * k * window + (tau - k * window)


def sliced(
    config: kvsched.SchedulerConfig,
    tenants: Sequence[kvsched.TenantConfig],
    arrivals: list[Arrival],
    cost: StepCost,
    window: float,
) -> SimResult:
    """The whole machine alternating between two tenants in windows of
    `window` seconds, the first tenant first (see the module docstring)."""
    if len(tenants) != 2:
        raise ValueError(f"time slicing alternates two tenants, got {len(tenants)}")
    if not (window > 0):
        raise ValueError(f"the window must be > 0 seconds, got {window!r}")
    records: list[RequestRecord] = []
    steps = errors = 0
    end = wall = 0.0
    for slot, tenant in enumerate(tenants):
        mine = [a for a in arrivals if a.tenant == tenant.name]
        own = [Arrival(_own_clock(a.at, slot, window), a.tenant, a.prompt, a.max_tokens)
               for a in mine]  # fmt: skip
        res = simulate(config, [tenant], own, cost, name=f"sliced:{tenant.name}")
        if len(res.records) != len(mine):  # pragma: no cover - the simulator's books
            raise AssertionError("the simulator lost a request")
        for rec, a in zip(res.records, mine, strict=True):
            rec.arrival = a.at
            crossed = False
            if rec.first_token is not None and rec.last_token is not None:
                crossed = int(rec.first_token // window) != int(rec.last_token // window)
            for attr in ("first_token", "last_token", "finished"):
                v = getattr(rec, attr)
                if v is not None:
                    setattr(rec, attr, _wall_clock(v, slot, window))
            if crossed:
                rec.max_gap += window
            records.append(rec)
        end = max(end, _wall_clock(res.virtual_s, slot, window) if mine else 0.0)
        steps += res.steps
        errors += res.step_errors
        wall += res.wall_s
    records.sort(key=lambda r: r.arrival)
    return SimResult("sliced", records, end, wall, steps, errors)


def _merge(name: str, results: Iterable[SimResult]) -> SimResult:
    results = list(results)
    recs = sorted((r for res in results for r in res.records), key=lambda r: r.arrival)
    gaps: dict[str, list[float]] = {}
    for res in results:
        for t, g in res.gaps.items():
            gaps.setdefault(t, []).extend(g)
    return SimResult(name, recs, max(r.virtual_s for r in results),
                     sum(r.wall_s for r in results), sum(r.steps for r in results),
                     sum(r.step_errors for r in results), gaps=gaps)  # fmt: skip


def check_machine(devices: int, window: float, which: Sequence[str]) -> list[str]:
    """Refuse a machine that does not split in two, a time slice <= 0 (when
    sliced runs) or an unknown arrangement, before anything runs; `which` as a
    list."""
    if devices < 2 or devices % 2:
        raise ValueError(
            f"the machine must split in two halves: devices must be even, got {devices}"
        )
    if "sliced" in which and not (window > 0):  # NaN too; before anything runs
        raise ValueError(f"the window must be > 0 seconds, got {window!r}")
    which = list(which)
    unknown = [w for w in which if w not in ARRANGEMENTS]
    if unknown:
        raise ValueError(f"unknown arrangement {unknown[0]!r}; known: {', '.join(ARRANGEMENTS)}")
    return which


def arrange(
    arrivals: list[Arrival],
    tenants: Sequence[kvsched.TenantConfig],
    slos: Mapping[str, Slo],
    *,
    model: str = "llama-3-8b",
    accelerator: str = "h100",
    devices: int = 2,
    window: float = 1.0,
    max_num_seqs: int = 128,
    step_budget: int = STEP_BUDGET,
    chunk: int = 2048,
    which: Sequence[str] = ARRANGEMENTS,
) -> list[Arrangement]:
    """The same arrivals in each arrangement (ARRANGEMENTS, in that order).
    `max_num_seqs` and `step_budget` are per device (an engine of n devices
    gets n x each); `chunk` is per sequence."""
    which = check_machine(devices, window, which)
    names = [t.name for t in tenants]
    if sorted({a.tenant for a in arrivals}) != sorted(names) or len(names) != 2:
        raise ValueError(f"two tenants, each with arrivals, are needed; tenants {names}")
    check_tenants(slos, names)

    def engine(mine: list[Arrival], n: int):
        # Per-device knobs: an engine of n devices runs n x the sequences and
        # n x the step budget, so a step takes as long on the whole machine as
        # on a half, and neither arrangement is short of batch slots.
        return engine_for(mine, model=model, accelerator=accelerator, devices=n,
                          max_num_seqs=max_num_seqs * n, step_budget=step_budget * n,
                          chunk=chunk)  # fmt: skip

    whole = engine(arrivals, devices)
    out = []
    for name in which:
        if name == "together":
            res = simulate(whole.config, tenants, arrivals, whole.cost, name=name)
            machine = f"{devices} x {accelerator}, one engine for both"
        elif name == "replicas":
            streams: list[list[Arrival]] = [[], []]
            seen: dict[str, int] = {}
            for a in arrivals:  # every other request of each tenant
                i = seen.get(a.tenant, 0)
                streams[i % 2].append(a)
                seen[a.tenant] = i + 1
            half = engine(arrivals, devices // 2)
            res = _merge(name, [simulate(half.config, tenants, st, half.cost, name=f"{name}:{k}")
                                for k, st in enumerate(streams)])  # fmt: skip
            machine = f"{devices // 2} x {accelerator} per replica, two serving both"
        elif name == "apart":
            parts = []
            for t in tenants:
                mine = [a for a in arrivals if a.tenant == t.name]
                half = engine(mine, devices // 2)
                parts.append(simulate(half.config, [t], mine, half.cost, name=f"apart:{t.name}"))
            res = _merge(name, parts)
            machine = f"{devices // 2} x {accelerator} per tenant, an engine each"
        else:
            res = sliced(whole.config, tenants, arrivals, whole.cost, window)
            machine = f"{devices} x {accelerator}, {window:g} s windows each in turn"
        out.append(Arrangement(name, machine, res, attainment(res, slos)))
    return out


@dataclass(frozen=True)
class TenantFigures:
    offered: int
    served: int
    met_share: float
    goodput_rps: float
    served_rps: float
    tokens_per_s: float  # prompt + output tokens of served requests per second
    ttft_p99: float  # served requests, seconds
    itl_p99: float  # per-request mean time per output token, seconds
    max_gap: float  # the longest pause any served request saw, seconds


def figures(arr: Arrangement) -> dict[str, TenantFigures]:
    """Per tenant, from the records (wall clock in every arrangement)."""
    res = arr.result
    duration = max(res.virtual_s, 1e-9)
    out = {}
    for t in res.tenants():
        mine = [r for r in res.records if r.tenant == t]
        served = [r for r in mine if r.outcome in SERVED]
        ttft = [r.ttft for r in served if r.ttft is not None]
        itl = [r.itl for r in served if r.itl is not None]
        a = arr.attainment.get(t)
        out[t] = TenantFigures(
            offered=len(mine), served=len(served),
            met_share=a.share if a else float("nan"),
            goodput_rps=a.goodput_rps if a else float("nan"),
            served_rps=len(served) / duration,
            tokens_per_s=sum(r.prompt_len + r.output_len for r in served) / duration,
            ttft_p99=float(np.percentile(ttft, 99)) if ttft else float("nan"),
            itl_p99=float(np.percentile(itl, 99)) if itl else float("nan"),
            max_gap=max((r.max_gap for r in served), default=float("nan")),
        )  # fmt: skip
    return out


def meets(arr: Arrangement, target: float) -> bool:
    """Every tenant's SLO attainment at least `target`."""
    return all(a.share >= target for a in arr.attainment.values())


def table(runs: Sequence[Arrangement], load: float | None = None) -> str:
    head = (f"{'arrangement':<12}{'tenant':<7}{'offered':>8}{'served':>7}{'met':>7}"
            f"{'goodput':>9}{'served':>8}{'tokens/s':>10}{'TTFT99':>8}"
            f"{'ITL99':>7}{'maxgap':>8}")  # fmt: skip
    sub = (f"{'':<12}{'':<7}{'':>8}{'':>7}{'':>7}{'req/s':>9}{'req/s':>8}{'':>10}{'s':>8}"
           f"{'ms':>7}{'ms':>8}")  # fmt: skip
    lines = [] if load is None else [f"load {load:g}x:"]
    lines += [head, sub, "-" * len(head)]
    for arr in runs:
        figs = figures(arr)
        for t, f in figs.items():
            lines.append(
                f"{arr.name:<12}{t:<7}{f.offered:>8}{f.served:>7}{f.met_share:>7.1%}"
                f"{f.goodput_rps:>9.2f}{f.served_rps:>8.2f}{f.tokens_per_s:>10,.0f}"
                f"{f.ttft_p99:>8.2f}{f.itl_p99 * 1e3:>7.0f}{f.max_gap * 1e3:>8.0f}"
            )
        total = sum(f.tokens_per_s for f in figs.values())
        lines.append(f"{'':<12}{'(all)':<7} {total:,.0f} tokens/s over "
                     f"{arr.result.virtual_s:.1f} s; {arr.machine}; "
                     f"{arr.result.step_errors} OOM")  # fmt: skip
    return "\n".join(lines)


@dataclass(frozen=True)
class Limit:
    """The highest load an arrangement was seen to hold: every tenant at its
    target there. `missed`: the lowest load above it seen to miss (None: the
    grid's top held, the limit may be higher)."""

    name: str
    load: float | None  # None: even the grid's lowest load missed
    run: Arrangement | None = field(repr=False)  # the run at `load`
    missed: float | None


@dataclass
class Scan:
    """Every arrangement at every load of the grid, and where each stops
    meeting its SLOs (bisected between grid points)."""

    loads: list[float]
    runs: dict[float, list[Arrangement]]
    target: float
    limits: dict[str, Limit]

    def max_load(self, name: str) -> float | None:
        """The highest load of the grid below which (it included) every load met
        every tenant's target in arrangement `name`; None if the first missed."""
        best = None
        for load in self.loads:
            arr = next(a for a in self.runs[load] if a.name == name)
            if not meets(arr, self.target):
                break
            best = load
        return best


def scan(workload: MixWorkload, loads: Iterable[float], slos: Mapping[str, Slo], *,
         target: float = DEFAULT_TARGET, refine: int = 4, **kw: Any) -> Scan:  # fmt: skip
    """`arrange` at every load of `loads`, then per arrangement `refine`
    bisection steps between its highest passing grid load and the next (which
    assumes attainment falls with load between two grid points; a grid step
    of 0.5 and 4 steps find the limit within 0.03x)."""
    loads = sorted(set(loads))
    if not loads or not all(0 < x < math.inf for x in loads):  # inf drew arrivals forever
        raise ValueError(f"loads must be finite and > 0, got {loads}")
    if not (0 < target <= 1):
        raise ValueError(f"the attainment target must be in (0, 1], got {target!r}")
    tenants = workload.tenants()
    runs = {load: arrange(workload.arrivals(load), tenants, slos, **kw) for load in loads}
    limits = {}
    for arr in runs[loads[0]]:
        name = arr.name
        sc = Scan(loads, runs, target, {})
        lo = sc.max_load(name)
        run = None if lo is None else next(a for a in runs[lo] if a.name == name)
        higher = [x for x in loads if lo is not None and x > lo]
        hi = higher[0] if higher else None
        if lo is not None and hi is not None:
            for _ in range(refine):
                mid = (lo + hi) / 2
                r = arrange(workload.arrivals(mid), tenants, slos,
                            **{**kw, "which": [name]})[0]  # fmt: skip
                if meets(r, target):
                    lo, run = mid, r
                else:
                    hi = mid
        limits[name] = Limit(name, lo, run, hi)
    return Scan(loads, runs, target, limits)


def summary(sc: Scan) -> list[str]:
    """The gain of mixing: each arrangement's highest load meeting every
    tenant's target (bisected), the throughput it served there, and each
    mixing arrangement's ratio to each separating one."""
    lines = [f"highest load meeting every tenant's SLO attainment >= {sc.target:.0%} "
             f"(grid {', '.join(f'{x:g}' for x in sc.loads)}, bisected; one seed):"]  # fmt: skip
    names = list(sc.limits)
    for name, lim in sc.limits.items():
        if lim.load is None or lim.run is None:
            lines.append(f"  {name:<9} none (misses at {sc.loads[0]:g}x already)")
            continue
        figs = figures(lim.run)
        per = ", ".join(f"{t} {f.tokens_per_s:,.0f}" for t, f in figs.items())
        bound = f"misses at {lim.missed:.3g}x" if lim.missed else "the grid's top: may hold more"
        lines.append(f"  {name:<9} {lim.load:.3g}x ({bound}): served "
                     f"{sum(f.tokens_per_s for f in figs.values()):,.0f} tokens/s "
                     f"(prompt + output; {per})")  # fmt: skip
    for mixed in [n for n in names if n in MIXING]:
        t = sc.limits[mixed].load
        for other in [n for n in names if n not in MIXING]:
            o = sc.limits[other].load
            if t is None:
                lines.append(f"  {mixed} vs {other}: {mixed} misses at the grid's lowest "
                             "load, no gain measured")  # fmt: skip
            elif o is None:
                lines.append(f"  {mixed} vs {other}: {mixed} holds {t:.3g}x, {other} not even "
                             f"{sc.loads[0]:g}x")  # fmt: skip
            else:
                top = "" if sc.limits[mixed].missed else " (at the grid's top: may be more)"
                lines.append(f"  {mixed} vs {other}: {t / o:.2f}x the load "
                             f"({t:.3g} / {o:.3g}){top}")  # fmt: skip
    return lines
