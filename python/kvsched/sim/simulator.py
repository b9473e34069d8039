"""A discrete-event simulator that drives the real kvsched.Scheduler in virtual
time. Only the engine is modelled; every admission, plan and preemption is the
scheduler's own.

The step time (all of the model in one place, `StepCost`): a fixed overhead per
step plus a roofline, max(compute, memory):
- compute = scheduled tokens x 2 x parameters / (devices x bf16 FLOP/s x MFU)
- memory  = (weight bytes + KV bytes read) / (devices x HBM bytes/s x efficiency)
where the KV read is every scheduled sequence's kv_len x KV bytes per token
(x the copies the devices store of it past the model's KV heads:
`ModelShape.kv_copies`), except in the layers of a hybrid model that attend
to less: a sliding-window layer of W reads min(kv_len, W + q_len - 1) tokens of
a sequence running q_len queries, a chunked local layer of C reads from the
chunk its first query is in (`kv_tokens_read`), as a kernel that skips what
the window excludes does.
Prefill-heavy steps come out compute-bound, decode steps bound by reading
weights and KV. Tensor parallelism over n devices splits compute and memory n
ways and adds its all-reduces, not overlapped: 2 per layer of tokens x hidden x
2 bytes, a ring moving 2(n-1)/n of that per device over the preset's
interconnect, plus a fixed latency per collective. Over several hosts
(`hosts`, `devices` on each) a TPU slice's ICI spans them (one ring over all
chips); GPUs all-reduce in three stages, each in the open (no overlap):
reduce-scatter within a host over NVLink, all-reduce of each GPU's 1/devices
share across hosts over its NIC, all-gather within the host. `kvsched calibrate`
replaces the peak x efficiency rates and the overhead by ones measured on the
engine (`StepCost.load`).

Scenarios differ only in the scheduler's configuration, except static batching,
modelled as the same engine without slot reuse: a batch starts only when the
previous one has completely finished, so the difference is attributable.
"""

from __future__ import annotations

import json
import math
import operator
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

import kvsched
from kvsched.shapes import (
    ACCELERATORS,
    CHUNKED_LOCAL,
    MODELS,
    WEIGHT_BYTES,
    Accelerator,
    ModelShape,
    parse_kind,
)


class StepCostError(ValueError):
    """A step-cost file that cannot be used: unreadable, malformed, or
    calibrated for another model than the one simulated."""


STEP_COST_FORMAT = "kvsched-step-cost/1"


def kv_tokens_read(model: ModelShape, kv_lens: np.ndarray, q_lens: np.ndarray) -> float:
    """KV tokens a step reads, counted as tokens of every layer (what
    `StepCost.memory_seconds` charges KV bytes per token for), of sequences with
    these kv_lens (cached + scheduled) and q_lens (scheduled): a full layer
    reads each sequence's kv_len, a sliding-window layer of W only what its
    queries' windows cover, min(kv_len, W + q_len - 1), a chunked local layer
    of C from the start of its first query's chunk; averaged over the layers.
    The sum of kv_lens for a model of full layers."""
    return _read(_kind_spans(model), model.layers, kv_lens, q_lens)


def _kind_spans(model: ModelShape) -> tuple[tuple[int, str, int | None], ...]:
    # (layers, kind name, span) of each distinct kind: the sum a step makes
    # runs over a model's few kinds, not its layers.
    kinds = Counter(model.layer_types)
    return tuple((n, *parse_kind(k)) for k, n in kinds.items())


