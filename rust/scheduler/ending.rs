//! How a request ends outside a commit: cancelled, stopped by the host (a stop
//! string), and the queue of terminal events those endings (and the drain
//! deadline's hand-back) leave for the loop, each delivered exactly once.

use super::*;

impl Scheduler {
    /// Drop a live request wherever it is; pages and reservation go back at
    /// once. A plan already handed out may still list it: its commit skips it.
    /// Its terminal event (`Cancelled`, the tokens so far, ended at the latest
    /// `now` this scheduler was given) is queued (see `take_finished`).
    /// UnknownRequest for any id that is not live: the strict form of
    /// `cancel_at`, which tells a request that already ended apart.
    pub fn cancel(&mut self, id: u64) -> KvResult<Request> {
        let slab = self
            .requests
            .slot_of(id)
            .ok_or(KvError::UnknownRequest(id))?;
        let now = self.clock.max(self.requests.get(slab).arrival);
        self.end_by_caller(id, FinishReason::Cancelled, None, now)?
            .ok_or(KvError::UnknownRequest(id))
    }

    /// Cancel request `id` at `now` (see `cancel`): Ok(true) when it was live
    /// and is now cancelled, with a terminal event `Cancelled` queued;
    /// Ok(false) when it already ended on its own (finished in a commit, or
    /// handed back at the drain deadline): its terminal event exists, nothing
    /// changes, so a cancel racing the end of a request is not an error.
    /// UnknownRequest for an id never issued, or one the caller already ended
    /// (cancel or stop twice is a bug in the caller).
    pub fn cancel_at(&mut self, id: u64, now: f64) -> KvResult<bool> {
        Ok(self
            .end_by_caller(id, FinishReason::Cancelled, None, now)?
            .is_some())
    }

    /// End request `id` at `now` as finished, reason `Stop`: the host matched a
    /// stop string in its detokenized text. Counted as finished (not
    /// cancelled), its e2e latency observed; its terminal event (the tokens so
    /// far) is queued like a cancel's. Returns as `cancel_at` does: true when
    /// it was live, false when it already ended on its own; UnknownRequest for
    /// an id never issued or one the caller already ended.
    pub fn stop(&mut self, id: u64, now: f64) -> KvResult<bool> {
        Ok(self
            .end_by_caller(id, FinishReason::Stop, None, now)?
            .is_some())
    }

    /// End live request `id` as `Error`: the host could not serve it (its
    /// logits were not finite, an input id outside the vocabulary), `error`
    /// says why. Like `cancel_at` otherwise: its pages go back at once, it is
    /// counted as not finished, and its terminal event (carrying `error`) is
    /// delivered by the next commit or `take_finished`, so what the core
    /// reports and what the host tells its client agree. Returns and errs as
    /// `cancel_at` does.
    pub fn fail(&mut self, id: u64, error: String, now: f64) -> KvResult<bool> {
        Ok(self
            .end_by_caller(id, FinishReason::Error, Some(error), now)?
            .is_some())
    }

    /// End live request `id` for `reason` (Cancelled, Stop or Error, with the
    /// host's `error`) at `now`: release it, count it, queue its terminal
    /// event. Ok(None) for an id
    /// issued and already ended on its own; nothing changes then.
    fn end_by_caller(
        &mut self,
        id: u64,
        reason: FinishReason,
        error: Option<String>,
        now: f64,
    ) -> KvResult<Option<Request>> {
        self.accept_now(now)?;
        let Some(slab) = self.requests.slot_of(id) else {
            if !self.requests.issued(id) || self.caller_ended.contains(id) {
                return Err(KvError::UnknownRequest(id));
            }
            return Ok(None);
        };
        self.clock = self.clock.max(now);
        let req = self.release(slab);
        let record = FinishedRequest {
            error,
            ..self.finished_record(&req, reason, now)
        };
        self.tenants
            .get_mut(req.tenant)
            .count_end(reason.is_finished(), now - req.arrival);
        self.caller_ended.insert(id);
        if self.lifecycle == Lifecycle::Draining && reason.is_finished() {
            self.drain_finished.push(record.clone());
        }
        self.maybe_drained();
        self.ended.push(record);
        Ok(Some(req))
    }

    /// Terminal events of requests ended outside a commit (cancel, stop, the
    /// drain deadline) not yet delivered, in the order they ended. Each
    /// terminal event is delivered exactly once: by whichever comes first of
    /// this call and the next successful `commit` (in its `finished`). A loop
    /// whose `step` returned None (nothing to run) calls this.
    pub fn take_finished(&mut self) -> Vec<FinishedRequest> {
        std::mem::take(&mut self.ended)
    }

    /// Terminal events waiting for delivery (see `take_finished`).
    pub fn pending_finished(&self) -> usize {
        self.ended.len()
    }

    /// The terminal event of `req` (released) ending at `now` for `reason`.
    pub(super) fn finished_record(
        &self,
        req: &Request,
        reason: FinishReason,
        now: f64,
    ) -> FinishedRequest {
        FinishedRequest {
            id: req.id,
            tenant: self.tenants.get(req.tenant).config.name.clone(),
            reason,
            prompt_len: req.prompt_len,
            // A token not resolved yet (see overlap.rs) is not part of it.
            output: overlap::known(req.output()).to_vec(),
            arrival: req.arrival,
            first_scheduled: req.first_scheduled.unwrap_or(now),
            first_token: req.first_token.unwrap_or(now),
            finished: now,
            preemptions: req.preemptions,
            cached_tokens: req.cached_tokens,
            asked_max_tokens: req.asked_max_tokens,
            max_tokens: req.max_tokens,
            retry_after: (reason == FinishReason::Shed).then(|| self.ladder.config().retry_after_s),
            error: None,
        }
    }

    /// End live request `slab` as `Shed`: displaced at `now` by a request of
    /// tenant `by` (a higher tier) that `limit` ("concurrency" or "pool_full")
    /// would have refused. Its pages and reservation go back, it is counted
    /// (cancelled, and in `displaced`), a `Displaced` event is logged, and its
    /// terminal event is queued like a cancel's (see `take_finished`).
    pub(super) fn end_displaced(
        &mut self,
        slab: usize,
        by: TenantId,
        limit: &'static str,
        now: f64,
    ) {
        let req = self.release(slab);
        let record = self.finished_record(&req, FinishReason::Shed, now);
        let t = self.tenants.get_mut(req.tenant);
        t.count_end(false, now - req.arrival);
        let tenant = t.config.name.clone();
        self.displaced += 1;
        let by_tenant = self.tenants.get(by).config.name.clone();
        self.push_event(SchedulerEvent::Displaced {
            request: req.id,
            tenant,
            by_tenant,
            limit,
            ran: req.first_scheduled.is_some(),
            at: now,
        });
        self.ended.push(record);
    }
}
