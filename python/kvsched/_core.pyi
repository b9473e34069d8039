"""Type stubs for kvsched's native core, kept by hand (checked against the
module by mypy.stubtest; tests/test_stub.py checks that each docstring here is
the compiled object's own).

The dicts the core returns are TypedDicts here (type-checking only: at run time
they are plain dicts), and its fixed vocabularies (reject reasons, lifecycle
states, admission modes, finish reasons, event kinds) are Literal types.
"""

import os
from collections.abc import Iterable
from typing import Any, Final, Literal, TypedDict, final, type_check_only

import numpy as np
import numpy.typing as npt
from typing_extensions import NotRequired

# How a request ends: the one vocabulary, kvsched.FinishReason (defined once, in
# kvsched/__init__.py; FINISH_REASONS is the core's tuple of it).
from kvsched import FinishReason as _FinishReason

__all__ = [
    "SchedulerConfig",
    "TenantConfig",
    "BlockPool",
    "FinishedRequest",
    "Scheduler",
    "StepEvents",
    "StepPlan",
    "TextStreams",
    "KvSchedError",
    "Rejected",
    "InvalidRequest",
    "UnknownTenant",
    "UnknownRequest",
    "InvalidConfig",
    "TenantExists",
    "TenantInUse",
    "PoolError",
    "OutOfPages",
    "StalePlan",
    "InvalidState",
    "RestartRequired",
    "CheckpointError",
    "InternalError",
    "REJECT_REASONS",
    "FINISH_REASONS",
    "__version__",
    "build_profile",
    "NULL_PAGE",
    "LATENCY_BUCKETS",
]

# -- vocabularies ---------------------------------------------------------------

_RejectReason = Literal[
    "unknown_tenant",
    "invalid",
    "too_long",
    "tenant_budget",
    "pool_full",
    "rate_limited",
    "concurrency",
    "shed",
    "draining",
    "not_ready",
]
_Lifecycle = Literal["cold", "warming", "ready", "draining", "drained"]
_Admission = Literal["reserve", "overcommit"]
_LadderSignal = Literal["reserved_share", "queue_depth", "oldest_wait_s"]
_LadderAction = Literal["shed_lowest_tier", "cap_max_tokens", "max_running", "reject_fast"]

__version__: Final[str]
build_profile: Final[Literal["debug", "release"]]
NULL_PAGE: Final[int]
REJECT_REASONS: Final[tuple[_RejectReason, ...]]
FINISH_REASONS: Final[tuple[_FinishReason, ...]]
LATENCY_BUCKETS: Final[tuple[float, ...]]

# -- the dicts the core returns (plain dicts at run time) ------------------------

@type_check_only
class PlanShape(TypedDict):
    """Scheduler.plan_shape: the fixed dimensions of every plan."""

    max_tokens: int
    max_seqs: int
    pages_per_seq: int
    block_size: int
    pad_slot: int

@type_check_only
class Pressure(TypedDict):
    """The ladder's signals (Scheduler.pressure(), stats()["pressure"])."""

    reserved_share: float
    queue_depth: float
    oldest_wait_s: float

@type_check_only
class LadderRung(TypedDict):
    """One rung of SchedulerConfig(ladder=...); `value` for cap_max_tokens and
    max_running only."""

    signal: _LadderSignal
    engage: float
    release: float
    action: _LadderAction
    value: NotRequired[int]

@type_check_only
class LadderRungState(LadderRung):
    """A rung in stats()["ladder"]: engaged now, and how often it climbed."""

    engaged: bool
    climbs: int

@type_check_only
class LadderStats(TypedDict):
    level: int
    rungs: list[LadderRungState]
    seconds_at_level: list[float]

@type_check_only
class Histogram(TypedDict):
    """A latency histogram (seconds): `buckets` are cumulative counts over
    LATENCY_BUCKETS plus +inf; p50/p99 are None while empty."""

    count: int
    sum: float
    buckets: list[int]
    p50: float | None
    p99: float | None

@type_check_only
class RejectionCounts(TypedDict):
    """Refusals by reason (every reason of REJECT_REASONS, zero included)."""

    unknown_tenant: int
    invalid: int
    too_long: int
    tenant_budget: int
    pool_full: int
    rate_limited: int
    concurrency: int
    shed: int
    draining: int
    not_ready: int

@type_check_only
class PoolStats(TypedDict):
    num_blocks: int
    block_size: int
    total: int
    free: int
    used: int
    shared: int
    overhead_reserve: int
    usable: int
    reserved: int
    committed: int
    cached: int
    evictable: int
    evictions: int

@type_check_only
class PrefixCacheStats(TypedDict):
    query_blocks: int
    hit_blocks: int
    query_tokens: int
    hit_tokens: int
    hit_rate_blocks: float
    hit_rate_tokens: float

