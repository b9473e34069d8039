//! Tenants: who may use how much of the machine.
//!
//! A tenant has a tier (0 = most important), a KV floor (blocks guaranteed to it:
//! never lent to other tenants' reservations), a KV cap (the most it may reserve
//! in a burst), a concurrency limit, a token-bucket rate limit on the tokens it
//! asks for (prompt + max_tokens) and a weight for fair share. Every field can be
//! changed live; the registry keeps per-tenant usage and counters.

use std::collections::{HashMap, VecDeque};

use crate::error::{KvError, KvResult, RejectReason};
use crate::metrics::TenantMetrics;

/// Longest tenant name accepted; names become metric labels.
pub const MAX_NAME_LEN: usize = 128;

/// The most pages any pool can have: slots (`page * block_size + offset`)
/// are int32 in the step plan (see `page::validate_shape`). A floor above it
/// could never be honoured, whatever the pool.
pub const MAX_POOL_BLOCKS: usize = i32::MAX as usize;

/// Slowest rate limit accepted, in tokens per second (one token in about 11.6
/// days): below it `retry_after` stops being a meaningful number of seconds.
pub const MIN_RATE_TOKENS_PER_S: f64 = 1e-6;

#[derive(Clone, Debug, PartialEq)]
pub struct TenantConfig {
    pub name: String,
    /// 0 is the most important tier.
    pub tier: u32,
    /// Blocks guaranteed to this tenant.
    pub kv_floor_blocks: usize,
    /// Most blocks this tenant may hold reserved at once; None: bounded by the pool.
    /// A cap above the usable pool acts as the pool (no wrap: admission's sums saturate).
    pub kv_cap_blocks: Option<usize>,
    /// Most live (admitted, unfinished) requests; None: no per-tenant limit. 0 pauses the tenant.
    pub max_concurrent: Option<u32>,
    /// Token-bucket refill rate, in requested tokens (prompt + max_tokens) per second.
    pub rate_tokens_per_s: Option<f64>,
    /// Token-bucket size; defaults to one second of `rate_tokens_per_s`.
    pub burst_tokens: Option<f64>,
    /// Share of service among tenants of one tier (used by the step planner).
    pub weight: f64,
    /// Largest step, in tokens, this tenant's sequences may be pulled into: while
    /// one of them runs, the step budget shrinks to this (prefill chunks of others
    /// wait), so its inter-token latency is not paid for by batch work.
    pub max_step_tokens: Option<usize>,
    /// Prefix-cache namespace shared with the tenants that name the same one
    /// (a trust group); None: the tenant's own, which no other tenant can hit.
    pub prefix_namespace: Option<String>,
}

impl TenantConfig {
    pub fn new(name: impl Into<String>) -> Self {
        TenantConfig {
            name: name.into(),
            tier: 0,
            kv_floor_blocks: 0,
            kv_cap_blocks: None,
            max_concurrent: None,
            rate_tokens_per_s: None,
            burst_tokens: None,
            weight: 1.0,
            max_step_tokens: None,
            prefix_namespace: None,
        }
    }

