//! The scheduler's clock: which `now` values are accepted, and what a time
//! far behind the clock means (a re-based clock, which the rate buckets
//! follow).

use super::Scheduler;
use crate::error::{KvError, KvResult};

/// Largest `now` accepted, in seconds (about 31,700 years): any clock in
/// seconds a server uses (`time.monotonic()`, `time.time()`) is far below it;
/// a larger value is a unit mistake (ns, ms) or garbage, refused.
pub const MAX_TIME_S: f64 = 1e12;

/// How far `now` may go back behind the latest one (the scheduler's clock)
/// and still be jitter (a time read before waiting for the lock): nothing
/// changes, as when time stands still. Further back, the caller's clock was
/// re-based (another clock, a restart): the scheduler's clock and every rate
/// bucket follow it (`TokenBucket::rebase`), so none waits for a time that
/// will not come.
pub const CLOCK_JITTER_S: f64 = 60.0;

/// The one check on a `now` (and on every time the bindings take for one):
/// finite, not negative, at most `MAX_TIME_S`. InvalidRequest naming `what`.
pub fn check_time(now: f64, what: &str) -> KvResult<()> {
    if now.is_finite() && (0.0..=MAX_TIME_S).contains(&now) {
        Ok(())
    } else {
        Err(KvError::InvalidRequest(format!(
            "{what} must be a finite number of seconds in [0, {MAX_TIME_S:e}] (a monotonic \
             or Unix clock), got {now}"
        )))
    }
}

impl Scheduler {
    /// Every method that takes a `now` calls this first: a bad time is
    /// refused (`check_time`; nothing changes), and a time more than
    /// `CLOCK_JITTER_S` behind the clock re-bases the clock and the rate
    /// buckets to it (see `CLOCK_JITTER_S`).
    pub(crate) fn accept_now(&mut self, now: f64) -> KvResult<()> {
        check_time(now, "now")?;
        if now < self.clock - CLOCK_JITTER_S {
            self.clock = now;
            self.tenants.rebase_buckets(now);
        }
        Ok(())
    }
}
