//! Where a scheduler is in its life: cold, warming, ready, draining, drained.
//! Every change of state goes through `transition`, and the one that ends a
//! drain through `maybe_drained`.

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
    /// The moves a scheduler may make: cold -> warming -> ready (warming and
    /// ready may be repeated, and warming skipped), any state but drained ->
    /// draining, and draining -> drained once nothing is left.
    pub fn allows(self, to: Lifecycle) -> bool {
        use Lifecycle::*;
        matches!(
            (self, to),
            (Cold | Warming, Warming)
                | (Cold | Warming | Ready, Ready)
                | (Cold | Warming | Ready | Draining, Draining)
                | (Draining, Drained)
        )
    }

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
        self.transition(Lifecycle::Warming, "begin_warmup")
    }

    /// The engine is warm (weights resident, every bucket compiled, a synthetic
    /// request completed): admit requests.
    pub fn mark_ready(&mut self) -> KvResult<()> {
        self.transition(Lifecycle::Ready, "mark_ready")
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
        self.transition(Lifecycle::Draining, "drain")?;
        self.drain_deadline = deadline;
        self.maybe_drained();
        Ok(())
    }

    /// Move to `to` if the lifecycle allows it from here (`Lifecycle::allows`);
    /// otherwise InvalidState naming the `call` that asked.
    fn transition(&mut self, to: Lifecycle, call: &str) -> KvResult<()> {
        if !self.lifecycle.allows(to) {
            return Err(KvError::InvalidState(format!(
                "{call} on a {} scheduler",
                self.lifecycle.as_str()
            )));
        }
        self.lifecycle = to;
        Ok(())
    }

    /// A draining scheduler with nothing live, no plan pending and none
    /// unresolved is drained.
    /// Called after everything that can end the last request: a commit, a
    /// cancel or stop, the deadline's hand-back, and `drain` itself.
    pub(super) fn maybe_drained(&mut self) {
        if self.lifecycle == Lifecycle::Draining
            && self.requests.is_empty()
            && self.pending.is_none()
            && self.unresolved.is_none()
        {
            self.transition(Lifecycle::Drained, "drained")
                .expect("draining may always drain");
        }
    }
}
