"""Service-level objectives per tenant, and how well a simulated run met them.

An SLO is up to three targets, each optional: time to first token (`ttft`),
inter-token latency (`itl`: the request's mean gap between output tokens, i.e.
time per output token) and the longest single pause between two of its tokens
(`gap`: the stall a long prefill in the same step causes, which a mean hides).
A request *meets* its tenant's SLO when it was served in full (not refused,
displaced, aborted or capped by the ladder) within every target given. The
*attainment* is the share of offered requests that met it: a refusal is a miss,
never left out. *Goodput* is what met it, per second of the run.

Targets are written as on the command line, one per tenant, `*` for every
tenant not named: `interactive:ttft=1,itl=0.1`, `chat:gap=0.5`, `*:ttft=5`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvsched.sim.simulator import RequestRecord, SimResult

ANY = "*"
# Why a request missed, in the order the binding constraint is reported.
CAUSES = ("refused", "capped", "ttft", "itl", "gap")
TARGETS = ("ttft", "itl", "gap")


class SloError(ValueError):
    """An SLO written wrong; the message names the part and the expected form."""


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None  # time to first token, seconds
    itl_s: float | None = None  # mean inter-token latency, seconds per token
    gap_s: float | None = None  # longest pause between two output tokens, seconds

    def targets(self) -> tuple[tuple[str, float | None], ...]:
        return (("ttft", self.ttft_s), ("itl", self.itl_s), ("gap", self.gap_s))

    def __post_init__(self) -> None:
        for name, v in self.targets():
            if v is not None and not (math.isfinite(v) and v > 0):
                raise SloError(f"{name} must be a finite number of seconds > 0, got {v!r}")
        if all(v is None for _, v in self.targets()):
            raise SloError("an SLO needs at least one of ttft=, itl=, gap= (seconds)")

    def miss(self, rec: RequestRecord) -> str | None:
        """Why `rec` missed this SLO (one of CAUSES), or None when it met it."""
        if rec.outcome == "capped":
            return "capped"
        if rec.outcome != "finished":
            return "refused"  # rejected, displaced, aborted or never submitted
        if self.ttft_s is not None and (rec.ttft is None or rec.ttft > self.ttft_s):
            return "ttft"
        itl = rec.itl  # None for a single output token: nothing to pace
        if self.itl_s is not None and itl is not None and itl > self.itl_s:
            return "itl"
        if self.gap_s is not None and rec.max_gap > self.gap_s:
            return "gap"
        return None

    def __str__(self) -> str:
        return ",".join(f"{k}={v:g}" for k, v in self.targets() if v is not None)


def parse_slo(spec: str) -> tuple[str, Slo]:
    """`TENANT:ttft=SECONDS,itl=SECONDS,gap=SECONDS` (any target may be left
    out; TENANT `*` for every tenant not named) -> (tenant, Slo)."""
    tenant, sep, targets = spec.partition(":")
    tenant = tenant.strip()
    if not sep or not tenant or not targets.strip():
        raise SloError(f"SLO {spec!r}: expected TENANT:ttft=SECONDS,itl=SECONDS")
    values: dict[str, float] = {}
    for part in targets.split(","):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in TARGETS:
            raise SloError(f"SLO {spec!r}: {part.strip()!r} is not ttft=, itl= or gap=SECONDS")
        if key in values:
            raise SloError(f"SLO {spec!r}: {key} given twice")
        try:
            values[key] = float(value)
        except ValueError:
            raise SloError(f"SLO {spec!r}: {key}={value.strip()!r} is not a number") from None
    try:
        return tenant, Slo(values.get("ttft"), values.get("itl"), values.get("gap"))
    except SloError as e:
        raise SloError(f"SLO {spec!r}: {e}") from None


def parse_slos(specs: Iterable[str]) -> dict[str, Slo]:
    """Several `parse_slo` specs; a tenant given twice is an error."""
    out: dict[str, Slo] = {}
    for spec in specs:
        tenant, slo = parse_slo(spec)
        if tenant in out:
            raise SloError(f"two SLOs for tenant {tenant!r}")
        out[tenant] = slo
    return out


def check_tenants(slos: Mapping[str, Slo], tenants: Iterable[str]) -> None:
    """Refuse an SLO naming no tenant of the workload: taken silently, a typo
    judges nobody and every figure reads goodput 0."""
    names = list(dict.fromkeys(tenants))
    unknown = sorted(set(slos) - set(names) - {ANY})
    if unknown:
        raise SloError(f"SLO for {', '.join(map(repr, unknown))}, not a tenant of the "
                       f"workload (its tenants: {', '.join(names)})")  # fmt: skip


def slo_of(tenant: str, slos: Mapping[str, Slo]) -> Slo | None:
    return slos.get(tenant, slos.get(ANY))


@dataclass(frozen=True)
class Attainment:
    """How one tenant's offered requests fared against its SLO."""

    tenant: str
    slo: Slo
    offered: int
    met: int
    misses: dict[str, int]  # cause (CAUSES) -> requests
    goodput_rps: float  # requests that met the SLO, per second of the run
    goodput_tokens_per_s: float  # their output tokens, per second of the run

    @property
    def share(self) -> float:
        """Met / offered (1.0 for a tenant that offered nothing)."""
        return self.met / self.offered if self.offered else 1.0

    @property
    def binding(self) -> str | None:
        """The cause of most misses (ties in CAUSES order), None if none missed."""
        worst = max(CAUSES, key=lambda c: (self.misses.get(c, 0), -CAUSES.index(c)))
        return worst if self.misses.get(worst, 0) else None


def attainment(result: SimResult, slos: Mapping[str, Slo]) -> dict[str, Attainment]:
    """Per tenant with an SLO (named or `*`): offered, met, misses by cause and
    goodput. Tenants of `slos` that sent nothing are left out."""
    duration = max(result.virtual_s, 1e-9)
    out: dict[str, Attainment] = {}
    for tenant in result.tenants():
        slo = slo_of(tenant, slos)
        if slo is None:
            continue
        mine = [r for r in result.records if r.tenant == tenant]
        misses = dict.fromkeys(CAUSES, 0)
        met_tokens = met = 0
        for r in mine:
            cause = slo.miss(r)
            if cause is None:
                met += 1
                met_tokens += r.output_len
            else:
                misses[cause] += 1
        out[tenant] = Attainment(tenant, slo, len(mine), met, misses, met / duration,
                                 met_tokens / duration)  # fmt: skip
    return out