    /// Checks that need nothing but the config itself.
    pub fn validate(&self) -> KvResult<()> {
        let bad = |m: String| {
            Err(KvError::InvalidConfig(format!(
                "tenant {:?}: {m}",
                self.name
            )))
        };
        if self.name.is_empty() || self.name.len() > MAX_NAME_LEN {
            return bad(format!("name must be 1 to {MAX_NAME_LEN} bytes"));
        }
        if self.name.chars().any(|c| c.is_control()) {
            return bad("name must not contain control characters".into());
        }
        if self.kv_floor_blocks > MAX_POOL_BLOCKS {
            return bad(format!(
                "kv_floor_blocks ({}) exceeds {MAX_POOL_BLOCKS}, the most pages a pool can \
                 have (int32 slots): a floor larger than the pool cannot be honoured",
                self.kv_floor_blocks
            ));
        }
        if let Some(cap) = self.kv_cap_blocks {
            if self.kv_floor_blocks > cap {
                return bad(format!(
                    "kv_floor_blocks ({}) exceeds kv_cap_blocks ({cap})",
                    self.kv_floor_blocks
                ));
            }
        }
        if !(self.weight.is_finite() && self.weight > 0.0) {
            return bad(format!(
                "weight must be a positive number, got {}",
                self.weight
            ));
        }
        if let Some(ns) = &self.prefix_namespace {
            if ns.is_empty() || ns.len() > MAX_NAME_LEN || ns.chars().any(|c| c.is_control()) {
                return bad(format!(
                    "prefix_namespace must be 1 to {MAX_NAME_LEN} bytes without control characters"
                ));
            }
        }
        if self.max_step_tokens == Some(0) {
            return bad("max_step_tokens must be at least 1".into());
        }
        match (self.rate_tokens_per_s, self.burst_tokens) {
            (None, Some(_)) => return bad("burst_tokens needs rate_tokens_per_s".into()),
            (Some(rate), burst) => {
                if !(rate.is_finite() && rate >= MIN_RATE_TOKENS_PER_S) {
                    return bad(format!(
                        "rate_tokens_per_s must be a finite number of at least \
                         {MIN_RATE_TOKENS_PER_S}, got {rate}"
                    ));
                }
                if let Some(b) = burst {
                    if !(b.is_finite() && b >= 1.0) {
                        return bad(format!("burst_tokens must be at least 1, got {b}"));
                    }
                }
            }
            (None, None) => {}
        }
        Ok(())
    }

    fn bucket_size(&self) -> Option<(f64, f64)> {
        self.rate_tokens_per_s
            .map(|rate| (rate, self.burst_tokens.unwrap_or(rate.max(1.0))))
    }
}

/// A token bucket driven by caller-supplied time, so it is deterministic.
/// It starts full. Time that goes backwards refills nothing; when the caller's
/// clock is re-based (it went back by more than the scheduler tolerates as
/// jitter, see `Scheduler::accept_now`), `rebase` moves the last refill time
/// back with it, so a bucket never waits for a time that will not come.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    level: f64,
    last: Option<f64>,
}

/// Relative slack so that retrying exactly `retry_after` later succeeds despite rounding.
const BUCKET_EPS: f64 = 1e-9;

impl TokenBucket {
    pub fn new(rate: f64, burst: f64) -> Self {
        TokenBucket {
            rate,
            burst,
            level: burst,
            last: None,
        }
    }

    /// Tokens in the bucket at `now` (without changing it).
    pub fn level_at(&self, now: f64) -> f64 {
        match self.last {
            None => self.burst,
            Some(last) => (self.level + self.rate * (now - last).max(0.0)).min(self.burst),
        }
    }

    /// Ok if `cost` tokens are available at `now`; otherwise the seconds until they
    /// will be (None: never, the cost exceeds the bucket). Changes nothing.
    pub fn check(&self, cost: f64, now: f64) -> Result<(), Option<f64>> {
        if cost > self.burst * (1.0 + BUCKET_EPS) {
            return Err(None);
        }
        let level = self.level_at(now);
        if level + BUCKET_EPS * cost.max(1.0) >= cost {
            Ok(())
        } else {
            Err(Some((cost - level) / self.rate))
        }
    }

    /// Take `cost` tokens at `now` (after a successful `check`).
    pub fn take(&mut self, cost: f64, now: f64) {
        let level = self.level_at(now);
        self.level = (level - cost).max(0.0);
        self.last = Some(self.last.map_or(now, |last| last.max(now)));
    }

    /// The caller's clock was re-based at `now`: a last refill time in its
    /// future becomes `now` (the level is kept; refill resumes from `now`).
    pub fn rebase(&mut self, now: f64) {
        if let Some(last) = self.last {
            if last > now {
                self.last = Some(now);
            }
        }
    }

