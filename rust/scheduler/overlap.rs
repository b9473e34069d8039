//! Overlapped scheduling: a plan closed before its tokens are known, so the
//! next one is planned while the device still runs it.
//!
//! `advance(step)` closes the pending plan as if every sequence that samples
//! drew one token: each gets a placeholder, `-(row + 1)` (its row in the plan;
//! real ids are never negative), so positions move on, a prefill that sampled
//! becomes a decode, a request that reached max_tokens ends, filled blocks are
//! named (a block never holds a placeholder: the sampled token is the last one,
//! whose KV the next step computes). `step()` then plans the next step, whose
//! decodes' input is that placeholder: the engine takes the token from the
//! device's own sampled array (row `-t - 1` of the plan advanced), with no
//! round trip through the host. `resolve(step, sampled)` writes the real
//! tokens where the placeholders are and decides what only they tell: a stop
//! token ends its request then, one step late. The sequence it ended was
//! planned again meanwhile: that extra token is computed and dropped, inside
//! its reservation (it stopped before max_tokens, so prompt + generated + 1 <=
//! prompt + max_tokens). `resolve` returns the step's events, real tokens in.
//!
//! At most one plan is advanced and not resolved: `advance` and `commit`
//! refuse while one is, so a placeholder always refers to the previous plan
//! and is always the last token of its request. A request that ends between
//! `advance` and `resolve` (cancel, stop string, drain deadline, displacement)
//! ends without it: the token was not delivered, and is dropped
//! (`output_of`, `finished_record` leave a placeholder out).

use super::*;

/// The placeholder of the token sampled at `row` of the plan advanced.
#[inline]
pub(super) fn placeholder(row: usize) -> i32 {
    -(row as i32) - 1
}

/// Whether `token` (a request's last, say) is a placeholder.
#[inline]
pub(super) fn is_placeholder(token: Option<&i32>) -> bool {
    token.is_some_and(|&t| t < 0)
}

/// `tokens` without a trailing placeholder.
#[inline]
pub(super) fn known(tokens: &[i32]) -> &[i32] {
    match tokens.last() {
        Some(&t) if t < 0 => &tokens[..tokens.len() - 1],
        _ => tokens,
    }
}

/// A plan advanced and not yet resolved.
#[derive(Debug)]
pub(super) struct Unresolved {
    step_id: u64,
    /// Every row of the plan: its request (slot, id) and whether it sampled.
    rows: Vec<(usize, u64, bool)>,
    /// The events the advance made, placeholders for tokens.
    events: CommitEvents,
}

impl Scheduler {
    /// Refuse while a plan is advanced and not resolved.
    pub(super) fn check_resolved(&self) -> KvResult<()> {
        match &self.unresolved {
            Some(u) => Err(KvError::StalePlan(format!(
                "step {} was advanced and is not resolved: resolve it first",
                u.step_id
            ))),
            None => Ok(()),
        }
    }

    /// Whether a plan is advanced and not resolved.
    pub fn unresolved_step(&self) -> Option<u64> {
        self.unresolved.as_ref().map(|u| u.step_id)
    }

    /// Close step `step_id` before its tokens are known: as `commit`, each
    /// sequence that samples drawing a placeholder for its token (see the
    /// module doc). The next `step()` may then be planned; `resolve` gives the
    /// tokens and returns the step's events. Refused (StalePlan) for a plan
    /// that is not the pending one, or while another is unresolved; nothing
    /// changes then.
    pub fn advance(&mut self, step_id: u64, now: f64) -> KvResult<()> {
        self.accept_now(now)?;
        self.check_resolved()?;
        let pending = match &self.pending {
            Some(p) if p.step_id == step_id => p,
            Some(p) => {
                return Err(KvError::StalePlan(format!(
                    "plan of step {step_id} advanced, step {} is pending",
                    p.step_id
                )))
            }
            None => {
                return Err(KvError::StalePlan(format!(
                    "no plan is pending (step {step_id} already advanced?)"
                )))
            }
        };
        let decodes = self.running.pinned_decodes(pending.num_decode);
        let rows: Vec<(usize, u64, bool)> = decodes
            .iter()
            .chain(&pending.seqs)
            .map(|s| (s.slab, s.id, s.samples))
            .collect();
        let placeholders: Vec<i32> = (0..rows.len()).map(placeholder).collect();
        let pending = self.pending.take().expect("checked above");
        let events = self.apply(pending, &placeholders, now);
        self.unresolved = Some(Unresolved {
            step_id,
            rows,
            events,
        });
        Ok(())
    }

