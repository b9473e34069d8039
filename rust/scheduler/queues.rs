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
/// Beside each slot, in arrays in plan order (struct of arrays), it keeps the
/// sequence's `Owner` (request id and tenant) and its hot record: the
/// `DecodeSeq` the plan reads, a copy of what a decode needs of its request
/// (tokens computed, last token, page count and last page, row key). A step
/// plans its decodes from these arrays alone, one sequential pass, without
/// opening a request, its token list or its page list.
///
/// The copies follow the request: `enter_running` fills them, the step
/// refreshes the page fields after every page it adds (`grow_running`), and
/// commit the token fields. Nothing else changes a running request's tokens
/// or pages.
///
/// Beside the hot record, each sequence's `Tail` (see tail.rs) holds the
/// tokens a decode sampled since its request was last brought up to date:
/// a decode's commit writes there and to the hot record, not to its
/// request. Debug builds and `full_validation` check every sequence's copies
/// against its request, its tail's tokens counted, as the plan is written
/// (`check_hot`).
///
/// While a plan is pending, its decodes are pinned (`pin`): the first change
/// of position (an entry, a removal, a promotion) copies who they were, and
/// a commit that finds no copy (`unpin`) knows that the plan's k-th decode is
/// still at position k.
///
/// Its interface is kept narrow (positions in, slots out, a callback for every
/// sequence that moves) so that what it stores per running sequence can change
/// without touching its callers.
#[derive(Clone, Debug, Default)]
pub(super) struct RunningSet {
    slots: Vec<usize>,
    /// `owners[pos]` and `hot[pos]` belong to `slots[pos]`.
    owners: Vec<Owner>,
    hot: Vec<DecodeSeq>,
    tails: Vec<Tail>,
    num_decode: usize,
    pin: Pin,
}

/// The decodes of the plan pending (see `RunningSet::pin`).
#[derive(Clone, Debug, Default)]
enum Pin {
    /// No plan pending.
    #[default]
    Free,
    /// The first this many sequences, where the plan put them.
    Holding(usize),
    /// Who they were, in plan order, before the first change of position.
    Moved(Vec<PendingSeq>),
}

/// Whose a running sequence is: fixed for its request's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Owner {
    pub(super) id: u64,
    pub(super) tenant: TenantId,
    /// Whether it has stop tokens: a commit opens the request's list of them
    /// (a line of its own) only then.
    pub(super) stops: bool,
}

