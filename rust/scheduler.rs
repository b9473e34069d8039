//! Scheduler: owns the pool, the tenants and the live requests, and is the one
//! place that changes them together.
//!
//! The lifecycle of a request, as far as memory goes:
//! submit (admission reserves its final length) -> its KV grows page by page,
//! drawn lazily from the reservation -> finish or cancel releases pages and
//! reservation together.

use std::collections::HashMap;

use crate::admission::{self, Capacity};
use crate::error::{KvError, KvResult, RejectReason};
use crate::pool::BlockPool;
use crate::tenant::{TenantConfig, TenantId, Tenants};

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
    pub max_waiting: usize,
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
        }
    }
}

impl SchedulerConfig {
    pub fn validate(&self) -> KvResult<()> {
        let bad = |m: &str| Err(KvError::InvalidConfig(m.to_owned()));
        crate::pool::validate_shape(self.num_blocks, self.block_size)?;
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be at least 1");
        }
        if self.max_batched_tokens == 0 {
            return bad("max_batched_tokens must be at least 1");
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
        Ok(())
    }

    /// Blocks kept back by the overhead reserve, of `total` allocatable pages.
    pub fn reserve_blocks(&self, total: usize) -> usize {
        (total as f64 * self.overhead_reserve).ceil() as usize
    }
}

/// One admitted, unfinished request.
#[derive(Clone, Debug)]
pub struct Request {
    pub id: u64,
    pub tenant: TenantId,
    /// Prompt followed by the tokens generated so far.
    pub tokens: Vec<i32>,
    pub prompt_len: usize,
    pub max_tokens: usize,
    /// Blocks reserved for its whole life.
    pub reserved_blocks: usize,
    /// Pages holding its KV, in order.
    pub pages: Vec<u32>,
    /// Tokens whose KV is written (or about to be, in the current step).
    pub kv_len: usize,
    pub arrival: f64,
}

