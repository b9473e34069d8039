//! The scheduler's configuration: every knob, its defaults and checks, the
//! admission mode and the secret that keys prefix-cache block names.

use super::*;

/// Over-commit's default watermark: reserve the prompt plus one block of growth.
pub const DEFAULT_WATERMARK_BLOCKS: usize = 1;

/// How admission reserves memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdmissionMode {
    /// Reserve the final length: the engine can never run out of KV pages.
    Reserve,
    /// Reserve the prompt plus `watermark_blocks`; when pages run out, preempt
    /// the lowest-tier, most recently admitted sequence and recompute it later.
    /// A watermark past the final length reserves the final length (the sum
    /// saturates: any huge watermark means "reserve the final length").
    Overcommit { watermark_blocks: usize },
}

impl AdmissionMode {
    /// Blocks of growth admission reserves beyond the prompt; None: it
    /// reserves the final length (prompt + max_tokens).
    pub fn watermark_blocks(self) -> Option<usize> {
        match self {
            AdmissionMode::Reserve => None,
            AdmissionMode::Overcommit { watermark_blocks } => Some(watermark_blocks),
        }
    }

    /// Whether running out of pages preempts running sequences (over-commit).
    /// Reserved requests never run out: admission promised their pages.
    #[inline]
    pub fn preempts_for_pages(self) -> bool {
        matches!(self, AdmissionMode::Overcommit { .. })
    }
}

/// Whose allocations may evict a cached, unreferenced block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CachePartition {
    /// One LRU list: any allocation evicts the oldest evictable block of any
    /// tenant. Best hit rate; a tenant can time other tenants' allocations by
    /// probing which of its own blocks survived.
    #[default]
    Shared,
    /// One LRU list per tenant: a tenant's evictable blocks are evicted only
    /// by its own allocations, and it may keep at most its unused floor
    /// (kv_floor_blocks less what its live requests reserve) of them; blocks
    /// beyond that are freed as they are released. Reserve admission only.
    Tenant,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Pages in the pool, the null page included. Restart-only.
    pub num_blocks: usize,
    /// Tokens per page. Restart-only.
    pub block_size: usize,
    /// Most sequences in one step (the S dimension of a step plan).
    pub max_num_seqs: usize,
    /// Token budget of one step.
    pub max_batched_tokens: usize,
    /// Longest prompt + max_tokens a request may ask for.
    pub max_seq_len: usize,
    /// Share of the pool kept out of admission, for what the estimate missed.
    pub overhead_reserve: f64,
    /// Admitted requests that may wait beyond the `max_num_seqs` that run.
    /// The sum saturates: a huge value means "no limit but the pool".
    pub max_waiting: usize,
    /// Most prompt tokens one sequence gets in one step.
    pub long_prefill_chunk: usize,
    /// Token buckets; None: powers of two from 16 to max_batched_tokens.
    pub token_buckets: Option<Vec<usize>>,
    pub admission: AdmissionMode,
    /// A waiting request of a higher tier that finds no slot (or, over-committed,
    /// no pages) preempts the lowest-tier, most recently admitted running one.
    pub preempt_lower_tiers: bool,
    /// Re-read every plan in full after writing it (always on in debug builds).
    /// The cheap checks run on every plan regardless.
    pub full_validation: bool,
    /// Reuse the KV of full blocks already computed for the same prefix (in
    /// the same namespace). Restart-only.
    pub prefix_caching: bool,
    /// The secret that keys block names; None: random for this scheduler.
    /// Hosts that must name blocks alike configure the same one. Restart-only.
    pub prefix_cache_key: Option<SecretKey>,
    /// Whose allocations may evict a tenant's cached blocks. Restart-only.
    pub prefix_cache_partition: CachePartition,
    /// The degradation ladder (no rungs: never degrade). Live.
    pub ladder: LadderConfig,
    /// Start cold: refuse requests (`not_ready`) until the engine has warmed up
    /// and calls `mark_ready`. False: ready at once (no engine to wait for).
    pub require_warmup: bool,
    /// Seconds of `retry_after` given where nothing better is known: to refusals
    /// while not ready or draining, and to capacity refusals (pool_full,
    /// tenant_budget, concurrency) before a step rate has been measured. Live.
    pub retry_after_hint_s: f64,
    /// The model's vocabulary: token ids are 0..vocab_size. A prompt id outside
    /// it is refused at submit (`invalid`), a sampled one at commit, a restored
    /// one at restore. None: ids are only checked for being non-negative.
    /// Restart-only.
    pub vocab_size: Option<u32>,
    /// The model's KV-cache groups (see crate::groups): one page table per
    /// group per request; one full-attention group by default. Restart-only.
    pub kv_cache_groups: KvGroups,
}

/// A 128-bit secret that never shows in Debug output.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SecretKey(pub [u8; 16]);

