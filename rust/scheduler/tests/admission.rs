//! Admission through the scheduler: what a request reserves, why it is
//! refused and what a refusal changes (counters only), floors, concurrency,
//! rate limits, and a naive model of admission under random operations.

use super::*;

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
fn refused_work_charged_to_the_rate_limit_delays_the_next_request() {
    let mut s = sched(1001, 16);
    let mut c = tenant("a", 0, None);
    c.rate_tokens_per_s = Some(100.0);
    c.burst_tokens = Some(200.0);
    s.add_tenant(c).unwrap();
    s.add_tenant(tenant("free", 0, None)).unwrap();
    assert_eq!(s.rate_wait("a", 200, 10.0).unwrap(), 0.0);
    assert_eq!(s.rate_wait("a", 201, 10.0).unwrap(), f64::INFINITY);
    // 150 tokens of refused work: 50 left, so 120 more wait 0.7 s, as a submit says.
    s.charge_rate("a", 150, 10.0).unwrap();
    assert!((s.rate_wait("a", 120, 10.0).unwrap() - 0.7).abs() < 1e-9);
    let KvError::Rejected(r) = s.submit("a", &[1; 100], 20, 10.0).unwrap_err() else {
        panic!()
    };
    assert!((r.retry_after.unwrap() - 0.7).abs() < 1e-9);
    // A charge past the level empties the bucket, no further.
    s.charge_rate("a", 10_000, 10.0).unwrap();
    assert!((s.rate_wait("a", 200, 10.0).unwrap() - 2.0).abs() < 1e-9);
    s.submit("a", &[1; 100], 100, 12.0).unwrap();
    // No rate limit: nothing to charge, nothing to wait for.
    s.charge_rate("free", 10_000, 12.0).unwrap();
    assert_eq!(s.rate_wait("free", 10_000, 12.0).unwrap(), 0.0);
    assert!(matches!(
        s.charge_rate("nobody", 1, 12.0),
        Err(KvError::UnknownTenant(_))
    ));
    assert!(matches!(
        s.rate_wait("nobody", 1, 12.0),
        Err(KvError::UnknownTenant(_))
    ));
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

/// Submits (to a ghost tenant too, and empty or zero-length), steps, cancels
/// and floor changes.
pub(super) const ADMISSION_MIX: Mix = Mix {
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

}