@type_check_only
class TenantStats(TypedDict):
    tier: int
    weight: float
    kv_floor_blocks: int
    kv_cap_blocks: int | None
    reserved_blocks: int
    used_blocks: int
    shared_blocks: int
    live_requests: int
    waiting: int
    running: int
    admitted: int
    finished: int
    cancelled: int
    rejected: RejectionCounts
    rate_tokens_available: float | None
    tokens_in: int
    tokens_out: int
    prefill_tokens: int
    preemptions: int
    prefix_cache: PrefixCacheStats
    virtual_time: float
    queue_time: Histogram
    ttft: Histogram
    inter_token: Histogram
    e2e: Histogram

@type_check_only
class SchedulerStats(TypedDict):
    """Scheduler.stats()."""

    pool: PoolStats
    tenants: dict[str, TenantStats]
    live_requests: int
    running: int
    waiting: int
    steps: int
    preemptions: int
    displaced: int
    rejected: RejectionCounts
    step_gap: Histogram
    lifecycle: _Lifecycle
    ladder: LadderStats
    pressure: Pressure
    events_dropped: int

@type_check_only
class RungEvent(TypedDict):
    """A ladder rung engaged or released (Scheduler.take_events())."""

    kind: Literal["rung_engaged", "rung_released"]
    rung: int
    action: _LadderAction
    at: float
    pressure: Pressure

@type_check_only
class MaxTokensCappedEvent(TypedDict):
    """A request admitted with max_tokens capped by the ladder
    (Scheduler.take_events())."""

    kind: Literal["max_tokens_capped"]
    request_id: int
    tenant: str
    asked: int
    admitted: int
    at: float

@type_check_only
class DisplacedEvent(TypedDict):
    """A lower-tier request ended "shed" to make room for a request of
    `by_tenant` (a higher tier) that the global `limit` would have refused
    (Scheduler.take_events()); `ran`: it had entered the running set."""

    kind: Literal["displaced"]
    request_id: int
    tenant: str
    by_tenant: str
    limit: Literal["concurrency", "pool_full"]
    ran: bool
    at: float

@type_check_only
class FinishedRecord(TypedDict):
    """A checkpoint record: a request finished since the drain began."""

    kind: Literal["finished"]
    request_id: int
    tenant: str
    reason: _FinishReason
    prompt_len: int
    output_ids: list[int]
    arrival: float
    finished: float
    cached_tokens: int

@type_check_only
class InFlightRecord(TypedDict):
    """A checkpoint record: an unfinished request, handed back at the drain
    deadline ("drain_deadline") or still live ("in_flight")."""

    kind: Literal["in_flight"]
    request_id: int
    tenant: str
    reason: Literal["in_flight", "drain_deadline"]
    prompt_ids: list[int]
    generated_ids: list[int]
    max_tokens: int
    # What the caller asked for (more than max_tokens when the ladder capped
    # it); absent in records written before it was kept: max_tokens then.
    asked_max_tokens: NotRequired[int]
    stop_token_ids: list[int]
    cache_salt_hex: str | None
    arrival: float

@type_check_only
class CheckpointCounts(TypedDict):
    """Scheduler.checkpoint(): the records written, by kind."""

    finished: int
    in_flight: int

@type_check_only
class RestoredRecords(TypedDict):
    """Scheduler.restore_records(): old id -> new id; `refused` is always empty
    (a restore is all or nothing: a refusal raises CheckpointError)."""

    restored: dict[int, int]
    refused: dict[int, _RejectReason]

@type_check_only
class RestoreResult(RestoredRecords):
    """Scheduler.restore(): restore_records() of the file's in-flight records,
    and its finished records as they are."""

    finished: list[FinishedRecord]

# -- errors ---------------------------------------------------------------------

class KvSchedError(Exception):
    """Base class of every error kvsched raises."""

class Rejected(KvSchedError):
    """A request was refused and nothing changed. `reason` says why (one of
    kvsched.REJECT_REASONS), `retry_after` when a retry makes sense (seconds: exact for
    rate_limited, the ladder's for shed, the configured hint for draining and not_ready, an
    estimate from the running requests for pool_full, tenant_budget and concurrency; None
    where the request cannot pass as things stand), `tenant` whose request it was,
    `permanent` when no change in load can lift it, only new configuration (the request
    itself, an unknown tenant, a request over its tenant's cap or rate burst): answer it
    as a client error, without a Retry-After."""

    reason: _RejectReason | None
    retry_after: float | None
    tenant: str | None
    permanent: bool

class InvalidRequest(Rejected):
    """The request can never be valid as given (empty prompt, max_tokens < 1, negative token ids,
    wrong dtype or shape). reason == 'invalid'."""

class UnknownTenant(Rejected):
    """No tenant has that name. reason == 'unknown_tenant'."""

class UnknownRequest(KvSchedError):
    """No live request has that id (never admitted, or already finished or cancelled)."""

class InvalidConfig(KvSchedError):
    """A configuration value is out of range or inconsistent; nothing was changed."""

class TenantExists(KvSchedError):
    """add_tenant was given a name that is already registered."""

class TenantInUse(KvSchedError):
    """remove_tenant was refused: the tenant still has live requests."""

class PoolError(KvSchedError):
    """A page id that is out of range, the null page 0, or not allocated (double free)."""

class OutOfPages(PoolError):
    """More pages were asked of a BlockPool than it has free; nothing was taken."""

