//! Admission: may this request start, and what does it hold while it lives?
//!
//! Default mode, "reserve": a request is admitted only if its final length,
//! ceil((prompt + max_tokens) / block_size) blocks, fits everywhere it must: the
//! tenant's cap, and the usable pool (total less the overhead reserve) without
//! touching another tenant's unused floor. The sum of reservations then never
//! exceeds what exists, so an admitted request never fails to get a page.
//!
//! Over-commit mode (opt-in) reserves the prompt plus a watermark instead; the
//! scheduler then preempts (and later recomputes) when pages run out.
//!
//! The checks run from the most permanent to the most passing (an invalid request
//! is invalid forever; a rate limit clears in seconds) and none of them changes
//! anything: the caller applies an `Admission` only once every check passed.

use crate::error::{RejectReason, Rejection};
use crate::tenant::Tenant;

/// What the scheduler knows of itself at the moment of the decision.
#[derive(Clone, Copy, Debug)]
pub struct Capacity {
    pub block_size: usize,
    /// Blocks the request reserves at its final length (prompt + max_tokens)
    /// over the model's KV-cache groups: ceil(len / block_size) for a model
    /// with one group (see crate::groups).
    pub final_blocks: usize,
    /// The same at its prompt's length (over-commit reserves that plus the
    /// watermark).
    pub prompt_blocks: usize,
    pub max_seq_len: usize,
    /// Pool pages less the overhead reserve.
    pub usable_blocks: usize,
    /// Sum over tenants of max(reserved, floor).
    pub committed_blocks: usize,
    /// Live (admitted, unfinished) requests, all tenants.
    pub live_requests: usize,
    /// Most live requests the scheduler holds (running set plus waiting queue).
    pub max_live_requests: usize,
    /// Over-commit mode: reserve the prompt plus this many blocks instead of the
    /// final length (None: reserve mode).
    pub overcommit_watermark_blocks: Option<usize>,
    /// The degradation ladder sheds new requests of this tier.
    pub shed_tier: Option<u32>,
    /// The ladder rejects fast, and this request could not start running now.
    pub reject_fast_would_wait: bool,
    /// `retry_after` of a request the ladder sheds.
    pub shed_retry_after: f64,
}

/// What must end before a request refused for capacity could pass. The
/// scheduler turns it into a `retry_after` from what is running (see
/// `Scheduler::room_wait`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Room {
    /// The tenant's reservations must shrink by this many blocks (its cap).
    TenantBlocks(usize),
    /// The tenant's live requests must shrink by this many (its max_concurrent).
    TenantRequests(usize),
    /// The scheduler's live requests must shrink by this many.
    Requests(usize),
    /// The pool must make room for `blocks` more blocks of this tenant, of
    /// which `shared` (its own pages already held, counted once) cost nothing.
    Pool { blocks: usize, shared: usize },
}

/// A decision to admit: what to charge.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Admission {
    /// Blocks reserved for the request's whole life.
    pub blocks: usize,
    /// Tokens taken from the tenant's rate-limit bucket.
    pub rate_cost: f64,
}

fn reject(
    tenant: &Tenant,
    reason: RejectReason,
    retry_after: Option<f64>,
    message: String,
) -> Rejection {
    Rejection {
        reason,
        retry_after,
        tenant: Some(tenant.config.name.clone()),
        message,
        // What is wrong with the request itself stays wrong; a limit it can never
        // fit is marked at its site (`Rejection::forever`).
        permanent: matches!(reason, RejectReason::Invalid | RejectReason::TooLong),
    }
}

/// What one pass over a list of ids finds: whether any is negative, and
/// whether every one is below `vocab` (true when there is no vocabulary). A
/// sign bit in the OR of the ids, and in the AND of `id - vocab` (no wrap for
/// ids >= 0 and a vocabulary below 2^31): reductions that vectorize on any
/// x86-64, where a signed max needs SSE4.1. Positions are looked for only
/// when a test fails.
fn scan_ids(ids: &[i32], vocab: Option<u32>) -> (bool, bool) {
    let Some(v) = vocab.and_then(|v| i32::try_from(v).ok()) else {
        // No vocabulary, or one of 2^31 ids or more (every int32 >= 0 is in).
        return (ids.iter().fold(0i32, |o, &t| o | t) < 0, true);
    };
    let (below, any) = ids
        .iter()
        .fold((-1i32, 0i32), |(a, o), &t| (a & t.wrapping_sub(v), o | t));
    let negative = any < 0;
    // With negatives present the AND proves nothing: the caller refuses them
    // first, or `first_outside` looks.
    (negative, below < 0 && !negative)
}

