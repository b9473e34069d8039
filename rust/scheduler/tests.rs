//! The scheduler's tests, end to end through its public calls: each plan runs
//! on a fake engine (`Harness`) that reads every sequence's KV back through
//! its page row, so a wrong slot, page or length fails the test that made it.
//!
//! One suite per behaviour, in `tests/`:
//! - `admission`: what a request reserves, why it is refused (and what a
//!   refusal changes: counters only), floors, limits; a naive model under
//!   random operations.
//! - `planning`: chunked prefill, decodes never skipped, determinism,
//!   out-of-order calls, ends between a step and its commit.
//! - `fairness`: weighted fair service, per-tenant step caps.
//! - `preemption`: over-commit and priority preemption lose nothing; tier
//!   changes while a request waits to resume.
//! - `overload`: the degradation ladder and what counts as pressure.
//! - `lifecycle`: warm-up, drain, restore, live reconfiguration.
//! - `terminal`: every request ends with exactly one event; `retry_after`.
//! - `prefix`: the prefix cache through the scheduler.
//! - `tails`: decodes committed into the running set's tails, and every
//!   reader of a request seeing the tokens they hold.
//! - `plan_rows_fuzz`, `lifecycle_fuzz`, `prefix_fuzz`: random operations
//!   against the page lists, the request accounting and the page owners.
//! - `random_ops`: the one operation generator the random suites share.

use super::*;
use crate::planner::OwnedPlanBuffers;
use proptest::prelude::*;
use random_ops::{ops, Mix, Op};
use std::collections::{BTreeMap, BTreeSet};

// ---------------------------------------------------------------------------
// A fake engine that runs plans the way a real one does: it writes each token
// at its slot, then "attends" by reading the sequence back through its page
// row, and samples a token that is a hash of everything it read. A wrong slot,
// page or length changes what it reads, and the harness checks the read against
// the scheduler's own token list, so every plan's paging is checked end to end.

fn sample_of(tokens: &[i32]) -> i32 {
    let mut h: u64 = 0xcbf29ce484222325;
    for &t in tokens {
        h = (h ^ t as u64).wrapping_mul(0x100000001b3);
    }
    (h % 50_000) as i32
}

struct Harness {
    s: Scheduler,
    bufs: [OwnedPlanBuffers; 2],
    kv: Vec<i32>,
    now: f64,
    dt: f64,
    finished: BTreeMap<u64, FinishedRequest>,
    /// Per request, every (position, token id) it ran, in order.
    ran: BTreeMap<u64, Vec<(i32, i32)>>,
    preempted: u64,
    outcomes: Vec<StepOutcome>,
}

impl Harness {
    fn new(config: SchedulerConfig) -> Self {
        let s = Scheduler::new(config).unwrap();
        let shape = *s.plan_shape();
        let slots = s.config().num_blocks * s.config().block_size;
        Harness {
            s,
            bufs: [OwnedPlanBuffers::new(&shape), OwnedPlanBuffers::new(&shape)],
            kv: vec![-1; slots],
            now: 0.0,
            dt: 0.01,
            finished: BTreeMap::new(),
            ran: BTreeMap::new(),
            preempted: 0,
            outcomes: Vec::new(),
        }
    }

    fn tenant(&mut self, config: TenantConfig) {
        self.s.add_tenant(config).unwrap();
    }

    fn submit(&mut self, tenant: &str, prompt: &[i32], max_tokens: usize) -> u64 {
        self.s.submit(tenant, prompt, max_tokens, self.now).unwrap()
    }

    /// One step and its commit; None when nothing ran.
    fn step(&mut self) -> Option<CommitEvents> {
        let out = self.plan().unwrap()?;
        let sampled = self
            .execute(&out, |_, _| {})
            .unwrap_or_else(|e| panic!("{e}"));
        Some(self.commit(out, &sampled).unwrap())
    }

    /// Plans the next step into the buffer set its parity names; None when
    /// nothing runs.
    fn plan(&mut self) -> KvResult<Option<StepOutcome>> {
        let parity = self.s.next_parity();
        let out = self.s.step(self.now, &mut self.bufs[parity].as_mut())?;
        if let Some(out) = &out {
            assert_eq!(out.parity, parity);
        }
        Ok(out)
    }

