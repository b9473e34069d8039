"""One scheduler knob swept at a stated load, and where its curves bend.

Two sweeps answer two planners' questions:
- `reserve` (`overhead_reserve`: the share of the pool kept out of admission):
  how close admission can run to the pool limit. More reserve, more refusals;
  less, longer queues and tails.
- `chunk` (`long_prefill_chunk`: most prompt tokens one sequence gets in one
  step; `None` = unchunked, the whole prompt at once, the step budget raised to
  the longest sequence as the `unchunked` scenario does): whether the chunk size
  hides prefill from the requests decoding beside it (their p99 and max pause).

Every point replays the same arrivals on the same engine (`setup.engine_for`);
only the knob changes. Per point: goodput under the SLOs (`slo.attainment`:
refusals are misses), and per tenant p99 TTFT (served requests), p99 and max
inter-token gap, and refusals.

The knee (`knee`) is the Kneedle idea: normalise the curve to the unit square,
draw the chord from its first point to its last, and take the point farthest
from it; when no point is at least `min_distance` (0.1 of the unit square) from
the chord, the curve is called straight and has no knee (None), which noise of
a few percent does not change. A curve whose whole range is under `min_range`
(5%) of its largest magnitude is flat and has no knee either: normalising would
blow its noise up to the full square (goodput 4.16..4.20 req/s is flat, not a
knee at the highest point).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import kvsched
from kvsched.sim import scenarios
from kvsched.sim.simulator import Arrival, SimResult, StepCost, simulate
from kvsched.sim.slo import Attainment, Slo, attainment, check_tenants

KNOBS = ("reserve", "chunk")
# The knob values swept when none are given.
DEFAULT_VALUES: dict[str, tuple[int | float | None, ...]] = {
    "reserve": (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3),
    "chunk": (128, 256, 512, 1024, 2048, 4096, 8192, None),
}
# The SLOs scored when no --slo is given, per workload. Azure at 2x: every step
# is a full 8,192-token step (~0.27 s on one H100), so an ITL target under that
# is missed at every reserve; the reserve moves refusals and TTFT, which these
# target. prefill-vs-decode: the chat tenant's longest pause catches the stall
# a long prefill causes; docs are batch work.
DEFAULT_SLOS: dict[str, tuple[str, ...]] = {
    "azure": ("interactive:ttft=2,itl=0.5", "batch:ttft=20"),
    "mooncake": ("*:ttft=5,itl=0.5",),
    "prefill-vs-decode": ("chat:ttft=1,itl=0.1,gap=0.2", "docs:ttft=10"),
    "burst": ("gold:ttft=1,itl=0.1", "bulk:ttft=10"),
}
# The distance from the chord (unit square) below which a curve is straight.
MIN_DISTANCE = 0.1
# The range, as a share of the largest magnitude, below which a curve is flat.
MIN_RANGE = 0.05


@dataclass(frozen=True)
class Knee:
    """Where a curve bends: its index, knob position, value, and its distance
    from the chord in the normalised unit square (0..~0.71)."""

    index: int
    x: float
    y: float
    distance: float


def knee(xs: Sequence[float], ys: Sequence[float], *, min_distance: float = MIN_DISTANCE,
         min_range: float = MIN_RANGE) -> Knee | None:  # fmt: skip
    """The knee of the curve (xs, ys) by the chord-distance (Kneedle) rule, or
    None: fewer than three finite points, a flat curve (range under `min_range`
    of the largest |y|), or no interior point `min_distance` or more from the
    chord. Points with a NaN or infinite value
    are left out (a p99 of nothing served). `xs` must be increasing."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} positions but {len(ys)} values")
    pts = [(i, float(x), float(y)) for i, (x, y) in enumerate(zip(xs, ys, strict=True))
           if math.isfinite(x) and math.isfinite(y)]  # fmt: skip
    if any(b[1] <= a[1] for a, b in zip(pts, pts[1:], strict=False)):
        raise ValueError("knee positions must be increasing")
    if len(pts) < 3:
        return None
    x0, x1 = pts[0][1], pts[-1][1]
    ylo, yhi = min(p[2] for p in pts), max(p[2] for p in pts)
    if yhi - ylo <= min_range * max(abs(ylo), abs(yhi)) or yhi - ylo <= 1e-12:
        return None
    norm = [((x - x0) / (x1 - x0), (y - ylo) / (yhi - ylo)) for _, x, y in pts]
    (ax, ay), (bx, by) = norm[0], norm[-1]
    length = math.hypot(bx - ax, by - ay)
    best, best_d = None, -1.0
    for k in range(1, len(norm) - 1):
        px, py = norm[k]
        d = abs((bx - ax) * (ay - py) - (ax - px) * (by - ay)) / length
        if d > best_d:
            best, best_d = k, d
    if best is None or best_d < min_distance:
        return None
    i, x, y = pts[best]
    return Knee(i, x, y, best_d)


