//! A fuzzer for the prefix cache: random submits from a
//! few prompt families, salts and divergent prompts; steps with a cancel or a
//! submit between step and commit; cancels; tenant updates (floor, cap,
//! namespace, tier); removal and re-adding. After every operation: the
//! invariants, the KV each sequence reads back, and a page-owner oracle (every
//! page a request holds was written by a request of the same namespace and
//! salt); steps never stall; a final drain leaves no page used and only the
//! floors promised.

use super::*;
use random_ops::namespace;
use std::collections::HashMap as Map;

/// Submits from prompt families (with stop tokens, a salt, a divergent
/// token), steps with a cancel or a submit between plan and commit, cancels,
/// tenant updates (floor, cap, namespace, tier), removal and re-adding.
pub(super) const PREFIX_MIX: Mix = Mix {
    submit: 5,
    step: 10,
    cancel: 1,
    update: 2,
    remove: 1,
    submit_tenants: 0..4,
    prompt_len: 1..60,
    max_tokens: 1..30,
    families: 0..3,
    stop: 0.2,
    salt: Some((0.2, 0..3)),
    divergent: Some((0.2, 0..60)),
    cancel_mid: 0.2,
    submit_mid: Some((0.2, (0..4, 0..3, 1..40))),
    tenants: 0..4,
    floor: Some(0..8),
    cap: Some((0.3, 4..40)),
    tier: Some(0..3),
    ns: Some(0..3),
    ..Mix::NONE
};

const TN: [&str; 4] = ["p0", "p1", "p2", "p3"];

/// Namespace identity: (private incarnation or shared name, salt).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Ident {
    Private(u64),
    Shared(String),
}

struct Fz {
    h: Harness,
    incarnation: [u64; 4],
    next_inc: u64,
    ident: Map<u64, (Ident, Option<u8>)>,
    owner: Vec<Option<(Ident, Option<u8>)>>,
    k: i32,
}