class StalePlan(KvSchedError):
    """commit() got a plan that is not the pending one (already committed, or from another
    scheduler), or step() was called before the last plan was committed."""

class InvalidState(KvSchedError):
    """A well-formed call that is wrong for the scheduler's state: a lifecycle transition from
    the wrong state (mark_ready while draining), sampled ids that do not fit the pending plan
    (count, dtype, a negative id), a reconfigure that kept racing concurrent ones. Not a
    Rejected: no request was refused. Nothing changed."""

class RestartRequired(KvSchedError):
    """A restart-only knob (block_size, num_blocks, ...) was changed on a live object."""

class CheckpointError(KvSchedError):
    """A checkpoint that cannot be restored as a whole, and nothing was restored: a file
    that is not a regular file or is too large, a damaged file (truncated, altered,
    duplicated or reordered lines: the header, record count and checksum say which), a
    duplicated request id, or records this scheduler would refuse. `refused` is None for a
    file error, else {checkpoint request id: reason} for every refused record (a reject
    reason, or "duplicate")."""

    refused: dict[int, str] | None

class InternalError(KvSchedError):
    """An internal invariant broke: a bug in kvsched. Please report it."""

# -- classes --------------------------------------------------------------------

@final
class BlockPool:
    """A pool of `num_blocks` KV pages of `block_size` tokens; page 0 is the null
    page and is never handed out. Refcounted: `retain` adds an owner, `free`
    drops one. Batch calls take and return numpy int32 arrays and are all or
    nothing."""

    def __new__(cls, num_blocks: int, block_size: int) -> BlockPool: ...
    def allocate(self, n: int, /) -> npt.NDArray[np.int32]:
        """Take `n` free pages (one reference each); returns their ids as int32.
        Raises OutOfPages, taking nothing, when fewer than `n` are free."""
    def allocate_one(self) -> int:
        """Take one free page; returns its id."""
    def free(self, pages: npt.NDArray[np.int32], /) -> None:
        """Drop one reference on each page in `pages` (1-D int32); pages left without
        references become free. Raises PoolError and changes nothing on the null
        page, an out-of-range id or a page with no reference to drop."""
    def free_one(self, page: int, /) -> None:
        """Drop one reference on one page."""
    def retain(self, pages: npt.NDArray[np.int32], /) -> None:
        """Add one reference to each (allocated) page in `pages`. All or nothing."""
    def refcount(self, page: int, /) -> int:
        """References held on `page` (0 when free)."""
    @property
    def num_blocks(self) -> int:
        """All pages, the null page included."""
    @property
    def block_size(self) -> int:
        """Tokens per page."""
    @property
    def total(self) -> int:
        """Pages that can be handed out (num_blocks - 1)."""
    @property
    def free_pages(self) -> int:
        """Pages free now."""
    @property
    def used(self) -> int:
        """Pages with at least one reference."""
    @property
    def shared(self) -> int:
        """Pages with two or more references."""