@dataclass
class Point:
    """One knob value's run."""

    value: float | None  # the knob's value (None: unchunked)
    result: SimResult
    attainment: dict[str, Attainment]
    note: str = ""  # e.g. the step budget caps this chunk

    @cached_property
    def summary(self) -> dict[str, dict[str, Any]]:
        """The run's per-tenant summary (`SimResult.summary`), computed once."""
        return self.result.summary()

    @property
    def goodput(self) -> float:
        """Requests that met their SLO per second, all scored tenants."""
        return sum(a.goodput_rps for a in self.attainment.values())


# Per-tenant metrics: (key, label, unit, scale from the summary's seconds).
TENANT_METRICS = (
    ("ttft_p99", "p99 TTFT", "s", 1.0),
    ("itl_p99", "p99 inter-token gap", "ms", 1e3),
    ("itl_max", "max inter-token gap", "ms", 1e3),
    ("rejected", "refused", "requests", 1.0),
)


@dataclass
class Sweep:
    knob: str
    points: list[Point]
    slos: dict[str, Slo]
    load: float | None = None
    notes: list[str] = field(default_factory=list)

    def tenants(self) -> list[str]:
        return sorted({t for p in self.points for t in p.result.tenants()})

    def label(self, value: float | None) -> str:
        if value is None:
            return "unchunked"
        return f"{value:.0%}" if self.knob == "reserve" else f"{int(value):,}"

    def positions(self) -> list[float]:
        """The knob axis the knee is found on: the reserve as is; the chunk on
        log2 (128..8,192 evenly spaced), unchunked one octave past the largest."""
        if self.knob == "reserve":
            return [float(p.value or 0.0) for p in self.points]
        finite = [math.log2(p.value) for p in self.points if p.value is not None]
        past = (max(finite) + 1.0) if finite else 0.0
        return [past if p.value is None else math.log2(p.value) for p in self.points]

    def curves(self) -> dict[str, list[float]]:
        """Every curve, by name: `goodput` (req/s) and `<metric>:<tenant>` for
        TENANT_METRICS, in their display units."""
        out: dict[str, list[float]] = {"goodput": [p.goodput for p in self.points]}
        for t in self.tenants():
            for key, _, _, scale in TENANT_METRICS:
                ys = []
                for p in self.points:
                    row = p.summary.get(t)
                    if row is None:
                        ys.append(float("nan"))
                    elif key == "rejected":
                        ys.append(float(sum(row["rejected"].values())))
                    else:
                        ys.append(row[key] * scale)
                out[f"{key}:{t}"] = ys
        return out

    def knees(self) -> dict[str, Knee | None]:
        xs = self.positions()
        return {name: knee(xs, ys) for name, ys in self.curves().items()}


Config = tuple[float | None, kvsched.SchedulerConfig, str]


def configs(
    base: kvsched.SchedulerConfig, knob: str, values: Iterable[float | None]
) -> list[Config]:
    """(value, configuration, note) per knob value, every other knob of `base`
    kept. Values must be given ascending (unchunked last), each once: they are
    the curve's x axis, checked before anything runs."""
    if knob not in KNOBS:
        raise ValueError(f"unknown knob {knob!r}; known: {', '.join(KNOBS)}")
    values = list(values)
    finite = [v for v in values if v is not None]
    if (
        finite != sorted(set(finite))
        or values[: len(finite)] != finite
        or len(values) > len(finite) + 1
    ):
        raise ValueError(f"{knob} values must be ascending and distinct (unchunked last): "
                         f"{values}")  # fmt: skip
    out = []
    for v in values:
        note = ""
        if knob == "reserve":
            if v is None or not (0.0 <= v < 1.0):
                raise ValueError(f"overhead_reserve must be in [0, 1), got {v!r}")
            cfg = base.replace(overhead_reserve=float(v))
        elif v is None:
            unchunked = next(s for s in scenarios.standard(base) if s.name == "unchunked")
            cfg = base.replace(**unchunked.overrides)
        else:
            if v != int(v) or v < 1:
                raise ValueError(f"long_prefill_chunk must be a whole number >= 1, got {v!r}")
            cfg = base.replace(long_prefill_chunk=int(v))
            if v > base.max_batched_tokens:
                note = f"> step budget {base.max_batched_tokens:,}: capped by it"
        out.append((v, cfg, note))
    return out


def sweep(
    base: kvsched.SchedulerConfig,
    tenants: Iterable[kvsched.TenantConfig],
    arrivals: list[Arrival],
    cost: StepCost,
    knob: str,
    values: Iterable[float | None] | None = None,
    *,
    slos: Mapping[str, Slo],
    load: float | None = None,
) -> Sweep:
    """Replay `arrivals` once per knob value (DEFAULT_VALUES unless given)."""
    tenants = list(tenants)
    check_tenants(slos, [t.name for t in tenants])
    chosen = configs(base, knob, DEFAULT_VALUES[knob] if values is None else values)
    if len(chosen) < 1:
        raise ValueError("a sweep needs at least one knob value")
    points = []
    for v, cfg, note in chosen:
        res = simulate(cfg, tenants, arrivals, cost, name=f"{knob}={v}")
        points.append(Point(v, res, attainment(res, slos), note))
    return Sweep(knob, points, dict(slos), load)


