//! Tier 0 first under global limits: the lower-tier requests a higher tier's
//! request may displace when the live-request cap or the pool would refuse it
//! (see `Scheduler::displacement`), and the submit stage that ends them and
//! decides again (`admit_or_displace`).

use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::ops::ControlFlow;

use super::submit::{PrefixHits, Submission};
use super::{Place, Scheduler};
use crate::admission::{self, Admission, Capacity, Room};
use crate::error::{KvResult, RejectReason};
use crate::prefix::BlockKey;
use crate::tenant::TenantId;

impl Scheduler {
    /// Admission for `sub` (see `decide`), with displace-and-retry: refused
    /// for a global limit that lower tiers hold (the live-request cap, the
    /// pool) while `displace` allows it, the lower-tier requests whose ending
    /// is enough (`displacement`) end `Shed`, and the request is decided
    /// again against the room they left, its prefix looked up afresh from
    /// `root`. Any other refusal, or one that displacing cannot lift, is
    /// counted (`reject`) and returned.
    pub(super) fn admit_or_displace(
        &mut self,
        sub: &Submission<'_>,
        capacity: &Capacity,
        root: BlockKey,
        displace: bool,
        hits: &mut PrefixHits,
    ) -> KvResult<Admission> {
        let mut room = None;
        let rejection = match self.decide(sub, capacity, hits, &mut room) {
            Ok(admit) => return Ok(admit),
            Err(rejection) => rejection,
        };
        // A global limit (the live-request cap, the pool) that lower
        // tiers hold: displace some of them if that is enough.
        let limit = match (rejection.reason, room) {
            (RejectReason::Concurrency, Some(Room::Requests(_))) if displace => "concurrency",
            (RejectReason::PoolFull, Some(Room::Pool { .. })) if displace => "pool_full",
            _ => return Err(self.reject(Some(sub.tid), rejection)),
        };
        let Some(victims) =
            self.displacement(sub.tid, capacity, sub.prompt, sub.max_tokens, sub.now, root)
        else {
            return Err(self.reject(Some(sub.tid), rejection));
        };
        for slab in victims {
            self.end_displaced(slab, sub.tid, limit, sub.now);
        }
        let capacity = Capacity {
            committed_blocks: self.tenants.committed(),
            live_requests: self.requests.len(),
            ..*capacity
        };
        hits.reset(self.kv.chain(root));
        let again = self.decide(sub, &capacity, hits, &mut None);
        // `displacement` counts the room it frees conservatively.
        debug_assert!(again.is_ok(), "displacement fell short: {again:?}");
        again.map_err(|rejection| self.reject(Some(sub.tid), rejection))
    }

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
        // Per victim tenant: (reservation given back, pages referenced).
        let mut freed: HashMap<TenantId, (usize, usize)> = HashMap::new();
        let mut victims = Vec::new();
        // The prefix lookup, once, when the pool is consulted (other tenants'
        // endings do not change what the tenant's own requests share).
        let shared = std::cell::OnceCell::new();
        let shared_hits = || {
            *shared.get_or_init(|| {
                let (mut hits, mut chain) = (Vec::new(), self.kv.chain(root));
                let mut groups = self.kv.new_group_pages(self.config.long_prefill_chunk);
                self.kv
                    .lookup_at_submit(tid, prompt, &mut hits, &mut chain, &mut groups)
            })
        };
        let outcome = self.each_displaceable(tier, |slab| {
            let r = self.requests.get(slab);
            let e = freed.entry(r.tenant).or_default();
            e.0 += r.reserved_blocks;
            e.1 += r.held_pages();
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
                Ok(_) => ControlFlow::Break(true),
                Err(r)
                    if matches!(r.reason, RejectReason::Concurrency | RejectReason::PoolFull) =>
                {
                    ControlFlow::Continue(())
                }
                Err(_) => ControlFlow::Break(false),
            }
        });
        (outcome == Some(true)).then_some(victims)
    }

    /// Calls `visit` with each request a request of `tier` may displace, in
    /// displacement order, until it breaks (returning its value; None when the
    /// candidates ran out). The order: lowest tier (largest number) first;
    /// within a tier, the queued requests that never ran, newest first; then,
    /// with `preempt_lower_tiers`, the running and preempted ones, newest first.
    ///
    /// Lazily, because a submit usually needs one or two victims and the
    /// queues may hold tens of thousands (sorting them all cost about 7 ns a
    /// waiting request per displacing submit): a tenant's queue holds requests
    /// that never ran, in id order (check_invariants checks both), so each
    /// tier's never-run requests are a merge of its tenants' queues read from
    /// the back. The running and preempted ones of a tier are gathered and
    /// sorted only when a submit gets that far.
    pub(super) fn each_displaceable<B>(
        &self,
        tier: u32,
        mut visit: impl FnMut(usize) -> ControlFlow<B>,
    ) -> Option<B> {
        let mut lower: Vec<u32> = (self.tenants.iter())
            .map(|(_, t)| t.config.tier)
            .filter(|&t| t > tier)
            .collect();
        lower.sort_unstable_by(|a, b| b.cmp(a));
        lower.dedup();
        for v in lower {
            let queues: Vec<&VecDeque<usize>> = (self.tenants.iter())
                .filter(|(_, t)| t.config.tier == v)
                .map(|(_, t)| &t.waiting)
                .collect();
            // (id, queue, index) of each queue's newest request not yet visited.
            let newest = |k: usize, i: usize| (self.requests.get(queues[k][i]).id, k, i);
            let mut heads: BinaryHeap<(u64, usize, usize)> = (queues.iter().enumerate())
                .filter(|(_, q)| !q.is_empty())
                .map(|(k, q)| newest(k, q.len() - 1))
                .collect();
            while let Some((_, k, i)) = heads.pop() {
                if let ControlFlow::Break(b) = visit(queues[k][i]) {
                    return Some(b);
                }
                if i > 0 {
                    heads.push(newest(k, i - 1));
                }
            }
            if self.config.preempt_lower_tiers {
                let mut started: Vec<(u64, usize)> = (self.requests.iter())
                    .filter(|(_, r)| !matches!(r.place, Place::Queued))
                    .filter(|(_, r)| self.tenants.get(r.tenant).config.tier == v)
                    .map(|(slab, r)| (r.id, slab))
                    .collect();
                started.sort_unstable_by(|a, b| b.cmp(a));
                for (_, slab) in started {
                    if let ControlFlow::Break(b) = visit(slab) {
                        return Some(b);
                    }
                }
            }
        }
        None
    }

    /// The displacement order as it is defined, by sorting every candidate:
    /// what `each_displaceable` must visit, for check_invariants in tests.
    #[cfg(test)]
    pub(super) fn displaceable_by_sort(&self, tier: u32) -> Vec<usize> {
        use std::cmp::Reverse;
        let preempt = self.config.preempt_lower_tiers;
        let mut candidates: Vec<(Reverse<u32>, bool, Reverse<u64>, usize)> = Vec::new();
        for (slab, r) in self.requests.iter() {
            let t = self.tenants.get(r.tenant).config.tier;
            let started = r.first_scheduled.is_some();
            let queued = matches!(r.place, Place::Queued);
            if t > tier && (preempt || (queued && !started)) {
                candidates.push((Reverse(t), started, Reverse(r.id), slab));
            }
        }
        candidates.sort_unstable();
        candidates.into_iter().map(|c| c.3).collect()
    }
}