    /// New rate and size; the current level is kept, clipped to the new size.
    fn resize(&mut self, rate: f64, burst: f64, now: f64) {
        let level = self.level_at(now);
        self.rate = rate;
        self.burst = burst;
        self.level = level.min(burst);
        if self.last.is_some() {
            self.last = Some(self.last.map_or(now, |last| last.max(now)));
        }
    }
}

/// Per-tenant counters since the tenant was added.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TenantCounters {
    pub admitted: u64,
    pub rejected: [u64; RejectReason::COUNT],
    pub finished: u64,
    pub cancelled: u64,
}

#[derive(Clone, Debug)]
pub struct Tenant {
    pub config: TenantConfig,
    pub bucket: Option<TokenBucket>,
    /// Blocks reserved by its live requests (admission charges these).
    pub reserved_blocks: usize,
    /// Pages its live requests hold (at most `reserved_blocks` in reserve mode);
    /// a page two of its requests share counts twice.
    pub used_blocks: usize,
    /// References its requests hold beyond the first on pages of its own prefix
    /// namespace: pages its reservations count twice but the pool holds once.
    pub shared_blocks: usize,
    pub live_requests: u32,
    pub counters: TenantCounters,
    pub metrics: TenantMetrics,
    /// Admitted requests waiting to enter the running set, oldest first (slab ids).
    pub waiting: VecDeque<usize>,
    /// Its sequences in the running set.
    pub running: u32,
    /// Preempted requests of this tenant waiting in their tier's resume queue.
    pub resuming: u32,
    /// Virtual service: tokens served divided by weight (weighted fair share).
    pub vtime: f64,
}

impl Tenant {
    fn new(config: TenantConfig) -> Self {
        let bucket = config
            .bucket_size()
            .map(|(rate, burst)| TokenBucket::new(rate, burst));
        Tenant {
            config,
            bucket,
            reserved_blocks: 0,
            used_blocks: 0,
            shared_blocks: 0,
            live_requests: 0,
            counters: TenantCounters::default(),
            metrics: TenantMetrics::default(),
            waiting: VecDeque::new(),
            running: 0,
            resuming: 0,
            vtime: 0.0,
        }
    }

    /// The cap admission enforces; `pool_limit` when the tenant has none.
    pub fn cap(&self, pool_limit: usize) -> usize {
        self.config.kv_cap_blocks.unwrap_or(pool_limit)
    }

    /// Blocks this tenant takes from the shared pool's point of view: its
    /// reservations, less the pages its own requests share (held once), or its
    /// floor while the floor is larger (a floor is held for it).
    pub fn footprint(&self) -> usize {
        self.reserved_blocks
            .saturating_sub(self.shared_blocks)
            .max(self.config.kv_floor_blocks)
    }

    // -- usage ------------------------------------------------------------------
    // The scheduler changes a tenant's usage and counters through these, one
    // method per event, so each event is counted the same way everywhere.
    // (Reservations and shared pages change `committed` too: see `Tenants`.)

    /// A request of this tenant was refused for `reason`.
    pub fn count_rejection(&mut self, reason: RejectReason) {
        self.counters.rejected[reason.index()] += 1;
    }

    /// A request was admitted at `now`: `prompt_len` tokens in, `rate_cost`
    /// taken from its rate-limit bucket.
    pub fn admit(&mut self, prompt_len: usize, rate_cost: f64, now: f64) {
        if let Some(bucket) = self.bucket.as_mut() {
            bucket.take(rate_cost, now);
        }
        self.live_requests += 1;
        self.counters.admitted += 1;
        self.metrics.tokens_in += prompt_len as u64;
    }

    /// One prefix-cache lookup of a prompt of `prompt_len` tokens that found
    /// `hit_tokens` (whole blocks) cached. All but the last prompt token can hit.
    pub fn count_prefix_lookup(&mut self, prompt_len: usize, hit_tokens: usize, block_size: usize) {
        let m = &mut self.metrics;
        m.prefix_query_blocks += (prompt_len.saturating_sub(1) / block_size) as u64;
        m.prefix_hit_blocks += (hit_tokens / block_size) as u64;
        m.prefix_query_tokens += prompt_len as u64;
        m.prefix_hit_tokens += hit_tokens as u64;
    }

