"""Workloads for the simulator: the bundled traces turned into arrivals (with a
time scale and a rule assigning requests to tenants), any trace (`from_trace`,
with arrival times of its own or drawn at a rate: `arrival_times`) and
synthetic mixes."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from kvsched.sim.simulator import Arrival
from kvsched.sim.traces import (
    HASH_BLOCK,
    AzureRequest,
    MooncakeRequest,
    TraceRequest,
    hashed_prompt,
    mooncake_prompt,
)

VOCAB = 32000


def scale_time(arrivals: list[Arrival], time_scale: float) -> list[Arrival]:
    """The same requests with arrival times multiplied by `time_scale` (< 1: the
    same work in less time, more load)."""
    return [Arrival(a.at * time_scale, a.tenant, a.prompt, a.max_tokens) for a in arrivals]


def by_length(threshold: int = 4096, short: str = "interactive", long: str = "batch"):
    """A tenant rule: prompts longer than `threshold` tokens go to `long`."""
    return lambda n_prompt, i: long if n_prompt > threshold else short


def round_robin(names: list[str]):
    return lambda n_prompt, i: names[i % len(names)]


def azure(
    reqs: list[AzureRequest],
    *,
    tenant: Callable[[int, int], str] | None = None,
    time_scale: float = 1.0,
    max_prompt: int | None = None,
    seed: int = 0,
) -> list[Arrival]:
    """Arrivals from the Azure trace: random prompt tokens of each request's
    context length (the trace has no content), its generated tokens as
    max_tokens. `time_scale` < 1 compresses time (more load). Tenants: `by_length()`
    unless given."""
    tenant = tenant or by_length()
    rng = np.random.default_rng(seed)
    out = []
    for i, r in enumerate(reqs):
        n = r.context_tokens if max_prompt is None else min(r.context_tokens, max_prompt)
        n = max(1, n)
        prompt = rng.integers(0, VOCAB, n, dtype=np.int32)
        out.append(
            Arrival(r.arrival * time_scale, tenant(n, i), prompt, max(1, r.generated_tokens))
        )
    return out


def mooncake(
    reqs: list[MooncakeRequest],
    *,
    tenant: Callable[[int, int], str] | None = None,
    time_scale: float = 1.0,
) -> list[Arrival]:
    """Arrivals from the Mooncake trace, prompts built from its hash ids (equal
    ids, equal tokens: the prefix cache sees the trace's real sharing). One
    tenant, "mooncake", unless a rule is given."""
    tenant = tenant or round_robin(["mooncake"])
    return [
        Arrival(
            r.arrival * time_scale,
            tenant(r.input_length, i),
            mooncake_prompt(r),
            max(1, r.output_length),
        )  # fmt: skip
        for i, r in enumerate(reqs)
    ]


def prefill_vs_decode(
    *,
    seconds: float = 20.0,
    long_prompt: int = 30_000,
    long_rate: float = 0.2,
    chat_rate: float = 4.0,
    chat_prompt: int = 200,
    chat_output: int = 200,
    seed: int = 0,
) -> list[Arrival]:
    """A prefill-heavy tenant (`docs`: long prompts, short answers) next to a
    decode-heavy one (`chat`: short prompts, long answers), Poisson arrivals."""
    rng = np.random.default_rng(seed)
    out = []
    mix = (("docs", long_rate, long_prompt, 16), ("chat", chat_rate, chat_prompt, chat_output))
    for tenant, rate, prompt, output in mix:
        t = 0.0
        while True:
            t += rng.exponential(1.0 / rate)
            if t >= seconds:
                break
            out.append(Arrival(t, tenant, rng.integers(0, VOCAB, prompt, dtype=np.int32), output))
    out.sort(key=lambda a: a.at)
    return out


def burst(
    *,
    seconds: float = 30.0,
    base_rate: float = 2.0,
    burst_factor: float = 10.0,
    burst: tuple[float, float] = (10.0, 20.0),
    gold_rate: float = 1.0,
    prompt: int = 512,
    output: int = 128,
    seed: int = 0,
) -> list[Arrival]:
    """A tier-0 tenant (`gold`) at a steady rate and a tier-1 tenant (`bulk`) at
    `base_rate`, `burst_factor` times that during `burst`."""
    rng = np.random.default_rng(seed)
    out = []
    t = 0.0
    while t < seconds:
        t += rng.exponential(1.0 / gold_rate)
        out.append(Arrival(t, "gold", rng.integers(0, VOCAB, prompt // 2, dtype=np.int32), 64))
    t = 0.0
    while t < seconds:
        rate = base_rate * (burst_factor if burst[0] <= t < burst[1] else 1.0)
        t += rng.exponential(1.0 / rate)
        out.append(Arrival(t, "bulk", rng.integers(0, VOCAB, prompt, dtype=np.int32), output))
    out = [a for a in out if a.at < seconds]
    out.sort(key=lambda a: a.at)
    return out


def arrival_times(n: int, rate: float, *, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """`n` arrival times (seconds, increasing) at `rate` requests/s on average:
    gamma-distributed gaps whose coefficient of variation is `burstiness`
    (1: exponential gaps, a Poisson process; > 1 burstier; < 1 more regular).
    The first request arrives after one gap."""
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a number of requests/s > 0, got {rate!r}")
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be a coefficient of variation > 0, got {burstiness!r}")
    shape = 1.0 / burstiness**2  # gamma(k, theta): mean k theta, CV 1 / sqrt(k)
    gaps = np.random.default_rng(seed).gamma(shape, 1.0 / (rate * shape), n)
    return np.cumsum(gaps)


def from_trace(
    reqs: list[TraceRequest],
    *,
    rate: float | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
    time_scale: float = 1.0,
    hash_block: int = HASH_BLOCK,
) -> list[Arrival]:
    """Arrivals from a generic trace (`traces.read_requests`). Arrival times are
    the trace's own, or, when `rate` is given, drawn by `arrival_times` (the
    trace's own are then ignored; a trace without them needs `rate`); then
    multiplied by `time_scale`. A request with hash ids gets `hashed_prompt`
    tokens (shared ids, shared prefix), the others random tokens (seeded)."""
    if not reqs:
        return []
    if rate is not None:
        at = arrival_times(len(reqs), rate, burstiness=burstiness, seed=seed)
    elif any(r.arrival_s is None for r in reqs):
        raise ValueError(
            "the trace has no arrival_s: give an arrival rate (rate=, --rate: requests/s)"
        )
    else:
        at = np.array([r.arrival_s for r in reqs], dtype=float)
    rng = np.random.default_rng(seed)
    out = []
    for t, r in zip(at, reqs, strict=True):
        if r.hash_ids is not None:
            prompt = hashed_prompt(r.hash_ids, r.prompt_tokens, hash_block)
        else:
            prompt = rng.integers(0, VOCAB, r.prompt_tokens, dtype=np.int32)
        out.append(Arrival(float(t) * time_scale, r.tenant, prompt, r.output_tokens))
    return out