@final
class SchedulerConfig:
    """Scheduler configuration. `num_blocks` and `block_size` are restart-only;
    every argument left out takes the core's default."""

    def __new__(
        cls,
        *,
        num_blocks: int | None = None,
        block_size: int | None = None,
        max_num_seqs: int | None = None,
        max_batched_tokens: int | None = None,
        max_seq_len: int | None = None,
        overhead_reserve: float | None = None,
        max_waiting: int | None = None,
        long_prefill_chunk: int | None = None,
        token_buckets: list[int] | None = None,
        admission: _Admission | None = None,
        watermark_blocks: int | None = None,
        preempt_lower_tiers: bool | None = None,
        full_validation: bool | None = None,
        prefix_caching: bool | None = None,
        prefix_cache_key: bytes | None = None,
        prefix_cache_partition: Literal["shared", "tenant"] | None = None,
        ladder: Literal["default"] | list[LadderRung] | None = None,
        ladder_retry_after_s: float | None = None,
        require_warmup: bool | None = None,
        retry_after_hint_s: float | None = None,
        vocab_size: int | None = None,
        kv_cache_groups: list[str] | None = None,
    ) -> SchedulerConfig: ...
    @property
    def num_blocks(self) -> int:
        """Pages in the pool, the null page 0 included. Restart-only."""
    @property
    def block_size(self) -> int:
        """Tokens per page. Restart-only."""
    @property
    def max_num_seqs(self) -> int:
        """Most sequences in one step (a plan has at most num_blocks - 1 rows)."""
    @property
    def max_batched_tokens(self) -> int:
        """Token budget of one step."""
    @property
    def max_seq_len(self) -> int:
        """Longest prompt + max_tokens admitted (a plan row holds at most
        num_blocks - 1 pages)."""
    @property
    def overhead_reserve(self) -> float:
        """Share of the pool kept out of admission."""
    @property
    def max_waiting(self) -> int:
        """Admitted requests that may wait beyond the max_num_seqs that run (the
        sum saturates: a huge value means no limit but the pool)."""
    @property
    def long_prefill_chunk(self) -> int:
        """Most prompt tokens one sequence gets in one step."""
    @property
    def token_buckets(self) -> list[int]:
        """The token buckets steps are padded to (sizes, ascending)."""
    @property
    def admission(self) -> _Admission:
        """ "reserve" (final-length reservation) or "overcommit" (with preemption)."""
    @property
    def watermark_blocks(self) -> int | None:
        """Over-commit: blocks reserved beyond the prompt (None in reserve mode;
        never more than the final length)."""
    @property
    def preempt_lower_tiers(self) -> bool:
        """Whether a waiting higher-tier request preempts a lower-tier running one."""
    @property
    def full_validation(self) -> bool:
        """Whether every plan is re-read in full after it is written (the cheap
        checks always run)."""
    @property
    def prefix_caching(self) -> bool:
        """Whether full blocks already computed for the same prefix (same
        namespace) are reused. The key is write-only: it is never shown."""
    @property
    def prefix_cache_partition(self) -> Literal["shared", "tenant"]:
        """Whose allocations may evict a tenant's cached blocks: "shared" (one
        LRU for all) or "tenant" (each tenant's own, kept within its unused
        floor; reserve admission only). Restart-only."""
    @property
    def ladder(self) -> list[LadderRung]:
        """The degradation ladder's rungs, in climbing order (empty: off). Each a
        dict: signal, engage, release, action and, for cap_max_tokens and
        max_running, value."""
    @property
    def ladder_retry_after_s(self) -> float:
        """Seconds a request shed by the ladder is told to wait."""
    @property
    def require_warmup(self) -> bool:
        """Whether the scheduler starts cold and admits only after mark_ready()."""
    @property
    def retry_after_hint_s(self) -> float:
        """Seconds of retry_after where nothing better is known: refusals while not
        ready or draining, and pool_full / tenant_budget / concurrency refusals
        before a step rate is measured. Live."""
    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size: prompt, sampled and restored token ids must
        be below it (None: only checked for being non-negative). Restart-only."""
    @property
    def kv_cache_groups(self) -> list[str]:
        """The model's KV-cache groups, group 0 first: "full", "sliding_window:W"
        or "chunked_local:C" each (group 0 is "full"). One page table per
        group per request, from the one pool; a window group holds only what
        its window reads. Restart-only."""
    def replace(self, **changes: Any) -> SchedulerConfig:
        """A copy with some arguments changed (validated like the constructor); the
        write-only prefix_cache_key is carried over unless given."""

@final
class TenantConfig:
    """A tenant: `tier` (0 most important), `kv_floor_blocks` (guaranteed),
    `kv_cap_blocks` (burst cap, None: the pool), `max_concurrent` live requests,
    a token bucket on prompt + max_tokens (`rate_tokens_per_s`, `burst_tokens`,
    default one second of rate) and a fair-share `weight`."""

    def __new__(
        cls,
        name: str,
        /,
        *,
        tier: int = 0,
        kv_floor_blocks: int = 0,
        kv_cap_blocks: int | None = None,
        max_concurrent: int | None = None,
        rate_tokens_per_s: float | None = None,
        burst_tokens: float | None = None,
        weight: float = 1.0,
        max_step_tokens: int | None = None,
        prefix_namespace: str | None = None,
    ) -> TenantConfig: ...
    @property
    def name(self) -> str:
        """The tenant's name (unique; a metric label)."""
    @property
    def tier(self) -> int:
        """0 is the most important tier."""
    @property
    def kv_floor_blocks(self) -> int:
        """Blocks guaranteed to this tenant, never lent to others' reservations
        (at most 2**31 - 1; all floors together must fit the usable pool)."""
    @property
    def kv_cap_blocks(self) -> int | None:
        """Most blocks it may hold reserved at once (None, or more than the pool:
        bounded by the pool)."""
    @property
    def max_concurrent(self) -> int | None:
        """Most live requests (None: no per-tenant limit; 0 pauses the tenant)."""
    @property
    def rate_tokens_per_s(self) -> float | None:
        """Token-bucket refill rate, in prompt + max_tokens tokens per second (at
        least 1e-6)."""
    @property
    def burst_tokens(self) -> float | None:
        """Token-bucket size (None: one second of rate)."""
    @property
    def weight(self) -> float:
        """Share of service among the tenants of one tier."""
    @property
    def max_step_tokens(self) -> int | None:
        """Largest step (tokens) this tenant's sequences are pulled into (None: no cap)."""
    @property
    def prefix_namespace(self) -> str | None:
        """Prefix-cache namespace shared with the tenants naming the same one
        (None: its own; no other tenant can hit its blocks)."""

