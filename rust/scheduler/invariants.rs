//! `check_invariants`: every cross-structure invariant, for tests.

use super::*;
use crate::pool::CacheKey;

impl Scheduler {
    /// `full_validation` (and debug builds): every page-table row of the plan
    /// just written in buffer set `parity` holds its request's own page list
    /// (`Request::pages`, not the row cache, which a write into the arrays
    /// would fool), then page 0; rows past the plan are all page 0.
    ///
    /// On a difference it raises Internal, and repairs first: the set's page
    /// table is cleared and its row cache forgotten, so the next step writes
    /// every row again from the page lists. Raising (not repairing silently)
    /// because the plan just written must not run, and the difference means a
    /// bug or something writing the arrays behind the scheduler's back.
    ///
    /// The refused step serves nobody (`write_step`): no tenant's virtual
    /// time moves, the step id, parity and step rate do not advance, and its
    /// preemptions are reported with the next plan. What it did before the
    /// plan was written stays: the clock and the gap since the last step()
    /// call, the ladder's update, preemptions, the pages it gave decodes and
    /// prefill chunks, the requests it moved from waiting to running. That is
    /// harmless: none of it is a token computed or charged, and the next step
    /// plans the same sequences again, their pages already in hand.
    pub(super) fn check_plan_rows(
        &mut self,
        bufs: &mut PlanBuffers<'_>,
        num_seqs: usize,
        parity: usize,
    ) -> KvResult<()> {
        let pps = self.shape.pages_per_seq;
        let mut wrong = None;
        // The plan's sequences are the first `num_seqs` running ones.
        let planned = self.running.slots().iter().zip(self.running.owners());
        for (i, (&slab, o)) in planned.take(num_seqs).enumerate() {
            let pages = &self.requests.get(slab).pages;
            let row = &bufs.page_indices[i * pps..(i + 1) * pps];
            let same = pages.len() <= pps
                && row[..pages.len()]
                    .iter()
                    .zip(pages)
                    .all(|(&got, &want)| got as i64 == want as i64)
                && row[pages.len()..].iter().all(|&p| p == 0);
            if !same {
                wrong = Some(format!(
                    "row {i} (request {}) does not hold the request's pages",
                    o.id
                ));
                break;
            }
        }
        let s = self.shape.max_seqs;
        for (g, _) in self.kv.groups().extra().iter().enumerate() {
            let table = &bufs.group_page_indices[g * s * pps..(g + 1) * s * pps];
            let planned = self.running.slots().iter().zip(self.running.owners());
            for (i, (&slab, o)) in planned.take(num_seqs).enumerate() {
                let Some(mine) = self.requests.get(slab).groups.as_deref() else {
                    continue;
                };
                let (pages, from) = (&mine.tables[g], mine.live_from[g]);
                let row = &table[i * pps..(i + 1) * pps];
                let same = pages.len() <= pps
                    && row[..from].iter().all(|&p| p == 0)
                    && row[from..pages.len()]
                        .iter()
                        .zip(&pages[from..])
                        .all(|(&got, &want)| got as i64 == want as i64)
                    && row[pages.len()..].iter().all(|&p| p == 0);
                if !same && wrong.is_none() {
                    wrong = Some(format!(
                        "group {} row {i} (request {}) does not hold the request's pages",
                        g + 1,
                        o.id
                    ));
                }
            }
            if wrong.is_none() && table[num_seqs * pps..].iter().any(|&p| p != 0) {
                wrong = Some(format!("a group {} padding row is not page 0", g + 1));
            }
        }
        if wrong.is_none() && bufs.page_indices[num_seqs * pps..].iter().any(|&p| p != 0) {
            wrong = Some(format!(
                "a padding row past the {num_seqs} sequences is not page 0"
            ));
        }
        match wrong {
            None => Ok(()),
            Some(what) => {
                bufs.page_indices.fill(0);
                self.rows[parity].forget();
                bufs.group_page_indices.fill(0);
                self.group_rows[parity]
                    .iter_mut()
                    .for_each(GroupRowCache::forget);
                Err(KvError::Internal(format!(
                    "invalid step plan: {what}; the page table was written outside the \
                     scheduler, or a bug; its rows are rewritten from the page lists at the \
                     next step"
                )))
            }
        }
    }

