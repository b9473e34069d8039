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

mod checkpoint;
mod config;
mod ending;
mod events;
mod invariants;
mod kv;
mod lifecycle;
mod queues;
mod request;
mod retry;
mod stats;
mod step;

pub use checkpoint::InFlight;
pub use config::{AdmissionMode, SchedulerConfig, SecretKey, DEFAULT_WATERMARK_BLOCKS};
pub use events::{SchedulerEvent, MAX_PENDING_EVENTS};
pub use lifecycle::Lifecycle;
pub use request::{FinishReason, FinishedRequest, Request};
pub use stats::{PoolStats, SchedulerStats, TenantStats};
pub use step::StepOutcome;

use kv::lookup_prefix;
use request::{IdSet, Place};
use step::Pending;

/// What a request may carry beside its prompt.
#[derive(Clone, Copy, Debug, Default)]
pub struct SubmitOptions<'a> {
    /// Sampling one of these finishes the request (the token is part of the output).
    pub stop_token_ids: &'a [i32],
    /// Mixed into the request's prefix-cache namespace: only requests with the
    /// same salt (in the same namespace) share its blocks.
    pub cache_salt: Option<&'a [u8]>,
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

/// Gaps between productive steps kept for the step-rate estimate.
const STEP_GAP_WINDOW: usize = 32;

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
}

#[cfg(test)]
mod tests;
