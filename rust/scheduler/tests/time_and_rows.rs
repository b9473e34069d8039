//! The times a scheduler takes (a clock in seconds, or refused), and plan
//! rows checked against the requests' own page lists.

use super::*;

fn rate_limited(rate: f64, burst: f64) -> Scheduler {
    let mut s = sched(256, 16);
    let mut t = TenantConfig::new("a");
    t.rate_tokens_per_s = Some(rate);
    t.burst_tokens = Some(burst);
    s.add_tenant(t).unwrap();
    s
}

/// A time that is not a clock in seconds is refused, naming `now`, and
/// changes nothing, at every call that takes one.
#[test]
fn times_that_are_not_clocks_are_refused_and_change_nothing() {
    let mut s = rate_limited(10.0, 100.0);
    let id = s.submit("a", &prompt(4, 1), 4, 1.0).unwrap();
    let before = s.stats(1.0);
    let mut bufs = OwnedPlanBuffers::new(s.plan_shape());
    for bad in [
        1e308,
        1e13,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        -1.0,
        -1e-9,
    ] {
        let is_bad_now = |e: KvError| matches!(&e, KvError::InvalidRequest(m) if m.contains("now"));
        assert!(
            is_bad_now(s.submit("a", &prompt(4, 2), 4, bad).unwrap_err()),
            "{bad}"
        );
        assert!(
            is_bad_now(s.step(bad, &mut bufs.as_mut()).unwrap_err()),
            "{bad}"
        );
        assert!(is_bad_now(s.cancel_at(id, bad).unwrap_err()), "{bad}");
        assert!(is_bad_now(s.stop(id, bad).unwrap_err()), "{bad}");
        assert!(is_bad_now(
            s.update_tenant(TenantConfig::new("a"), bad).unwrap_err()
        ));
        assert!(check_time(bad, "now").is_err());
        assert_eq!(s.stats(1.0), before, "{bad}");
    }
    assert!(check_time(0.0, "now").is_ok() && check_time(MAX_TIME_S, "now").is_ok());
    s.check_invariants().unwrap();
}

/// A rate bucket recovers from any time it accepted. Far ahead and back (a
/// clock switched, a unit slip within bounds) re-bases it; time going back a
/// little is jitter and refills nothing, as before.
#[test]
fn a_rate_bucket_recovers_from_a_jump_ahead_and_back() {
    let mut s = rate_limited(10.0, 100.0);
    // 92 tokens of 100 taken at a time far ahead.
    s.submit("a", &prompt(2, 1), 90, 1e11).unwrap();
    // Back to the real clock: refused for now, with a finite wait ...
    let wait = match s.submit("a", &prompt(2, 2), 90, 100.0).unwrap_err() {
        KvError::Rejected(r) => {
            assert_eq!(r.reason, RejectReason::RateLimited);
            r.retry_after.unwrap()
        }
        e => panic!("{e}"),
    };
    assert!(wait > 0.0 && wait < 10.0, "{wait}");
    // ... and admitted once it has passed (not refused for ever).
    s.submit("a", &prompt(2, 2), 90, 100.0 + wait + 1e-6)
        .unwrap();

    // Jitter: a time a little behind refills nothing (nor does it re-base).
    let mut s = rate_limited(10.0, 100.0);
    s.submit("a", &prompt(2, 1), 98, 1000.0).unwrap();
    assert!(s
        .submit("a", &prompt(2, 1), 8, 1000.0 - CLOCK_JITTER_S + 1.0)
        .is_err());
    assert!(s.submit("a", &prompt(2, 1), 8, 1000.0).is_err());
    s.submit("a", &prompt(2, 1), 8, 1001.0).unwrap();
}

/// A page-table row written behind the scheduler's back (another
/// request's page) is found against the requests' own page lists, even
/// where the row cache says the row is unchanged, and repaired for the next
/// step.
#[test]
fn a_row_written_behind_the_schedulers_back_is_found_and_rewritten() {
    let mut h = Harness::new(SchedulerConfig {
        full_validation: true,
        ..config(64, 4)
    });
    h.tenant(TenantConfig::new("a"));
    h.tenant(TenantConfig::new("b"));
    let ida = h.submit("a", &prompt(12, 1), 40);
    let idb = h.submit("b", &prompt(12, 2), 40);
    // Both prefilled (step 0, parity 0) and decoding (step 1, parity 1).
    h.step().unwrap();
    h.step().unwrap();
    let pps = h.s.plan_shape().pages_per_seq;
    let a_pages = h.s.request(ida).unwrap().pages.clone();
    let b_pages = h.s.request(idb).unwrap().pages.clone();
    let out = h.outcomes.last().unwrap().clone();
    let row_a = out.request_ids.iter().position(|&id| id == ida).unwrap();
    // Parity 0's row of `a` gets `b`'s first page where `a`'s first is.
    let other = 1 - out.parity;
    assert_eq!(h.bufs[other].page_indices[row_a * pps], a_pages[0] as i32);
    h.bufs[other].page_indices[row_a * pps] = b_pages[0] as i32;
    let err = h.plan().unwrap_err();
    assert!(
        matches!(&err, KvError::Internal(m) if m.contains("does not hold the request's pages")),
        "{err}"
    );
    // Repaired: the next plan rewrites every row from the page lists, and runs.
    h.step().unwrap();
    h.run(200);
    assert_eq!(h.s.live_requests(), 0);
    assert!(h.finished.contains_key(&ida) && h.finished.contains_key(&idb));
}