    /// Give step `step_id`, advanced, its sampled tokens (one per sequence in
    /// plan order, ignored where the plan does not sample): each replaces its
    /// placeholder; a stop token ends its request now. Returns the step's
    /// events as `commit` would have (requests that ended since the advance
    /// get no token), after the terminal events queued since the last
    /// delivery. StalePlan for a step that is not the unresolved one,
    /// InvalidState for ids that do not fit it; nothing changes then.
    pub fn resolve(&mut self, step_id: u64, sampled: &[i32], now: f64) -> KvResult<CommitEvents> {
        self.accept_now(now)?;
        let u = match &self.unresolved {
            Some(u) if u.step_id == step_id => u,
            Some(u) => {
                return Err(KvError::StalePlan(format!(
                    "step {step_id} resolved, step {} is the one advanced",
                    u.step_id
                )))
            }
            None => {
                return Err(KvError::StalePlan(format!(
                    "no step is advanced (step {step_id} already resolved?)"
                )))
            }
        };
        if sampled.len() != u.rows.len() {
            return Err(KvError::InvalidState(format!(
                "{} sampled ids for a plan of {} sequences",
                sampled.len(),
                u.rows.len()
            )));
        }
        let vocab = self.config.vocab_size.map_or(i64::MAX, i64::from);
        let bad = u
            .rows
            .iter()
            .zip(sampled)
            .position(|(&(_, _, samples), &t)| samples && (t < 0 || i64::from(t) >= vocab));
        if let Some(k) = bad {
            return Err(KvError::InvalidState(format!(
                "sampled id {} of sequence {k} is {}",
                sampled[k],
                if sampled[k] < 0 {
                    "negative".to_owned()
                } else {
                    format!("outside the vocabulary of {vocab}")
                }
            )));
        }
        let Unresolved {
            rows, mut events, ..
        } = self.unresolved.take().expect("checked above");
        // The real tokens where the placeholders are; stop tokens end now.
        let mut stopped = Vec::new();
        for (k, &(slab, id, samples)) in rows.iter().enumerate() {
            if samples && self.fill_placeholder(slab, id, placeholder(k), sampled[k]) {
                stopped.push(slab);
            }
        }
        // Its events: tokens of requests still live or finished by the
        // advance, with their real values.
        let deferred = std::mem::take(&mut self.deferred_stops);
        let ended_by_advance = |rid: u64| deferred.iter().any(|(id, _)| *id == rid);
        let (ids, tokens) = (std::mem::take(&mut events.request_ids), events.tokens);
        events.tokens = Vec::with_capacity(tokens.len());
        for (rid, t) in ids.into_iter().zip(tokens) {
            let k = usize::try_from(-i64::from(t) - 1).expect("a placeholder");
            if self.requests.slot_of(rid).is_some() || ended_by_advance(rid) {
                events.request_ids.push(rid);
                events.tokens.push(sampled[k]);
            }
        }
        let draining = self.lifecycle == Lifecycle::Draining;
        for f in events.finished.iter_mut() {
            let Some((_, stops)) = deferred.iter().find(|(id, _)| *id == f.id) else {
                continue;
            };
            let k = rows
                .iter()
                .position(|&(_, id, samples)| id == f.id && samples)
                .expect("the advance finished a row of its plan");
            f.output.push(sampled[k]);
            if stops.contains(&sampled[k]) {
                f.reason = FinishReason::Stop;
            }
            if draining {
                self.drain_finished.push(f.clone());
            }
        }
        for slab in stopped {
            let req = self.release(slab);
            self.tenants
                .get_mut(req.tenant)
                .count_end(true, now - req.arrival);
            let record = self.finished_record(&req, FinishReason::Stop, now);
            if draining {
                self.drain_finished.push(record.clone());
            }
            events.finished.push(record);
        }
        self.maybe_drained();
        self.clock = self.clock.max(now);
        if !self.ended.is_empty() {
            let mut all = std::mem::take(&mut self.ended);
            all.append(&mut events.finished);
            events.finished = all;
        }
        Ok(events)
    }

    /// Write `token` where request (`slab`, `id`) holds `placeholder`, if it
    /// is still live and holds it: its tail, or its token list, and the hot
    /// record a running decode plans from. Returns whether it is a stop token.
    fn fill_placeholder(&mut self, slab: usize, id: u64, placeholder: i32, token: i32) -> bool {
        let Some(r) = self.requests.get_mut_if(slab, id) else {
            return false;
        };
        let mut found = false;
        if let Place::Running(pos) = r.place {
            let (h, tail, _) = self.running.decode_mut(pos);
            if let Some(t) = tail.buf[..usize::from(tail.n)].last_mut() {
                if *t == placeholder {
                    *t = token;
                    found = true;
                }
            }
            if h.token == placeholder {
                h.token = token;
            }
        }
        if !found {
            match r.tokens.last_mut() {
                Some(t) if *t == placeholder => *t = token,
                // Its placeholder left with a recompute that never ran (a
                // preemption dropped it): nothing to fill.
                _ => return false,
            }
        }
        r.stop_token_ids.contains(&token)
    }
}