impl Request {
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

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
    /// Reservations plus other tenants' unused floors: what admission has promised.
    pub committed: usize,
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
    pub live_requests: u32,
    pub admitted: u64,
    pub finished: u64,
    pub cancelled: u64,
    /// Rejections by reason, in `RejectReason::ALL` order.
    pub rejected: [u64; RejectReason::COUNT],
    /// Tokens in the rate-limit bucket now (None without a rate limit).
    pub rate_tokens_available: Option<f64>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerStats {
    pub pool: PoolStats,
    /// Sorted by tenant name.
    pub tenants: Vec<TenantStats>,
    pub live_requests: usize,
    /// Rejections by reason since start, over all tenants (removed ones and
    /// unknown names included).
    pub rejected: [u64; RejectReason::COUNT],
}

pub struct Scheduler {
    config: SchedulerConfig,
    pool: BlockPool,
    tenants: Tenants,
    requests: HashMap<u64, Request>,
    next_id: u64,
    /// Rejections by reason over all tenants, removed ones and unknown names
    /// included: monotonic, as counters must be.
    rejected: [u64; RejectReason::COUNT],
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> KvResult<Self> {
        config.validate()?;
        let pool = BlockPool::new(config.num_blocks, config.block_size)?;
        Ok(Scheduler {
            config,
            pool,
            tenants: Tenants::default(),
            requests: HashMap::new(),
            next_id: 1,
            rejected: [0; RejectReason::COUNT],
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    pub fn request(&self, id: u64) -> KvResult<&Request> {
        self.requests.get(&id).ok_or(KvError::UnknownRequest(id))
    }

    /// Pool pages admission may promise: all but the overhead reserve.
    pub fn usable_blocks(&self) -> usize {
        let total = self.pool.total();
        total - self.config.reserve_blocks(total)
    }

    pub fn add_tenant(&mut self, config: TenantConfig) -> KvResult<()> {
        let usable = self.usable_blocks();
        self.tenants.add(config, usable).map(|_| ())
    }

    pub fn update_tenant(&mut self, config: TenantConfig, now: f64) -> KvResult<()> {
        let usable = self.usable_blocks();
        self.tenants.update(config, usable, now)
    }

    pub fn remove_tenant(&mut self, name: &str) -> KvResult<()> {
        self.tenants.remove(name)
    }

    /// Admit a request or say why not. A rejection changes nothing but the
    /// rejection counters.
    pub fn submit(
        &mut self,
        tenant: &str,
        prompt: &[i32],
        max_tokens: usize,
        now: f64,
    ) -> KvResult<u64> {
        let Some(tid) = self.tenants.id(tenant) else {
            self.rejected[RejectReason::UnknownTenant.index()] += 1;
            return Err(KvError::rejected(
                RejectReason::UnknownTenant,
                None,
                Some(tenant),
                format!("no tenant named {tenant:?}"),
            ));
        };
        let capacity = Capacity {
            block_size: self.config.block_size,
            max_seq_len: self.config.max_seq_len,
            usable_blocks: self.usable_blocks(),
            committed_blocks: self.tenants.committed(),
            live_requests: self.requests.len(),
            max_live_requests: self.config.max_num_seqs + self.config.max_waiting,
        };
        let decision = admission::decide(self.tenants.get(tid), &capacity, prompt, max_tokens, now);
        let admit = match decision {
            Ok(a) => a,
            Err(rejection) => {
                self.tenants.get_mut(tid).counters.rejected[rejection.reason.index()] += 1;
                self.rejected[rejection.reason.index()] += 1;
                return Err(KvError::Rejected(rejection));
            }
        };

        self.tenants.reserve(tid, admit.blocks);
        let t = self.tenants.get_mut(tid);
        if let Some(bucket) = t.bucket.as_mut() {
            bucket.take(admit.rate_cost, now);
        }
        t.live_requests += 1;
        t.counters.admitted += 1;

        let id = self.next_id;
        self.next_id += 1;
        let mut tokens = Vec::with_capacity(prompt.len() + max_tokens);
        tokens.extend_from_slice(prompt);
        self.requests.insert(
            id,
            Request {
                id,
                tenant: tid,
                tokens,
                prompt_len: prompt.len(),
                max_tokens,
                reserved_blocks: admit.blocks,
                pages: Vec::with_capacity(admit.blocks),
                kv_len: 0,
                arrival: now,
            },
        );
        Ok(id)
    }

    /// Grow a request's KV by `n` tokens, taking pages from its reservation as
    /// they are needed. Asking beyond the sequence's final length is the caller's
    /// error; failing to find a page within the reservation would be a kvsched bug.
    pub fn extend_kv(&mut self, id: u64, n: usize) -> KvResult<()> {
        let req = self
            .requests
            .get_mut(&id)
            .ok_or(KvError::UnknownRequest(id))?;
        let kv_len = req.kv_len + n;
        let final_len = req.prompt_len + req.max_tokens;
        if kv_len > final_len {
            return Err(KvError::InvalidRequest(format!(
                "request {id}: KV of {kv_len} tokens exceeds its final length {final_len}"
            )));
        }
        let need = self.pool.blocks_for(kv_len).saturating_sub(req.pages.len());
        if req.pages.len() + need > req.reserved_blocks {
            return Err(KvError::Internal(format!(
                "request {id} needs {} pages, reserved {}",
                req.pages.len() + need,
                req.reserved_blocks
            )));
        }
        if need > 0 {
            self.pool
                .allocate_into(need, &mut req.pages)
                .map_err(|e| KvError::Internal(format!("reserved page unavailable: {e}")))?;
            self.tenants.get_mut(req.tenant).used_blocks += need;
        }
        req.kv_len = kv_len;
        Ok(())
    }

    /// Append one generated token to a request's sequence.
    pub fn push_token(&mut self, id: u64, token: i32) -> KvResult<()> {
        let req = self
            .requests
            .get_mut(&id)
            .ok_or(KvError::UnknownRequest(id))?;
        if req.generated() >= req.max_tokens {
            return Err(KvError::InvalidRequest(format!(
                "request {id} already generated its max_tokens ({})",
                req.max_tokens
            )));
        }
        req.tokens.push(token);
        Ok(())
    }

    /// The request is done: release its pages and its reservation.
    pub fn finish(&mut self, id: u64) -> KvResult<Request> {
        let req = self.release(id)?;
        self.tenants.get_mut(req.tenant).counters.finished += 1;
        Ok(req)
    }

    /// Drop a request wherever it is; pages and reservation go back at once.
    pub fn cancel(&mut self, id: u64) -> KvResult<Request> {
        let req = self.release(id)?;
        self.tenants.get_mut(req.tenant).counters.cancelled += 1;
        Ok(req)
    }

    fn release(&mut self, id: u64) -> KvResult<Request> {
        let req = self
            .requests
            .remove(&id)
            .ok_or(KvError::UnknownRequest(id))?;
        self.pool
            .free(&req.pages)
            .map_err(|e| KvError::Internal(format!("request {id} held a bad page: {e}")))?;
        self.tenants.release(req.tenant, req.reserved_blocks);
        let t = self.tenants.get_mut(req.tenant);
        t.used_blocks -= req.pages.len();
        t.live_requests -= 1;
        Ok(req)
    }

    pub fn live_requests(&self) -> usize {
        self.requests.len()
    }

    pub fn stats(&self, now: f64) -> SchedulerStats {
        let total = self.pool.total();
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
                    live_requests: t.live_requests,
                    admitted: t.counters.admitted,
                    finished: t.counters.finished,
                    cancelled: t.counters.cancelled,
                    rejected: t.counters.rejected,
                    rate_tokens_available: t.bucket.as_ref().map(|b| b.level_at(now)),
                }
            })
            .collect();
        tenants.sort_by(|a, b| a.name.cmp(&b.name));
        SchedulerStats {
            pool: PoolStats {
                num_blocks: self.pool.num_blocks(),
                block_size: self.pool.block_size(),
                total,
                free: self.pool.free_count(),
                used: self.pool.used(),
                shared: self.pool.shared(),
                overhead_reserve: self.config.reserve_blocks(total),
                usable: self.usable_blocks(),
                reserved,
                committed: self.tenants.committed(),
            },
            tenants,
            live_requests: self.requests.len(),
            rejected: self.rejected,
        }
    }