    /// Its requests took `pages` more page references.
    #[inline]
    pub fn hold_pages(&mut self, pages: usize) {
        self.used_blocks += pages;
    }

    /// Its requests gave back `pages` page references.
    #[inline]
    pub fn drop_pages(&mut self, pages: usize) {
        self.used_blocks -= pages;
    }

    /// One of its requests entered the running set; `queued_for`: seconds it
    /// waited, on its first entry only.
    pub fn start_running(&mut self, queued_for: Option<f64>) {
        self.running += 1;
        if let Some(q) = queued_for {
            self.metrics.queue_time.observe(q);
        }
    }

    /// One of its sequences left the running set.
    pub fn stop_running(&mut self) {
        self.running -= 1;
    }

    /// One of its running sequences was preempted into its tier's resume queue.
    pub fn preempted(&mut self) {
        self.metrics.preemptions += 1;
        self.resuming += 1;
    }

    /// One of its requests left a resume queue (to run again, or to end).
    pub fn left_resume_queue(&mut self) {
        self.resuming -= 1;
    }

    /// One of its requests ended (its pages go back through `drop_pages`, its
    /// reservation through `Tenants::release`).
    pub fn request_ended(&mut self) {
        self.live_requests -= 1;
    }

    /// How a request that ended is counted: finished (with its end-to-end
    /// latency `e2e_s`) or cancelled.
    pub fn count_end(&mut self, finished: bool, e2e_s: f64) {
        if finished {
            self.counters.finished += 1;
            self.metrics.e2e.observe(e2e_s);
        } else {
            self.counters.cancelled += 1;
        }
    }

    /// Prompt tokens one of its sequences computed in a step.
    #[inline]
    pub fn count_prefill(&mut self, tokens: usize) {
        self.metrics.prefill_tokens += tokens as u64;
    }

    /// A request's first token, `ttft` seconds after its arrival.
    #[inline]
    pub fn count_first_token(&mut self, ttft: f64) {
        self.metrics.ttft.observe(ttft);
        self.metrics.tokens_out += 1;
    }

    /// A later token, `gap` seconds after the request's previous one.
    #[inline]
    pub fn count_inter_token(&mut self, gap: f64) {
        self.metrics.inter_token.observe(gap);
        self.metrics.tokens_out += 1;
    }

    /// Weighted fair share: `tokens` served advance its virtual time by tokens / weight.
    #[inline]
    pub fn serve(&mut self, tokens: usize) {
        self.vtime += tokens as f64 / self.config.weight;
    }

    /// An idle tenant rejoins at `floor`, the lowest virtual time of its tier's
    /// active tenants (when there is one): a fair share from now on, no credit
    /// for the time it was idle.
    pub fn rejoin(&mut self, floor: f64) {
        if floor.is_finite() {
            self.vtime = self.vtime.max(floor);
        }
    }

    fn apply_config(&mut self, config: TenantConfig, now: f64) {
        self.bucket = match (config.bucket_size(), self.bucket.take()) {
            (None, _) => None,
            (Some((rate, burst)), None) => Some(TokenBucket::new(rate, burst)),
            (Some((rate, burst)), Some(mut b)) => {
                b.resize(rate, burst, now);
                Some(b)
            }
        };
        self.config = config;
    }
}

/// Index of a tenant in the registry; stable while the tenant exists.
pub type TenantId = usize;

/// The tenants, by name, in stable slots (a removed tenant's slot is reused).
#[derive(Clone, Debug, Default)]
pub struct Tenants {
    slots: Vec<Option<Tenant>>,
    by_name: HashMap<String, TenantId>,
    /// Sum of footprints, kept up to date by every change to reservations or floors.
    committed: usize,
}

impl Tenants {
    pub fn id(&self, name: &str) -> Option<TenantId> {
        self.by_name.get(name).copied()
    }