impl std::fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretKey(<redacted>)")
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            num_blocks: 8192,
            block_size: 16,
            max_num_seqs: 256,
            max_batched_tokens: 2048,
            max_seq_len: 8192,
            overhead_reserve: 0.10,
            max_waiting: 0,
            long_prefill_chunk: 512,
            token_buckets: None,
            admission: AdmissionMode::Reserve,
            preempt_lower_tiers: false,
            full_validation: false,
            prefix_caching: true,
            prefix_cache_key: None,
            prefix_cache_partition: CachePartition::Shared,
            ladder: LadderConfig::off(),
            require_warmup: false,
            retry_after_hint_s: 1.0,
            vocab_size: None,
            kv_cache_groups: KvGroups::single(),
        }
    }
}

impl SchedulerConfig {
    pub fn validate(&self) -> KvResult<()> {
        let bad = |m: &str| Err(KvError::InvalidConfig(m.to_owned()));
        crate::page::validate_shape(self.num_blocks, self.block_size)?;
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be at least 1");
        }
        if self.max_batched_tokens < self.max_num_seqs {
            return bad(
                "max_batched_tokens must be at least max_num_seqs (every running \
                        sequence decodes one token per step)",
            );
        }
        if self.max_seq_len < 2 {
            return bad("max_seq_len must be at least 2 (one prompt token and one new token)");
        }
        if self.max_seq_len > i32::MAX as usize {
            return bad("max_seq_len must fit int32 positions");
        }
        if !(self.overhead_reserve.is_finite() && (0.0..1.0).contains(&self.overhead_reserve)) {
            return bad("overhead_reserve must be in [0, 1)");
        }
        if self.long_prefill_chunk == 0 {
            return bad("long_prefill_chunk must be at least 1");
        }
        if !(self.retry_after_hint_s.is_finite() && self.retry_after_hint_s >= 0.0) {
            return bad("retry_after_hint_s must be a non-negative number");
        }
        if self.vocab_size == Some(0) {
            return bad("vocab_size must be at least 1 (or None: ids not checked)");
        }
        if self.prefix_cache_partition == CachePartition::Tenant
            && self.admission.preempts_for_pages()
        {
            return bad(
                "prefix_cache_partition=\"tenant\" needs admission=\"reserve\" (over-committed, \
                 a tenant's page needs are not bounded by its reservations, so no per-tenant \
                 quota of cached blocks can be promised)",
            );
        }
        self.buckets()?;
        self.ladder.validate()?;
        Ok(())
    }

    /// Blocks kept back by the overhead reserve, of `total` allocatable pages.
    pub fn reserve_blocks(&self, total: usize) -> usize {
        (total as f64 * self.overhead_reserve).ceil() as usize
    }

    pub fn buckets(&self) -> KvResult<TokenBuckets> {
        match &self.token_buckets {
            None => Ok(TokenBuckets::powers_of_two(self.max_batched_tokens)),
            Some(list) => TokenBuckets::from_list(list.clone(), self.max_batched_tokens),
        }
    }

    /// Most tokens one step can ever hold: max_batched_tokens, and never more
    /// than the pool's slots (each token of a step writes its own KV slot, in
    /// a page its sequence holds alone; page 0 is never handed out).
    pub fn reachable_step_tokens(&self) -> usize {
        let slots = self
            .num_blocks
            .saturating_sub(1)
            .saturating_mul(self.block_size);
        self.max_batched_tokens.min(slots)
    }

    /// The buckets a step can be padded to: the configured ones up to the
    /// smallest that holds `reachable_step_tokens` (a larger one could never
    /// be used, so no buffer is sized for it); that last one, when it is
    /// larger than the pool's slots (num_blocks * block_size), becomes
    /// `reachable_step_tokens` itself (no buffer larger than the pool).
    pub fn plan_buckets(&self) -> KvResult<TokenBuckets> {
        let reachable = self.reachable_step_tokens();
        let buckets = self.buckets()?.truncated(reachable);
        let slots = self.num_blocks.saturating_mul(self.block_size);
        Ok(if buckets.largest() > slots {
            buckets.with_largest(reachable)
        } else {
            buckets
        })
    }

    /// The plan's dimensions, bounded by what this configuration can use: a
    /// row never holds more pages than the pool hands out (num_blocks - 1),
    /// no step runs more sequences than that either (each holds a page of
    /// its own), and the token buffers stop at the largest usable bucket.
    pub fn plan_shape(&self) -> KvResult<PlanShape> {
        let pages = self.num_blocks.saturating_sub(1);
        Ok(PlanShape {
            max_tokens: self.plan_buckets()?.largest(),
            max_seqs: self.max_num_seqs.min(pages),
            pages_per_seq: self.max_seq_len.div_ceil(self.block_size).min(pages),
            block_size: crate::page::BlockSize::new(self.block_size),
            pad_slot: (self.num_blocks * self.block_size) as i32,
            num_groups: self.kv_cache_groups.len(),
        })
    }
}
