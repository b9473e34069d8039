//! Tier 0 first under every limit: a higher tier refused for a
//! global limit that lower tiers hold displaces them (ended `Shed`, told
//! through the terminal event, all or nothing); the ladder's rungs degrade
//! the lower tiers and spare the top one.

use super::*;

/// Gold (tier 0) and bulk (tier 1); `max_num_seqs` 2 and `max_waiting` 2: at
/// most 4 live requests.
fn two_tiers(num_blocks: usize, preempt: bool) -> Harness {
    let mut c = config(num_blocks, 8);
    c.max_num_seqs = 2;
    c.max_waiting = 2;
    c.overhead_reserve = 0.0;
    c.preempt_lower_tiers = preempt;
    let mut h = Harness::new(c);
    let mut gold = tenant("gold", 0, None);
    gold.tier = 0;
    h.tenant(gold);
    let mut bulk = tenant("bulk", 0, None);
    bulk.tier = 1;
    h.tenant(bulk);
    h
}

/// What a refusal must leave as it was.
fn snapshot(h: &Harness) -> (Vec<u64>, SchedulerStats) {
    let mut st = h.s.stats(h.now);
    st.rejected = [0; RejectReason::COUNT];
    for t in &mut st.tenants {
        t.rejected = Default::default();
    }
    (h.s.requests.ids().collect(), st)
}

#[test]
fn tier_0_takes_the_newest_waiting_lower_tier_place_under_the_live_cap() {
    let mut h = two_tiers(401, false);
    let bulk: Vec<u64> = (0..4)
        .map(|k| h.submit("bulk", &prompt(10, k), 20))
        .collect();
    h.step(); // bulk[0] and bulk[1] run; bulk[2], bulk[3] wait
    let _ = h.s.take_events();
    let g = h.s.submit("gold", &prompt(10, 9), 5, h.now).unwrap();
    // The newest waiting bulk request made room, and its waiter is told.
    let ended = h.s.take_finished();
    assert_eq!(ended.len(), 1);
    let f = &ended[0];
    assert_eq!(
        (f.id, f.reason, f.tenant.as_str()),
        (bulk[3], FinishReason::Shed, "bulk")
    );
    assert!(f.retry_after.is_some_and(|r| r > 0.0));
    assert!(f.output.is_empty());
    assert_eq!(h.s.stats(h.now).displaced, 1);
    let ev = h.s.take_events();
    assert!(
        ev.iter().any(|e| matches!(e, SchedulerEvent::Displaced { request, limit: "concurrency", ran: false, .. } if *request == bulk[3])),
        "{ev:?}"
    );
    assert!(h.s.request(g).is_ok());
    // The next gold takes bulk[2]'s place; then only running bulk requests are
    // left, which are not displaced without preempt_lower_tiers: refused, and
    // nothing changes.
    h.s.submit("gold", &prompt(10, 10), 5, h.now).unwrap();
    assert_eq!(h.s.take_finished()[0].id, bulk[2]);
    let before = snapshot(&h);
    let e = h.s.submit("gold", &prompt(10, 11), 5, h.now).unwrap_err();
    assert_eq!(e.reason(), Some(RejectReason::Concurrency));
    assert_eq!(snapshot(&h), before);
    assert!(h.s.take_finished().is_empty());
    h.s.check_invariants().unwrap();
    h.run(1000);
    assert_eq!(h.finished[&bulk[0]].reason, FinishReason::Length);
}

#[test]
fn with_preemption_a_running_lower_tier_request_is_displaced_too() {
    let mut h = two_tiers(401, true);
    let bulk: Vec<u64> = (0..4)
        .map(|k| h.submit("bulk", &prompt(10, k), 20))
        .collect();
    h.step();
    for k in 0..4 {
        h.s.submit("gold", &prompt(10, 20 + k), 5, h.now).unwrap();
    }
    // Waiting ones first (newest first), then running ones (newest first).
    let shed: Vec<u64> = h.s.take_finished().iter().map(|f| f.id).collect();
    assert_eq!(shed, vec![bulk[3], bulk[2], bulk[1], bulk[0]]);
    assert_eq!(h.s.stats(h.now).displaced, 4);
    h.s.check_invariants().unwrap();
    assert_eq!(h.s.pool().used(), 0, "the running victims' pages went back");
    h.run(1000);
}

