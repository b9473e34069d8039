"""Scenarios compared on one workload: the same engine and step-cost model, one
scheduling choice changed at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import kvsched
from kvsched.sim.simulator import Arrival, SimResult, StepCost, simulate


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


def table(results: list[SimResult]) -> str:
    """Per scenario and tenant: TTFT and inter-token p50/p99, rejections, tokens/s;
    `capped` (short): requests the ladder's max_tokens cap cut short, apart from
    `done`, and the output tokens they did not get."""
    head = (f"{'scenario':<12}{'tenant':<12}{'offered':>8}{'done':>6}{'capped (short)':>16}"
            f"  {'TTFT p50/p99 (s)':>18}  {'ITL p50/p99 (ms)':>18}{'tok/s':>9}"
            "  rejected")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in results:
        for t, row in r.summary().items():
            capped = f"{row['capped']} ({row['tokens_short']})" if row["capped"] else "-"
            lines.append(
                f"{r.name:<12}{t:<12}{row['requests']:>8}{row['finished']:>6}{capped:>16}  "
                f"{row['ttft_p50']:>8.3f}/{row['ttft_p99']:<9.3f}  "
                f"{row['itl_p50'] * 1e3:>8.1f}/{row['itl_p99'] * 1e3:<9.1f}"
                f"{row['tokens_per_s']:>9.1f}  {row['rejected'] or '-'}"
            )
        lines.append(
            f"{'':<12}{'(all)':<12} throughput {r.throughput():.1f} tok/s, pool use "
            f"{r.utilization():.0%}, {r.steps} steps, {r.step_errors} OOM, "
            f"{r.wall_s:.1f} s wall"
        )
    return "\n".join(lines)


def plot(results: list[SimResult], out_dir: str) -> list[str]:
    """PNGs: TTFT CDFs per tenant, pool use over time, ladder level over time."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    tenants = sorted({t for r in results for t in r.tenants()})
    fig, axes = plt.subplots(1, len(tenants), figsize=(5 * len(tenants), 4), squeeze=False)
    for ax, t in zip(axes[0], tenants, strict=True):
        for r in results:
            ttft = np.sort([x.ttft for x in r.records if x.tenant == t and x.ttft is not None])
            if len(ttft):
                ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=r.name)
        ax.set(xscale="log", xlabel="TTFT (s)", ylabel="share of requests", title=t)
        ax.legend(fontsize=7)
    paths.append(os.path.join(out_dir, "ttft_cdf.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=100)
    for key, label, name in (("pool_used", "pool pages in use", "pool_use.png"),
                             ("ladder_level", "ladder level", "ladder_level.png")):  # fmt: skip
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for r in results:
            ax.plot(r.timeline["t"], r.timeline[key], label=r.name, lw=0.8)
        ax.set(xlabel="virtual time (s)", ylabel=label)
        ax.legend(fontsize=7)
        paths.append(os.path.join(out_dir, name))
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=100)
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
