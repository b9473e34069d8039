//! `retry_after` of a refusal for room: when what runs now ends enough for the
//! refused request to fit, from the steps each running request still needs and
//! the measured step period.

use super::*;

impl Scheduler {
    /// Steps until running request `r` ends by itself, no stop token assumed:
    /// each step gives it one token, or one prefill chunk.
    fn steps_left(&self, r: &Request) -> usize {
        r.max_tokens
            .saturating_sub(r.generated() + self.unsettled(r))
            + r.need().saturating_sub(1) / self.config.long_prefill_chunk
    }

    /// The measured step period: the median gap (in `now` seconds) between
    /// the last 32 pairs of consecutive `step()` calls that both made a plan.
    /// None until one is measured.
    pub fn step_period(&self) -> Option<f64> {
        if self.step_gaps.is_empty() {
            return None;
        }
        let mut gaps: Vec<f64> = self.step_gaps.iter().copied().collect();
        gaps.sort_unstable_by(f64::total_cmp);
        Some(gaps[gaps.len() / 2])
    }

    /// `retry_after` of a request of tenant `tid` refused for capacity: an
    /// estimate of when enough of what runs now ends for `room` to be made.
    ///
    /// A running request r ends in
    ///   steps(r) = (max_tokens - generated) + (uncomputed prompt tokens - 1) / long_prefill_chunk
    /// steps (every running sequence gets one token, or one prefill chunk, a
    /// step; stop tokens are not foreseen). The running requests that hold
    /// the room (the tenant's own for tenant_budget and a tenant's
    /// max_concurrent, all for the pool and the scheduler's concurrency) are
    /// taken in order of steps(r), releasing their reservations (the pool's
    /// count recomputed with floors) or their slot, until the request would
    /// fit; with k the steps(r) of the last one taken,
    ///   retry_after = k * step_period
    /// (`step_period`), or `retry_after_hint_s` when no step period is
    /// measured yet. None when all the running requests ending would still
    /// not make room (it is held by requests that have not started running):
    /// nothing measured says when it frees.
    pub fn room_wait(&self, tid: TenantId, room: Room) -> Option<f64> {
        let own = matches!(room, Room::TenantBlocks(_) | Room::TenantRequests(_));
        let mut ends: Vec<(usize, u64, TenantId, usize)> = self
            .running
            .slots()
            .iter()
            .map(|&s| self.requests.get(s))
            .filter(|r| !own || r.tenant == tid)
            .map(|r| (self.steps_left(r), r.id, r.tenant, r.reserved_blocks))
            .collect();
        ends.sort_unstable();
        let steps = match room {
            Room::TenantRequests(n) | Room::Requests(n) => ends.get(n.checked_sub(1)?)?.0,
            Room::TenantBlocks(blocks) => {
                let mut freed = 0;
                ends.iter()
                    .find(|e| {
                        freed += e.3;
                        freed >= blocks
                    })?
                    .0
            }
            Room::Pool { blocks, shared } => {
                // Each tenant's footprint as admission counts it, less `released`
                // of its reservations; the asking tenant's with this request added.
                let footprint = |u: TenantId, released: usize| {
                    let t = self.tenants.get(u);
                    let reserved = t.reserved_blocks - released;
                    let held = if u == tid {
                        (reserved + blocks).saturating_sub(shared)
                    } else {
                        reserved.saturating_sub(t.shared_blocks)
                    };
                    held.max(t.config.kv_floor_blocks)
                };
                let usable = self.usable_blocks();
                let mut released = vec![0usize; self.tenants.slots_len()];
                let mut committed: usize = self.tenants.iter().map(|(u, _)| footprint(u, 0)).sum();
                let mut fits_at = None;
                for &(steps, _, u, r) in &ends {
                    let before = footprint(u, released[u]);
                    released[u] += r;
                    committed = committed - before + footprint(u, released[u]);
                    if committed <= usable {
                        fits_at = Some(steps);
                        break;
                    }
                }
                fits_at?
            }
        };
        Some(match self.step_period() {
            Some(period) => steps as f64 * period,
            None => self.config.retry_after_hint_s,
        })
    }
}
