//! `submit`: a request checked and admitted into its tenant's queue, or
//! refused. Its stages, in the order a request meets them, each a function:
//!
//! 1. `gate`: what refuses a request before the ladder reads the pressure:
//!    the time, the tenant, the lifecycle, then the request itself;
//! 2. `apply_ladder`: the ladder moves, and its effects set the request's
//!    terms (a capped max_tokens) and the capacity it is decided against;
//! 3. `decide` (`admission::decide`), with displace-and-retry on a global
//!    limit lower tiers hold (`admit_or_displace`, in displace.rs);
//! 4. `charge_admitted`: the tenant pays (reservation, rate, shared hits);
//! 5. `enqueue`: the `Request` built and appended to its tenant's queue.
//!
//! Which check comes first decides which reason a refused request gets, so
//! the order above is part of the behaviour. A refusal (`reject`) changes
//! nothing but the rejection counters.

use super::*;

/// What a request may carry beside its prompt.
#[derive(Clone, Copy, Debug, Default)]
pub struct SubmitOptions<'a> {
    /// Sampling one of these finishes the request (the token is part of the output).
    pub stop_token_ids: &'a [i32],
    /// Mixed into the request's prefix-cache namespace: only requests with the
    /// same salt (in the same namespace) share its blocks.
    pub cache_salt: Option<&'a [u8]>,
}

/// Where a submitted request comes from: new, or restored from a checkpoint
/// with the tokens it generated.
#[derive(Clone, Copy)]
pub(super) struct Resumed<'a> {
    pub(super) generated: &'a [i32],
    /// Whether lower tiers may be displaced to admit it (see displace.rs).
    pub(super) displace: bool,
}

impl Resumed<'_> {
    const NEW: Resumed<'static> = Resumed {
        generated: &[],
        displace: true,
    };
}

/// A request past the gate, with the terms the ladder left it: what
/// admission decides on and the `Request` is built from.
#[derive(Clone, Copy)]
pub(super) struct Submission<'a> {
    pub(super) tid: TenantId,
    pub(super) prompt: &'a [i32],
    /// Tokens it generated elsewhere (restored from a checkpoint); they lead
    /// its output.
    pub(super) generated: &'a [i32],
    /// max_tokens as admitted (the ladder may have capped it) and as asked.
    pub(super) max_tokens: usize,
    pub(super) asked: usize,
    pub(super) now: f64,
}

/// The prefix lookup admission makes when it consults the pool: the cached
/// pages of the prompt's prefix, the naming stream past them, and how many
/// of them are already held by the tenant's own requests (shared, so not
/// charged twice).
pub(super) struct PrefixHits {
    pub(super) pages: Vec<u32>,
    pub(super) chain: BlockChain,
    pub(super) newly_shared: usize,
    /// The other KV-cache groups' tables (hybrid models; None otherwise):
    /// their hits, and the request's tables once admitted.
    pub(super) groups: GroupHits,
}

impl PrefixHits {
    /// No hits yet, the stream at `chain` (a namespace's root), `groups` the
    /// empty tables of a hybrid model's request.
    fn at(chain: BlockChain, groups: GroupHits) -> Self {
        PrefixHits {
            pages: Vec::new(),
            chain,
            newly_shared: 0,
            groups,
        }
    }

    /// Forget a lookup (keeping the page list's room): no hits, the stream
    /// back at `chain`.
    pub(super) fn reset(&mut self, chain: BlockChain) {
        self.pages.clear();
        self.chain = chain;
        self.newly_shared = 0;
        if let Some(g) = &mut self.groups {
            g.take_pages();
        }
    }

    /// Pages the hits hold over every group.
    fn held(&self) -> usize {
        self.pages.len() + self.groups.as_ref().map_or(0, |g| g.held())
    }
}

impl Scheduler {
    /// Admit a request or say why not. A rejection changes nothing but the
    /// rejection counters.
    pub fn submit(
        &mut self,
        tenant: &str,
        prompt: &[i32],
        max_tokens: usize,
        now: f64,
    ) -> KvResult<u64> {
        self.submit_with_stops(tenant, prompt, max_tokens, &[], now)
    }

