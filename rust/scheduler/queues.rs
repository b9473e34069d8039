//! Where admitted requests wait and run: the running set (`RunningSet`), the
//! per-tier resume queues of preempted requests (`ResumeQueues`) and, on the
//! scheduler, the one order in which waiting requests enter: `peek_waiting`,
//! `pop_waiting`, `remove_waiting`, and `victim` for preemption.
//!
//! The per-tenant waiting queues stay on `Tenant::waiting` (the tenant
//! registry reports and reconfigures them); the functions here are the only
//! ones that push, pop or remove there, apart from `submit` appending a new
//! request.
//!
//! Every structure here holds request slots (see `RequestTable`); a request's
//! `Place` says which one holds it, and the functions here keep the two in step.

use super::*;

/// The running set in plan order: `num_decode` decode sequences, then those
/// still in prefill, in the order they entered.
///
/// Its interface is kept narrow (positions in, slots out, a callback for every
/// sequence that moves) so that what it stores per running sequence can change
/// without touching its callers.
#[derive(Clone, Debug, Default)]
pub(super) struct RunningSet {
    slots: Vec<usize>,
    num_decode: usize,
}

impl RunningSet {
    #[inline]
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    #[inline]
    pub(super) fn num_decode(&self) -> usize {
        self.num_decode
    }

    /// Every running slot, in plan order.
    #[inline]
    pub(super) fn slots(&self) -> &[usize] {
        &self.slots
    }

    /// The slot at plan position `pos`.
    #[inline]
    pub(super) fn at(&self, pos: usize) -> usize {
        self.slots[pos]
    }

    /// Append a sequence that starts in prefill; returns its position.
    pub(super) fn push(&mut self, slot: usize) -> usize {
        self.slots.push(slot);
        self.slots.len() - 1
    }

    /// Take the sequence at `pos` out. Decodes fill a hole by swapping (their
    /// order does not matter); prefills keep their entry order. `moved(slot,
    /// pos)` is called for every remaining sequence whose position changed.
    pub(super) fn remove(&mut self, pos: usize, mut moved: impl FnMut(usize, usize)) -> usize {
        let slot = self.slots[pos];
        let from = if pos < self.num_decode {
            let last = self.num_decode - 1;
            self.slots.swap(pos, last);
            if pos != last {
                moved(self.slots[pos], pos);
            }
            self.num_decode -= 1;
            last
        } else {
            pos
        };
        self.slots.remove(from);
        for (p, &s) in self.slots.iter().enumerate().skip(from) {
            moved(s, p);
        }
        slot
    }

    /// The prefill at `pos` sampled its first token: it becomes the last decode.
    /// `moved(slot, pos)` is called for every sequence whose position changed.
    pub(super) fn promote(&mut self, pos: usize, mut moved: impl FnMut(usize, usize)) {
        debug_assert!(pos >= self.num_decode);
        let slot = self.slots.remove(pos);
        self.slots.insert(self.num_decode, slot);
        self.num_decode += 1;
        for p in self.num_decode - 1..=pos {
            moved(self.slots[p], p);
        }
    }
}

/// Preempted requests, per tier, in admission order: served before the tier's
/// tenant queues, so they keep their place at the head.
#[derive(Clone, Debug, Default)]
pub(super) struct ResumeQueues {
    by_tier: BTreeMap<u32, VecDeque<usize>>,
}

impl ResumeQueues {
    /// Queue `slot` in `tier`'s queue in admission order (request ids grow
    /// with admission; `id_of` gives a slot's request id).
    pub(super) fn insert(&mut self, tier: u32, slot: usize, id_of: impl Fn(usize) -> u64) {
        let queue = self.by_tier.entry(tier).or_default();
        let id = id_of(slot);
        let at = queue.partition_point(|&s| id_of(s) < id);
        queue.insert(at, slot);
    }

    /// The head of the best (lowest) tier's queue.
    pub(super) fn first(&self) -> Option<(u32, usize)> {
        self.by_tier.iter().next().map(|(&tier, q)| (tier, q[0]))
    }

