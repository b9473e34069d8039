//! What `stats()` reports: the pool, each tenant and the scheduler.

use super::*;

#[derive(Clone, Debug, PartialEq)]
pub struct PoolStats {
    pub num_blocks: usize,
    pub block_size: usize,
    /// Allocatable pages (all but the null page).
    pub total: usize,
    pub free: usize,
    pub used: usize,
    pub shared: usize,
    /// Pages kept out of admission by the overhead reserve.
    pub overhead_reserve: usize,
    /// `total` less the overhead reserve.
    pub usable: usize,
    /// Blocks reserved by live requests.
    pub reserved: usize,
    /// Reservations (pages a tenant's requests share counted once) plus unused
    /// floors: what admission has promised.
    pub committed: usize,
    /// Prefix cache: pages named (referenced or evictable).
    pub cached: usize,
    /// Cached pages nobody references: reusable, taken when no free page is left.
    pub evictable: usize,
    /// Cached pages taken back for reuse since start.
    pub evictions: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TenantStats {
    pub name: String,
    pub tier: u32,
    pub weight: f64,
    pub kv_floor_blocks: usize,
    pub kv_cap_blocks: Option<usize>,
    pub reserved_blocks: usize,
    pub used_blocks: usize,
    /// Pages its requests share among themselves (reserved twice, held once).
    pub shared_blocks: usize,
    pub live_requests: u32,
    pub waiting: usize,
    pub running: u32,
    pub admitted: u64,
    pub finished: u64,
    pub cancelled: u64,
    /// Rejections by reason, in `RejectReason::ALL` order.
    pub rejected: [u64; RejectReason::COUNT],
    /// Tokens in the rate-limit bucket now (None without a rate limit).
    pub rate_tokens_available: Option<f64>,
    pub metrics: TenantMetrics,
    pub vtime: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerStats {
    pub pool: PoolStats,
    /// Sorted by tenant name.
    pub tenants: Vec<TenantStats>,
    pub live_requests: usize,
    pub running: usize,
    pub waiting: usize,
    pub steps: u64,
    /// Seconds between consecutive step() calls: a long gap is a starved host.
    pub step_gap: Histogram,
    /// Rejections by reason since start, over all tenants (removed ones and
    /// unknown names included).
    pub rejected: [u64; RejectReason::COUNT],
    /// Preemptions since start, over all tenants.
    pub preemptions: u64,
    /// Requests ended `Shed` since start to make room for a higher tier
    /// (see `FinishReason::Shed`).
    pub displaced: u64,
}

impl Scheduler {
    // -- stats and invariants -----------------------------------------------------------

    pub fn stats(&self, now: f64) -> SchedulerStats {
        let total = self.kv.pool().total();
        let mut reserved = 0;
        let mut tenants: Vec<TenantStats> = self
            .tenants
            .iter()
            .map(|(_, t)| {
                reserved += t.reserved_blocks;
                TenantStats {
                    name: t.config.name.clone(),
                    tier: t.config.tier,
                    weight: t.config.weight,
                    kv_floor_blocks: t.config.kv_floor_blocks,
                    kv_cap_blocks: t.config.kv_cap_blocks,
                    reserved_blocks: t.reserved_blocks,
                    used_blocks: t.used_blocks,
                    shared_blocks: t.shared_blocks,
                    live_requests: t.live_requests,
                    waiting: t.waiting.len() + t.resuming as usize,
                    running: t.running,
                    admitted: t.counters.admitted,
                    finished: t.counters.finished,
                    cancelled: t.counters.cancelled,
                    rejected: t.counters.rejected,
                    rate_tokens_available: t.bucket.as_ref().map(|b| b.level_at(now)),
                    metrics: t.metrics.clone(),
                    vtime: t.vtime,
                }
            })
            .collect();
        tenants.sort_by(|a, b| a.name.cmp(&b.name));
        SchedulerStats {
            pool: PoolStats {
                num_blocks: self.kv.pool().num_blocks(),
                block_size: self.kv.pool().block_size(),
                total,
                free: self.kv.pool().free_count(),
                used: self.kv.pool().used(),
                cached: self.kv.pool().cache().cached(),
                evictable: self.kv.pool().cache().evictable(),
                evictions: self.kv.pool().cache().evictions(),
                shared: self.kv.pool().shared(),
                overhead_reserve: self.config.reserve_blocks(total),
                usable: self.usable_blocks(),
                reserved,
                committed: self.tenants.committed(),
            },
            tenants,
            live_requests: self.live_requests(),
            running: self.running.len(),
            waiting: self.requests.len() - self.running.len(),
            steps: self.steps,
            step_gap: self.step_gap.clone(),
            rejected: self.rejected,
            preemptions: self.preemptions,
            displaced: self.displaced,
        }
    }
}