@final
class Scheduler:
    """The KV-cache manager and scheduler. Safe to share between threads.

    Every time-dependent method takes `now` (seconds, float); left out, it is
    `time.monotonic()`. Pass it always or never. A `now` that is not finite or
    not in [0, 1e12] raises InvalidRequest and changes nothing; one up to 60 s
    behind the latest is jitter (nothing refills), further behind re-bases the
    clock and the rate buckets to it."""

    def __new__(cls, config: SchedulerConfig | None = None, /) -> Scheduler: ...
    @property
    def config(self) -> SchedulerConfig:
        """The configuration this scheduler runs with."""
    @property
    def live_requests(self) -> int:
        """Live (admitted, unfinished) requests."""
    @property
    def token_buckets(self) -> list[int]:
        """The token buckets a step is padded to: one compiled program each. The
        configured ones up to the first holding the most tokens a step can hold
        (max_batched_tokens, at most the pool's slots), which becomes that
        number when it is larger than the pool's slots."""
    @property
    def plan_shape(self) -> PlanShape:
        """Fixed plan dimensions: max_tokens (largest bucket), max_seqs (S),
        pages_per_seq (PPS), block_size, pad_slot. S and PPS are at most
        num_blocks - 1: no plan can use more."""
    def add_tenant(self, config: TenantConfig, /) -> None:
        """Register a tenant. Raises TenantExists, or InvalidConfig when its floor does
        not fit beside the other tenants' floors and reservations."""
    def update_tenant(self, config: TenantConfig, /, *, now: float | None = None) -> None:
        """Replace a tenant's configuration live (matched by name). A raised floor
        must be honourable now; a lowered cap limits only new admissions; the rate
        bucket keeps its level, clipped to the new size."""
    def remove_tenant(self, name: str, /) -> None:
        """Remove a tenant; refused with TenantInUse while it has live requests."""
    def rate_wait(self, name: str, tokens: int, /, *, now: float | None = None) -> float:
        """Seconds until `tokens` fit in tenant `name`'s rate limit: 0.0 when they
        fit now or it has no rate limit, math.inf when they never will (more than
        its burst). Changes nothing. Raises UnknownTenant."""
    def charge_rate(self, name: str, tokens: int, /, *, now: float | None = None) -> None:
        """Take `tokens` from tenant `name`'s rate limit (down to empty) for work a
        refused request cost the caller, e.g. a prompt tokenized and then found
        too long. Nothing for a tenant without a rate limit. Raises UnknownTenant."""
    def tenant(self, name: str, /) -> TenantConfig:
        """The current configuration of tenant `name`."""
    def submit(
        self,
        tenant: str,
        prompt_ids: npt.NDArray[np.int32],
        max_tokens: int,
        *,
        stop_token_ids: list[int] | None = None,
        cache_salt: str | bytes | None = None,
        now: float | None = None,
    ) -> int:
        """Admit a request and return its id, or raise Rejected (reason, retry_after).
        Admission reserves ceil((len(prompt_ids) + max_tokens) / block_size) blocks
        (over-commit: the prompt plus the watermark). `prompt_ids` is a 1-D numpy
        int32 array; sampling any of `stop_token_ids` finishes the request.

        Reserve mode looks up the prompt's longest cached prefix in the
        request's namespace (its tenant's, or the shared one the tenant names,
        mixed with `cache_salt` when given: str or bytes) and shares those pages
        at once; prefill starts after them.

        `retry_after` (seconds) of a refusal: rate_limited, the exact wait for
        the tenant's bucket; shed, the ladder's ladder_retry_after_s; draining
        and not_ready, retry_after_hint_s; pool_full, tenant_budget and
        concurrency, an estimate from what runs: the running requests holding
        the room, taken in order of the steps they have left ((max_tokens -
        generated) + (uncomputed prompt - 1) // long_prefill_chunk) until
        enough would end for this request to fit, k the steps of the last one
        taken, gives k * step period (the median gap between the last 32 pairs
        of consecutive steps that both ran something), or retry_after_hint_s
        before a step period is measured; None when even all running requests
        ending would not make room. None for refusals that can never pass
        (too_long, invalid, unknown_tenant, a request over its tenant's cap or
        burst, or, over-committed, over the pool).

        A request the scheduler's global limits (the live-request cap
        max_num_seqs + max_waiting, the pool) would refuse displaces requests of
        lower tiers when that makes room, all or nothing: those not yet running
        (with preempt_lower_tiers, running ones too), lowest tier and newest
        first. Each ends with a FinishedRequest, reason "shed", with a
        retry_after (delivered like a cancel's; a "displaced" event is logged)."""
    def cancel(self, request_id: int, /, *, now: float | None = None) -> bool:
        """Cancel a request: its pages and reservation are released at once, and
        its terminal event (a FinishedRequest, reason "cancelled", the tokens
        generated so far) is delivered by the next commit() or take_finished().
        Returns True when it was live; False when it had already ended on its
        own (finished, or handed back at a drain deadline: its terminal event
        exists and nothing changes), so a cancel racing the end of a request is
        not an error. Raises UnknownRequest for an id never issued, or one
        already ended by cancel() or stop() (ending it twice is a caller bug)."""
    def stop(self, request_id: int, /, *, now: float | None = None) -> bool:
        """End a live request as finished, reason "stop": the host matched a stop
        string in its detokenized text. Counted as finished (not cancelled) in
        stats and the e2e histogram; its pages are released at once and its
        FinishedRequest (the tokens generated so far) is delivered by the next
        commit() or take_finished(). Returns and raises as cancel() does."""
    def fail(self, request_id: int, error: str, /, *, now: float | None = None) -> bool:
        """End a live request as "error": the host could not serve it (`error`
        says why: its logits were not finite, say). Its pages are released at
        once; its FinishedRequest (reason "error", with `error`, the tokens so
        far) is delivered by the next commit() or take_finished(), so the
        core's terminal event and what the host's client is told agree. Counted
        as not finished. Returns and raises as cancel() does."""
    def take_finished(self) -> list[FinishedRequest]:
        """Terminal events of requests ended outside a commit (cancel, stop, a
        drain deadline) not delivered yet, in the order they ended. Each
        terminal event is delivered exactly once, by whichever comes first: this
        call or the next commit() (first in its `finished`). A loop whose step()
        returned None calls this to see them."""
    def step(self, *, now: float | None = None) -> StepPlan | None:
        """Plan the next step: a StepPlan, or None when nothing can run.

        The plan's arrays are read-only views of buffers this scheduler owns and
        reuses: they stay valid until the second step() after this one (two buffer
        sets alternate), so the engine may keep reading them while the next step
        is planned. Copy them to keep them longer. Commit the plan before the next
        step()."""
    def commit(
        self,
        plan: StepPlan,
        sampled_ids: npt.NDArray[np.int32],
        /,
        *,
        now: float | None = None,
    ) -> StepEvents:
        """Close a step: `sampled_ids` (1-D int32) holds one token per sequence in
        plan order (ignored where `plan.samples` is False). Appends tokens,
        finishes requests (max_tokens or a stop token) and frees their pages.
        Its `finished` also delivers, first, the terminal events of requests
        ended since the last delivery (cancel, stop, a drain deadline).
        Raises StalePlan for a plan that is not the pending one and InvalidState
        for sampled ids that do not fit it; then nothing changes."""
    def advance(self, plan: StepPlan, /, *, now: float | None = None) -> None:
        """Close a step before its tokens are known (overlapped scheduling): each
        sequence that samples draws a placeholder, -(row + 1), so the next
        step() can be planned while the device still runs this one; that
        plan's `token_ids` hold the placeholder where a decode's input is the
        token this plan samples at that row (take it from the device's sampled
        array). `resolve` then gives the tokens and returns the events. At most
        one plan is advanced and not resolved. Raises StalePlan for a plan that
        is not the pending one or while another is unresolved; then nothing
        changes."""
    def resolve(
        self, plan: StepPlan, sampled_ids: npt.NDArray[np.int32], /, *, now: float | None = None
    ) -> StepEvents:
        """Give an advanced step its sampled tokens (1-D int32, one per sequence
        in plan order, ignored where `plan.samples` is False): they replace
        the placeholders, and a stop token ends its request now (one step
        late: the token the next plan computed for it is dropped). Returns the
        step's events as commit() would have (a request ended since the
        advance gets no token), after the terminal events queued since the
        last delivery. Raises StalePlan for a plan that is not the advanced
        one and InvalidState for ids that do not fit it; then nothing changes."""
    @property
    def unresolved_step(self) -> int | None:
        """The step advanced and not yet resolved (None when there is none)."""
    def stats(self, *, now: float | None = None) -> SchedulerStats:
        """A snapshot: pool counts, per-tenant usage, reservations, counters, latency
        histograms (seconds; buckets are cumulative over kvsched.LATENCY_BUCKETS
        plus +inf), and rejections by reason."""
    def reconfigure(self, **knobs: Any) -> None:
        """Change live knobs, given as SchedulerConfig keyword arguments; effective
        from the next step, validated as a whole, nothing changes on an error.
        Restart-only knobs (num_blocks, block_size, token_buckets, admission,
        prefix_caching, prefix_cache_key, prefix_cache_partition, vocab_size,
        kv_cache_groups, and raising
        max_num_seqs, max_seq_len or max_batched_tokens past the plan shape)
        raise RestartRequired naming the knob."""
    def take_events(self) -> list[RungEvent | MaxTokensCappedEvent | DisplacedEvent]:
        """Events since the last call, oldest first: ladder rungs engaged and
        released, requests admitted with max_tokens capped. At most 4096 wait;
        older ones are dropped and counted in stats()["events_dropped"]."""
    def enable_kv_events(self) -> None:
        """Record the prefix cache's changes from now on for routers (KV events);
        nothing when prefix caching is off. Drain them with `drain_kv_events`
        (once a step: what is not drained accumulates, up to a bound)."""
    def drain_kv_events(self, timestamp: float, /, data_parallel_rank: int = 0) -> bytes | None:
        """The prefix cache's changes since the last call, as one batch in vLLM's
        KV-event wire format (msgpack `[timestamp, events, data_parallel_rank]`;
        docs/fleet.md), or None when nothing changed or events are off."""
    def kv_events_pending(self) -> tuple[int, int]:
        """(events waiting to be drained, events lost to the bound since start)."""
    def cached_blocks_on_wire(self) -> list[tuple[int, int]]:
        """The blocks the prefix cache holds, as KV events name them: a list of
        (group, block hash), one per cached page."""
    def pressure(self, *, now: float | None = None) -> Pressure:
        """The ladder's signals now: reserved_share, queue_depth, oldest_wait_s."""
    @property
    def lifecycle(self) -> _Lifecycle:
        """ "cold", "warming", "ready", "draining" or "drained"."""
    def live(self) -> bool:
        """Liveness: the scheduler answers and can still run work (not drained)."""
    def ready(self) -> bool:
        """Readiness: warm and admitting."""
    def begin_warmup(self) -> None:
        """The engine started loading weights and compiling (cold -> warming)."""
    def mark_ready(self) -> None:
        """The engine is warm: weights resident, every bucket compiled, a synthetic
        request completed. Admission opens."""
    def drain(self, deadline: float, /) -> None:
        """Stop admitting (submit raises Rejected "draining") and keep stepping the
        in-flight requests; the first step at or after `deadline` (seconds, the
        clock of `now`) hands back whatever is unfinished, each with a terminal
        event (reason "drain_deadline", the tokens so far) for take_finished()
        (that step returns None). Then `checkpoint`."""
    def checkpoint(self, path: str | os.PathLike[str], /) -> CheckpointCounts:
        """Write the requests finished since the drain began and every unfinished
        one (tenant, prompt, tokens generated so far, options, reason) as JSON
        lines between a header and a checksummed trailer, durably (a temporary
        file, fsync, rename). Returns the counts.
        The file is kvsched.checkpoint's (this calls kvsched.checkpoint.save)."""
    def restore(
        self, path: str | os.PathLike[str], /, *, now: float | None = None
    ) -> RestoreResult:
        """Submit again every in-flight request of a checkpoint, all or nothing:
        each continues after the tokens it had generated. Returns {"restored":
        {old id: new id}, "refused": {} (always empty: any refusal restores
        nothing and raises CheckpointError), "finished": [the finished records]}.
        The file is kvsched.checkpoint's (this calls kvsched.checkpoint.restore)."""
    def checkpoint_records(self) -> list[FinishedRecord | InFlightRecord]:
        """The checkpoint as records (what checkpoint() writes, one a line): the
        requests finished since the drain began (kind "finished"), then every
        unfinished one (kind "in_flight": handed back at the drain deadline, or
        still live)."""
    def restore_records(
        self, records: Iterable[InFlightRecord], /, *, now: float | None = None
    ) -> RestoredRecords:
        """Submit again in-flight checkpoint records, all or nothing: each
        continues after the tokens it had generated. A malformed record raises
        InvalidRequest; a duplicated id, an unknown tenant or any refusal (pool
        full, ...) raises CheckpointError naming every refused id in `.refused`;
        either way nothing changes. So that nothing does, several records
        displace no lower-tier request (one that only displacement would
        admit is refused); a single record displaces like submit. Returns
        {"restored": {old id: new id}, "refused": {}} (always empty, kept for
        the result's shape)."""

