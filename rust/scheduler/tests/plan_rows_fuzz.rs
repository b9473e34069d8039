//! A fuzzer over every operation, cancels and submits between a step and
//! its commit included, that checks each plan's rows against the request's
//! page lists and the KV each sequence reads back through them.

use super::*;

/// Submits (with stop tokens or not), steps with a cancel or a submit
/// between plan and commit, cancels, and tenant updates (floor, per-step
/// cap, weight).
pub(super) const ROWS_MIX: Mix = Mix {
    submit: 4,
    step: 8,
    cancel: 1,
    update: 1,
    submit_tenants: 0..3,
    prompt_len: 1..50,
    max_tokens: 1..40,
    stop: 0.5,
    cancel_mid: 0.3,
    submit_mid: Some((0.2, (0..1, 0..1, 5..6))),
    tenants: 0..3,
    floor: Some(0..6),
    step_cap: Some((0.5, 1..20)),
    weight: Some(1..4),
    ..Mix::NONE
};

fn check_rows(s: &Scheduler, b: &OwnedPlanBuffers, out: &StepOutcome) -> Result<(), String> {
    let pps = s.plan_shape().pages_per_seq;
    for (i, &id) in out.request_ids.iter().enumerate() {
        let r = s.request(id).map_err(|e| e.to_string())?;
        let row = &b.page_indices[i * pps..(i + 1) * pps];
        let want: Vec<i32> = r
            .pages
            .iter()
            .map(|&p| p as i32)
            .chain(std::iter::repeat(0))
            .take(pps)
            .collect();
        if row != &want[..] {
            return Err(format!("row {i} of request {id}: {row:?} != {want:?}"));
        }
    }
    for i in out.num_seqs..s.plan_shape().max_seqs {
        if b.page_indices[i * pps..(i + 1) * pps]
            .iter()
            .any(|&p| p != 0)
        {
            return Err(format!("pad row {i} dirty"));
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn run(
    ops: Vec<Op>,
    over: bool,
    preempt: bool,
    bs: usize,
    pages: usize,
    seqs: usize,
    chunk: usize,
    groups: KvGroups,
) -> Result<(), TestCaseError> {
    let c = SchedulerConfig {
        kv_cache_groups: groups,
        num_blocks: pages + 1,
        block_size: bs,
        max_num_seqs: seqs,
        max_batched_tokens: 24.max(seqs),
        max_seq_len: 96.min(pages * bs).max(2),
        overhead_reserve: 0.0,
        max_waiting: 6,
        long_prefill_chunk: chunk,
        admission: if over {
            AdmissionMode::Overcommit {
                watermark_blocks: 1,
            }
        } else {
            AdmissionMode::Reserve
        },
        preempt_lower_tiers: preempt,
        ..SchedulerConfig::default()
    };
    let mut h = Harness::new(c);
    for (tier, name) in NAMES[..3].iter().enumerate() {
        let mut tc = tenant(name, 0, None);
        tc.tier = tier as u32;
        // Two of the three share a prefix-cache namespace.
        tc.prefix_namespace = (tier > 0).then(|| "group".to_owned());
        h.tenant(tc);
    }
    let mut k = 0i32;
    let mut nones = 0;
    for op in ops {
        match op {
            Op::Submit { t, n, m, stop, .. } => {
                k += 1;
                // Three families of prompts: each one a prefix of the longer
                // ones of its family, so the prefix cache is hit all the time.
                let p = prompt(n, k % 3);
                let stops: Vec<i32> = if stop {
                    (0..50_000).step_by(7).collect()
                } else {
                    vec![]
                };
                let _ = h.s.submit_with_stops(NAMES[t], &p, m, &stops, h.now);
            }
            Op::Step {
                cancel_mid,
                submit_mid,
            } => {
                let out = h.plan().map_err(|e| TestCaseError::fail(e.to_string()))?;
                let Some(out) = out else {
                    if h.s.live_requests() > 0 {
                        nones += 1;
                        prop_assert!(nones < 4, "stalled: {:?}", h.s.stats(h.now).pool);
                    }
                    continue;
                };
                nones = 0;
                check_rows(&h.s, &h.bufs[out.parity], &out).map_err(TestCaseError::fail)?;
                let sampled = h.execute(&out, |_, _| {}).map_err(TestCaseError::fail)?;
                if let Some(pick) = cancel_mid {
                    let ids: Vec<u64> = (1..=k as u64 + 1)
                        .filter(|&id| h.s.request(id).is_ok())
                        .collect();
                    if !ids.is_empty() {
                        h.s.cancel(ids[pick % ids.len()]).unwrap();
                    }
                    h.s.check_invariants().map_err(TestCaseError::fail)?;
                }
                if let Some((t, _, n)) = submit_mid {
                    k += 1;
                    let _ = h.s.submit(NAMES[t], &prompt(n, k), 5, h.now);
                }
                h.commit(out, &sampled)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::Cancel { pick } => {
                let ids: Vec<u64> = (1..=k as u64 + 1)
                    .filter(|&id| h.s.request(id).is_ok())
                    .collect();
                if !ids.is_empty() {
                    h.s.cancel(ids[pick % ids.len()]).unwrap();
                }
            }
            Op::Update { t, .. } => {
                // Each tenant stays on its own tier (the one it was added with).
                let c = op.updated(h.s.tenants().by_name(NAMES[t]).unwrap().config.clone());
                let _ = h.s.update_tenant(c, h.now);
            }
            op => unreachable!("not in this mix: {op:?}"),
        }
        h.s.check_invariants().map_err(TestCaseError::fail)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    #[test]
    fn every_plan_row_and_kv_read_matches_the_page_lists_in_reserve_mode(ops in ops(&ROWS_MIX, 1..200), preempt in any::<bool>(),
                    bs in prop::sample::select(vec![1usize, 2, 4, 8]), seqs in 1usize..6, chunk in 1usize..30, groups in kv_groups()) {
        run(ops, false, preempt, bs, 200, seqs, chunk, groups)?;
    }
    #[test]
    fn every_plan_row_and_kv_read_matches_the_page_lists_over_committed(ops in ops(&ROWS_MIX, 1..200), preempt in any::<bool>(),
                    bs in prop::sample::select(vec![1usize, 2, 4, 8]), seqs in 1usize..6, chunk in 1usize..30, pages in 8usize..40, groups in kv_groups()) {
        run(ops, true, preempt, bs, pages, seqs, chunk, groups)?;
    }
}

/// The case the over-committed run once shrank to (saved as a proptest seed,
/// which the shared generator no longer maps to the same operations): two
/// prompts, then a one-token one, in one-token blocks, two slots.
#[test]
fn rows_stay_right_in_a_case_the_over_committed_fuzzer_once_found() {
    let submit = |n, m| Op::Submit {
        t: 0,
        n,
        m,
        fam: 0,
        stop: false,
        salt: None,
        divergent: None,
    };
    let step = || Op::Step {
        cancel_mid: None,
        submit_mid: None,
    };
    let mut ops = vec![submit(15, 6), step(), submit(11, 4)];
    ops.extend(std::iter::repeat_with(step).take(3));
    ops.push(submit(1, 1));
    ops.extend(std::iter::repeat_with(step).take(5));
    run(ops, true, false, 1, 28, 2, 15, KvGroups::single()).unwrap();
}
