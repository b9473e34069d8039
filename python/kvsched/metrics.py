"""Prometheus exposition of a Scheduler's counters.

`SchedulerCollector` reads `Scheduler.stats()` when Prometheus scrapes, and only
then: the serving loop does no per-request Python work for metrics. Register it
with a prometheus_client registry::

    from prometheus_client import REGISTRY, start_http_server
    collector = kvsched.metrics.SchedulerCollector(sched, model={"name": "llama-3-8b",
                                                                 "checksum": "ab12..."})
    REGISTRY.register(collector)
    start_http_server(9400)

Every metric is prefixed `kvsched_`; per-tenant ones carry a `tenant` label.
The engine reports what only it knows with `record_recompiles(n)`.

With `vllm_model_name`, the collector also exports, from the same snapshot, the
gauges that routers scrape from vLLM by default (the Gateway API Inference
Extension's endpoint picker, llm-d's inference scheduler), under vLLM's names
and with their meaning: `vllm:num_requests_waiting` (admitted, not running),
`vllm:num_requests_running` (sequences in the running set) and
`vllm:kv_cache_usage_perc` (a fraction 0-1, despite the name: pages referenced
by a request over allocatable pages; cached pages nobody references count as
free, as in vLLM; also as `vllm:gpu_cache_usage_perc`, the older name early
endpoint pickers read), each labelled `model_name` and `engine` ("0"), and
`vllm:cache_config_info` (value 1; labels `block_size`, `num_gpu_blocks`,
`enable_prefix_caching`, `engine`). What admission has promised beyond the
pages in use (kvsched reserves each request's final length) is
`kvsched_pool_committed_blocks`, which no router reads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvsched._core import LATENCY_BUCKETS, REJECT_REASONS, Scheduler

LIFECYCLE_STATES = ("cold", "warming", "ready", "draining", "drained")

# (stats key, metric name, help) of the per-tenant latency histograms.
TENANT_HISTOGRAMS = (
    ("queue_time", "queue_time_seconds", "Submit to first entering the running set."),
    ("ttft", "ttft_seconds", "Submit to first generated token."),
    ("inter_token", "inter_token_seconds", "Between consecutive tokens of a request."),
    ("e2e", "e2e_seconds", "Submit to finish."),
)

# (stats key, metric name, help) of the per-tenant counters.
TENANT_COUNTERS = (
    ("admitted", "requests_admitted", "Requests admitted."),
    ("finished", "requests_finished", "Requests finished (max_tokens or a stop token)."),
    ("cancelled", "requests_cancelled", "Requests cancelled or handed back by a drain."),
    ("tokens_in", "tokens_in", "Prompt tokens of admitted requests."),
    ("tokens_out", "tokens_out", "Generated tokens."),
    ("prefill_tokens", "prefill_tokens", "Tokens run through prefill (recomputes included)."),
    ("preemptions", "preemptions", "Times one of the tenant's sequences was preempted."),
    # Sum over tenants for the total: one name, one family.
)

# (stats key, help) of the per-tenant gauges.
TENANT_GAUGES = (
    ("reserved_blocks", "KV blocks reserved by the tenant's live requests."),
    ("used_blocks", "KV pages its live requests hold (a shared page once per request)."),
    ("shared_blocks", "Pages its requests share among themselves (held once)."),
    ("live_requests", "Admitted, unfinished requests."),
    ("running", "Sequences in the running set."),
    ("waiting", "Admitted requests not running."),
)

PREFIX_COUNTERS = (
    ("query_blocks", "Full prompt blocks looked up in the prefix cache."),
    ("hit_blocks", "Prompt blocks served from the prefix cache."),
    ("query_tokens", "Prompt tokens of the requests looked up."),
    ("hit_tokens", "Prompt tokens served from the prefix cache."),
)

POOL_GAUGES = (
    ("total", "Allocatable KV pages."),
    ("free", "Pages on the free list."),
    ("used", "Pages with at least one reference."),
    ("evictable", "Cached pages nobody references (reusable)."),
    ("cached", "Pages named by the prefix cache."),
    ("shared", "Pages with two or more references."),
    ("usable", "Pages admission may promise (total less the overhead reserve)."),
    ("reserved", "Blocks reserved by live requests."),
    ("committed", "Blocks admission has promised (reservations and unused floors)."),
)


def _histogram(name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=labels)


def _buckets(h: Mapping[str, Any]) -> list[tuple[str, float]]:
    bounds = [repr(float(b)) for b in LATENCY_BUCKETS] + ["+Inf"]
    return list(zip(bounds, (float(c) for c in h["buckets"]), strict=True))


class SchedulerCollector(Collector):
    """A prometheus_client collector over one Scheduler.

    `model` (name, checksum, ...) is exported as `kvsched_model_info` so the
    model version behind the numbers is pinned and visible.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        model: Mapping[str, str] | None = None,
        prefix: str = "kvsched",
        vllm_model_name: str | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.model = dict(model or {})
        self.prefix = prefix
        self.vllm_model_name = vllm_model_name
        self._recompiles = 0
        self._lock = threading.Lock()

    def record_recompiles(self, n: int = 1) -> None:
        """The engine saw `n` more XLA compilations after warmup."""
        if n < 0:
            raise ValueError("recompiles only grow")
        with self._lock:
            self._recompiles += n

    def describe(self) -> list[Metric]:
        return []  # collected fresh at each scrape; nothing to pre-register

    def collect(self) -> Iterator[Metric]:
        st = self.scheduler.stats()
        stats: Mapping[str, Any] = st
        p = self.prefix
        # The stats' TypedDicts read as Mappings: the keys come from the tables above.
        tenants: Mapping[str, Mapping[str, Any]] = st["tenants"]

        for key, name, doc in TENANT_COUNTERS:
            c = CounterMetricFamily(f"{p}_{name}", doc, labels=["tenant"])
            for t, ts in tenants.items():
                c.add_metric([t], ts[key])
            yield c
        rej = CounterMetricFamily(
            f"{p}_requests_rejected", "Requests refused, by tenant and reason.",
            labels=["tenant", "reason"],
        )  # fmt: skip
        for t, ts in tenants.items():
            for reason in REJECT_REASONS:
                rej.add_metric([t, reason], ts["rejected"][reason])
        yield rej
        rej_all = CounterMetricFamily(
            f"{p}_rejected",
            "Requests refused since start, all tenants (unknown and removed ones included).",
            labels=["reason"],
        )
        for reason in REJECT_REASONS:
            rej_all.add_metric([reason], st["rejected"][reason])
        yield rej_all

        for key, doc in TENANT_GAUGES:
            g = GaugeMetricFamily(f"{p}_tenant_{key}", doc, labels=["tenant"])
            for t, ts in tenants.items():
                g.add_metric([t], ts[key])
            yield g
        for key, doc in PREFIX_COUNTERS:
            c = CounterMetricFamily(f"{p}_prefix_cache_{key}", doc, labels=["tenant"])
            for t, ts in tenants.items():
                c.add_metric([t], ts["prefix_cache"][key])
            yield c
        for key, name, doc in TENANT_HISTOGRAMS:
            h = _histogram(f"{p}_{name}", doc, ["tenant"])
            for t, ts in tenants.items():
                h.add_metric([t], _buckets(ts[key]), ts[key]["sum"])
            yield h

        pool: Mapping[str, Any] = st["pool"]
        for key, doc in POOL_GAUGES:
            yield GaugeMetricFamily(f"{p}_pool_{key}_blocks", doc, value=pool[key])
        yield GaugeMetricFamily(
            f"{p}_pool_utilization", "Referenced pages / allocatable pages.",
            value=pool["used"] / pool["total"],
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{p}_prefix_cache_evictions", "Cached pages taken back for reuse.",
            value=pool["evictions"],
        )  # fmt: skip

        lad = st["ladder"]
        yield GaugeMetricFamily(
            f"{p}_ladder_level", "Degradation ladder rungs engaged (0: none).", value=lad["level"]
        )
        secs = CounterMetricFamily(
            f"{p}_ladder_seconds", "Seconds spent at each ladder level.", labels=["level"]
        )
        for level, s in enumerate(lad["seconds_at_level"]):
            secs.add_metric([str(level)], s)
        yield secs
        climbs = CounterMetricFamily(
            f"{p}_ladder_climbs", "Times each rung engaged.", labels=["rung", "action"]
        )
        for i, r in enumerate(lad["rungs"]):
            climbs.add_metric([str(i), r["action"]], r["climbs"])
        yield climbs

        yield CounterMetricFamily(f"{p}_steps", "Steps planned.", value=st["steps"])
        yield CounterMetricFamily(
            f"{p}_displaced",
            "Admitted requests that gave their place to a higher tier's request "
            "(ended with finish reason shed).",
            value=st["displaced"],
        )  # fmt: skip
        gap = _histogram(
            f"{p}_step_gap_seconds",
            "Seconds between consecutive step() calls; a long gap is a starved host.",
            [],
        )
        gap.add_metric([], _buckets(st["step_gap"]), st["step_gap"]["sum"])
        yield gap
        for key, doc in (
            ("live_requests", "Admitted, unfinished requests."),
            ("running", "Sequences in the running set."),
            ("waiting", "Admitted requests not running."),
        ):
            yield GaugeMetricFamily(f"{p}_{key}", doc, value=stats[key])
        life = GaugeMetricFamily(
            f"{p}_lifecycle", "1 for the scheduler's lifecycle state.", labels=["state"]
        )
        for state in LIFECYCLE_STATES:
            life.add_metric([state], 1.0 if st["lifecycle"] == state else 0.0)
        yield life
        with self._lock:
            recompiles = self._recompiles
        yield CounterMetricFamily(
            f"{p}_recompiles", "XLA compilations after warmup, as the engine reports them.",
            value=recompiles,
        )  # fmt: skip
        if self.model:
            info = GaugeMetricFamily(
                f"{p}_model_info", "The model served (name, weights checksum).",
                labels=sorted(self.model),
            )  # fmt: skip
            info.add_metric([self.model[k] for k in sorted(self.model)], 1.0)
            yield info
        if self.vllm_model_name is not None:
            yield from self._vllm(st)

    def _vllm(self, st: Mapping[str, Any]) -> Iterator[Metric]:
        """vLLM's names for what routers read (see the module), from stats `st`."""
        labels, values = ["model_name", "engine"], [str(self.vllm_model_name), "0"]
        pool: Mapping[str, Any] = st["pool"]
        usage = pool["used"] / pool["total"]
        for name, doc, value in (
            ("num_requests_waiting", "Admitted requests not running (vLLM's name).",
             st["waiting"]),
            ("num_requests_running", "Sequences in the running set (vLLM's name).",
             st["running"]),
            ("kv_cache_usage_perc",
             "KV-cache usage as a fraction 0-1 (1 is 100%): pages referenced / allocatable "
             "pages (vLLM's name).", usage),
            ("gpu_cache_usage_perc",
             "The same as vllm:kv_cache_usage_perc, under the older name the Gateway API "
             "Inference Extension's first endpoint pickers read.", usage),
        ):  # fmt: skip
            g = GaugeMetricFamily(f"vllm:{name}", doc, labels=labels)
            g.add_metric(values, value)
            yield g
        cfg = self.scheduler.config
        info = {"block_size": str(cfg.block_size), "num_gpu_blocks": str(cfg.num_blocks),
                "enable_prefix_caching": str(cfg.prefix_caching), "engine": "0"}  # fmt: skip
        g = GaugeMetricFamily(
            "vllm:cache_config_info", "The KV cache's configuration (vLLM's name).",
            labels=list(info),
        )  # fmt: skip
        g.add_metric(list(info.values()), 1.0)
        yield g


class EngineLoopCollector(Collector):
    """The serving loop's own time (kvsched.serve.AsyncEngine), read at scrape:
    steps, seconds inside engine steps, and of those seconds the model's. The
    difference is what scheduling, detokenization and Python cost per step."""

    def __init__(self, loop: Any) -> None:
        self._loop = loop

    def collect(self) -> Iterator[Metric]:
        loop = self._loop
        yield CounterMetricFamily(
            "kvsched_engine_steps", "Engine steps run by the loop.", value=loop.steps
        )
        yield CounterMetricFamily(
            "kvsched_engine_step_seconds", "Wall seconds inside engine steps.", value=loop.busy_s
        )
        yield CounterMetricFamily(
            "kvsched_engine_model_seconds",
            "Of the step seconds, those in the jitted model step and sampling.",
            value=loop.model_s,
        )
