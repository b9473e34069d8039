//! One step: plan the running set's next tokens (decodes first, then prefill
//! chunks, then new entries), preempting where the admission mode says so,
//! and hand the arrays to `planner::write_plan`. The chunk arithmetic itself
//! is the planner's (`planner::prefill_room`, `planner::prefill_chunk`).

use super::*;

/// What one `step()` decided, beside the arrays it wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutcome {
    pub step_id: u64,
    /// Which of the two buffer sets holds this plan's arrays.
    pub parity: usize,
    pub num_seqs: usize,
    pub num_decode: usize,
    pub num_tokens: usize,
    pub bucket: usize,
    /// Request id of each sequence, in plan order.
    pub request_ids: Vec<u64>,
    /// Whether the token sampled for each sequence is used (its prompt, or its
    /// recompute, is complete); false for a prefill chunk that stops short.
    pub samples: Vec<bool>,
    /// Requests preempted while planning this step (back in their queue).
    pub preempted: Vec<u64>,
    /// KV tokens the step reads: `kv_lens` summed over its sequences (what a
    /// cost model of the step needs, summed while the array is at hand).
    pub kv_tokens: u64,
}

/// One sequence of a pending plan.
#[derive(Clone, Debug)]
pub(super) struct PendingSeq {
    pub(super) slab: usize,
    pub(super) id: u64,
    /// Its tokens in the plan (the plan's arrays are indexed by i32, so this
    /// fits; 24 bytes a sequence instead of 32, written by every step and
    /// read by every commit).
    pub(super) q_len: u32,
    pub(super) samples: bool,
    pub(super) decode: bool,
    /// Whether the request has stop tokens (see `queues::Owner`).
    pub(super) stops: bool,
}

/// The step being planned: its decodes (one token each, first in plan
/// order), then the tokens of each prefill chunk after them, tokens placed so
/// far, and the budget they must fit.
struct Batch {
    chunks: Vec<usize>,
    scheduled: usize,
    num_decode: usize,
    budget: usize,
}

/// A plan handed out and not yet committed: what `commit` needs of it.
#[derive(Clone, Debug)]
pub(super) struct Pending {
    pub(super) step_id: u64,
    /// Its decodes: the first `num_decode` running sequences, pinned there
    /// (`RunningSet::pin`).
    pub(super) num_decode: usize,
    /// Its prefill chunks, after the decodes.
    pub(super) seqs: Vec<PendingSeq>,
    pub(super) preempted: Vec<u64>,
}

impl Scheduler {
    // -- one step -------------------------------------------------------------------

    /// Plan the next step into `bufs`, which must be the buffer set
    /// `next_parity()` names: each set's page-table rows are updated against
    /// what that set held two steps ago, so passing any other buffer leaves stale
    /// rows (only `full_validation` would catch it). Returns None when nothing can
    /// run. The plan must be committed before the next step.
    ///
    /// In order: the drain deadline and the ladder; priority preemption; a
    /// page for every decode; the running prefills' next chunks; new entries
    /// while there are slots and budget; then the arrays (`planner::write_plan`).
    pub fn step(&mut self, now: f64, bufs: &mut PlanBuffers<'_>) -> KvResult<Option<StepOutcome>> {
        self.accept_now(now)?;
        if self.pending.is_some() {
            return Err(KvError::StalePlan(
                "the previous plan was not committed; commit it first (or advance it)".into(),
            ));
        }
        if let Some(last) = self.last_step_at {
            self.step_gap.observe((now - last).max(0.0));
        }
        self.last_step_at = Some(now);
        self.clock = self.clock.max(now);
        if self.lifecycle == Lifecycle::Draining && now >= self.drain_deadline {
            self.hand_back_all(now);
        }
        self.maybe_drained();
        self.update_ladder(now);
        let mut preempted = Vec::new();
        if self.config.preempt_lower_tiers {
            self.preempt_for_higher_tiers(&mut preempted);
        }

        // Decodes first: every running decode sequence gets its token.
        self.decode_pages(&mut preempted)?;
        let num_decode = self.running.num_decode();
        let mut batch = Batch {
            chunks: Vec::new(),
            scheduled: num_decode,
            num_decode,
            budget: self.step_budget(),
        };
        if self.continue_prefills(&mut batch, &mut preempted)? {
            self.enter_waiting(&mut batch, now)?;
        }

        if num_decode == 0 && batch.chunks.is_empty() {
            // Preemptions of a step that runs nothing are reported with the next plan.
            self.unreported_preempted.extend(preempted);
            self.last_plan_at = None;
            return Ok(None);
        }
        if !self.unreported_preempted.is_empty() {
            let mut all = std::mem::take(&mut self.unreported_preempted);
            all.extend(preempted);
            preempted = all;
        }
        self.write_step(num_decode, &batch.chunks, preempted, bufs, now)
            .map(Some)
    }