    /// `submit` with stop tokens: sampling one of them finishes the request.
    pub fn submit_with_stops(
        &mut self,
        tenant: &str,
        prompt: &[i32],
        max_tokens: usize,
        stop_token_ids: &[i32],
        now: f64,
    ) -> KvResult<u64> {
        let opts = SubmitOptions {
            stop_token_ids,
            cache_salt: None,
        };
        self.submit_with(tenant, prompt, max_tokens, &opts, now)
    }

    /// `submit` with options. The longest cached prefix of the prompt in the
    /// request's namespace (all but its last token at most, so there are logits
    /// to sample) is shared at once: prefill starts after it.
    pub fn submit_with(
        &mut self,
        tenant: &str,
        prompt: &[i32],
        max_tokens: usize,
        opts: &SubmitOptions<'_>,
        now: f64,
    ) -> KvResult<u64> {
        self.submit_inner(tenant, prompt, max_tokens, opts, Resumed::NEW, now)
    }

    /// `submit_with`, for a request that already generated `from.generated`
    /// tokens elsewhere: they lead its output, and the ladder's max_tokens
    /// cap does not apply (it was admitted before, with its max_tokens).
    /// The stages, in order (see the module doc).
    pub(super) fn submit_inner(
        &mut self,
        tenant: &str,
        prompt: &[i32],
        max_tokens: usize,
        opts: &SubmitOptions<'_>,
        from: Resumed<'_>,
        now: f64,
    ) -> KvResult<u64> {
        let tid = self.gate(tenant, prompt, max_tokens, from.generated, now)?;
        let (sub, capacity) = self.apply_ladder(tid, prompt, max_tokens, from.generated, now);
        let namespace = self
            .kv
            .namespace(tid, self.tenants.get(tid), opts.cache_salt);
        let groups = self.kv.new_group_pages(self.config.long_prefill_chunk);
        let mut hits = PrefixHits::at(self.kv.chain(namespace.root), groups);
        let admit =
            self.admit_or_displace(&sub, &capacity, namespace.root, from.displace, &mut hits)?;
        self.charge_admitted(&sub, &admit, &hits)?;
        Ok(self.enqueue(&sub, opts, admit.blocks, hits, namespace))
    }

    /// What refuses a request before the ladder reads the pressure, in this
    /// order: a `now` that is no time (an error, not a refusal), an unknown
    /// tenant, a scheduler that takes no requests (warming up, draining),
    /// then what is wrong with the request itself (its length, an id outside
    /// the vocabulary, in its prompt or its `generated` tokens). Returns the
    /// tenant. Such a refusal moves nothing but its counters.
    fn gate(
        &mut self,
        tenant: &str,
        prompt: &[i32],
        max_tokens: usize,
        generated: &[i32],
        now: f64,
    ) -> KvResult<TenantId> {
        self.accept_now(now)?;
        let Some(tid) = self.tenants.id(tenant) else {
            return Err(self.reject(
                None,
                Rejection {
                    reason: RejectReason::UnknownTenant,
                    retry_after: None,
                    tenant: Some(tenant.to_owned()),
                    message: format!("no tenant named {tenant:?}"),
                    permanent: true,
                },
            ));
        };
        if self.lifecycle != Lifecycle::Ready {
            let (reason, why) = match self.lifecycle {
                Lifecycle::Cold | Lifecycle::Warming => (RejectReason::NotReady, "warming up"),
                _ => (RejectReason::Draining, "draining: no new requests"),
            };
            let retry_after = Some(self.config.retry_after_hint_s);
            return Err(self.reject(
                Some(tid),
                Rejection {
                    reason,
                    retry_after,
                    tenant: Some(tenant.to_owned()),
                    message: why.to_owned(),
                    permanent: false,
                },
            ));
        }
        // What is wrong with the request itself is refused before the ladder
        // reads the pressure: such a refusal moves nothing but its counter.
        let vocab = self.config.vocab_size;
        if let Err(rejection) = admission::check_request(
            self.tenants.get(tid),
            self.config.max_seq_len,
            vocab,
            prompt,
            max_tokens,
        )
        .and_then(|()| {
            admission::check_vocab(self.tenants.get(tid), vocab, generated, "generated token")
        }) {
            return Err(self.reject(Some(tid), rejection));
        }
        Ok(tid)
    }