/// The first id of `ids` at or above `vocab` as a refusal `invalid` naming
/// `what` (e.g. "prompt token"); None when there is none.
fn first_outside(tenant: &Tenant, vocab: u32, ids: &[i32], what: &str) -> Option<Rejection> {
    let at = ids.iter().position(|&t| i64::from(t) >= i64::from(vocab))?;
    Some(reject(
        tenant,
        RejectReason::Invalid,
        None,
        format!(
            "{what} {at} is {}, outside the vocabulary of {vocab} (ids 0..={})",
            ids[at],
            vocab - 1
        ),
    ))
}

/// The first id of `ids` at or above `vocab_size` (None: no vocabulary), as a
/// refusal `invalid` naming `what` (e.g. "generated token"). Negative ids are
/// not this check's to refuse.
pub fn check_vocab(
    tenant: &Tenant,
    vocab_size: Option<u32>,
    ids: &[i32],
    what: &str,
) -> Result<(), Rejection> {
    match vocab_size {
        Some(vocab) if !scan_ids(ids, vocab_size).1 => {
            first_outside(tenant, vocab, ids, what).map_or(Ok(()), Err)
        }
        _ => Ok(()),
    }
}

/// The checks that depend on the request alone, in this order: empty prompt,
/// max_tokens 0, a negative id, too long, a prompt id outside the vocabulary
/// (`vocab_size`; None: not checked). A request that fails one fails it
/// forever. The prompt is read once for both id checks.
pub fn check_request(
    tenant: &Tenant,
    max_seq_len: usize,
    vocab_size: Option<u32>,
    prompt: &[i32],
    max_tokens: usize,
) -> Result<(), Rejection> {
    use RejectReason::*;
    if prompt.is_empty() {
        return Err(reject(tenant, Invalid, None, "empty prompt".into()));
    }
    if max_tokens == 0 {
        return Err(reject(
            tenant,
            Invalid,
            None,
            "max_tokens must be at least 1".into(),
        ));
    }
    let (negative, inside) = scan_ids(prompt, vocab_size);
    if let Some(at) = negative
        .then(|| prompt.iter().position(|&t| t < 0))
        .flatten()
    {
        return Err(reject(
            tenant,
            Invalid,
            None,
            format!("prompt token {at} is negative ({})", prompt[at]),
        ));
    }
    let final_len = prompt.len().saturating_add(max_tokens);
    if final_len > max_seq_len {
        return Err(reject(
            tenant,
            TooLong,
            None,
            format!(
                "prompt ({}) + max_tokens ({max_tokens}) = {final_len} exceeds max_seq_len \
                 ({max_seq_len})",
                prompt.len(),
            ),
        ));
    }
    match vocab_size {
        Some(vocab) if !inside => {
            first_outside(tenant, vocab, prompt, "prompt token").map_or(Ok(()), Err)
        }
        _ => Ok(()),
    }
}

