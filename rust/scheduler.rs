//! Scheduler: owns the pool, the tenants and the live requests, and is the one
//! place that changes them together.
//!
//! A request's life: `submit` (admission reserves its final length) -> waits in
//! its tenant's queue -> enters the running set (tier first, then weighted fair
//! share between the tenants of a tier, then arrival) -> prefill in chunks ->
//! one token per step -> finishes (max_tokens or a stop token) or is cancelled,
//! releasing its pages and reservation together. Pages are drawn lazily from
//! the reservation as the KV grows.
//!
//! One engine step is `step()` (plan) then `commit()` (the sampled tokens).
//!
//! Every admitted request ends exactly once, with one `FinishedRequest`: a
//! commit finishes it (length, stop token), or the caller ends it (`cancel`,
//! `stop`), or the drain's deadline hands it back. Those ended outside a
//! commit are queued and delivered once, by the next commit's `finished` or
//! by `take_finished`, whichever comes first.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};

pub use crate::admission::Room;
use crate::admission::{self, Capacity};
use crate::buckets::TokenBuckets;
use crate::error::{KvError, KvResult, RejectReason, Rejection};
use crate::ladder::{Ladder, LadderConfig, LadderMove, Pressure};
use crate::metrics::{Histogram, TenantMetrics};
use crate::planner::{self, PlanBuffers, PlanShape, RowCache, SeqSlice};
use crate::pool::BlockPool;
use crate::prefix::{BlockKey, Namespace, PrefixHasher, Scope};
use crate::tenant::{TenantConfig, TenantId, Tenants};

/// Over-commit's default watermark: reserve the prompt plus one block of growth.
pub const DEFAULT_WATERMARK_BLOCKS: usize = 1;

/// How admission reserves memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdmissionMode {
    /// Reserve the final length: the engine can never run out of KV pages.
    Reserve,
    /// Reserve the prompt plus `watermark_blocks`; when pages run out, preempt
    /// the lowest-tier, most recently admitted sequence and recompute it later.
    Overcommit { watermark_blocks: usize },
}

#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Pages in the pool, the null page included. Restart-only.
    pub num_blocks: usize,
    /// Tokens per page. Restart-only.
    pub block_size: usize,
    /// Most sequences in one step (the S dimension of a step plan).
    pub max_num_seqs: usize,
    /// Token budget of one step.
    pub max_batched_tokens: usize,
    /// Longest prompt + max_tokens a request may ask for.
    pub max_seq_len: usize,
    /// Share of the pool kept out of admission, for what the estimate missed.
    pub overhead_reserve: f64,
    /// Admitted requests that may wait beyond the `max_num_seqs` that run.
    pub max_waiting: usize,
    /// Most prompt tokens one sequence gets in one step.
    pub long_prefill_chunk: usize,
    /// Token buckets; None: powers of two from 16 to max_batched_tokens.
    pub token_buckets: Option<Vec<usize>>,
    pub admission: AdmissionMode,
    /// A waiting request of a higher tier that finds no slot (or, over-committed,
    /// no pages) preempts the lowest-tier, most recently admitted running one.
    pub preempt_lower_tiers: bool,
    /// Re-read every plan in full after writing it (always on in debug builds).
    /// The cheap checks run on every plan regardless.
    pub full_validation: bool,
    /// Reuse the KV of full blocks already computed for the same prefix (in
    /// the same namespace). Restart-only.
    pub prefix_caching: bool,
    /// The secret that keys block names; None: random for this scheduler.
    /// Hosts that must name blocks alike configure the same one. Restart-only.
    pub prefix_cache_key: Option<SecretKey>,
    /// The degradation ladder (no rungs: never degrade). Live.
    pub ladder: LadderConfig,
    /// Start cold: refuse requests (`not_ready`) until the engine has warmed up
    /// and calls `mark_ready`. False: ready at once (no engine to wait for).
    pub require_warmup: bool,
    /// Seconds of `retry_after` given where nothing better is known: to refusals
    /// while not ready or draining, and to capacity refusals (pool_full,
    /// tenant_budget, concurrency) before a step rate has been measured. Live.
    pub retry_after_hint_s: f64,
}

/// A 128-bit secret that never shows in Debug output.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SecretKey(pub [u8; 16]);

impl std::fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretKey(<redacted>)")
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            num_blocks: 8192,
            block_size: 16,
            max_num_seqs: 256,
            max_batched_tokens: 2048,
            max_seq_len: 8192,
            overhead_reserve: 0.10,
            max_waiting: 0,
            long_prefill_chunk: 512,
            token_buckets: None,
            admission: AdmissionMode::Reserve,
            preempt_lower_tiers: false,
            full_validation: false,
            prefix_caching: true,
            prefix_cache_key: None,
            ladder: LadderConfig::off(),
            require_warmup: false,
            retry_after_hint_s: 1.0,
        }
    }
}

impl SchedulerConfig {
    pub fn validate(&self) -> KvResult<()> {
        let bad = |m: &str| Err(KvError::InvalidConfig(m.to_owned()));
        crate::pool::validate_shape(self.num_blocks, self.block_size)?;
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be at least 1");
        }
        if self.max_batched_tokens < self.max_num_seqs {
            return bad(
                "max_batched_tokens must be at least max_num_seqs (every running \
                        sequence decodes one token per step)",
            );
        }
        if self.max_seq_len < 2 {
            return bad("max_seq_len must be at least 2 (one prompt token and one new token)");
        }
        if self.max_seq_len > i32::MAX as usize {
            return bad("max_seq_len must fit int32 positions");
        }
        if !(self.overhead_reserve.is_finite() && (0.0..1.0).contains(&self.overhead_reserve)) {
            return bad("overhead_reserve must be in [0, 1)");
        }
        if self.long_prefill_chunk == 0 {
            return bad("long_prefill_chunk must be at least 1");
        }
        if !(self.retry_after_hint_s.is_finite() && self.retry_after_hint_s >= 0.0) {
            return bad("retry_after_hint_s must be a non-negative number");
        }
        self.buckets()?;
        self.ladder.validate()?;
        Ok(())
    }

    /// Blocks kept back by the overhead reserve, of `total` allocatable pages.
    pub fn reserve_blocks(&self, total: usize) -> usize {
        (total as f64 * self.overhead_reserve).ceil() as usize
    }

    pub fn buckets(&self) -> KvResult<TokenBuckets> {
        match &self.token_buckets {
            None => Ok(TokenBuckets::powers_of_two(self.max_batched_tokens)),
            Some(list) => TokenBuckets::from_list(list.clone(), self.max_batched_tokens),
        }
    }

    pub fn plan_shape(&self) -> KvResult<PlanShape> {
        Ok(PlanShape {
            max_tokens: self.buckets()?.largest(),
            max_seqs: self.max_num_seqs,
            pages_per_seq: self.max_seq_len.div_ceil(self.block_size),
            block_size: crate::pool::BlockSize::new(self.block_size),
            pad_slot: (self.num_blocks * self.block_size) as i32,
        })
    }
}

/// How a request ended. Every admitted request ends exactly once, with one
/// `FinishedRequest` carrying one of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// max_tokens reached.
    Length,
    /// A stop token was sampled (it is part of the output), or the host ended
    /// it with `Scheduler::stop` (it matched a stop string in the text).
    Stop,
    /// Cancelled by the caller (`cancel`); its output is what it had generated.
    Cancelled,
    /// Still unfinished when the drain's deadline came: handed back (see
    /// `checkpoint`) with what it had generated.
    DrainDeadline,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Cancelled => "cancelled",
            FinishReason::DrainDeadline => "drain_deadline",
        }
    }

    /// Counted as finished (per-tenant `finished`, the e2e histogram), not as
    /// cancelled.
    pub fn is_finished(self) -> bool {
        matches!(self, FinishReason::Length | FinishReason::Stop)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// In its tenant's queue.
    Queued,
    /// Preempted, in the resume queue of this tier (its tier when it was
    /// preempted: a tenant's tier may change while it waits).
    Resuming(u32),
    /// In the running set at this position.
    Running(usize),
}

/// Where the next request to enter the running set comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WaitFrom {
    Tenant(TenantId),
    Resume(u32),
}

/// One admitted, unfinished request.
///
/// `repr(C)` and 64-byte alignment keep what a decode step touches in the first
/// cache line and what its commit touches in the second: a step visits every
/// running request, so lines per request are the cost of a step.
#[derive(Clone, Debug)]
#[repr(C, align(64))]
pub struct Request {
    // Line 1: read by step().
    /// Prompt followed by the tokens generated so far.
    pub tokens: Vec<i32>,
    /// Pages holding its KV, in order.
    pub pages: Vec<u32>,
    /// Tokens whose KV is written (committed steps only).
    pub num_computed: usize,
    /// Identifies this page list in the plan's row caches; renewed on (re)entry.
    row_key: u64,
    // Line 2: read by commit().
    pub id: u64,
    pub tenant: TenantId,
    place: Place,
    pub max_tokens: usize,
    pub prompt_len: usize,
    pub last_token: Option<f64>,
    // Colder.
    pub stop_token_ids: Vec<i32>,
    pub first_token: Option<f64>,
    /// Blocks reserved at admission, held until it ends.
    pub reserved_blocks: usize,
    /// Prefix-cache names of its first full blocks, in order (the chain so far).
    pub block_keys: Vec<BlockKey>,
    /// The namespace its blocks are named in.
    pub namespace: Namespace,
    pub arrival: f64,
    pub first_scheduled: Option<f64>,
    pub preemptions: u32,
    pub cached_tokens: usize,
    pub cache_salt: Option<Vec<u8>>,
    /// Since when it waits to (re)enter the running set: its arrival, or its
    /// last preemption. The ladder's oldest-wait signal reads this.
    pub waiting_since: f64,
}

impl Request {
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    pub fn output(&self) -> &[i32] {
        &self.tokens[self.prompt_len..]
    }

    pub fn is_running(&self) -> bool {
        matches!(self.place, Place::Running(_))
    }

    /// Tokens still to run before the next token can be sampled.
    fn need(&self) -> usize {
        self.tokens.len() - self.num_computed
    }
}