#[test]
fn pool_full_displaces_just_enough_and_refuses_unchanged_when_not_enough() {
    // 60 usable blocks of 8 tokens; each bulk request reserves 10 blocks.
    let mut h = two_tiers(61, false);
    h.s.update_config(SchedulerConfig {
        max_waiting: 20,
        ..h.s.config().clone()
    })
    .unwrap();
    let bulk: Vec<u64> = (0..6)
        .map(|k| h.submit("bulk", &prompt(40, k), 40))
        .collect();
    // 15 blocks for gold: two bulk reservations must go, the two newest.
    let g = h.s.submit("gold", &prompt(60, 9), 60, h.now).unwrap();
    let shed: Vec<u64> = h.s.take_finished().iter().map(|f| f.id).collect();
    assert_eq!(shed, vec![bulk[5], bulk[4]]);
    h.s.check_invariants().unwrap();
    // 30 blocks: three of the four bulk reservations left.
    h.s.submit("gold", &prompt(120, 3), 120, h.now).unwrap();
    let shed: Vec<u64> = h.s.take_finished().iter().map(|f| f.id).collect();
    assert_eq!(shed, vec![bulk[3], bulk[2], bulk[1]]);
    // 30 more: even the last bulk request would not do (gold's own
    // reservations stay). Refused for the pool, and nothing changes.
    let before = snapshot(&h);
    let e = h.s.submit("gold", &prompt(120, 4), 120, h.now).unwrap_err();
    assert_eq!(e.reason(), Some(RejectReason::PoolFull));
    assert_eq!(snapshot(&h), before);
    assert!(h.s.take_finished().is_empty());
    assert_eq!(h.s.stats(h.now).displaced, 5);
    assert!(h.s.request(g).is_ok() && h.s.request(bulk[0]).is_ok());
    h.run(2000);
}

#[test]
fn a_tenants_own_limits_and_the_same_tier_are_not_displaced_for() {
    let mut h = two_tiers(401, false);
    let mut gold = tenant("gold", 0, None);
    gold.max_concurrent = Some(1);
    h.s.update_tenant(gold, h.now).unwrap();
    h.submit("bulk", &prompt(10, 1), 20);
    h.submit("gold", &prompt(10, 2), 20);
    let e = h.s.submit("gold", &prompt(10, 3), 20, h.now).unwrap_err();
    assert_eq!(e.reason(), Some(RejectReason::Concurrency));
    assert!(h.s.take_finished().is_empty());
    // Bulk (the lowest tier) never displaces anyone.
    h.submit("bulk", &prompt(10, 4), 20);
    h.submit("bulk", &prompt(10, 5), 20);
    let e = h.s.submit("bulk", &prompt(10, 6), 20, h.now).unwrap_err();
    assert_eq!(e.reason(), Some(RejectReason::Concurrency));
    assert!(h.s.take_finished().is_empty());
    assert_eq!(h.s.stats(h.now).displaced, 0);
}

#[test]
fn the_ladder_caps_and_rejects_fast_below_the_top_tier_only() {
    use crate::ladder::{Action, Rung, Signal};
    let mut c = config(401, 8);
    c.max_num_seqs = 1;
    c.max_waiting = 40;
    c.ladder = LadderConfig {
        rungs: vec![
            Rung {
                signal: Signal::QueueDepth,
                engage: 2.0,
                release: 1.0,
                action: Action::CapMaxTokens(4),
            },
            Rung {
                signal: Signal::QueueDepth,
                engage: 3.0,
                release: 1.5,
                action: Action::MaxRunning(1),
            },
            Rung {
                signal: Signal::QueueDepth,
                engage: 4.0,
                release: 2.0,
                action: Action::RejectFast,
            },
        ],
        retry_after_s: 0.5,
    };
    let mut h = Harness::new(c);
    for (name, tier) in [("gold", 0), ("silver", 1), ("bulk", 2)] {
        let mut t = tenant(name, 0, None);
        t.tier = tier;
        h.tenant(t);
    }
    for k in 0..4 {
        h.submit("bulk", &prompt(10, k), 20);
    }
    assert_eq!(h.s.ladder().level(), 2);
    // The fifth engages reject-fast, which refuses it (it would wait).
    let e = h.s.submit("bulk", &prompt(10, 5), 20, h.now).unwrap_err();
    assert_eq!(e.reason(), Some(RejectReason::Shed));
    assert_eq!(h.s.ladder().level(), 3);
    h.step();
    // Reject-fast spares gold only: silver would wait for the slot bulk holds.
    let e = h.s.submit("silver", &prompt(10, 7), 20, h.now).unwrap_err();
    assert_eq!(e.reason(), Some(RejectReason::Shed));
    let g = h.submit("gold", &prompt(10, 8), 20);
    assert_eq!(
        h.s.request(g).unwrap().max_tokens,
        20,
        "tier 0 is never capped"
    );
    h.s.update_config(SchedulerConfig {
        ladder: LadderConfig {
            rungs: h.s.config().ladder.rungs[..1].to_vec(),
            ..h.s.config().ladder.clone()
        },
        ..h.s.config().clone()
    })
    .unwrap();
    let s = h.submit("silver", &prompt(10, 9), 20);
    assert_eq!(
        h.s.request(s).unwrap().max_tokens,
        4,
        "a lower tier is capped"
    );
    assert_eq!(h.s.request(s).unwrap().asked_max_tokens, 20);
    h.run(5000);
    let (fg, fs) = (&h.finished[&g], &h.finished[&s]);
    assert!(!fg.max_tokens_capped() && fg.output.len() == 20);
    assert!(fs.max_tokens_capped());
    assert_eq!(
        (fs.asked_max_tokens, fs.max_tokens, fs.output.len()),
        (20, 4, 4)
    );
}

