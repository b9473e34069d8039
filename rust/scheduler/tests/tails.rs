//! A decode's commit writes its running set's tail, not its request (see
//! tail.rs): the request catches up every `TAIL_TOKENS` tokens, and everything
//! that reads it meanwhile sees every token, finished or not.

use super::*;
use crate::scheduler::tail::TAIL_TOKENS;

fn one_tenant(caching: bool) -> Harness {
    let mut h = Harness::new(SchedulerConfig {
        prefix_caching: caching,
        ..config(200, 8)
    });
    h.tenant(TenantConfig::new("a"));
    h
}

/// Steps until `id` has generated `n` tokens.
fn generate(h: &mut Harness, id: u64, n: usize) {
    while h.s.request(id).unwrap().generated() < n {
        h.step().expect("it runs");
    }
}

/// What `prompt` generates with no stop tokens (the fake engine's tokens
/// depend on the tokens read alone).
fn reference_output(prompt: &[i32], max_tokens: usize) -> Vec<i32> {
    let mut h = one_tenant(false);
    let id = h.submit("a", prompt, max_tokens);
    h.run(200);
    h.finished[&id].output.clone()
}

#[test]
fn a_decodes_commit_leaves_its_request_as_it_was_until_its_tail_fills() {
    let mut h = one_tenant(false);
    let id = h.submit("a", &prompt(5, 1), 60);
    generate(&mut h, id, 1);
    let slab = h.s.requests.slot_of(id).unwrap();
    let record = |h: &Harness| h.s.requests.get(slab).tokens.len();
    let settled = record(&h);
    assert_eq!(settled, 6, "the first token comes through the request");
    for k in 1..TAIL_TOKENS {
        h.step().unwrap();
        assert_eq!(record(&h), settled, "after {k} decodes");
        assert_eq!(h.s.request(id).unwrap().tokens.len(), settled + k);
    }
    h.step().unwrap();
    assert_eq!(record(&h), settled + TAIL_TOKENS, "a full tail catches up");
    assert_eq!(h.s.request(id).unwrap().tokens.len(), record(&h));
}

#[test]
fn every_reader_of_a_running_request_sees_the_tokens_its_tail_holds() {
    let mut h = one_tenant(false);
    let a = h.submit("a", &prompt(5, 2), 60);
    let b = h.submit("a", &prompt(7, 3), 60);
    generate(&mut h, a, 4);
    let slab = h.s.requests.slot_of(a).unwrap();
    let so_far = h.s.request(a).unwrap().output().to_vec();
    assert!(h.s.requests.get(slab).output().len() < so_far.len());
    assert_eq!(so_far.len(), 4);
    // The checkpoint.
    let (_, live) = h.s.checkpoint();
    let rec = live.iter().find(|r| r.id == a).unwrap();
    assert_eq!(rec.generated, so_far);
    // Cancelling: its terminal event carries every token.
    let ended = h.s.cancel(a).unwrap();
    assert_eq!(ended.output(), &so_far[..]);
    let f = h.s.take_finished();
    assert_eq!((f[0].id, &f[0].output), (a, &so_far));
    h.s.check_invariants().unwrap();
    // The drain deadline hands back b with every token too.
    generate(&mut h, b, 3);
    let b_so_far = h.s.request(b).unwrap().output().to_vec();
    h.s.drain(h.now).unwrap();
    assert!(h.step().is_none());
    let f = h.s.take_finished();
    assert_eq!((f[0].id, &f[0].output), (b, &b_so_far));
    let (_, back) = h.s.checkpoint();
    assert_eq!(back[0].generated, b_so_far);
}

#[test]
fn stop_tokens_end_a_decode_whether_or_not_its_tail_holds_them() {
    let p = prompt(6, 4);
    let reference = reference_output(&p, 40);
    // A stop token first sampled 13 tokens in (past a full tail).
    let k = (12..reference.len())
        .find(|&k| !reference[..k].contains(&reference[k]))
        .unwrap();
    let stop = reference[k];
    let unseen: Vec<i32> = (60_000..60_004).collect(); // never sampled (< 50,000)
    for stops in [
        vec![stop],
        vec![unseen[0], stop],
        vec![unseen[0], unseen[1], stop],
        unseen.iter().copied().chain([stop]).collect(),
    ] {
        let mut h = one_tenant(false);
        let id = h.s.submit_with_stops("a", &p, 40, &stops, h.now).unwrap();
        h.run(200);
        let f = &h.finished[&id];
        assert_eq!(f.reason, FinishReason::Stop, "stops {stops:?}");
        assert_eq!(f.output, reference[..=k], "stops {stops:?}");
    }
}

#[test]
fn max_tokens_ends_a_decode_at_exactly_its_length_past_full_tails() {
    let p = prompt(6, 5);
    let reference = reference_output(&p, 40);
    for max in [1, 2, TAIL_TOKENS, TAIL_TOKENS + 1, 2 * TAIL_TOKENS + 3] {
        let mut h = one_tenant(true);
        let id = h.submit("a", &p, max);
        h.run(200);
        let f = &h.finished[&id];
        assert_eq!(f.reason, FinishReason::Length);
        assert_eq!(f.output, reference[..max], "max_tokens {max}");
    }
}

#[test]
fn a_commit_after_the_running_set_changed_catches_every_request_up() {
    // Ending one request between a step and its commit moves another into
    // its place: that commit goes through the requests.
    let mut h = one_tenant(true);
    let ids: Vec<u64> = (0..4)
        .map(|i| h.submit("a", &prompt(5, 10 + i), 40))
        .collect();
    let reference: Vec<Vec<i32>> = (0..4)
        .map(|i| reference_output(&prompt(5, 10 + i), 40))
        .collect();
    generate(&mut h, ids[3], 5);
    let out = h.plan().unwrap().unwrap();
    let sampled = h.execute(&out, |_, _| {}).unwrap();
    h.s.cancel(ids[0]).unwrap();
    h.commit(out, &sampled).unwrap();
    for (i, &id) in ids.iter().enumerate().skip(1) {
        let slab = h.s.requests.slot_of(id).unwrap();
        let r = h.s.requests.get(slab);
        assert_eq!(r.output(), &reference[i][..6], "request {id}, settled");
    }
    h.run(200);
    for (i, &id) in ids.iter().enumerate().skip(1) {
        assert_eq!(h.finished[&id].output, reference[i], "request {id}");
    }
}

#[test]
fn a_decodes_sampled_id_is_checked_and_a_refused_commit_changes_nothing() {
    let mut h = Harness::new(SchedulerConfig {
        vocab_size: Some(50_000),
        ..config(200, 8)
    });
    h.tenant(TenantConfig::new("a"));
    let id = h.submit("a", &prompt(5, 6), 30);
    generate(&mut h, id, 3);
    let out = h.plan().unwrap().unwrap();
    assert_eq!((out.num_seqs, out.num_decode), (1, 1));
    let sampled = h.execute(&out, |_, _| {}).unwrap();
    let before = h.s.request(id).unwrap();
    for bad in [-1, 50_000] {
        let err = h.s.commit(out.step_id, &[bad], h.now).unwrap_err();
        assert!(matches!(err, KvError::InvalidState(_)), "{err}");
        let now = h.s.request(id).unwrap();
        assert_eq!(
            (now.tokens, now.num_computed),
            (before.tokens.clone(), before.num_computed)
        );
    }
    h.commit(out, &sampled).unwrap();
    assert_eq!(h.s.request(id).unwrap().generated(), 4);
}
