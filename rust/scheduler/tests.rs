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
        let mut sampled = Vec::with_capacity(out.num_seqs);
        for i in 0..out.num_seqs {
            let kv_len = b.kv_lens[i] as usize;
            let row = &b.page_indices[i * pps..(i + 1) * pps];
            let read: Vec<i32> = (0..kv_len)
                .map(|p| self.kv[row[p / bs] as usize * bs + p % bs])
                .collect();
            let id = out.request_ids[i];
            let truth = &self.s.request(id).map_err(|e| e.to_string())?.tokens[..kv_len];
            if read != truth {
                return Err(format!(
                    "request {id} attends to the wrong KV: read {read:?}, not {truth:?}"
                ));
            }
            sampled.push(sample_of(&read));
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

// ---------------------------------------------------------------------------
// Admission

#[test]
fn admission_reserves_final_length_and_pages_come_lazily() {
    let mut h = Harness::new(config(101, 16)); // 100 pages, 10 reserved, 90 usable
    h.tenant(tenant("a", 0, None));
    let id = h.submit("a", &prompt(40, 1), 30); // 70 tokens -> 5 blocks
    let st = h.s.stats(0.0);
    assert_eq!((st.pool.usable, st.pool.reserved, st.pool.used), (90, 5, 0));
    h.step(); // a 40-token prompt in a 64-token budget: one chunk, 3 pages
    assert_eq!(h.s.pool().used(), 3);
    assert_eq!(h.s.request(id).unwrap().generated(), 1);
    h.run(100);
    let f = &h.finished[&id];
    assert_eq!((f.output.len(), f.reason), (30, FinishReason::Length));
    let st = h.s.stats(h.now);
    assert_eq!(
        (st.pool.reserved, st.pool.used, st.live_requests),
        (0, 0, 0)
    );
    assert_eq!(st.tenants[0].metrics.tokens_out, 30);
    assert_eq!(st.tenants[0].metrics.tokens_in, 40);
}

#[test]
fn rejections_have_reasons_and_change_only_counters() {
    let mut s = sched(101, 16);
    s.add_tenant(tenant("a", 0, Some(10))).unwrap();
    let before = s.stats(0.0);
    assert_eq!(reason(s.submit("zz", &[1], 1, 0.0)), Some("unknown_tenant"));
    assert_eq!(reason(s.submit("a", &[], 1, 0.0)), Some("invalid"));
    assert_eq!(reason(s.submit("a", &[1], 0, 0.0)), Some("invalid"));
    assert_eq!(reason(s.submit("a", &[-3], 1, 0.0)), Some("invalid"));
    assert_eq!(reason(s.submit("a", &[1; 200], 57, 0.0)), Some("too_long"));
    assert_eq!(
        reason(s.submit("a", &[1; 200], 1, 0.0)),
        Some("tenant_budget")
    ); // 13 > 10
    let after = s.stats(0.0);
    assert_eq!(after.pool, before.pool);
    assert_eq!(after.live_requests, 0);
    let a = &after.tenants[0];
    assert_eq!(a.rejected[RejectReason::Invalid.index()], 3);
    assert_eq!(a.rejected[RejectReason::TooLong.index()], 1);
    assert_eq!(a.rejected[RejectReason::TenantBudget.index()], 1);
    assert_eq!(after.rejected[RejectReason::UnknownTenant.index()], 1);
    assert_eq!(after.rejected.iter().sum::<u64>(), 6);
}

#[test]
fn floors_are_not_lent_to_other_tenants() {
    let mut s = sched(101, 16); // 90 usable
    s.add_tenant(tenant("gold", 40, None)).unwrap();
    s.add_tenant(tenant("bulk", 0, None)).unwrap();
    // bulk can take 50 blocks (90 - gold's unused 40) and not one more.
    for _ in 0..3 {
        s.submit("bulk", &[1; 200], 56, 0.0).unwrap(); // 16 blocks each: 48
    }
    assert_eq!(
        reason(s.submit("bulk", &[1; 40], 9, 0.0)),
        Some("pool_full")
    ); // 4 blocks
    s.submit("bulk", &[1; 20], 12, 0.0).unwrap(); // 2 blocks: 50
                                                  // gold still gets its whole floor, in any shape.
    for _ in 0..5 {
        s.submit("gold", &[1; 120], 8, 0.0).unwrap(); // 8 blocks each
    }
    assert_eq!(reason(s.submit("gold", &[1], 1, 0.0)), Some("pool_full"));
    s.check_invariants().unwrap();
}

#[test]
fn concurrency_limits_tenant_and_scheduler() {
    let mut s = sched(1001, 16);
    let mut c = tenant("a", 0, None);
    c.max_concurrent = Some(2);
    s.add_tenant(c).unwrap();
    s.add_tenant(tenant("b", 0, None)).unwrap();
    s.submit("a", &[1], 1, 0.0).unwrap();
    s.submit("a", &[1], 1, 0.0).unwrap();
    assert_eq!(reason(s.submit("a", &[1], 1, 0.0)), Some("concurrency"));
    for _ in 0..10 {
        s.submit("b", &[1], 1, 0.0).unwrap(); // 12 live = 8 running + 4 waiting
    }
    assert_eq!(reason(s.submit("b", &[1], 1, 0.0)), Some("concurrency"));
}

#[test]
fn rate_limit_retry_after_is_exact_and_deterministic() {
    let mut s = sched(1001, 16);
    let mut c = tenant("a", 0, None);
    c.rate_tokens_per_s = Some(100.0);
    c.burst_tokens = Some(200.0);
    s.add_tenant(c).unwrap();
    s.submit("a", &[1; 100], 50, 10.0).unwrap(); // 150 of 200
    let err = s.submit("a", &[1; 100], 20, 10.0).unwrap_err(); // needs 120, has 50
    let KvError::Rejected(r) = err else { panic!() };
    assert_eq!(r.reason, RejectReason::RateLimited);
    let wait = r.retry_after.unwrap();
    assert!((wait - 0.7).abs() < 1e-9, "{wait}");
    assert_eq!(
        reason(s.submit("a", &[1; 100], 20, 10.0 + wait * 0.99)),
        Some("rate_limited")
    );
    s.submit("a", &[1; 100], 20, 10.0 + wait).unwrap();
    let big = s.submit("a", &[1; 200], 20, 1e6).unwrap_err();
    let KvError::Rejected(r) = big else { panic!() };
    assert_eq!((r.reason, r.retry_after), (RejectReason::RateLimited, None));
}

#[test]
fn cancel_releases_and_unknown_ids_are_typed() {
    let mut h = Harness::new(config(101, 16));
    h.tenant(tenant("a", 0, None));
    let id = h.submit("a", &prompt(40, 2), 8);
    h.step();
    assert!(h.s.pool().used() > 0);
    assert!(matches!(
        h.s.remove_tenant("a"),
        Err(KvError::TenantInUse { .. })
    ));
    h.s.cancel(id).unwrap();
    assert!(matches!(h.s.cancel(id), Err(KvError::UnknownRequest(_))));
    let st = h.s.stats(0.0);
    assert_eq!(
        (st.pool.used, st.pool.reserved, st.tenants[0].cancelled),
        (0, 0, 1)
    );
    h.s.check_invariants().unwrap();
    h.s.remove_tenant("a").unwrap();
}

// ---------------------------------------------------------------------------
// Planning

#[test]
fn chunked_prefill_runs_exactly_the_tokens_of_an_unchunked_run() {
    let run = |chunk: usize, budget: usize| {
        let mut c = config(401, 8);
        c.long_prefill_chunk = chunk;
        c.max_batched_tokens = budget;
        let mut h = Harness::new(c);
        h.tenant(tenant("a", 0, None));
        for i in 0..6 {
            h.submit("a", &prompt(30 + 25 * i, i as i32), 12);
        }
        h.run(1000);
        (h.ran, h.finished)
    };
    let (ran_chunked, out_chunked) = run(8, 16);
    let (ran_whole, out_whole) = run(256, 256);
    assert_eq!(
        ran_chunked, ran_whole,
        "same (position, token) stream per request"
    );
    let outputs = |m: &BTreeMap<u64, FinishedRequest>| {
        m.iter()
            .map(|(&id, f)| (id, f.output.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(outputs(&out_chunked), outputs(&out_whole));
    assert_eq!(out_whole.len(), 6);
}

#[test]
fn every_step_carries_every_running_decode_while_a_long_prompt_prefills() {
    let mut c = config(401, 8);
    c.long_prefill_chunk = 16;
    c.max_batched_tokens = 32;
    let mut h = Harness::new(c);
    h.tenant(tenant("a", 0, None));
    for i in 0..4 {
        h.submit("a", &prompt(5, i), 40);
    }
    h.step();
    h.step();
    let long = h.submit("a", &prompt(200, 9), 4); // 200 tokens in chunks of <= 16
    let mut decoding: Vec<u64> = (1..=4).collect();
    let mut long_steps = 0;
    while h.s.request(long).is_ok_and(|r| r.generated() == 0) {
        let before = decoding.clone();
        h.step();
        let out = h.outcomes.last().unwrap();
        for id in &before {
            assert!(
                out.request_ids[..out.num_decode].contains(id),
                "decode {id} skipped"
            );
        }
        if out.request_ids.contains(&long) {
            long_steps += 1;
        }
        decoding.retain(|id| h.s.request(*id).is_ok());
    }
    assert!(
        long_steps >= 200 / 16,
        "the long prompt was chunked ({long_steps} steps)"
    );
}

#[test]
fn determinism_same_calls_give_byte_identical_plans() {
    let run = || {
        let mut c = config(301, 8);
        c.long_prefill_chunk = 24;
        let mut h = Harness::new(c);
        let mut w = tenant("w", 0, None);
        w.weight = 2.0;
        h.tenant(w);
        h.tenant(tenant("v", 0, None));
        let mut snapshots = Vec::new();
        for i in 0..30 {
            if i % 3 == 0 {
                let name = if i % 2 == 0 { "w" } else { "v" };
                let _ =
                    h.s.submit(name, &prompt(10 + i, i as i32), 6 + i % 5, h.now);
            }
            let parity = h.s.next_parity();
            h.step();
            snapshots.push(h.bufs[parity].clone());
        }
        snapshots
    };
    assert_eq!(run(), run());
}

#[test]
fn commit_and_step_refuse_out_of_order_calls_and_change_nothing() {
    let mut h = Harness::new(config(101, 16));
    h.tenant(tenant("a", 0, None));
    h.submit("a", &prompt(10, 1), 5);
    h.submit("a", &prompt(10, 2), 5);
    let parity = h.s.next_parity();
    let out =
        h.s.step(0.0, &mut h.bufs[parity].as_mut())
            .unwrap()
            .unwrap();
    let before = h.s.stats(0.0);
    let other = 1 - parity;
    assert!(matches!(
        h.s.step(0.0, &mut h.bufs[other].as_mut()),
        Err(KvError::StalePlan(_))
    ));
    assert!(matches!(
        h.s.commit(out.step_id + 1, &[1, 2], 0.0),
        Err(KvError::StalePlan(_))
    ));
    assert!(matches!(
        h.s.commit(out.step_id, &[1], 0.0),
        Err(KvError::InvalidState(_))
    ));
    assert!(matches!(
        h.s.commit(out.step_id, &[1, -2], 0.0),
        Err(KvError::InvalidState(_))
    ));
    assert_eq!(h.s.stats(0.0), before);
    h.s.commit(out.step_id, &[1, 2], 0.0).unwrap();
    assert!(matches!(
        h.s.commit(out.step_id, &[1, 2], 0.0),
        Err(KvError::StalePlan(_))
    ));
}

#[test]
fn stop_tokens_finish_a_request() {
    let mut h = Harness::new(config(101, 16));
    h.tenant(tenant("a", 0, None));
    // Find what the fake engine samples first, then make it a stop token.
    let p = prompt(12, 3);
    let first = sample_of(&p);
    let id = h.s.submit_with_stops("a", &p, 50, &[first], 0.0).unwrap();
    h.step();
    let f = &h.finished[&id];
    assert_eq!(
        (f.reason, f.output.as_slice()),
        (FinishReason::Stop, &[first][..])
    );
    assert_eq!(h.s.pool().used(), 0);
}

#[test]
fn a_cancel_between_step_and_commit_is_skipped_by_the_commit() {
    let mut h = Harness::new(config(101, 16));
    h.tenant(tenant("a", 0, None));
    let a = h.submit("a", &prompt(10, 1), 5);
    let b = h.submit("a", &prompt(10, 2), 5);
    let parity = h.s.next_parity();
    let out =
        h.s.step(0.0, &mut h.bufs[parity].as_mut())
            .unwrap()
            .unwrap();
    h.s.cancel(a).unwrap();
    let c = h.submit("a", &prompt(10, 3), 5); // may reuse a's slab slot
    let ev = h.s.commit(out.step_id, &[7, 8], 0.0).unwrap();
    assert_eq!(ev.request_ids, vec![b]);
    assert_eq!(h.s.request(c).unwrap().generated(), 0);
    h.s.check_invariants().unwrap();
}

/// Two backlogged tenants: served tokens over time, and the largest gap.
fn fairness_run(weight_a: f64, steps: usize) -> (f64, f64, f64) {
    let mut c = config(2001, 8);
    c.max_num_seqs = 4;
    c.max_waiting = 200;
    c.max_seq_len = 64;
    let mut h = Harness::new(c);
    let mut a = tenant("a", 0, None);
    a.weight = weight_a;
    h.tenant(a);
    h.tenant(tenant("b", 0, None));
    let mut served = [0.0f64; 2];
    let mut max_gap: f64 = 0.0;
    let mut n = 0;
    for _ in 0..steps {
        // Keep both backlogged.
        for (k, name) in ["a", "b"].iter().enumerate() {
            while h.s.tenants().by_name(name).unwrap().waiting.len() < 4 {
                n += 1;
                h.s.submit(name, &prompt(16, n + k as i32), 16, h.now)
                    .unwrap();
            }
        }
        h.step();
        let out = h.outcomes.last().unwrap();
        let b = &h.bufs[out.parity];
        for (i, id) in out.request_ids.iter().enumerate() {
            let q = (b.cu_q_lens[i + 1] - b.cu_q_lens[i]) as f64;
            let tid = h.s.request(*id).map(|r| r.tenant).unwrap_or_else(|_| {
                // Finished in this commit: find its tenant from the finished record.
                if h.finished[id].tenant == "a" {
                    0
                } else {
                    1
                }
            });
            served[tid] += q;
        }
        max_gap = max_gap.max((served[0] / weight_a - served[1]).abs());
    }
    (served[0], served[1], max_gap)
}

#[test]
fn equal_weights_share_service_within_a_bound() {
    let (a, b, gap) = fairness_run(1.0, 3000);
    // Each request is 32 tokens (16 prompt + 16 generated); with 4 slots the gap
    // stays within one running set's worth of requests: 4 x 32 = 128 tokens.
    assert!(
        gap <= 128.0,
        "largest service gap {gap} tokens (served {a} vs {b})"
    );
    assert!((a / b - 1.0).abs() < 0.02, "served {a} vs {b}");
}

#[test]
fn weights_two_to_one_converge_to_two_to_one() {
    let (a, b, _) = fairness_run(2.0, 3000);
    let ratio = a / b;
    assert!((ratio - 2.0).abs() < 0.05, "service ratio {ratio}");
}

#[test]
fn max_step_tokens_bounds_the_step_while_that_tenant_runs() {
    let mut c = config(801, 8);
    c.max_batched_tokens = 256;
    c.long_prefill_chunk = 256;
    c.max_seq_len = 1024;
    let mut h = Harness::new(c);
    let mut chat = tenant("chat", 0, None);
    chat.max_step_tokens = Some(32);
    h.tenant(chat);
    h.tenant(tenant("batch", 0, None));
    let chat_id = h.submit("chat", &prompt(8, 1), 20);
    h.submit("batch", &prompt(1000, 2), 4); // more than 20 steps of 31 tokens
    while h.s.request(chat_id).is_ok() {
        h.step();
        let out = h.outcomes.last().unwrap();
        assert!(
            out.num_tokens <= 32,
            "step of {} tokens while chat runs",
            out.num_tokens
        );
    }
    h.step();
    assert!(
        h.outcomes.last().unwrap().num_tokens > 32,
        "batch speeds up once chat is done"
    );
}

#[test]
fn overcommit_preempts_under_pressure_and_every_stream_is_unchanged() {
    let workload = |h: &mut Harness| {
        h.tenant(tenant("a", 0, None));
        let mut b = tenant("b", 0, None);
        b.tier = 1;
        h.tenant(b);
        for i in 0..10 {
            let name = if i % 2 == 0 { "a" } else { "b" };
            h.submit(name, &prompt(20 + 3 * i, i as i32), 60);
        }
        h.run(5000);
    };
    let mut roomy = Harness::new(config(1001, 8));
    workload(&mut roomy);
    assert_eq!(roomy.preempted, 0, "reserve mode never preempts for memory");

    // 70 pages: the reservations (prompt + 1 block, 51 in all) fit, the final
    // lengths (10 to 13 pages each, 113 in all) do not.
    let mut c = config(71, 8);
    c.overhead_reserve = 0.0;
    c.admission = AdmissionMode::Overcommit {
        watermark_blocks: 1,
    };
    c.max_waiting = 10;
    let mut tight = Harness::new(c);
    workload(&mut tight);
    assert!(tight.preempted > 0, "the pool was too small not to preempt");
    let st = tight.s.stats(tight.now);
    assert_eq!(st.preemptions, tight.preempted);
    let outputs = |h: &Harness| {
        h.finished
            .iter()
            .map(|(&id, f)| (id, f.output.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(outputs(&tight), outputs(&roomy));
    assert_eq!(tight.finished.len(), 10);
}

#[test]
fn priority_preemption_frees_a_slot_and_the_victim_keeps_its_place() {
    let mut c = config(401, 8);
    c.max_num_seqs = 2;
    c.max_waiting = 8;
    c.preempt_lower_tiers = true;
    let mut h = Harness::new(c);
    let mut gold = tenant("gold", 0, None);
    gold.tier = 0;
    h.tenant(gold);
    let mut bulk = tenant("bulk", 0, None);
    bulk.tier = 1;
    h.tenant(bulk);
    let b1 = h.submit("bulk", &prompt(10, 1), 30);
    let b2 = h.submit("bulk", &prompt(10, 2), 30);
    let b3 = h.submit("bulk", &prompt(10, 3), 30);
    for _ in 0..5 {
        h.step();
    }
    let g = h.submit("gold", &prompt(10, 4), 5);
    let ev = h.step().unwrap();
    assert_eq!(
        ev.preempted,
        vec![b2],
        "lowest tier, most recently admitted running"
    );
    assert!(h.outcomes.last().unwrap().request_ids.contains(&g));
    // b2 keeps its place at the head of its tier: it runs again before b3, which
    // was admitted after it and has been waiting all along.
    let preempted_at = h.outcomes.len() - 1;
    h.run(1000);
    let first_step_with = |id: u64| {
        h.outcomes[preempted_at..]
            .iter()
            .position(|o| o.request_ids.contains(&id))
            .unwrap()
    };
    assert!(first_step_with(b2) < first_step_with(b3));
    assert_eq!(
        (h.finished[&b2].preemptions, h.finished[&b1].preemptions),
        (1, 0)
    );
    // b2's resumed stream equals an undisturbed run of the same request.
    let mut alone = Harness::new(config(401, 8));
    alone.tenant(tenant("bulk", 0, None));
    let solo = alone.submit("bulk", &prompt(10, 2), 30);
    alone.run(1000);
    assert_eq!(h.finished[&b2].output, alone.finished[&solo].output);
}

// ---------------------------------------------------------------------------
// Property tests

const NAMES: [&str; 4] = ["t0", "t1", "t2", "ghost"];

/// Submits (to a ghost tenant too, and empty or zero-length), steps, cancels
/// and floor changes.
const ADMISSION_MIX: Mix = Mix {
    submit: 4,
    step: 6,
    cancel: 1,
    update: 1,
    submit_tenants: 0..4,
    prompt_len: 0..90,
    max_tokens: 0..60,
    tenants: 0..3,
    floor: Some(0..12),
    ..Mix::NONE
};

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Admission against a naive model, while steps draw pages: an admitted
    /// request always gets its pages (no Internal error), every plan is valid
    /// (the scheduler validates, the harness checks the KV it reads), and every
    /// request ends finished, cancelled or rejected.
    #[test]
    fn scheduler_matches_naive_admission_and_never_starves_an_admitted_request(
        ops in ops(&ADMISSION_MIX, 1..150),
        chunk in 4usize..40,
    ) {
        const BS: usize = 8;
        let mut h = Harness::new(SchedulerConfig {
            num_blocks: 41, block_size: BS, max_num_seqs: 6, max_batched_tokens: 48,
            max_seq_len: 120, overhead_reserve: 0.1, max_waiting: 2,
            long_prefill_chunk: chunk, ..SchedulerConfig::default()
        });
        let usable = 40 - 4;
        let caps = [Some(20), None, Some(8)];
        let mut floors = [6usize, 0, 4];
        let max_conc = [None, Some(3), None];
        for i in 0..3 {
            let mut c = tenant(NAMES[i], floors[i], caps[i]);
            c.max_concurrent = max_conc[i];
            h.tenant(c);
        }
        // Live requests: id -> (tenant, blocks).
        let mut live: BTreeMap<u64, (usize, usize)> = BTreeMap::new();
        let mut admitted = 0usize;
        let mut ended = 0usize;
        // Cancelled, their terminal event not delivered yet.
        let mut cancel_events: BTreeSet<u64> = BTreeSet::new();
        for op in ops {
            let reserved = |live: &BTreeMap<u64, (usize, usize)>, t: usize| -> usize {
                live.values().filter(|r| r.0 == t).map(|r| r.1).sum()
            };
            match op {
                Op::Submit { t, n, m: max_tokens, .. } => {
                    let final_len = n + max_tokens;
                    let blocks = final_len.div_ceil(BS);
                    let expect = if t == 3 { Some("unknown_tenant") }
                        else if n == 0 || max_tokens == 0 { Some("invalid") }
                        else if final_len > 120 { Some("too_long") }
                        // A cap counts every reservation; without one only the pool
                        // bounds the tenant (and no single request may exceed it).
                        else if caps[t].map_or(blocks > usable, |c| reserved(&live, t) + blocks > c) { Some("tenant_budget") }
                        else if max_conc[t].is_some_and(|m| live.values().filter(|r| r.0 == t).count() >= m as usize)
                            || live.len() >= 8 { Some("concurrency") }
                        else {
                            let committed: usize = (0..3).map(|u| {
                                let r = reserved(&live, u) + if u == t { blocks } else { 0 };
                                r.max(floors[u])
                            }).sum();
                            if committed > usable { Some("pool_full") } else { None }
                        };
                    let got = h.s.submit(NAMES[t], &prompt(n, admitted as i32), max_tokens, h.now);
                    match (&got, expect) {
                        (Ok(id), None) => { live.insert(*id, (t, blocks)); admitted += 1; }
                        (Err(e), Some(r)) => prop_assert_eq!(e.reason().map(RejectReason::as_str), Some(r)),
                        _ => prop_assert!(false, "submit {:?}: got {:?}, model says {:?}", op, got, expect),
                    }
                }
                Op::Step { .. } => {
                    if let Some(ev) = h.step() {
                        for f in &ev.finished {
                            if f.reason == FinishReason::Cancelled {
                                // A cancel's terminal event, delivered once.
                                prop_assert!(cancel_events.remove(&f.id));
                                continue;
                            }
                            prop_assert!(live.remove(&f.id).is_some());
                            ended += 1;
                        }
                    }
                }
                Op::Cancel { pick } if !live.is_empty() => {
                    let id = *live.keys().nth(pick % live.len()).unwrap();
                    let (_, blocks) = live.remove(&id).unwrap();
                    prop_assert_eq!(h.s.cancel(id).unwrap().reserved_blocks, blocks);
                    cancel_events.insert(id);
                    ended += 1;
                }
                Op::Update { t, floor: Some(floor), .. } => {
                    let c = op.updated(h.s.tenants().by_name(NAMES[t]).unwrap().config.clone());
                    let others: usize = (0..3).filter(|&u| u != t)
                        .map(|u| reserved(&live, u).max(floors[u])).sum();
                    let fits = caps[t].is_none_or(|cap| floor <= cap)
                        && others + reserved(&live, t).max(floor) <= usable;
                    prop_assert_eq!(h.s.update_tenant(c, h.now).is_ok(), fits);
                    if fits { floors[t] = floor; }
                }
                Op::Cancel { .. } => {}
                op => unreachable!("not in this mix: {op:?}"),
            }
            let st = h.s.stats(h.now);
            prop_assert_eq!(st.live_requests, live.len());
            prop_assert_eq!(st.pool.reserved, live.values().map(|r| r.1).sum::<usize>());
            prop_assert!(st.pool.reserved <= usable);
        }
        // Drain: everything admitted finishes.
        while !live.is_empty() {
            let ev = h.step().expect("live requests make progress");
            for f in &ev.finished {
                if f.reason == FinishReason::Cancelled {
                    prop_assert!(cancel_events.remove(&f.id));
                    continue;
                }
                prop_assert!(live.remove(&f.id).is_some());
                ended += 1;
            }
        }
        for f in h.s.take_finished() {
            prop_assert_eq!(f.reason, FinishReason::Cancelled);
            prop_assert!(cancel_events.remove(&f.id));
        }
        prop_assert!(cancel_events.is_empty(), "every cancel's event is delivered");
        prop_assert_eq!(ended, admitted);
        prop_assert_eq!(h.s.pool().used(), 0);
    }

    /// Random mixes under over-commit and priority preemption: every plan valid,
    /// every request finishes, with the stream of an undisturbed run.
    #[test]
    fn overcommit_and_priority_preemption_lose_nothing(
        reqs in prop::collection::vec((0usize..3, 1usize..60, 1usize..40, 0usize..6), 1..25),
        pages in 20usize..80,
    ) {
        let mut c = SchedulerConfig {
            num_blocks: pages + 1, block_size: 8, max_num_seqs: 4, max_batched_tokens: 32,
            max_seq_len: 100, overhead_reserve: 0.0, max_waiting: 30, long_prefill_chunk: 16,
            admission: AdmissionMode::Overcommit { watermark_blocks: 1 },
            preempt_lower_tiers: true, ..SchedulerConfig::default()
        };
        let mut tight = Harness::new(c.clone());
        c.num_blocks = 2001;
        c.admission = AdmissionMode::Reserve;
        c.preempt_lower_tiers = false;
        let mut roomy = Harness::new(c);
        for h in [&mut tight, &mut roomy] {
            for tier in 0..3u32 {
                let mut t = tenant(NAMES[tier as usize], 0, None);
                t.tier = tier;
                h.tenant(t);
            }
        }
        let mut ids = Vec::new();
        for h in [&mut tight, &mut roomy] {
            let mut mine = Vec::new();
            let mut pending = reqs.clone();
            pending.reverse();
            let mut step = 0;
            while !pending.is_empty() || h.s.live_requests() > 0 {
                while pending.last().is_some_and(|r| r.3 <= step) {
                    let (t, n, m, _) = pending.pop().unwrap();
                    match h.s.submit(NAMES[t], &prompt(n, mine.len() as i32), m, h.now) {
                        Ok(id) => mine.push(Some(id)),
                        Err(e) => {
                            // A tenant without a cap is capped by the usable pool.
                            prop_assert!(matches!(
                                e.reason(),
                                Some(RejectReason::PoolFull | RejectReason::TenantBudget)
                            ));
                            mine.push(None)
                        }
                    }
                }
                h.step();
                step += 1;
                prop_assert!(step < 20_000, "no progress");
            }
            ids.push(mine);
        }
        for (a, b) in ids[0].iter().zip(&ids[1]) {
            if let (Some(a), Some(b)) = (a, b) {
                prop_assert_eq!(&tight.finished[a].output, &roomy.finished[b].output);
            }
        }
        prop_assert_eq!(tight.s.pool().used(), 0);
    }
}

// ---------------------------------------------------------------------------
// Regressions from review: tier changes while preempted, over-commit stalls, a
// capped tenant at the head of the queue; and a fuzzer over every operation,
// cancels and submits between step and commit included, that checks each plan's
// rows against the page lists and the KV read back through them.

mod review {
    use super::*;

    fn step_commit(h: &mut Harness) -> Option<StepOutcome> {
        let ev = h.step();
        ev.map(|_| h.outcomes.last().unwrap().clone())
    }

    /// One slot; tenant "lo" (tier 1) runs request `a` until "hi" (tier 0)
    /// preempts it, then "lo" moves to `new_tier` while `a` waits to resume.
    fn preempted_then_retiered(hi_max_tokens: usize, new_tier: u32) -> (Harness, u64) {
        let mut c = config(101, 16);
        c.max_num_seqs = 1;
        c.preempt_lower_tiers = true;
        let mut h = Harness::new(c);
        let mut lo = tenant("lo", 0, None);
        lo.tier = 1;
        h.tenant(lo.clone());
        h.tenant(tenant("hi", 0, None));
        let a = h.submit("lo", &prompt(10, 1), 20);
        step_commit(&mut h);
        h.submit("hi", &prompt(10, 2), hi_max_tokens);
        let out = step_commit(&mut h).unwrap();
        assert_eq!(out.preempted, vec![a]);
        lo.tier = new_tier;
        h.s.update_tenant(lo, h.now).unwrap();
        h.s.check_invariants().unwrap();
        (h, a)
    }

    #[test]
    fn tier_change_with_request_in_resume_queue_then_cancel() {
        let (mut h, a) = preempted_then_retiered(20, 2);
        h.s.cancel(a).unwrap(); // found in the queue it sits in, not its new tier's
        h.s.check_invariants().unwrap();
    }

    #[test]
    fn tier_change_with_request_in_resume_queue_then_run() {
        let (mut h, a) = preempted_then_retiered(3, 0); // now the same tier as hi
        h.run(200);
        assert_eq!(h.finished[&a].preemptions, 1);
    }

    /// Over-commit: two recomputing prefills whose KV together exceeds the pool.
    #[test]
    fn overcommit_resumed_prefills_never_deadlock() {
        let c = SchedulerConfig {
            num_blocks: 11,
            block_size: 8,
            max_num_seqs: 4,
            max_batched_tokens: 32,
            max_seq_len: 100,
            overhead_reserve: 0.0,
            max_waiting: 30,
            long_prefill_chunk: 16,
            admission: AdmissionMode::Overcommit {
                watermark_blocks: 0,
            },
            preempt_lower_tiers: true,
            ..SchedulerConfig::default()
        };
        let mut h = Harness::new(c);
        let mut lo = tenant("lo", 0, None);
        lo.tier = 1;
        h.tenant(lo);
        h.tenant(tenant("hi", 0, None));
        // Each fits the 10-page pool alone (80 tokens), not both together.
        let _a = h.submit("lo", &prompt(8, 1), 72);
        let _b = h.submit("lo", &prompt(8, 2), 72);
        let mut hi_sent = false;
        let mut nones = 0;
        for i in 0..2000 {
            if h.s.live_requests() == 0 {
                return;
            }
            if !hi_sent && h.s.pool().free_count() <= 1 && i > 3 {
                h.submit("hi", &prompt(8, 3), 40);
                hi_sent = true;
            }
            match h.step() {
                None => {
                    nones += 1;
                    let st = h.s.stats(h.now);
                    assert!(nones <= 5, "stalled at step {i}: {st:?}");
                }
                Some(_) => nones = 0,
            }
        }
        panic!("no finish");
    }
}

mod review_fuzz {
    use super::*;

    /// Submits (with stop tokens or not), steps with a cancel or a submit
    /// between plan and commit, cancels, and tenant updates (floor, per-step
    /// cap, weight).
    const ROWS_MIX: Mix = Mix {
        submit: 4,
        step: 8,
        cancel: 1,
        update: 1,
        submit_tenants: 0..3,
        prompt_len: 1..50,
        max_tokens: 1..40,
        stop: 0.5,
        cancel_mid: 0.3,
        submit_mid: Some((0.2, (0..1, 0..1, 5..6))),
        tenants: 0..3,
        floor: Some(0..6),
        step_cap: Some((0.5, 1..20)),
        weight: Some(1..4),
        ..Mix::NONE
    };

    fn check_rows(s: &Scheduler, b: &OwnedPlanBuffers, out: &StepOutcome) -> Result<(), String> {
        let pps = s.plan_shape().pages_per_seq;
        for (i, &id) in out.request_ids.iter().enumerate() {
            let r = s.request(id).map_err(|e| e.to_string())?;
            let row = &b.page_indices[i * pps..(i + 1) * pps];
            let want: Vec<i32> = r
                .pages
                .iter()
                .map(|&p| p as i32)
                .chain(std::iter::repeat(0))
                .take(pps)
                .collect();
            if row != &want[..] {
                return Err(format!("row {i} of request {id}: {row:?} != {want:?}"));
            }
        }
        for i in out.num_seqs..s.plan_shape().max_seqs {
            if b.page_indices[i * pps..(i + 1) * pps]
                .iter()
                .any(|&p| p != 0)
            {
                return Err(format!("pad row {i} dirty"));
            }
        }
        Ok(())
    }

    fn run(
        ops: Vec<Op>,
        over: bool,
        preempt: bool,
        bs: usize,
        pages: usize,
        seqs: usize,
        chunk: usize,
    ) -> Result<(), TestCaseError> {
        let c = SchedulerConfig {
            num_blocks: pages + 1,
            block_size: bs,
            max_num_seqs: seqs,
            max_batched_tokens: 24.max(seqs),
            max_seq_len: 96.min(pages * bs).max(2),
            overhead_reserve: 0.0,
            max_waiting: 6,
            long_prefill_chunk: chunk,
            admission: if over {
                AdmissionMode::Overcommit {
                    watermark_blocks: 1,
                }
            } else {
                AdmissionMode::Reserve
            },
            preempt_lower_tiers: preempt,
            ..SchedulerConfig::default()
        };
        let mut h = Harness::new(c);
        for (tier, name) in NAMES[..3].iter().enumerate() {
            let mut tc = tenant(name, 0, None);
            tc.tier = tier as u32;
            // Two of the three share a prefix-cache namespace.
            tc.prefix_namespace = (tier > 0).then(|| "group".to_owned());
            h.tenant(tc);
        }
        let mut k = 0i32;
        let mut nones = 0;
        for op in ops {
            match op {
                Op::Submit { t, n, m, stop, .. } => {
                    k += 1;
                    // Three families of prompts: each one a prefix of the longer
                    // ones of its family, so the prefix cache is hit all the time.
                    let p = prompt(n, k % 3);
                    let stops: Vec<i32> = if stop {
                        (0..50_000).step_by(7).collect()
                    } else {
                        vec![]
                    };
                    let _ = h.s.submit_with_stops(NAMES[t], &p, m, &stops, h.now);
                }
                Op::Step {
                    cancel_mid,
                    submit_mid,
                } => {
                    let out = h.plan().map_err(|e| TestCaseError::fail(e.to_string()))?;
                    let Some(out) = out else {
                        if h.s.live_requests() > 0 {
                            nones += 1;
                            prop_assert!(nones < 4, "stalled: {:?}", h.s.stats(h.now).pool);
                        }
                        continue;
                    };
                    nones = 0;
                    check_rows(&h.s, &h.bufs[out.parity], &out).map_err(TestCaseError::fail)?;
                    let sampled = h.execute(&out, |_, _| {}).map_err(TestCaseError::fail)?;
                    if let Some(pick) = cancel_mid {
                        let ids: Vec<u64> = (1..=k as u64 + 1)
                            .filter(|&id| h.s.request(id).is_ok())
                            .collect();
                        if !ids.is_empty() {
                            h.s.cancel(ids[pick % ids.len()]).unwrap();
                        }
                        h.s.check_invariants().map_err(TestCaseError::fail)?;
                    }
                    if let Some((t, _, n)) = submit_mid {
                        k += 1;
                        let _ = h.s.submit(NAMES[t], &prompt(n, k), 5, h.now);
                    }
                    h.commit(out, &sampled)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                Op::Cancel { pick } => {
                    let ids: Vec<u64> = (1..=k as u64 + 1)
                        .filter(|&id| h.s.request(id).is_ok())
                        .collect();
                    if !ids.is_empty() {
                        h.s.cancel(ids[pick % ids.len()]).unwrap();
                    }
                }
                Op::Update { t, .. } => {
                    // Each tenant stays on its own tier (the one it was added with).
                    let c = op.updated(h.s.tenants().by_name(NAMES[t]).unwrap().config.clone());
                    let _ = h.s.update_tenant(c, h.now);
                }
                op => unreachable!("not in this mix: {op:?}"),
            }
            h.s.check_invariants().map_err(TestCaseError::fail)?;
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
        #[test]
        fn fuzz_reserve(ops in ops(&ROWS_MIX, 1..200), preempt in any::<bool>(),
                        bs in prop::sample::select(vec![1usize, 2, 4, 8]), seqs in 1usize..6, chunk in 1usize..30) {
            run(ops, false, preempt, bs, 200, seqs, chunk)?;
        }
        #[test]
        fn fuzz_over(ops in ops(&ROWS_MIX, 1..200), preempt in any::<bool>(),
                        bs in prop::sample::select(vec![1usize, 2, 4, 8]), seqs in 1usize..6, chunk in 1usize..30, pages in 8usize..40) {
            run(ops, true, preempt, bs, pages, seqs, chunk)?;
        }
    }
}
mod review2 {
    use super::*;
    #[test]
    fn tier_change_pops_the_wrong_resume_queue() {
        let mut c = config(101, 16);
        c.max_num_seqs = 2;
        c.preempt_lower_tiers = true;
        let mut h = Harness::new(c);
        let mut l1 = tenant("l1", 0, None);
        l1.tier = 1;
        h.tenant(l1.clone());
        let mut l2 = tenant("l2", 0, None);
        l2.tier = 2;
        h.tenant(l2);
        h.tenant(tenant("hi", 0, None));
        let a = h.submit("l1", &prompt(10, 1), 30);
        let b = h.submit("l2", &prompt(10, 2), 30);
        h.step();
        h.submit("hi", &prompt(10, 3), 3);
        h.submit("hi", &prompt(10, 4), 3);
        h.step();
        h.step();
        assert!(!h.s.request(a).unwrap().is_running() && !h.s.request(b).unwrap().is_running());
        l1.tier = 2;
        h.s.update_tenant(l1, h.now).unwrap();
        h.s.check_invariants().unwrap();
        for _ in 0..10 {
            h.step();
        } // Harness::step checks invariants after every commit
    }
}
mod review3 {
    use super::*;
    #[test]
    fn a_capped_tenant_at_the_queue_head_neither_starves_nor_idles_slots() {
        let mut c = config(1001, 16);
        c.max_num_seqs = 8;
        let mut h = Harness::new(c);
        let mut x = tenant("x", 0, None);
        x.max_step_tokens = Some(2);
        h.tenant(x);
        h.tenant(tenant("b", 0, None));
        for i in 0..3 {
            h.submit("b", &prompt(4, i), 100);
        }
        h.step();
        h.step();
        h.submit("x", &prompt(4, 9), 5);
        for i in 0..3 {
            h.submit("b", &prompt(4, 10 + i), 5);
        }
        for _ in 0..20 {
            h.step();
        }
        // x enters at once (its first chunk is allowed even though the running
        // decodes alone exceed its cap), b's short requests follow once x is done,
        // and all of them finish while b's long decodes are still running.
        let st = h.s.stats(h.now);
        let finished = |name: &str| st.tenants.iter().find(|t| t.name == name).unwrap().finished;
        assert_eq!((finished("x"), finished("b")), (1, 3));
        assert_eq!((st.running, st.waiting), (3, 0));
    }
}

mod ops;
mod ops_fuzz;
mod prefix;
mod prefix_fuzz;
mod random_ops;
mod terminal;
