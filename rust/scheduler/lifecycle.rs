//! Where a scheduler is in its life: cold, warming, ready, draining, drained.

use super::*;

/// Where a scheduler is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lifecycle {
    /// Built; the engine has not started warming up.
    Cold,
    /// The engine is loading weights and compiling.
    Warming,
    /// Admitting.
    Ready,
    /// Not admitting; in-flight requests run until they finish or the deadline.
    Draining,
    /// Nothing left running; what did not finish was handed back.
    Drained,
}

impl Lifecycle {
    pub fn as_str(self) -> &'static str {
        match self {
            Lifecycle::Cold => "cold",
            Lifecycle::Warming => "warming",
            Lifecycle::Ready => "ready",
            Lifecycle::Draining => "draining",
            Lifecycle::Drained => "drained",
        }
    }
}

impl Scheduler {
    pub fn lifecycle(&self) -> Lifecycle {
        self.lifecycle
    }

    /// Alive: it answers and can still run work (everything but drained).
    pub fn live(&self) -> bool {
        self.lifecycle != Lifecycle::Drained
    }

    /// Ready: warm, and admitting.
    pub fn ready(&self) -> bool {
        self.lifecycle == Lifecycle::Ready
    }

    /// The engine started loading weights and compiling.
    pub fn begin_warmup(&mut self) -> KvResult<()> {
        match self.lifecycle {
            Lifecycle::Cold | Lifecycle::Warming => {
                self.lifecycle = Lifecycle::Warming;
                Ok(())
            }
            s => Err(KvError::InvalidState(format!(
                "begin_warmup on a {} scheduler",
                s.as_str()
            ))),
        }
    }

    /// The engine is warm (weights resident, every bucket compiled, a synthetic
    /// request completed): admit requests.
    pub fn mark_ready(&mut self) -> KvResult<()> {
        match self.lifecycle {
            Lifecycle::Cold | Lifecycle::Warming | Lifecycle::Ready => {
                self.lifecycle = Lifecycle::Ready;
                Ok(())
            }
            s => Err(KvError::InvalidState(format!(
                "mark_ready on a {} scheduler",
                s.as_str()
            ))),
        }
    }

    /// Stop admitting (`draining`); keep stepping what is in flight. The first
    /// step at or after `deadline` hands back whatever is unfinished (see
    /// `checkpoint`) and the scheduler is drained. A second call may move the
    /// deadline.
    pub fn drain(&mut self, deadline: f64) -> KvResult<()> {
        if deadline.is_nan() {
            return Err(KvError::InvalidRequest("drain deadline is NaN".into()));
        }
        if self.lifecycle == Lifecycle::Drained {
            return Ok(());
        }
        self.lifecycle = Lifecycle::Draining;
        self.drain_deadline = deadline;
        if self.index.is_empty() && self.pending.is_none() {
            self.lifecycle = Lifecycle::Drained;
        }
        Ok(())
    }
}