@final
class StepPlan:
    """One step's plan: the kernel's arrays (read-only views, see Scheduler.step for
    how long they stay valid) and host-side fields."""

    @property
    def token_ids(self) -> npt.NDArray[np.int32]:
        """int32 [T]: input token of each scheduled token; padding 0."""
    @property
    def positions(self) -> npt.NDArray[np.int32]:
        """int32 [T]: absolute position of each token; padding 0."""
    @property
    def slot_mapping(self) -> npt.NDArray[np.int32]:
        """int32 [T]: page * block_size + offset; padding num_blocks * block_size."""
    @property
    def cu_q_lens(self) -> npt.NDArray[np.int32]:
        """int32 [S+1]: cumulative query lengths, decode sequences first."""
    @property
    def kv_lens(self) -> npt.NDArray[np.int32]:
        """int32 [S]: cached + newly scheduled tokens; padding 0."""
    @property
    def page_indices(self) -> npt.NDArray[np.int32]:
        """int32 [S, PPS]: page ids of each sequence; padding page 0."""
    @property
    def num_seqs(self) -> npt.NDArray[np.int32]:
        """int32 [1]: real sequences in the plan."""
    @property
    def distribution(self) -> npt.NDArray[np.int32]:
        """int32 [3]: (decode-only, decode-only, all)."""
    @property
    def logits_indices(self) -> npt.NDArray[np.int32]:
        """int32 [S]: cu_q_lens[1:] - 1, the row whose logits are sampled."""
    @property
    def group_page_indices(self) -> npt.NDArray[np.int32]:
        """int32 [G, S, PPS]: every KV-cache group's page table (group 0's is
        `page_indices`); a window group's row holds page 0 before the first
        block its sequence still reads."""
    @property
    def group_slot_mapping(self) -> npt.NDArray[np.int32]:
        """int32 [G, T]: every KV-cache group's slots (group 0's is `slot_mapping`)."""
    @property
    def request_ids(self) -> npt.NDArray[np.int64]:
        """int64 [n]: request id of each sequence, in plan order."""
    @property
    def samples(self) -> npt.NDArray[np.bool_]:
        """bool [n]: whether the token sampled for the sequence is used."""
    @property
    def preempted(self) -> list[int]:
        """Requests preempted while planning this step (queued again)."""
    @property
    def step_id(self) -> int:
        """Identifies this plan for commit()."""
    @property
    def num_tokens(self) -> int:
        """Real tokens in the plan."""
    @property
    def bucket(self) -> int:
        """T: the token bucket the arrays are padded to."""
    @property
    def num_decode(self) -> int:
        """Decode sequences (they come first)."""
    @property
    def kv_tokens(self) -> int:
        """KV tokens the step reads: kv_lens summed over the plan's sequences."""
    def __len__(self) -> int: ...