    /// Move the ladder for `now` and apply its effects to a request of `tid`
    /// that passed the gate: its terms (max_tokens capped, unless it was
    /// generated elsewhere or its tier is spared) and the capacity admission
    /// decides it against (the tier the ladder sheds, whether it rejects
    /// fast what would wait, and the pool's and the limits' state now).
    fn apply_ladder<'a>(
        &mut self,
        tid: TenantId,
        prompt: &'a [i32],
        max_tokens: usize,
        generated: &'a [i32],
        now: f64,
    ) -> (Submission<'a>, Capacity) {
        self.update_ladder(now);
        let effects = self.ladder.effects();
        // The ladder degrades the lower tiers and spares the top one: the
        // max_tokens cap and reject-fast apply to every tier but the top (to
        // everyone when all tenants share one tier), shedding to the lowest.
        let (top, lowest) = self.tier_range();
        let tier = self.tenants.get(tid).config.tier;
        let spared = top < lowest && tier == top;
        let asked = max_tokens;
        let max_tokens = match effects.cap_max_tokens {
            Some(c) if generated.is_empty() && !spared => max_tokens.min(c),
            _ => max_tokens,
        };
        // The lowest tier, never the only one.
        let shed_tier = (effects.shed_lowest_tier && top < lowest).then_some(lowest);
        // What the request reserves over the KV-cache groups (one group:
        // ceil(len / block_size)), at its final length and at its prompt's.
        let chunk = self.config.long_prefill_chunk;
        let final_len = prompt.len() + max_tokens;
        let capacity = Capacity {
            final_blocks: self.kv.reserve_for(final_len, chunk),
            // Over-commit reserves the prompt's and a watermark (reserve mode
            // never reads it).
            prompt_blocks: if self.config.admission.preempts_for_pages() {
                self.kv.reserve_for(prompt.len(), chunk)
            } else {
                0
            },
            shed_tier,
            reject_fast_would_wait: effects.reject_fast && !spared && self.would_wait(tid),
            shed_retry_after: self.ladder.config().retry_after_s,
            block_size: self.config.block_size,
            max_seq_len: self.config.max_seq_len,
            usable_blocks: self.usable_blocks(),
            committed_blocks: self.tenants.committed(),
            live_requests: self.requests.len(),
            // Saturating: a huge max_waiting means no limit but the pool's.
            max_live_requests: self
                .config
                .max_num_seqs
                .saturating_add(self.config.max_waiting),
            overcommit_watermark_blocks: self.config.admission.watermark_blocks(),
        };
        let sub = Submission {
            tid,
            prompt,
            generated,
            max_tokens,
            asked,
            now,
        };
        (sub, capacity)
    }

    /// `admission::decide` for `sub` now, against `capacity`. `hits`
    /// receives the prefix lookup (when the pool is consulted); `room` the
    /// room a capacity refusal waits for.
    pub(super) fn decide(
        &self,
        sub: &Submission<'_>,
        capacity: &Capacity,
        hits: &mut PrefixHits,
        room: &mut Option<Room>,
    ) -> Result<admission::Admission, Rejection> {
        let kv = &self.kv;
        let Submission {
            tid,
            prompt,
            max_tokens,
            now,
            ..
        } = *sub;
        let PrefixHits {
            pages,
            chain,
            newly_shared,
            groups,
        } = hits;
        admission::decide(
            self.tenants.get(tid),
            capacity,
            prompt,
            max_tokens,
            now,
            || {
                // Over-committed, waiting requests must not pin pages (nothing
                // could preempt them): the lookup waits for entry.
                *newly_shared = kv.lookup_at_submit(tid, prompt, pages, chain, groups);
                *newly_shared
            },
            |r| {
                *room = Some(r);
                self.room_wait(tid, r)
            },
        )
    }

    /// Charge an admitted request to its tenant: an idle tenant rejoins its
    /// tier's fair share, then its reservation, its rate and its prefix
    /// lookup are counted, and the cache hits are shared at once; what its
    /// tenant keeps cached is then trimmed to the quota the new reservation
    /// leaves.
    fn charge_admitted(
        &mut self,
        sub: &Submission<'_>,
        admit: &admission::Admission,
        hits: &PrefixHits,
    ) -> KvResult<()> {
        let tid = sub.tid;
        // An idle tenant rejoins at the lowest virtual time of its tier's active
        // tenants: it gets its fair share from now on, not a credit for the past.
        if self.tenants.get(tid).live_requests == 0 {
            let tier = self.tenants.get(tid).config.tier;
            let floor = self
                .tenants
                .iter()
                .filter(|(_, t)| t.config.tier == tier && t.live_requests > 0)
                .map(|(_, t)| t.vtime)
                .fold(f64::INFINITY, f64::min);
            self.tenants.get_mut(tid).rejoin(floor);
        }
        self.tenants.reserve(tid, admit.blocks);
        let cached_tokens = hits.pages.len() * self.config.block_size;
        let t = self.tenants.get_mut(tid);
        t.admit(sub.prompt.len(), admit.rate_cost, sub.now);
        if self.kv.shares_at_submit() {
            t.count_prefix_lookup(sub.prompt.len(), cached_tokens, self.config.block_size);
        }
        if !hits.pages.is_empty() {
            t.hold_pages(hits.held());
            self.kv.share_hits(&hits.pages, &hits.groups)?;
            self.tenants.share(tid, hits.newly_shared, 0);
        }
        // Its new reservation comes out of the unused floor its cached
        // blocks were kept in (partitioned).
        self.trim_cache(tid);
        Ok(())
    }

    /// The admitted request, built and appended to its tenant's queue: its
    /// prompt and generated tokens, its cached prefix's pages (computed
    /// already) and its naming stream past them, `blocks` reserved. A
    /// max_tokens the ladder capped is told as an event. Returns its id.
    fn enqueue(
        &mut self,
        sub: &Submission<'_>,
        opts: &SubmitOptions<'_>,
        blocks: usize,
        hits: PrefixHits,
        namespace: Namespace,
    ) -> u64 {
        let Submission {
            tid,
            prompt,
            generated,
            max_tokens,
            asked,
            now,
        } = *sub;
        let id = self.requests.next_id();
        self.clock = self.clock.max(now);
        let cached_tokens = hits.pages.len() * self.config.block_size;
        let mut tokens = Vec::with_capacity(prompt.len() + max_tokens);
        tokens.extend_from_slice(prompt);
        tokens.extend_from_slice(generated);
        let req = Request {
            id,
            tenant: tid,
            tokens,
            prompt_len: prompt.len(),
            max_tokens,
            stop_token_ids: opts.stop_token_ids.to_vec(),
            reserved_blocks: blocks,
            pages: hits.pages,
            num_computed: cached_tokens,
            chain: hits.chain,
            namespace,
            cached_tokens,
            place: Place::Queued,
            arrival: now,
            first_scheduled: None,
            first_token: None,
            last_token_at: -1.0,
            live: Live::Yes,
            preemptions: 0,
            cache_salt: opts.cache_salt.map(<[u8]>::to_vec),
            waiting_since: now,
            asked_max_tokens: asked,
            groups: hits.groups,
        };
        let slab = self.requests.insert(req);
        self.tenants.get_mut(tid).waiting.push_back(slab);
        if max_tokens < asked {
            let tenant = self.tenants.get(tid).config.name.clone();
            self.push_event(SchedulerEvent::MaxTokensCapped {
                request: id,
                tenant,
                asked,
                admitted: max_tokens,
                at: now,
            });
        }
        id
    }

    /// Count a refusal (for its tenant too, when it has one) and turn it into
    /// the error `submit` returns. A refusal changes nothing else.
    pub(super) fn reject(&mut self, tid: Option<TenantId>, rejection: Rejection) -> KvError {
        let reason = rejection.reason;
        if let Some(tid) = tid {
            self.tenants.get_mut(tid).count_rejection(reason);
        }
        self.rejected[reason.index()] += 1;
        KvError::Rejected(rejection)
    }
}