/// Where a scheduler is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lifecycle {
    /// Built; the engine has not started warming up.
    Cold,
    /// The engine is loading weights and compiling.
    Warming,
    /// Admitting.
    Ready,
    /// Not admitting; in-flight requests run until they finish or the deadline.
    Draining,
    /// Nothing left running; what did not finish was handed back.
    Drained,
}

impl Lifecycle {
    pub fn as_str(self) -> &'static str {
        match self {
            Lifecycle::Cold => "cold",
            Lifecycle::Warming => "warming",
            Lifecycle::Ready => "ready",
            Lifecycle::Draining => "draining",
            Lifecycle::Drained => "drained",
        }
    }
}

/// An unfinished request as a checkpoint holds it: enough to submit it again
/// elsewhere and finish it with the same tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct InFlight {
    pub id: u64,
    pub tenant: String,
    pub prompt: Vec<i32>,
    pub generated: Vec<i32>,
    pub max_tokens: usize,
    pub stop_token_ids: Vec<i32>,
    pub cache_salt: Option<Vec<u8>>,
    pub arrival: f64,
    /// "in_flight" (still running at the checkpoint) or "drain_deadline"
    /// (handed back when the drain's deadline came).
    pub reason: &'static str,
}

impl InFlight {
    /// Whether the record describes a request that can still run: tokens left
    /// to generate, no negative id, no stop token already generated.
    pub fn validate(&self) -> KvResult<()> {
        let bad = |why: String| {
            Err(KvError::InvalidRequest(format!(
                "restored request {}: {why}",
                self.id
            )))
        };
        if self.generated.len() >= self.max_tokens {
            return bad(format!(
                "{} tokens generated of max_tokens {}: it had finished",
                self.generated.len(),
                self.max_tokens
            ));
        }
        if self
            .generated
            .iter()
            .any(|t| self.stop_token_ids.contains(t))
        {
            return bad("it generated a stop token: it had finished".into());
        }
        if self.generated.iter().any(|&t| t < 0) {
            return bad("a generated token id is negative".into());
        }
        Ok(())
    }
}

/// Something operators want to know about, in the order it happened.
#[derive(Clone, Debug, PartialEq)]
pub enum SchedulerEvent {
    /// The ladder engaged or released a rung.
    Ladder(LadderMove),
    /// The ladder admitted a request with its max_tokens lowered.
    MaxTokensCapped {
        request: u64,
        tenant: String,
        asked: usize,
        admitted: usize,
        at: f64,
    },
}

/// Most events kept between two `take_events` calls; older ones are dropped
/// (and counted) so an unread queue cannot grow without bound.
pub const MAX_PENDING_EVENTS: usize = 4096;

/// What a request may carry beside its prompt.
#[derive(Clone, Copy, Debug, Default)]
pub struct SubmitOptions<'a> {
    /// Sampling one of these finishes the request (the token is part of the output).
    pub stop_token_ids: &'a [i32],
    /// Mixed into the request's prefix-cache namespace: only requests with the
    /// same salt (in the same namespace) share its blocks.
    pub cache_salt: Option<&'a [u8]>,
}

/// Find the longest cached prefix of `tokens`: for each full block, in order
/// and at most `max_blocks`, its key (chained from `root`) and the page the
/// cache holds for it, until the first miss. Appends to `pages` and `keys`.
#[allow(clippy::too_many_arguments)]
fn lookup_prefix(
    pool: &BlockPool,
    hasher: &PrefixHasher,
    block_size: usize,
    root: BlockKey,
    tokens: &[i32],
    max_blocks: usize,
    pages: &mut Vec<u32>,
    keys: &mut Vec<BlockKey>,
) {
    let mut parent = root;
    for block in tokens.chunks_exact(block_size).take(max_blocks) {
        let key = hasher.block(parent, block);
        let Some(page) = pool.cache().lookup(key) else {
            return;
        };
        pages.push(page);
        keys.push(key);
        parent = key;
    }
}

/// A request's terminal event: how it ended, its output (the tokens generated
/// until then) and timings (seconds, from `now` values). `first_scheduled` and
/// `first_token` are `finished` for a request that ended before it got there.
#[derive(Clone, Debug, PartialEq)]
pub struct FinishedRequest {
    pub id: u64,
    pub tenant: String,
    pub reason: FinishReason,
    pub prompt_len: usize,
    pub output: Vec<i32>,
    pub arrival: f64,
    pub first_scheduled: f64,
    pub first_token: f64,
    pub finished: f64,
    pub preemptions: u32,
    /// Prompt tokens served from the prefix cache at submit.
    pub cached_tokens: usize,
}

/// What one `step()` decided, beside the arrays it wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutcome {
    pub step_id: u64,
    /// Which of the two buffer sets holds this plan's arrays.
    pub parity: usize,
    pub num_seqs: usize,
    pub num_decode: usize,
    pub num_tokens: usize,
    pub bucket: usize,
    /// Request id of each sequence, in plan order.
    pub request_ids: Vec<u64>,
    /// Whether the token sampled for each sequence is used (its prompt, or its
    /// recompute, is complete); false for a prefill chunk that stops short.
    pub samples: Vec<bool>,
    /// Requests preempted while planning this step (back in their queue).
    pub preempted: Vec<u64>,
}

/// What one `commit()` did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CommitEvents {
    /// Requests that got a new token, in plan order, and the token.
    pub request_ids: Vec<u64>,
    pub tokens: Vec<i32>,
    /// Terminal events: first those of requests ended outside a commit since
    /// the last delivery (cancel, stop, the drain deadline; see
    /// `Scheduler::take_finished`), in the order they ended, then the requests
    /// this commit finished, in plan order.
    pub finished: Vec<FinishedRequest>,
    /// Requests preempted by the step this commit closes.
    pub preempted: Vec<u64>,
}

#[derive(Clone, Debug)]
struct PendingSeq {
    slab: usize,
    id: u64,
    q_len: usize,
    samples: bool,
    decode: bool,
}

