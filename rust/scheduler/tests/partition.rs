//! The prefix cache partitioned by tenant (`CachePartition::Tenant`): the
//! eviction probe (what one tenant's cache hits reveal of another's prompts)
//! and the knob's rules.
//!
//! The probe: tenant b caches a 40-block prompt, then tenant a either repeats
//! an earlier prompt of its own (a cache hit: it takes almost no page) or
//! sends a new, larger one; then b sends its prompt again and counts its
//! cache hits. With one LRU list for everyone a's new prompt evicts b's
//! oldest blocks, so b learns what a did; partitioned, a's allocations never
//! touch b's blocks and b sees the same thing either way.

use super::*;

const BS: usize = 4;
/// Blocks b primes and probes.
const PROBE_BLOCKS: usize = 40;

fn cfg(partition: CachePartition) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks: 101, // 100 usable pages, no overhead reserve
        block_size: BS,
        max_num_seqs: 4,
        max_batched_tokens: 64,
        max_seq_len: 256,
        overhead_reserve: 0.0,
        max_waiting: 8,
        long_prefill_chunk: 64,
        prefix_cache_partition: partition,
        ..SchedulerConfig::default()
    }
}

/// A prompt of `blocks` full blocks and one more token (all but the last
/// token of a prompt can hit), distinct per `seed`.
fn blocks_prompt(blocks: usize, seed: i32) -> Vec<i32> {
    (0..(blocks * BS + 1) as i32)
        .map(|i| 1 + (i * 7 + seed * 131) % 1000)
        .collect()
}

/// What b can see of its probe: the blocks that survived (its cache hits),
/// the request's cached_tokens and generated tokens, and its own tenant
/// stats (hit counters, prefill tokens, latencies, usage).
#[derive(Debug, PartialEq)]
struct ProbeView {
    survived: usize,
    cached_tokens: usize,
    output: Vec<i32>,
    stats: TenantStats,
}

/// Runs the probe; `a_repeats`: a sends its earlier prompt again, else a new
/// prompt. Also returns the pool's gauges after the probe.
fn probe(partition: CachePartition, a_repeats: bool) -> (ProbeView, PoolStats) {
    let mut h = Harness::new(cfg(partition));
    // Floors: a partitioned tenant keeps cached blocks in its unused floor;
    // b's covers its 41-block prompt (40 full blocks and a partial one).
    h.tenant(tenant("a", 59, None));
    h.tenant(tenant("b", 41, None));
    let pb = blocks_prompt(PROBE_BLOCKS, 1);
    let pa = blocks_prompt(20, 2);
    h.submit("b", &pb, 1);
    h.run(200);
    h.submit("a", &pa, 1);
    h.run(200);
    if a_repeats {
        h.submit("a", &pa, 1);
    } else {
        h.submit("a", &blocks_prompt(58, 3), 1);
    }
    h.run(200);
    let id = h.submit("b", &pb, 1);
    let r = h.s.request(id).unwrap();
    let (survived, cached_tokens) = (r.num_computed / BS, r.cached_tokens);
    h.run(200);
    let output = h.finished[&id].output.clone();
    let st = h.s.stats(h.now);
    let stats = st.tenants.into_iter().find(|t| t.name == "b").unwrap();
    h.s.check_invariants().unwrap();
    let view = ProbeView {
        survived,
        cached_tokens,
        output,
        stats,
    };
    (view, st.pool)
}

#[test]
fn shared_lru_lets_a_tenant_see_another_tenants_allocations_by_probing_its_own_blocks() {
    let (repeat, _) = probe(CachePartition::Shared, true);
    let (new, _) = probe(CachePartition::Shared, false);
    assert_eq!(
        repeat.survived, PROBE_BLOCKS,
        "a's cache hit takes nothing of b's"
    );
    // a's new prompt needs 59 pages: the 40 free ones, then the 19 oldest
    // evictable ones, b's tail (released last to first).
    assert_eq!(new.survived, 21, "a's new prompt evicts b's oldest blocks");
    assert_ne!(repeat, new, "the channel exists");
}

