//! Prefix caching through the scheduler, checked by the fake engine: a cache
//! hit that pointed at the wrong KV would be read back and caught.

use super::*;

const BS: usize = 8;

fn cfg(num_blocks: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size: BS,
        max_num_seqs: 4,
        max_batched_tokens: 32,
        max_seq_len: 128,
        overhead_reserve: 0.0,
        max_waiting: 8,
        long_prefill_chunk: 32,
        ..SchedulerConfig::default()
    }
}

fn harness(num_blocks: usize, tenants: &[(&str, Option<&str>)]) -> Harness {
    let mut h = Harness::new(cfg(num_blocks));
    for &(name, ns) in tenants {
        let mut c = TenantConfig::new(name);
        c.prefix_namespace = ns.map(str::to_owned);
        h.tenant(c);
    }
    h
}

fn tenant_stats(h: &Harness, name: &str) -> TenantStats {
    h.s.stats(h.now)
        .tenants
        .into_iter()
        .find(|t| t.name == name)
        .unwrap()
}

fn salted(h: &mut Harness, tenant: &str, p: &[i32], salt: &[u8]) -> u64 {
    let opts = SubmitOptions {
        stop_token_ids: &[],
        cache_salt: Some(salt),
    };
    h.s.submit_with(tenant, p, 4, &opts, h.now).unwrap()
}

fn cached(h: &Harness, id: u64) -> usize {
    h.s.request(id).unwrap().num_computed
}

/// Submit and say how many prompt tokens the cache served.
fn hit(h: &mut Harness, tenant: &str, p: &[i32], max_tokens: usize) -> usize {
    let id = h.submit(tenant, p, max_tokens);
    cached(h, id)
}

#[test]
fn a_finished_prompt_is_served_from_the_cache_and_generates_the_same() {
    let mut h = harness(64, &[("a", None)]);
    let p = prompt(43, 1);
    let a = h.submit("a", &p, 5);
    assert_eq!(cached(&h, a), 0, "a cold cache");
    h.run(100);
    let b = h.submit("a", &p, 5);
    // (43 - 1) / 8 = 5 full blocks can be served; the last 3 tokens run.
    assert_eq!(cached(&h, b), 40);
    h.run(100);
    assert_eq!(h.ran[&b][0], (40, p[40]), "prefill starts after the hit");
    assert_eq!(h.ran[&b].len(), 3 + 4, "3 prompt tokens, then 4 decodes");
    assert_eq!(h.finished[&a].output, h.finished[&b].output);
    assert_eq!(h.finished[&b].cached_tokens, 40);
    let m = tenant_stats(&h, "a").metrics;
    assert_eq!((m.prefix_query_blocks, m.prefix_hit_blocks), (10, 5));
    assert_eq!((m.prefix_query_tokens, m.prefix_hit_tokens), (86, 40));
    assert_eq!(m.prefill_tokens, 43 + 3);
}

#[test]
fn the_last_prompt_token_is_always_recomputed() {
    let mut h = harness(64, &[("a", None)]);
    let p = prompt(32, 1); // exactly 4 blocks
    h.submit("a", &p, 2);
    h.run(100);
    let b = h.submit("a", &p, 2);
    assert_eq!(
        cached(&h, b),
        24,
        "3 blocks: the 4th holds the token to sample from"
    );
    h.run(100);
}

#[test]
fn a_partial_prefix_hits_its_full_blocks() {
    let mut h = harness(64, &[("a", None)]);
    let p = prompt(40, 1);
    h.submit("a", &p, 2);
    h.run(100);
    let mut q = p[..21].to_vec();
    q.extend([999, 998, 997, 996, 995]);
    let b = h.submit("a", &q, 2);
    assert_eq!(
        cached(&h, b),
        16,
        "blocks 0 and 1 match; block 2 differs at token 21"
    );
    // A different first token shares nothing: the chain starts there.
    let mut r = p.clone();
    r[0] += 1;
    let c = h.submit("a", &r, 2);
    assert_eq!(cached(&h, c), 0);
    h.run(100);
}

#[test]
fn tenants_never_hit_each_other_unless_they_share_a_namespace() {
    let mut h = harness(
        128,
        &[
            ("a", None),
            ("b", None),
            ("s1", Some("team")),
            ("s2", Some("team")),
            ("x", Some("other")),
        ],
    );
    let p = prompt(40, 3);
    h.submit("a", &p, 2);
    h.submit("s1", &p, 2);
    h.run(100);
    assert_eq!(hit(&mut h, "b", &p, 2), 0, "another tenant");
    assert_eq!(hit(&mut h, "x", &p, 2), 0, "another shared namespace");
    assert_eq!(hit(&mut h, "s2", &p, 2), 32, "same shared namespace");
    assert_eq!(hit(&mut h, "a", &p, 2), 32, "its own");
    h.run(100);
    // A shared namespace is not its members' own: s1 does not hit a's blocks
    // (it did not above either: s1 ran cold next to a).
    let s1 = tenant_stats(&h, "s1").metrics;
    assert_eq!(s1.prefix_hit_blocks, 0);
}

