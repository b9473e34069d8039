"""Scenarios compared on one workload: the same engine and step-cost model, one
scheduling choice changed at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kvsched
from kvsched.sim.simulator import Arrival, SimResult, StepCost, simulate
from kvsched.sim.slo import CAUSES, Slo, attainment


@dataclass(frozen=True)
class Scenario:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    static_batching: bool = False


def standard(base: kvsched.SchedulerConfig) -> list[Scenario]:
    """The comparisons the simulator exists for, against `base` (continuous
    batching, chunked prefill, reserve mode, no ladder)."""
    step = max(base.max_batched_tokens, base.max_seq_len)
    unchunked: dict[str, Any] = {"long_prefill_chunk": base.max_seq_len, "max_batched_tokens": step}
    configured = base.token_buckets != base.replace(token_buckets=None).token_buckets
    if configured and base.token_buckets[-1] < step:
        # Configured buckets are kept; the larger step needs one more.
        unchunked["token_buckets"] = [*base.token_buckets, step]
    return [
        Scenario("continuous"),
        Scenario("static", static_batching=True),
        Scenario("unchunked", unchunked),
        Scenario("ladder", {"ladder": "default"}),
        Scenario("overcommit", {"admission": "overcommit", "watermark_blocks": 1}),
        *[Scenario(f"reserve_{r:.0%}", {"overhead_reserve": r}) for r in (0.0, 0.05, 0.2)],
    ]


def run(
    base: kvsched.SchedulerConfig,
    tenants: Iterable[kvsched.TenantConfig],
    arrivals: list[Arrival],
    cost: StepCost,
    scenarios: Iterable[Scenario],
    *,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[SimResult]:
    tenants = list(tenants)
    out = []
    for sc in scenarios:
        # Every knob of `base` (token buckets, warmup, key...) but the overrides;
        # a scenario switching the admission mode gets that mode's watermark.
        cfg = base.replace(**sc.overrides)
        cb = (lambda d, n, name=sc.name: progress(name, d, n)) if progress else None
        out.append(simulate(cfg, tenants, arrivals, cost, name=sc.name,
                            static_batching=sc.static_batching, progress=cb))  # fmt: skip
    return out


def _itl(row: dict[str, Any]) -> str:
    keys = ("itl_p50", "itl_p99", "itl_p999", "itl_max")
    return "/".join(f"{row[k] * 1e3:.1f}" for k in keys)


def table(results: list[SimResult], slos: Mapping[str, Slo] | None = None) -> str:
    """Per scenario and tenant: TTFT and inter-token p50/p99, rejections, tokens/s;
    `capped` (short): requests the ladder's max_tokens cap cut short, apart from
    `done`, and the output tokens they did not get. Per scenario: the pool's
    used and promised shares (mean and peak) and the preemptions.

    With `slos` (`slo.parse_slos`), per tenant with an SLO: `SLO met`, the share
    of its offered requests served within it (a refusal is a miss), `goodput`,
    those requests per second of the run, and the misses by cause."""
    slo_head = f"{'SLO met':>9}{'goodput r/s':>13}" if slos else ""
    head = (f"{'scenario':<12}{'tenant':<12}{'offered':>8}{'done':>6}{'capped (short)':>16}"
            f"  {'TTFT p50/p99 (s)':>18}  {'ITL p50/p99/p99.9/max (ms)':>28}{'tok/s':>9}"
            f"{slo_head}  rejected")  # fmt: skip
    if slos:
        head += "; SLO misses"
    lines = [head, "-" * len(head)]
    for r in results:
        att = attainment(r, slos) if slos else {}
        for t, row in r.summary().items():
            capped = f"{row['capped']} ({row['tokens_short']})" if row["capped"] else "-"
            line = (
                f"{r.name:<12}{t:<12}{row['requests']:>8}{row['finished']:>6}{capped:>16}  "
                f"{row['ttft_p50']:>8.3f}/{row['ttft_p99']:<9.3f}  "
                f"{_itl(row):>28}"
                f"{row['tokens_per_s']:>9.1f}"
            )
            if slos:
                a = att.get(t)
                line += f"{'-':>9}{'-':>13}" if a is None else (
                    f"{a.share:>9.1%}{a.goodput_rps:>13.3f}")  # fmt: skip
            line += f"  {row['rejected'] or '-'}"
            if slos:
                a = att.get(t)
                missed = {c: a.misses[c] for c in CAUSES if a.misses[c]} if a else {}
                line += f"; {'no SLO' if a is None else missed or '-'}"
            lines.append(line)
        sh = r.pool_shares()
        lines.append(
            f"{'':<12}{'(all)':<12} throughput {r.throughput():.1f} tok/s, pool pages "
            f"used {sh['used_mean']:.0%} mean/{sh['used_peak']:.0%} peak, promised "
            f"{sh['promised_mean']:.0%}/{sh['promised_peak']:.0%}, {r.preemptions} preempted, "
            f"{r.steps} steps, {r.step_errors} OOM, {r.wall_s:.1f} s wall"
        )
    lines.append(
        "pool pages: used = holding KV; promised = committed to admitted requests "
        "(reserve-mode admission refuses on promised, hence pool_full at a low used share)"
    )
    if slos:
        targets = ", ".join(f"{t}: {s}" for t, s in slos.items())
        lines.append(
            f"SLOs ({targets}; seconds; itl = mean per output token, gap = longest pause): "
            "SLO met = share of offered requests served within them, refusals counted as "
            "misses; goodput = those requests per second of the run"
        )
    return "\n".join(lines)


def _panels(n: int, plt: Any, height: float = 1.6) -> tuple[Any, list[Any]]:
    """One panel per scenario, stacked, sharing the time axis."""
    fig, axes = plt.subplots(n, 1, figsize=(8, 0.8 + height * n), sharex=True, squeeze=False)
    return fig, list(axes[:, 0])


def plot_figures(results: list[SimResult]) -> dict[str, Any]:
    """The figures `plot` writes, by file name (matplotlib Figures)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    figs: dict[str, Any] = {}
    tenants = sorted({t for r in results for t in r.tenants()})
    axes: Any  # a grid here, a list of panels below
    fig, axes = plt.subplots(1, len(tenants), figsize=(5 * len(tenants) + 2, 4), squeeze=False)
    for ax, t in zip(axes[0], tenants, strict=True):
        for r in results:
            x, y = r.ttft_cdf(t)
            if len(x):
                ax.plot(x, y, label=r.name)
        ax.set(xscale="log", xlabel="TTFT (s)", ylabel="share of offered requests",
               title=f"{t} (refused = infinite TTFT)", ylim=(0, 1.02))  # fmt: skip
    seen: dict[str, Any] = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, h)
    fig.legend(list(seen.values()), list(seen), loc="center left", bbox_to_anchor=(1.0, 0.5),
               fontsize=8)  # fmt: skip
    fig.tight_layout()
    figs["ttft_cdf.png"] = fig

    fig, axes = _panels(len(results), plt)
    for ax, r in zip(axes, results, strict=True):
        ax.plot(r.timeline["t"], r.timeline["pool_used"], lw=0.8, label="used")
        ax.plot(r.timeline["t"], r.timeline.get("pool_promised", []), lw=0.8, label="promised")
        ax.set_ylim(0, 1.05)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_ylabel("share of\npool pages")
        ax.set_title(f"{r.name}: {r.preemptions} preempted", fontsize=8, loc="left")
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    axes[-1].set_xlabel("virtual time (s)")
    fig.tight_layout()
    figs["pool_use.png"] = fig

    fig, axes = _panels(len(results), plt, height=1.0)
    for ax, r in zip(axes, results, strict=True):
        levels = r.timeline["ladder_level"]
        ax.step(r.timeline["t"], levels, where="post", lw=0.8)
        # Integer ticks, also for a ladder that never climbed (all 0: the
        # automatic limits would put 0.006, 0.012... there).
        top = max(1, int(max(levels, default=0)))
        ax.set_ylim(-0.1 * top, 1.1 * top)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(top, 5)))
        ax.set_ylabel("level")
        ax.set_title(r.name, fontsize=8, loc="left")
    axes[-1].set_xlabel("virtual time (s)")
    fig.tight_layout()
    figs["ladder_level.png"] = fig
    return figs


