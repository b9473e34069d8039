//! Checkpoint records: the scheduler's finished and in-flight requests as
//! plain dicts, and in-flight records taken back.
//!
//! The bindings own the records (their fields, and reading an in-flight one
//! back into the core's `InFlight`); the file they are kept in (JSON lines, the
//! durable write) is kvsched/checkpoint.py's, which `Scheduler.checkpoint` and
//! `Scheduler.restore` call.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::error::KvError;
use crate::scheduler::{FinishedRequest, InFlight};

fn finished_record<'py>(py: Python<'py>, f: &FinishedRequest) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("kind", "finished")?;
    d.set_item("request_id", f.id)?;
    d.set_item("tenant", &f.tenant)?;
    d.set_item("reason", f.reason.as_str())?;
    d.set_item("prompt_len", f.prompt_len)?;
    d.set_item("output_ids", f.output.clone())?;
    d.set_item("arrival", f.arrival)?;
    d.set_item("finished", f.finished)?;
    d.set_item("cached_tokens", f.cached_tokens)?;
    Ok(d)
}

fn in_flight_record<'py>(py: Python<'py>, r: &InFlight) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("kind", "in_flight")?;
    d.set_item("request_id", r.id)?;
    d.set_item("tenant", &r.tenant)?;
    d.set_item("reason", r.reason)?;
    d.set_item("prompt_ids", r.prompt.clone())?;
    d.set_item("generated_ids", r.generated.clone())?;
    d.set_item("max_tokens", r.max_tokens)?;
    d.set_item("asked_max_tokens", r.asked_max_tokens)?;
    d.set_item("stop_token_ids", r.stop_token_ids.clone())?;
    let salt: Option<String> = r
        .cache_salt
        .as_ref()
        .map(|s| s.iter().map(|b| format!("{b:02x}")).collect());
    d.set_item("cache_salt_hex", salt)?;
    d.set_item("arrival", r.arrival)?;
    Ok(d)
}

/// The checkpoint as records: the requests finished since the drain began,
/// then every unfinished one, each a dict whose "kind" says which.
pub(super) fn records<'py>(
    py: Python<'py>,
    finished: &[FinishedRequest],
    in_flight: &[InFlight],
) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for f in finished {
        out.append(finished_record(py, f)?)?;
    }
    for r in in_flight {
        out.append(in_flight_record(py, r)?)?;
    }
    Ok(out)
}

/// In-flight records handed back, each read as the core's InFlight; the first
/// bad one is an InvalidRequest naming its field.
pub(super) fn read_records(records: &Bound<'_, PyAny>) -> PyResult<Vec<InFlight>> {
    let mut out = Vec::new();
    for (i, item) in records.try_iter()?.enumerate() {
        let item = item?;
        let d = item
            .cast::<PyDict>()
            .map_err(|_| KvError::InvalidRequest(format!("checkpoint record {i}: not a dict")))?;
        out.push(read_in_flight(d)?);
    }
    Ok(out)
}

/// An in-flight record read back from a checkpoint.
fn read_in_flight(d: &Bound<'_, PyDict>) -> PyResult<InFlight> {
    let bad = |k: &str| KvError::InvalidRequest(format!("checkpoint record: bad or missing {k:?}"));
    fn get<'py, T: for<'a> pyo3::FromPyObject<'a, 'py>>(
        d: &Bound<'py, PyDict>,
        k: &str,
    ) -> Option<T> {
        d.get_item(k)
            .ok()
            .flatten()
            .and_then(|v| v.extract::<T>().ok())
    }
    let salt = match d.get_item("cache_salt_hex")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => {
            let hex: String = v.extract().map_err(|_| bad("cache_salt_hex"))?;
            let bytes: Option<Vec<u8>> = (0..hex.len())
                .step_by(2)
                .map(|i| {
                    hex.get(i..i + 2)
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                })
                .collect();
            Some(bytes.ok_or_else(|| bad("cache_salt_hex"))?)
        }
    };
    // The fields in record order: the first bad one is the one named.
    let id = get(d, "request_id").ok_or_else(|| bad("request_id"))?;
    let tenant = get(d, "tenant").ok_or_else(|| bad("tenant"))?;
    let prompt = get(d, "prompt_ids").ok_or_else(|| bad("prompt_ids"))?;
    let generated = get(d, "generated_ids").ok_or_else(|| bad("generated_ids"))?;
    let max_tokens: usize = get(d, "max_tokens").ok_or_else(|| bad("max_tokens"))?;
    // Optional: records written before it was kept were not capped, as far as
    // anyone can tell, and restore as they always did.
    let asked_max_tokens = match d.get_item("asked_max_tokens")? {
        None => max_tokens,
        Some(v) => v.extract().map_err(|_| bad("asked_max_tokens"))?,
    };
    Ok(InFlight {
        id,
        tenant,
        prompt,
        generated,
        max_tokens,
        asked_max_tokens,
        stop_token_ids: get(d, "stop_token_ids").ok_or_else(|| bad("stop_token_ids"))?,
        cache_salt: salt,
        arrival: get(d, "arrival").unwrap_or(0.0),
        reason: "in_flight",
    })
}