    /// The fake engine runs a planned step: it writes each scheduled token at
    /// its slot (telling `wrote` which request wrote which slot), reads every
    /// sequence back through its page row, checks what it read against the
    /// scheduler's own tokens, records what ran, and returns the token it
    /// samples for each sequence. Err names the request that read wrong KV.
    fn execute(
        &mut self,
        out: &StepOutcome,
        mut wrote: impl FnMut(u64, usize),
    ) -> Result<Vec<i32>, String> {
        let b = &self.bufs[out.parity];
        let bs = self.s.config().block_size;
        let pps = self.s.plan_shape().pages_per_seq;
        if b.cu_q_lens[out.num_seqs] as usize != out.num_tokens {
            return Err(format!(
                "the sequences do not run all {} tokens",
                out.num_tokens
            ));
        }
        for i in 0..out.num_seqs {
            let (lo, hi) = (b.cu_q_lens[i] as usize, b.cu_q_lens[i + 1] as usize);
            let id = out.request_ids[i];
            for t in lo..hi {
                let slot = b.slot_mapping[t] as usize;
                self.kv[slot] = b.token_ids[t];
                wrote(id, slot);
            }
            let ran = self.ran.entry(id).or_default();
            ran.extend((lo..hi).map(|t| (b.positions[t], b.token_ids[t])));
        }
        // The other KV-cache groups write their own pages (all from the one
        // pool: a page two groups or two requests both wrote would read back
        // the wrong token below).
        let shape = *self.s.plan_shape();
        let kinds = self.s.config().kv_cache_groups.clone();
        for g in 1..kinds.len() {
            let slots = b.group_slots(&shape, g);
            for i in 0..out.num_seqs {
                let (lo, hi) = (b.cu_q_lens[i] as usize, b.cu_q_lens[i + 1] as usize);
                for (&slot, &token) in slots[lo..hi].iter().zip(&b.token_ids[lo..hi]) {
                    self.kv[slot as usize] = token;
                    wrote(out.request_ids[i], slot as usize);
                }
            }
        }
        let mut sampled = Vec::with_capacity(out.num_seqs);
        for i in 0..out.num_seqs {
            let kv_len = b.kv_lens[i] as usize;
            let q_len = (b.cu_q_lens[i + 1] - b.cu_q_lens[i]) as usize;
            let id = out.request_ids[i];
            let truth = &self.s.request(id).map_err(|e| e.to_string())?.tokens[..kv_len];
            // Each group reads what its first query attends to, through its row.
            for (g, kind) in kinds.kinds().iter().enumerate() {
                let row = &b.group_rows(&shape, g)[i * pps..(i + 1) * pps];
                let from = kind.visible_from(kv_len - q_len);
                let read: Vec<i32> = (from..kv_len)
                    .map(|p| self.kv[row[p / bs] as usize * bs + p % bs])
                    .collect();
                if read != truth[from..] {
                    return Err(format!(
                        "request {id} attends to the wrong KV in group {g}: read {read:?}, \
                         not {:?}",
                        &truth[from..]
                    ));
                }
            }
            sampled.push(sample_of(truth));
        }
        Ok(sampled)
    }

    /// Commits a step with what `execute` sampled, records what finished and
    /// was preempted, moves the clock on and checks the invariants.
    fn commit(&mut self, out: StepOutcome, sampled: &[i32]) -> KvResult<CommitEvents> {
        let ev = self.s.commit(out.step_id, sampled, self.now)?;
        self.preempted += ev.preempted.len() as u64;
        for f in &ev.finished {
            self.finished.insert(f.id, f.clone());
        }
        self.outcomes.push(out);
        self.now += self.dt;
        self.s.check_invariants().unwrap();
        Ok(ev)
    }

    fn run(&mut self, max_steps: usize) {
        for _ in 0..max_steps {
            if self.s.live_requests() == 0 {
                return;
            }
            self.step();
        }
        panic!("requests still live after {max_steps} steps");
    }
}

fn config(num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size,
        max_num_seqs: 8,
        max_batched_tokens: 64,
        max_seq_len: 256,
        overhead_reserve: 0.1,
        max_waiting: 4,
        ..SchedulerConfig::default()
    }
}

fn sched(num_blocks: usize, block_size: usize) -> Scheduler {
    Scheduler::new(config(num_blocks, block_size)).unwrap()
}

fn tenant(name: &str, floor: usize, cap: Option<usize>) -> TenantConfig {
    let mut c = TenantConfig::new(name);
    c.kv_floor_blocks = floor;
    c.kv_cap_blocks = cap;
    c
}

fn reason(r: KvResult<u64>) -> Option<&'static str> {
    r.err().and_then(|e| e.reason()).map(RejectReason::as_str)
}

fn prompt(n: usize, seed: i32) -> Vec<i32> {
    (0..n as i32).map(|i| (i * 7 + seed * 131) % 1000).collect()
}

/// KV-cache groups for the random suites: one full-attention group (as
/// every suite had before groups existed), or a full group and one to three
/// more, sliding-window, chunked-local or full, of small sizes so that
/// windows move within the suites' short sequences.
fn kv_groups() -> impl Strategy<Value = KvGroups> {
    let kind = prop_oneof![
        (1usize..24).prop_map(AttentionKind::SlidingWindow),
        (1usize..24).prop_map(AttentionKind::ChunkedLocal),
        Just(AttentionKind::Full),
    ];
    prop_oneof![
        1 => Just(KvGroups::single()),
        2 => prop::collection::vec(kind, 1..4).prop_map(|extra| {
            let kinds = std::iter::once(AttentionKind::Full).chain(extra).collect();
            KvGroups::new(kinds).expect("group 0 is full")
        }),
    ]
}

/// Tenant names of the random suites; "ghost" is never added.
const NAMES: [&str; 4] = ["t0", "t1", "t2", "ghost"];

mod admission;
mod extreme_knobs;
mod fairness;
mod groups;
mod lifecycle;
mod lifecycle_fuzz;
mod overlap;
mod overload;
mod partition;
mod plan_rows_fuzz;
mod planning;
mod preemption;
mod prefix;
mod prefix_fuzz;
mod random_ops;
mod tails;
mod terminal;
mod tiers;
mod time_and_rows;