    /// The step's token budget: max_batched_tokens, shrunk to the smallest
    /// max_step_tokens of the tenants with a sequence running.
    fn step_budget(&self) -> usize {
        let budget_cap = self
            .tenants
            .iter()
            .filter(|(_, t)| t.running > 0)
            .filter_map(|(_, t)| t.config.max_step_tokens)
            .min();
        self.config
            .max_batched_tokens
            .min(budget_cap.unwrap_or(usize::MAX))
    }

    /// Prefills already running resume where they stopped, in entry order,
    /// each by the chunk that fits. Returns whether every one of them moved
    /// (only then may new sequences enter).
    fn continue_prefills(&mut self, batch: &mut Batch, preempted: &mut Vec<u64>) -> KvResult<bool> {
        let overcommit = self.config.admission.preempts_for_pages();
        let mut pos = batch.num_decode;
        while pos < self.running.len() {
            let slab = self.running.at(pos);
            let room = self.prefill_room(batch.budget, batch.scheduled, batch.num_decode);
            let chunk = self.prefill_chunk(slab, room);
            if chunk == 0 {
                if overcommit && batch.scheduled == 0 {
                    // Nothing runs and no page is free: the running prefills hold
                    // the pool between them. Preempt (lowest tier, most recently
                    // admitted) until the first of them can move.
                    let victim = self.victim(None).expect("a prefill is running");
                    self.preempt(victim, preempted);
                    continue;
                }
                break;
            }
            let start = self.requests.get(slab).num_computed;
            self.grow_running(pos, start, start + chunk)?;
            batch.chunks.push(chunk);
            batch.scheduled += chunk;
            pos += 1;
        }
        Ok(pos == self.running.len())
    }

    /// New sequences enter while there are slots and budget. The best waiting
    /// request holds the line: nothing of lower priority passes it.
    fn enter_waiting(&mut self, batch: &mut Batch, now: f64) -> KvResult<()> {
        while self.running.len() < self.config.max_num_seqs {
            let Some((slab, from)) = self.peek_waiting() else {
                break;
            };
            let tier = self.tenants.get(self.requests.get(slab).tenant).config.tier;
            if self.running.len() >= self.max_running_for(tier) {
                break;
            }
            self.prepare_entry(slab);
            let cap = self
                .tenants
                .get(self.requests.get(slab).tenant)
                .config
                .max_step_tokens;
            let entry_budget = batch.budget.min(cap.unwrap_or(usize::MAX));
            let room = self.prefill_room(entry_budget, batch.scheduled, batch.num_decode);
            let chunk = self.prefill_chunk(slab, room);
            if chunk == 0 {
                self.abandon_entry(slab);
                break;
            }
            self.count_entry_lookup(slab);
            batch.budget = entry_budget;
            self.pop_waiting(slab, from);
            let pos = self.enter_running(slab, now);
            let start = self.requests.get(slab).num_computed;
            self.grow_running(pos, start, start + chunk)?;
            batch.chunks.push(chunk);
            batch.scheduled += chunk;
        }
        Ok(())
    }

