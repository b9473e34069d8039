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
//!
//! # Layout
//!
//! One concept a file under `scheduler/`; docs/DESIGN.md ("The house") lists
//! them, and README.md's Layout section says which holds each step of a
//! request. This file: the `Scheduler` struct, `new`, its accessors,
//! `release` and `commit`.
//!
//! Two choices a reader may wonder about. The per-tenant waiting queues stay
//! in `Tenant::waiting`, where the tenant registry (stats, tiers, removal)
//! reads them; `queues.rs` holds every function that takes from them. The KV
//! manager lives under `scheduler/` rather than beside `pool.rs` because it
//! works on a `Request`'s pages and block names, which are the scheduler's.

// The files under scheduler/ start with `use super::*`: these imports are
// theirs too, so each of them reads with the same names.
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};

pub use crate::admission::Room;
use crate::admission::{self, Capacity};
use crate::buckets::TokenBuckets;
use crate::error::{KvError, KvResult, RejectReason, Rejection};
use crate::groups::{AttentionKind, KvGroups};
use crate::ladder::{Ladder, LadderConfig, LadderMove, Pressure};
use crate::metrics::{Histogram, TenantMetrics};
use crate::page::BlockSize;
use crate::planner::{
    self, DecodeSeq, GroupRowCache, GroupSeq, PlanBuffers, PlanShape, RowCache, SeqSlice,
};
use crate::pool::BlockPool;
use crate::prefix::{BlockChain, BlockKey, Namespace, PrefixHasher, Scope};
#[cfg(test)]
use crate::tenant::TenantConfig;
use crate::tenant::{TenantId, Tenants};

mod checkpoint;
mod clock;
mod config;
mod displace;
mod ending;
mod events;
mod invariants;
mod knobs;
mod kv;
mod lifecycle;
mod overlap;
mod queues;
mod request;
mod retry;
mod stats;
mod step;
mod submit;
mod tail;

pub use checkpoint::InFlight;
pub use clock::{check_time, CLOCK_JITTER_S, MAX_TIME_S};
pub use config::{
    AdmissionMode, CachePartition, SchedulerConfig, SecretKey, DEFAULT_WATERMARK_BLOCKS,
};
pub use events::{SchedulerEvent, MAX_PENDING_EVENTS};
pub use lifecycle::Lifecycle;
pub use request::{FinishReason, FinishedRequest, GroupPages, Request};
pub use stats::{PoolStats, SchedulerStats, TenantStats};
pub use step::StepOutcome;
pub use submit::SubmitOptions;

use events::EventLog;
use kv::{GroupHits, KvManager};
use queues::{ResumeQueues, RunningSet};
use request::{IdSet, Live, Place, RequestTable};
use step::{Pending, PendingSeq};
use submit::Resumed;
use tail::Tail;

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