    /// The head of every tier's queue.
    pub(super) fn heads(&self) -> impl Iterator<Item = usize> + '_ {
        self.by_tier.values().filter_map(|q| q.front().copied())
    }

    pub(super) fn pop(&mut self, tier: u32) -> Option<usize> {
        let q = self.by_tier.get_mut(&tier)?;
        let popped = q.pop_front();
        if q.is_empty() {
            self.by_tier.remove(&tier);
        }
        popped
    }

    pub(super) fn remove(&mut self, tier: u32, slot: usize) {
        let queue = self
            .by_tier
            .get_mut(&tier)
            .expect("resume queue of its tier");
        let i = queue.iter().position(|&s| s == slot).expect("queued");
        queue.remove(i);
        if queue.is_empty() {
            self.by_tier.remove(&tier);
        }
    }

    /// Take out every slot `pick` selects, in tier then queue order.
    pub(super) fn take_where(&mut self, mut pick: impl FnMut(usize) -> bool) -> Vec<usize> {
        let mut taken = Vec::new();
        for q in self.by_tier.values_mut() {
            q.retain(|&s| {
                let mine = pick(s);
                if mine {
                    taken.push(s);
                }
                !mine
            });
        }
        self.by_tier.retain(|_, q| !q.is_empty());
        taken
    }

    pub(super) fn contains(&self, tier: u32, slot: usize) -> bool {
        self.by_tier.get(&tier).is_some_and(|q| q.contains(&slot))
    }

    /// Requests in all the resume queues.
    pub(super) fn len(&self) -> usize {
        self.by_tier.values().map(VecDeque::len).sum()
    }
}

/// Where the next request to enter the running set comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum WaitFrom {
    Tenant(TenantId),
    Resume(u32),
}

impl Scheduler {
    /// The next request to enter the running set, and where it waits: the
    /// best tier first; within a tier, preempted requests (resume queue) before
    /// new ones, and among the tenants the lowest virtual time (weighted fair
    /// share), then the lowest tenant slot.
    pub(super) fn peek_waiting(&self) -> Option<(usize, WaitFrom)> {
        let best_tenant = self
            .tenants
            .iter()
            .filter(|(_, t)| !t.waiting.is_empty())
            .min_by(|(ia, a), (ib, b)| {
                (a.config.tier, a.vtime, *ia)
                    .partial_cmp(&(b.config.tier, b.vtime, *ib))
                    .expect("virtual times are finite")
            })
            .map(|(id, t)| (t.config.tier, id));
        match (self.resume.first(), best_tenant) {
            (Some((rt, slab)), Some((tt, _))) if rt <= tt => Some((slab, WaitFrom::Resume(rt))),
            (Some((rt, slab)), None) => Some((slab, WaitFrom::Resume(rt))),
            (_, Some((_, tid))) => Some((self.tenants.get(tid).waiting[0], WaitFrom::Tenant(tid))),
            (None, None) => None,
        }
    }

    /// Take `slab`, which `peek_waiting` returned with `from`, off its queue.
    pub(super) fn pop_waiting(&mut self, slab: usize, from: WaitFrom) {
        match from {
            WaitFrom::Tenant(tid) => {
                let popped = self.tenants.get_mut(tid).waiting.pop_front();
                debug_assert_eq!(popped, Some(slab));
            }
            WaitFrom::Resume(tier) => {
                let popped = self.resume.pop(tier);
                debug_assert_eq!(popped, Some(slab));
                let tid = self.requests.get(slab).tenant;
                self.tenants.get_mut(tid).left_resume_queue();
            }
        }
    }

    /// Take a waiting request off whichever queue holds it.
    pub(super) fn remove_waiting(&mut self, slab: usize) {
        let r = self.requests.get(slab);
        let (tid, place) = (r.tenant, r.place);
        match place {
            Place::Queued => {
                let t = self.tenants.get_mut(tid);
                let i = t.waiting.iter().position(|&s| s == slab).expect("queued");
                t.waiting.remove(i);
            }
            Place::Resuming(tier) => {
                self.resume.remove(tier, slab);
                self.tenants.get_mut(tid).left_resume_queue();
            }
            Place::Running(_) => unreachable!("not waiting"),
        }
    }

