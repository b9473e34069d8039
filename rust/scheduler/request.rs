//! One admitted request: its tokens, pages and place, how it ended, and its
//! terminal event.

use super::*;

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
    pub(super) row_key: u64,
    // Line 2: read by commit().
    pub id: u64,
    pub tenant: TenantId,
    pub(super) place: Place,
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
}

/// A growable set of request ids, one bit each (ids are dense from 1).
#[derive(Clone, Debug, Default)]
pub(super) struct IdSet {
    pub(super) words: Vec<u64>,
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