def table(sw: Sweep) -> str:
    """One row per knob value: goodput, then per tenant SLO attainment, p99
    TTFT, p99 and max inter-token gap, refusals."""
    tenants = sw.tenants()
    head = f"{sw.knob:>10}{'goodput':>9}"
    for t in tenants:
        head += f"  | {t[:10]:<10}{'met':>6}{'TTFT99':>8}{'gap99':>7}{'max':>7}{'refused':>8}"
    sub = f"{'':>10}{'req/s':>9}" + f"  | {'':<10}{'':>6}{'s':>8}{'ms':>7}{'ms':>7}{'':>8}" * len(
        tenants
    )
    lines = [head, sub, "-" * len(head)]
    for p in sw.points:
        row = f"{sw.label(p.value):>10}{p.goodput:>9.3f}"
        summ = p.summary
        for t in tenants:
            s = summ.get(t)
            a = p.attainment.get(t)
            met = f"{a.share:.1%}" if a else "-"
            if s is None:
                row += f"  | {'':<10}{met:>6}{'-':>8}{'-':>7}{'-':>7}{'-':>8}"
                continue
            refused = sum(s["rejected"].values())
            row += (f"  | {'':<10}{met:>6}{s['ttft_p99']:>8.2f}{s['itl_p99'] * 1e3:>7.0f}"
                    f"{s['itl_max'] * 1e3:>7.0f}{refused:>8}")  # fmt: skip
        if p.note:
            row += f"  ({p.note})"
        lines.append(row)
    lines.append("met: share of offered requests that met the SLO (refusals are misses); "
                 "TTFT99 over served requests; gap: pause between two output tokens")  # fmt: skip
    return "\n".join(lines)


def knee_lines(sw: Sweep) -> list[str]:
    """The knee of every curve, goodput first, each with the metric it was found on."""
    names = {key: (label, unit) for key, label, unit, _ in TENANT_METRICS}
    curves = sw.curves()
    out = []
    for name, k in sw.knees().items():
        if name == "goodput":
            what, unit = "goodput", "req/s"
        else:
            key, tenant = name.split(":", 1)
            label, unit = names[key]
            what = f"{tenant} {label}"
        if k is None:
            ys = [y for y in curves[name] if math.isfinite(y)]
            span = f"{min(ys):.3g}..{max(ys):.3g} {unit}" if ys else "no values"
            out.append(f"  {what:<36} no knee (flat or straight; {span})")
        else:
            v = sw.points[k.index].value
            out.append(f"  {what:<36} knee at {sw.knob} {sw.label(v)}: {k.y:.3g} {unit} "
                       f"(distance {k.distance:.2f} from the chord)")  # fmt: skip
    return out


def plot_figure(sw: Sweep) -> Any:
    """Goodput, p99 TTFT, p99 and max gap and refusals against the knob, one
    panel each, every knee marked (a ring and a dotted line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sw.positions()
    curves, knees = sw.curves(), sw.knees()
    panels = [("goodput", "goodput (req/s meeting SLO)")] + [
        (key, f"{label} ({unit})") for key, label, unit, _ in TENANT_METRICS
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.0 * len(panels) + 0.8), sharex=True)
    for ax, (key, ylabel) in zip(axes, panels, strict=True):
        names = [n for n in curves if n == key or n.startswith(key + ":")]
        for n in names:
            label = n.split(":", 1)[1] if ":" in n else "all tenants"
            (line,) = ax.plot(xs, curves[n], marker=".", label=label)
            k = knees[n]
            if k is not None:
                ax.plot([k.x], [k.y], "o", ms=10, mfc="none", color=line.get_color())
                ax.axvline(k.x, ls=":", lw=0.8, color=line.get_color())
        # From 0: every metric is >= 0, and a 1% wiggle must not fill the panel.
        top = max((y for n in names for y in curves[n] if math.isfinite(y)), default=0.0)
        ax.set_ylim(0, 1.1 * top if top > 0 else 1.0)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    axes[-1].set_xticks(xs, [sw.label(p.value) for p in sw.points], rotation=45)
    axes[-1].set_xlabel(("overhead_reserve" if sw.knob == "reserve" else "long_prefill_chunk")
                        + " (ring: knee)")  # fmt: skip
    load = f" at {sw.load:g}x load" if sw.load is not None else ""
    axes[0].set_title(f"{sw.knob} sweep{load}", fontsize=9, loc="left")
    fig.tight_layout()
    return fig


def plot(sw: Sweep, out_dir: str) -> str:
    """Write `<knob>_sweep.png` to `out_dir`; its path."""
    import os

    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{sw.knob}_sweep.png")
    plot_figure(sw).savefig(path, dpi=100, bbox_inches="tight")
    plt.close("all")
    return path