/// The hot record of request `r` entering with row key `row_key`.
fn hot_record(r: &Request, row_key: u64) -> DecodeSeq {
    DecodeSeq {
        row_key,
        pos: r.num_computed,
        token: r.tokens.last().copied().unwrap_or(0),
        last_page: r.pages.last().copied().unwrap_or(0),
        num_pages: r.pages.len(),
    }
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

    /// The owner of every running sequence, in plan order (as `slots`).
    #[inline]
    pub(super) fn owners(&self) -> &[Owner] {
        &self.owners
    }

    /// The hot record of every running sequence, in plan order (as `slots`).
    #[inline]
    pub(super) fn hot(&self) -> &[DecodeSeq] {
        &self.hot
    }

    /// The hot record of the sequence at plan position `pos`.
    #[inline]
    pub(super) fn hot_mut(&mut self, pos: usize) -> &mut DecodeSeq {
        &mut self.hot[pos]
    }

    /// The tail of every running sequence, in plan order (as `slots`).
    #[inline]
    pub(super) fn tails(&self) -> &[Tail] {
        &self.tails
    }

    /// The tail of the sequence at plan position `pos`.
    #[inline]
    pub(super) fn tail_mut(&mut self, pos: usize) -> &mut Tail {
        &mut self.tails[pos]
    }

    /// The hot record and tail of the sequence at `pos`, and its tenant.
    #[inline]
    pub(super) fn decode_mut(&mut self, pos: usize) -> (&mut DecodeSeq, &mut Tail, TenantId) {
        (
            &mut self.hot[pos],
            &mut self.tails[pos],
            self.owners[pos].tenant,
        )
    }

    /// A plan of the first `num_decode` sequences (the decodes) is pending:
    /// until `unpin`, the first change of position copies who they are.
    pub(super) fn pin(&mut self, num_decode: usize) {
        debug_assert!(num_decode <= self.num_decode);
        self.pin = Pin::Holding(num_decode);
    }

    /// End the pin: None when every pinned decode is still where the plan
    /// put it, else who they were, in plan order.
    pub(super) fn unpin(&mut self) -> Option<Vec<PendingSeq>> {
        match std::mem::take(&mut self.pin) {
            Pin::Moved(decodes) => Some(decodes),
            Pin::Free | Pin::Holding(_) => None,
        }
    }

    /// The pinned decodes of the plan pending (its first `num_decode`
    /// sequences), in plan order, wherever they are now.
    pub(super) fn pinned_decodes(&self, num_decode: usize) -> Vec<PendingSeq> {
        match &self.pin {
            Pin::Moved(decodes) => decodes.clone(),
            Pin::Free | Pin::Holding(_) => {
                (0..num_decode).map(|k| self.planned_decode(k)).collect()
            }
        }
    }

    /// The decode at `pos`, as the plan holds it.
    pub(super) fn planned_decode(&self, pos: usize) -> PendingSeq {
        debug_assert!(pos < self.num_decode);
        let o = self.owners[pos];
        PendingSeq {
            slab: self.slots[pos],
            id: o.id,
            q_len: 1,
            samples: true,
            decode: true,
            stops: o.stops,
        }
    }

    /// Called before every change of position: the pinned decodes are copied.
    fn moving(&mut self) {
        if let Pin::Holding(n) = self.pin {
            self.pin = Pin::Moved((0..n).map(|pos| self.planned_decode(pos)).collect());
        }
    }

    /// The slot at plan position `pos`.
    #[inline]
    pub(super) fn at(&self, pos: usize) -> usize {
        self.slots[pos]
    }

    /// Append a sequence that starts in prefill; returns its position.
    pub(super) fn push(&mut self, slot: usize, owner: Owner, hot: DecodeSeq, tail: Tail) -> usize {
        self.moving();
        self.slots.push(slot);
        self.owners.push(owner);
        self.hot.push(hot);
        self.tails.push(tail);
        self.slots.len() - 1
    }

    /// Take the sequence at `pos` out. Decodes fill a hole by swapping (their
    /// order does not matter); prefills keep their entry order. `moved(slot,
    /// pos)` is called for every remaining sequence whose position changed.
    pub(super) fn remove(&mut self, pos: usize, mut moved: impl FnMut(usize, usize)) -> usize {
        debug_assert_eq!(self.tails[pos].n, 0, "settled before it leaves");
        self.moving();
        let slot = self.slots[pos];
        let from = if pos < self.num_decode {
            let last = self.num_decode - 1;
            self.slots.swap(pos, last);
            self.owners.swap(pos, last);
            self.hot.swap(pos, last);
            self.tails.swap(pos, last);
            if pos != last {
                moved(self.slots[pos], pos);
            }
            self.num_decode -= 1;
            last
        } else {
            pos
        };
        self.slots.remove(from);
        self.owners.remove(from);
        self.hot.remove(from);
        self.tails.remove(from);
        for (p, &s) in self.slots.iter().enumerate().skip(from) {
            moved(s, p);
        }
        slot
    }

    /// The prefill at `pos` sampled its first token: it becomes the last decode.
    /// `moved(slot, pos)` is called for every sequence whose position changed.
    pub(super) fn promote(&mut self, pos: usize, mut moved: impl FnMut(usize, usize)) {
        debug_assert!(pos >= self.num_decode);
        self.moving();
        let to = self.num_decode;
        let slot = self.slots.remove(pos);
        self.slots.insert(to, slot);
        let owner = self.owners.remove(pos);
        self.owners.insert(to, owner);
        let hot = self.hot.remove(pos);
        self.hot.insert(to, hot);
        let tail = self.tails.remove(pos);
        self.tails.insert(to, tail);
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
                // The queue is in id order (check_invariants): a binary search,
                // so that displacing the newest of a long queue does not scan it.
                let id = r.id;
                let requests = &self.requests;
                let t = self.tenants.get_mut(tid);
                let found = t
                    .waiting
                    .binary_search_by_key(&id, |&s| requests.get(s).id)
                    .ok()
                    .filter(|&i| t.waiting[i] == slab);
                debug_assert!(found.is_some(), "queue {:?} out of id order", t.config.name);
                let i = found
                    .or_else(|| t.waiting.iter().position(|&s| s == slab))
                    .expect("queued");
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
        running + ahead >= self.max_running_for(tier)
    }

    // -- the running set ----------------------------------------------------------

    /// `slab` enters the running set at `now` (as a prefill), with a fresh row
    /// key; returns its position.
    pub(super) fn enter_running(&mut self, slab: usize, now: f64) -> usize {
        let key = self.next_row_key;
        self.next_row_key += 1;
        let r = self.requests.get_mut(slab);
        let owner = Owner {
            id: r.id,
            tenant: r.tenant,
            stops: !r.stop_token_ids.is_empty(),
        };
        let pos = self
            .running
            .push(slab, owner, hot_record(r, key), Tail::of(r));
        r.place = Place::Running(pos);
        let queued = r.first_scheduled.is_none().then_some(now - r.arrival);
        r.first_scheduled.get_or_insert(now);
        let tid = r.tenant;
        self.tenants.get_mut(tid).start_running(queued);
        pos
    }

    /// Take the sequence at `pos` out of the running set; its caller puts it
    /// somewhere (a resume queue) or drops it.
    pub(super) fn remove_running(&mut self, pos: usize) {
        self.settle(pos);
        let requests = &mut self.requests;
        let slab = self.running.remove(pos, |s, p| {
            requests.get_mut(s).place = Place::Running(p);
        });
        let r = self.requests.get_mut(slab);
        r.place = Place::Queued;
        let tid = r.tenant;
        self.tenants.get_mut(tid).stop_running();
    }

    /// Pages so that the running sequence at `pos` covers `len` tokens, for
    /// a step whose first query is at `start`; its hot record follows.
    #[inline]
    pub(super) fn grow_running(&mut self, pos: usize, start: usize, len: usize) -> KvResult<()> {
        let slab = self.running.at(pos);
        self.grow_pages(slab, start, len)?;
        let pages = &self.requests.get(slab).pages;
        let h = self.running.hot_mut(pos);
        h.num_pages = pages.len();
        h.last_page = pages.last().copied().unwrap_or(0);
        Ok(())
    }

    /// Whether every running sequence's hot record, owner and tail agree
    /// with its request, counting the tokens its tail holds (see `RunningSet`).
    pub(super) fn check_hot(&self) -> KvResult<()> {
        let running = &self.running;
        let decodes = running.num_decode();
        let records = running
            .owners()
            .iter()
            .zip(running.hot())
            .zip(running.tails());
        for (pos, (&s, ((o, h), tail))) in running.slots().iter().zip(records).enumerate() {
            let r = self.requests.get(s);
            let owner =
                r.id == o.id && r.tenant == o.tenant && o.stops != r.stop_token_ids.is_empty();
            let fits = tail.agrees_with(r) && (pos < decodes || tail.n == 0);
            let n = usize::from(tail.n);
            let last = match n {
                0 => r.tokens.last(),
                _ => tail.buf.get(n - 1),
            };
            let lists = pos >= decodes
                || (r.tokens.len() == r.num_computed + 1
                    && last == Some(&h.token)
                    && r.pages.len() == h.num_pages
                    && r.pages.last() == Some(&h.last_page)
                    && r.num_computed + n == h.pos);
            if !(lists && owner && fits) {
                return Err(KvError::Internal(format!(
                    "the hot record or tail of running sequence {pos} (request {}) disagrees with it",
                    r.id
                )));
            }
        }
        Ok(())
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
            .owners()
            .iter()
            .enumerate()
            .map(|(pos, o)| (self.tenants.get(o.tenant).config.tier, o.id, pos))
            .filter(|&(tier, _, _)| below_tier.is_none_or(|b| tier > b))
            .max()
            .map(|(_, _, pos)| pos)
    }
}