    pub fn get(&self, id: TenantId) -> &Tenant {
        self.slots[id].as_ref().expect("live tenant id")
    }

    /// The tenant `id`, if it is still there.
    pub fn try_get(&self, id: TenantId) -> Option<&Tenant> {
        self.slots.get(id)?.as_ref()
    }

    pub fn get_mut(&mut self, id: TenantId) -> &mut Tenant {
        self.slots[id].as_mut().expect("live tenant id")
    }

    /// Charge `blocks` of reservation to a tenant.
    pub fn reserve(&mut self, id: TenantId, blocks: usize) {
        let t = self.slots[id].as_mut().expect("live tenant id");
        let before = t.footprint();
        t.reserved_blocks += blocks;
        self.committed = self.committed - before + t.footprint();
    }

    /// The caller's clock was re-based at `now` (see `TokenBucket::rebase`).
    pub fn rebase_buckets(&mut self, now: f64) {
        for t in self.slots.iter_mut().flatten() {
            if let Some(b) = t.bucket.as_mut() {
                b.rebase(now);
            }
        }
    }

    /// Give back `blocks` of a tenant's reservation.
    pub fn release(&mut self, id: TenantId, blocks: usize) {
        let t = self.slots[id].as_mut().expect("live tenant id");
        let before = t.footprint();
        t.reserved_blocks -= blocks;
        self.committed = self.committed - before + t.footprint();
    }

    /// Its requests took (`gained`) or dropped references on pages of its own
    /// namespace that another of its requests holds.
    pub fn share(&mut self, id: TenantId, gained: usize, dropped: usize) {
        let t = self.slots[id].as_mut().expect("live tenant id");
        let before = t.footprint();
        t.shared_blocks = t.shared_blocks + gained - dropped;
        self.committed = self.committed - before + t.footprint();
    }

    pub fn by_name(&self, name: &str) -> KvResult<&Tenant> {
        self.id(name)
            .map(|id| self.get(id))
            .ok_or_else(|| KvError::UnknownTenant(name.to_owned()))
    }

    /// Live tenants in slot order (deterministic).
    pub fn iter(&self) -> impl Iterator<Item = (TenantId, &Tenant)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.as_ref().map(|t| (i, t)))
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Slots, live or free: an upper bound on every TenantId.
    pub fn slots_len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// Sum of footprints (reservations or floors) over all tenants: what the
    /// shared pool has promised away.
    pub fn committed(&self) -> usize {
        debug_assert_eq!(
            self.committed,
            self.iter().map(|(_, t)| t.footprint()).sum::<usize>()
        );
        self.committed
    }

    /// Add a tenant. `usable` is the pool less the overhead reserve: the floors
    /// together, and everything already reserved, must still fit it.
    pub fn add(&mut self, config: TenantConfig, usable: usize) -> KvResult<TenantId> {
        config.validate()?;
        if self.by_name.contains_key(&config.name) {
            return Err(KvError::TenantExists(config.name));
        }
        // Saturating: a sum past usize::MAX is past `usable` all the same.
        let committed = self.committed().saturating_add(config.kv_floor_blocks);
        if committed > usable {
            return Err(floors_do_not_fit(&config, committed, usable));
        }
        let id = match self.slots.iter().position(Option::is_none) {
            Some(free) => free,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        self.by_name.insert(config.name.clone(), id);
        self.slots[id] = Some(Tenant::new(config));
        self.committed = committed;
        Ok(id)
    }

    /// Replace a tenant's configuration live. A raised floor must be honourable
    /// now (with what other tenants already reserved); a lowered cap only limits
    /// new admissions.
    pub fn update(&mut self, config: TenantConfig, usable: usize, now: f64) -> KvResult<()> {
        config.validate()?;
        let id = self
            .id(&config.name)
            .ok_or_else(|| KvError::UnknownTenant(config.name.clone()))?;
        let tenant = self.get(id);
        let committed = (self.committed() - tenant.footprint()).saturating_add(
            tenant
                .reserved_blocks
                .saturating_sub(tenant.shared_blocks)
                .max(config.kv_floor_blocks),
        );
        if committed > usable {
            return Err(floors_do_not_fit(&config, committed, usable));
        }
        self.get_mut(id).apply_config(config, now);
        self.committed = committed;
        Ok(())
    }

    pub fn remove(&mut self, name: &str) -> KvResult<()> {
        let id = self
            .id(name)
            .ok_or_else(|| KvError::UnknownTenant(name.to_owned()))?;
        let live = self.get(id).live_requests;
        if live > 0 {
            return Err(KvError::TenantInUse {
                tenant: name.to_owned(),
                live_requests: live,
            });
        }
        self.committed -= self.get(id).footprint();
        self.by_name.remove(name);
        self.slots[id] = None;
        Ok(())
    }
}

