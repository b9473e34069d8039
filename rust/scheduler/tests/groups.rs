//! KV-cache groups (crate::groups) through the scheduler: what a hybrid
//! request reserves, the pages a window group gives back as its window moves,
//! and prefix hits that every group can resume from. The harness reads every
//! group's KV back through its row, so a page given back too early, or a
//! table that points at another group's page, fails the step that made it.

use super::*;

fn hybrid(num_blocks: usize, block_size: usize, groups: &[&str]) -> SchedulerConfig {
    SchedulerConfig {
        kv_cache_groups: KvGroups::parse(groups).unwrap(),
        max_seq_len: 512,
        long_prefill_chunk: 16,
        ..config(num_blocks, block_size)
    }
}

/// Pages request `id` holds in extra group `g` (1-based), and where they start.
fn held(h: &Harness, id: u64, g: usize) -> (usize, usize) {
    let r = h.s.request(id).unwrap();
    let t = r.groups.as_ref().expect("hybrid");
    (
        t.tables[g - 1].len() - t.live_from[g - 1],
        t.live_from[g - 1],
    )
}

#[test]
fn a_hybrid_request_reserves_each_groups_bound() {
    // Block 4, chunk 16: a window of 8 holds at most ceil((8 + 16 - 2) / 4) + 1
    // = 7 pages, a chunk of 12 at most ceil((12 + 16 - 2) / 4) + 1 = 8.
    let mut h = Harness::new(hybrid(
        401,
        4,
        &["full", "sliding_window:8", "chunked_local:12"],
    ));
    h.tenant(tenant("a", 0, None));
    h.submit("a", &prompt(40, 1), 20);
    // 60 tokens: 15 pages in full, 7 and 8 in the other groups.
    assert_eq!(h.s.stats(h.now).pool.reserved, 15 + 7 + 8);
    // Shorter than the bounds, every group holds it all.
    h.submit("a", &prompt(5, 2), 3);
    assert_eq!(h.s.stats(h.now).pool.reserved, 30 + 3 * 2);
    h.run(200);
    assert_eq!(h.s.stats(h.now).pool.reserved, 0);
    assert_eq!(h.s.stats(h.now).pool.used, 0);
}

#[test]
fn window_pages_go_back_as_a_sequence_decodes() {
    let mut h = Harness::new(hybrid(401, 4, &["full", "sliding_window:8"]));
    h.tenant(tenant("a", 0, None));
    let id = h.submit("a", &prompt(10, 1), 90);
    let mut most = 0;
    let mut moved = 0;
    while h.s.live_requests() > 0 {
        h.step();
        if let Ok(r) = h.s.request(id) {
            let (n, from) = held(&h, id, 1);
            most = most.max(n);
            moved = moved.max(from);
            // Group 0 keeps everything from block 0.
            assert!(r.pages.len() >= r.num_computed / 4 && !r.pages.contains(&0));
        }
    }
    // A decode holds at most ceil((8 - 1) / 4) + 1 = 3 pages; the first chunk
    // (10 tokens) held 3 too.
    assert!(most <= 3, "held {most}");
    assert!(
        moved >= 20,
        "the window should have moved past block 20, got {moved}"
    );
    assert_eq!(h.s.stats(h.now).pool.used, 0);
}

#[test]
fn a_long_prompt_prefills_holding_only_the_window_and_the_chunk() {
    let mut h = Harness::new(hybrid(
        401,
        4,
        &["full", "sliding_window:8", "sliding_window:8"],
    ));
    h.tenant(tenant("a", 0, None));
    let id = h.submit("a", &prompt(300, 3), 4);
    let bound = AttentionKind::SlidingWindow(8).reserve(304, BlockSize::new(4), 16);
    assert_eq!(bound, 7);
    let mut steps = 0;
    while h.s.request(id).is_ok() {
        h.step();
        steps += 1;
        if h.s.request(id).is_ok() {
            for g in 1..=2 {
                assert!(held(&h, id, g).0 <= bound);
            }
            // Group 0's pages, plus at most the bound in each window group.
            assert!(h.s.stats(h.now).pool.used <= 304usize.div_ceil(4) + 2 * bound);
        }
    }
    // 300 prompt tokens in chunks of 16, then the decodes.
    assert!(steps >= 19);
}

