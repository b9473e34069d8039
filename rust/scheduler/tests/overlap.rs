//! Overlapped scheduling (overlap.rs): a plan advanced before its tokens are
//! known, the next one planned and "run" while they are out, then resolved.
//! The fake engine takes a placeholder input token from the previous plan's
//! sampled array, as a device would, and reads every sequence's KV back; each
//! request must end with the tokens and the reason a serial run gives it.

use super::*;

/// One request of a workload: tenant, prompt, max_tokens, stop tokens.
type Job = (&'static str, Vec<i32>, usize, Vec<i32>);

/// Run `jobs` (all submitted at the start) to the end, serially
/// (`commit`), or overlapped (`advance`, the next `step`, then `resolve`).
/// Returns each request's terminal event by id, after checking the KV every
/// sequence read and the invariants after every call.
fn run(config: SchedulerConfig, jobs: &[Job], overlapped: bool) -> BTreeMap<u64, FinishedRequest> {
    let mut h = Harness::new(config);
    for name in ["a", "b"] {
        let mut t = tenant(name, 0, None);
        t.tier = u32::from(name == "b");
        h.tenant(t);
    }
    for (tenant, prompt, max_tokens, stops) in jobs {
        // A refusal (the pool) is the same in both runs.
        let _ =
            h.s.submit_with_stops(tenant, prompt, *max_tokens, stops, h.now);
    }
    if !overlapped {
        h.run(2000);
        return h.finished;
    }
    // The plan advanced and not resolved, with its sampled tokens.
    let mut prev: Option<(StepOutcome, Vec<i32>)> = None;
    for _ in 0..2000 {
        if h.s.live_requests() == 0 && prev.is_none() {
            return h.finished;
        }
        let out = h.plan().unwrap();
        // The device runs it now: its placeholders come from `prev`.
        let reads = out
            .as_ref()
            .map(|o| h.run_overlapped(o, prev.as_ref().map_or(&[][..], |p| &p.1)));
        if let Some((p, sampled)) = prev.take() {
            let ev = h.s.resolve(p.step_id, &sampled, h.now).unwrap();
            h.record(&ev);
            h.s.check_invariants().unwrap();
        }
        if let (Some(o), Some(reads)) = (out, reads) {
            let sampled = h.check_reads(&o, reads);
            h.s.advance(o.step_id, h.now).unwrap();
            h.s.check_invariants().unwrap();
            prev = Some((o, sampled));
        }
        h.now += h.dt;
    }
    panic!("requests still live after 2000 steps");
}

impl Harness {
    /// The fake engine on a plan some of whose input tokens are placeholders
    /// of the previous plan's rows (`prev`, its sampled tokens): each is taken
    /// from there, written at its slots, and every sequence's KV is read back
    /// through its rows. Returns what each sequence read.
    fn run_overlapped(&mut self, out: &StepOutcome, prev: &[i32]) -> Vec<Vec<i32>> {
        let shape = *self.s.plan_shape();
        let b = self.bufs[out.parity].clone();
        let bs = shape.block_size.get();
        let pps = shape.pages_per_seq;
        let token = |t: i32| if t < 0 { prev[(-t - 1) as usize] } else { t };
        let kinds = self.s.config().kv_cache_groups.clone();
        for g in 0..kinds.len() {
            let slots = b.group_slots(&shape, g);
            for (&slot, &t) in slots.iter().zip(&b.token_ids).take(out.num_tokens) {
                self.kv[slot as usize] = token(t);
            }
        }
        (0..out.num_seqs)
            .map(|i| {
                let kv_len = b.kv_lens[i] as usize;
                let row = &b.page_indices[i * pps..(i + 1) * pps];
                (0..kv_len)
                    .map(|p| self.kv[row[p / bs] as usize * bs + p % bs])
                    .collect()
            })
            .collect()
    }

    /// After the previous plan is resolved: what each sequence read is its
    /// request's tokens (a request ended since is not checked: its token is
    /// dropped); the tokens sampled are a hash of the reads.
    fn check_reads(&self, out: &StepOutcome, reads: Vec<Vec<i32>>) -> Vec<i32> {
        for (i, read) in reads.iter().enumerate() {
            if let Ok(r) = self.s.request(out.request_ids[i]) {
                assert_eq!(
                    read[..],
                    r.tokens[..read.len()],
                    "request {} read the wrong KV",
                    r.id
                );
            }
        }
        reads.iter().map(|r| sample_of(r)).collect()
    }

    fn record(&mut self, ev: &CommitEvents) {
        self.preempted += ev.preempted.len() as u64;
        for f in &ev.finished {
            assert!(
                self.finished.insert(f.id, f.clone()).is_none(),
                "request {} ended twice",
                f.id
            );
        }
        assert!(ev.tokens.iter().all(|&t| t >= 0), "a placeholder escaped");
    }
}

/// Stop tokens that a hash-sampled run hits now and then.
fn stops() -> Vec<i32> {
    (0..50_000).step_by(9).collect()
}

fn jobs(n: usize, seed: i32) -> Vec<Job> {
    (0..n)
        .map(|k| {
            let s = k as i32 + seed;
            let tenant = if k % 3 == 0 { "b" } else { "a" };
            let stop = if k % 2 == 0 { stops() } else { vec![] };
            (
                tenant,
                prompt(3 + (k * 7) % 40, s % 4),
                1 + (k * 5) % 30,
                stop,
            )
        })
        .collect()
}

fn same_endings(config: SchedulerConfig, jobs: &[Job]) {
    let serial = run(config.clone(), jobs, false);
    let overlapped = run(config, jobs, true);
    assert_eq!(serial.len(), jobs.len());
    assert_eq!(overlapped.len(), serial.len());
    for (id, f) in &serial {
        let o = &overlapped[id];
        assert_eq!((&o.output, o.reason), (&f.output, f.reason), "request {id}");
    }
}

#[test]
fn overlapped_runs_end_every_request_as_a_serial_run_does() {
    same_endings(config(400, 4), &jobs(12, 0));
}

#[test]
fn overlapped_hybrid_runs_end_every_request_as_a_serial_run_does() {
    let c = SchedulerConfig {
        kv_cache_groups: KvGroups::parse(&["full", "sliding_window:6"]).unwrap(),
        ..config(400, 4)
    };
    same_endings(c, &jobs(12, 3));
}

#[test]
fn overlapped_runs_preempted_over_committed_end_as_a_serial_run_does() {
    let c = SchedulerConfig {
        admission: AdmissionMode::Overcommit {
            watermark_blocks: 1,
        },
        preempt_lower_tiers: true,
        ..config(25, 4)
    };
    // Short prompts (3 pages reserved each) that grow to 11 pages.
    let js: Vec<Job> = (0..7)
        .map(|k| (if k % 3 == 0 { "b" } else { "a" }, prompt(5, k), 38, vec![]))
        .collect();
    let serial = run(c.clone(), &js, false);
    let overlapped = run(c, &js, true);
    assert_eq!(overlapped.len(), 7);
    let most = overlapped.values().map(|f| f.preemptions).max();
    assert!(
        most > Some(0),
        "nothing was preempted: {} ended",
        overlapped.len()
    );
    for (id, f) in &serial {
        assert_eq!(overlapped[id].output, f.output, "request {id}");
    }
}

#[test]
fn a_request_stopped_by_its_token_is_known_one_step_late_and_its_extra_token_dropped() {
    let mut h = Harness::new(config(200, 4));
    h.tenant(tenant("a", 0, None));
    // Hash-sampled: learn its second token, then make it the stop token.
    let p = prompt(9, 1);
    h.submit("a", &p, 5);
    h.run(100);
    let second = h.finished[&1].output[1];
    let id = h.s.submit_with_stops("a", &p, 5, &[second], h.now).unwrap();
    let step = |h: &mut Harness| {
        let out = h.plan().unwrap().unwrap();
        let sampled = h.execute(&out, |_, _| {}).unwrap();
        (out, sampled)
    };
    let (first, s1) = step(&mut h); // the prompt, sampling token 1
    h.s.advance(first.step_id, h.now).unwrap();
    h.s.resolve(first.step_id, &s1, h.now).unwrap();
    let (second_step, s2) = step(&mut h); // samples the stop token
    h.s.advance(second_step.step_id, h.now).unwrap();
    // Not known yet: planned again (the extra token), then resolved.
    let third = h.plan().unwrap().unwrap();
    assert_eq!(third.request_ids, vec![id]);
    assert!(
        h.bufs[third.parity].token_ids[0] < 0,
        "its input is a placeholder"
    );
    let ev = h.s.resolve(second_step.step_id, &s2, h.now).unwrap();
    let f = &ev.finished[0];
    assert_eq!((f.reason, f.output.len()), (FinishReason::Stop, 2));
    assert_eq!(f.output[1], second);
    h.s.advance(third.step_id, h.now).unwrap();
    let ev = h.s.resolve(third.step_id, &[7], h.now).unwrap();
    assert!(ev.tokens.is_empty() && ev.finished.is_empty());
    assert_eq!(h.s.pool().used(), 0);
    h.s.check_invariants().unwrap();
}

#[test]
fn one_plan_at_most_is_unresolved_and_out_of_order_calls_change_nothing() {
    let mut h = Harness::new(config(200, 4));
    h.tenant(tenant("a", 0, None));
    h.submit("a", &prompt(5, 1), 8);
    let a = h.plan().unwrap().unwrap();
    assert!(matches!(
        h.s.resolve(a.step_id, &[1], h.now),
        Err(KvError::StalePlan(_))
    ));
    h.s.advance(a.step_id, h.now).unwrap();
    assert!(matches!(
        h.s.advance(a.step_id, h.now),
        Err(KvError::StalePlan(_))
    ));
    let b = h.plan().unwrap().unwrap();
    assert!(matches!(
        h.s.advance(b.step_id, h.now),
        Err(KvError::StalePlan(_))
    ));
    assert!(matches!(
        h.s.commit(b.step_id, &[1], h.now),
        Err(KvError::StalePlan(_))
    ));
    assert!(matches!(
        h.s.resolve(a.step_id, &[1, 2], h.now),
        Err(KvError::InvalidState(_))
    ));
    assert!(matches!(
        h.s.resolve(a.step_id, &[-1], h.now),
        Err(KvError::InvalidState(_))
    ));
    assert_eq!(h.s.unresolved_step(), Some(a.step_id));
    h.s.check_invariants().unwrap();
    let ev = h.s.resolve(a.step_id, &[4], h.now).unwrap();
    assert_eq!(ev.tokens, vec![4]);
    h.s.commit(b.step_id, &[5], h.now).unwrap();
    assert_eq!(h.s.request(1).unwrap().output(), &[4, 5]);
}

#[test]
fn a_request_cancelled_or_handed_back_before_the_resolve_ends_without_its_placeholder() {
    let mut h = Harness::new(config(200, 4));
    h.tenant(tenant("a", 0, None));
    let a = h.submit("a", &prompt(5, 1), 8);
    let b = h.submit("a", &prompt(6, 2), 8);
    let p = h.plan().unwrap().unwrap();
    h.s.advance(p.step_id, h.now).unwrap();
    h.s.cancel(a).unwrap();
    h.s.drain(h.now).unwrap();
    let _ = h.plan().unwrap(); // the deadline hands b back
    let (_, back) = h.s.checkpoint();
    assert_eq!(
        back.iter()
            .map(|r| (r.id, r.generated.len()))
            .collect::<Vec<_>>(),
        vec![(b, 0)]
    );
    let ev = h.s.resolve(p.step_id, &[3, 4], h.now).unwrap();
    assert!(ev.tokens.is_empty(), "their tokens are dropped");
    let cancelled = ev.finished.iter().find(|f| f.id == a).unwrap();
    assert!(cancelled.output.is_empty());
    assert_eq!(h.s.lifecycle(), Lifecycle::Drained);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 60, ..ProptestConfig::default() })]
    /// Random workloads, pools, chunk sizes, KV-cache groups and admission
    /// modes: an overlapped run ends every request as a serial run does.
    #[test]
    fn overlapped_and_serial_runs_agree(n in 1usize..14, seed in 0i32..50, bs in 1usize..6,
                                        pages in 30usize..200, chunk in 1usize..20,
                                        over in any::<bool>(), groups in kv_groups()) {
        let c = SchedulerConfig {
            num_blocks: pages + 1,
            block_size: bs,
            long_prefill_chunk: chunk,
            max_seq_len: 96.min(pages * bs / 4).max(48),
            max_waiting: 16,
            kv_cache_groups: groups,
            admission: if over {
                AdmissionMode::Overcommit { watermark_blocks: 1 }
            } else {
                AdmissionMode::Reserve
            },
            ..config(pages + 1, bs)
        };
        let js: Vec<Job> = jobs(n, seed)
            .into_iter()
            .filter(|(_, p, m, _)| p.len() + m <= c.max_seq_len)
            .collect();
        let serial = run(c.clone(), &js, false);
        let overlapped = run(c, &js, true);
        prop_assert_eq!(serial.len(), overlapped.len());
        for (id, f) in &serial {
            prop_assert_eq!(&overlapped[id].output, &f.output, "request {}", id);
        }
    }
}
