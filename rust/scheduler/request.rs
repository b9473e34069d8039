//! One admitted request: its tokens, pages and place, how it ended, and its
//! terminal event; and `RequestTable`, the live requests by slot and by id.
//!
//! The queues and the running set hold slots (indices into the table), not
//! requests: a slot is stable while its request lives and is reused after.

use super::*;
use crate::prefix::BlockChain;

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
    /// Displaced by a request of a higher tier that a global limit (the live
    /// request cap, the pool) would have refused otherwise: admitted, then
    /// given up before it ran (or, with `preempt_lower_tiers`, while it ran).
    /// Its terminal event carries a `retry_after`.
    Shed,
    /// The host could not serve it (`Scheduler::fail`: its logits were not
    /// finite, say); its terminal event carries the host's `error`.
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Cancelled => "cancelled",
            FinishReason::DrainDeadline => "drain_deadline",
            FinishReason::Shed => "shed",
            FinishReason::Error => "error",
        }
    }

    /// Every reason, in declaration order: the one vocabulary of endings
    /// (`kvsched.FINISH_REASONS`).
    pub const ALL: [FinishReason; 6] = [
        FinishReason::Length,
        FinishReason::Stop,
        FinishReason::Cancelled,
        FinishReason::DrainDeadline,
        FinishReason::Shed,
        FinishReason::Error,
    ];

    /// Counted as finished (per-tenant `finished`, the e2e histogram), not as
    /// cancelled.
    pub fn is_finished(self) -> bool {
        matches!(self, FinishReason::Length | FinishReason::Stop)
    }
}

/// A field with one value, there for its layout: the request table stores
/// `Option<Request>`, whose tag goes into the largest niche among the
/// fields. Without this one that is the namespace's scope, three lines past
/// what a commit reads, and every slab lookup would load that line to find
/// the request there. An 8-byte tag with one valid value is the largest
/// niche, so the tag sits in line 2, which a commit reads anyway.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub(super) enum Live {
    Yes = 1,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Place {
    /// In its tenant's queue.
    Queued,
    /// Preempted, in the resume queue of this tier (its tier when it was
    /// preempted: a tenant's tier may change while it waits).
    Resuming(u32),
    /// In the running set at this position.
    Running(usize),
}

/// One admitted, unfinished request.
///
/// `repr(C)` and 64-byte alignment keep what a prefill chunk's step reads in
/// the first cache line and what a commit reads in the first two: lines per
/// request are the cost of a commit that opens one. (A decode's step reads
/// the running set's copies instead, and its commit writes the running set's
/// tail: it opens its request once every `TAIL_TOKENS` tokens; see tail.rs.)
#[derive(Clone, Debug)]
#[repr(C, align(64))]
pub struct Request {
    // Line 1: read by step() for a prefill chunk, and by a commit that opens
    // the request (or a tail catching up), which writes nothing else (so
    // line 2 stays clean: nothing to write back).
    /// Prompt followed by the tokens generated so far.
    pub tokens: Vec<i32>,
    /// Pages holding its KV, in order.
    pub pages: Vec<u32>,
    /// Tokens whose KV is written (committed steps only). While it runs,
    /// this and `tokens` may lag by the tokens its tail holds (see tail.rs).
    pub num_computed: usize,
    /// When its last token was committed; negative before its first (see
    /// `last_token()`): an `Option<f64>` would not fit the line.
    pub(super) last_token_at: f64,
    // Line 2: read by a commit that opens it. A step plans a decode from the running
    // set's copies (`queues::RunningSet`) and opens neither line.
    pub id: u64,
    pub tenant: TenantId,
    pub(super) place: Place,
    pub max_tokens: usize,
    pub prompt_len: usize,
    /// Holds `Option<Request>`'s tag (see `Live`).
    pub(super) live: Live,
    // Line 3 and on: colder.
    pub stop_token_ids: Vec<i32>,
    pub first_token: Option<f64>,
    /// Blocks reserved at admission, held until it ends.
    pub reserved_blocks: usize,
    /// The naming stream after the full blocks it has named so far
    /// (`chain.tokens()` tokens): the names themselves live once, in the
    /// prefix cache, so a request keeps 40 bytes instead of 16 per block.
    /// (Here Request is 384 bytes. Packed to 320, by moving this field,
    /// step + commit of 1,024 decoding sequences measured 30% slower, as
    /// main after the split is at 320; the cause is not understood yet.)
    pub chain: BlockChain,
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
    /// The max_tokens its caller asked for (more than `max_tokens` when the
    /// ladder capped it at admission).
    pub asked_max_tokens: usize,
    /// The page tables of the KV-cache groups after group 0 (whose table is
    /// `pages`); None for a model with one group.
    pub groups: Option<Box<GroupPages>>,
}