@final
class FinishedRequest:
    """A request's terminal event (exactly one per admitted request): how it
    ended, its output and timings (seconds, on the clock of the `now` values;
    first_scheduled and first_token equal `finished` for a request that ended
    before it got there)."""

    @property
    def request_id(self) -> int: ...
    @property
    def tenant(self) -> str: ...
    @property
    def reason(self) -> _FinishReason:
        """ "length" (max_tokens reached), "stop" (a stop token was sampled, or
        Scheduler.stop), "cancelled" (Scheduler.cancel), "drain_deadline"
        (unfinished at the drain's deadline, handed back), "shed" (displaced
        by a higher tier's request that a global limit would have refused; see
        retry_after) or "error" (Scheduler.fail: the host could not serve it;
        see error)."""
    @property
    def prompt_len(self) -> int: ...
    @property
    def output_ids(self) -> npt.NDArray[np.int32]:
        """int32: the generated tokens (a stop token included); for a request
        cancelled, stopped or handed back, those generated until then."""
    @property
    def arrival(self) -> float: ...
    @property
    def first_scheduled(self) -> float: ...
    @property
    def first_token(self) -> float: ...
    @property
    def finished(self) -> float: ...
    @property
    def preemptions(self) -> int:
        """Times it was preempted and recomputed."""
    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (not computed for it)."""
    @property
    def asked_max_tokens(self) -> int:
        """The max_tokens the caller asked for."""
    @property
    def max_tokens(self) -> int:
        """The max_tokens it was admitted with: less than asked_max_tokens when
        the ladder's cap_max_tokens rung lowered it (see max_tokens_capped)."""
    @property
    def retry_after(self) -> float | None:
        """Seconds after which a retry may pass: set for a request ended "shed",
        None otherwise."""
    @property
    def error(self) -> str | None:
        """Why the host could not serve it: set for a request ended "error", None
        otherwise."""
    @property
    def max_tokens_capped(self) -> bool:
        """Whether the ladder lowered its max_tokens at admission: a "length"
        ending then stopped short of what was asked."""
    @property
    def ttft(self) -> float:
        """Submit to first token."""
    @property
    def e2e(self) -> float:
        """Submit to finish."""
    @property
    def queue_time(self) -> float:
        """Submit to first entering the running set."""