/// Decide on a request of `tenant` for `prompt` plus up to `max_tokens` new
/// tokens, which passed `check_request`.
///
/// `shared_hits` is asked (once, only when the pool must be consulted) how many
/// of the request's prefix-cache hits are pages of the tenant's own namespace
/// that another of its requests already holds: the tenant's cap counts those
/// pages again, the pool does not.
///
/// `room_wait` is asked (at most once) for the `retry_after` of a refusal for
/// capacity that can pass once something ends (tenant_budget, concurrency,
/// pool_full); refusals that can never pass carry None.
pub fn decide(
    tenant: &Tenant,
    cap: &Capacity,
    prompt: &[i32],
    max_tokens: usize,
    now: f64,
    shared_hits: impl FnOnce() -> usize,
    room_wait: impl FnOnce(Room) -> Option<f64>,
) -> Result<Admission, Rejection> {
    use RejectReason::*;
    let name = &tenant.config.name;

    // The caller ran check_request (before reading the ladder's pressure).
    debug_assert!(check_request(tenant, cap.max_seq_len, None, prompt, max_tokens).is_ok());
    let final_len = prompt.len() + max_tokens;
    // The ladder: passing, but cheaper than anything below it.
    if cap.shed_tier == Some(tenant.config.tier) {
        return Err(reject(
            tenant,
            Shed,
            Some(cap.shed_retry_after),
            format!(
                "overloaded: tier {} (the lowest) is not admitted for now",
                tenant.config.tier
            ),
        ));
    }
    if cap.reject_fast_would_wait {
        return Err(reject(
            tenant,
            Shed,
            Some(cap.shed_retry_after),
            "overloaded: only requests that can start at once are admitted".into(),
        ));
    }

    let final_blocks = cap.final_blocks;
    let blocks = match cap.overcommit_watermark_blocks {
        None => final_blocks,
        // Saturating: a watermark past the final length reserves the final length.
        Some(w) => cap.prompt_blocks.saturating_add(w).min(final_blocks),
    };

    // A configured cap counts every page a request references, shared or not;
    // without one, only the pool (which counts shared pages once) bounds the
    // tenant, and no single request may exceed it.
    let tenant_cap = tenant.cap(cap.usable_blocks);
    let held = match tenant.config.kv_cap_blocks {
        Some(_) => tenant.reserved_blocks,
        None => 0,
    };
    if held.saturating_add(blocks) > tenant_cap {
        let never = blocks > tenant_cap;
        let wait = if never {
            None
        } else {
            room_wait(Room::TenantBlocks(held + blocks - tenant_cap))
        };
        let refusal = reject(
            tenant,
            TenantBudget,
            wait,
            if never {
                format!("request needs {blocks} blocks, more than tenant {name:?}'s cap of {tenant_cap}")
            } else {
                format!(
                    "request needs {blocks} blocks; tenant {name:?} holds {} of its cap of {tenant_cap}",
                    tenant.reserved_blocks
                )
            },
        );
        return Err(if never { refusal.forever() } else { refusal });
    }

    if cap.overcommit_watermark_blocks.is_some() && final_blocks > cap.usable_blocks {
        // Over-committed, the reservation is smaller than the final length; a
        // request longer than the whole pool would preempt itself forever.
        return Err(reject(
            tenant,
            PoolFull,
            None,
            format!(
                "request needs {final_blocks} blocks at its final length, more than the \
                 {} usable blocks of the pool",
                cap.usable_blocks
            ),
        )
        .forever());
    }

    if let Some(max) = tenant.config.max_concurrent {
        if tenant.live_requests >= max {
            let excess = (tenant.live_requests - max) as usize + 1;
            return Err(reject(
                tenant,
                Concurrency,
                room_wait(Room::TenantRequests(excess)),
                format!("tenant {name:?} has {max} live request(s), its limit"),
            ));
        }
    }
    if cap.live_requests >= cap.max_live_requests {
        let excess = cap.live_requests - cap.max_live_requests + 1;
        return Err(reject(
            tenant,
            Concurrency,
            room_wait(Room::Requests(excess)),
            format!(
                "the scheduler holds {} live requests, its limit",
                cap.live_requests
            ),
        ));
    }

    // The pool: this tenant's footprint grows from max(reserved - shared, floor)
    // to max(reserved + blocks - shared - newly shared, floor); everyone else's
    // footprint is unchanged.
    let shared = tenant.shared_blocks + shared_hits();
    let grown = (tenant.reserved_blocks.saturating_add(blocks))
        .saturating_sub(shared)
        .max(tenant.config.kv_floor_blocks);
    let committed_after = (cap.committed_blocks - tenant.footprint()).saturating_add(grown);
    if committed_after > cap.usable_blocks {
        let free_now = cap.usable_blocks.saturating_sub(cap.committed_blocks);
        return Err(reject(
            tenant,
            PoolFull,
            room_wait(Room::Pool { blocks, shared }),
            format!(
                "request needs {blocks} blocks; {free_now} of {} usable blocks are unpromised",
                cap.usable_blocks
            ),
        ));
    }

    let rate_cost = final_len as f64;
    if let Some(bucket) = &tenant.bucket {
        if let Err(wait) = bucket.check(rate_cost, now) {
            let message = match wait {
                Some(w) => format!("tenant {name:?} is over its token rate; retry in {w:.3} s"),
                None => format!(
                    "request asks for {final_len} tokens, more than tenant {name:?}'s burst allows"
                ),
            };
            let refusal = reject(tenant, RateLimited, wait, message);
            return Err(if wait.is_none() {
                refusal.forever()
            } else {
                refusal
            });
        }
    }

    Ok(Admission { blocks, rate_cost })
}

#[cfg(test)]
mod tests;
