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
}

/// Most events kept between two `take_events` calls; older ones are dropped
/// (and counted) so an unread queue cannot grow without bound.
pub const MAX_PENDING_EVENTS: usize = 4096;

impl Scheduler {
    // -- the ladder and events ----------------------------------------------------

    /// The ladder's signals now.
    pub fn pressure(&self, now: f64) -> Pressure {
        let usable = self.usable_blocks();
        let oldest = self
            .tenants
            .iter()
            .filter_map(|(_, t)| t.waiting.front())
            .chain(self.resume.values().filter_map(|q| q.front()))
            .map(|&s| self.req(s).waiting_since)
            .fold(f64::INFINITY, f64::min);
        Pressure {
            reserved_share: if usable == 0 {
                1.0
            } else {
                self.tenants.committed() as f64 / usable as f64
            },
            queue_depth: (self.index.len() - self.running.len()) as f64,
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
        if self.events.len() == MAX_PENDING_EVENTS {
            self.events.pop_front();
            self.events_dropped += 1;
        }
        self.events.push_back(e);
    }

    /// Events since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<SchedulerEvent> {
        self.events.drain(..).collect()
    }

    /// Events dropped because nobody took them in time.
    pub fn events_dropped(&self) -> u64 {
        self.events_dropped
    }

    pub fn ladder(&self) -> &Ladder {
        &self.ladder
    }

    /// Whether a new request of tenant `tid` would have to wait for a slot:
    /// the sequences it cannot pass (running ones of its tier or above, or all
    /// of them without priority preemption) and the requests waiting ahead of
    /// it (of its tier or above) take every slot.
    pub(super) fn would_wait(&self, tid: TenantId) -> bool {
        let tier = self.tenants.get(tid).config.tier;
        let ahead: usize = self
            .tenants
            .iter()
            .filter(|(_, t)| t.config.tier <= tier)
            .map(|(_, t)| {
                let running = if self.config.preempt_lower_tiers {
                    t.running as usize
                } else {
                    0
                };
                running + t.waiting.len() + t.resuming as usize
            })
            .sum();
        let running = if self.config.preempt_lower_tiers {
            0
        } else {
            self.running.len()
        };
        running + ahead >= self.max_running()
    }

    /// Most sequences that may run now: max_num_seqs, or less while a ladder
    /// rung says so.
    pub fn max_running(&self) -> usize {
        let cap = self.ladder.effects().max_running.unwrap_or(usize::MAX);
        self.config.max_num_seqs.min(cap)
    }
}