#[test]
fn a_salt_keeps_blocks_to_requests_with_the_same_salt() {
    let mut h = harness(128, &[("a", None)]);
    let p = prompt(40, 4);
    h.submit("a", &p, 2);
    h.run(100);
    assert_eq!(
        {
            let id = salted(&mut h, "a", &p, b"user-1");
            cached(&h, id)
        },
        0
    );
    h.run(100);
    assert_eq!(
        {
            let id = salted(&mut h, "a", &p, b"user-1");
            cached(&h, id)
        },
        32
    );
    assert_eq!(
        {
            let id = salted(&mut h, "a", &p, b"user-2");
            cached(&h, id)
        },
        0
    );
    h.run(100);
}

#[test]
fn eviction_takes_the_oldest_release_first_and_a_chain_tail_before_its_head() {
    // 12 pages. a's prompt fills 4 full blocks + 1 partial; so does b's, later.
    let mut h = harness(13, &[("a", None), ("z", None)]);
    let pa = prompt(33, 5);
    let pb = prompt(33, 6);
    h.submit("a", &pa, 1);
    h.run(50);
    h.submit("a", &pb, 1);
    h.run(50);
    let st = h.s.stats(h.now).pool;
    assert_eq!((st.cached, st.evictable, st.used), (8, 8, 0));
    // z (no hits: another tenant) needs 6 pages: 4 free, then 2 evicted: a's
    // first prompt, tail first.
    let z = h.submit("z", &prompt(41, 7), 7);
    h.run(50);
    assert!(h.finished.contains_key(&z));
    assert_eq!(h.s.stats(h.now).pool.evictions, 2);
    assert_eq!(hit(&mut h, "a", &pa, 1), 16, "head blocks 0, 1 survive");
    assert_eq!(hit(&mut h, "a", &pb, 1), 32, "the later release is intact");
    h.run(50);
}

#[test]
fn live_requests_share_pages_the_pool_counts_once_and_the_cap_counts_each_time() {
    // Each request: 40-token prompt + 8 = 6 blocks reserved, 4 of them shareable.
    let p = prompt(41, 8);
    let mut h = harness(17, &[("a", None)]); // 16 usable pages
    let a = h.submit("a", &p, 7);
    // Let a finish its prefill (and name its blocks) but keep decoding.
    while h.s.request(a).unwrap().num_computed < 40 {
        h.step();
    }
    let b = h.submit("a", &p, 7);
    assert_eq!(cached(&h, b), 40);
    let c = h.submit("a", &p, 7);
    assert_eq!(cached(&h, c), 40);
    // Reserved 18 > 16 pages, but 10 of them are 5 pages held 3 times: the pool
    // has promised 18 - 10 = 8.
    let st = h.s.stats(h.now);
    let t = &st.tenants[0];
    assert_eq!((t.reserved_blocks, t.shared_blocks), (18, 10));
    assert_eq!(st.pool.committed, 8);
    assert_eq!(st.pool.shared, 5);
    h.run(100);
    assert_eq!(h.finished[&a].output, h.finished[&b].output);
    assert_eq!(h.finished[&a].output, h.finished[&c].output);

    // A cap of 12 blocks admits two such requests, not three, shared or not.
    let mut capped = tenant("a", 0, Some(12));
    capped.prefix_namespace = None;
    h.s.update_tenant(capped, h.now).unwrap();
    let a = h.submit("a", &p, 7);
    while h.s.request(a).unwrap().num_computed < 40 {
        h.step();
    }
    h.submit("a", &p, 7);
    assert_eq!(
        reason(h.s.submit("a", &p, 7, h.now)),
        Some("tenant_budget"),
        "sharing never lifts a tenant past its cap"
    );
    h.run(100);
}

#[test]
fn without_sharing_the_same_requests_do_not_fit() {
    let p = prompt(41, 8);
    let mut c = cfg(17);
    c.prefix_caching = false;
    let mut h = Harness::new(c);
    h.tenant(TenantConfig::new("a"));
    h.submit("a", &p, 7);
    h.step();
    h.submit("a", &p, 7);
    assert_eq!(reason(h.s.submit("a", &p, 7, h.now)), Some("pool_full"));
    h.run(100);
    assert_eq!(h.s.stats(h.now).pool.cached, 0);
}

