//! Where admitted requests wait and run: the per-tenant waiting queues, the
//! per-tier resume queues of preempted requests and the running set.

use super::*;

/// Where the next request to enter the running set comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum WaitFrom {
    Tenant(TenantId),
    Resume(u32),
}

impl Scheduler {
    /// Move `tid`'s preempted requests to the resume queue of `tier`, in
    /// admission order: the queue a request waits in is always its tier's, so
    /// priority preemption and entry agree on who goes first.
    pub(super) fn refile_resuming(&mut self, tid: TenantId, tier: u32) {
        let mut moved = Vec::new();
        let slab = &self.slab;
        for q in self.resume.values_mut() {
            q.retain(|&s| {
                let mine = slab[s].as_ref().expect("live").tenant == tid;
                if mine {
                    moved.push(s);
                }
                !mine
            });
        }
        self.resume.retain(|_, q| !q.is_empty());
        for s in moved {
            let id = self.req(s).id;
            let queue = self.resume.entry(tier).or_default();
            let slab = &self.slab;
            let at = queue.partition_point(|&x| slab[x].as_ref().expect("live").id < id);
            queue.insert(at, s);
            self.req_mut(s).place = Place::Resuming(tier);
        }
    }

    pub(super) fn remove_waiting(&mut self, slab: usize) {
        let (tid, place) = (self.req(slab).tenant, self.req(slab).place);
        match place {
            Place::Queued => {
                let t = self.tenants.get_mut(tid);
                let i = t.waiting.iter().position(|&s| s == slab).expect("queued");
                t.waiting.remove(i);
            }
            Place::Resuming(tier) => {
                let queue = self
                    .resume
                    .get_mut(&tier)
                    .expect("resume queue of its tier");
                let i = queue.iter().position(|&s| s == slab).expect("queued");
                queue.remove(i);
                if queue.is_empty() {
                    self.resume.remove(&tier);
                }
                self.tenants.get_mut(tid).resuming -= 1;
            }
            Place::Running(_) => unreachable!("not waiting"),
        }
    }

    // -- the running set ----------------------------------------------------------

    pub(super) fn set_pos(&mut self, pos: usize) {
        let slab = self.running[pos];
        self.req_mut(slab).place = Place::Running(pos);
    }

    /// Take the sequence at `pos` out of the running set. Decodes fill a hole by
    /// swapping (their order does not matter); prefills keep their entry order.
    pub(super) fn remove_running(&mut self, pos: usize) {
        let slab = self.running[pos];
        if pos < self.num_decode {
            let last = self.num_decode - 1;
            self.running.swap(pos, last);
            self.set_pos(pos);
            self.num_decode -= 1;
            self.running.remove(last);
            for p in last..self.running.len() {
                self.set_pos(p);
            }
        } else {
            self.running.remove(pos);
            for p in pos..self.running.len() {
                self.set_pos(p);
            }
        }
        let tid = self.req(slab).tenant;
        self.tenants.get_mut(tid).running -= 1;
        // Its caller puts it somewhere (a resume queue) or drops it.
        self.req_mut(slab).place = Place::Queued;
    }

    /// A prefill sequence that sampled its first token becomes a decode.
    pub(super) fn promote_to_decode(&mut self, pos: usize) {
        debug_assert!(pos >= self.num_decode);
        let slab = self.running.remove(pos);
        self.running.insert(self.num_decode, slab);
        self.num_decode += 1;
        for p in self.num_decode - 1..=pos {
            self.set_pos(p);
        }
    }

    pub(super) fn enter_running(&mut self, slab: usize, now: f64) {
        self.running.push(slab);
        let pos = self.running.len() - 1;
        let key = self.next_row_key;
        self.next_row_key += 1;
        let r = self.req_mut(slab);
        r.place = Place::Running(pos);
        r.row_key = key;
        let queued = r.first_scheduled.is_none().then_some(now - r.arrival);
        r.first_scheduled.get_or_insert(now);
        let tid = r.tenant;
        let t = self.tenants.get_mut(tid);
        t.running += 1;
        if let Some(q) = queued {
            t.metrics.queue_time.observe(q);
        }
    }

    /// The running sequence to preempt: lowest tier, most recently admitted;
    /// only of a tier strictly below `below_tier` when given.
    pub(super) fn victim(&self, below_tier: Option<u32>) -> Option<usize> {
        self.running
            .iter()
            .enumerate()
            .map(|(pos, &slab)| {
                let r = self.req(slab);
                (self.tenants.get(r.tenant).config.tier, r.id, pos)
            })
            .filter(|&(tier, _, _)| below_tier.is_none_or(|b| tier > b))
            .max()
            .map(|(_, _, pos)| pos)
    }

    /// The next request to enter the running set, and where it waits.
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
        let best_resume = self.resume.iter().next().map(|(&tier, q)| (tier, q[0]));
        match (best_resume, best_tenant) {
            (Some((rt, slab)), Some((tt, _))) if rt <= tt => Some((slab, WaitFrom::Resume(rt))),
            (Some((rt, slab)), None) => Some((slab, WaitFrom::Resume(rt))),
            (_, Some((_, tid))) => Some((self.tenants.get(tid).waiting[0], WaitFrom::Tenant(tid))),
            (None, None) => None,
        }
    }

    pub(super) fn pop_waiting(&mut self, slab: usize, from: WaitFrom) {
        match from {
            WaitFrom::Tenant(tid) => {
                let popped = self.tenants.get_mut(tid).waiting.pop_front();
                debug_assert_eq!(popped, Some(slab));
            }
            WaitFrom::Resume(tier) => {
                let q = self.resume.get_mut(&tier).expect("resume queue");
                let popped = q.pop_front();
                debug_assert_eq!(popped, Some(slab));
                if q.is_empty() {
                    self.resume.remove(&tier);
                }
                let tid = self.req(slab).tenant;
                self.tenants.get_mut(tid).resuming -= 1;
            }
        }
    }
}
