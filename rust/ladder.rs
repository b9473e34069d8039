//! The degradation ladder: what the scheduler gives up, in an order chosen in
//! advance, when the box is overloaded.
//!
//! A ladder is a list of rungs, each a trigger and an action. The scheduler
//! stands on level L: rungs 0..L are engaged. It climbs to rung L when that
//! rung's signal reaches its `engage` threshold and steps down from rung L-1
//! when that rung's signal falls below its `release` threshold (release <
//! engage: hysteresis, so a signal hovering at a threshold does not flap).
//! Rungs engage in order and release in reverse order; the actions of every
//! engaged rung apply together.
//!
//! The default order: (1) stop admitting the lowest tier, (2) cap max_tokens of
//! new requests, (3) run fewer sequences at once, (4) reject at once whatever
//! cannot start now. Signals are the scheduler's own pressure: the share of the
//! usable pool its promises take, the number of admitted requests waiting, and
//! how long the oldest of them has waited.

use crate::error::{KvError, KvResult};

/// What a trigger reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// Committed blocks (reservations and unused floors) / usable blocks.
    ReservedShare,
    /// Admitted requests not running.
    QueueDepth,
    /// Seconds the oldest admitted, not-yet-running request has waited.
    OldestWaitS,
}

impl Signal {
    pub fn as_str(self) -> &'static str {
        match self {
            Signal::ReservedShare => "reserved_share",
            Signal::QueueDepth => "queue_depth",
            Signal::OldestWaitS => "oldest_wait_s",
        }
    }

    pub fn parse(s: &str) -> KvResult<Self> {
        match s {
            "reserved_share" => Ok(Signal::ReservedShare),
            "queue_depth" => Ok(Signal::QueueDepth),
            "oldest_wait_s" => Ok(Signal::OldestWaitS),
            _ => Err(KvError::InvalidConfig(format!(
                "unknown ladder signal {s:?} (reserved_share, queue_depth, oldest_wait_s)"
            ))),
        }
    }
}

/// What an engaged rung does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Refuse new requests of the lowest (largest-numbered) tier that has tenants.
    ShedLowestTier,
    /// Admit new requests with max_tokens lowered to at most this.
    CapMaxTokens(usize),
    /// Run at most this many sequences at once.
    MaxRunning(usize),
    /// Refuse every new request that could not start running now.
    RejectFast,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::ShedLowestTier => "shed_lowest_tier",
            Action::CapMaxTokens(_) => "cap_max_tokens",
            Action::MaxRunning(_) => "max_running",
            Action::RejectFast => "reject_fast",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Rung {
    pub signal: Signal,
    /// Climb onto this rung when the signal is at least this.
    pub engage: f64,
    /// Step down from it when the signal is below this (< engage).
    pub release: f64,
    pub action: Action,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LadderConfig {
    /// In climbing order.
    pub rungs: Vec<Rung>,
    /// `retry_after` given to a request a rung refuses.
    pub retry_after_s: f64,
}

impl LadderConfig {
    /// No rungs: never degrade.
    pub fn off() -> Self {
        LadderConfig {
            rungs: Vec::new(),
            retry_after_s: 1.0,
        }
    }

    /// The default order, with thresholds scaled to the scheduler's size:
    /// shed the lowest tier at 90% of the pool promised (release at 75%); cap
    /// max_tokens to `cap_tokens` with `max_num_seqs` requests waiting (release
    /// at a quarter of that); halve the running set when the oldest has waited
    /// 5 s (release at 1 s); reject fast at 15 s (release at 3 s).
    pub fn default_for(max_num_seqs: usize, cap_tokens: usize) -> Self {
        let q = max_num_seqs as f64;
        LadderConfig {
            rungs: vec![
                Rung {
                    signal: Signal::ReservedShare,
                    engage: 0.90,
                    release: 0.75,
                    action: Action::ShedLowestTier,
                },
                Rung {
                    signal: Signal::QueueDepth,
                    engage: q,
                    release: (q / 4.0).max(1.0),
                    action: Action::CapMaxTokens(cap_tokens),
                },
                Rung {
                    signal: Signal::OldestWaitS,
                    engage: 5.0,
                    release: 1.0,
                    action: Action::MaxRunning((max_num_seqs / 2).max(1)),
                },
                Rung {
                    signal: Signal::OldestWaitS,
                    engage: 15.0,
                    release: 3.0,
                    action: Action::RejectFast,
                },
            ],
            retry_after_s: 1.0,
        }
    }

    /// `default_for` with the max_tokens cap a scheduler of this size uses:
    /// 256, or half of max_seq_len if that is smaller.
    pub fn default_for_scheduler(max_num_seqs: usize, max_seq_len: usize) -> Self {
        Self::default_for(max_num_seqs, 256.min((max_seq_len / 2).max(1)))
    }

    pub fn validate(&self) -> KvResult<()> {
        let bad = |m: String| Err(KvError::InvalidConfig(format!("ladder: {m}")));
        if !(self.retry_after_s.is_finite() && self.retry_after_s >= 0.0) {
            return bad("retry_after_s must be a non-negative number".into());
        }
        for (i, r) in self.rungs.iter().enumerate() {
            if !(r.engage.is_finite() && r.release.is_finite() && r.release > 0.0) {
                return bad(format!(
                    "rung {i}: thresholds must be positive numbers (a signal is never below \
                     0, so a release at 0 would never release)"
                ));
            }
            if r.release >= r.engage {
                return bad(format!(
                    "rung {i}: release ({}) must be below engage ({}), or it would flap",
                    r.release, r.engage
                ));
            }
            match r.action {
                Action::CapMaxTokens(0) => return bad(format!("rung {i}: cap must be >= 1")),
                Action::MaxRunning(0) => return bad(format!("rung {i}: max_running must be >= 1")),
                _ => {}
            }
        }
        Ok(())
    }
}

/// The signals, read by the scheduler.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pressure {
    pub reserved_share: f64,
    pub queue_depth: f64,
    pub oldest_wait_s: f64,
}