@final
class StepEvents:
    """What a commit did: new tokens (arrays, in plan order), finished requests,
    and requests the step preempted."""

    @property
    def request_ids(self) -> npt.NDArray[np.int64]:
        """int64 [k]: requests that got a token."""
    @property
    def tokens(self) -> npt.NDArray[np.int32]:
        """int32 [k]: the token each got."""
    @property
    def finished(self) -> list[FinishedRequest]:
        """list[FinishedRequest]."""
    @property
    def preempted(self) -> list[int]:
        """Request ids preempted (and queued again) by this step."""

@final
class TextStreams:
    """Many requests' streaming text over one tokenizer's table of token bytes:
    token `t` is `data[offsets[t]:offsets[t + 1]]`; `byte_tokens`: the
    SentencePiece byte-fallback tokens (`<0xHH>`, one byte each: a run shows
    each character as it completes, and bytes that cannot be one as one U+FFFD
    per byte when it ends);
    `skipped`: the special tokens decode skips (no bytes; a run goes on
    through them). Raises InvalidConfig on a table that is not one. Each
    step's tokens for every row in one `push`; text never splits a character,
    and stop strings end a stream without showing. For tokenizers whose decode
    is their tokens' bytes joined (kvsched.engine.token_bytes builds and checks
    the table)."""

    def __new__(
        cls, data: bytes, offsets: list[int], byte_tokens: list[int] = ..., skipped: list[int] = ...
    ) -> TextStreams: ...
    @property
    def vocab_size(self) -> int:
        """Tokens in the table."""
    def __len__(self) -> int: ...
    def __contains__(self, request_id: int, /) -> bool: ...
    def add(self, request_id: int, stops: list[str] = ...) -> None:
        """Open request `request_id`'s stream with its stop strings. Raises
        InvalidRequest on an empty stop or a stream it has already."""
    def push(
        self, request_ids: list[int], tokens: list[int], last: list[bool]
    ) -> tuple[list[str], list[bool]]:
        """One step: row `i` is request `request_ids[i]` getting `tokens[i]` (a
        negative token: one with no text, a stop token); `last[i]`: its final
        token (all held text comes out, the stream closes). Returns each row's
        text and whether a stop string ended it (its stream closed); a row
        whose request has no stream gets "" and False."""
    def finish(self, request_id: int) -> str | None:
        """Close a stream whose request ended without a token; returns the text a
        possible stop held back (None: no such stream)."""