def _read(
    spans: tuple[tuple[int, str, int | None], ...], layers: int, kv_lens: np.ndarray,
    q_lens: np.ndarray,
) -> float:  # fmt: skip
    kv = np.asarray(kv_lens, dtype=np.int64)
    total = 0
    for n, name, span in spans:
        if span is None:
            read = int(kv.sum())
        else:
            q = np.asarray(q_lens, dtype=np.int64)
            if name == CHUNKED_LOCAL:
                read = int((kv - (kv - q) // span * span).sum())
            else:
                read = int(np.minimum(kv, span + q - 1).sum())
        total += n * read
    return total / layers


@dataclass(frozen=True)
class StepCost:
    model: ModelShape
    accelerator: Accelerator
    devices: int = 1
    precision: str = "bf16"
    kv_dtype_bytes: float = 2.0
    mfu: float = 0.5  # share of peak FLOP/s a real step reaches
    bandwidth_efficiency: float = 0.8  # share of peak HBM bandwidth
    overhead_s: float = 0.002  # launch, sampling, host work per step
    activation_bytes: float = 2.0  # bytes per element of what an all-reduce carries (bf16)
    # Measured rates (`kvsched calibrate`): the FLOP/s and bytes/s all devices
    # together reach on a step; None: devices x the preset's peak x mfu, or x
    # bandwidth_efficiency.
    flop_rate: float | None = None
    byte_rate: float | None = None
    # The engine runs a step padded up to a multiple of this many tokens (its
    # token buckets' spacing; 1: no padding charged). A calibrated cost sets
    # the calibration engine's (kvsched calibrate: every block_size tokens).
    token_quantum: int = 1
    # Hosts the devices are spread over, `devices` on each (one tensor-parallel
    # replica over all of them).
    hosts: int = 1
    # What a calibrated cost was measured on (model, device, kernel backend, fit
    # error); None for a preset.
    calibration: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.devices, int) or self.devices < 1:
            raise StepCostError(f"devices must be an integer >= 1, got {self.devices!r}")
        if not isinstance(self.hosts, int) or self.hosts < 1:
            raise StepCostError(f"hosts must be an integer >= 1, got {self.hosts!r}")
        if self.hosts > 1 and self.accelerator.host_link_bytes_per_s == 0:
            raise StepCostError(
                f"{self.accelerator.name}: {self.hosts} hosts need the link between them "
                "(Accelerator.host_link_bytes_per_s)"
            )

        def number(v: Any) -> bool:  # a hand-edited file: "0.5", true, null
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        for name in ("flop_rate", "byte_rate"):
            v = getattr(self, name)
            if v is not None and not (number(v) and v > 0 and math.isfinite(v)):
                raise StepCostError(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("mfu", "bandwidth_efficiency"):  # shares of a peak; 0 divides by 0
            v = getattr(self, name)
            if not (number(v) and 0 < v <= 1):
                raise StepCostError(f"{name} must be a share of the peak in (0, 1], got {v!r}")
        for name in ("kv_dtype_bytes", "activation_bytes"):
            v = getattr(self, name)
            if not (number(v) and 0 < v < math.inf):
                raise StepCostError(f"{name} must be a number of bytes > 0, got {v!r}")
        if not number(self.overhead_s):
            raise StepCostError(f"overhead_s must be a number of seconds, got {self.overhead_s!r}")
        if not isinstance(self.token_quantum, int) or self.token_quantum < 1:
            raise StepCostError(
                f"token_quantum must be an integer >= 1, got {self.token_quantum!r}"
            )
        if not (self.overhead_s >= 0 and math.isfinite(self.overhead_s)):
            raise StepCostError(f"overhead_s must be >= 0, got {self.overhead_s!r}")
        if self.total_devices > 1:
            n = self.total_devices
            if self.model.hidden <= 0:
                raise StepCostError(
                    f"{self.model.name}: tensor parallelism over {n} devices needs "
                    "the model's hidden size (ModelShape.hidden) for its all-reduces"
                )
            if self.accelerator.interconnect_bytes_per_s <= 0:
                raise StepCostError(
                    f"{self.accelerator.name}: tensor parallelism over {n} devices "
                    "needs the interconnect bandwidth (Accelerator.interconnect_bytes_per_s)"
                )

    @property
    def total_devices(self) -> int:
        return self.devices * self.hosts

    @classmethod
    def preset(cls, model: str = "llama-3-8b", accelerator: str = "h100", **kw: Any) -> StepCost:
        return cls(MODELS[model], ACCELERATORS[accelerator], **kw)

    def compute_seconds(self, tokens: int) -> float:
        rate = self.flop_rate or self.total_devices * self.accelerator.bf16_flops * self.mfu
        return tokens * self.model.flops_per_token() / rate

    @cached_property
    def _spans(self) -> tuple[tuple[int, str, int | None], ...]:
        return _kind_spans(self.model)

    def kv_tokens_read(self, kv_lens: np.ndarray, q_lens: np.ndarray) -> float:
        """`kv_tokens_read` of this cost's model."""
        return _read(self._spans, self.model.layers, kv_lens, q_lens)

    def plan_kv_tokens(self, plan: kvsched.StepPlan) -> float:
        """`kv_tokens_read` of a plan's sequences (plan.kv_tokens, the sum of
        its kv_lens, when every layer is full)."""
        if len(self._spans) == 1 and self._spans[0][2] is None:
            return plan.kv_tokens
        n = len(plan)
        return self.kv_tokens_read(plan.kv_lens[:n], np.diff(plan.cu_q_lens[: n + 1]))

    def memory_seconds(self, kv_tokens_read: float) -> float:
        weights = self.model.params * WEIGHT_BYTES[self.precision]
        # Every device reads the KV of the heads it holds: past the model's KV
        # heads, some heads are held (and read) by more than one.
        copies = self.model.kv_copies(self.total_devices)
        kv = kv_tokens_read * self.model.kv_bytes_per_token(self.kv_dtype_bytes) * copies
        rate = self.byte_rate or (
            self.total_devices * self.accelerator.hbm_bytes_per_s * self.bandwidth_efficiency
        )
        return (weights + kv) / rate

    def allreduce_seconds(self, tokens: int) -> float:
        """Tensor parallelism's collectives in one step: a Megatron-style split
        all-reduces the activations twice per layer (after attention, after the
        MLP), tokens x hidden x activation_bytes each; a ring all-reduce sends
        2(n-1)/n of that per device over the interconnect, plus a fixed latency
        per collective. 0 on one device. Across hosts see `host_seconds`."""
        if self.total_devices == 1:
            return 0.0
        size = tokens * self.model.hidden * self.activation_bytes
        return 2 * self.model.layers * self.one_allreduce_seconds(size)

    def one_allreduce_seconds(self, size: float) -> float:
        """One all-reduce of `size` bytes over every device of the replica."""
        a, d, h = self.accelerator, self.devices, self.hosts
        if h == 1 or a.host_link_bytes_per_s is None:
            # One ring (a TPU slice's ICI spans its hosts).
            n = d * h
            return a.collective_latency_s + 2 * (n - 1) / n * size / a.interconnect_bytes_per_s
        # Hierarchical: reduce-scatter and all-gather within a host (together
        # one intra-host all-reduce's traffic), and between them each device's
        # 1/d share all-reduced across the hosts over its own link.
        within = 2 * (d - 1) / d * size / a.interconnect_bytes_per_s
        across = 2 * (h - 1) / h * (size / d) / a.host_link_bytes_per_s
        return 2 * a.collective_latency_s + within + across

    def host_bytes(self, tokens: int) -> float:
        """Bytes each host sends to the others in one step's all-reduces (0 on
        one host): what crosses the inter-host links."""
        if self.hosts == 1:
            return 0.0
        d, h = self.devices, self.hosts
        size = tokens * self.model.hidden * self.activation_bytes
        if self.accelerator.host_link_bytes_per_s is None:
            # One ring over all d x h chips: of its 2(n-1)/n x size per chip,
            # the ring crosses into the next host on one link of each host.
            n = d * h
            per_host = 2 * (n - 1) / n * size
        else:
            per_host = d * 2 * (h - 1) / h * (size / d)
        return 2 * self.model.layers * per_host

    def seconds(self, tokens: int, kv_tokens_read: float) -> float:
        """One step: overhead + max(compute, memory) + the all-reduces (not
        overlapped with the compute: an engine that overlaps them is faster),
        the tokens padded up to a multiple of `token_quantum`."""
        q = self.token_quantum
        tokens = -(-tokens // q) * q
        roof = max(self.compute_seconds(tokens), self.memory_seconds(kv_tokens_read))
        return self.overhead_s + roof + self.allreduce_seconds(tokens)

    # -- the step-cost file (`kvsched calibrate` writes it, `--step-cost` reads it) ----

    def to_json(self) -> dict[str, Any]:
        """The whole model as plain JSON: shapes, rates and what it was calibrated
        on; `StepCost.from_json` reads it back."""
        return {
            "format": STEP_COST_FORMAT,
            "model": asdict(self.model),
            "accelerator": asdict(self.accelerator),
            "devices": self.devices,
            "precision": self.precision,
            "kv_dtype_bytes": self.kv_dtype_bytes,
            "mfu": self.mfu,
            "bandwidth_efficiency": self.bandwidth_efficiency,
            "overhead_s": self.overhead_s,
            "activation_bytes": self.activation_bytes,
            "token_quantum": self.token_quantum,
            "hosts": self.hosts,
            "flop_rate": self.flop_rate,
            "byte_rate": self.byte_rate,
            "calibration": self.calibration,
        }

    @classmethod
    def from_json(
        cls, data: Any, *, model: str | None = None, devices: int | None = None
    ) -> StepCost:
        """A StepCost from `to_json`'s dict. With `model`, a cost of another
        model is refused (StepCostError): fitted rates describe the engine on
        the model it ran, not another one's shape; with `devices`, one of
        another device count (its rates and all-reduces are those devices')."""
        if not isinstance(data, dict) or data.get("format") != STEP_COST_FORMAT:
            raise StepCostError(f"not a step-cost file (format {STEP_COST_FORMAT!r} expected)")
        try:
            shape = ModelShape(**data["model"])
            acc = Accelerator(**data["accelerator"])
            kw = {k: data[k] for k in ("devices", "precision", "kv_dtype_bytes", "mfu",
                                       "bandwidth_efficiency", "overhead_s",
                                       "activation_bytes", "flop_rate", "byte_rate")}  # fmt: skip
            kw["token_quantum"] = data.get("token_quantum", 1)
            kw["hosts"] = data.get("hosts", 1)
        except (KeyError, TypeError, ValueError) as e:
            # ValueError: layer_types a ModelShape refuses (a CapacityError).
            raise StepCostError(f"malformed step-cost file: {e}") from None
        if kw["precision"] not in WEIGHT_BYTES:
            raise StepCostError(f"precision must be one of {sorted(WEIGHT_BYTES)}")
        if model is not None and shape.name != model:
            raise StepCostError(
                f"this step cost was calibrated for {shape.name!r}, not {model!r}: its "
                f"fitted rates are the engine's on {shape.name}; calibrate on {model} "
                "(or simulate that model)"
            )
        if devices is not None and kw["devices"] != devices:
            raise StepCostError(
                f"this step cost is for {kw['devices']} device(s), not {devices}: "
                f"its rates are those of {kw['devices']}; calibrate on {devices}"
            )
        return cls(shape, acc, calibration=data.get("calibration"), **kw)

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, model: str | None = None, devices: int | None = None
    ) -> StepCost:
        """Read a step-cost file (`save`, `kvsched calibrate --out`), refusing
        one of another model or device count (`from_json`)."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise StepCostError(f"{path}: not JSON ({e})") from None
        try:
            return cls.from_json(data, model=model, devices=devices)
        except StepCostError as e:
            raise StepCostError(f"{path}: {e}") from None


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds
    tenant: str
    prompt: np.ndarray  # int32 token ids
    max_tokens: int


@dataclass
class RequestRecord:
    tenant: str
    arrival: float
    prompt_len: int
    # finished | capped (finished, but the ladder lowered its max_tokens) |
    # rejected:<reason> (refused at submit; "displaced": admitted, then ended
    # "shed" to make room for a higher tier) | aborted:oom
    outcome: str = "pending"
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    output_len: int = 0
    asked_max_tokens: int = 0  # what the workload asked for
    max_tokens: int = 0  # what it was admitted with (less when capped)
    max_gap: float = 0.0  # the longest pause between two of its output tokens, seconds

    @property
    def tokens_short(self) -> int:
        """Output tokens a capped request did not get (0 for one not capped)."""
        return self.asked_max_tokens - self.max_tokens if self.outcome == "capped" else 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itl(self) -> float | None:
        if self.finished is None or self.first_token is None or self.output_len < 2:
            return None
        return (self.finished - self.first_token) / (self.output_len - 1)


@dataclass
class SimResult:
    name: str
    records: list[RequestRecord]
    virtual_s: float
    wall_s: float
    steps: int
    step_errors: int  # a step or commit the scheduler refused: an OOM in a real engine
    timeline: dict[str, list[float]] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)  # the scheduler's, at the end
    gaps: dict[str, list[float]] = field(default_factory=dict)  # inter-token gaps per tenant

    def tenants(self) -> list[str]:
        return sorted({r.tenant for r in self.records})

    def summary(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for t in self.tenants():
            mine = [r for r in self.records if r.tenant == t]
            done = [r for r in mine if r.outcome == "finished"]
            # Served, but short of what was asked: counted apart, not as done.
            capped = [r for r in mine if r.outcome == "capped"]
            ttft = [r.ttft for r in done + capped if r.ttft is not None]
            # Every inter-token gap (a request's mean would hide the stall a long
            # prefill causes), exact rather than from the scheduler's histogram;
            # as one array, not a list converted for each percentile (millions
            # of gaps on an hour of trace).
            gaps = np.asarray(self.gaps.get(t, []), dtype=np.float64)
            rejected: dict[str, int] = {}
            for r in mine:
                if r.outcome.startswith(("rejected:", "aborted:")):
                    reason = r.outcome.split(":", 1)[1]
                    rejected[reason] = rejected.get(reason, 0) + 1
            out[t] = {
                "requests": len(mine),
                "finished": len(done),
                "capped": len(capped),
                "tokens_short": sum(r.tokens_short for r in capped),
                "rejected": rejected,
                "ttft_p50": _pct(ttft, 50),
                "ttft_p99": _pct(ttft, 99),
                "itl_p50": _pct(gaps, 50),
                "itl_p99": _pct(gaps, 99),
                # The stall a long prefill causes shows in the tail: at a large
                # step budget p99 can hide what p99.9 and the max show.
                "itl_p999": _pct(gaps, 99.9),
                "itl_max": float(gaps.max()) if len(gaps) else float("nan"),
                "tokens_per_s": sum(r.output_len for r in done + capped)
                / max(self.virtual_s, 1e-9),
            }
        return out

    def throughput(self) -> float:
        """Output tokens per virtual second, all tenants (capped requests' too)."""
        done = [r for r in self.records if r.outcome in ("finished", "capped")]
        return sum(r.output_len for r in done) / max(self.virtual_s, 1e-9)

    def utilization(self) -> float:
        """Mean share of the pool's pages in use, over steps."""
        used = self.timeline.get("pool_used", [])
        return float(np.mean(used)) if used else 0.0

    def pool_shares(self) -> dict[str, float]:
        """Mean and peak shares of the pool's pages: `used` (holding KV now) and
        `promised` (committed to admitted requests: what reserve-mode admission
        refuses on, so a pool_full rejection can come at a low used share)."""
        out = {}
        for key in ("used", "promised"):
            xs = self.timeline.get(f"pool_{key}", [])
            out[f"{key}_mean"] = float(np.mean(xs)) if xs else 0.0
            out[f"{key}_peak"] = float(np.max(xs)) if xs else 0.0
        return out

    @property
    def preemptions(self) -> int:
        """Running requests the scheduler preempted (queued again), whole run."""
        return int(self.stats.get("preemptions", 0))

    def ttft_cdf(self, tenant: str) -> tuple[np.ndarray, np.ndarray]:
        """The TTFT CDF of `tenant` over every offered request: a request never
        served (rejected, displaced, aborted) counts as an infinite TTFT, so the
        curve ends at the served share, below 1 when any was refused."""
        mine = [r for r in self.records if r.tenant == tenant]
        ttft = np.sort([r.ttft for r in mine if r.ttft is not None and r.outcome in SERVED])
        return ttft, np.arange(1, len(ttft) + 1) / max(1, len(mine))


SERVED = ("finished", "capped")


def _pct(values: list[float] | np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def simulate(
    config: kvsched.SchedulerConfig,
    tenants: Iterable[kvsched.TenantConfig],
    arrivals: list[Arrival],
    cost: StepCost,
    *,
    name: str = "",
    static_batching: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Replay `arrivals` (sorted by time) through a Scheduler built from `config`."""
    t0 = time.perf_counter()
    sched = kvsched.Scheduler(config)
    for t in tenants:
        sched.add_tenant(t)
    records: list[RequestRecord] = []
    by_id: dict[int, RequestRecord] = {}  # live requests
    admitted: dict[int, RequestRecord] = {}  # every request id the scheduler gave
    tokens = _TokenLog()
    total_pages = config.num_blocks - 1
    timeline: dict[str, list[float]] = {
        "t": [], "pool_used": [], "pool_promised": [], "ladder_level": []
    }  # fmt: skip
    now, nxt, steps, errors = 0.0, 0, 0, 0
    held: list[tuple[Arrival, RequestRecord]] = []  # static batching: waits client-side
    n = len(arrivals)
    # The loop runs once per step (hundreds of thousands of times on an hour of
    # trace): bound methods are looked up once, and the sampled tokens (all 0)
    # are views of one zeros row as long as the longest plan.
    step, commit, take_finished = sched.step, sched.commit, sched.take_finished
    seconds, log_ids, log_at = cost.seconds, tokens.ids.append, tokens.at.append
    # A stand-in cost with `seconds` alone (a test's) is charged the plan's kv_lens.
    kv_read = getattr(cost, "plan_kv_tokens", None) or operator.attrgetter("kv_tokens")
    zeros = np.zeros(sched.plan_shape["max_seqs"], np.int32)

    def submit(a: Arrival, rec: RequestRecord, at: float) -> str | None:
        rec.asked_max_tokens = a.max_tokens
        try:
            rid = sched.submit(a.tenant, a.prompt, a.max_tokens, now=at)
            by_id[rid] = admitted[rid] = rec
            return None
        except kvsched.Rejected as e:
            rec.outcome = f"rejected:{e.reason}"
            return e.reason

    def end(finished: Iterable[kvsched.FinishedRequest], at: float) -> None:
        for f in finished:
            rec = by_id.pop(f.request_id)
            rec.finished = at
            rec.output_len = len(f.output_ids)
            rec.max_tokens = f.max_tokens
            if f.reason == "shed":
                # Displaced by a higher tier: refused after all, not served.
                rec.outcome = "rejected:displaced"
            else:
                rec.outcome = "capped" if f.max_tokens_capped else "finished"

    while nxt < n or sched.live_requests or held:
        while nxt < n and arrivals[nxt].at <= now:
            a = arrivals[nxt]
            rec = RequestRecord(a.tenant, a.at, len(a.prompt))
            records.append(rec)
            if static_batching:
                held.append((a, rec))
            else:
                submit(a, rec, now)
            nxt += 1
        if static_batching and not sched.live_requests and held:
            # A batch of what fits an empty engine; the rest waits for the next
            # one. Only a request that fits no empty engine is refused for good.
            taken = 0
            while held and taken < config.max_num_seqs:
                a, rec = held[0]
                reason = submit(a, rec, now)
                if reason in ("pool_full", "concurrency") and taken > 0:
                    rec.outcome = "pending"
                    break
                held.pop(0)
                taken += reason is None
        # Requests a submit displaced end now (their waiter is told at once).
        displaced = take_finished()
        if displaced:
            end(displaced, now)
        try:
            plan = step(now=now)
        except kvsched.KvSchedError:
            errors += 1  # in a real engine: a page it counted on is gone (an OOM)
            break
        if plan is None:
            if nxt < n:
                now = max(now, arrivals[nxt].at)
                continue
            if not sched.live_requests and not held:
                break
            now += cost.overhead_s  # live but nothing runnable: time passes
            continue
        now += seconds(plan.num_tokens, kv_read(plan))
        try:
            events = commit(plan, zeros[: len(plan)], now=now)
        except kvsched.KvSchedError:
            errors += 1
            break
        steps += 1
        # Token times are logged here and turned into first/last token, gaps
        # and max_gap once, after the run (_TokenLog.apply): the same figures
        # as a per-token Python loop, at a fraction of its cost.
        log_ids(events.request_ids)
        log_at(now)
        finished = events.finished
        if finished:
            end(finished, now)
        if not steps & 15:
            st = sched.stats(now=now)
            timeline["t"].append(now)
            timeline["pool_used"].append(st["pool"]["used"] / total_pages)
            timeline["pool_promised"].append(st["pool"]["committed"] / total_pages)
            timeline["ladder_level"].append(st["ladder"]["level"])
        if not steps & 4095:
            tokens.flush()  # one array per 4,096 steps rather than 4,096 small ones
            if progress is not None:
                progress(nxt, n)
        elif progress is not None and not steps & 255:
            progress(nxt, n)
    gaps = tokens.apply(admitted)
    if errors:
        # The engine died: whatever was live or still to come is lost, and said so.
        for rec in list(by_id.values()) + [r for _, r in held]:
            rec.outcome = "aborted:oom"
        for a in arrivals[nxt:]:
            records.append(RequestRecord(a.tenant, a.at, len(a.prompt), "aborted:oom"))
    if progress is not None:
        progress(n, n)
    return SimResult(name, records, now, time.perf_counter() - t0, steps, errors, timeline,
                     dict(sched.stats(now=now)), gaps)  # fmt: skip


class _TokenLog:
    """Every token the replay produced, as the commits reported them: per step
    its virtual time and the ids of the requests that got a token. `apply`
    derives from it what a loop over each token would have kept per request
    (first and last token time, the longest gap) and the inter-token gaps per
    tenant, in token order; the loop only appends two references a step."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []  # per step: request_ids of its tokens
        self.at: list[float] = []  # per step: its virtual time
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def flush(self) -> None:
        """Join the steps logged since the last flush into one chunk."""
        if not self.ids:
            return
        counts = np.fromiter(map(len, self.ids), np.int64, len(self.ids))
        ids = np.concatenate(self.ids)
        if len(ids) and 0 <= ids.min() and ids.max() < 2**31:
            ids = ids.astype(np.int32)  # half the memory; ids are small in practice
        self._chunks.append((ids, counts, np.asarray(self.at, np.float64)))
        # Cleared in place: the loop holds these lists' append methods.
        self.ids.clear()
        self.at.clear()

    def apply(self, admitted: dict[int, RequestRecord]) -> dict[str, list[float]]:
        """Set first_token, last_token and max_gap on the records of
        `admitted` (by request id) that got tokens; return the gaps per tenant
        (tenants in the order of their first gap, each list in token order)."""
        self.flush()
        chunks, self._chunks = self._chunks, []
        ids = np.concatenate([c[0] for c in chunks]) if chunks else np.zeros(0, np.int64)
        if not len(ids):
            return {}
        counts = np.concatenate([c[1] for c in chunks])
        step_at = np.concatenate([c[2] for c in chunks])
        # Request ids to dense indices 0..m-1, in the order `admitted` holds them.
        recs = list(admitted.values())
        keys = np.fromiter(admitted.keys(), np.int64, len(recs))
        if keys.min() >= 0 and keys.max() < 4 * len(keys) + 1024:
            lut = np.full(int(keys.max()) + 1, -1, np.int32)
            lut[keys] = np.arange(len(keys), dtype=np.int32)
            dense = lut[ids]
        else:
            by_key = np.argsort(keys)
            dense = by_key[np.searchsorted(keys, ids, sorter=by_key)]
        del ids
        # Each request's tokens together, in the order they came.
        order = _stable_argsort(dense, len(recs))
        who = dense[order]
        when = step_at[np.repeat(np.arange(len(counts), dtype=np.int32), counts)[order]]
        first = np.empty(len(who), bool)
        first[0] = True
        np.not_equal(who[1:], who[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        ends = np.append(starts[1:], len(who)) - 1
        gap = np.empty(len(when), np.float64)
        np.subtract(when[1:], when[:-1], out=gap[1:])
        gap[first] = 0.0  # a first token has no gap; a max_gap starts at 0.0
        longest = np.maximum.reduceat(gap, starts)
        for i, f, last, g in zip(who[starts].tolist(), when[starts].tolist(),
                                 when[ends].tolist(), longest.tolist(), strict=True):  # fmt: skip
            rec = recs[i]
            rec.first_token, rec.last_token, rec.max_gap = f, last, g
        del who, when
        # The gaps back in token order, per tenant.
        in_order = np.empty_like(gap)
        in_order[order] = gap
        has_gap = np.empty(len(first), bool)
        has_gap[order] = ~first
        del gap, first, order
        names: dict[str, int] = {}
        tenant_of = [names.setdefault(r.tenant, len(names)) for r in recs]
        code = np.asarray(tenant_of, np.min_scalar_type(len(names)))[dense]
        found = []
        for tenant, c in names.items():
            mine = has_gap & (code == c)
            if mine.any():
                found.append((int(np.argmax(mine)), tenant, mine))
        return {tenant: in_order[mine].tolist() for _, tenant, mine in sorted(found)}


def _stable_argsort(keys: np.ndarray, bound: int) -> np.ndarray:
    """np.argsort(keys, kind="stable") for integer keys in [0, bound): numpy
    radix-sorts 16-bit keys, much faster than its merge sort of wider ones, so
    wider keys go in two 16-bit passes (low half, then high half, both stable)."""
    if bound <= 1 << 16:
        return np.argsort(keys.astype(np.uint16), kind="stable")
    if bound > 1 << 32:
        return np.argsort(keys, kind="stable")
    low = np.argsort((keys & 0xFFFF).astype(np.uint16), kind="stable")
    high = (keys[low] >> 16).astype(np.uint16)
    return low[np.argsort(high, kind="stable")]