/// A request's page tables for the KV-cache groups after group 0 (see
/// crate::groups). Each table covers the same blocks as `Request::pages`
/// (the same length); a window group's blocks before `live_from` fell behind
/// the window and went back: they hold the null page.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupPages {
    /// One table per extra group, in group order.
    pub tables: Vec<Vec<u32>>,
    /// Per extra group: the first block it still holds.
    pub live_from: Vec<usize>,
    /// The most tokens one step runs of it, as its reservation assumed (the
    /// long_prefill_chunk it was admitted with: a larger one set live later
    /// must not make it hold more than it reserved).
    pub chunk: usize,
}

impl GroupPages {
    /// Empty tables for `groups` extra groups.
    pub(super) fn new(groups: usize, chunk: usize) -> Self {
        GroupPages {
            tables: vec![Vec::new(); groups],
            live_from: vec![0; groups],
            chunk,
        }
    }

    /// Pages it holds over the extra groups (null pages not counted).
    pub fn held(&self) -> usize {
        self.tables
            .iter()
            .zip(&self.live_from)
            .map(|(t, &from)| t.len().saturating_sub(from))
            .sum()
    }

    /// Every page it holds, group by group, each table in block order.
    pub fn live_pages(&self) -> impl Iterator<Item = u32> + '_ {
        self.tables
            .iter()
            .zip(&self.live_from)
            .flat_map(|(t, &from)| t.get(from..).unwrap_or(&[]).iter().copied())
    }

    /// Take every page it holds out (the tables left empty), group by group.
    pub(super) fn take_pages(&mut self) -> Vec<u32> {
        let pages = self.live_pages().collect();
        for (t, from) in self.tables.iter_mut().zip(&mut self.live_from) {
            t.clear();
            *from = 0;
        }
        pages
    }
}

impl Request {
    /// Pages it holds over every group.
    #[inline]
    pub fn held_pages(&self) -> usize {
        self.pages.len() + self.groups.as_ref().map_or(0, |g| g.held())
    }
}

impl Request {
    /// When its last token was committed (None before its first).
    #[inline]
    pub fn last_token(&self) -> Option<f64> {
        (self.last_token_at >= 0.0).then_some(self.last_token_at)
    }

    /// Its token committed at `now` (a checked time: finite, >= 0).
    #[inline]
    pub(super) fn set_last_token(&mut self, now: f64) {
        debug_assert!(now >= 0.0);
        self.last_token_at = now;
    }

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
    pub(super) fn need(&self) -> usize {
        self.tokens.len() - self.num_computed
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
    /// The max_tokens its caller asked for. Larger than the max_tokens it was
    /// admitted with when the ladder's `cap_max_tokens` rung lowered it (see
    /// `max_tokens_capped`): a `Length` ending then is short of what was asked.
    pub asked_max_tokens: usize,
    /// The max_tokens it was admitted with.
    pub max_tokens: usize,
    /// When a retry may pass: set for a request ended `Shed`, None otherwise.
    pub retry_after: Option<f64>,
    /// Why the host could not serve it: set for a request ended `Error`.
    pub error: Option<String>,
}

impl FinishedRequest {
    /// Whether the ladder lowered its max_tokens at admission.
    pub fn max_tokens_capped(&self) -> bool {
        self.asked_max_tokens > self.max_tokens
    }
}

/// A growable set of request ids, one bit each (ids are dense from 1).
#[derive(Clone, Debug, Default)]
pub(super) struct IdSet {
    words: Vec<u64>,
}

impl IdSet {
    pub(super) fn insert(&mut self, id: u64) {
        let (w, b) = ((id / 64) as usize, id % 64);
        if w >= self.words.len() {
            self.words.resize(w + 1, 0);
        }
        self.words[w] |= 1 << b;
    }

    pub(super) fn contains(&self, id: u64) -> bool {
        let (w, b) = ((id / 64) as usize, id % 64);
        self.words.get(w).is_some_and(|x| x & (1 << b) != 0)
    }
}

/// The live requests: a slab whose slots are reused once a request ends, the
/// index from request id to slot, and the ids issued so far (dense from 1).
#[derive(Debug)]
pub(super) struct RequestTable {
    slab: Vec<Option<Request>>,
    free: Vec<usize>,
    index: HashMap<u64, usize>,
    next_id: u64,
}

impl Default for RequestTable {
    fn default() -> Self {
        RequestTable {
            slab: Vec::new(),
            free: Vec::new(),
            index: HashMap::new(),
            next_id: 1,
        }
    }
}

impl RequestTable {
    /// The id the next admitted request gets.
    pub(super) fn next_id(&self) -> u64 {
        self.next_id
    }