#[test]
fn max_running_binds_the_lower_tiers_and_leaves_the_top_tier_its_slots() {
    use crate::ladder::{Action, Rung, Signal};
    let mut c = config(801, 8);
    c.max_num_seqs = 4;
    c.max_waiting = 40;
    c.ladder = LadderConfig {
        rungs: vec![Rung {
            signal: Signal::QueueDepth,
            engage: 1.0,
            release: 0.5,
            action: Action::MaxRunning(1),
        }],
        retry_after_s: 0.5,
    };
    let mut h = Harness::new(c);
    for (name, tier) in [("gold", 0), ("bulk", 1)] {
        let mut t = tenant(name, 0, None);
        t.tier = tier;
        h.tenant(t);
    }
    let bulk: Vec<u64> = (0..3)
        .map(|k| h.submit("bulk", &prompt(10, k), 50))
        .collect();
    let gold: Vec<u64> = (0..3)
        .map(|k| h.submit("gold", &prompt(10, 10 + k), 50))
        .collect();
    assert_eq!(h.s.ladder().effects().max_running, Some(1));
    h.step();
    // Gold enters up to max_num_seqs; bulk only below the rung's cap of 1.
    for &g in &gold {
        assert!(h.s.request(g).unwrap().is_running());
    }
    assert!(bulk.iter().all(|&b| !h.s.request(b).unwrap().is_running()));
    h.run(5000);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Random mixes of three tiers' submits, steps and cancels, with and
    /// without priority preemption: tier 0 is never refused `concurrency` or
    /// `pool_full` while the requests of lower tiers it may displace (not
    /// started, or any with preemption) would make room; every displaced
    /// request ends once, `Shed` with a retry_after; the invariants hold.
    #[test]
    fn tier_0_is_never_refused_for_room_lower_tiers_hold(
        ops in prop::collection::vec((0u8..5, 0usize..3, 1usize..40, 1usize..40), 1..80),
        pages in 30usize..120,
        preempt in any::<bool>(),
    ) {
        let mut c = config(pages + 1, 8);
        c.max_num_seqs = 3;
        c.max_waiting = 4;
        c.max_seq_len = 96;
        c.overhead_reserve = 0.0;
        c.prefix_caching = false;
        c.preempt_lower_tiers = preempt;
        let mut h = Harness::new(c);
        for tier in 0..3u32 {
            let mut t = tenant(NAMES[tier as usize], 0, None);
            t.tier = tier;
            h.tenant(t);
        }
        let mut admitted = Vec::new();
        let mut ended: BTreeMap<u64, FinishedRequest> = BTreeMap::new();
        for (k, &(op, t, n, m)) in ops.iter().enumerate() {
            match op {
                0..=2 => {
                    // The room tier-t's displaceable requests hold, before the submit.
                    let (live, mut lower, mut lower_blocks) = (h.s.live_requests(), 0, 0);
                    for (_, r) in h.s.requests.iter() {
                        let tier = h.s.tenants.get(r.tenant).config.tier as usize;
                        if tier > t && (preempt || r.first_scheduled.is_none()) {
                            lower += 1;
                            lower_blocks += r.reserved_blocks;
                        }
                    }
                    let committed = h.s.tenants.committed();
                    match h.s.submit(NAMES[t], &prompt(n, k as i32), m, h.now) {
                        Ok(id) => admitted.push(id),
                        Err(e) => {
                            let r = e.reason().unwrap();
                            if t == 0 && matches!(r, RejectReason::Concurrency | RejectReason::PoolFull) {
                                let blocks = (n + m).div_ceil(8);
                                let fits = live - lower < 7 && committed - lower_blocks + blocks <= pages;
                                prop_assert!(!fits, "tier 0 refused {r:?} with {lower} displaceable ({lower_blocks} blocks)");
                            }
                        }
                    }
                    h.s.check_invariants().unwrap();
                }
                3 => { h.step(); }
                _ => {
                    if let Some(&id) = admitted.get(n % admitted.len().max(1)) {
                        let _ = h.s.cancel_at(id, h.now);
                    }
                }
            }
            for f in h.s.take_finished() {
                prop_assert!(ended.insert(f.id, f).is_none(), "one terminal event each");
            }
        }
        for _ in 0..5000 {
            if h.s.live_requests() == 0 { break; }
            h.step();
        }
        for f in h.s.take_finished() {
            prop_assert!(ended.insert(f.id, f).is_none());
        }
        for (&id, f) in &h.finished {
            prop_assert!(ended.insert(id, f.clone()).is_none(), "one terminal event each");
        }
        for id in &admitted {
            let f = &ended[id];
            if f.reason == FinishReason::Shed {
                prop_assert!(f.retry_after.is_some());
                prop_assert!(f.tenant != NAMES[0], "tier 0 is never displaced");
            }
        }
        prop_assert_eq!(h.s.pool().used(), 0);
    }
}
