//! Tier 0 first under global limits: the lower-tier requests a higher tier's
//! request may displace when the live-request cap or the pool would refuse it
//! (see `Scheduler::displacement`; the caller ends them with `end_displaced`).

use std::collections::HashMap;

use super::{Place, Scheduler};
use crate::admission::{self, Capacity};
use crate::error::RejectReason;
use crate::prefix::BlockKey;
use crate::tenant::TenantId;

impl Scheduler {
    /// The top (smallest) and lowest (largest) tier among the tenants.
    pub(super) fn tier_range(&self) -> (u32, u32) {
        let tiers = self.tenants.iter().map(|(_, t)| t.config.tier);
        tiers.fold((u32::MAX, 0), |(lo, hi), t| (lo.min(t), hi.max(t)))
    }

    /// The requests to end (`Shed`) so that a request of `tid`, refused for a
    /// global limit (the live-request cap or the pool), passes; None when
    /// ending every candidate would not be enough, or when something else
    /// would still refuse it. Nothing changes here: the caller ends them.
    ///
    /// Candidates are requests of lower tiers (larger numbers) that have not
    /// entered the running set (their tenant's queue) and, with
    /// `preempt_lower_tiers`, also running and preempted ones. Taken lowest
    /// tier first; within a tier, those that never ran first, newest first;
    /// just as many as needed. A tenant's own limits (its max_concurrent, its
    /// cap) are not displaced for: they bound that tenant alone.
    ///
    /// The room is counted conservatively: a victim's tenant gives back its
    /// reservation, less every page the victim referenced in case each was
    /// one its tenant counted as shared (a floor holds what it holds).
    pub(super) fn displacement(
        &self,
        tid: TenantId,
        capacity: &Capacity,
        prompt: &[i32],
        max_tokens: usize,
        now: f64,
        root: BlockKey,
    ) -> Option<Vec<usize>> {
        let tier = self.tenants.get(tid).config.tier;
        let preempt = self.config.preempt_lower_tiers;
        let mut candidates: Vec<(std::cmp::Reverse<u32>, bool, std::cmp::Reverse<u64>, usize)> =
            Vec::new();
        for (_, t) in self.tenants.iter().filter(|(_, t)| t.config.tier > tier) {
            let lower = std::cmp::Reverse(t.config.tier);
            for &slab in &t.waiting {
                let r = self.requests.get(slab);
                let started = r.first_scheduled.is_some();
                if preempt || !started {
                    candidates.push((lower, started, std::cmp::Reverse(r.id), slab));
                }
            }
        }
        if preempt {
            for (slab, r) in self.requests.iter() {
                let t = self.tenants.get(r.tenant);
                if t.config.tier > tier && !matches!(r.place, Place::Queued) {
                    let lower = std::cmp::Reverse(t.config.tier);
                    candidates.push((lower, true, std::cmp::Reverse(r.id), slab));
                }
            }
        }
        if candidates.is_empty() {
            return None;
        }
        candidates.sort_unstable();
        // Per victim tenant: (reservation given back, pages referenced).
        let mut freed: HashMap<TenantId, (usize, usize)> = HashMap::new();
        let mut victims = Vec::new();
        // The prefix lookup, once, when the pool is consulted (other tenants'
        // endings do not change what the tenant's own requests share).
        let shared = std::cell::OnceCell::new();
        let shared_hits = || {
            *shared.get_or_init(|| {
                let (mut hits, mut chain) = (Vec::new(), self.kv.chain(root));
                self.kv.lookup_at_submit(tid, prompt, &mut hits, &mut chain)
            })
        };
        for (_, _, _, slab) in candidates {
            let r = self.requests.get(slab);
            let e = freed.entry(r.tenant).or_default();
            e.0 += r.reserved_blocks;
            e.1 += r.pages.len();
            victims.push(slab);
            let released: usize = freed
                .iter()
                .map(|(&v, &(blocks, pages))| {
                    let t = self.tenants.get(v);
                    let after = (t.reserved_blocks - blocks)
                        .saturating_sub(t.shared_blocks.saturating_sub(pages))
                        .max(t.config.kv_floor_blocks);
                    t.footprint().saturating_sub(after)
                })
                .sum();
            let hypothetical = Capacity {
                committed_blocks: capacity.committed_blocks - released,
                live_requests: capacity.live_requests - victims.len(),
                ..*capacity
            };
            let decision = admission::decide(
                self.tenants.get(tid),
                &hypothetical,
                prompt,
                max_tokens,
                now,
                shared_hits,
                |_| None,
            );
            match decision {
                Ok(_) => return Some(victims),
                Err(r)
                    if matches!(r.reason, RejectReason::Concurrency | RejectReason::PoolFull) => {}
                Err(_) => return None,
            }
        }
        None
    }
}