#[test]
fn partitioned_cache_shows_the_prober_the_same_whatever_the_other_tenant_did() {
    let (repeat, pool_repeat) = probe(CachePartition::Tenant, true);
    let (new, pool_new) = probe(CachePartition::Tenant, false);
    assert_eq!(repeat.survived, PROBE_BLOCKS);
    assert_eq!(repeat.cached_tokens, PROBE_BLOCKS * BS);
    // Survival, cached_tokens, output, hit counters, prefill tokens,
    // latencies, usage: everything b can read of itself is identical.
    assert_eq!(repeat, new);
    // What remains visible is pool-wide: a keeps its new prompt's blocks
    // cached (within its floor), so the pool gauges differ. They are the
    // operator's, not a tenant's.
    assert_ne!(pool_repeat.evictable, pool_new.evictable);
}

#[test]
fn a_partitioned_tenant_keeps_at_most_its_unused_floor_cached() {
    let mut h = Harness::new(cfg(CachePartition::Tenant));
    h.tenant(tenant("a", 10, None));
    h.tenant(tenant("z", 0, None));
    // 16 full blocks released: only the 10 newest (the prompt's head: a
    // request releases last to first) stay cached.
    let p = blocks_prompt(16, 5);
    h.submit("a", &p, 1);
    h.run(100);
    let pool = h.s.kv.pool();
    assert_eq!(pool.cache().parked_by(0), 10);
    assert_eq!(pool.cache().evictable(), 10);
    assert_eq!(
        hit(&mut h, "a", &p, 1),
        10 * BS,
        "the head of the chain survives"
    );
    h.run(100);
    // A tenant without a floor keeps nothing once its requests end.
    h.submit("z", &blocks_prompt(8, 6), 1);
    h.run(100);
    assert_eq!(h.s.kv.pool().cache().parked_by(1), 0);
    // A live request's reservation comes out of the same floor: admitting a
    // 9-block request leaves room for 1 cached block.
    let id = h.submit("a", &blocks_prompt(8, 7), 1);
    assert_eq!(h.s.request(id).unwrap().reserved_blocks, 9);
    assert_eq!(h.s.kv.pool().cache().parked_by(0), 1);
    h.run(100);
    // Lowering the floor live lowers the quota at once.
    h.s.update_tenant(tenant("a", 3, None), h.now).unwrap();
    assert_eq!(h.s.kv.pool().cache().parked_by(0), 3);
    // Removing the tenant frees what it kept.
    h.s.remove_tenant("a").unwrap();
    assert_eq!(h.s.kv.pool().cache().evictable(), 0);
    h.s.check_invariants().unwrap();
}

fn hit(h: &mut Harness, tenant: &str, p: &[i32], max_tokens: usize) -> usize {
    let id = h.submit(tenant, p, max_tokens);
    h.s.request(id).unwrap().num_computed
}

#[test]
fn partition_needs_reserve_admission_and_a_restart_to_change() {
    let mut c = cfg(CachePartition::Tenant);
    c.admission = AdmissionMode::Overcommit {
        watermark_blocks: 1,
    };
    let Err(err) = Scheduler::new(c) else {
        panic!("partition with over-commit accepted")
    };
    assert!(
        matches!(&err, KvError::InvalidConfig(m) if m.contains("prefix_cache_partition")),
        "{err}"
    );
    let mut s = Scheduler::new(cfg(CachePartition::Shared)).unwrap();
    let before = s.config().clone();
    let err = s.update_config(cfg(CachePartition::Tenant)).unwrap_err();
    assert_eq!(err, KvError::RestartRequired("prefix_cache_partition"));
    assert_eq!(s.config(), &before);
    // Without caching there is nothing to partition: accepted, inert.
    let mut c = cfg(CachePartition::Tenant);
    c.prefix_caching = false;
    let mut h = Harness::new(c);
    h.tenant(tenant("a", 10, None));
    h.submit("a", &blocks_prompt(4, 1), 1);
    h.run(50);
    assert_eq!(h.s.kv.pool().cache().evictable(), 0);
}
