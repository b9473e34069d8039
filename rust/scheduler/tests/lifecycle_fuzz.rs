//! A fuzzer for operations: submits with stop tokens,
//! steps, cancels, live reconfiguration (raising and lowering the shape-bound
//! knobs while sequences run, overhead reserve, ladder on and off), drains with
//! deadlines past and future, tier changes and idle time, in both admission
//! modes with and without priority preemption. After every operation the
//! invariants hold and a refused reconfiguration changes nothing; in the end
//! every admitted request is finished, cancelled or handed back exactly once.

use super::*;
use crate::ladder::{Action, Rung, Signal};
use random_ops::RESERVES;
use std::collections::BTreeSet;

fn rung(signal: Signal, engage: f64, release: f64, action: Action) -> Rung {
    Rung {
        signal,
        engage,
        release,
        action,
    }
}

/// Submits (with stop tokens or not), steps, cancels, live reconfiguration,
/// drains, tier changes and idle time.
pub(super) const LIFECYCLE_MIX: Mix = Mix {
    submit: 5,
    step: 8,
    cancel: 1,
    update: 1,
    reconf: 1,
    drain: 1,
    wait: 1,
    submit_tenants: 0..3,
    prompt_len: 1..50,
    max_tokens: 1..40,
    stop: 0.5,
    tenants: 0..3,
    tier: Some(0..3),
    ..Mix::NONE
};

fn lad() -> LadderConfig {
    LadderConfig {
        rungs: vec![
            rung(Signal::ReservedShare, 0.6, 0.3, Action::ShedLowestTier),
            rung(Signal::QueueDepth, 3.0, 1.0, Action::CapMaxTokens(5)),
            rung(Signal::OldestWaitS, 0.1, 0.05, Action::MaxRunning(2)),
            rung(Signal::OldestWaitS, 0.2, 0.1, Action::RejectFast),
        ],
        retry_after_s: 0.5,
    }
}

