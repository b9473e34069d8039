//! Planning steps: chunked prefill runs the same tokens as an unchunked run,
//! decodes are never skipped, plans are deterministic, out-of-order calls are
//! refused, and what ends between a step and its commit.

use super::*;

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