def plot(results: list[SimResult], out_dir: str) -> list[str]:
    """PNGs: TTFT CDFs per tenant over offered requests (a refusal counts as an
    infinite TTFT: the curve ends at the served share), the pool's used and
    promised shares over time, and the ladder level (an integer) over time, one
    panel per scenario."""
    import os

    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, fig in plot_figures(results).items():
        paths.append(os.path.join(out_dir, name))
        fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close("all")
    return paths


def squeezed_window(
    arrivals: list[Arrival], start: float, seconds: float, load: float
) -> list[Arrival]:
    """The arrivals of [start, start + seconds), from 0, with time compressed
    `load` times (3: three times the load)."""
    return [
        Arrival((a.at - start) / load, a.tenant, a.prompt, a.max_tokens)
        for a in arrivals
        if start <= a.at < start + seconds
    ]


def ladder_vs_none(
    base: kvsched.SchedulerConfig,
    tenants: Iterable[kvsched.TenantConfig],
    arrivals: list[Arrival],
    cost: StepCost,
) -> tuple[SimResult, SimResult]:
    """The same workload without a ladder and with the default one."""
    off, on = run(base, tenants, arrivals, cost,
                  [Scenario("no_ladder"), Scenario("ladder", {"ladder": "default"})])  # fmt: skip
    return off, on
