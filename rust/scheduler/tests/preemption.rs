//! Preemption: over-commit under memory pressure and priority preemption
//! lose nothing and change no stream; a preempted request keeps its place,
//! also when its tenant changes tier while it waits to resume.

use super::*;

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

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

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
                // Displaced for a higher tier: ended with a reason and a
                // retry_after, never silently; the rest are undisturbed.
                let f = &tight.finished[a];
                if f.reason == FinishReason::Shed {
                    prop_assert!(f.retry_after.is_some());
                    continue;
                }
                prop_assert_eq!(&f.output, &roomy.finished[b].output);
            }
        }
        prop_assert!(roomy.finished.values().all(|f| f.reason != FinishReason::Shed));
        prop_assert_eq!(tight.s.pool().used(), 0);
    }
}

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
fn a_preempted_request_whose_tenant_changed_tier_can_be_cancelled() {
    let (mut h, a) = preempted_then_retiered(20, 2);
    h.s.cancel(a).unwrap(); // found in the queue it sits in, not its new tier's
    h.s.check_invariants().unwrap();
}

#[test]
fn a_preempted_request_whose_tenant_changed_tier_resumes_and_finishes() {
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

/// Two tiers preempted by a third; one moves to the other's tier while both
/// wait to resume: the resume queues stay consistent (each step checks the
/// invariants) and each request leaves the queue it is in.
#[test]
fn a_tier_change_while_two_tiers_wait_to_resume_keeps_the_queues_consistent() {
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

// A regression: a preempted request whose tenant moved up a tier waited in
// its old tier's resume queue, so priority preemption made room for it every
// step and the victim took the room back.
#[test]
fn a_retiered_tenants_preempted_request_waits_in_its_new_tiers_queue() {
    for admission in [
        AdmissionMode::Overcommit {
            watermark_blocks: 1,
        },
        AdmissionMode::Reserve,
    ] {
        let mut h = Harness::new(SchedulerConfig {
            max_num_seqs: 1,
            long_prefill_chunk: 2,
            preempt_lower_tiers: true,
            admission,
            ..config(64, 4)
        });
        let mut lo = TenantConfig::new("lo");
        lo.tier = 2;
        h.tenant(lo.clone());
        let mut mid = TenantConfig::new("mid");
        mid.tier = 1;
        h.tenant(mid);
        let r = h.submit("lo", &prompt(6, 1), 4);
        h.step();
        let m = h.submit("mid", &prompt(6, 2), 4);
        h.step(); // r is preempted into resume queue 2; m runs
        lo.tier = 0;
        h.s.update_tenant(lo, h.now).unwrap();
        h.run(60);
        assert_eq!(
            h.finished[&m].preemptions, 1,
            "{admission:?}: preempted once for r"
        );
        assert!(
            h.finished[&r].finished < h.finished[&m].finished,
            "{admission:?}"
        );
    }
}