impl Fz {
    fn live_ids(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .ident
            .keys()
            .copied()
            .filter(|&id| self.h.s.request(id).is_ok())
            .collect();
        v.sort();
        v
    }
    fn submit(
        &mut self,
        t: usize,
        p: &[i32],
        m: usize,
        stop: bool,
        salt: Option<u8>,
    ) -> Result<(), TestCaseError> {
        let Ok(tc) = self.h.s.tenants().by_name(TN[t]) else {
            return Ok(());
        };
        let id_ns = match &tc.config.prefix_namespace {
            None => Ident::Private(self.incarnation[t]),
            Some(s) => Ident::Shared(s.clone()),
        };
        let stops: Vec<i32> = if stop {
            (0..50_000).step_by(5).collect()
        } else {
            vec![]
        };
        let salt_bytes = salt.map(|s| vec![s; s as usize]);
        let opts = SubmitOptions {
            stop_token_ids: &stops,
            cache_salt: salt_bytes.as_deref(),
        };
        match self.h.s.submit_with(TN[t], p, m, &opts, self.h.now) {
            Ok(id) => {
                self.ident.insert(id, (id_ns, salt));
            }
            Err(e) => prop_assert!(e.reason().is_some(), "submit error {e}"),
        }
        Ok(())
    }
    /// Runs a planned step on the fake engine, noting who wrote each page.
    fn execute(&mut self, out: &StepOutcome) -> Result<Vec<i32>, TestCaseError> {
        let bs = self.h.s.config().block_size;
        let (ident, owner) = (&self.ident, &mut self.owner);
        self.h
            .execute(out, |id, slot| owner[slot / bs] = Some(ident[&id].clone()))
            .map_err(TestCaseError::fail)
    }
    fn check_owners(&self) -> Result<(), TestCaseError> {
        for (&id, ident) in &self.ident {
            let Ok(r) = self.h.s.request(id) else {
                continue;
            };
            for &p in &r.pages {
                let o = &self.owner[p as usize];
                prop_assert!(
                    o.as_ref() == Some(ident),
                    "request {} ({:?}) holds page {} written by {:?}",
                    id,
                    ident,
                    p,
                    o
                );
            }
        }
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
fn run(
    ops: Vec<Op>,
    one_fam: bool,
    over: bool,
    wm: usize,
    ovh: f64,
    mbt: usize,
    preempt: bool,
    bs: usize,
    pages: usize,
    seqs: usize,
    chunk: usize,
    tiers: [u32; 4],
    ns0: [u8; 4],
    partition: CachePartition,
    floor0: usize,
    groups: KvGroups,
) -> Result<(), TestCaseError> {
    let c = SchedulerConfig {
        kv_cache_groups: groups,
        num_blocks: pages + 1,
        block_size: bs,
        max_num_seqs: seqs,
        max_batched_tokens: mbt.max(seqs),
        max_seq_len: 96.min(pages * bs).max(2),
        overhead_reserve: ovh,
        max_waiting: 6,
        long_prefill_chunk: chunk,
        admission: if over {
            AdmissionMode::Overcommit {
                watermark_blocks: wm,
            }
        } else {
            AdmissionMode::Reserve
        },
        preempt_lower_tiers: preempt,
        prefix_cache_partition: partition,
        ..SchedulerConfig::default()
    };
    let mut f = Fz {
        h: Harness::new(c),
        incarnation: [0; 4],
        next_inc: 1,
        ident: Map::new(),
        owner: vec![None; pages + 1],
        k: 0,
    };
    for t in 0..4 {
        let mut tc = TenantConfig::new(TN[t]);
        tc.tier = tiers[t];
        tc.prefix_namespace = namespace(ns0[t]);
        // Floors give a partitioned tenant room to keep cached blocks in.
        tc.kv_floor_blocks = floor0.min(f.h.s.usable_blocks() / 4);
        f.h.s.add_tenant(tc).unwrap();
        f.incarnation[t] = f.next_inc;
        f.next_inc += 1;
    }
    let mut nones = 0;
    for op in ops {
        match op {
            Op::Submit {
                t,
                fam,
                n,
                m,
                stop,
                salt,
                divergent,
            } => {
                let mut p = prompt(n, if one_fam { 0 } else { fam });
                if let Some(d) = divergent {
                    if d < n {
                        f.k += 1;
                        p[d] = 1000 + f.k;
                    }
                }
                f.submit(t, &p, m, stop, salt)?;
            }
            Op::Step {
                cancel_mid,
                submit_mid,
            } => {
                let out =
                    f.h.plan()
                        .map_err(|e| TestCaseError::fail(format!("step: {e}")))?;
                let Some(out) = out else {
                    if f.h.s.live_requests() > 0 {
                        nones += 1;
                        prop_assert!(nones < 4, "stalled: {:?}", f.h.s.stats(f.h.now).pool);
                    }
                    f.h.now += 0.01;
                    f.check_owners()?;
                    f.h.s.check_invariants().map_err(TestCaseError::fail)?;
                    continue;
                };
                nones = 0;
                let sampled = f.execute(&out)?;
                f.check_owners()?;
                if let Some(pick) = cancel_mid {
                    let ids = f.live_ids();
                    if !ids.is_empty() {
                        f.h.s.cancel(ids[pick % ids.len()]).unwrap();
                    }
                    f.h.s.check_invariants().map_err(TestCaseError::fail)?;
                }
                if let Some((t, fam, n)) = submit_mid {
                    let p = prompt(n, fam);
                    f.submit(t, &p, 5, false, None)?;
                    f.check_owners()?;
                    f.h.s.check_invariants().map_err(TestCaseError::fail)?;
                }
                f.h.commit(out, &sampled)
                    .map_err(|e| TestCaseError::fail(format!("commit: {e}")))?;
            }
            Op::Cancel { pick } => {
                let ids = f.live_ids();
                if !ids.is_empty() {
                    f.h.s.cancel(ids[pick % ids.len()]).unwrap();
                }
            }
            Op::Update { t, .. } => {
                if let Ok(tc) = f.h.s.tenants().by_name(TN[t]) {
                    let c = op.updated(tc.config.clone());
                    let _ = f.h.s.update_tenant(c, f.h.now);
                }
            }
            Op::Remove {
                t,
                cancel_all,
                readd,
                ns,
            } => {
                if cancel_all {
                    let tid = f.h.s.tenants().id(TN[t]);
                    for id in f.live_ids() {
                        if Some(f.h.s.request(id).unwrap().tenant) == tid {
                            f.h.s.cancel(id).unwrap();
                        }
                    }
                }
                let _ = f.h.s.remove_tenant(TN[t]);
                f.h.s.check_invariants().map_err(TestCaseError::fail)?;
                if readd && f.h.s.tenants().id(TN[t]).is_none() {
                    let mut tc = TenantConfig::new(TN[t]);
                    tc.prefix_namespace = namespace(ns);
                    tc.tier = tiers[t];
                    if f.h.s.add_tenant(tc).is_ok() {
                        f.incarnation[t] = f.next_inc;
                    }
                    f.next_inc += 1;
                }
            }
            op => unreachable!("not in this mix: {op:?}"),
        }
        f.check_owners()?;
        f.h.s.check_invariants().map_err(TestCaseError::fail)?;
    }
    // Drain.
    for _ in 0..5000 {
        if f.h.s.live_requests() == 0 {
            break;
        }
        let out =
            f.h.plan()
                .map_err(|e| TestCaseError::fail(format!("drain step: {e}")))?;
        let Some(out) = out else {
            prop_assert!(false, "drain stalled: {:?}", f.h.s.stats(f.h.now).pool);
            unreachable!()
        };
        let sampled = f.execute(&out)?;
        f.check_owners()?;
        f.h.commit(out, &sampled)
            .map_err(|e| TestCaseError::fail(format!("drain commit: {e}")))?;
        f.h.s.check_invariants().map_err(TestCaseError::fail)?;
    }
    prop_assert_eq!(f.h.s.live_requests(), 0);
    let st = f.h.s.stats(f.h.now);
    prop_assert_eq!(st.pool.used, 0);
    prop_assert_eq!(
        st.pool.committed,
        st.tenants.iter().map(|t| t.kv_floor_blocks).sum::<usize>()
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100, ..ProptestConfig::default() })]
    #[test]
    fn a_request_reads_only_kv_of_its_namespace_and_salt_in_reserve_mode(ops in ops(&PREFIX_MIX, 1..200), preempt in any::<bool>(),
                     bs in 1usize..9, seqs in 1usize..6, chunk in 1usize..30, pages in 10usize..60,
                     tiers in prop::array::uniform4(0u32..3), ns0 in prop::array::uniform4(0u8..3), ovh in prop::sample::select(vec![0.0, 0.1, 0.3]), mbt in prop::sample::select(vec![4usize, 8, 24, 64]), one_fam in any::<bool>(), groups in kv_groups()) {
        run(ops, one_fam, false, 0, ovh, mbt, preempt, bs, pages, seqs, chunk, tiers, ns0, CachePartition::Shared, 0, groups)?;
    }
    #[test]
    fn a_request_reads_only_kv_of_its_namespace_and_salt_over_committed(ops in ops(&PREFIX_MIX, 1..200), preempt in any::<bool>(),
                  bs in 1usize..9, seqs in 1usize..6, chunk in 1usize..30, pages in 8usize..40,
                  tiers in prop::array::uniform4(0u32..3), ns0 in prop::array::uniform4(0u8..3), wm in 0usize..3, ovh in prop::sample::select(vec![0.0, 0.1, 0.3]), mbt in prop::sample::select(vec![4usize, 8, 24, 64]), one_fam in any::<bool>(), groups in kv_groups()) {
        run(ops, one_fam, true, wm, ovh, mbt, preempt, bs, pages, seqs, chunk, tiers, ns0, CachePartition::Shared, 0, groups)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100, ..ProptestConfig::default() })]
    #[test]
    fn a_request_reads_only_kv_of_its_namespace_and_salt_in_a_tiny_pool(ops in ops(&PREFIX_MIX, 1..250), preempt in any::<bool>(), over in any::<bool>(),
                     bs in 1usize..5, seqs in 1usize..8, chunk in 1usize..30, pages in 4usize..16,
                     tiers in prop::array::uniform4(0u32..3), ns0 in prop::array::uniform4(0u8..2), wm in 0usize..3, mbt in prop::sample::select(vec![8usize, 24, 64]), groups in kv_groups()) {
        run(ops, true, over, wm, 0.0, mbt, preempt, bs, pages, seqs, chunk, tiers, ns0, CachePartition::Shared, 0, groups)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100, ..ProptestConfig::default() })]
    /// The same runs with the cache partitioned by tenant (reserve mode): the
    /// invariants add each tenant's quota and a free list that covers every
    /// promised page, and no step ever finds a page the plan counted on gone.
    #[test]
    fn a_request_reads_only_kv_of_its_namespace_and_salt_partitioned(ops in ops(&PREFIX_MIX, 1..200), preempt in any::<bool>(),
                     bs in 1usize..9, seqs in 1usize..6, chunk in 1usize..30, pages in 10usize..60,
                     tiers in prop::array::uniform4(0u32..3), ns0 in prop::array::uniform4(0u8..3), ovh in prop::sample::select(vec![0.0, 0.1, 0.3]), mbt in prop::sample::select(vec![4usize, 8, 24, 64]), one_fam in any::<bool>(), floor0 in 0usize..3, groups in kv_groups()) {
        run(ops, one_fam, false, 0, ovh, mbt, preempt, bs, pages, seqs, chunk, tiers, ns0, CachePartition::Tenant, floor0, groups)?;
    }
    #[test]
    fn a_request_reads_only_kv_of_its_namespace_and_salt_partitioned_in_a_tiny_pool(ops in ops(&PREFIX_MIX, 1..250), preempt in any::<bool>(),
                     bs in 1usize..5, seqs in 1usize..8, chunk in 1usize..30, pages in 4usize..16,
                     tiers in prop::array::uniform4(0u32..3), ns0 in prop::array::uniform4(0u8..2), mbt in prop::sample::select(vec![8usize, 24, 64]), floor0 in 0usize..2, groups in kv_groups()) {
        run(ops, true, false, 0, 0.0, mbt, preempt, bs, pages, seqs, chunk, tiers, ns0, CachePartition::Tenant, floor0, groups)?;
    }
}
