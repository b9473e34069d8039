//! Terminal events (every request ends with exactly one FinishedRequest: by a
//! commit, cancel, stop or the drain deadline) and `retry_after` on refusals.

use super::*;

fn two_tenants() -> Harness {
    let mut h = Harness::new(config(200, 8));
    h.tenant(TenantConfig::new("a"));
    h.tenant(TenantConfig::new("b"));
    h
}

fn rejection(r: KvResult<u64>) -> Rejection {
    match r {
        Err(KvError::Rejected(r)) => r,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------
// Terminal events

#[test]
fn a_request_the_host_cannot_serve_ends_as_error_with_its_reason() {
    let mut h = two_tenants();
    let bad = h.submit("a", &prompt(8, 1), 50);
    let mate = h.submit("b", &prompt(8, 2), 3);
    h.step();
    let used = h.s.pool().used();
    assert!(h.s.fail(bad, "logits were NaN".into(), h.now).unwrap());
    assert!(h.s.pool().used() < used, "its pages went back at once");
    let ended = h.s.take_finished();
    assert_eq!(ended.len(), 1);
    assert_eq!((ended[0].id, ended[0].reason), (bad, FinishReason::Error));
    assert_eq!(ended[0].error.as_deref(), Some("logits were NaN"));
    assert_eq!(ended[0].retry_after, None);
    assert!(matches!(
        h.s.fail(bad, "again".into(), h.now),
        Err(KvError::UnknownRequest(_))
    ));
    assert!(matches!(
        h.s.cancel_at(bad, h.now),
        Err(KvError::UnknownRequest(_))
    ));
    while h.s.live_requests() > 0 {
        h.step();
    }
    assert_eq!(h.finished[&mate].reason, FinishReason::Length);
    assert_eq!(h.finished[&mate].error, None);
    let a =
        h.s.stats(h.now)
            .tenants
            .into_iter()
            .find(|t| t.name == "a")
            .unwrap();
    assert_eq!((a.finished, a.cancelled), (0, 1), "counted as not finished");
    assert_eq!(FinishReason::ALL.len(), 6);
    assert_eq!(FinishReason::ALL.last().unwrap().as_str(), "error");
}

#[test]
fn a_drain_deadline_ends_each_unfinished_request_with_its_tokens_so_far() {
    let mut h = two_tenants();
    let a = h.submit("a", &prompt(8, 1), 50);
    let b = h.submit("b", &prompt(12, 2), 50);
    let done = h.submit("a", &prompt(8, 3), 2);
    for _ in 0..5 {
        h.step();
    }
    assert_eq!(h.finished[&done].reason, FinishReason::Length);
    let so_far = |h: &Harness, id| h.s.request(id).unwrap().output().to_vec();
    let (out_a, out_b) = (so_far(&h, a), so_far(&h, b));
    assert_eq!(out_a.len(), 5);
    h.s.drain(h.now).unwrap();
    let at = h.now;
    assert!(
        h.step().is_none(),
        "the deadline step hands everything back"
    );
    assert_eq!(h.s.lifecycle(), Lifecycle::Drained);
    let ended = h.s.take_finished();
    assert_eq!(
        ended
            .iter()
            .map(|f| (f.id, f.reason, f.output.clone(), f.finished))
            .collect::<Vec<_>>(),
        vec![
            (a, FinishReason::DrainDeadline, out_a.clone(), at),
            (b, FinishReason::DrainDeadline, out_b.clone(), at),
        ]
    );
    assert_eq!(
        (ended[0].tenant.as_str(), ended[1].tenant.as_str()),
        ("a", "b")
    );
    assert!(h.s.take_finished().is_empty(), "delivered once");
    // The checkpoint still holds them, as before.
    let (finished, back) = h.s.checkpoint();
    assert!(finished.is_empty());
    assert_eq!(
        back.iter()
            .map(|r| (r.id, r.reason, r.generated.clone()))
            .collect::<Vec<_>>(),
        vec![(a, "drain_deadline", out_a), (b, "drain_deadline", out_b)]
    );
    let st = h.s.stats(h.now);
    let counts = |t: usize| (st.tenants[t].finished, st.tenants[t].cancelled);
    assert_eq!((counts(0), counts(1)), ((1, 1), (0, 1)));
}

#[test]
fn a_cancel_ends_with_a_cancelled_event_delivered_by_the_next_commit() {
    let mut h = two_tenants();
    let a = h.submit("a", &prompt(8, 1), 50);
    let b = h.submit("b", &prompt(8, 2), 50);
    for _ in 0..3 {
        h.step();
    }
    let out = h.s.request(a).unwrap().output().to_vec();
    assert_eq!(out.len(), 3);
    assert_eq!(h.s.cancel_at(a, 7.5), Ok(true));
    assert!(h.s.request(a).is_err());
    assert_eq!(h.s.pending_finished(), 1);
    let ev = h.step().unwrap();
    assert_eq!(ev.request_ids, vec![b]);
    assert_eq!(ev.finished.len(), 1);
    let f = &ev.finished[0];
    assert_eq!(
        (f.id, f.reason, &f.output, f.finished, f.prompt_len),
        (a, FinishReason::Cancelled, &out, 7.5, 8)
    );
    assert_eq!(f.first_token, 0.0);
    assert!(h.s.take_finished().is_empty(), "the commit delivered it");
    assert!(h.step().unwrap().finished.is_empty(), "only once");
    let st = h.s.stats(h.now);
    assert_eq!((st.tenants[0].finished, st.tenants[0].cancelled), (0, 1));
    assert_eq!(st.tenants[0].metrics.e2e.count(), 0);
}

#[test]
fn a_cancel_before_scheduling_has_an_empty_output_and_its_own_times() {
    let mut h = two_tenants();
    h.now = 2.0;
    let a = h.submit("a", &prompt(8, 1), 5);
    assert!(h.s.cancel_at(a, 3.0).unwrap());
    let f = h.s.take_finished().pop().unwrap();
    assert!(f.output.is_empty());
    assert_eq!(
        (f.arrival, f.first_scheduled, f.first_token, f.finished),
        (2.0, 3.0, 3.0, 3.0)
    );
}

#[test]
fn the_strict_cancel_also_queues_an_event_at_the_latest_time_seen() {
    let mut h = two_tenants();
    let a = h.submit("a", &prompt(8, 1), 50);
    h.step();
    h.step(); // at 0.01; the clock is now 0.01
    let req = h.s.cancel(a).unwrap();
    assert_eq!(req.id, a);
    let f = h.s.take_finished().pop().unwrap();
    assert_eq!(
        (f.reason, f.output.len(), f.finished),
        (FinishReason::Cancelled, 2, 0.01)
    );
    assert!(matches!(h.s.cancel(a), Err(KvError::UnknownRequest(_))));
}

#[test]
fn stop_ends_a_request_as_finished_not_cancelled() {
    let mut h = two_tenants();
    let a = h.submit("a", &prompt(8, 1), 50);
    let b = h.submit("a", &prompt(8, 2), 50);
    for _ in 0..4 {
        h.step();
    }
    let out = h.s.request(a).unwrap().output().to_vec();
    assert_eq!(h.s.stop(a, 1.25), Ok(true));
    let f = h.s.take_finished().pop().unwrap();
    assert_eq!(
        (f.id, f.reason, &f.output, f.finished),
        (a, FinishReason::Stop, &out, 1.25)
    );
    let ev = h.step().unwrap();
    assert!(ev.finished.is_empty(), "take_finished delivered it");
    assert_eq!(ev.request_ids, vec![b]);
    let st = h.s.stats(h.now);
    let t = &st.tenants[0];
    assert_eq!((t.finished, t.cancelled), (1, 0));
    assert_eq!(t.metrics.e2e.count(), 1);
    assert_eq!(t.metrics.e2e.sum(), 1.25);
    assert_eq!(h.s.pool().used(), h.s.request(b).unwrap().pages.len());
    h.s.check_invariants().unwrap();
}

#[test]
fn a_stop_while_draining_is_checkpointed_as_finished_and_can_end_the_drain() {
    let mut h = two_tenants();
    let a = h.submit("a", &prompt(8, 1), 50);
    h.step();
    h.s.drain(h.now + 100.0).unwrap();
    assert!(h.s.stop(a, h.now).unwrap());
    assert_eq!(h.s.lifecycle(), Lifecycle::Drained);
    let (finished, back) = h.s.checkpoint();
    assert!(back.is_empty());
    assert_eq!(
        finished
            .iter()
            .map(|f| (f.id, f.reason))
            .collect::<Vec<_>>(),
        vec![(a, FinishReason::Stop)]
    );
    assert_eq!(h.s.take_finished().len(), 1);
}

#[test]
fn each_out_of_band_event_is_delivered_once_by_whichever_comes_first() {
    let mut h = two_tenants();
    let ids: Vec<u64> = (0..4).map(|k| h.submit("a", &prompt(8, k), 40)).collect();
    let keep = h.submit("b", &prompt(8, 9), 40);
    h.step();
    // Two ended between steps: the commit delivers them, in the order they ended.
    h.s.stop(ids[1], h.now).unwrap();
    h.s.cancel_at(ids[0], h.now).unwrap();
    let ev = h.step().unwrap();
    assert_eq!(
        ev.finished
            .iter()
            .map(|f| (f.id, f.reason))
            .collect::<Vec<_>>(),
        vec![
            (ids[1], FinishReason::Stop),
            (ids[0], FinishReason::Cancelled)
        ]
    );
    // Ended between step and commit: the commit skips it and delivers its event.
    let parity = h.s.next_parity();
    let out =
        h.s.step(h.now, &mut h.bufs[parity].as_mut())
            .unwrap()
            .unwrap();
    h.s.cancel_at(ids[2], h.now).unwrap();
    let sampled = vec![1; out.num_seqs];
    let ev = h.s.commit(out.step_id, &sampled, h.now).unwrap();
    assert!(!ev.request_ids.contains(&ids[2]));
    assert_eq!(
        ev.finished.iter().map(|f| f.id).collect::<Vec<_>>(),
        vec![ids[2]]
    );
    // Taken first: the next commit does not repeat it.
    h.s.cancel_at(ids[3], h.now).unwrap();
    assert_eq!(
        h.s.take_finished().iter().map(|f| f.id).collect::<Vec<_>>(),
        vec![ids[3]]
    );
    assert!(h.s.take_finished().is_empty());
    let parity = h.s.next_parity();
    let out =
        h.s.step(h.now, &mut h.bufs[parity].as_mut())
            .unwrap()
            .unwrap();
    assert_eq!(out.request_ids, vec![keep]);
    let ev = h.s.commit(out.step_id, &[1], h.now).unwrap();
    assert!(ev.finished.is_empty());
    // A refused commit delivers nothing and keeps the events for the next.
    h.s.cancel_at(keep, h.now).unwrap();
    assert!(h.s.commit(out.step_id, &[1], h.now).is_err());
    assert_eq!(h.s.pending_finished(), 1);
    assert_eq!(h.s.take_finished()[0].id, keep);
}

#[test]
fn cancel_or_stop_of_a_request_that_ended_on_its_own_is_false_not_an_error() {
    let mut h = two_tenants();
    let done = h.submit("a", &prompt(8, 1), 2);
    let handed = h.submit("a", &prompt(8, 2), 50);
    while !h.finished.contains_key(&done) {
        h.step();
    }
    let before = h.s.stats(h.now);
    assert_eq!(h.s.cancel_at(done, h.now), Ok(false));
    assert_eq!(h.s.stop(done, h.now), Ok(false));
    assert_eq!(h.s.stats(h.now), before, "nothing changes");
    assert_eq!(h.s.pending_finished(), 0, "no second event");
    // The strict form still says it is not live.
    assert!(matches!(h.s.cancel(done), Err(KvError::UnknownRequest(_))));
    // Handed back at the drain deadline: ended on its own too.
    h.s.drain(h.now).unwrap();
    assert!(h.step().is_none());
    assert_eq!(h.s.take_finished().len(), 1);
    assert_eq!(h.s.cancel_at(handed, h.now), Ok(false));
    assert_eq!(h.s.pending_finished(), 0);
}

#[test]
fn ids_never_issued_or_already_ended_by_the_caller_are_unknown() {
    let mut h = two_tenants();
    let a = h.submit("a", &prompt(8, 1), 20);
    let b = h.submit("a", &prompt(8, 2), 20);
    let c = h.submit("a", &prompt(8, 3), 20);
    for id in [0, c + 1, u64::MAX] {
        assert_eq!(h.s.cancel_at(id, 0.0), Err(KvError::UnknownRequest(id)));
        assert_eq!(h.s.stop(id, 0.0), Err(KvError::UnknownRequest(id)));
    }
    assert_eq!(h.s.cancel_at(a, 0.0), Ok(true));
    assert_eq!(h.s.cancel_at(a, 0.0), Err(KvError::UnknownRequest(a)));
    assert_eq!(h.s.stop(a, 0.0), Err(KvError::UnknownRequest(a)));
    assert_eq!(h.s.stop(b, 0.0), Ok(true));
    assert_eq!(h.s.stop(b, 0.0), Err(KvError::UnknownRequest(b)));
    assert_eq!(h.s.cancel_at(b, 0.0), Err(KvError::UnknownRequest(b)));
    assert_eq!(h.s.take_finished().len(), 2, "one event each");
    h.s.check_invariants().unwrap();
}

#[test]
fn every_request_ends_exactly_once_in_a_random_mix() {
    // Deterministic pseudo-random mixes of submit, step, cancel, stop, drain.
    for seed in 0..40u64 {
        let mut rng = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
        let mut next = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let mut h = two_tenants();
        let mut admitted = Vec::new();
        let mut told: BTreeMap<u64, FinishReason> = BTreeMap::new();
        let mut how: BTreeMap<u64, FinishReason> = BTreeMap::new();
        // Record delivered events; a commit's own finishes are how those ended.
        let deliver = |evs: Vec<FinishedRequest>,
                       told: &mut BTreeMap<u64, FinishReason>,
                       how: &mut BTreeMap<u64, FinishReason>| {
            for f in evs {
                if f.reason.is_finished() {
                    how.entry(f.id).or_insert(f.reason);
                }
                assert!(told.insert(f.id, f.reason).is_none(), "{} twice", f.id);
            }
        };
        for _ in 0..120 {
            match next(6) {
                0 | 1 => {
                    let k = admitted.len() as i32;
                    let t = if next(2) == 0 { "a" } else { "b" };
                    let m = 1 + next(30) as usize;
                    if let Ok(id) = h.s.submit(t, &prompt(4 + next(20) as usize, k), m, h.now) {
                        admitted.push(id);
                    }
                }
                2 | 3 => match h.step() {
                    Some(ev) => deliver(ev.finished, &mut told, &mut how),
                    None => {
                        h.now += 0.01;
                        deliver(h.s.take_finished(), &mut told, &mut how);
                    }
                },
                4 if !admitted.is_empty() => {
                    let id = admitted[next(admitted.len() as u64) as usize];
                    let stop = next(2) == 0;
                    let r = if stop {
                        h.s.stop(id, h.now)
                    } else {
                        h.s.cancel_at(id, h.now)
                    };
                    match r {
                        Ok(true) => {
                            let reason = if stop {
                                FinishReason::Stop
                            } else {
                                FinishReason::Cancelled
                            };
                            assert!(how.insert(id, reason).is_none());
                        }
                        Ok(false) => assert!(
                            how.contains_key(&id) || h.s.checkpoint().1.iter().any(|r| r.id == id),
                            "ended on its own: finished or handed back"
                        ),
                        Err(e) => {
                            assert_eq!(e, KvError::UnknownRequest(id));
                            assert!(matches!(
                                how.get(&id),
                                Some(FinishReason::Stop | FinishReason::Cancelled)
                            ));
                        }
                    }
                }
                5 if next(8) == 0 => {
                    h.s.drain(h.now + next(10) as f64 * 0.01).unwrap();
                }
                _ => {}
            }
            h.s.check_invariants().unwrap();
        }
        h.s.drain(h.now + 0.05).unwrap();
        while h.s.lifecycle() != Lifecycle::Drained {
            match h.step() {
                Some(ev) => deliver(ev.finished, &mut told, &mut how),
                None => h.now += 0.01,
            }
        }
        deliver(h.s.take_finished(), &mut told, &mut how);
        let (_, back) = h.s.checkpoint();
        for r in &back {
            assert!(how.insert(r.id, FinishReason::DrainDeadline).is_none());
        }
        assert_eq!(told.len(), admitted.len(), "seed {seed}");
        for id in &admitted {
            assert_eq!(told.get(id), how.get(id), "seed {seed} request {id}");
        }
    }
}

// ---------------------------------------------------------------------------
// retry_after

/// Steps `h` until its step period is measured: 0.01 s a step.
fn warm(h: &mut Harness, steps: usize) {
    for _ in 0..steps {
        h.step();
    }
}

fn close(a: Option<f64>, b: f64) -> bool {
    a.is_some_and(|a| (a - b).abs() < 1e-9)
}

#[test]
fn not_ready_and_draining_refusals_carry_the_hint_which_is_live() {
    let c = SchedulerConfig {
        require_warmup: true,
        ..config(64, 8)
    };
    let mut h = Harness::new(c);
    h.tenant(TenantConfig::new("a"));
    let r = rejection(h.s.submit("a", &prompt(8, 1), 4, 0.0));
    assert_eq!(
        (r.reason, r.retry_after),
        (RejectReason::NotReady, Some(1.0))
    );
    let mut c = h.s.config().clone();
    c.retry_after_hint_s = 2.5;
    h.s.update_config(c).unwrap();
    h.s.mark_ready().unwrap();
    h.s.drain(10.0).unwrap();
    let r = rejection(h.s.submit("a", &prompt(8, 1), 4, 0.0));
    assert_eq!(
        (r.reason, r.retry_after),
        (RejectReason::Draining, Some(2.5))
    );
    let mut c = h.s.config().clone();
    c.retry_after_hint_s = -1.0;
    assert!(matches!(
        h.s.update_config(c),
        Err(KvError::InvalidConfig(_))
    ));
    let mut c = h.s.config().clone();
    c.retry_after_hint_s = f64::NAN;
    assert!(matches!(
        h.s.update_config(c),
        Err(KvError::InvalidConfig(_))
    ));
}

#[test]
fn requests_that_can_never_pass_get_no_retry_after() {
    let mut h = Harness::new(config(101, 16));
    h.tenant(tenant("capped", 0, Some(4)));
    for (t, n, m, why) in [
        ("nobody", 8, 4, RejectReason::UnknownTenant),
        ("capped", 0, 4, RejectReason::Invalid),
        ("capped", 8, 0, RejectReason::Invalid),
        ("capped", 200, 100, RejectReason::TooLong),
        // 5 blocks: more than its cap of 4, ever.
        ("capped", 64, 16, RejectReason::TenantBudget),
    ] {
        let r = rejection(h.s.submit(t, &prompt(n, 1), m, 0.0));
        assert_eq!((r.reason, r.retry_after), (why, None), "{t} {n} {m}");
    }
}

#[test]
fn tenant_concurrency_waits_for_the_tenants_own_running_requests() {
    let mut h = Harness::new(config(200, 8));
    let mut c = TenantConfig::new("a");
    c.max_concurrent = Some(2);
    h.tenant(c);
    h.tenant(TenantConfig::new("b"));
    h.submit("a", &prompt(8, 1), 20);
    h.submit("a", &prompt(8, 2), 30);
    h.submit("b", &prompt(8, 3), 5); // b's requests do not free a's slots
                                     // Nothing measured yet: the hint.
    h.step();
    let r = rejection(h.s.submit("a", &prompt(8, 4), 4, h.now));
    assert_eq!(
        (r.reason, r.retry_after),
        (RejectReason::Concurrency, Some(1.0))
    );
    warm(&mut h, 4); // 5 steps: 5 tokens each
                     // The first of a's requests ends in 20 - 5 steps of 0.01 s.
    let r = rejection(h.s.submit("a", &prompt(8, 4), 4, h.now));
    assert_eq!(r.reason, RejectReason::Concurrency);
    assert!(close(r.retry_after, 0.15), "{:?}", r.retry_after);
    warm(&mut h, 5);
    let r = rejection(h.s.submit("a", &prompt(8, 4), 4, h.now));
    assert!(close(r.retry_after, 0.10), "{:?}", r.retry_after);
}

#[test]
fn scheduler_concurrency_waits_for_the_nth_request_to_end() {
    let mut c = config(400, 8);
    c.max_num_seqs = 3;
    c.max_batched_tokens = 64;
    c.max_waiting = 0;
    let mut h = Harness::new(c);
    h.tenant(TenantConfig::new("a"));
    for (k, m) in [(0, 40), (1, 10), (2, 25)] {
        h.submit("a", &prompt(8, k), m);
    }
    warm(&mut h, 3);
    let r = rejection(h.s.submit("a", &prompt(8, 9), 4, h.now));
    assert_eq!(r.reason, RejectReason::Concurrency);
    // One must end: the 10-token one, 7 steps from now.
    assert!(close(r.retry_after, 0.07), "{:?}", r.retry_after);
}

#[test]
fn tenant_budget_waits_until_enough_of_its_reservations_end() {
    let mut h = Harness::new(config(200, 8));
    h.tenant(tenant("a", 0, Some(12)));
    h.submit("a", &prompt(16, 1), 16); // 4 blocks, 16 tokens to go
    h.submit("a", &prompt(16, 2), 32); // 6 blocks, 32 tokens to go
    warm(&mut h, 4);
    // 10 of 12 held; 5 blocks more need 3 freed: the 4-block one is enough.
    let r = rejection(h.s.submit("a", &prompt(32, 3), 8, h.now));
    assert_eq!(r.reason, RejectReason::TenantBudget);
    assert!(close(r.retry_after, 0.12), "{:?}", r.retry_after);
    // 9 blocks need 7 freed: both.
    let r = rejection(h.s.submit("a", &prompt(64, 3), 8, h.now));
    assert_eq!(r.reason, RejectReason::TenantBudget);
    assert!(close(r.retry_after, 0.28), "{:?}", r.retry_after);
}

#[test]
fn pool_full_estimate_follows_the_running_requests_and_shrinks_as_they_progress() {
    // 60 usable blocks of 8 tokens, 0 reserve.
    let mut c = config(61, 8);
    c.overhead_reserve = 0.0;
    c.max_batched_tokens = 128; // every prompt in the first step
    c.max_seq_len = 400;
    let mut h = Harness::new(c);
    h.tenant(tenant("a", 0, None));
    h.tenant(tenant("b", 20, None)); // b's unused floor is not lent
    h.submit("a", &prompt(40, 1), 40); // 10 blocks, ends after 40 steps
    h.submit("a", &prompt(40, 2), 120); // 20 blocks, ends after 120 steps
    h.submit("a", &prompt(8, 3), 16); // 3 blocks, ends after 16 steps
    let r = rejection(h.s.submit("a", &prompt(40, 4), 40, h.now));
    assert_eq!(r.reason, RejectReason::PoolFull);
    assert_eq!(r.retry_after, None, "nothing runs yet: no estimate");
    h.step();
    let r = rejection(h.s.submit("a", &prompt(40, 4), 40, h.now));
    assert_eq!(
        r.retry_after,
        Some(1.0),
        "running, no step period yet: the hint"
    );
    warm(&mut h, 5);
    // 53 committed, 7 free: 10 blocks need 3 freed -> the 3-block request
    // (16 - 6 = 10 steps) is enough.
    let r = rejection(h.s.submit("a", &prompt(40, 4), 40, h.now));
    assert!(close(r.retry_after, 0.10), "{:?}", r.retry_after);
    // 15 blocks need 8: the 3-block one and the 10-block one (40 - 6 = 34 steps).
    let r = rejection(h.s.submit("a", &prompt(80, 4), 40, h.now));
    assert!(close(r.retry_after, 0.34), "{:?}", r.retry_after);
    let mut last = r.retry_after.unwrap();
    for _ in 0..5 {
        h.step();
        let r = rejection(h.s.submit("a", &prompt(80, 4), 40, h.now));
        let now = r.retry_after.unwrap();
        assert!(now < last, "{now} < {last}");
        last = now;
    }
    // 29 blocks for b, 9 over its floor of 20, 7 free: a's 3-block one ends first.
    let r = rejection(h.s.submit("b", &prompt(100, 5), 130, h.now));
    assert_eq!(r.reason, RejectReason::PoolFull);
    assert!(close(r.retry_after, 0.05), "{:?}", r.retry_after);
    // More than the pool less b's floor: never, even if everything ended.
    let r = rejection(h.s.submit("a", &prompt(200, 5), 130, h.now));
    assert_eq!((r.reason, r.retry_after), (RejectReason::PoolFull, None));
}

#[test]
fn the_step_period_ignores_idle_gaps() {
    let mut h = two_tenants();
    h.submit("a", &prompt(8, 1), 3);
    h.run(10);
    assert!(close(h.s.step_period(), 0.01));
    h.now += 50.0; // idle
    assert!(h.step().is_none());
    h.submit("a", &prompt(8, 2), 3);
    h.run(10);
    assert!(close(h.s.step_period(), 0.01));
}
