//! Checkpoints: the unfinished requests a drain hands back, and submitting
//! them again elsewhere.

use super::*;

/// An unfinished request as a checkpoint holds it: enough to submit it again
/// elsewhere and finish it with the same tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct InFlight {
    pub id: u64,
    pub tenant: String,
    pub prompt: Vec<i32>,
    pub generated: Vec<i32>,
    pub max_tokens: usize,
    pub stop_token_ids: Vec<i32>,
    pub cache_salt: Option<Vec<u8>>,
    pub arrival: f64,
    /// "in_flight" (still running at the checkpoint) or "drain_deadline"
    /// (handed back when the drain's deadline came).
    pub reason: &'static str,
}

impl InFlight {
    /// Whether the record describes a request that can still run: tokens left
    /// to generate, no negative id, no stop token already generated.
    pub fn validate(&self) -> KvResult<()> {
        let bad = |why: String| {
            Err(KvError::InvalidRequest(format!(
                "restored request {}: {why}",
                self.id
            )))
        };
        if self.generated.len() >= self.max_tokens {
            return bad(format!(
                "{} tokens generated of max_tokens {}: it had finished",
                self.generated.len(),
                self.max_tokens
            ));
        }
        if self
            .generated
            .iter()
            .any(|t| self.stop_token_ids.contains(t))
        {
            return bad("it generated a stop token: it had finished".into());
        }
        if self.generated.iter().any(|&t| t < 0) {
            return bad("a generated token id is negative".into());
        }
        Ok(())
    }
}

impl Scheduler {
    /// What a checkpoint holds: requests finished since the drain began, and
    /// every unfinished one (handed back at the deadline, or still live).
    pub fn checkpoint(&self) -> (Vec<FinishedRequest>, Vec<InFlight>) {
        let mut in_flight = self.handed_back.clone();
        let mut live: Vec<&Request> = self.requests.iter().map(|(_, r)| r).collect();
        live.sort_by_key(|r| r.id);
        in_flight.extend(live.into_iter().map(|r| self.in_flight(r, "in_flight")));
        (self.drain_finished.clone(), in_flight)
    }

    pub(super) fn in_flight(&self, r: &Request, reason: &'static str) -> InFlight {
        InFlight {
            id: r.id,
            tenant: self.tenants.get(r.tenant).config.name.clone(),
            prompt: r.tokens[..r.prompt_len].to_vec(),
            generated: r.output().to_vec(),
            max_tokens: r.max_tokens,
            stop_token_ids: r.stop_token_ids.clone(),
            cache_salt: r.cache_salt.clone(),
            arrival: r.arrival,
            reason,
        }
    }

    /// Submit a request checkpointed elsewhere: its prompt, the tokens it had
    /// generated (they count toward `max_tokens` and lead its output) and its
    /// options. Admitted like any request (its final length is reserved).
    pub fn submit_restored(&mut self, record: &InFlight, now: f64) -> KvResult<u64> {
        record.validate()?;
        let opts = SubmitOptions {
            stop_token_ids: &record.stop_token_ids,
            cache_salt: record.cache_salt.as_deref(),
        };
        self.submit_inner(
            &record.tenant,
            &record.prompt,
            record.max_tokens,
            &opts,
            &record.generated,
            now,
        )
    }

    /// Submit every record of a checkpoint (see `submit_restored`), each one's
    /// outcome in order. Every record is checked first: one that can never run
    /// is an error and nothing is submitted; a refusal for now (pool full, ...)
    /// is that record's outcome.
    pub fn restore(
        &mut self,
        records: &[InFlight],
        now: f64,
    ) -> KvResult<Vec<Result<u64, Rejection>>> {
        for rec in records {
            rec.validate()?;
        }
        records
            .iter()
            .map(|rec| match self.submit_restored(rec, now) {
                Ok(id) => Ok(Ok(id)),
                Err(KvError::Rejected(r)) => Ok(Err(r)),
                Err(e) => Err(e),
            })
            .collect()
    }

    /// At the drain deadline (`now`): hand back every unfinished request, each
    /// with a terminal event (reason `DrainDeadline`, the tokens so far) and a
    /// record for the checkpoint. Counted as cancelled.
    pub(super) fn hand_back_all(&mut self, now: f64) {
        let mut ids: Vec<u64> = self.requests.ids().collect();
        ids.sort_unstable();
        for id in ids {
            let slab = self.requests.slot_of(id).expect("live id");
            let record = self.in_flight(self.requests.get(slab), "drain_deadline");
            let req = self.release(slab);
            self.tenants
                .get_mut(req.tenant)
                .count_end(FinishReason::DrainDeadline.is_finished(), now - req.arrival);
            self.handed_back.push(record);
            let ended = self.finished_record(&req, FinishReason::DrainDeadline, now);
            self.ended.push(ended);
        }
        self.maybe_drained();
    }
}