impl Pressure {
    fn get(&self, s: Signal) -> f64 {
        match s {
            Signal::ReservedShare => self.reserved_share,
            Signal::QueueDepth => self.queue_depth,
            Signal::OldestWaitS => self.oldest_wait_s,
        }
    }
}

/// The union of the engaged rungs' actions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Effects {
    pub shed_lowest_tier: bool,
    pub cap_max_tokens: Option<usize>,
    pub max_running: Option<usize>,
    pub reject_fast: bool,
}

/// A rung engaged (`up`) or released, at `at` seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct LadderMove {
    pub rung: usize,
    pub action: &'static str,
    pub up: bool,
    pub at: f64,
    pub pressure: Pressure,
}

#[derive(Clone, Debug)]
pub struct Ladder {
    config: LadderConfig,
    level: usize,
    effects: Effects,
    last: Option<f64>,
    /// Seconds spent at each level (index 0: no rung engaged).
    time_at: Vec<f64>,
    climbs: Vec<u64>,
}

impl Ladder {
    pub fn new(config: LadderConfig) -> KvResult<Self> {
        config.validate()?;
        let n = config.rungs.len();
        Ok(Ladder {
            config,
            level: 0,
            effects: Effects::default(),
            last: None,
            time_at: vec![0.0; n + 1],
            climbs: vec![0; n],
        })
    }

    pub fn config(&self) -> &LadderConfig {
        &self.config
    }

    /// Rungs engaged (0: none).
    pub fn level(&self) -> usize {
        self.level
    }

    pub fn effects(&self) -> Effects {
        self.effects
    }

    /// Seconds spent at each level so far (index 0: no rung engaged).
    pub fn time_at(&self) -> &[f64] {
        &self.time_at
    }

    /// Times each rung was climbed onto.
    pub fn climbs(&self) -> &[u64] {
        &self.climbs
    }

    /// Replace the rungs live. The level is kept as far as the new ladder has
    /// rungs; it moves on the next update.
    pub fn reconfigure(&mut self, config: LadderConfig) -> KvResult<()> {
        config.validate()?;
        let n = config.rungs.len();
        self.level = self.level.min(n);
        self.time_at.resize(n + 1, 0.0);
        self.climbs.resize(n, 0);
        self.config = config;
        self.effects = self.compute_effects();
        Ok(())
    }