    /// Queue preempted request `slab` at the head of `tier`, in admission order.
    pub(super) fn queue_resuming(&mut self, slab: usize, tier: u32) {
        self.requests.get_mut(slab).place = Place::Resuming(tier);
        let requests = &self.requests;
        self.resume.insert(tier, slab, |s| requests.get(s).id);
    }

    /// Move `tid`'s preempted requests to the resume queue of `tier`, in
    /// admission order: the queue a request waits in is always its tier's, so
    /// priority preemption and entry agree on who goes first.
    pub(super) fn refile_resuming(&mut self, tid: TenantId, tier: u32) {
        let requests = &self.requests;
        let moved = self.resume.take_where(|s| requests.get(s).tenant == tid);
        for s in moved {
            self.queue_resuming(s, tier);
        }
    }

    /// Whether a new request of tenant `tid` would have to wait for a slot:
    /// the sequences it cannot pass (running ones of its tier or above, or all
    /// of them without priority preemption) and the requests waiting ahead of
    /// it (of its tier or above) take every slot.
    pub(super) fn would_wait(&self, tid: TenantId) -> bool {
        let tier = self.tenants.get(tid).config.tier;
        let ahead: usize = self
            .tenants
            .iter()
            .filter(|(_, t)| t.config.tier <= tier)
            .map(|(_, t)| {
                let running = if self.config.preempt_lower_tiers {
                    t.running as usize
                } else {
                    0
                };
                running + t.waiting.len() + t.resuming as usize
            })
            .sum();
        let running = if self.config.preempt_lower_tiers {
            0
        } else {
            self.running.len()
        };
        running + ahead >= self.max_running()
    }

    // -- the running set ----------------------------------------------------------

    /// `slab` enters the running set at `now` (as a prefill), with a fresh row key.
    pub(super) fn enter_running(&mut self, slab: usize, now: f64) {
        let pos = self.running.push(slab);
        let key = self.next_row_key;
        self.next_row_key += 1;
        let r = self.requests.get_mut(slab);
        r.place = Place::Running(pos);
        r.row_key = key;
        let queued = r.first_scheduled.is_none().then_some(now - r.arrival);
        r.first_scheduled.get_or_insert(now);
        let tid = r.tenant;
        self.tenants.get_mut(tid).start_running(queued);
    }

    /// Take the sequence at `pos` out of the running set; its caller puts it
    /// somewhere (a resume queue) or drops it.
    pub(super) fn remove_running(&mut self, pos: usize) {
        let requests = &mut self.requests;
        let slab = self.running.remove(pos, |s, p| {
            requests.get_mut(s).place = Place::Running(p);
        });
        let r = self.requests.get_mut(slab);
        r.place = Place::Queued;
        let tid = r.tenant;
        self.tenants.get_mut(tid).stop_running();
    }

    /// A prefill sequence that sampled its first token becomes a decode.
    pub(super) fn promote_to_decode(&mut self, pos: usize) {
        let requests = &mut self.requests;
        self.running.promote(pos, |s, p| {
            requests.get_mut(s).place = Place::Running(p);
        });
    }

    /// The running sequence to preempt: lowest tier, most recently admitted;
    /// only of a tier strictly below `below_tier` when given.
    pub(super) fn victim(&self, below_tier: Option<u32>) -> Option<usize> {
        self.running
            .slots()
            .iter()
            .enumerate()
            .map(|(pos, &slab)| {
                let r = self.requests.get(slab);
                (self.tenants.get(r.tenant).config.tier, r.id, pos)
            })
            .filter(|&(tier, _, _)| below_tier.is_none_or(|b| tier > b))
            .max()
            .map(|(_, _, pos)| pos)
    }
}