/// The tenants' virtual times, by name.
fn vtimes(s: &Scheduler, now: f64) -> Vec<(String, f64)> {
    s.stats(now)
        .tenants
        .into_iter()
        .map(|t| (t.name, t.vtime))
        .collect()
}

/// A step refused by full_validation serves nobody: the tenants' virtual
/// times stay as if it never ran, then and after the next step: the refused
/// step's per-tenant token counts do not stay in the scratch counts to be
/// charged with the next step's (each tenant served twice for it).
#[test]
fn a_refused_plan_charges_no_tenant() {
    let setup = || {
        let mut h = Harness::new(SchedulerConfig {
            full_validation: true,
            ..config(64, 4)
        });
        h.tenant(TenantConfig::new("a"));
        let mut b = TenantConfig::new("b");
        b.weight = 3.0;
        h.tenant(b);
        let ida = h.submit("a", &prompt(12, 1), 40);
        let idb = h.submit("b", &prompt(12, 2), 40);
        h.step().unwrap();
        h.step().unwrap();
        (h, ida, idb)
    };
    let (mut h, ida, idb) = setup();
    // The same scheduler where the refused step never happens.
    let (mut never, _, _) = setup();
    assert_eq!(vtimes(&h.s, h.now), vtimes(&never.s, never.now));

    let pps = h.s.plan_shape().pages_per_seq;
    let b_pages = h.s.request(idb).unwrap().pages.clone();
    let out = h.outcomes.last().unwrap().clone();
    let row_a = out.request_ids.iter().position(|&id| id == ida).unwrap();
    h.bufs[1 - out.parity].page_indices[row_a * pps] = b_pages[0] as i32;
    assert!(matches!(h.plan(), Err(KvError::Internal(_))));
    assert_eq!(vtimes(&h.s, h.now), vtimes(&never.s, never.now));

    // The next steps charge what they serve, once.
    for _ in 0..3 {
        h.step().unwrap();
        never.step().unwrap();
        assert_eq!(vtimes(&h.s, h.now), vtimes(&never.s, never.now));
    }
}

/// A step refused by full_validation after it preempted a request: the
/// preemption is reported with the next plan, not lost (the engine drops a
/// preempted request's state when told).
#[test]
fn a_refused_plans_preemptions_go_out_with_the_next_plan() {
    let setup = || {
        let mut h = Harness::new(SchedulerConfig {
            num_blocks: 11,
            block_size: 8,
            max_num_seqs: 4,
            max_batched_tokens: 32,
            max_seq_len: 100,
            overhead_reserve: 0.0,
            long_prefill_chunk: 16,
            admission: AdmissionMode::Overcommit {
                watermark_blocks: 0,
            },
            full_validation: true,
            ..SchedulerConfig::default()
        });
        h.tenant(TenantConfig::new("a"));
        // Each fits the 10-page pool alone (80 tokens), not both together:
        // decoding, one is preempted when the pool runs out.
        h.submit("a", &prompt(8, 1), 72);
        h.submit("a", &prompt(8, 2), 72);
        h
    };
    let mut first = setup();
    let mut k = 0;
    let preempted = loop {
        first.step().expect("something runs");
        k += 1;
        let out = first.outcomes.last().unwrap();
        if !out.preempted.is_empty() {
            break out.preempted.clone();
        }
        assert!(k < 200, "no preemption");
    };

    // The same run, with the plan of step k refused: a padding row of its
    // buffer set is written behind the scheduler's back.
    let mut h = setup();
    for _ in 0..k - 1 {
        h.step().unwrap();
    }
    let parity = h.s.next_parity();
    let last = h.bufs[parity].page_indices.len() - 1;
    h.bufs[parity].page_indices[last] = 1;
    let err = h.plan().unwrap_err();
    assert!(
        matches!(&err, KvError::Internal(m) if m.contains("padding row")),
        "{err}"
    );
    let out = h.plan().unwrap().expect("the step is planned again");
    assert_eq!(out.preempted, preempted);
}

/// A request's first token counts its time to first token from its arrival;
/// each later one, the gap since the one before (the request keeps when its
/// last token came as a time with a "none yet" sign, see `Request`).
#[test]
fn the_first_token_counts_from_arrival_and_each_later_one_from_the_last() {
    let mut s = sched(256, 16);
    s.add_tenant(TenantConfig::new("a")).unwrap();
    let shape = *s.plan_shape();
    let mut bufs = [OwnedPlanBuffers::new(&shape), OwnedPlanBuffers::new(&shape)];
    let id = s.submit("a", &prompt(5, 1), 3, 1.0).unwrap();
    let mut finished = Vec::new();
    for now in [2.0, 2.5, 4.0] {
        let parity = s.next_parity();
        let out = s.step(now, &mut bufs[parity].as_mut()).unwrap().unwrap();
        let ev = s.commit(out.step_id, &[7], now).unwrap();
        assert_eq!(ev.request_ids, vec![id]);
        finished.extend(ev.finished);
    }
    let m = &s.stats(4.0).tenants[0].metrics;
    assert_eq!((m.ttft.count(), m.ttft.sum()), (1, 1.0));
    assert_eq!((m.inter_token.count(), m.inter_token.sum()), (2, 2.0));
    assert_eq!(m.tokens_out, 3);
    assert_eq!(finished.len(), 1);
    assert_eq!((finished[0].first_token, finished[0].finished), (2.0, 4.0));
}
