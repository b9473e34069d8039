use super::*;
use proptest::prelude::*;

fn sched(num_blocks: usize, block_size: usize) -> Scheduler {
    Scheduler::new(SchedulerConfig {
        num_blocks,
        block_size,
        max_num_seqs: 8,
        max_batched_tokens: 64,
        max_seq_len: 256,
        overhead_reserve: 0.1,
        max_waiting: 4,
    })
    .unwrap()
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

#[test]
fn admission_reserves_final_length_and_pages_come_lazily() {
    let mut s = sched(101, 16); // 100 pages, 10 reserved, 90 usable
    s.add_tenant(tenant("a", 0, None)).unwrap();
    let id = s.submit("a", &[1; 20], 30, 0.0).unwrap(); // 50 tokens -> 4 blocks
    let st = s.stats(0.0);
    assert_eq!((st.pool.usable, st.pool.reserved, st.pool.used), (90, 4, 0));
    s.extend_kv(id, 20).unwrap();
    assert_eq!(s.pool().used(), 2);
    for t in 0..30 {
        s.push_token(id, t).unwrap();
        s.extend_kv(id, 1).unwrap();
    }
    assert_eq!(s.pool().used(), 4);
    assert!(matches!(
        s.push_token(id, 0),
        Err(KvError::InvalidRequest(_))
    ));
    assert!(matches!(
        s.extend_kv(id, 1),
        Err(KvError::InvalidRequest(_))
    ));
    s.finish(id).unwrap();
    let st = s.stats(0.0);
    assert_eq!(
        (st.pool.reserved, st.pool.used, st.live_requests),
        (0, 0, 0)
    );
    s.check_invariants().unwrap();
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
    let mut s = sched(101, 16);
    s.add_tenant(tenant("a", 0, None)).unwrap();
    let id = s.submit("a", &[1; 40], 8, 0.0).unwrap();
    s.extend_kv(id, 40).unwrap();
    assert!(matches!(
        s.remove_tenant("a"),
        Err(KvError::TenantInUse { .. })
    ));
    s.cancel(id).unwrap();
    assert!(matches!(s.cancel(id), Err(KvError::UnknownRequest(_))));
    assert!(matches!(
        s.extend_kv(id, 1),
        Err(KvError::UnknownRequest(_))
    ));
    let st = s.stats(0.0);
    assert_eq!(
        (st.pool.used, st.pool.reserved, st.tenants[0].cancelled),
        (0, 0, 1)
    );
    s.remove_tenant("a").unwrap();
}

// ---------------------------------------------------------------------------
// Property test: random operation sequences against a naive model of admission.

const NAMES: [&str; 4] = ["t0", "t1", "t2", "ghost"];

#[derive(Clone, Debug)]
enum Op {
    Submit {
        tenant: usize,
        prompt: usize,
        max_tokens: usize,
    },
    Extend {
        pick: usize,
        n: usize,
    },
    Generate {
        pick: usize,
    },
    Finish {
        pick: usize,
    },
    Cancel {
        pick: usize,
    },
    SetFloor {
        tenant: usize,
        floor: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..4, 0usize..90, 0usize..60)
            .prop_map(|(tenant, prompt, max_tokens)| Op::Submit { tenant, prompt, max_tokens }),
        4 => (any::<usize>(), 1usize..40).prop_map(|(pick, n)| Op::Extend { pick, n }),
        2 => any::<usize>().prop_map(|pick| Op::Generate { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Finish { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Cancel { pick }),
        1 => (0usize..3, 0usize..12).prop_map(|(tenant, floor)| Op::SetFloor { tenant, floor }),
    ]
}

/// The naive model: per tenant config and reservations; per request its numbers.
#[derive(Clone, Debug)]
struct ModelReq {
    id: u64,
    tenant: usize,
    blocks: usize,
    final_len: usize,
    kv: usize,
    generated: usize,
    max_tokens: usize,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn scheduler_matches_naive_admission_and_never_starves_an_admitted_request(
        ops in prop::collection::vec(op(), 1..150)
    ) {
        const BS: usize = 8;
        let mut s = Scheduler::new(SchedulerConfig {
            num_blocks: 41, block_size: BS, max_num_seqs: 6, max_batched_tokens: 64,
            max_seq_len: 120, overhead_reserve: 0.1, max_waiting: 2,
        }).unwrap();
        let usable = 40 - 4;
        let caps = [Some(20), None, Some(8)];
        let mut floors = [6usize, 0, 4];
        let max_conc = [None, Some(3), None];
        for i in 0..3 {
            let mut c = tenant(NAMES[i], floors[i], caps[i]);
            c.max_concurrent = max_conc[i];
            s.add_tenant(c).unwrap();
        }
        let mut live: Vec<ModelReq> = Vec::new();
        for op in ops {
            let reserved = |live: &[ModelReq], t: usize| -> usize {
                live.iter().filter(|r| r.tenant == t).map(|r| r.blocks).sum()
            };
            match op {
                Op::Submit { tenant: t, prompt, max_tokens } => {
                    let final_len = prompt + max_tokens;
                    let blocks = final_len.div_ceil(BS);
                    let expect = if t == 3 { Some("unknown_tenant") }
                        else if prompt == 0 || max_tokens == 0 { Some("invalid") }
                        else if final_len > 120 { Some("too_long") }
                        else if reserved(&live, t) + blocks > caps[t].unwrap_or(usable) { Some("tenant_budget") }
                        else if max_conc[t].is_some_and(|m| live.iter().filter(|r| r.tenant == t).count() >= m as usize)
                            || live.len() >= 8 { Some("concurrency") }
                        else {
                            let committed: usize = (0..3).map(|u| {
                                let r = reserved(&live, u) + if u == t { blocks } else { 0 };
                                r.max(floors[u])
                            }).sum();
                            if committed > usable { Some("pool_full") } else { None }
                        };
                    let got = s.submit(NAMES[t], &vec![7; prompt], max_tokens, 0.0);
                    match (&got, expect) {
                        (Ok(id), None) => live.push(ModelReq {
                            id: *id, tenant: t, blocks, final_len, kv: 0, generated: 0, max_tokens,
                        }),
                        (Err(e), Some(r)) => prop_assert_eq!(e.reason().map(RejectReason::as_str), Some(r)),
                        _ => prop_assert!(false, "submit {:?}: got {:?}, model says {:?}", op, got, expect),
                    }
                }
                Op::Extend { pick, n } if !live.is_empty() => {
                    let at = pick % live.len();
                    let r = &mut live[at];
                    let res = s.extend_kv(r.id, n);
                    if r.kv + n <= r.final_len {
                        // The guarantee: within its final length, a page is always there.
                        prop_assert!(res.is_ok(), "admitted request starved: {:?}", res);
                        r.kv += n;
                    } else {
                        prop_assert!(matches!(res, Err(KvError::InvalidRequest(_))));
                    }
                }
                Op::Generate { pick } if !live.is_empty() => {
                    let at = pick % live.len();
                    let r = &mut live[at];
                    let res = s.push_token(r.id, 3);
                    prop_assert_eq!(res.is_ok(), r.generated < r.max_tokens);
                    if res.is_ok() { r.generated += 1; }
                }
                Op::Finish { pick } | Op::Cancel { pick } if !live.is_empty() => {
                    let r = live.swap_remove(pick % live.len());
                    let done = if matches!(op, Op::Finish { .. }) { s.finish(r.id) } else { s.cancel(r.id) };
                    prop_assert_eq!(done.unwrap().reserved_blocks, r.blocks);
                }
                Op::SetFloor { tenant: t, floor } => {
                    let mut c = s.tenants().get(s.tenants().id(NAMES[t]).unwrap()).config.clone();
                    c.kv_floor_blocks = floor;
                    let others: usize = (0..3).filter(|&u| u != t)
                        .map(|u| reserved(&live, u).max(floors[u])).sum();
                    let fits = caps[t].is_none_or(|cap| floor <= cap)
                        && others + reserved(&live, t).max(floor) <= usable;
                    prop_assert_eq!(s.update_tenant(c, 0.0).is_ok(), fits);
                    if fits { floors[t] = floor; }
                }
                _ => {}
            }
            s.check_invariants().map_err(TestCaseError::fail)?;
            let st = s.stats(0.0);
            prop_assert_eq!(st.live_requests, live.len());
            prop_assert_eq!(st.pool.reserved, live.iter().map(|r| r.blocks).sum::<usize>());
            prop_assert_eq!(
                st.pool.used,
                live.iter().map(|r| r.kv.div_ceil(BS)).sum::<usize>()
            );
            prop_assert!(st.pool.reserved <= usable);
        }
    }
}