    /// Read the signals at `now`: climb and descend as far as they say, and
    /// report each move.
    pub fn update(&mut self, p: &Pressure, now: f64, moves: &mut Vec<LadderMove>) {
        if let Some(last) = self.last {
            self.time_at[self.level] += (now - last).max(0.0);
        }
        self.last = Some(self.last.map_or(now, |l| l.max(now)));
        let before = self.level;
        loop {
            if let Some(r) = self.config.rungs.get(self.level) {
                if p.get(r.signal) >= r.engage {
                    self.climbs[self.level] += 1;
                    moves.push(LadderMove {
                        rung: self.level,
                        action: r.action.as_str(),
                        up: true,
                        at: now,
                        pressure: *p,
                    });
                    self.level += 1;
                    continue;
                }
            }
            break;
        }
        if self.level == before {
            while self.level > 0 {
                let r = &self.config.rungs[self.level - 1];
                if p.get(r.signal) >= r.release {
                    break;
                }
                self.level -= 1;
                moves.push(LadderMove {
                    rung: self.level,
                    action: r.action.as_str(),
                    up: false,
                    at: now,
                    pressure: *p,
                });
            }
        }
        if self.level != before {
            self.effects = self.compute_effects();
        }
    }

    fn compute_effects(&self) -> Effects {
        let mut e = Effects::default();
        for r in &self.config.rungs[..self.level] {
            match r.action {
                Action::ShedLowestTier => e.shed_lowest_tier = true,
                Action::CapMaxTokens(n) => {
                    e.cap_max_tokens = Some(e.cap_max_tokens.map_or(n, |c: usize| c.min(n)))
                }
                Action::MaxRunning(n) => {
                    e.max_running = Some(e.max_running.map_or(n, |c: usize| c.min(n)))
                }
                Action::RejectFast => e.reject_fast = true,
            }
        }
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(share: f64, depth: f64, wait: f64) -> Pressure {
        Pressure {
            reserved_share: share,
            queue_depth: depth,
            oldest_wait_s: wait,
        }
    }

    #[test]
    fn climbs_in_order_with_hysteresis_and_descends_in_reverse() {
        let mut l = Ladder::new(LadderConfig::default_for(8, 64)).unwrap();
        let mut moves = Vec::new();
        l.update(&p(0.5, 0.0, 0.0), 0.0, &mut moves);
        assert_eq!(l.level(), 0);
        // Queue depth alone does not climb past rung 0: rungs engage in order.
        l.update(&p(0.5, 100.0, 0.0), 1.0, &mut moves);
        assert_eq!(l.level(), 0);
        l.update(&p(0.95, 100.0, 0.0), 2.0, &mut moves);
        assert_eq!(l.level(), 2);
        assert_eq!(
            l.effects(),
            Effects {
                shed_lowest_tier: true,
                cap_max_tokens: Some(64),
                ..Effects::default()
            }
        );
        l.update(&p(0.95, 100.0, 20.0), 3.0, &mut moves);
        assert_eq!(l.level(), 4);
        assert_eq!(l.effects().max_running, Some(4));
        // Between release and engage: stays (no flapping).
        l.update(&p(0.8, 5.0, 4.0), 4.0, &mut moves);
        assert_eq!(l.level(), 4);
        // Below rung 3's release: steps down one; rung 2 (release 1 s) holds.
        l.update(&p(0.8, 5.0, 2.0), 5.0, &mut moves);
        assert_eq!(l.level(), 3);
        l.update(&p(0.5, 0.0, 0.0), 6.0, &mut moves);
        assert_eq!(l.level(), 0);
        let ups: Vec<(usize, bool)> = moves.iter().map(|m| (m.rung, m.up)).collect();
        assert_eq!(
            ups,
            vec![
                (0, true),
                (1, true),
                (2, true),
                (3, true),
                (3, false),
                (2, false),
                (1, false),
                (0, false)
            ]
        );
        assert_eq!(l.time_at(), &[2.0, 0.0, 1.0, 1.0, 2.0]);
        assert_eq!(l.climbs(), &[1, 1, 1, 1]);
    }

    #[test]
    fn validation_refuses_flapping_and_empty_actions() {
        let mut c = LadderConfig::default_for(8, 64);
        c.rungs[0].release = c.rungs[0].engage;
        assert!(Ladder::new(c).is_err());
        let mut c = LadderConfig::default_for(8, 64);
        c.rungs[1].action = Action::CapMaxTokens(0);
        assert!(Ladder::new(c).is_err());
        let mut c = LadderConfig::default_for(8, 64);
        c.rungs[2].release = 0.0; // signals are never below 0: it would never release
        assert!(Ladder::new(c).is_err());
        assert!(Signal::parse("bogus").is_err());
        assert_eq!(Signal::parse("queue_depth").unwrap(), Signal::QueueDepth);
        Ladder::new(LadderConfig::off()).unwrap();
    }
}
