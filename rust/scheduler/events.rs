//! The event log, the degradation ladder's update and the pressure it reads.

use super::*;

/// Something operators want to know about, in the order it happened.
#[derive(Clone, Debug, PartialEq)]
pub enum SchedulerEvent {
    /// The ladder engaged or released a rung.
    Ladder(LadderMove),
    /// The ladder admitted a request with its max_tokens lowered.
    MaxTokensCapped {
        request: u64,
        tenant: String,
        asked: usize,
        admitted: usize,
        at: f64,
    },
    /// A request of a lower tier was ended `Shed` to make room (a live slot,
    /// pool blocks) for a request of `by_tenant`, a higher tier, that the
    /// global `limit` ("concurrency" or "pool_full") would have refused.
    /// `ran`: it had entered the running set (only with `preempt_lower_tiers`).
    Displaced {
        request: u64,
        tenant: String,
        by_tenant: String,
        limit: &'static str,
        ran: bool,
        at: f64,
    },
}

/// Most events kept between two `take_events` calls; older ones are dropped
/// (and counted) so an unread queue cannot grow without bound.
pub const MAX_PENDING_EVENTS: usize = 4096;

/// Events not yet taken, oldest first, at most `MAX_PENDING_EVENTS`; the
/// oldest are dropped (and counted) beyond that.
#[derive(Clone, Debug, Default)]
pub(super) struct EventLog {
    queue: VecDeque<SchedulerEvent>,
    dropped: u64,
}

impl EventLog {
    fn push(&mut self, e: SchedulerEvent) {
        if self.queue.len() == MAX_PENDING_EVENTS {
            self.queue.pop_front();
            self.dropped += 1;
        }
        self.queue.push_back(e);
    }

    fn take(&mut self) -> Vec<SchedulerEvent> {
        self.queue.drain(..).collect()
    }
}

impl Scheduler {
    // -- the ladder and events ----------------------------------------------------

    /// The ladder's signals now.
    pub fn pressure(&self, now: f64) -> Pressure {
        let usable = self.usable_blocks();
        let oldest = self
            .tenants
            .iter()
            .filter_map(|(_, t)| t.waiting.front())
            .copied()
            .chain(self.resume.heads())
            .map(|s| self.requests.get(s).waiting_since)
            .fold(f64::INFINITY, f64::min);
        Pressure {
            reserved_share: if usable == 0 {
                1.0
            } else {
                self.tenants.committed() as f64 / usable as f64
            },
            queue_depth: (self.requests.len() - self.running.len()) as f64,
            oldest_wait_s: if oldest.is_finite() {
                (now - oldest).max(0.0)
            } else {
                0.0
            },
        }
    }

    pub(super) fn update_ladder(&mut self, now: f64) {
        if self.ladder.config().rungs.is_empty() {
            return;
        }
        let p = self.pressure(now);
        let mut moves = Vec::new();
        self.ladder.update(&p, now, &mut moves);
        for m in moves {
            self.push_event(SchedulerEvent::Ladder(m));
        }
    }

    pub(super) fn push_event(&mut self, e: SchedulerEvent) {
        self.events.push(e);
    }

    /// Events since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<SchedulerEvent> {
        self.events.take()
    }

    /// Events dropped because nobody took them in time.
    pub fn events_dropped(&self) -> u64 {
        self.events.dropped
    }

    pub fn ladder(&self) -> &Ladder {
        &self.ladder
    }
}