const NAMES: [&str; 3] = ["t0", "t1", "t2"];

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]
    #[test]
    fn every_admitted_request_ends_exactly_once_under_random_operations(ops in ops(&LIFECYCLE_MIX, 1..200), over in any::<bool>(), pc in any::<bool>(), part in any::<bool>(), groups in kv_groups()) {
        let base = SchedulerConfig {
            num_blocks: 61, block_size: 8, max_num_seqs: 6, max_batched_tokens: 48,
            max_seq_len: 128, overhead_reserve: 0.0, max_waiting: 6, long_prefill_chunk: 16,
            admission: if over { AdmissionMode::Overcommit { watermark_blocks: 1 } } else { AdmissionMode::Reserve },
            preempt_lower_tiers: pc, ladder: lad(), kv_cache_groups: groups,
            // A cache partitioned by tenant needs reserve admission.
            prefix_cache_partition: if part && !over { CachePartition::Tenant } else { CachePartition::Shared },
            ..SchedulerConfig::default()
        };
        let mut h = Harness::new(base.clone());
        for (i, n) in NAMES.iter().enumerate() {
            let mut c = TenantConfig::new(*n);
            c.tier = i as u32;
            // Partitioned, a floor is the room a tenant keeps cached blocks in.
            c.kv_floor_blocks = if part { 4 } else { 0 };
            h.tenant(c);
        }
        let mut admitted = BTreeSet::new();
        let mut finished = BTreeSet::new();
        let mut cancelled = BTreeSet::new();
        // Terminal events of cancelled and handed-back requests, as delivered.
        let mut cancel_events = BTreeSet::new();
        let mut deadline_events = BTreeSet::new();
        // Displaced for a higher tier: ended Shed outside a commit.
        let mut shed_events = BTreeSet::new();
        let mut k = 0i32;
        for op in ops {
            match op {
                Op::Submit { t, n, m, stop, .. } => {
                    k += 1;
                    let p = prompt(n, k);
                    let stops = if stop { vec![p[0] % 7 + 3] } else { vec![] };
                    if let Ok(id) = h.s.submit_with_stops(NAMES[t], &p, m, &stops, h.now) {
                        admitted.insert(id);
                    }
                }
                Op::Step { .. } => {
                    if let Some(ev) = h.step() {
                        for f in ev.finished {
                            match f.reason {
                                FinishReason::Cancelled => prop_assert!(cancel_events.insert(f.id)),
                                FinishReason::DrainDeadline => prop_assert!(deadline_events.insert(f.id)),
                                FinishReason::Shed => prop_assert!(shed_events.insert(f.id)),
                                _ => prop_assert!(finished.insert(f.id)),
                            }
                        }
                    } else { h.now += 0.01; }
                }
                Op::Cancel { pick } => {
                    let live: Vec<u64> = admitted.iter().filter(|&&i| !finished.contains(&i) && !cancelled.contains(&i) && h.s.request(i).is_ok()).copied().collect();
                    if !live.is_empty() {
                        let id = live[pick % live.len()];
                        h.s.cancel(id).unwrap();
                        cancelled.insert(id);
                    }
                }
                Op::Reconf { seqs, mbt, msl, reserve, ladder, preempt } => {
                    let mut c = h.s.config().clone();
                    c.max_num_seqs = seqs;
                    c.max_batched_tokens = mbt.max(seqs);
                    c.max_seq_len = msl;
                    c.overhead_reserve = RESERVES[reserve as usize];
                    c.ladder = if ladder { lad() } else { LadderConfig::off() };
                    c.preempt_lower_tiers = preempt;
                    let before = (h.s.config().clone(), h.s.stats(h.now));
                    match h.s.update_config(c.clone()) {
                        Ok(()) => prop_assert_eq!(h.s.config(), &c),
                        Err(_) => prop_assert_eq!((h.s.config().clone(), h.s.stats(h.now)), before),
                    }
                }
                Op::Drain { delta } => { h.s.drain(h.now + delta as f64 * 0.01).unwrap(); }
                Op::Update { t, .. } => {
                    let c = op.updated(h.s.tenants().by_name(NAMES[t]).unwrap().config.clone());
                    h.s.update_tenant(c, h.now).unwrap();
                }
                Op::Wait { dt } => h.now += dt as f64 * 0.01,
                op => unreachable!("not in this mix: {op:?}"),
            }
            h.s.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert!(h.s.ladder().level() <= h.s.ladder().config().rungs.len());
        }
        // Drain to the end.
        h.s.drain(h.now + 5.0).unwrap();
        let mut n = 0;
        while h.s.lifecycle() != Lifecycle::Drained {
            match h.step() {
                Some(ev) => for f in ev.finished {
                    match f.reason {
                        FinishReason::Cancelled => prop_assert!(cancel_events.insert(f.id)),
                        FinishReason::DrainDeadline => prop_assert!(deadline_events.insert(f.id)),
                        FinishReason::Shed => prop_assert!(shed_events.insert(f.id)),
                        _ => prop_assert!(finished.insert(f.id)),
                    }
                },
                None => h.now += 0.01,
            }
            n += 1;
            prop_assert!(n < 20000, "drain never ends; live {}", h.s.live_requests());
        }
        for f in h.s.take_finished() {
            match f.reason {
                FinishReason::Cancelled => prop_assert!(cancel_events.insert(f.id)),
                FinishReason::DrainDeadline => prop_assert!(deadline_events.insert(f.id)),
                FinishReason::Shed => prop_assert!(shed_events.insert(f.id)),
                r => prop_assert!(false, "{:?} outside a commit", r),
            }
        }
        let (_, back) = h.s.checkpoint();
        let back: BTreeSet<u64> = back.iter().map(|r| r.id).collect();
        for id in &admitted {
            let c = finished.contains(id) as u8 + cancelled.contains(id) as u8 + back.contains(id) as u8
                + shed_events.contains(id) as u8;
            prop_assert_eq!(c, 1, "request {} accounted {} times", id, c);
        }
        // Exactly one terminal event each, with the reason it ended for.
        prop_assert_eq!(&cancel_events, &cancelled);
        prop_assert_eq!(&deadline_events, &back);
        prop_assert_eq!(h.s.stats(h.now).displaced, shed_events.len() as u64);
        prop_assert_eq!(h.s.pool().used(), 0);
    }
}