    /// Write the plan of the first `num_decode + chunks.len()` running
    /// sequences (the decodes one token each, then `chunks` tokens each) into
    /// `bufs`, advance the tenants' virtual times and the step rate, and keep
    /// what `commit` needs.
    fn write_step(
        &mut self,
        num_decode: usize,
        chunks: &[usize],
        preempted: Vec<u64>,
        bufs: &mut PlanBuffers<'_>,
        now: f64,
    ) -> KvResult<StepOutcome> {
        let parity = self.next_parity();
        let n = num_decode + chunks.len();
        self.served.resize(self.tenants.slots_len(), 0);
        let mut seqs = Vec::with_capacity(chunks.len());
        let mut request_ids = Vec::with_capacity(n);
        let mut samples = Vec::with_capacity(n);
        if cfg!(debug_assertions) || self.config.full_validation {
            self.check_hot()?;
        }
        let written = {
            // One pass over the scheduled sequences writes the arrays and records
            // what commit needs (disjoint fields, so the borrows coexist).
            let requests = &self.requests;
            let served = &mut self.served;
            let running = &self.running;
            let slots = &running.slots()[..n];
            let owners = &running.owners()[..n];
            let hot = &running.hot()[..n];
            // Decodes are planned from the running set's arrays alone (see
            // `RunningSet`): one token each, sampled; commit finds them where
            // they are (`RunningSet::pin`).
            for o in &owners[..num_decode] {
                served[o.tenant] += 1;
            }
            request_ids.extend(owners[..num_decode].iter().map(|o| o.id));
            samples.resize(num_decode, true);
            // Prefill chunks from their requests' lists.
            let chunks = (num_decode..n).zip(chunks).map(|(pos, &q)| {
                let (s, o) = (slots[pos], owners[pos]);
                let r = requests.get(s);
                let done = r.num_computed + q == r.tokens.len();
                served[o.tenant] += q;
                seqs.push(PendingSeq {
                    slab: s,
                    id: o.id,
                    // Saturated: a chunk this long fails `write_plan`'s checks,
                    // and then no commit reads it.
                    q_len: u32::try_from(q).unwrap_or(u32::MAX),
                    samples: done,
                    decode: false,
                    stops: o.stops,
                });
                request_ids.push(o.id);
                samples.push(done);
                SeqSlice {
                    row_key: hot[pos].row_key,
                    tokens: &r.tokens,
                    start: r.num_computed,
                    q_len: q,
                    pages: &r.pages,
                }
            });
            planner::write_plan(
                &self.shape,
                &self.buckets,
                bufs,
                &mut self.rows[parity],
                self.kv.pool(),
                &hot[..num_decode],
                chunks,
                |i| &requests.get(slots[i]).pages,
            )
        };
        let checked = written.and_then(|written| {
            if self.kv.hybrid() {
                self.write_groups(bufs, num_decode, chunks, parity, &written)?;
            }
            if cfg!(debug_assertions) || self.config.full_validation {
                self.check_plan_rows(bufs, n, parity)?;
                planner::validate(&self.shape, bufs, &written, self.kv.pool())?;
                let extra = self.kv.groups().extra();
                planner::validate_groups(&self.shape, bufs, &written, self.kv.pool(), extra)?;
            }
            Ok(written)
        });
        let written = match checked {
            Ok(written) => written,
            Err(e) => {
                // This plan does not run (see `check_plan_rows`): nobody was
                // served by it, and its preemptions go out with the next plan.
                self.served.fill(0);
                self.unreported_preempted.extend(preempted);
                return Err(e);
            }
        };
        // Weighted fair share: virtual time grows by tokens served / weight (summed
        // per tenant first: one division per tenant, not per sequence).
        for (tid, tokens) in self.served.iter_mut().enumerate() {
            if *tokens > 0 {
                self.tenants.get_mut(tid).serve(*tokens);
                *tokens = 0;
            }
        }

        // The step rate: gaps between consecutive steps that both ran something.
        if let Some(prev) = self.last_plan_at {
            let gap = now - prev;
            if gap > 0.0 {
                if self.step_gaps.len() == STEP_GAP_WINDOW {
                    self.step_gaps.pop_front();
                }
                self.step_gaps.push_back(gap);
            }
        }
        self.last_plan_at = Some(now);
        let step_id = (self.instance << STEP_ID_BITS) | (self.steps % (1 << STEP_ID_BITS));
        self.steps += 1;
        self.pending = Some(Pending {
            step_id,
            num_decode,
            seqs,
            preempted: preempted.clone(),
        });
        self.running.pin(num_decode);
        let kv_tokens = bufs.kv_lens[..written.num_seqs]
            .iter()
            .map(|&k| k as u64)
            .sum();
        Ok(StepOutcome {
            step_id,
            parity,
            kv_tokens,
            num_seqs: written.num_seqs,
            num_decode,
            num_tokens: written.num_tokens,
            bucket: written.bucket,
            request_ids,
            samples,
            preempted,
        })
    }

    /// Hybrid: the plan's page tables and slots of the KV-cache groups after
    /// group 0 (see `planner::write_groups`), for the first `num_decode +
    /// chunks.len()` running sequences as `write_plan` planned them.
    fn write_groups(
        &mut self,
        bufs: &mut PlanBuffers<'_>,
        num_decode: usize,
        chunks: &[usize],
        parity: usize,
        written: &planner::WrittenPlan,
    ) -> KvResult<()> {
        let (requests, running) = (&self.requests, &self.running);
        let seqs: Vec<GroupSeq<'_>> = (0..num_decode + chunks.len())
            .map(|pos| {
                let r = requests.get(running.at(pos));
                let g = r
                    .groups
                    .as_deref()
                    .expect("a hybrid model's request has group tables");
                let hot = &running.hot()[pos];
                let (start, q_len) = match pos.checked_sub(num_decode) {
                    None => (hot.pos, 1),
                    Some(c) => (r.num_computed, chunks[c]),
                };
                GroupSeq {
                    row_key: hot.row_key,
                    start,
                    q_len,
                    tables: &g.tables,
                    live_from: &g.live_from,
                }
            })
            .collect();
        planner::write_groups(
            &self.shape,
            bufs,
            &mut self.group_rows[parity],
            self.kv.pool(),
            self.kv.groups().extra(),
            &seqs,
            written,
        )
    }