#[test]
fn a_referenced_page_is_never_evicted() {
    // a holds its 4 named pages (decoding); the rest of the pool is churned by z.
    let p = prompt(33, 9);
    let mut h = harness(13, &[("a", None), ("z", None)]);
    let a = h.submit("a", &p, 30);
    while h.s.request(a).unwrap().num_computed < 33 {
        h.step();
    }
    let held = h.s.request(a).unwrap().pages[..4].to_vec();
    for k in 0..6 {
        h.submit("z", &prompt(17, 20 + k), 2);
        for _ in 0..4 {
            h.step();
        }
        let now_held = &h.s.request(a).unwrap().pages[..4];
        assert_eq!(now_held, &held[..]);
    }
    h.run(200);
    assert!(h.s.stats(h.now).pool.evictions > 0, "z had to evict");
}

#[test]
fn cancelling_a_request_that_hit_the_cache_gives_its_pages_back_to_the_cache() {
    let p = prompt(40, 10);
    let mut h = harness(64, &[("a", None)]);
    h.submit("a", &p, 2);
    h.run(50);
    let before = h.s.stats(h.now).pool;
    let b = h.submit("a", &p, 2);
    assert_eq!(h.s.stats(h.now).pool.evictable, before.evictable - 4);
    h.s.cancel(b).unwrap();
    h.s.check_invariants().unwrap();
    let after = h.s.stats(h.now).pool;
    assert_eq!(
        (after.evictable, after.cached, after.used),
        (before.evictable, before.cached, 0)
    );
}

#[test]
fn removing_a_tenant_forgets_its_blocks() {
    let p = prompt(40, 11);
    let mut h = harness(64, &[("a", None)]);
    h.submit("a", &p, 2);
    h.run(50);
    assert_eq!(
        h.s.stats(h.now).pool.cached,
        5,
        "40 prompt + 1 generated token computed"
    );
    h.s.remove_tenant("a").unwrap();
    let st = h.s.stats(h.now).pool;
    assert_eq!((st.cached, st.free), (0, st.total));
    h.tenant(TenantConfig::new("a"));
    assert_eq!(
        hit(&mut h, "a", &p, 2),
        0,
        "a new tenant of that name starts cold"
    );
    h.run(50);
}

#[test]
fn overcommit_preemption_recomputes_only_what_the_cache_lost() {
    let mut c = cfg(13);
    c.admission = AdmissionMode::Overcommit {
        watermark_blocks: 1,
    };
    c.max_num_seqs = 2;
    let mut h = Harness::new(c);
    h.tenant(TenantConfig::new("a"));
    let a = h.submit("a", &prompt(40, 12), 40);
    let b = h.submit("a", &prompt(40, 13), 40);
    h.run(400);
    assert!(h.preempted > 0, "12 pages cannot hold 2 x 10");
    let m = tenant_stats(&h, "a").metrics;
    let recomputed = m.prefill_tokens - 80;
    // Every preemption of a sequence of up to 80 tokens would recompute it all
    // without the cache; with it, the evicted tail and the partial block.
    assert!(
        recomputed < 40 * h.preempted,
        "{recomputed} tokens recomputed over {} preemptions",
        h.preempted
    );
    for id in [a, b] {
        let f = &h.finished[&id];
        assert_eq!(f.output.len(), 40);
    }
}