    /// Every cross-structure invariant, for tests: pages conserved and owned once,
    /// usage within reservations, reservations within caps and within the usable
    /// pool, floors honoured.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        let n_tenants = self.tenants.iter().map(|(id, _)| id + 1).max().unwrap_or(0);
        let mut reserved = vec![0usize; n_tenants];
        let mut used = vec![0usize; n_tenants];
        let mut live = vec![0u32; n_tenants];
        let mut owner = vec![0u64; self.pool.num_blocks()];
        for req in self.requests.values() {
            if req.pages.len() > req.reserved_blocks {
                return Err(format!("request {} holds more pages than reserved", req.id));
            }
            if req.pages.len() != self.pool.blocks_for(req.kv_len) {
                return Err(format!(
                    "request {} pages do not match its KV length",
                    req.id
                ));
            }
            for &p in &req.pages {
                if owner[p as usize] != 0 {
                    return Err(format!(
                        "page {p} owned by {} and {}",
                        owner[p as usize], req.id
                    ));
                }
                owner[p as usize] = req.id;
            }
            reserved[req.tenant] += req.reserved_blocks;
            used[req.tenant] += req.pages.len();
            live[req.tenant] += 1;
        }
        let held: usize = used.iter().sum();
        if held != self.pool.used() {
            return Err(format!(
                "requests hold {held} pages, pool says {}",
                self.pool.used()
            ));
        }
        let usable = self.usable_blocks();
        let mut committed = 0;
        for (id, t) in self.tenants.iter() {
            let name = &t.config.name;
            if (t.reserved_blocks, t.used_blocks, t.live_requests)
                != (reserved[id], used[id], live[id])
            {
                return Err(format!(
                    "tenant {name:?} accounting differs from its requests"
                ));
            }
            committed += t.footprint();
        }
        if committed != self.tenants.committed() {
            return Err("committed blocks drifted".into());
        }
        if committed > usable {
            return Err(format!(
                "reservations and floors ({committed}) exceed the usable pool ({usable})"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