    /// Priority preemption: the best waiting request, if of a higher tier than
    /// some running sequence, takes its slot (or, over-committed, its pages).
    pub(super) fn preempt_for_higher_tiers(&mut self, preempted: &mut Vec<u64>) {
        loop {
            let Some((slab, _)) = self.peek_waiting() else {
                return;
            };
            let tier = self.tenants.get(self.requests.get(slab).tenant).config.tier;
            let no_slot = self.running.len() >= self.max_running_for(tier);
            // Over-committed, a request that cannot get the pages of its
            // first chunk needs room as much as one without a slot.
            let no_room = self.config.admission.preempts_for_pages() && {
                let first = self
                    .requests
                    .get(slab)
                    .need()
                    .min(self.config.long_prefill_chunk);
                self.kv.blocks_for(first) * self.kv.groups().len() > self.kv.available()
            };
            if !(no_slot || no_room) {
                return;
            }
            let Some(pos) = self.victim(Some(tier)) else {
                return;
            };
            self.preempt(pos, preempted);
        }
    }

    /// Give every decode sequence the page its next token needs. Over-committed,
    /// preempt (lowest tier, most recently admitted) until they fit.
    pub(super) fn decode_pages(&mut self, preempted: &mut Vec<u64>) -> KvResult<()> {
        // Reserve mode needs no count: every page is within a reservation.
        if self.config.admission.preempts_for_pages() {
            // A decode that opens a block opens it in every group (a window
            // group gives back pages at the same time, not counted here).
            let groups = self.kv.groups().len();
            loop {
                let need = self.running.hot()[..self.running.num_decode()]
                    .iter()
                    .filter(|h| self.kv.blocks_for(h.pos + 1) > h.num_pages)
                    .count()
                    * groups;
                if need <= self.kv.available() {
                    break;
                }
                let pos = self.victim(None).expect("decodes are running");
                self.preempt(pos, preempted);
            }
        }
        // A decode needs a page when its token's position is past its pages
        // (blocks_for(pos + 1) > num_pages). Fifteen steps in sixteen (block
        // 16) the page is already there: find the others in one scan.
        let bs = self.shape.block_size.get();
        let mut pos = 0;
        while let Some(k) = self.running.hot()[pos..self.running.num_decode()]
            .iter()
            .position(|h| h.pos >= h.num_pages * bs)
        {
            pos += k;
            let at = self.running.hot()[pos].pos;
            self.grow_running(pos, at, at + 1)?;
            pos += 1;
        }
        Ok(())
    }

    /// Preempt the running sequence at `pos` and queue it at the head of its
    /// tier. Over-committed, its pages go back (cached blocks stay evictable,
    /// tail first) and it is recomputed later from what the cache still holds.
    /// In reserve mode its pages are reserved anyway: it keeps its KV and only
    /// gives up its slot.
    pub(super) fn preempt(&mut self, pos: usize, preempted: &mut Vec<u64>) {
        let slab = self.running.at(pos);
        self.remove_running(pos);
        if self.config.admission.preempts_for_pages() {
            self.drop_all_pages(slab);
            self.requests.get_mut(slab).num_computed = 0;
        }
        let now = self.last_step_at;
        let r = self.requests.get_mut(slab);
        r.preemptions += 1;
        r.waiting_since = now.unwrap_or(r.waiting_since);
        let (id, tid) = (r.id, r.tenant);
        let t = self.tenants.get_mut(tid);
        t.preempted();
        let tier = t.config.tier;
        self.preemptions += 1;
        self.queue_resuming(slab, tier);
        preempted.push(id);
    }

    /// Prefill tokens the step still has room for (see `planner::prefill_room`).
    #[inline]
    fn prefill_room(&self, budget: usize, scheduled: usize, num_decode: usize) -> usize {
        planner::prefill_room(
            budget,
            scheduled,
            num_decode,
            self.config.max_batched_tokens,
        )
    }

    /// Tokens of `slab`'s prefill that fit `room`, the chunk cap and
    /// (over-committed) the pages it holds plus the free ones.
    fn prefill_chunk(&self, slab: usize, room: usize) -> usize {
        let r = self.requests.get(slab);
        // Every group opens the same blocks (window groups give back pages
        // as they go, not counted here).
        let groups = self.kv.groups().len();
        let coverable = self.config.admission.preempts_for_pages().then(|| {
            (r.pages.len() + self.kv.available() / groups) * self.config.block_size - r.num_computed
        });
        // A hybrid model's reservation assumed steps of at most the chunk it
        // was admitted with (read only then: `groups` is a line of its own).
        let mut cap = self.config.long_prefill_chunk;
        if self.kv.hybrid() {
            if let Some(g) = &r.groups {
                cap = cap.min(g.chunk);
            }
        }
        planner::prefill_chunk(r.need(), cap, room, coverable)
    }
}