/// Runs a workload of (arrival step, prompt length, prompt family, max_tokens)
/// for tenant "a"; a family's prompts are prefixes of each other. A request
/// refused for now is submitted again at the next step. Returns the request id
/// of each workload entry.
fn workload(h: &mut Harness, reqs: &[(usize, usize, i32, usize)]) -> Vec<u64> {
    let mut ids = vec![0u64; reqs.len()];
    let mut next = 0;
    for step in 0..3000 {
        while next < reqs.len() && reqs[next].0 <= step {
            let (_, n, fam, m) = reqs[next];
            match h.s.submit("a", &prompt(n, fam), m, h.now) {
                Ok(id) => ids[next] = id,
                Err(e) if e.reason().is_some() => break,
                Err(e) => panic!("{e}"),
            }
            next += 1;
        }
        if next == reqs.len() && h.s.live_requests() == 0 {
            return ids;
        }
        if h.step().is_none() {
            h.now += h.dt;
        }
    }
    panic!("workload did not finish");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Random prompts from a few shared prefixes, cached against uncached: every
    /// request generates the same tokens and runs exactly the same (position,
    /// token) stream past its cached prefix; the reserve-mode guarantee holds
    /// (the harness unwraps every step) and every invariant after every step.
    #[test]
    fn caching_changes_what_runs_never_what_comes_out(
        mut reqs in prop::collection::vec((0usize..60, 1usize..70, 0i32..3, 1usize..20), 1..25),
        pages in 20usize..60,
    ) {
        reqs.sort_by_key(|r| r.0);
        reqs.retain(|r| (r.1 + r.3).div_ceil(BS) <= pages && r.1 + r.3 <= 96);
        let run = |caching: bool| {
            let mut c = cfg(pages + 1);
            c.prefix_caching = caching;
            c.max_seq_len = 96;
            let mut h = Harness::new(c);
            h.tenant(TenantConfig::new("a"));
            let ids = workload(&mut h, &reqs);
            (h, ids)
        };
        let ((on, on_ids), (off, off_ids)) = (run(true), run(false));
        let mut hits = 0;
        for (i, (&a, &b)) in on_ids.iter().zip(&off_ids).enumerate() {
            let (fa, fb) = (&on.finished[&a], &off.finished[&b]);
            prop_assert_eq!(&fa.output, &fb.output, "request {}", i);
            prop_assert_eq!(fb.cached_tokens, 0);
            let skip = fa.cached_tokens as i32;
            hits += fa.cached_tokens;
            let want: Vec<(i32, i32)> =
                off.ran[&b].iter().copied().filter(|&(pos, _)| pos >= skip).collect();
            prop_assert_eq!(&on.ran[&a], &want, "request {}", i);
        }
        let st = on.s.stats(on.now);
        prop_assert_eq!(st.tenants[0].metrics.prefix_hit_tokens as usize, hits);
        prop_assert_eq!(st.pool.used, 0);
    }
}

// A regression: a tenant that left a shared namespace kept hitting and
// naming blocks in it through requests admitted before it left.
#[test]
fn a_namespace_change_waits_until_the_tenant_is_idle() {
    let mut h = harness(64, &[("a", Some("g")), ("b", Some("g"))]);
    let p = prompt(17, 2);
    let b = h.submit("b", &p, 2);
    let mut leave = TenantConfig::new("b");
    assert!(matches!(
        h.s.update_tenant(leave.clone(), h.now),
        Err(KvError::TenantInUse { .. })
    ));
    assert_eq!(
        h.s.tenants()
            .by_name("b")
            .unwrap()
            .config
            .prefix_namespace
            .as_deref(),
        Some("g")
    );
    h.run(50);
    assert!(h.finished.contains_key(&b));
    h.s.update_tenant(leave.clone(), h.now).unwrap();
    assert_eq!(
        hit(&mut h, "b", &p, 2),
        0,
        "b left the group: a's and its old blocks are not its own"
    );
    h.run(50);
    leave.prefix_namespace = Some("g".into());
    h.s.update_tenant(leave, h.now).unwrap();
    assert_eq!(hit(&mut h, "b", &p, 2), 16, "back in the group");
    h.run(50);
}

// A regression: over-committed, sharing found at entry lowered the pool's
// promise, a preemption raised it past the pool, and from then on every
// tenant update and every floor was refused. Sharing earns admission room in
// reserve mode only.
#[test]
fn overcommit_sharing_never_pushes_the_promise_past_the_pool() {
    let mut c = cfg(15); // 14 usable, 2 of them a floor
    c.admission = AdmissionMode::Overcommit {
        watermark_blocks: 0,
    };
    c.block_size = 4;
    c.max_num_seqs = 3;
    c.max_seq_len = 64;
    let mut h = Harness::new(c);
    h.tenant(TenantConfig::new("a"));
    h.tenant(tenant("zf", 2, None));
    let p = prompt(17, 3);
    let r1 = h.submit("a", &p, 24);
    while h.s.request(r1).unwrap().num_computed < 17 {
        h.step();
    }
    h.submit("a", &p, 24);
    h.step();
    // Without a sharing credit the pool's promise has room for no third one.
    assert_eq!(reason(h.s.submit("a", &p, 24, h.now)), Some("pool_full"));
    for _ in 0..40 {
        h.step();
        let st = h.s.stats(h.now);
        assert!(st.pool.committed <= st.pool.usable, "{:?}", st.pool);
        assert_eq!(st.tenants[0].shared_blocks, 0);
    }
    assert!(h.preempted > 0, "the pool was tight enough to preempt");
    // The floor still admits, and tenants can still be changed and added.
    assert!(h.s.submit("zf", &[1, 2, 3], 1, h.now).is_ok());
    let mut a = TenantConfig::new("a");
    a.weight = 2.0;
    h.s.update_tenant(a, h.now).unwrap();
    h.s.add_tenant(TenantConfig::new("z")).unwrap();
    h.run(500);
}
