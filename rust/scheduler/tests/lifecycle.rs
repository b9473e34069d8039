//! Lifecycle and live operations: warm-up and drain refuse new requests,
//! live knobs take effect next step (restart-only ones say which), a drain
//! deadline hands back what is unfinished and a restore finishes it alike.

use super::overload::ladder;
use super::*;
use crate::ladder::{Action, Rung, Signal};

#[test]
fn live_knobs_take_effect_next_step_and_restart_only_ones_say_which() {
    let c = SchedulerConfig {
        num_blocks: 101,
        block_size: 8,
        max_num_seqs: 6,
        max_batched_tokens: 64,
        max_seq_len: 128,
        overhead_reserve: 0.0,
        max_waiting: 8,
        ..SchedulerConfig::default()
    };
    let mut h = Harness::new(c.clone());
    h.tenant(TenantConfig::new("a"));
    for k in 0..6 {
        h.submit("a", &prompt(8, k), 30);
    }
    h.step();
    assert_eq!(h.s.stats(h.now).running, 6);

    let restart = |f: &dyn Fn(&mut SchedulerConfig)| {
        let mut n = c.clone();
        f(&mut n);
        n
    };
    let cases: Vec<(&str, SchedulerConfig)> = vec![
        ("num_blocks", restart(&|n| n.num_blocks = 200)),
        ("block_size", restart(&|n| n.block_size = 16)),
        (
            "token_buckets",
            restart(&|n| n.token_buckets = Some(vec![64])),
        ),
        (
            "admission",
            restart(&|n| {
                n.admission = AdmissionMode::Overcommit {
                    watermark_blocks: 1,
                }
            }),
        ),
        ("prefix_caching", restart(&|n| n.prefix_caching = false)),
        (
            "prefix_cache_key",
            restart(&|n| n.prefix_cache_key = Some(SecretKey([3; 16]))),
        ),
        ("max_num_seqs", restart(&|n| n.max_num_seqs = 7)),
        ("max_seq_len", restart(&|n| n.max_seq_len = 136)),
        (
            "max_batched_tokens",
            restart(&|n| {
                n.max_batched_tokens = 128;
                n.token_buckets = None
            }),
        ),
    ];
    let before = h.s.stats(h.now);
    for (knob, n) in cases {
        match h.s.update_config(n) {
            Err(KvError::RestartRequired(k)) => assert_eq!(k, knob),
            other => panic!("{knob}: {other:?}"),
        }
    }
    // Reserving more than the pool has promised away is refused too.
    let mut n = c.clone();
    n.overhead_reserve = 0.9;
    assert!(matches!(
        h.s.update_config(n),
        Err(KvError::InvalidConfig(_))
    ));
    assert_eq!(h.s.stats(h.now), before, "refused changes change nothing");
    assert_eq!(h.s.config(), &c);

    // Live: fewer sequences run from the next step; running ones are not cut.
    let mut n = c.clone();
    n.max_num_seqs = 3;
    n.max_seq_len = 64;
    n.ladder = ladder();
    h.s.update_config(n).unwrap();
    assert_eq!(h.s.ladder().config().rungs.len(), 4);
    assert_eq!(
        reason(h.s.submit("a", &prompt(40, 9), 30, h.now)),
        Some("too_long")
    );
    h.run(500);
    for k in 0..5 {
        h.submit("a", &prompt(8, 20 + k), 4);
    }
    h.step();
    assert_eq!(h.s.stats(h.now).running, 3);
    h.run(100);
}

#[test]
fn lifecycle_refuses_before_ready_and_while_draining() {
    let c = SchedulerConfig {
        require_warmup: true,
        ..config(64, 8)
    };
    let mut h = Harness::new(c);
    h.tenant(TenantConfig::new("a"));
    assert_eq!(h.s.lifecycle(), Lifecycle::Cold);
    assert!(h.s.live() && !h.s.ready());
    assert_eq!(
        reason(h.s.submit("a", &prompt(8, 1), 4, 0.0)),
        Some("not_ready")
    );
    h.s.begin_warmup().unwrap();
    assert_eq!(
        reason(h.s.submit("a", &prompt(8, 1), 4, 0.0)),
        Some("not_ready")
    );
    h.s.mark_ready().unwrap();
    assert!(h.s.ready());
    h.submit("a", &prompt(8, 1), 4);
    h.s.drain(100.0).unwrap();
    assert_eq!(h.s.lifecycle(), Lifecycle::Draining);
    assert!(!h.s.ready() && h.s.live());
    assert_eq!(
        reason(h.s.submit("a", &prompt(8, 2), 4, 0.0)),
        Some("draining")
    );
    assert!(
        h.s.mark_ready().is_err(),
        "a draining scheduler does not come back"
    );
    h.run(100);
    assert_eq!(h.s.lifecycle(), Lifecycle::Drained);
    assert!(!h.s.live());
    let st = h.s.stats(h.now);
    assert_eq!(st.rejected[RejectReason::NotReady.index()], 2);
    assert_eq!(st.rejected[RejectReason::Draining.index()], 1);
}