#[test]
fn a_pool_admits_as_many_hybrid_requests_as_the_formula_says() {
    // 1 full and 3 window groups against the same model kept in full (4 full
    // groups): 64-token requests, block 4, chunk 16.
    let count = |groups: &[&str]| {
        let mut c = hybrid(1001, 4, groups);
        c.overhead_reserve = 0.0;
        c.max_waiting = 10_000;
        c.max_num_seqs = 8;
        let mut s = Scheduler::new(c).unwrap();
        s.add_tenant(TenantConfig::new("a")).unwrap();
        (0..10_000)
            .take_while(|&i| s.submit("a", &prompt(48, i), 16, 0.0).is_ok())
            .count()
    };
    let uniform = count(&["full", "full", "full", "full"]);
    let groups = count(&[
        "full",
        "sliding_window:8",
        "sliding_window:8",
        "sliding_window:8",
    ]);
    // 1000 pages: 16 x 4 = 64 a request kept in full, 16 + 3 x 7 = 37 hybrid.
    assert_eq!((uniform, groups), (1000 / 64, 1000 / 37));
}

#[test]
fn a_hybrid_prefix_hit_resumes_from_what_every_group_holds() {
    let mut h = Harness::new(hybrid(401, 4, &["full", "sliding_window:6"]));
    h.tenant(tenant("a", 0, None));
    let p = prompt(41, 5);
    h.submit("a", &p, 3);
    h.run(100);
    // Every block was named in both groups before the window left it, and
    // went back to the LRU: a second request hits the whole prompt but its
    // last token, and the harness reads its KV back in both groups.
    let id = h.submit("a", &p, 3);
    let r = h.s.request(id).unwrap();
    assert_eq!(r.cached_tokens, 40);
    // Group 1 holds only what a query at 40 reads: from 35, block 8.
    assert_eq!(held(&h, id, 1), (2, 8));
    h.run(100);
    assert_eq!(h.finished[&1].output, h.finished[&id].output);
}

#[test]
fn an_evicted_window_page_shortens_the_hit_and_never_corrupts_it() {
    let mut h = Harness::new(hybrid(41, 4, &["full", "sliding_window:6"]));
    h.tenant(tenant("a", 0, None));
    h.tenant(tenant("b", 0, None));
    let p = prompt(41, 5);
    h.submit("a", &p, 3);
    h.run(100);
    // 40 pages: a's blocks are cached (11 + 11 named, evictable). b takes
    // 26 + 7 of them, evicting the oldest cached pages first: group 1's early
    // blocks (released as the window moved), then its last ones.
    h.submit("b", &prompt(100, 9), 4);
    h.run(100);
    let id = h.submit("a", &p, 3);
    let hit = h.s.request(id).unwrap().cached_tokens;
    assert!(hit < 40, "a full hit survived the pressure: {hit}");
    h.run(200);
    // Whatever was hit, every group read the right KV (the harness checks),
    // and the tokens are the first run's.
    assert_eq!(h.finished[&1].output, h.finished[&id].output);
}

#[test]
fn a_chunk_raised_live_does_not_outgrow_a_reservation() {
    let mut h = Harness::new(hybrid(401, 4, &["full", "sliding_window:8"]));
    h.tenant(tenant("a", 0, None));
    let id = h.submit("a", &prompt(200, 2), 4);
    let reserved = h.s.stats(h.now).pool.reserved;
    let mut c = h.s.config().clone();
    c.long_prefill_chunk = 64;
    h.s.update_config(c).unwrap();
    // Runs in chunks of 16, as admitted (a chunk of 64 would need 19 pages of
    // window group 1, not 7): the harness checks the reservation every step.
    while h.s.request(id).is_ok() {
        assert_eq!(h.s.stats(h.now).pool.reserved, reserved);
        assert!(h.step().is_some());
    }
    assert!(h.outcomes.iter().all(|o| o.num_tokens <= 16));
}

#[test]
fn groups_are_restart_only_and_named_in_the_refusal() {
    let mut s = Scheduler::new(hybrid(101, 4, &["full", "sliding_window:8"])).unwrap();
    let mut c = s.config().clone();
    c.kv_cache_groups = KvGroups::single();
    assert!(matches!(
        s.update_config(c),
        Err(KvError::RestartRequired("kv_cache_groups"))
    ));
    assert!(s.plan_shape().num_groups == 2);
    let single = sched(101, 4);
    assert_eq!(single.plan_shape().num_groups, 1);
    assert!(OwnedPlanBuffers::new(single.plan_shape())
        .group_page_indices
        .is_empty());
}