#[derive(Clone, Debug)]
struct Pending {
    step_id: u64,
    seqs: Vec<PendingSeq>,
    preempted: Vec<u64>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PoolStats {
    pub num_blocks: usize,
    pub block_size: usize,
    /// Allocatable pages (all but the null page).
    pub total: usize,
    pub free: usize,
    pub used: usize,
    pub shared: usize,
    /// Pages kept out of admission by the overhead reserve.
    pub overhead_reserve: usize,
    /// `total` less the overhead reserve.
    pub usable: usize,
    /// Blocks reserved by live requests.
    pub reserved: usize,
    /// Reservations (pages a tenant's requests share counted once) plus unused
    /// floors: what admission has promised.
    pub committed: usize,
    /// Prefix cache: pages named (referenced or evictable).
    pub cached: usize,
    /// Cached pages nobody references: reusable, taken when no free page is left.
    pub evictable: usize,
    /// Cached pages taken back for reuse since start.
    pub evictions: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TenantStats {
    pub name: String,
    pub tier: u32,
    pub weight: f64,
    pub kv_floor_blocks: usize,
    pub kv_cap_blocks: Option<usize>,
    pub reserved_blocks: usize,
    pub used_blocks: usize,
    /// Pages its requests share among themselves (reserved twice, held once).
    pub shared_blocks: usize,
    pub live_requests: u32,
    pub waiting: usize,
    pub running: u32,
    pub admitted: u64,
    pub finished: u64,
    pub cancelled: u64,
    /// Rejections by reason, in `RejectReason::ALL` order.
    pub rejected: [u64; RejectReason::COUNT],
    /// Tokens in the rate-limit bucket now (None without a rate limit).
    pub rate_tokens_available: Option<f64>,
    pub metrics: TenantMetrics,
    pub vtime: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerStats {
    pub pool: PoolStats,
    /// Sorted by tenant name.
    pub tenants: Vec<TenantStats>,
    pub live_requests: usize,
    pub running: usize,
    pub waiting: usize,
    pub steps: u64,
    /// Seconds between consecutive step() calls: a long gap is a starved host.
    pub step_gap: Histogram,
    /// Rejections by reason since start, over all tenants (removed ones and
    /// unknown names included).
    pub rejected: [u64; RejectReason::COUNT],
    /// Preemptions since start, over all tenants.
    pub preemptions: u64,
}

/// Gaps between productive steps kept for the step-rate estimate.
const STEP_GAP_WINDOW: usize = 32;

/// A growable set of request ids, one bit each (ids are dense from 1).
#[derive(Clone, Debug, Default)]
struct IdSet {
    words: Vec<u64>,
}

impl IdSet {
    fn insert(&mut self, id: u64) {
        let (w, b) = ((id / 64) as usize, id % 64);
        if w >= self.words.len() {
            self.words.resize(w + 1, 0);
        }
        self.words[w] |= 1 << b;
    }

    fn contains(&self, id: u64) -> bool {
        let (w, b) = ((id / 64) as usize, id % 64);
        self.words.get(w).is_some_and(|x| x & (1 << b) != 0)
    }
}

/// Hands each scheduler a distinct range of step ids, so a plan can only be
/// committed to the scheduler that made it.
static INSTANCES: AtomicU64 = AtomicU64::new(1);
const STEP_ID_BITS: u32 = 40;

pub struct Scheduler {
    config: SchedulerConfig,
    /// This scheduler's step ids are `instance << STEP_ID_BITS | step`.
    instance: u64,
    buckets: TokenBuckets,
    shape: PlanShape,
    pool: BlockPool,
    /// Names prefix-cache blocks (None: caching off).
    hasher: Option<PrefixHasher>,
    tenants: Tenants,
    /// Live requests; a slot is reused once its request ends.
    slab: Vec<Option<Request>>,
    free_slab: Vec<usize>,
    index: HashMap<u64, usize>,
    /// The running set in plan order: `num_decode` decode sequences, then those
    /// still in prefill, in the order they entered.
    running: Vec<usize>,
    num_decode: usize,
    /// Preempted requests, per tier, in admission order: served before the
    /// tier's tenant queues, so they keep their place at the head.
    resume: BTreeMap<u32, VecDeque<usize>>,
    rows: [RowCache; 2],
    steps: u64,
    pending: Option<Pending>,
    next_id: u64,
    next_row_key: u64,
    rejected: [u64; RejectReason::COUNT],
    preemptions: u64,
    /// Scratch: tokens served per tenant slot in the step being planned.
    served: Vec<usize>,
    /// Preempted by a step that ran nothing; reported with the next plan.
    unreported_preempted: Vec<u64>,
    ladder: Ladder,
    events: VecDeque<SchedulerEvent>,
    events_dropped: u64,
    lifecycle: Lifecycle,
    drain_deadline: f64,
    /// Finished since the drain began, for the checkpoint.
    drain_finished: Vec<FinishedRequest>,
    /// Handed back at the drain's deadline, for the checkpoint.
    handed_back: Vec<InFlight>,
    last_step_at: Option<f64>,
    step_gap: Histogram,
    /// Terminal events of requests ended outside a commit (cancel, stop, the
    /// drain deadline), each delivered once: by the next commit or `take_finished`.
    ended: Vec<FinishedRequest>,
    /// Requests the caller ended (cancel, stop): ending one again is an error.
    caller_ended: IdSet,
    /// The latest `now` any call passed (`cancel` takes none).
    clock: f64,
    /// Recent gaps between consecutive step() calls that both made a plan.
    step_gaps: VecDeque<f64>,
    /// When the last step() made a plan (None: it ran nothing).
    last_plan_at: Option<f64>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> KvResult<Self> {
        config.validate()?;
        let pool = BlockPool::new(config.num_blocks, config.block_size)?;
        let shape = config.plan_shape()?;
        let hasher = if config.prefix_caching {
            let key = match config.prefix_cache_key {
                Some(SecretKey(k)) => k,
                None => PrefixHasher::random_key().map_err(KvError::Internal)?,
            };
            Some(PrefixHasher::new(&key))
        } else {
            None
        };
        Ok(Scheduler {
            hasher,
            instance: INSTANCES.fetch_add(1, Ordering::Relaxed) % (1 << (63 - STEP_ID_BITS)),
            buckets: config.buckets()?,
            shape,
            pool,
            tenants: Tenants::default(),
            slab: Vec::new(),
            free_slab: Vec::new(),
            index: HashMap::new(),
            running: Vec::new(),
            num_decode: 0,
            resume: BTreeMap::new(),
            rows: [
                RowCache::new(config.max_num_seqs),
                RowCache::new(config.max_num_seqs),
            ],
            steps: 0,
            pending: None,
            next_id: 1,
            next_row_key: 1,
            rejected: [0; RejectReason::COUNT],
            preemptions: 0,
            served: Vec::new(),
            unreported_preempted: Vec::new(),
            ladder: Ladder::new(config.ladder.clone())?,
            events: VecDeque::new(),
            events_dropped: 0,
            lifecycle: if config.require_warmup {
                Lifecycle::Cold
            } else {
                Lifecycle::Ready
            },
            drain_deadline: f64::INFINITY,
            drain_finished: Vec::new(),
            handed_back: Vec::new(),
            last_step_at: None,
            step_gap: Histogram::default(),
            ended: Vec::new(),
            caller_ended: IdSet::default(),
            clock: f64::NEG_INFINITY,
            step_gaps: VecDeque::with_capacity(STEP_GAP_WINDOW),
            last_plan_at: None,
            config,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn plan_shape(&self) -> &PlanShape {
        &self.shape
    }

    pub fn buckets(&self) -> &TokenBuckets {
        &self.buckets
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    pub fn request(&self, id: u64) -> KvResult<&Request> {
        self.index
            .get(&id)
            .map(|&s| self.req(s))
            .ok_or(KvError::UnknownRequest(id))
    }

    /// Pool pages admission may promise: all but the overhead reserve.
    pub fn usable_blocks(&self) -> usize {
        let total = self.pool.total();
        total - self.config.reserve_blocks(total)
    }

    pub fn live_requests(&self) -> usize {
        self.index.len()
    }

    /// The buffer set the next `step()` writes (0 or 1).
    pub fn next_parity(&self) -> usize {
        (self.steps % 2) as usize
    }

    // -- lifecycle ----------------------------------------------------------------

    pub fn lifecycle(&self) -> Lifecycle {
        self.lifecycle
    }

    /// Alive: it answers and can still run work (everything but drained).
    pub fn live(&self) -> bool {
        self.lifecycle != Lifecycle::Drained
    }

    /// Ready: warm, and admitting.
    pub fn ready(&self) -> bool {
        self.lifecycle == Lifecycle::Ready
    }

    /// The engine started loading weights and compiling.
    pub fn begin_warmup(&mut self) -> KvResult<()> {
        match self.lifecycle {
            Lifecycle::Cold | Lifecycle::Warming => {
                self.lifecycle = Lifecycle::Warming;
                Ok(())
            }
            s => Err(KvError::InvalidState(format!(
                "begin_warmup on a {} scheduler",
                s.as_str()
            ))),
        }
    }

    /// The engine is warm (weights resident, every bucket compiled, a synthetic
    /// request completed): admit requests.
    pub fn mark_ready(&mut self) -> KvResult<()> {
        match self.lifecycle {
            Lifecycle::Cold | Lifecycle::Warming | Lifecycle::Ready => {
                self.lifecycle = Lifecycle::Ready;
                Ok(())
            }
            s => Err(KvError::InvalidState(format!(
                "mark_ready on a {} scheduler",
                s.as_str()
            ))),
        }
    }

    /// Stop admitting (`draining`); keep stepping what is in flight. The first
    /// step at or after `deadline` hands back whatever is unfinished (see
    /// `checkpoint`) and the scheduler is drained. A second call may move the
    /// deadline.
    pub fn drain(&mut self, deadline: f64) -> KvResult<()> {
        if deadline.is_nan() {
            return Err(KvError::InvalidRequest("drain deadline is NaN".into()));
        }
        if self.lifecycle == Lifecycle::Drained {
            return Ok(());
        }
        self.lifecycle = Lifecycle::Draining;
        self.drain_deadline = deadline;
        if self.index.is_empty() && self.pending.is_none() {
            self.lifecycle = Lifecycle::Drained;
        }
        Ok(())
    }

    /// What a checkpoint holds: requests finished since the drain began, and
    /// every unfinished one (handed back at the deadline, or still live).
    pub fn checkpoint(&self) -> (Vec<FinishedRequest>, Vec<InFlight>) {
        let mut in_flight = self.handed_back.clone();
        let mut live: Vec<&Request> = self.slab.iter().flatten().collect();
        live.sort_by_key(|r| r.id);
        in_flight.extend(live.into_iter().map(|r| self.in_flight(r, "in_flight")));
        (self.drain_finished.clone(), in_flight)
    }

    fn in_flight(&self, r: &Request, reason: &'static str) -> InFlight {
        InFlight {
            id: r.id,
            tenant: self.tenants.get(r.tenant).config.name.clone(),
            prompt: r.tokens[..r.prompt_len].to_vec(),
            generated: r.output().to_vec(),
            max_tokens: r.max_tokens,
            stop_token_ids: r.stop_token_ids.clone(),
            cache_salt: r.cache_salt.clone(),
            arrival: r.arrival,
            reason,
        }
    }

    /// Submit a request checkpointed elsewhere: its prompt, the tokens it had
    /// generated (they count toward `max_tokens` and lead its output) and its
    /// options. Admitted like any request (its final length is reserved).
    pub fn submit_restored(&mut self, record: &InFlight, now: f64) -> KvResult<u64> {
        record.validate()?;
        let opts = SubmitOptions {
            stop_token_ids: &record.stop_token_ids,
            cache_salt: record.cache_salt.as_deref(),
        };
        self.submit_inner(
            &record.tenant,
            &record.prompt,
            record.max_tokens,
            &opts,
            &record.generated,
            now,
        )
    }

    /// Submit every record of a checkpoint (see `submit_restored`), each one's
    /// outcome in order. Every record is checked first: one that can never run
    /// is an error and nothing is submitted; a refusal for now (pool full, ...)
    /// is that record's outcome.
    pub fn restore(
        &mut self,
        records: &[InFlight],
        now: f64,
    ) -> KvResult<Vec<Result<u64, Rejection>>> {
        for rec in records {
            rec.validate()?;
        }
        records
            .iter()
            .map(|rec| match self.submit_restored(rec, now) {
                Ok(id) => Ok(Ok(id)),
                Err(KvError::Rejected(r)) => Ok(Err(r)),
                Err(e) => Err(e),
            })
            .collect()
    }

    /// At the drain deadline (`now`): hand back every unfinished request, each
    /// with a terminal event (reason `DrainDeadline`, the tokens so far) and a
    /// record for the checkpoint. Counted as cancelled.
    fn hand_back_all(&mut self, now: f64) {
        let mut ids: Vec<u64> = self.index.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let slab = self.index[&id];
            let record = self.in_flight(self.req(slab), "drain_deadline");
            let req = self.release(slab);
            self.tenants.get_mut(req.tenant).counters.cancelled += 1;
            self.handed_back.push(record);
            let ended = self.finished_record(&req, FinishReason::DrainDeadline, now);
            self.ended.push(ended);
        }
        self.lifecycle = Lifecycle::Drained;
    }

    /// The terminal event of `req` (released) ending at `now` for `reason`.
    fn finished_record(&self, req: &Request, reason: FinishReason, now: f64) -> FinishedRequest {
        FinishedRequest {
            id: req.id,
            tenant: self.tenants.get(req.tenant).config.name.clone(),
            reason,
            prompt_len: req.prompt_len,
            output: req.output().to_vec(),
            arrival: req.arrival,
            first_scheduled: req.first_scheduled.unwrap_or(now),
            first_token: req.first_token.unwrap_or(now),
            finished: now,
            preemptions: req.preemptions,
            cached_tokens: req.cached_tokens,
        }
    }

    // -- live knobs ---------------------------------------------------------------

    /// Change the configuration live, effective from the next step. Validated
    /// as a whole; on an error nothing changes.
    ///
    /// Restart-only (`RestartRequired` names the knob): num_blocks, block_size,
    /// token_buckets, admission, prefix_caching, prefix_cache_key; and raising
    /// max_num_seqs, max_seq_len or max_batched_tokens past the plan shape the
    /// scheduler started with (the engine compiled for it). Lowering them is
    /// live: running sequences are not cut, new work obeys. overhead_reserve may
    /// not shrink the usable pool below what admission has already promised.
    pub fn update_config(&mut self, new: SchedulerConfig) -> KvResult<()> {
        new.validate()?;
        let old = &self.config;
        let restart = |knob: &'static str| Err(KvError::RestartRequired(knob));
        if new.num_blocks != old.num_blocks {
            return restart("num_blocks");
        }
        if new.block_size != old.block_size {
            return restart("block_size");
        }
        if new.token_buckets != old.token_buckets {
            return restart("token_buckets");
        }
        if new.admission != old.admission {
            return restart("admission");
        }
        if new.prefix_caching != old.prefix_caching {
            return restart("prefix_caching");
        }
        if new.prefix_cache_key.is_some() && new.prefix_cache_key != old.prefix_cache_key {
            return restart("prefix_cache_key");
        }
        if new.max_num_seqs > self.shape.max_seqs {
            return restart("max_num_seqs");
        }
        if new.max_seq_len > self.shape.pages_per_seq * self.config.block_size {
            return restart("max_seq_len");
        }
        if new.max_batched_tokens > self.buckets.largest() {
            return restart("max_batched_tokens");
        }
        let total = self.pool.total();
        let usable = total - new.reserve_blocks(total);
        if self.tenants.committed() > usable {
            return Err(KvError::InvalidConfig(format!(
                "overhead_reserve {} leaves {usable} usable blocks, fewer than the {} \
                 already promised",
                new.overhead_reserve,
                self.tenants.committed()
            )));
        }
        let mut ladder = self.ladder.clone();
        ladder.reconfigure(new.ladder.clone())?;
        self.ladder = ladder;
        let key = self.config.prefix_cache_key;
        self.config = SchedulerConfig {
            prefix_cache_key: key,
            ..new
        };
        Ok(())
    }

    // -- tenants ----------------------------------------------------------------

    pub fn add_tenant(&mut self, config: TenantConfig) -> KvResult<()> {
        let usable = self.usable_blocks();
        self.tenants.add(config, usable).map(|_| ())
    }

    /// Replace a tenant's configuration live. Its prefix namespace may change
    /// only while it has no live request (`TenantInUse`): a request keeps the
    /// namespace it was admitted in, and must not go on naming blocks in a
    /// group the tenant has left. A new tier applies to its waiting requests
    /// at once (preempted ones move to the new tier's resume queue).
    pub fn update_tenant(&mut self, config: TenantConfig, now: f64) -> KvResult<()> {
        let usable = self.usable_blocks();
        let Some(tid) = self.tenants.id(&config.name) else {
            return Err(KvError::UnknownTenant(config.name));
        };
        let old = self.tenants.get(tid);
        if old.config.prefix_namespace != config.prefix_namespace && old.live_requests > 0 {
            return Err(KvError::TenantInUse {
                tenant: config.name,
                live_requests: old.live_requests,
            });
        }
        let (old_tier, new_tier) = (old.config.tier, config.tier);
        self.tenants.update(config, usable, now)?;
        if old_tier != new_tier {
            self.refile_resuming(tid, new_tier);
        }
        Ok(())
    }

    /// Move `tid`'s preempted requests to the resume queue of `tier`, in
    /// admission order: the queue a request waits in is always its tier's, so
    /// priority preemption and entry agree on who goes first.
    fn refile_resuming(&mut self, tid: TenantId, tier: u32) {
        let mut moved = Vec::new();
        let slab = &self.slab;
        for q in self.resume.values_mut() {
            q.retain(|&s| {
                let mine = slab[s].as_ref().expect("live").tenant == tid;
                if mine {
                    moved.push(s);
                }
                !mine
            });
        }
        self.resume.retain(|_, q| !q.is_empty());
        for s in moved {
            let id = self.req(s).id;
            let queue = self.resume.entry(tier).or_default();
            let slab = &self.slab;
            let at = queue.partition_point(|&x| slab[x].as_ref().expect("live").id < id);
            queue.insert(at, s);
            self.req_mut(s).place = Place::Resuming(tier);
        }
    }

    /// Remove a tenant without live requests; its evictable prefix-cache pages
    /// are forgotten and freed, so a tenant added later under the same name
    /// starts cold.
    pub fn remove_tenant(&mut self, name: &str) -> KvResult<()> {
        let id = self.tenants.id(name);
        self.tenants.remove(name)?;
        if let Some(id) = id {
            self.pool.forget_tenant(id);
        }
        Ok(())
    }

    // -- requests ---------------------------------------------------------------

    /// Admit a request or say why not. A rejection changes nothing but the
    /// rejection counters.
    pub fn submit(
        &mut self,
        tenant: &str,
        prompt: &[i32],
        max_tokens: usize,
        now: f64,
    ) -> KvResult<u64> {
        self.submit_with_stops(tenant, prompt, max_tokens, &[], now)
    }

    /// `submit` with stop tokens: sampling one of them finishes the request.
    pub fn submit_with_stops(
        &mut self,
        tenant: &str,
        prompt: &[i32],
        max_tokens: usize,
        stop_token_ids: &[i32],
        now: f64,
    ) -> KvResult<u64> {
        let opts = SubmitOptions {
            stop_token_ids,
            cache_salt: None,
        };
        self.submit_with(tenant, prompt, max_tokens, &opts, now)
    }

    /// `submit` with options. The longest cached prefix of the prompt in the
    /// request's namespace (all but its last token at most, so there are logits
    /// to sample) is shared at once: prefill starts after it.
    pub fn submit_with(
        &mut self,
        tenant: &str,
        prompt: &[i32],
        max_tokens: usize,
        opts: &SubmitOptions<'_>,
        now: f64,
    ) -> KvResult<u64> {
        self.submit_inner(tenant, prompt, max_tokens, opts, &[], now)
    }

    /// `submit_with`, for a request that already generated `restored` tokens
    /// elsewhere: they lead its output, and the ladder's max_tokens cap does
    /// not apply (it was admitted before, with its max_tokens).
    fn submit_inner(
        &mut self,
        tenant: &str,
        prompt: &[i32],
        max_tokens: usize,
        opts: &SubmitOptions<'_>,
        restored: &[i32],
        now: f64,
    ) -> KvResult<u64> {
        let Some(tid) = self.tenants.id(tenant) else {
            self.rejected[RejectReason::UnknownTenant.index()] += 1;
            return Err(KvError::rejected(
                RejectReason::UnknownTenant,
                None,
                Some(tenant),
                format!("no tenant named {tenant:?}"),
            ));
        };
        if self.lifecycle != Lifecycle::Ready {
            let (reason, why) = match self.lifecycle {
                Lifecycle::Cold | Lifecycle::Warming => (RejectReason::NotReady, "warming up"),
                _ => (RejectReason::Draining, "draining: no new requests"),
            };
            self.tenants.get_mut(tid).counters.rejected[reason.index()] += 1;
            self.rejected[reason.index()] += 1;
            return Err(KvError::rejected(
                reason,
                Some(self.config.retry_after_hint_s),
                Some(tenant),
                why.to_owned(),
            ));
        }
        // What is wrong with the request itself is refused before the ladder
        // reads the pressure: such a refusal moves nothing but its counter.
        if let Err(rejection) = admission::check_request(
            self.tenants.get(tid),
            self.config.max_seq_len,
            prompt,
            max_tokens,
        ) {
            self.tenants.get_mut(tid).counters.rejected[rejection.reason.index()] += 1;
            self.rejected[rejection.reason.index()] += 1;
            return Err(KvError::Rejected(rejection));
        }
        self.update_ladder(now);
        let effects = self.ladder.effects();
        let asked = max_tokens;
        let max_tokens = match effects.cap_max_tokens {
            Some(c) if restored.is_empty() => max_tokens.min(c),
            _ => max_tokens,
        };
        let shed_tier = if effects.shed_lowest_tier {
            let tiers = self.tenants.iter().map(|(_, t)| t.config.tier);
            let (lo, hi) = tiers.fold((u32::MAX, 0), |(lo, hi), t| (lo.min(t), hi.max(t)));
            // The lowest tier, never the only one.
            (hi > lo).then_some(hi)
        } else {
            None
        };
        let capacity = Capacity {
            shed_tier,
            reject_fast_would_wait: effects.reject_fast && self.would_wait(tid),
            shed_retry_after: self.ladder.config().retry_after_s,
            block_size: self.config.block_size,
            max_seq_len: self.config.max_seq_len,
            usable_blocks: self.usable_blocks(),
            committed_blocks: self.tenants.committed(),
            live_requests: self.index.len(),
            max_live_requests: self.config.max_num_seqs + self.config.max_waiting,
            overcommit_watermark_blocks: match self.config.admission {
                AdmissionMode::Reserve => None,
                AdmissionMode::Overcommit { watermark_blocks } => Some(watermark_blocks),
            },
        };
        let mut hits: Vec<u32> = Vec::new();
        let mut hit_keys: Vec<BlockKey> = Vec::new();
        let mut newly_shared = 0;
        let namespace = match &self.hasher {
            Some(h) => {
                let t = self.tenants.get(tid);
                h.namespace(
                    tid,
                    &t.config.name,
                    t.config.prefix_namespace.as_deref(),
                    opts.cache_salt,
                )
            }
            None => Namespace {
                root: 0,
                scope: Scope::Tenant(tid),
            },
        };
        let max_hit_blocks = prompt.len().saturating_sub(1) / self.config.block_size;
        let reserve = matches!(self.config.admission, AdmissionMode::Reserve);
        let decision = {
            let (pool, hasher, bs) = (&self.pool, &self.hasher, self.config.block_size);
            let (hits, hit_keys, newly_shared) = (&mut hits, &mut hit_keys, &mut newly_shared);
            admission::decide(
                self.tenants.get(tid),
                &capacity,
                prompt,
                max_tokens,
                now,
                || {
                    // Over-committed, waiting requests must not pin pages (nothing
                    // could preempt them): the lookup waits for entry.
                    let Some(hasher) = hasher.as_ref().filter(|_| reserve) else {
                        return 0;
                    };
                    hits.reserve_exact(max_hit_blocks);
                    hit_keys.reserve_exact(max_hit_blocks);
                    lookup_prefix(
                        pool,
                        hasher,
                        bs,
                        namespace.root,
                        prompt,
                        max_hit_blocks,
                        hits,
                        hit_keys,
                    );
                    *newly_shared = hits
                        .iter()
                        .filter(|&&p| {
                            pool.refcount(p) > 0
                                && pool.cache().scope(p) == Some(Scope::Tenant(tid))
                        })
                        .count();
                    *newly_shared
                },
                |room| self.room_wait(tid, room),
            )
        };
        let admit = match decision {
            Ok(a) => a,
            Err(rejection) => {
                self.tenants.get_mut(tid).counters.rejected[rejection.reason.index()] += 1;
                self.rejected[rejection.reason.index()] += 1;
                return Err(KvError::Rejected(rejection));
            }
        };

        // An idle tenant rejoins at the lowest virtual time of its tier's active
        // tenants: it gets its fair share from now on, not a credit for the past.
        if self.tenants.get(tid).live_requests == 0 {
            let tier = self.tenants.get(tid).config.tier;
            let floor = self
                .tenants
                .iter()
                .filter(|(_, t)| t.config.tier == tier && t.live_requests > 0)
                .map(|(_, t)| t.vtime)
                .fold(f64::INFINITY, f64::min);
            let t = self.tenants.get_mut(tid);
            if floor.is_finite() {
                t.vtime = t.vtime.max(floor);
            }
        }
        self.tenants.reserve(tid, admit.blocks);
        let t = self.tenants.get_mut(tid);
        if let Some(bucket) = t.bucket.as_mut() {
            bucket.take(admit.rate_cost, now);
        }
        t.live_requests += 1;
        t.counters.admitted += 1;
        t.metrics.tokens_in += prompt.len() as u64;
        let cached_tokens = hits.len() * self.config.block_size;
        if self.hasher.is_some() && reserve {
            let m = &mut t.metrics;
            m.prefix_query_blocks += max_hit_blocks as u64;
            m.prefix_hit_blocks += hits.len() as u64;
            m.prefix_query_tokens += prompt.len() as u64;
            m.prefix_hit_tokens += cached_tokens as u64;
        }
        if !hits.is_empty() {
            t.used_blocks += hits.len();
            self.pool
                .retain(&hits)
                .map_err(|e| KvError::Internal(format!("a cache hit is not a cached page: {e}")))?;
            self.tenants.share(tid, newly_shared, 0);
        }

        let id = self.next_id;
        self.next_id += 1;
        self.clock = self.clock.max(now);
        let mut tokens = Vec::with_capacity(prompt.len() + max_tokens);
        tokens.extend_from_slice(prompt);
        tokens.extend_from_slice(restored);
        let req = Request {
            id,
            tenant: tid,
            tokens,
            prompt_len: prompt.len(),
            max_tokens,
            stop_token_ids: opts.stop_token_ids.to_vec(),
            reserved_blocks: admit.blocks,
            pages: hits,
            num_computed: cached_tokens,
            block_keys: hit_keys,
            namespace,
            cached_tokens,
            place: Place::Queued,
            row_key: 0,
            arrival: now,
            first_scheduled: None,
            first_token: None,
            last_token: None,
            preemptions: 0,
            cache_salt: opts.cache_salt.map(<[u8]>::to_vec),
            waiting_since: now,
        };
        let slab = match self.free_slab.pop() {
            Some(s) => {
                self.slab[s] = Some(req);
                s
            }
            None => {
                self.slab.push(Some(req));
                self.slab.len() - 1
            }
        };
        self.index.insert(id, slab);
        self.tenants.get_mut(tid).waiting.push_back(slab);
        if max_tokens < asked {
            let tenant = self.tenants.get(tid).config.name.clone();
            self.push_event(SchedulerEvent::MaxTokensCapped {
                request: id,
                tenant,
                asked,
                admitted: max_tokens,
                at: now,
            });
        }
        Ok(id)
    }

    // -- the ladder and events ----------------------------------------------------

    /// The ladder's signals now.
    pub fn pressure(&self, now: f64) -> Pressure {
        let usable = self.usable_blocks();
        let oldest = self
            .tenants
            .iter()
            .filter_map(|(_, t)| t.waiting.front())
            .chain(self.resume.values().filter_map(|q| q.front()))
            .map(|&s| self.req(s).waiting_since)
            .fold(f64::INFINITY, f64::min);
        Pressure {
            reserved_share: if usable == 0 {
                1.0
            } else {
                self.tenants.committed() as f64 / usable as f64
            },
            queue_depth: (self.index.len() - self.running.len()) as f64,
            oldest_wait_s: if oldest.is_finite() {
                (now - oldest).max(0.0)
            } else {
                0.0
            },
        }
    }

    fn update_ladder(&mut self, now: f64) {
        if self.ladder.config().rungs.is_empty() {
            return;
        }
        let p = self.pressure(now);
        let mut moves = Vec::new();
        self.ladder.update(&p, now, &mut moves);
        for m in moves {
            self.push_event(SchedulerEvent::Ladder(m));
        }
    }

    fn push_event(&mut self, e: SchedulerEvent) {
        if self.events.len() == MAX_PENDING_EVENTS {
            self.events.pop_front();
            self.events_dropped += 1;
        }
        self.events.push_back(e);
    }

    /// Events since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<SchedulerEvent> {
        self.events.drain(..).collect()
    }

    /// Events dropped because nobody took them in time.
    pub fn events_dropped(&self) -> u64 {
        self.events_dropped
    }

    pub fn ladder(&self) -> &Ladder {
        &self.ladder
    }

    /// Whether a new request of tenant `tid` would have to wait for a slot:
    /// the sequences it cannot pass (running ones of its tier or above, or all
    /// of them without priority preemption) and the requests waiting ahead of
    /// it (of its tier or above) take every slot.
    fn would_wait(&self, tid: TenantId) -> bool {
        let tier = self.tenants.get(tid).config.tier;
        let ahead: usize = self
            .tenants
            .iter()
            .filter(|(_, t)| t.config.tier <= tier)
            .map(|(_, t)| {
                let running = if self.config.preempt_lower_tiers {
                    t.running as usize
                } else {
                    0
                };
                running + t.waiting.len() + t.resuming as usize
            })
            .sum();
        let running = if self.config.preempt_lower_tiers {
            0
        } else {
            self.running.len()
        };
        running + ahead >= self.max_running()
    }

    /// Most sequences that may run now: max_num_seqs, or less while a ladder
    /// rung says so.
    pub fn max_running(&self) -> usize {
        let cap = self.ladder.effects().max_running.unwrap_or(usize::MAX);
        self.config.max_num_seqs.min(cap)
    }

    fn req(&self, slab: usize) -> &Request {
        self.slab[slab].as_ref().expect("live slab entry")
    }

    fn req_mut(&mut self, slab: usize) -> &mut Request {
        self.slab[slab].as_mut().expect("live slab entry")
    }

    /// Remove a request from wherever it sits, free its pages and reservation.
    fn release(&mut self, slab: usize) -> Request {
        match self.req(slab).place {
            Place::Running(pos) => self.remove_running(pos),
            Place::Queued | Place::Resuming(_) => self.remove_waiting(slab),
        }
        let req = self.slab[slab].take().expect("live slab entry");
        self.free_slab.push(slab);
        self.index.remove(&req.id);
        self.drop_pages(req.tenant, &req.pages);
        self.tenants.release(req.tenant, req.reserved_blocks);
        let t = self.tenants.get_mut(req.tenant);
        t.used_blocks -= req.pages.len();
        t.live_requests -= 1;
        req
    }

    fn remove_waiting(&mut self, slab: usize) {
        let (tid, place) = (self.req(slab).tenant, self.req(slab).place);
        match place {
            Place::Queued => {
                let t = self.tenants.get_mut(tid);
                let i = t.waiting.iter().position(|&s| s == slab).expect("queued");
                t.waiting.remove(i);
            }
            Place::Resuming(tier) => {
                let queue = self
                    .resume
                    .get_mut(&tier)
                    .expect("resume queue of its tier");
                let i = queue.iter().position(|&s| s == slab).expect("queued");
                queue.remove(i);
                if queue.is_empty() {
                    self.resume.remove(&tier);
                }
                self.tenants.get_mut(tid).resuming -= 1;
            }
            Place::Running(_) => unreachable!("not waiting"),
        }
    }

    // -- the running set ----------------------------------------------------------

    fn set_pos(&mut self, pos: usize) {
        let slab = self.running[pos];
        self.req_mut(slab).place = Place::Running(pos);
    }

    /// Take the sequence at `pos` out of the running set. Decodes fill a hole by
    /// swapping (their order does not matter); prefills keep their entry order.
    fn remove_running(&mut self, pos: usize) {
        let slab = self.running[pos];
        if pos < self.num_decode {
            let last = self.num_decode - 1;
            self.running.swap(pos, last);
            self.set_pos(pos);
            self.num_decode -= 1;
            self.running.remove(last);
            for p in last..self.running.len() {
                self.set_pos(p);
            }
        } else {
            self.running.remove(pos);
            for p in pos..self.running.len() {
                self.set_pos(p);
            }
        }
        let tid = self.req(slab).tenant;
        self.tenants.get_mut(tid).running -= 1;
        // Its caller puts it somewhere (a resume queue) or drops it.
        self.req_mut(slab).place = Place::Queued;
    }

    /// A prefill sequence that sampled its first token becomes a decode.
    fn promote_to_decode(&mut self, pos: usize) {
        debug_assert!(pos >= self.num_decode);
        let slab = self.running.remove(pos);
        self.running.insert(self.num_decode, slab);
        self.num_decode += 1;
        for p in self.num_decode - 1..=pos {
            self.set_pos(p);
        }
    }

    fn enter_running(&mut self, slab: usize, now: f64) {
        self.running.push(slab);
        let pos = self.running.len() - 1;
        let key = self.next_row_key;
        self.next_row_key += 1;
        let r = self.req_mut(slab);
        r.place = Place::Running(pos);
        r.row_key = key;
        let queued = r.first_scheduled.is_none().then_some(now - r.arrival);
        r.first_scheduled.get_or_insert(now);
        let tid = r.tenant;
        let t = self.tenants.get_mut(tid);
        t.running += 1;
        if let Some(q) = queued {
            t.metrics.queue_time.observe(q);
        }
    }

    /// Drop a request's references on `pages` (last to first), keeping the
    /// tenant's shared-page count exact.
    fn drop_pages(&mut self, tid: TenantId, pages: &[u32]) {
        if self.hasher.is_some() && matches!(self.config.admission, AdmissionMode::Reserve) {
            let dropped = pages
                .iter()
                .filter(|&&p| {
                    self.pool.refcount(p) >= 2
                        && self.pool.cache().scope(p) == Some(Scope::Tenant(tid))
                })
                .count();
            if dropped > 0 {
                self.tenants.share(tid, 0, dropped);
            }
        }
        self.pool
            .free(pages)
            .expect("a request's pages are allocated and its own");
    }

    /// Preempt the running sequence at `pos` and queue it at the head of its
    /// tier. Over-committed, its pages go back (cached blocks stay evictable,
    /// tail first) and it is recomputed later from what the cache still holds.
    /// In reserve mode its pages are reserved anyway: it keeps its KV and only
    /// gives up its slot.
    fn preempt(&mut self, pos: usize, preempted: &mut Vec<u64>) {
        let slab = self.running[pos];
        self.remove_running(pos);
        let mut dropped = 0;
        if matches!(self.config.admission, AdmissionMode::Overcommit { .. }) {
            let pages = std::mem::take(&mut self.req_mut(slab).pages);
            let tid = self.req(slab).tenant;
            self.drop_pages(tid, &pages);
            dropped = pages.len();
            self.req_mut(slab).num_computed = 0;
        }
        let now = self.last_step_at;
        let r = self.req_mut(slab);
        r.preemptions += 1;
        r.waiting_since = now.unwrap_or(r.waiting_since);
        let (id, tid) = (r.id, r.tenant);
        let t = self.tenants.get_mut(tid);
        t.used_blocks -= dropped;
        t.metrics.preemptions += 1;
        t.resuming += 1;
        let tier = t.config.tier;
        self.preemptions += 1;
        self.req_mut(slab).place = Place::Resuming(tier);
        let queue = self.resume.entry(tier).or_default();
        // Admission order (request ids grow with it) within the resume queue.
        let at = queue.partition_point(|&s| self.slab[s].as_ref().expect("live").id < id);
        queue.insert(at, slab);
        preempted.push(id);
    }

    /// The running sequence to preempt: lowest tier, most recently admitted;
    /// only of a tier strictly below `below_tier` when given.
    fn victim(&self, below_tier: Option<u32>) -> Option<usize> {
        self.running
            .iter()
            .enumerate()
            .map(|(pos, &slab)| {
                let r = self.req(slab);
                (self.tenants.get(r.tenant).config.tier, r.id, pos)
            })
            .filter(|&(tier, _, _)| below_tier.is_none_or(|b| tier > b))
            .max()
            .map(|(_, _, pos)| pos)
    }

    /// The next request to enter the running set, and where it waits.
    fn peek_waiting(&self) -> Option<(usize, WaitFrom)> {
        let best_tenant = self
            .tenants
            .iter()
            .filter(|(_, t)| !t.waiting.is_empty())
            .min_by(|(ia, a), (ib, b)| {
                (a.config.tier, a.vtime, *ia)
                    .partial_cmp(&(b.config.tier, b.vtime, *ib))
                    .expect("virtual times are finite")
            })
            .map(|(id, t)| (t.config.tier, id));
        let best_resume = self.resume.iter().next().map(|(&tier, q)| (tier, q[0]));
        match (best_resume, best_tenant) {
            (Some((rt, slab)), Some((tt, _))) if rt <= tt => Some((slab, WaitFrom::Resume(rt))),
            (Some((rt, slab)), None) => Some((slab, WaitFrom::Resume(rt))),
            (_, Some((_, tid))) => Some((self.tenants.get(tid).waiting[0], WaitFrom::Tenant(tid))),
            (None, None) => None,
        }
    }

    fn pop_waiting(&mut self, slab: usize, from: WaitFrom) {
        match from {
            WaitFrom::Tenant(tid) => {
                let popped = self.tenants.get_mut(tid).waiting.pop_front();
                debug_assert_eq!(popped, Some(slab));
            }
            WaitFrom::Resume(tier) => {
                let q = self.resume.get_mut(&tier).expect("resume queue");
                let popped = q.pop_front();
                debug_assert_eq!(popped, Some(slab));
                if q.is_empty() {
                    self.resume.remove(&tier);
                }
                let tid = self.req(slab).tenant;
                self.tenants.get_mut(tid).resuming -= 1;
            }
        }
    }

    /// Prefill tokens the step still has room for. When decodes alone fill a
    /// (capped) step, the first prefill still moves by up to the cap: a cap
    /// below the number of running decodes must not stall prefill, and with it
    /// the entry of new requests, until those decodes finish.
    fn prefill_room(&self, budget: usize, scheduled: usize, num_decode: usize) -> usize {
        let room = budget.saturating_sub(scheduled);
        if room == 0 && scheduled == num_decode {
            budget.min(self.config.max_batched_tokens.saturating_sub(scheduled))
        } else {
            room
        }
    }

    /// Tokens of `slab`'s prefill that fit `budget`, the chunk cap and (over-committed)
    /// the free pages.
    fn prefill_chunk(&self, slab: usize, budget: usize) -> usize {
        let r = self.req(slab);
        let mut chunk = r.need().min(self.config.long_prefill_chunk).min(budget);
        if matches!(self.config.admission, AdmissionMode::Overcommit { .. }) {
            let coverable =
                (r.pages.len() + self.pool.available()) * self.config.block_size - r.num_computed;
            chunk = chunk.min(coverable);
        }
        chunk
    }

    /// Over-committed, a request shares the cached prefix of its tokens when it
    /// is about to enter the running set (first entry, or back after a
    /// preemption: its own blocks, released tail first, are likely still
    /// cached), so only the rest is computed.
    fn acquire_prefix(&mut self, slab: usize) {
        let Some(hasher) = &self.hasher else { return };
        let bs = self.config.block_size;
        let r = self.slab[slab].as_mut().expect("live slab entry");
        debug_assert!(r.pages.is_empty() && r.num_computed == 0);
        let limit = r.tokens.len().saturating_sub(1) / bs;
        let mut pages = Vec::new();
        let mut parent = r.namespace.root;
        for b in 0..limit {
            // Keys named before a preemption are still right: they follow content.
            let key = match r.block_keys.get(b) {
                Some(&k) => k,
                None => {
                    let k = hasher.block(parent, &r.tokens[b * bs..(b + 1) * bs]);
                    r.block_keys.push(k);
                    k
                }
            };
            match self.pool.cache().lookup(key) {
                Some(p) => pages.push(p),
                None => break,
            }
            parent = key;
        }
        r.block_keys.truncate(pages.len());
        let tid = r.tenant;
        // No admission credit for sharing here: over-committed, a preemption
        // would take it back and push the promise past the pool.
        self.pool.retain(&pages).expect("cached pages");
        self.tenants.get_mut(tid).used_blocks += pages.len();
        let r = self.req_mut(slab);
        r.num_computed = pages.len() * bs;
        r.pages = pages;
    }

    /// Undo `acquire_prefix` for a request that did not enter after all.
    fn release_prefix(&mut self, slab: usize) {
        let r = self.req_mut(slab);
        if r.pages.is_empty() {
            return;
        }
        let pages = std::mem::take(&mut r.pages);
        r.num_computed = 0;
        let tid = r.tenant;
        self.drop_pages(tid, &pages);
        self.tenants.get_mut(tid).used_blocks -= pages.len();
    }

    /// Over-committed, hit rates count a request's lookup when it first enters.
    fn count_first_lookup(&mut self, slab: usize) {
        let bs = self.config.block_size;
        let r = self.req_mut(slab);
        r.cached_tokens = r.num_computed;
        let (tid, prompt_len, hit) = (r.tenant, r.prompt_len, r.num_computed);
        let m = &mut self.tenants.get_mut(tid).metrics;
        m.prefix_query_blocks += (prompt_len.saturating_sub(1) / bs) as u64;
        m.prefix_hit_blocks += (hit / bs) as u64;
        m.prefix_query_tokens += prompt_len as u64;
        m.prefix_hit_tokens += hit as u64;
    }

    /// Pages so that `slab` covers `len` tokens.
    fn grow_pages(&mut self, slab: usize, len: usize) -> KvResult<()> {
        let r = self.slab[slab].as_mut().expect("live slab entry");
        let need = self.pool.blocks_for(len).saturating_sub(r.pages.len());
        if need == 0 {
            return Ok(());
        }
        if matches!(self.config.admission, AdmissionMode::Reserve)
            && r.pages.len() + need > r.reserved_blocks
        {
            return Err(KvError::Internal(format!(
                "request {} would exceed its reservation",
                r.id
            )));
        }
        self.pool
            .allocate_into(need, &mut r.pages)
            .map_err(|e| KvError::Internal(format!("a page the plan counted on is gone: {e}")))?;
        self.tenants.get_mut(r.tenant).used_blocks += need;
        Ok(())
    }

    // -- one step -------------------------------------------------------------------

    /// Plan the next step into `bufs`, which must be the buffer set
    /// `next_parity()` names: each set's page-table rows are updated against
    /// what that set held two steps ago, so passing any other buffer leaves stale
    /// rows (only `full_validation` would catch it). Returns None when nothing can
    /// run. The plan must be committed before the next step.
    pub fn step(&mut self, now: f64, bufs: &mut PlanBuffers<'_>) -> KvResult<Option<StepOutcome>> {
        if self.pending.is_some() {
            return Err(KvError::StalePlan(
                "the previous plan was not committed; commit it first".into(),
            ));
        }
        if let Some(last) = self.last_step_at {
            self.step_gap.observe((now - last).max(0.0));
        }
        self.last_step_at = Some(now);
        self.clock = self.clock.max(now);
        if self.lifecycle == Lifecycle::Draining && now >= self.drain_deadline {
            self.hand_back_all(now);
        }
        if self.lifecycle == Lifecycle::Draining && self.index.is_empty() {
            self.lifecycle = Lifecycle::Drained;
        }
        self.update_ladder(now);
        let mut preempted = Vec::new();
        if self.config.preempt_lower_tiers {
            self.preempt_for_higher_tiers(&mut preempted);
        }

        // Decodes first: every running decode sequence gets its token.
        self.decode_pages(&mut preempted)?;
        let num_decode = self.num_decode;
        let mut q_lens: Vec<usize> = vec![1; num_decode];
        let mut scheduled = num_decode;

        // A tenant's max_step_tokens shrinks the step while one of its sequences runs.
        let budget_cap = self
            .tenants
            .iter()
            .filter(|(_, t)| t.running > 0)
            .filter_map(|(_, t)| t.config.max_step_tokens)
            .min();
        let mut budget = self
            .config
            .max_batched_tokens
            .min(budget_cap.unwrap_or(usize::MAX));

        // Prefills already running resume where they stopped, in entry order.
        let overcommit = matches!(self.config.admission, AdmissionMode::Overcommit { .. });
        let mut pos = num_decode;
        while pos < self.running.len() {
            let slab = self.running[pos];
            let room = self.prefill_room(budget, scheduled, num_decode);
            let chunk = self.prefill_chunk(slab, room);
            if chunk == 0 {
                if overcommit && scheduled == 0 {
                    // Nothing runs and no page is free: the running prefills hold
                    // the pool between them. Preempt (lowest tier, most recently
                    // admitted) until the first of them can move.
                    let victim = self.victim(None).expect("a prefill is running");
                    self.preempt(victim, &mut preempted);
                    continue;
                }
                break;
            }
            let len = self.req(slab).num_computed + chunk;
            self.grow_pages(slab, len)?;
            q_lens.push(chunk);
            scheduled += chunk;
            pos += 1;
        }

        // New sequences enter while there are slots and budget. The best waiting
        // request holds the line: nothing of lower priority passes it.
        if pos == self.running.len() {
            let max_running = self.max_running();
            while self.running.len() < max_running {
                let Some((slab, from)) = self.peek_waiting() else {
                    break;
                };
                if overcommit && self.req(slab).pages.is_empty() {
                    self.acquire_prefix(slab);
                }
                let cap = self
                    .tenants
                    .get(self.req(slab).tenant)
                    .config
                    .max_step_tokens;
                let entry_budget = budget.min(cap.unwrap_or(usize::MAX));
                let room = self.prefill_room(entry_budget, scheduled, num_decode);
                let chunk = self.prefill_chunk(slab, room);
                if chunk == 0 {
                    if overcommit {
                        self.release_prefix(slab);
                    }
                    break;
                }
                if overcommit && self.hasher.is_some() && self.req(slab).first_scheduled.is_none() {
                    self.count_first_lookup(slab);
                }
                budget = entry_budget;
                self.pop_waiting(slab, from);
                self.enter_running(slab, now);
                let len = self.req(slab).num_computed + chunk;
                self.grow_pages(slab, len)?;
                q_lens.push(chunk);
                scheduled += chunk;
            }
        }

        if q_lens.is_empty() {
            // Preemptions of a step that runs nothing are reported with the next plan.
            self.unreported_preempted.extend(preempted);
            self.last_plan_at = None;
            return Ok(None);
        }
        if !self.unreported_preempted.is_empty() {
            let mut all = std::mem::take(&mut self.unreported_preempted);
            all.extend(preempted);
            preempted = all;
        }
        let parity = self.next_parity();
        let n = q_lens.len();
        self.served.resize(self.tenants.slots_len(), 0);
        let mut seqs = Vec::with_capacity(n);
        let mut request_ids = Vec::with_capacity(n);
        let mut samples = Vec::with_capacity(n);
        let written = {
            // One pass over the scheduled sequences writes the arrays and records
            // what commit needs (disjoint fields, so the borrows coexist).
            let slab = &self.slab;
            let served = &mut self.served;
            let scheduled =
                self.running[..n]
                    .iter()
                    .zip(&q_lens)
                    .enumerate()
                    .map(|(pos, (&s, &q))| {
                        let r = slab[s].as_ref().expect("running request");
                        let done = r.num_computed + q == r.tokens.len();
                        served[r.tenant] += q;
                        seqs.push(PendingSeq {
                            slab: s,
                            id: r.id,
                            q_len: q,
                            samples: done,
                            decode: pos < num_decode,
                        });
                        request_ids.push(r.id);
                        samples.push(done);
                        SeqSlice {
                            row_key: r.row_key,
                            tokens: &r.tokens,
                            start: r.num_computed,
                            q_len: q,
                            pages: &r.pages,
                        }
                    });
            planner::write_plan(
                &self.shape,
                &self.buckets,
                bufs,
                &mut self.rows[parity],
                num_decode,
                &self.pool,
                scheduled,
            )?
        };
        if cfg!(debug_assertions) || self.config.full_validation {
            planner::validate(&self.shape, bufs, &written, &self.pool)?;
        }
        // Weighted fair share: virtual time grows by tokens served / weight (summed
        // per tenant first: one division per tenant, not per sequence).
        for (tid, tokens) in self.served.iter_mut().enumerate() {
            if *tokens > 0 {
                let t = self.tenants.get_mut(tid);
                t.vtime += *tokens as f64 / t.config.weight;
                *tokens = 0;
            }
        }

        // The step rate: gaps between consecutive steps that both ran something.
        if let Some(prev) = self.last_plan_at {
            let gap = now - prev;
            if gap > 0.0 {
                if self.step_gaps.len() == STEP_GAP_WINDOW {
                    self.step_gaps.pop_front();
                }
                self.step_gaps.push_back(gap);
            }
        }
        self.last_plan_at = Some(now);
        let step_id = (self.instance << STEP_ID_BITS) | (self.steps % (1 << STEP_ID_BITS));
        self.steps += 1;
        self.pending = Some(Pending {
            step_id,
            seqs,
            preempted: preempted.clone(),
        });
        Ok(Some(StepOutcome {
            step_id,
            parity,
            num_seqs: written.num_seqs,
            num_decode,
            num_tokens: written.num_tokens,
            bucket: written.bucket,
            request_ids,
            samples,
            preempted,
        }))
    }

    /// Priority preemption: the best waiting request, if of a higher tier than
    /// some running sequence, takes its slot (or, over-committed, its pages).
    fn preempt_for_higher_tiers(&mut self, preempted: &mut Vec<u64>) {
        loop {
            let Some((slab, _)) = self.peek_waiting() else {
                return;
            };
            let tier = self.tenants.get(self.req(slab).tenant).config.tier;
            let no_slot = self.running.len() >= self.max_running();
            let no_room = match self.config.admission {
                AdmissionMode::Reserve => false,
                AdmissionMode::Overcommit { .. } => {
                    let first = self.req(slab).need().min(self.config.long_prefill_chunk);
                    self.pool.blocks_for(first) > self.pool.available()
                }
            };
            if !(no_slot || no_room) {
                return;
            }
            let Some(pos) = self.victim(Some(tier)) else {
                return;
            };
            self.preempt(pos, preempted);
        }
    }

    /// Give every decode sequence the page its next token needs. Over-committed,
    /// preempt (lowest tier, most recently admitted) until they fit.
    fn decode_pages(&mut self, preempted: &mut Vec<u64>) -> KvResult<()> {
        // Reserve mode needs no count: every page is within a reservation.
        if matches!(self.config.admission, AdmissionMode::Overcommit { .. }) {
            loop {
                let need = self.running[..self.num_decode]
                    .iter()
                    .filter(|&&s| {
                        let r = self.req(s);
                        self.pool.blocks_for(r.num_computed + 1) > r.pages.len()
                    })
                    .count();
                if need <= self.pool.available() {
                    break;
                }
                let pos = self.victim(None).expect("decodes are running");
                self.preempt(pos, preempted);
            }
        }
        let bs = self.shape.block_size;
        for i in 0..self.num_decode {
            let slab = self.running[i];
            let r = self.req(slab);
            // Fifteen steps in sixteen (block 16) the page is already there.
            if bs.blocks_for(r.num_computed + 1) > r.pages.len() {
                let len = r.num_computed + 1;
                self.grow_pages(slab, len)?;
            }
        }
        Ok(())
    }

    /// Close step `step_id` with one sampled token per sequence, in plan order.
    /// Checks everything first: on an error nothing changes. Its `finished`
    /// also delivers the terminal events queued since the last delivery (see
    /// `take_finished`).
    pub fn commit(&mut self, step_id: u64, sampled: &[i32], now: f64) -> KvResult<CommitEvents> {
        let pending = self.pending.as_ref().ok_or_else(|| {
            KvError::StalePlan(format!(
                "no plan is pending (step {step_id} already committed?)"
            ))
        })?;
        if pending.step_id != step_id {
            return Err(KvError::StalePlan(format!(
                "plan of step {step_id} committed, step {} is pending",
                pending.step_id
            )));
        }
        if sampled.len() != pending.seqs.len() {
            return Err(KvError::InvalidState(format!(
                "{} sampled ids for a plan of {} sequences",
                sampled.len(),
                pending.seqs.len()
            )));
        }
        if let Some(k) = pending
            .seqs
            .iter()
            .zip(sampled)
            .position(|(s, &tok)| s.samples && tok < 0)
        {
            return Err(KvError::InvalidState(format!(
                "sampled id {} of sequence {k} is negative",
                sampled[k]
            )));
        }
        let pending = self.pending.take().expect("checked above");
        let mut events = CommitEvents {
            request_ids: Vec::with_capacity(pending.seqs.len()),
            tokens: Vec::with_capacity(pending.seqs.len()),
            finished: Vec::new(),
            preempted: pending.preempted,
        };
        let mut done: Vec<(usize, FinishReason)> = Vec::new();
        for (s, &token) in pending.seqs.iter().zip(sampled) {
            // Cancelled since the plan was made (its slot may hold a newer request).
            match &self.slab[s.slab] {
                Some(r) if r.id == s.id => {}
                _ => continue,
            }
            let r = self.slab[s.slab].as_mut().expect("checked");
            r.num_computed += s.q_len;
            if let Some(hasher) = &self.hasher {
                // Name the blocks this step filled; the first copy of a block
                // stays the cached one.
                let (full, _) = self.shape.block_size.split(r.num_computed);
                let bs = self.config.block_size;
                while r.block_keys.len() < full {
                    let b = r.block_keys.len();
                    let parent = r.block_keys.last().copied().unwrap_or(r.namespace.root);
                    let key = hasher.block(parent, &r.tokens[b * bs..(b + 1) * bs]);
                    let page = r.pages[b];
                    if !self.pool.cache().is_cached(page) {
                        self.pool.register(page, key, r.namespace.scope);
                    }
                    r.block_keys.push(key);
                }
            }
            let t = self.tenants.get_mut(r.tenant);
            if !s.decode {
                t.metrics.prefill_tokens += s.q_len as u64;
            }
            if !s.samples {
                continue;
            }
            r.tokens.push(token);
            match r.last_token {
                None => t.metrics.ttft.observe(now - r.arrival),
                Some(last) => t.metrics.inter_token.observe(now - last),
            }
            r.first_token.get_or_insert(now);
            r.last_token = Some(now);
            t.metrics.tokens_out += 1;
            events.request_ids.push(r.id);
            events.tokens.push(token);
            let reason = if !r.stop_token_ids.is_empty() && r.stop_token_ids.contains(&token) {
                Some(FinishReason::Stop)
            } else if r.generated() >= r.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            match (reason, r.place) {
                (Some(reason), _) => done.push((s.slab, reason)),
                (None, Place::Running(pos)) if pos >= self.num_decode => {
                    self.promote_to_decode(pos)
                }
                _ => {}
            }
        }
        for (slab, reason) in done {
            let req = self.release(slab);
            let t = self.tenants.get_mut(req.tenant);
            t.counters.finished += 1;
            t.metrics.e2e.observe(now - req.arrival);
            let record = self.finished_record(&req, reason, now);
            events.finished.push(record);
        }
        if self.lifecycle == Lifecycle::Draining {
            self.drain_finished.extend(events.finished.iter().cloned());
            if self.index.is_empty() {
                self.lifecycle = Lifecycle::Drained;
            }
        }
        self.clock = self.clock.max(now);
        // Terminal events of requests ended since the last delivery go first.
        if !self.ended.is_empty() {
            let mut all = std::mem::take(&mut self.ended);
            all.append(&mut events.finished);
            events.finished = all;
        }
        Ok(events)
    }

    // -- stats and invariants -----------------------------------------------------------

    pub fn stats(&self, now: f64) -> SchedulerStats {
        let total = self.pool.total();
        let mut reserved = 0;
        let mut tenants: Vec<TenantStats> = self
            .tenants
            .iter()
            .map(|(_, t)| {
                reserved += t.reserved_blocks;
                TenantStats {
                    name: t.config.name.clone(),
                    tier: t.config.tier,
                    weight: t.config.weight,
                    kv_floor_blocks: t.config.kv_floor_blocks,
                    kv_cap_blocks: t.config.kv_cap_blocks,
                    reserved_blocks: t.reserved_blocks,
                    used_blocks: t.used_blocks,
                    shared_blocks: t.shared_blocks,
                    live_requests: t.live_requests,
                    waiting: t.waiting.len() + t.resuming as usize,
                    running: t.running,
                    admitted: t.counters.admitted,
                    finished: t.counters.finished,
                    cancelled: t.counters.cancelled,
                    rejected: t.counters.rejected,
                    rate_tokens_available: t.bucket.as_ref().map(|b| b.level_at(now)),
                    metrics: t.metrics.clone(),
                    vtime: t.vtime,
                }
            })
            .collect();
        tenants.sort_by(|a, b| a.name.cmp(&b.name));
        SchedulerStats {
            pool: PoolStats {
                num_blocks: self.pool.num_blocks(),
                block_size: self.pool.block_size(),
                total,
                free: self.pool.free_count(),
                used: self.pool.used(),
                cached: self.pool.cache().cached(),
                evictable: self.pool.cache().evictable(),
                evictions: self.pool.cache().evictions(),
                shared: self.pool.shared(),
                overhead_reserve: self.config.reserve_blocks(total),
                usable: self.usable_blocks(),
                reserved,
                committed: self.tenants.committed(),
            },
            tenants,
            live_requests: self.index.len(),
            running: self.running.len(),
            waiting: self.index.len() - self.running.len(),
            steps: self.steps,
            step_gap: self.step_gap.clone(),
            rejected: self.rejected,
            preemptions: self.preemptions,
        }
    }

    /// Every cross-structure invariant, for tests: pages conserved and owned once,
    /// usage within reservations (reserve mode), reservations within the usable
    /// pool, floors honoured, the running set and queues consistent.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        let reserve_mode = matches!(self.config.admission, AdmissionMode::Reserve);
        let n_tenants = self.tenants.iter().map(|(id, _)| id + 1).max().unwrap_or(0);
        let mut reserved = vec![0usize; n_tenants];
        let mut used = vec![0usize; n_tenants];
        let mut live = vec![0u32; n_tenants];
        let mut running = vec![0u32; n_tenants];
        let mut resuming = vec![0u32; n_tenants];
        // References each page gets from requests, and from which tenant's
        // requests (for the shared-page accounting).
        let mut refs = vec![0u32; self.pool.num_blocks()];
        let mut refs_by_scope_tenant = vec![0u32; self.pool.num_blocks()];
        if self.num_decode > self.running.len() {
            return Err("num_decode exceeds the running set".into());
        }
        let mut seen = 0;
        for (slab, r) in self.slab.iter().enumerate() {
            let Some(r) = r else { continue };
            seen += 1;
            if self.index.get(&r.id) != Some(&slab) {
                return Err(format!("request {} missing from the index", r.id));
            }
            if reserve_mode && r.pages.len() > r.reserved_blocks {
                return Err(format!("request {} holds more pages than reserved", r.id));
            }
            let bs = self.config.block_size;
            if r.pages.len() < r.num_computed.div_ceil(bs)
                || r.pages.len() > r.tokens.len().div_ceil(bs)
            {
                return Err(format!("request {} pages do not match its KV", r.id));
            }
            match r.place {
                Place::Running(pos) => {
                    if self.running.get(pos) != Some(&slab) {
                        return Err(format!("request {} is not where it thinks it runs", r.id));
                    }
                    if pos < self.num_decode && !(r.need() == 1 && r.generated() > 0) {
                        return Err(format!("request {} is in the decode region", r.id));
                    }
                    running[r.tenant] += 1;
                }
                Place::Queued | Place::Resuming(_) => {
                    // Waiting, it holds cache hits or (preempted in reserve
                    // mode) the KV it computed; never a page beyond that.
                    if r.pages.len() != r.num_computed.div_ceil(bs) {
                        return Err(format!(
                            "waiting request {} holds pages it has not filled",
                            r.id
                        ));
                    }
                    let queued = match r.place {
                        Place::Resuming(tier) => {
                            resuming[r.tenant] += 1;
                            self.resume.get(&tier).is_some_and(|q| q.contains(&slab))
                        }
                        _ => self.tenants.get(r.tenant).waiting.contains(&slab),
                    };
                    if !queued {
                        return Err(format!("request {} is not in the queue it names", r.id));
                    }
                }
            }
            let cache = self.pool.cache();
            for (b, &p) in r.pages.iter().enumerate() {
                refs[p as usize] += 1;
                if cache.scope(p) == Some(Scope::Tenant(r.tenant)) {
                    refs_by_scope_tenant[p as usize] += 1;
                }
                // A cached page holds exactly the block the request's chain names.
                match (cache.key_of(p), r.block_keys.get(b)) {
                    (Some(k), Some(&mine)) if k != mine => {
                        return Err(format!(
                            "request {} page {p} is cached under another name",
                            r.id
                        ))
                    }
                    (Some(_), None) => {
                        return Err(format!("request {} shares page {p} it has not named", r.id))
                    }
                    _ => {}
                }
            }
            if self.hasher.is_some()
                && !r.pages.is_empty()
                && r.block_keys.len() != r.num_computed / bs
            {
                return Err(format!(
                    "request {} names {} blocks, has computed {}",
                    r.id,
                    r.block_keys.len(),
                    r.num_computed
                ));
            }
            reserved[r.tenant] += r.reserved_blocks;
            used[r.tenant] += r.pages.len();
            live[r.tenant] += 1;
        }
        if seen != self.index.len() {
            return Err("index and slab disagree".into());
        }
        for (p, &n) in refs.iter().enumerate() {
            if n != self.pool.refcount(p as u32) {
                return Err(format!(
                    "page {p}: requests hold {n} references, the pool counts {}",
                    self.pool.refcount(p as u32)
                ));
            }
        }
        let mut shared = vec![0usize; n_tenants];
        // Sharing earns admission room in reserve mode only.
        for (p, &n) in refs_by_scope_tenant
            .iter()
            .enumerate()
            .filter(|_| reserve_mode)
        {
            if let Some(Scope::Tenant(t)) = self.pool.cache().scope(p as u32) {
                if t < n_tenants {
                    shared[t] += n.saturating_sub(1) as usize;
                }
            }
        }
        let queued: usize = self
            .tenants
            .iter()
            .map(|(_, t)| t.waiting.len())
            .sum::<usize>()
            + self.resume.values().map(VecDeque::len).sum::<usize>();
        if queued + self.running.len() != self.index.len() {
            return Err("queues and running set do not cover the live requests".into());
        }
        let usable = self.usable_blocks();
        let mut committed = 0;
        for (id, t) in self.tenants.iter() {
            let name = &t.config.name;
            if (
                t.reserved_blocks,
                t.used_blocks,
                t.shared_blocks,
                t.live_requests,
                t.running,
                t.resuming,
            ) != (
                reserved[id],
                used[id],
                shared[id],
                live[id],
                running[id],
                resuming[id],
            ) {
                return Err(format!(
                    "tenant {name:?} accounting differs from its requests"
                ));
            }
            committed += t.footprint();
        }
        if committed != self.tenants.committed() {
            return Err("committed blocks drifted".into());
        }
        if committed > usable {
            return Err(format!(
                "reservations and floors ({committed}) exceed the usable pool ({usable})"
            ));
        }
        Ok(())
    }
}

mod ending;
mod retry;

#[cfg(test)]
mod tests;