#[test]
fn a_drain_deadline_hands_back_what_is_unfinished_and_a_restore_finishes_it_alike() {
    drain_and_restore(KvGroups::single());
    // A hybrid model alike: window pages given back before the deadline, the
    // restored requests' window groups rebuilt from their tokens.
    drain_and_restore(KvGroups::parse(&["full", "sliding_window:12", "chunked_local:20"]).unwrap());
}

fn drain_and_restore(groups: KvGroups) {
    let reqs: Vec<(i32, usize, usize)> = (0..10).map(|k| (k, 5 + 3 * k as usize, 20)).collect();
    let submit_all = |h: &mut Harness| -> Vec<u64> {
        reqs.iter()
            .map(|&(seed, n, m)| {
                h.submit(if seed % 2 == 0 { "a" } else { "b" }, &prompt(n, seed), m)
            })
            .collect()
    };
    let new = || {
        let mut h = Harness::new(SchedulerConfig {
            kv_cache_groups: groups.clone(),
            ..config(400, 8)
        });
        h.tenant(TenantConfig::new("a"));
        h.tenant(TenantConfig::new("b"));
        h
    };
    // Undisturbed.
    let mut base = new();
    let base_ids = submit_all(&mut base);
    base.run(1000);
    let want: Vec<Vec<i32>> = base_ids
        .iter()
        .map(|id| base.finished[id].output.clone())
        .collect();

    // Drained with a deadline part-way, restored into a new scheduler.
    let mut h = new();
    let ids = submit_all(&mut h);
    for _ in 0..12 {
        h.step();
    }
    let finished_before: Vec<u64> = h.finished.keys().copied().collect();
    h.s.drain(h.now + 0.05).unwrap();
    while h.s.lifecycle() != Lifecycle::Drained {
        if h.step().is_none() {
            h.now += h.dt;
        }
    }
    let (during, back) = h.s.checkpoint();
    assert!(
        !back.is_empty(),
        "the deadline came before everything finished"
    );
    assert!(back.iter().all(|r| r.reason == "drain_deadline"));
    assert_eq!(
        finished_before.len() + during.len() + back.len(),
        ids.len(),
        "every request is finished or handed back"
    );
    assert_eq!(h.s.pool().used(), 0);
    let mut r = new();
    let mut restored = BTreeMap::new();
    for rec in &back {
        let id = r.s.submit_restored(rec, r.now).unwrap();
        restored.insert(rec.id, id);
    }
    r.run(1000);
    for (i, id) in ids.iter().enumerate() {
        let got = if let Some(f) = h.finished.get(id) {
            f.output.clone()
        } else {
            r.finished[&restored[id]].output.clone()
        };
        assert_eq!(got, want[i], "request {i}");
    }
}

fn record(prompt_: Vec<i32>, generated: Vec<i32>, max_tokens: usize, stops: Vec<i32>) -> InFlight {
    InFlight {
        id: 77,
        tenant: "a".into(),
        prompt: prompt_,
        generated,
        max_tokens,
        asked_max_tokens: max_tokens,
        stop_token_ids: stops,
        cache_salt: None,
        arrival: 0.0,
        reason: "in_flight",
    }
}