    /// Every cross-structure invariant, for tests: pages conserved and owned once,
    /// usage within reservations (reserve mode), reservations within the usable
    /// pool, floors honoured, the running set and queues consistent.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.kv.pool().check_invariants()?;
        self.requests.check_invariants()?;
        let reserve_mode = !self.config.admission.preempts_for_pages();
        let n_tenants = self.tenants.iter().map(|(id, _)| id + 1).max().unwrap_or(0);
        let mut reserved = vec![0usize; n_tenants];
        let mut used = vec![0usize; n_tenants];
        let mut live = vec![0u32; n_tenants];
        let mut running = vec![0u32; n_tenants];
        let mut resuming = vec![0u32; n_tenants];
        // References each page gets from requests, and from which tenant's
        // requests (for the shared-page accounting).
        let mut refs = vec![0u32; self.kv.pool().num_blocks()];
        let mut refs_by_scope_tenant = vec![0u32; self.kv.pool().num_blocks()];
        if self.running.num_decode() > self.running.len() {
            return Err("num_decode exceeds the running set".into());
        }
        self.check_hot().map_err(|e| e.to_string())?;
        for (slab, r) in self.requests.iter() {
            if reserve_mode && r.held_pages() > r.reserved_blocks {
                return Err(format!("request {} holds more pages than reserved", r.id));
            }
            let bs = self.config.block_size;
            // Counting the tokens its tail holds (see tail.rs).
            let lag = self.unsettled(r);
            self.check_group_tables(r, r.num_computed + lag)?;
            if r.pages.len() < (r.num_computed + lag).div_ceil(bs)
                || r.pages.len() > (r.tokens.len() + lag).div_ceil(bs)
            {
                return Err(format!("request {} pages do not match its KV", r.id));
            }
            match r.place {
                Place::Running(pos) => {
                    if self.running.slots().get(pos) != Some(&slab) {
                        return Err(format!("request {} is not where it thinks it runs", r.id));
                    }
                    if pos < self.running.num_decode() && !(r.need() == 1 && r.generated() > 0) {
                        return Err(format!("request {} is in the decode region", r.id));
                    }
                    running[r.tenant] += 1;
                }
                Place::Queued | Place::Resuming(_) => {
                    // Waiting, it holds cache hits or (preempted in reserve
                    // mode) the KV it computed; never a page beyond that.
                    if r.pages.len() != r.num_computed.div_ceil(bs) {
                        return Err(format!(
                            "waiting request {} holds pages it has not filled",
                            r.id
                        ));
                    }
                    let queued = match r.place {
                        Place::Resuming(tier) => {
                            resuming[r.tenant] += 1;
                            self.resume.contains(tier, slab)
                        }
                        _ => self.tenants.get(r.tenant).waiting.contains(&slab),
                    };
                    if !queued {
                        return Err(format!("request {} is not in the queue it names", r.id));
                    }
                }
            }
            let cache = self.kv.pool().cache();
            // The names of the blocks it has named, recomputed from its tokens:
            // its naming stream must be where they lead.
            let mut names = Vec::new();
            if self.kv.caching() {
                let named = r.chain.tokens() / bs;
                if r.chain.tokens() % bs != 0 || named * bs > r.tokens.len() {
                    return Err(format!("request {} named a part of a block", r.id));
                }
                let mut c = self.kv.chain(r.namespace.root);
                for block in r.tokens.chunks_exact(bs).take(named) {
                    names.push(c.push(block));
                }
                if c != r.chain {
                    return Err(format!(
                        "request {} naming stream disagrees with its tokens",
                        r.id
                    ));
                }
            }
            for (b, &p) in r.pages.iter().enumerate() {
                refs[p as usize] += 1;
                if cache.scope(p) == Some(Scope::Tenant(r.tenant)) {
                    refs_by_scope_tenant[p as usize] += 1;
                }
                // A cached page holds exactly the block the request's chain names.
                match (cache.key_of(p), names.get(b)) {
                    (Some(k), Some(&mine)) if k != CacheKey::new(mine) => {
                        return Err(format!(
                            "request {} page {p} is cached under another name",
                            r.id
                        ))
                    }
                    (Some(_), None) => {
                        return Err(format!("request {} shares page {p} it has not named", r.id))
                    }
                    _ => {}
                }
            }
            for (g, (b, p)) in r
                .groups
                .iter()
                .flat_map(|x| x.tables.iter().zip(&x.live_from).enumerate())
                .flat_map(|(g, (t, &from))| {
                    t.iter().enumerate().skip(from).map(move |bp| (g + 1, bp))
                })
            {
                // Only group 0's pages earn admission room by being shared.
                refs[*p as usize] += 1;
                match (cache.key_of(*p), names.get(b)) {
                    (Some(k), Some(&mine)) if k != CacheKey::of_group(mine, g) => {
                        return Err(format!(
                            "request {} page {p} of group {g} is cached under another name",
                            r.id
                        ))
                    }
                    (Some(_), None) => {
                        return Err(format!("request {} shares page {p} it has not named", r.id))
                    }
                    _ => {}
                }
            }
            if self.kv.caching() && !r.pages.is_empty() && names.len() != r.num_computed / bs {
                return Err(format!(
                    "request {} names {} blocks, has computed {}",
                    r.id,
                    names.len(),
                    r.num_computed
                ));
            }
            reserved[r.tenant] += r.reserved_blocks;
            used[r.tenant] += r.held_pages();
            live[r.tenant] += 1;
        }
        for (p, &n) in refs.iter().enumerate() {
            if n != self.kv.pool().refcount(p as u32) {
                return Err(format!(
                    "page {p}: requests hold {n} references, the pool counts {}",
                    self.kv.pool().refcount(p as u32)
                ));
            }
        }
        let mut shared = vec![0usize; n_tenants];
        // Sharing earns admission room in reserve mode only.
        for (p, &n) in refs_by_scope_tenant
            .iter()
            .enumerate()
            .filter(|_| reserve_mode)
        {
            if let Some(Scope::Tenant(t)) = self.kv.pool().cache().scope(p as u32) {
                if t < n_tenants {
                    shared[t] += n.saturating_sub(1) as usize;
                }
            }
        }
        let queued: usize = self
            .tenants
            .iter()
            .map(|(_, t)| t.waiting.len())
            .sum::<usize>()
            + self.resume.len();
        if queued + self.running.len() != self.requests.len() {
            return Err("queues and running set do not cover the live requests".into());
        }
        // A tenant's queue holds requests that never ran, oldest (smallest id)
        // first: the displacement order reads it from the back (displace.rs).
        for (_, t) in self.tenants.iter() {
            let mut last = 0;
            for &slab in &t.waiting {
                let r = self.requests.get(slab);
                if r.first_scheduled.is_some() || r.id <= last {
                    return Err(format!(
                        "tenant {:?}'s queue: request {} ran or is out of id order",
                        t.config.name, r.id
                    ));
                }
                last = r.id;
            }
        }
        #[cfg(test)]
        {
            let (top, bottom) = self.tier_range();
            for tier in top..bottom.min(top.saturating_add(8)) {
                let mut lazy = Vec::new();
                self.each_displaceable(tier, |slab| {
                    lazy.push(slab);
                    std::ops::ControlFlow::<()>::Continue(())
                });
                if lazy != self.displaceable_by_sort(tier) {
                    return Err(format!("displacement order for tier {tier} differs"));
                }
            }
        }
        let usable = self.usable_blocks();
        let mut committed = 0;
        for (id, t) in self.tenants.iter() {
            let name = &t.config.name;
            if (
                t.reserved_blocks,
                t.used_blocks,
                t.shared_blocks,
                t.live_requests,
                t.running,
                t.resuming,
            ) != (
                reserved[id],
                used[id],
                shared[id],
                live[id],
                running[id],
                resuming[id],
            ) {
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
        if self.cache_partitioned() {
            self.check_partition()?;
        }
        Ok(())
    }

    /// A hybrid model's request: its group tables cover the blocks group 0's
    /// does, hold the null page exactly before their first block held, and
    /// hold every block a query at `next` (its next token's position) reads.
    fn check_group_tables(&self, r: &Request, next: usize) -> Result<(), String> {
        let bs = self.config.block_size;
        let kinds = self.kv.groups().extra();
        match &r.groups {
            None if kinds.is_empty() => Ok(()),
            None => Err(format!("request {} has no group tables", r.id)),
            Some(g) => {
                if g.tables.len() != kinds.len() || g.live_from.len() != kinds.len() {
                    return Err(format!("request {} has tables for other groups", r.id));
                }
                for ((t, &from), kind) in g.tables.iter().zip(&g.live_from).zip(kinds) {
                    let ok = t.len() == r.pages.len()
                        && from <= t.len()
                        && t[..from].iter().all(|&p| p == 0)
                        && t[from..].iter().all(|&p| p != 0)
                        && (t.is_empty() || from <= kind.visible_from(next) / bs);
                    if !ok {
                        return Err(format!(
                            "request {}: its {} table ({} pages from block {from}) does not \
                             hold what a query at {next} reads",
                            r.id,
                            kind.name(),
                            t.len()
                        ));
                    }
                }
                Ok(())
            }
        }
    }

    /// Partitioned cache: each tenant keeps at most its quota of evictable
    /// blocks, a removed tenant none, and the free list alone covers every
    /// page admission promised that no request holds yet, so no allocation
    /// ever needs a block another tenant cached.
    fn check_partition(&self) -> Result<(), String> {
        let cache = self.kv.pool().cache();
        let mut parked = 0;
        for tid in 0..self.tenants.slots_len() {
            let n = cache.parked_by(tid);
            parked += n;
            let quota = match self.tenants.iter().find(|&(id, _)| id == tid) {
                Some(_) => self.cache_quota(tid),
                None => 0,
            };
            if n > quota {
                return Err(format!(
                    "tenant slot {tid} keeps {n} evictable blocks, its quota is {quota}"
                ));
            }
        }
        if parked != cache.evictable() {
            return Err(format!(
                "{parked} blocks parked on tenant lists, {} evictable",
                cache.evictable()
            ));
        }
        let promised: usize = self
            .requests
            .iter()
            .map(|(_, r)| r.reserved_blocks.saturating_sub(r.held_pages()))
            .sum();
        if self.kv.pool().free_count() < promised {
            return Err(format!(
                "{} free pages, {promised} promised and not yet held",
                self.kv.pool().free_count()
            ));
        }
        Ok(())
    }
}
