//! `kvsched.StepEvents`, `kvsched.FinishedRequest` and the event dicts of
//! `Scheduler.take_events()`.

use numpy::{IntoPyArray, PyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::stats::pressure_dict;
use crate::scheduler::{CommitEvents, FinishedRequest, SchedulerEvent};

/// A request's terminal event (exactly one per admitted request): how it
/// ended, its output and timings (seconds, on the clock of the `now` values;
/// first_scheduled and first_token equal `finished` for a request that ended
/// before it got there).
#[pyclass(name = "FinishedRequest", module = "kvsched", frozen)]
pub struct PyFinishedRequest {
    #[pyo3(get)]
    request_id: u64,
    #[pyo3(get)]
    tenant: String,
    /// "length" (max_tokens reached), "stop" (a stop token was sampled, or
    /// Scheduler.stop), "cancelled" (Scheduler.cancel), "drain_deadline"
    /// (unfinished at the drain's deadline, handed back), "shed" (displaced
    /// by a higher tier's request that a global limit would have refused; see
    /// retry_after) or "error" (Scheduler.fail: the host could not serve it;
    /// see error).
    #[pyo3(get)]
    reason: &'static str,
    #[pyo3(get)]
    prompt_len: usize,
    /// int32: the generated tokens (a stop token included); for a request
    /// cancelled, stopped or handed back, those generated until then.
    #[pyo3(get)]
    output_ids: Py<PyArray1<i32>>,
    #[pyo3(get)]
    arrival: f64,
    #[pyo3(get)]
    first_scheduled: f64,
    #[pyo3(get)]
    first_token: f64,
    #[pyo3(get)]
    finished: f64,
    /// Times it was preempted and recomputed.
    #[pyo3(get)]
    preemptions: u32,
    /// Prompt tokens served from the prefix cache (not computed for it).
    #[pyo3(get)]
    cached_tokens: usize,
    /// The max_tokens the caller asked for.
    #[pyo3(get)]
    asked_max_tokens: usize,
    /// The max_tokens it was admitted with: less than asked_max_tokens when
    /// the ladder's cap_max_tokens rung lowered it (see max_tokens_capped).
    #[pyo3(get)]
    max_tokens: usize,
    /// Seconds after which a retry may pass: set for a request ended "shed",
    /// None otherwise.
    #[pyo3(get)]
    retry_after: Option<f64>,
    /// Why the host could not serve it: set for a request ended "error", None
    /// otherwise.
    #[pyo3(get)]
    error: Option<String>,
}

#[pymethods]
impl PyFinishedRequest {
    /// Submit to first token.
    #[getter]
    fn ttft(&self) -> f64 {
        self.first_token - self.arrival
    }
    /// Submit to finish.
    #[getter]
    fn e2e(&self) -> f64 {
        self.finished - self.arrival
    }
    /// Whether the ladder lowered its max_tokens at admission: a "length"
    /// ending then stopped short of what was asked.
    #[getter]
    fn max_tokens_capped(&self) -> bool {
        self.asked_max_tokens > self.max_tokens
    }
    /// Submit to first entering the running set.
    #[getter]
    fn queue_time(&self) -> f64 {
        self.first_scheduled - self.arrival
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "FinishedRequest(request_id={}, tenant={:?}, reason={:?}, output_len={})",
            self.request_id,
            self.tenant,
            self.reason,
            PyUntypedArrayMethods::len(self.output_ids.bind(py))
        )
    }
}

impl PyFinishedRequest {
    pub(super) fn new(py: Python<'_>, f: FinishedRequest) -> Self {
        PyFinishedRequest {
            request_id: f.id,
            tenant: f.tenant,
            reason: f.reason.as_str(),
            prompt_len: f.prompt_len,
            output_ids: f.output.into_pyarray(py).unbind(),
            arrival: f.arrival,
            first_scheduled: f.first_scheduled,
            first_token: f.first_token,
            finished: f.finished,
            preemptions: f.preemptions,
            cached_tokens: f.cached_tokens,
            asked_max_tokens: f.asked_max_tokens,
            max_tokens: f.max_tokens,
            retry_after: f.retry_after,
            error: f.error,
        }
    }
}

/// What a commit did: new tokens (arrays, in plan order), finished requests,
/// and requests the step preempted.
#[pyclass(name = "StepEvents", module = "kvsched", frozen)]
pub struct PyStepEvents {
    /// int64 [k]: requests that got a token.
    #[pyo3(get)]
    request_ids: Py<PyArray1<i64>>,
    /// int32 [k]: the token each got.
    #[pyo3(get)]
    tokens: Py<PyArray1<i32>>,
    /// list[FinishedRequest].
    #[pyo3(get)]
    finished: Py<PyList>,
    /// Request ids preempted (and queued again) by this step.
    #[pyo3(get)]
    preempted: Vec<u64>,
}

impl PyStepEvents {
    pub(super) fn new(py: Python<'_>, ev: CommitEvents) -> PyResult<Self> {
        // In place (same size and alignment): no second buffer to allocate.
        let ids: Vec<i64> = ev.request_ids.into_iter().map(|id| id as i64).collect();
        let finished = PyList::empty(py);
        for f in ev.finished {
            finished.append(Py::new(py, PyFinishedRequest::new(py, f))?)?;
        }
        Ok(PyStepEvents {
            request_ids: ids.into_pyarray(py).unbind(),
            tokens: ev.tokens.into_pyarray(py).unbind(),
            finished: finished.unbind(),
            preempted: ev.preempted,
        })
    }
}

#[pymethods]
impl PyStepEvents {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "StepEvents(tokens={}, finished={}, preempted={})",
            PyUntypedArrayMethods::len(self.tokens.bind(py)),
            self.finished.bind(py).len(),
            self.preempted.len()
        )
    }
}

pub(super) fn event_dict<'py>(py: Python<'py>, e: &SchedulerEvent) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    match e {
        SchedulerEvent::Ladder(m) => {
            d.set_item(
                "kind",
                if m.up {
                    "rung_engaged"
                } else {
                    "rung_released"
                },
            )?;
            d.set_item("rung", m.rung)?;
            d.set_item("action", m.action)?;
            d.set_item("at", m.at)?;
            d.set_item("pressure", pressure_dict(py, &m.pressure)?)?;
        }
        SchedulerEvent::MaxTokensCapped {
            request,
            tenant,
            asked,
            admitted,
            at,
        } => {
            d.set_item("kind", "max_tokens_capped")?;
            d.set_item("request_id", request)?;
            d.set_item("tenant", tenant)?;
            d.set_item("asked", asked)?;
            d.set_item("admitted", admitted)?;
            d.set_item("at", at)?;
        }
        SchedulerEvent::Displaced {
            request,
            tenant,
            by_tenant,
            limit,
            ran,
            at,
        } => {
            d.set_item("kind", "displaced")?;
            d.set_item("request_id", request)?;
            d.set_item("tenant", tenant)?;
            d.set_item("by_tenant", by_tenant)?;
            d.set_item("limit", limit)?;
            d.set_item("ran", ran)?;
            d.set_item("at", at)?;
        }
    }
    Ok(d)
}