#[test]
fn a_restored_request_keeps_its_max_tokens_under_a_cap_rung() {
    for admission in [
        AdmissionMode::Reserve,
        AdmissionMode::Overcommit {
            watermark_blocks: 1,
        },
    ] {
        let mut c = config(200, 8);
        c.admission = admission;
        c.ladder = LadderConfig {
            rungs: vec![Rung {
                signal: Signal::QueueDepth,
                engage: 1.0,
                release: 0.5,
                action: Action::CapMaxTokens(4),
            }],
            retry_after_s: 1.0,
        };
        let mut h = Harness::new(c);
        h.tenant(TenantConfig::new("a"));
        h.submit("a", &prompt(8, 1), 20); // the cap rung engages at the next submit
        let id =
            h.s.submit_restored(&record(prompt(8, 2), vec![5; 10], 20, vec![]), h.now)
                .unwrap();
        assert_eq!(h.s.request(id).unwrap().max_tokens, 20);
        h.run(200);
        assert_eq!(h.finished[&id].output.len(), 20, "{admission:?}");
        assert_eq!(&h.finished[&id].output[..10], &[5; 10]);
    }
}

/// A request the ladder's cap_max_tokens rung capped keeps the mark through a
/// checkpoint: restored into a fresh scheduler (no ladder), it finishes with
/// the max_tokens it was admitted with, its caller's asked_max_tokens, and
/// `max_tokens_capped()`, not as an uncapped request (asked == max_tokens):
/// the record holds asked_max_tokens.
#[test]
fn a_capped_request_stays_capped_through_a_checkpoint() {
    let mut c = config(200, 8);
    c.ladder = LadderConfig {
        rungs: vec![Rung {
            signal: Signal::QueueDepth,
            engage: 1.0,
            release: 0.5,
            action: Action::CapMaxTokens(6),
        }],
        retry_after_s: 1.0,
    };
    let mut lo = TenantConfig::new("lo");
    lo.tier = 1;
    let mut h = Harness::new(c);
    h.tenant(TenantConfig::new("top"));
    h.tenant(lo.clone());
    h.submit("top", &prompt(8, 1), 20); // the cap rung engages at the next submit
    let id = h.submit("lo", &prompt(8, 2), 20);
    assert_eq!(h.s.request(id).unwrap().max_tokens, 6);
    h.step(); // its prefill, and a first token
    let (_, records) = h.s.checkpoint();
    let rec = records.iter().find(|r| r.id == id).unwrap();
    assert_eq!((rec.max_tokens, rec.asked_max_tokens), (6, 20));
    assert!(!rec.generated.is_empty());

    let mut fresh = Harness::new(config(200, 8));
    fresh.tenant(lo);
    let new_id = fresh
        .s
        .restore_all(std::slice::from_ref(rec), fresh.now)
        .unwrap()[0];
    fresh.run(200);
    let f = &fresh.finished[&new_id];
    assert_eq!(
        (f.asked_max_tokens, f.max_tokens, f.output.len()),
        (20, 6, 6)
    );
    assert!(f.max_tokens_capped());
}

/// A record whose asked_max_tokens is below its max_tokens cannot be right:
/// refused before anything is submitted.
#[test]
fn a_record_asking_less_than_it_was_admitted_with_is_refused() {
    let mut h = Harness::new(config(200, 8));
    h.tenant(TenantConfig::new("a"));
    let before = h.s.stats(h.now);
    let mut rec = record(prompt(8, 2), vec![3], 6, vec![]);
    rec.asked_max_tokens = 5;
    assert!(matches!(
        h.s.restore_all(&[rec], h.now),
        Err(KvError::InvalidRequest(m)) if m.contains("asked_max_tokens")
    ));
    assert_eq!(h.s.stats(h.now), before);
}

#[test]
fn a_record_that_had_finished_is_refused_and_changes_nothing() {
    let mut h = Harness::new(config(200, 8));
    h.tenant(TenantConfig::new("a"));
    let before = h.s.stats(h.now);
    for rec in [
        record(prompt(8, 2), vec![3, 9], 6, vec![9]), // stop token generated
        record(prompt(8, 2), vec![3; 6], 6, vec![]),  // max_tokens reached
        record(prompt(8, 2), vec![3, -1], 6, vec![]), // negative id
    ] {
        assert!(matches!(
            h.s.submit_restored(&rec, h.now),
            Err(KvError::InvalidRequest(_))
        ));
    }
    assert_eq!(h.s.stats(h.now), before);
}

#[test]
fn cancelling_the_last_request_of_a_drain_ends_it() {
    let mut h = Harness::new(config(200, 8));
    h.tenant(TenantConfig::new("a"));
    let id = h.submit("a", &prompt(8, 1), 20);
    h.step();
    h.s.drain(h.now + 100.0).unwrap();
    h.s.cancel(id).unwrap();
    assert_eq!(h.s.lifecycle(), Lifecycle::Drained);
    assert!(!h.s.live());
}
