//! Checkpoint records: the scheduler's finished and in-flight requests as
//! JSON lines, and in-flight records read back.

use std::io::Write;

use pyo3::prelude::*;
use pyo3::types::PyDict;

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
    d.set_item("stop_token_ids", r.stop_token_ids.clone())?;
    let salt: Option<String> = r
        .cache_salt
        .as_ref()
        .map(|s| s.iter().map(|b| format!("{b:02x}")).collect());
    d.set_item("cache_salt_hex", salt)?;
    d.set_item("arrival", r.arrival)?;
    Ok(d)
}

/// Write the records as JSON lines to `path`, durably: a temporary file beside
/// it, flushed to disk, then renamed over it.
pub(super) fn write_checkpoint(
    py: Python<'_>,
    path: &str,
    finished: &[FinishedRequest],
    in_flight: &[InFlight],
) -> PyResult<(usize, usize)> {
    let dumps = py.import("json")?.getattr("dumps")?;
    let mut text = String::new();
    for f in finished {
        text.push_str(
            &dumps
                .call1((finished_record(py, f)?,))?
                .extract::<String>()?,
        );
        text.push('\n');
    }
    for r in in_flight {
        text.push_str(
            &dumps
                .call1((in_flight_record(py, r)?,))?
                .extract::<String>()?,
        );
        text.push('\n');
    }
    // A temporary name of its own (two checkpoints to one path do not mix),
    // flushed, renamed over the target, and the directory flushed so the
    // rename itself survives a crash.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let tmp = format!("{path}.{}.{nanos}.tmp", std::process::id());
    let io =
        |e: std::io::Error| pyo3::exceptions::PyOSError::new_err(format!("checkpoint {path}: {e}"));
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(text.as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)?;
        let dir = std::path::Path::new(path)
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(std::path::Path::new("."));
        std::fs::File::open(dir)?.sync_all()
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    Ok((finished.len(), in_flight.len()))
}

/// An in-flight record read back from a checkpoint line.
pub(super) fn read_in_flight(d: &Bound<'_, PyDict>) -> PyResult<InFlight> {
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
    Ok(InFlight {
        id: get(d, "request_id").ok_or_else(|| bad("request_id"))?,
        tenant: get(d, "tenant").ok_or_else(|| bad("tenant"))?,
        prompt: get(d, "prompt_ids").ok_or_else(|| bad("prompt_ids"))?,
        generated: get(d, "generated_ids").ok_or_else(|| bad("generated_ids"))?,
        max_tokens: get(d, "max_tokens").ok_or_else(|| bad("max_tokens"))?,
        stop_token_ids: get(d, "stop_token_ids").ok_or_else(|| bad("stop_token_ids"))?,
        cache_salt: salt,
        arrival: get(d, "arrival").unwrap_or(0.0),
        reason: "in_flight",
    })
}
