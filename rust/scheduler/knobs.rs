//! Live reconfiguration: the scheduler's knobs (what may change live and
//! what needs a restart), the running-set bounds the ladder sets, and the
//! tenant registry's add / update / remove.

use super::Scheduler;
use super::SchedulerConfig;
use crate::error::{KvError, KvResult};
use crate::tenant::TenantConfig;

impl Scheduler {
    // -- live knobs ---------------------------------------------------------------

    /// Change the configuration live, effective from the next step. Validated
    /// as a whole; on an error nothing changes.
    ///
    /// Restart-only (`RestartRequired` names the knob): num_blocks, block_size,
    /// token_buckets, admission, prefix_caching, prefix_cache_key,
    /// prefix_cache_partition, vocab_size, kv_cache_groups; and raising
    /// max_num_seqs, max_seq_len or max_batched_tokens past the plan shape the
    /// scheduler started with (the engine compiled for it). Lowering them is
    /// live: running sequences are not cut, new work obeys. overhead_reserve may
    /// not shrink the usable pool below what admission has already promised.
    pub fn update_config(&mut self, new: SchedulerConfig) -> KvResult<()> {
        new.validate()?;
        let old = &self.config;
        let restart = |knob: &'static str| Err(KvError::RestartRequired(knob));
        if new.num_blocks != old.num_blocks {
            return restart("num_blocks");
        }
        if new.block_size != old.block_size {
            return restart("block_size");
        }
        if new.token_buckets != old.token_buckets {
            return restart("token_buckets");
        }
        if new.admission != old.admission {
            return restart("admission");
        }
        if new.prefix_caching != old.prefix_caching {
            return restart("prefix_caching");
        }
        if new.prefix_cache_partition != old.prefix_cache_partition {
            return restart("prefix_cache_partition");
        }
        if new.vocab_size != old.vocab_size {
            return restart("vocab_size");
        }
        if new.kv_cache_groups != old.kv_cache_groups {
            return restart("kv_cache_groups");
        }
        if new.prefix_cache_key.is_some() && new.prefix_cache_key != old.prefix_cache_key {
            return restart("prefix_cache_key");
        }
        // Against the plan shape as bounded by the pool (`plan_shape`): a
        // value past what the pool can use needs no larger buffer.
        let shape = new.plan_shape()?;
        if shape.max_seqs > self.shape.max_seqs {
            return restart("max_num_seqs");
        }
        if shape.pages_per_seq > self.shape.pages_per_seq {
            return restart("max_seq_len");
        }
        if new.reachable_step_tokens() > self.buckets.largest() {
            return restart("max_batched_tokens");
        }
        let total = self.kv.pool().total();
        let usable = total - new.reserve_blocks(total);
        if self.tenants.committed() > usable {
            return Err(KvError::InvalidConfig(format!(
                "overhead_reserve {} leaves {usable} usable blocks, fewer than the {} \
                 already promised",
                new.overhead_reserve,
                self.tenants.committed()
            )));
        }
        let mut ladder = self.ladder.clone();
        ladder.reconfigure(new.ladder.clone())?;
        self.ladder = ladder;
        let key = self.config.prefix_cache_key;
        self.config = SchedulerConfig {
            prefix_cache_key: key,
            ..new
        };
        Ok(())
    }

    /// Most sequences that may run now: max_num_seqs, or less while a ladder
    /// rung says so.
    pub fn max_running(&self) -> usize {
        let cap = self.ladder.effects().max_running.unwrap_or(usize::MAX);
        self.config.max_num_seqs.min(self.shape.max_seqs).min(cap)
    }

    /// Most sequences running at once while a request of `tier` enters: the
    /// ladder's max_running rung binds the tiers below the top one (and every
    /// tier when all tenants share one); the top tier is bounded by
    /// max_num_seqs alone, so the rung gives the top tier the slots it takes
    /// from the others.
    pub fn max_running_for(&self, tier: u32) -> usize {
        if self.ladder.effects().max_running.is_none() {
            return self.config.max_num_seqs;
        }
        let (top, lowest) = self.tier_range();
        if top < lowest && tier == top {
            self.config.max_num_seqs
        } else {
            self.max_running()
        }
    }

    // -- tenants ----------------------------------------------------------------

    pub fn add_tenant(&mut self, config: TenantConfig) -> KvResult<()> {
        let usable = self.usable_blocks();
        self.tenants.add(config, usable).map(|_| ())
    }

    /// Replace a tenant's configuration live. Its prefix namespace may change
    /// only while it has no live request (`TenantInUse`): a request keeps the
    /// namespace it was admitted in, and must not go on naming blocks in a
    /// group the tenant has left. A new tier applies to its waiting requests
    /// at once (preempted ones move to the new tier's resume queue).
    pub fn update_tenant(&mut self, config: TenantConfig, now: f64) -> KvResult<()> {
        self.accept_now(now)?;
        let usable = self.usable_blocks();
        let Some(tid) = self.tenants.id(&config.name) else {
            return Err(KvError::UnknownTenant(config.name));
        };
        let old = self.tenants.get(tid);
        if old.config.prefix_namespace != config.prefix_namespace && old.live_requests > 0 {
            return Err(KvError::TenantInUse {
                tenant: config.name,
                live_requests: old.live_requests,
            });
        }
        let (old_tier, new_tier) = (old.config.tier, config.tier);
        self.tenants.update(config, usable, now)?;
        if old_tier != new_tier {
            self.refile_resuming(tid, new_tier);
        }
        // A lowered floor lowers its quota of cached blocks (partitioned).
        self.trim_cache(tid);
        Ok(())
    }

    /// Seconds until `tokens` fit in tenant `name`'s rate limit at `now`: 0.0
    /// when they fit now (or it has no rate limit), infinity when they never
    /// will (more than its burst). Changes nothing. For a caller about to spend
    /// work on a request before it can submit it (tokenizing a prompt).
    pub fn rate_wait(&self, name: &str, tokens: usize, now: f64) -> KvResult<f64> {
        let t = self.tenants.by_name(name)?;
        Ok(
            match t.bucket.as_ref().map(|b| b.check(tokens as f64, now)) {
                None | Some(Ok(())) => 0.0,
                Some(Err(Some(wait))) => wait,
                Some(Err(None)) => f64::INFINITY,
            },
        )
    }

    /// Take `tokens` from tenant `name`'s rate limit at `now` (down to empty,
    /// never below) for work a refused request cost: a prompt tokenized and
    /// then refused (too long for the context, say) is charged as if it had
    /// been admitted, so refusals are no cheaper a way to spend the server's
    /// time than requests. Nothing for a tenant without a rate limit.
    pub fn charge_rate(&mut self, name: &str, tokens: usize, now: f64) -> KvResult<()> {
        self.accept_now(now)?;
        let Some(tid) = self.tenants.id(name) else {
            return Err(KvError::UnknownTenant(name.to_string()));
        };
        if let Some(bucket) = self.tenants.get_mut(tid).bucket.as_mut() {
            bucket.take(tokens as f64, now);
        }
        Ok(())
    }

    /// Remove a tenant without live requests; its evictable prefix-cache pages
    /// are forgotten and freed, so a tenant added later under the same name
    /// starts cold.
    pub fn remove_tenant(&mut self, name: &str) -> KvResult<()> {
        let id = self.tenants.id(name);
        self.tenants.remove(name)?;
        if let Some(id) = id {
            self.kv.forget_tenant(id);
        }
        Ok(())
    }
}
