//! Checkpoints: the unfinished requests a drain hands back, and submitting
//! them again elsewhere.

use super::*;

/// What a restore puts back when it takes its admissions back.
struct Saved {
    tenants: Tenants,
    rejected: [u64; RejectReason::COUNT],
    ladder: Ladder,
    events: EventLog,
    clock: f64,
}

/// The error of a restore some records of which were refused (`total`
/// records in all): every refused one, its id and why.
fn checkpoint_refusal(total: usize, refused: Vec<(u64, &'static str, String)>) -> KvError {
    let mut message = format!(
        "{} of {total} record(s) would be refused, so none was restored:",
        refused.len()
    );
    for (id, reason, why) in &refused {
        message.push_str(&format!(" request {id}: {reason} ({why});"));
    }
    message.pop();
    KvError::Checkpoint {
        message,
        refused: refused
            .into_iter()
            .map(|(id, reason, _)| (id, reason.to_owned()))
            .collect(),
    }
}

/// An unfinished request as a checkpoint holds it: enough to submit it again
/// elsewhere and finish it with the same tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct InFlight {
    pub id: u64,
    pub tenant: String,
    pub prompt: Vec<i32>,
    pub generated: Vec<i32>,
    pub max_tokens: usize,
    /// The max_tokens its caller asked for: more than `max_tokens` when the
    /// ladder's `cap_max_tokens` rung lowered it at admission. Restored as
    /// is, so the request still finishes marked capped
    /// (`FinishedRequest::max_tokens_capped`).
    pub asked_max_tokens: usize,
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
        if self.asked_max_tokens < self.max_tokens {
            return bad(format!(
                "asked_max_tokens {} is less than the max_tokens {} it was admitted with",
                self.asked_max_tokens, self.max_tokens
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
            generated: self.output_of(r),
            max_tokens: r.max_tokens,
            asked_max_tokens: r.asked_max_tokens,
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
        self.restore_one(record, true, now)
    }

    /// `submit_restored`, displacing lower tiers only when `displace`.
    fn restore_one(&mut self, record: &InFlight, displace: bool, now: f64) -> KvResult<u64> {
        record.validate()?;
        let opts = SubmitOptions {
            stop_token_ids: &record.stop_token_ids,
            cache_salt: record.cache_salt.as_deref(),
        };
        let id = self.submit_inner(
            &record.tenant,
            &record.prompt,
            record.max_tokens,
            &opts,
            Resumed {
                generated: &record.generated,
                displace,
            },
            now,
        )?;
        // What the caller asked for before a ladder capped it elsewhere: the
        // cap was told then (its event), so only the mark is carried over.
        if let Some(slab) = self.requests.slot_of(id) {
            let r = self.requests.get_mut(slab);
            r.asked_max_tokens = r.asked_max_tokens.max(record.asked_max_tokens);
        }
        Ok(id)
    }

    /// Submit every record of a checkpoint (see `submit_restored`), all or
    /// nothing; returns the new ids in record order.
    ///
    /// - A record that can never run (`InFlight::validate`) is an
    ///   InvalidRequest, checked before anything else.
    /// - A request id that appears twice, a tenant this scheduler does not
    ///   have, a scheduler that does not take requests now (warming up,
    ///   draining) and a request its tenant or `max_seq_len` refuses are found
    ///   without touching anything: a `Checkpoint` error names every such
    ///   record and why.
    /// - Then the records are submitted in order, each admitted like any
    ///   request (capacity, rate limit, ladder; each sees the ones before it).
    ///   If any is refused, the ones admitted are taken out again and the
    ///   scheduler's state is put back as it was (counters, tenants, ladder,
    ///   events): the error names every refused record. So that this holds,
    ///   a restore of several records displaces nobody: a record that only a
    ///   lower tier's displacement would let in is refused (a displaced
    ///   request has ended, and a later refusal could not give it back). A
    ///   restore of one record displaces like any submit; so does
    ///   `submit_restored`, one record at a time. What is not put back:
    ///   the request ids those admissions used are not issued again, and a
    ///   prefix-cache block a taken-out request had shared goes back to the end
    ///   of the eviction order.
    ///
    /// On an error nothing was restored and no refusal was counted.
    pub fn restore_all(&mut self, records: &[InFlight], now: f64) -> KvResult<Vec<u64>> {
        self.accept_now(now)?;
        for rec in records {
            rec.validate()?;
        }
        let refused = self.refuse_before_submitting(records);
        if !refused.is_empty() {
            return Err(checkpoint_refusal(records.len(), refused));
        }

        let saved = Saved {
            tenants: self.tenants.clone(),
            rejected: self.rejected,
            ladder: self.ladder.clone(),
            events: self.events.clone(),
            clock: self.clock,
        };
        let mut ids = Vec::with_capacity(records.len());
        let mut refused = Vec::new();
        let displace = records.len() == 1;
        for rec in records {
            match self.restore_one(rec, displace, now) {
                Ok(id) => ids.push(id),
                Err(KvError::Rejected(r)) => refused.push((rec.id, r.reason.as_str(), r.message)),
                Err(e) => {
                    self.take_back(&ids, saved);
                    return Err(e);
                }
            }
        }
        if refused.is_empty() {
            return Ok(ids);
        }
        self.take_back(&ids, saved);
        Err(checkpoint_refusal(records.len(), refused))
    }

    /// The records refused whatever the pool holds: a duplicated id, an
    /// unknown tenant, a scheduler not taking requests, a request its tenant
    /// or `max_seq_len` refuses. Changes nothing (no refusal is counted).
    fn refuse_before_submitting(&self, records: &[InFlight]) -> Vec<(u64, &'static str, String)> {
        let mut out = Vec::new();
        let mut seen = std::collections::HashSet::with_capacity(records.len());
        for rec in records {
            if !seen.insert(rec.id) {
                out.push((
                    rec.id,
                    "duplicate",
                    "the request id appears more than once".to_owned(),
                ));
                continue;
            }
            let Some(tid) = self.tenants.id(&rec.tenant) else {
                let why = format!("no tenant named {:?}", rec.tenant);
                out.push((rec.id, RejectReason::UnknownTenant.as_str(), why));
                continue;
            };
            if self.lifecycle != Lifecycle::Ready {
                let reason = match self.lifecycle {
                    Lifecycle::Cold | Lifecycle::Warming => RejectReason::NotReady,
                    _ => RejectReason::Draining,
                };
                let why = format!("the scheduler is {}", self.lifecycle.as_str());
                out.push((rec.id, reason.as_str(), why));
                continue;
            }
            let tenant = self.tenants.get(tid);
            let vocab = self.config.vocab_size;
            if let Err(r) = admission::check_request(
                tenant,
                self.config.max_seq_len,
                vocab,
                &rec.prompt,
                rec.max_tokens,
            )
            .and_then(|()| admission::check_vocab(tenant, vocab, &rec.generated, "generated token"))
            {
                out.push((rec.id, r.reason.as_str(), r.message));
            }
        }
        out
    }

    /// Undo the admissions of a restore that failed: take the requests `ids`
    /// out (their shared prefix pages go back to the pool) and put back what
    /// `saved` kept.
    fn take_back(&mut self, ids: &[u64], saved: Saved) {
        for &id in ids.iter().rev() {
            let Some(slab) = self.requests.slot_of(id) else {
                continue;
            };
            // Gives the pages back to the pool; the tenant's usage it also
            // adjusts is put back whole below.
            self.drop_all_pages(slab);
            self.requests.remove(slab);
        }
        self.tenants = saved.tenants;
        // The hits given back parked within the restored tenants' quotas,
        // unless a restored admission trimmed them away: trim to be sure.
        let tids: Vec<TenantId> = self.tenants.iter().map(|(t, _)| t).collect();
        for tid in tids {
            self.trim_cache(tid);
        }
        self.rejected = saved.rejected;
        self.ladder = saved.ladder;
        self.events = saved.events;
        self.clock = saved.clock;
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

#[cfg(test)]
mod tests {
    //! Restore is all or nothing: any refused record leaves the scheduler as
    //! it was (stats, counters, the next restore's outcome).
    use super::*;

    fn sched(num_blocks: usize, max_waiting: usize) -> Scheduler {
        let mut s = Scheduler::new(SchedulerConfig {
            num_blocks,
            block_size: 4,
            max_num_seqs: 4,
            max_batched_tokens: 64,
            max_seq_len: 64,
            overhead_reserve: 0.0,
            max_waiting,
            ..SchedulerConfig::default()
        })
        .unwrap();
        s.add_tenant(TenantConfig::new("a")).unwrap();
        s
    }

    fn rec(id: u64, tenant: &str, prompt_len: usize, max_tokens: usize) -> InFlight {
        InFlight {
            id,
            tenant: tenant.to_owned(),
            prompt: (1..=prompt_len as i32).collect(),
            generated: vec![7],
            max_tokens,
            asked_max_tokens: max_tokens,
            stop_token_ids: vec![],
            cache_salt: None,
            arrival: 0.0,
            reason: "in_flight",
        }
    }

    fn refused_of(e: KvError) -> Vec<(u64, String)> {
        match e {
            KvError::Checkpoint { refused, .. } => refused,
            other => panic!("not a checkpoint error: {other:?}"),
        }
    }

    #[test]
    fn good_records_are_all_restored_in_order() {
        let mut s = sched(65, 16);
        let ids = s
            .restore_all(&[rec(10, "a", 8, 8), rec(3, "a", 4, 4)], 0.0)
            .unwrap();
        assert_eq!(ids, vec![1, 2]);
        assert_eq!(s.live_requests(), 2);
        assert_eq!(s.request(1).unwrap().output(), &[7]);
    }

    #[test]
    fn a_duplicated_id_restores_nothing() {
        let mut s = sched(65, 16);
        let before = s.stats(0.0);
        let e = s
            .restore_all(
                &[rec(5, "a", 4, 4), rec(6, "a", 4, 4), rec(5, "a", 4, 4)],
                0.0,
            )
            .unwrap_err();
        assert_eq!(refused_of(e), vec![(5, "duplicate".to_owned())]);
        assert_eq!(s.stats(0.0), before);
        assert_eq!(s.live_requests(), 0);
    }

    #[test]
    fn unknown_tenants_and_too_long_records_are_all_named_and_nothing_runs() {
        let mut s = sched(65, 16);
        let before = s.stats(0.0);
        let records = [
            rec(1, "a", 4, 4),
            rec(2, "ghost", 4, 4),
            rec(3, "a", 60, 10),
            rec(4, "a", 4, 4),
            rec(5, "ghost", 4, 4),
        ];
        let e = s.restore_all(&records, 0.0).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("3 of 5 record(s)"), "{msg}");
        assert_eq!(
            refused_of(e),
            vec![
                (2, "unknown_tenant".to_owned()),
                (3, "too_long".to_owned()),
                (5, "unknown_tenant".to_owned()),
            ]
        );
        assert_eq!(s.stats(0.0), before, "no refusal is counted");
        assert_eq!(s.live_requests(), 0);
    }

    #[test]
    fn a_capacity_refusal_takes_back_every_admission() {
        // 16 usable blocks: three requests of 6 blocks do not fit.
        let mut s = sched(17, 16);
        s.submit("a", &[1, 2, 3], 1, 0.0).unwrap();
        let before = s.stats(0.0);
        let records = [
            rec(1, "a", 12, 12),
            rec(2, "a", 12, 12),
            rec(3, "a", 12, 12),
        ];
        let e = s.restore_all(&records, 0.0).unwrap_err();
        assert_eq!(refused_of(e), vec![(3, "pool_full".to_owned())]);
        assert_eq!(
            s.stats(0.0),
            before,
            "counters, reservations and queues as before"
        );
        assert_eq!(s.live_requests(), 1);
        s.check_invariants().unwrap();
        // Room for two: both restored, and the pool still works.
        let ids = s.restore_all(&records[..2], 0.0).unwrap();
        assert_eq!(ids.len(), 2);
        s.check_invariants().unwrap();
    }

    #[test]
    fn the_live_request_limit_is_a_refusal_of_the_whole_restore() {
        let mut s = sched(257, 0);
        let before = s.stats(0.0);
        let records: Vec<InFlight> = (1..=5).map(|i| rec(i, "a", 4, 4)).collect();
        let e = s.restore_all(&records, 0.0).unwrap_err();
        assert_eq!(refused_of(e), vec![(5, "concurrency".to_owned())]);
        assert_eq!(s.stats(0.0), before);
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_restore_of_several_records_displaces_nobody_so_a_refusal_changes_nothing() {
        // Four lower-tier requests wait and take every live slot (max_num_seqs
        // 4, max_waiting 0); "top" may hold one request at a time.
        let mut s = sched(257, 0);
        let mut low = TenantConfig::new("low");
        low.tier = 2;
        s.add_tenant(low).unwrap();
        let mut top = TenantConfig::new("top");
        top.max_concurrent = Some(1);
        s.add_tenant(top).unwrap();
        for _ in 0..4 {
            s.submit("low", &[1, 2, 3], 4, 0.0).unwrap();
        }
        let before = s.stats(0.0);
        // The first record would get in by displacing a "low" request; the
        // second is refused by its tenant's own limit.
        let e = s
            .restore_all(&[rec(1, "top", 4, 4), rec(2, "top", 4, 4)], 0.0)
            .unwrap_err();
        let refused = refused_of(e);
        assert_eq!(refused.len(), 2, "{refused:?}");
        assert_eq!(s.stats(0.0), before, "nobody displaced, nothing counted");
        assert_eq!(s.live_requests(), 4);
        assert!(s.take_finished().is_empty(), "no request ended");
        s.check_invariants().unwrap();
        // One record displaces like any submit.
        let ids = s.restore_all(&[rec(1, "top", 4, 4)], 0.0).unwrap();
        assert_eq!(ids.len(), 1);
        let ended = s.take_finished();
        assert_eq!(ended.len(), 1);
        assert_eq!(
            (ended[0].tenant.as_str(), ended[0].reason),
            ("low", FinishReason::Shed)
        );
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_draining_scheduler_refuses_every_record() {
        let mut s = sched(65, 16);
        s.drain(10.0).unwrap();
        let e = s.restore_all(&[rec(1, "a", 4, 4)], 0.0).unwrap_err();
        assert_eq!(refused_of(e), vec![(1, "draining".to_owned())]);
    }
}