fn floors_do_not_fit(config: &TenantConfig, committed: usize, usable: usize) -> KvError {
    KvError::InvalidConfig(format!(
        "tenant {:?}: floors and current reservations would need {committed} blocks, \
         the usable pool has {usable}",
        config.name
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_retry_after_is_exact() {
        let mut b = TokenBucket::new(100.0, 500.0);
        assert_eq!(b.check(500.0, 0.0), Ok(()));
        b.take(500.0, 0.0);
        let wait = b.check(300.0, 1.0).unwrap_err().unwrap();
        assert!((wait - 2.0).abs() < 1e-12, "{wait}");
        assert_eq!(b.check(300.0, 1.0 + wait), Ok(()));
        assert_eq!(b.check(501.0, 100.0), Err(None), "larger than the bucket");
    }

    #[test]
    fn bucket_ignores_time_going_backwards() {
        let mut b = TokenBucket::new(10.0, 10.0);
        b.take(10.0, 5.0);
        assert_eq!(b.level_at(4.0), 0.0);
        assert!((b.level_at(5.5) - 5.0).abs() < 1e-12);
    }

    #[test]
    fn config_validation() {
        let mut c = TenantConfig::new("a");
        c.kv_floor_blocks = 10;
        c.kv_cap_blocks = Some(5);
        assert!(c.validate().is_err());
        let mut c = TenantConfig::new("a");
        c.weight = 0.0;
        assert!(c.validate().is_err());
        let mut c = TenantConfig::new("a");
        c.burst_tokens = Some(5.0);
        assert!(c.validate().is_err());
        assert!(TenantConfig::new("").validate().is_err());
        assert!(TenantConfig::new("a\nb").validate().is_err());
    }

    #[test]
    fn floors_must_fit_and_raised_floors_must_be_honourable() {
        let mut ts = Tenants::default();
        let mut a = TenantConfig::new("a");
        a.kv_floor_blocks = 60;
        ts.add(a.clone(), 100).unwrap();
        let mut b = TenantConfig::new("b");
        b.kv_floor_blocks = 50;
        assert!(matches!(
            ts.add(b.clone(), 100),
            Err(KvError::InvalidConfig(_))
        ));
        b.kv_floor_blocks = 40;
        let bid = ts.add(b.clone(), 100).unwrap();
        // b reserves 40 (its floor); raising a's floor to 61 cannot be honoured.
        ts.reserve(bid, 40);
        a.kv_floor_blocks = 61;
        assert!(ts.update(a.clone(), 100, 0.0).is_err());
        assert_eq!(ts.by_name("a").unwrap().config.kv_floor_blocks, 60);
        ts.get_mut(bid).live_requests = 1;
        assert!(matches!(ts.remove("b"), Err(KvError::TenantInUse { .. })));
        ts.get_mut(bid).live_requests = 0;
        ts.release(bid, 40);
        assert_eq!(ts.committed(), 100);
        ts.remove("b").unwrap();
        assert_eq!(ts.committed(), 60);
        assert!(matches!(ts.remove("b"), Err(KvError::UnknownTenant(_))));
    }
}