/// The scheduler: admission, the queues, the running set and the KV pages of
/// every live request, changed together by one caller at a time.
///
/// Which file holds each step of a request (submit, wait, step, commit, end)
/// is README.md's Layout section, the one route map.
pub struct Scheduler {
    config: SchedulerConfig,
    /// This scheduler's step ids are `instance << STEP_ID_BITS | step`.
    instance: u64,
    buckets: TokenBuckets,
    shape: PlanShape,
    /// The pool, prefix-cache naming and admission mode: every page moves here.
    kv: KvManager,
    tenants: Tenants,
    /// Live requests by slot and by id.
    requests: RequestTable,
    running: RunningSet,
    resume: ResumeQueues,
    rows: [RowCache; 2],
    /// The row caches of the KV-cache groups after group 0, per buffer set.
    group_rows: [Vec<GroupRowCache>; 2],
    steps: u64,
    pending: Option<Pending>,
    /// A plan advanced before its tokens were known, until `resolve` (see
    /// overlap.rs).
    unresolved: Option<overlap::Unresolved>,
    /// Requests an advance finished at max_tokens, with their stop tokens:
    /// whether the last one was a stop is known at `resolve`.
    deferred_stops: Vec<(u64, Vec<i32>)>,
    next_row_key: u64,
    rejected: [u64; RejectReason::COUNT],
    preemptions: u64,
    /// Requests ended `Shed` to make room for a higher tier, since start.
    displaced: u64,
    /// Scratch: tokens served per tenant slot in the step being planned.
    served: Vec<usize>,
    /// Scratch: slots whose committed tokens filled a block, to name.
    filled: Vec<usize>,
    /// Preempted by a step that ran nothing; reported with the next plan.
    unreported_preempted: Vec<u64>,
    ladder: Ladder,
    events: EventLog,
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
        let kv = KvManager::new(&config)?;
        let shape = config.plan_shape()?;
        Ok(Scheduler {
            kv,
            instance: INSTANCES.fetch_add(1, Ordering::Relaxed) % (1 << (63 - STEP_ID_BITS)),
            buckets: config.plan_buckets()?,
            shape,
            tenants: Tenants::default(),
            requests: RequestTable::default(),
            running: RunningSet::default(),
            resume: ResumeQueues::default(),
            rows: [RowCache::new(shape.max_seqs), RowCache::new(shape.max_seqs)],
            group_rows: std::array::from_fn(|_| {
                let extra = config.kv_cache_groups.len() - 1;
                vec![GroupRowCache::new(shape.max_seqs); extra]
            }),
            steps: 0,
            pending: None,
            unresolved: None,
            deferred_stops: Vec::new(),
            next_row_key: 1,
            rejected: [0; RejectReason::COUNT],
            preemptions: 0,
            displaced: 0,
            served: Vec::new(),
            filled: Vec::new(),
            unreported_preempted: Vec::new(),
            ladder: Ladder::new(config.ladder.clone())?,
            events: EventLog::default(),
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
        self.kv.pool()
    }

    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    /// A copy of request `id` as of now: a running one with the tokens its
    /// commits keep beside it until it catches up (see tail.rs).
    pub fn request(&self, id: u64) -> KvResult<Request> {
        let slab = self
            .requests
            .slot_of(id)
            .ok_or(KvError::UnknownRequest(id))?;
        let r = self.requests.get(slab);
        let mut copy = r.clone();
        if let Place::Running(pos) = r.place {
            let mut tail = self.running.tails()[pos];
            tail.settle_into(&mut copy);
        }
        Ok(copy)
    }

    /// Pool pages admission may promise: all but the overhead reserve.
    pub fn usable_blocks(&self) -> usize {
        let total = self.kv.pool().total();
        total - self.config.reserve_blocks(total)
    }

    /// Requests whose terminal event is not delivered yet: live ones, and
    /// those an advance finished before its tokens were known (their events
    /// come with `resolve`; see overlap.rs). A loop that steps while this is
    /// not zero sees every ending.
    pub fn live_requests(&self) -> usize {
        self.requests.len() + self.deferred_stops.len()
    }

    /// The buffer set the next `step()` writes (0 or 1).
    pub fn next_parity(&self) -> usize {
        (self.steps % 2) as usize
    }

    /// Remove a request from wherever it sits, free its pages and reservation.
    fn release(&mut self, slab: usize) -> Request {
        match self.requests.get(slab).place {
            Place::Running(pos) => self.remove_running(pos),
            Place::Queued | Place::Resuming(_) => self.remove_waiting(slab),
        }
        self.drop_all_pages(slab);
        let req = self.requests.remove(slab);
        self.tenants.release(req.tenant, req.reserved_blocks);
        self.tenants.get_mut(req.tenant).request_ended();
        // What it released stays cached within the tenant's quota (partitioned).
        self.trim_cache(req.tenant);
        req
    }

    /// Close step `step_id` with one sampled token per sequence, in plan order.
    /// Checks everything first: on an error nothing changes. Its `finished`
    /// also delivers the terminal events queued since the last delivery (see
    /// `take_finished`).
    pub fn commit(&mut self, step_id: u64, sampled: &[i32], now: f64) -> KvResult<CommitEvents> {
        self.accept_now(now)?;
        self.check_resolved()?;
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
        // The plan's decodes (one sampled token each), then its prefill chunks.
        let num_decode = pending.num_decode;
        let num_seqs = num_decode + pending.seqs.len();
        if sampled.len() != num_seqs {
            return Err(KvError::InvalidState(format!(
                "{} sampled ids for a plan of {num_seqs} sequences",
                sampled.len()
            )));
        }
        // The first sampled id `out` refuses among those the plan uses: every
        // decode's (a plain scan), then the chunks that sample.
        let bad = |out: fn(i32, i64) -> bool, vocab: i64| {
            let (decoded, chunked) = sampled.split_at(num_decode);
            decoded.iter().position(|&tok| out(tok, vocab)).or_else(|| {
                let mut chunks = pending.seqs.iter().zip(chunked);
                let j = chunks.position(|(s, &tok)| s.samples && out(tok, vocab))?;
                Some(num_decode + j)
            })
        };
        if let Some(k) = bad(|tok, _| tok < 0, 0) {
            return Err(KvError::InvalidState(format!(
                "sampled id {} of sequence {k} is negative",
                sampled[k]
            )));
        }
        if let Some(vocab) = self.config.vocab_size {
            if let Some(k) = bad(|tok, vocab| i64::from(tok) >= vocab, i64::from(vocab)) {
                return Err(KvError::InvalidState(format!(
                    "sampled id {} of sequence {k} is outside the vocabulary of {vocab}",
                    sampled[k]
                )));
            }
        }
        let pending = self.pending.take().expect("checked above");
        let mut events = self.apply(pending, sampled, now);
        // Terminal events of requests ended since the last delivery go first.
        if !self.ended.is_empty() {
            let mut all = std::mem::take(&mut self.ended);
            all.append(&mut events.finished);
            events.finished = all;
        }
        Ok(events)
    }

    /// Close the pending plan with `sampled` (checked): tokens appended,
    /// requests finished, filled blocks named. The events of requests ended
    /// outside a commit are not added.
    fn apply(&mut self, pending: Pending, sampled: &[i32], now: f64) -> CommitEvents {
        let num_decode = pending.num_decode;
        let num_seqs = num_decode + pending.seqs.len();
        let mut events = CommitEvents {
            request_ids: Vec::with_capacity(num_seqs),
            tokens: Vec::with_capacity(num_seqs),
            finished: Vec::new(),
            preempted: pending.preempted,
        };
        let mut done: Vec<(usize, FinishReason)> = Vec::new();
        let (decoded, chunked) = sampled.split_at(num_decode);
        match self.running.unpin() {
            // Nothing left or moved in the running set since the plan: its
            // k-th decode is still at position k, and is committed from the
            // running set's arrays alone (see tail.rs) unless its stop tokens
            // do not fit its tail.
            None => {
                for (k, &token) in decoded.iter().enumerate() {
                    if self.running.tails()[k].decides() {
                        events.request_ids.push(self.running.owners()[k].id);
                        events.tokens.push(token);
                        if let Some(reason) = self.commit_decode(k, token, now) {
                            done.push((self.running.at(k), reason));
                        }
                    } else {
                        let s = self.running.planned_decode(k);
                        self.commit_opened(&s, token, now, &mut events, &mut done);
                    }
                }
            }
            // Who the decodes were when something moved.
            Some(decodes) => self.commit_all_opened(&decodes, decoded, now, &mut events, &mut done),
        }
        self.commit_all_opened(&pending.seqs, chunked, now, &mut events, &mut done);
        // Name the blocks this step filled (before a finished request's pages
        // go back: its blocks stay cached).
        let mut filled = std::mem::take(&mut self.filled);
        for &slab in &filled {
            self.kv.name_filled_blocks(self.requests.get_mut(slab));
        }
        self.kv.register_named();
        filled.clear();
        self.filled = filled;
        let draining = self.lifecycle == Lifecycle::Draining;
        for (slab, reason) in done {
            let req = self.release(slab);
            self.tenants
                .get_mut(req.tenant)
                .count_end(true, now - req.arrival);
            let record = self.finished_record(&req, reason, now);
            if overlap::is_placeholder(req.tokens.last()) {
                // Advanced, not resolved: its last token (and whether it is a
                // stop token) is known at `resolve`, which completes its record.
                self.deferred_stops
                    .push((req.id, req.stop_token_ids.clone()));
            } else if draining {
                self.drain_finished.push(record.clone());
            }
            events.finished.push(record);
        }
        self.maybe_drained();
        self.clock = self.clock.max(now);
        events
    }

    /// Commit `sampled[k]` for each of `seqs` through its request, loading
    /// the requests a few sequences ahead (`commit_opened`).
    fn commit_all_opened(
        &mut self,
        seqs: &[PendingSeq],
        sampled: &[i32],
        now: f64,
        events: &mut CommitEvents,
        done: &mut Vec<(usize, FinishReason)>,
    ) {
        for (k, (s, &token)) in seqs.iter().zip(sampled).enumerate() {
            // Their lines, then the end of their token lists (whose address
            // is in the first line).
            if let Some(a) = seqs.get(k + 32) {
                self.requests.prefetch_record(a.slab);
            }
            if let Some(a) = seqs.get(k + 16) {
                self.requests.prefetch_token_tail(a.slab);
            }
            self.commit_opened(s, token, now, events, done);
        }
    }

    /// Commit `token` for sequence `s` of the plan through its request: a
    /// prefill chunk, or a decode whose tail cannot decide alone (the running
    /// set changed since the plan, or its stop tokens do not fit the tail).
    /// Nothing if it ended since the plan was made.
    fn commit_opened(
        &mut self,
        s: &PendingSeq,
        token: i32,
        now: f64,
        events: &mut CommitEvents,
        done: &mut Vec<(usize, FinishReason)>,
    ) {
        // Ended since the plan was made (its slot may hold a newer request).
        let Some(r) = self.requests.get_mut_if(s.slab, s.id) else {
            return;
        };
        // The running set's copies (see `RunningSet`): a request planned
        // and not ended since is still running. Its tail's tokens go to the
        // request first.
        let mut hot = match r.place {
            Place::Running(pos) => {
                let (h, tail, _) = self.running.decode_mut(pos);
                tail.settle_into(r);
                Some((h, tail))
            }
            _ => None,
        };
        let before = r.num_computed;
        r.num_computed += s.q_len as usize;
        if let Some((h, _)) = hot.as_mut() {
            h.pos = r.num_computed;
        }
        // Blocks fill only where the committed tokens reach a block boundary
        // (one decode in block_size), and every block filled before was named
        // by the commit that filled it: elsewhere there is nothing to name,
        // and the request's names are not read. The ones to name are named
        // together after this pass, in plan order.
        let bs = self.shape.block_size;
        if self.kv.caching() && bs.split(before).0 != bs.split(r.num_computed).0 {
            self.filled.push(s.slab);
        }
        let t = self.tenants.get_mut(r.tenant);
        if !s.decode {
            t.count_prefill(s.q_len as usize);
        }
        if !s.samples {
            return;
        }
        r.tokens.push(token);
        match r.last_token() {
            Some(last) => t.count_inter_token(now - last),
            // Its first token: arrival and first_token, on colder lines, are
            // read only then.
            None => {
                t.count_first_token(now - r.arrival);
                r.first_token.get_or_insert(now);
            }
        }
        r.set_last_token(now);
        if let Some((h, tail)) = hot {
            h.token = token;
            *tail = Tail::of(r);
        }
        events.request_ids.push(r.id);
        events.tokens.push(token);
        // `s.stops`: the plan's copy, so that a request without stop tokens
        // is decided without opening the line of its list.
        let reason = if s.stops && r.stop_token_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if r.generated() >= r.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        match reason {
            Some(reason) => done.push((s.slab, reason)),
            // A prefill that sampled its first token becomes a decode. (A
            // sequence planned as a prefill is still past the decodes: only
            // its own promotion could move it there.)
            None if !s.decode => {
                if let Place::Running(pos) = r.place {
                    debug_assert!(pos >= self.running.num_decode());
                    self.promote_to_decode(pos);
                }
            }
            None => {}
        }
    }
}

#[cfg(test)]
mod tests;