    /// Whether `id` was ever issued (live or ended).
    pub(super) fn issued(&self, id: u64) -> bool {
        id != 0 && id < self.next_id
    }

    /// Store a new request (its id must be `next_id()`); returns its slot.
    pub(super) fn insert(&mut self, req: Request) -> usize {
        debug_assert_eq!(req.id, self.next_id);
        self.next_id += 1;
        let id = req.id;
        let slot = match self.free.pop() {
            Some(s) => {
                self.slab[s] = Some(req);
                s
            }
            None => {
                self.slab.push(Some(req));
                self.slab.len() - 1
            }
        };
        self.index.insert(id, slot);
        slot
    }

    /// Take the request out of `slot`; the slot is free for reuse.
    pub(super) fn remove(&mut self, slot: usize) -> Request {
        let req = self.slab[slot].take().expect("live slab entry");
        self.free.push(slot);
        self.index.remove(&req.id);
        req
    }

    #[inline]
    pub(super) fn get(&self, slot: usize) -> &Request {
        self.slab[slot].as_ref().expect("live slab entry")
    }

    #[inline]
    pub(super) fn get_mut(&mut self, slot: usize) -> &mut Request {
        self.slab[slot].as_mut().expect("live slab entry")
    }

    /// The request in `slot` if it is still request `id` (a plan may name a
    /// request cancelled since, whose slot now holds a newer one).
    #[inline]
    pub(super) fn get_mut_if(&mut self, slot: usize, id: u64) -> Option<&mut Request> {
        self.slab[slot].as_mut().filter(|r| r.id == id)
    }

    /// Start loading the lines of `slot` that a commit reads: its first two
    /// (see `Request`).
    #[inline]
    pub(super) fn prefetch_record(&self, slot: usize) {
        if let Some(entry) = self.slab.get(slot) {
            let p: *const u8 = std::ptr::from_ref(entry).cast();
            crate::prefetch::line(p);
            crate::prefetch::line(p.wrapping_add(64));
        }
    }

    /// Start loading the end of `slot`'s token list, where a commit appends.
    /// Its address is read from the record's first line, so that line should
    /// have been prefetched a while before (`prefetch_record`).
    #[inline]
    pub(super) fn prefetch_token_tail(&self, slot: usize) {
        if let Some(Some(r)) = self.slab.get(slot) {
            crate::prefetch::line(r.tokens.as_ptr().wrapping_add(r.tokens.len()).cast());
        }
    }

    pub(super) fn slot_of(&self, id: u64) -> Option<usize> {
        self.index.get(&id).copied()
    }

    pub(super) fn len(&self) -> usize {
        self.index.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Live request ids, in no order.
    pub(super) fn ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.index.keys().copied()
    }

    /// Live requests with their slots, in slot order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (usize, &Request)> {
        self.slab
            .iter()
            .enumerate()
            .filter_map(|(s, r)| r.as_ref().map(|r| (s, r)))
    }

    /// The slab and the index agree: every live request is indexed at its slot.
    pub(super) fn check_invariants(&self) -> Result<(), String> {
        let mut seen = 0;
        for (slot, r) in self.iter() {
            seen += 1;
            if self.index.get(&r.id) != Some(&slot) {
                return Err(format!("request {} missing from the index", r.id));
            }
        }
        if seen != self.index.len() {
            return Err("index and slab disagree".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// What a commit that opens a request writes (and a tail catching up)
    /// is in the request's first cache line
    /// (its second is only read, so it is never written back), and
    /// `Option<Request>` keeps its tag in a field of the second (`Live`), not
    /// in a word of its own.
    #[test]
    fn a_commit_that_opens_a_request_writes_one_line_of_it() {
        let written = [
            (offset_of!(Request, tokens), size_of::<Vec<i32>>()),
            (offset_of!(Request, num_computed), size_of::<usize>()),
            (offset_of!(Request, last_token_at), size_of::<f64>()),
        ];
        for (at, len) in written {
            assert!(at + len <= 64, "a field at {at} (+{len}) is past line 1");
        }
        let read = [
            (offset_of!(Request, id), size_of::<u64>()),
            (offset_of!(Request, tenant), size_of::<TenantId>()),
            (offset_of!(Request, place), size_of::<Place>()),
            (offset_of!(Request, max_tokens), size_of::<usize>()),
            (offset_of!(Request, prompt_len), size_of::<usize>()),
            (offset_of!(Request, live), size_of::<Live>()),
        ];
        for (at, len) in read {
            assert!(
                at >= 64 && at + len <= 128,
                "a field at {at} (+{len}) is not in line 2"
            );
        }
        assert_eq!(size_of::<Option<Request>>(), size_of::<Request>());
        assert_eq!(std::mem::align_of::<Request>(), 64);
    }
}
