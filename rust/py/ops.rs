//! Translation for the operations API: ladder rungs <-> dicts, scheduler events
//! and pressure -> dicts, checkpoint records <-> JSON lines.

use std::io::Write;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

use crate::error::KvError;
use crate::ladder::{Action, Ladder, LadderConfig, Pressure, Rung, Signal};
use crate::scheduler::{FinishedRequest, InFlight, SchedulerEvent};

/// `ladder=` of SchedulerConfig: None (off), "default", or a list of rung dicts
/// {"signal", "engage", "release", "action", "value"}.
pub(super) fn ladder_arg(
    obj: Option<&Bound<'_, PyAny>>,
    max_num_seqs: usize,
    max_seq_len: usize,
    retry_after_s: Option<f64>,
) -> PyResult<LadderConfig> {
    let mut config = match obj {
        None => LadderConfig::off(),
        Some(o) if o.is_none() => LadderConfig::off(),
        Some(o) if o.is_instance_of::<PyString>() => {
            let s: String = o.extract()?;
            if s != "default" {
                return Err(KvError::InvalidConfig(format!(
                    "ladder must be None, \"default\" or a list of rungs, got {s:?}"
                ))
                .into());
            }
            LadderConfig::default_for_scheduler(max_num_seqs, max_seq_len)
        }
        Some(o) => {
            let list = o.cast::<PyList>().map_err(|_| {
                KvError::InvalidConfig("ladder must be None, \"default\" or a list of dicts".into())
            })?;
            let mut rungs = Vec::new();
            for (i, item) in list.iter().enumerate() {
                rungs.push(
                    rung_arg(&item)
                        .map_err(|e| KvError::InvalidConfig(format!("ladder rung {i}: {e}")))?,
                );
            }
            LadderConfig {
                rungs,
                retry_after_s: 1.0,
            }
        }
    };
    if let Some(r) = retry_after_s {
        config.retry_after_s = r;
    }
    config.validate()?;
    Ok(config)
}

fn rung_arg(item: &Bound<'_, PyAny>) -> Result<Rung, String> {
    let d = item.cast::<PyDict>().map_err(|_| "not a dict".to_owned())?;
    let get = |k: &str| -> Result<Bound<'_, PyAny>, String> {
        d.get_item(k)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("missing {k:?}"))
    };
    for key in d.keys() {
        let k: String = key.extract().map_err(|_| "keys must be str".to_owned())?;
        if !["signal", "engage", "release", "action", "value"].contains(&k.as_str()) {
            return Err(format!("unknown key {k:?}"));
        }
    }
    let signal: String = get("signal")?
        .extract()
        .map_err(|_| "signal must be a str")?;
    let signal = Signal::parse(&signal).map_err(|e| e.to_string())?;
    let engage: f64 = get("engage")?
        .extract()
        .map_err(|_| "engage must be a number")?;
    let release: f64 = get("release")?
        .extract()
        .map_err(|_| "release must be a number")?;
    let action: String = get("action")?
        .extract()
        .map_err(|_| "action must be a str")?;
    let value = || -> Result<usize, String> {
        get("value")?
            .extract::<usize>()
            .map_err(|_| format!("action {action:?} needs an int value >= 0"))
    };
    let action = match action.as_str() {
        "shed_lowest_tier" => Action::ShedLowestTier,
        "cap_max_tokens" => Action::CapMaxTokens(value()?),
        "max_running" => Action::MaxRunning(value()?),
        "reject_fast" => Action::RejectFast,
        other => {
            return Err(format!(
                "unknown action {other:?} (shed_lowest_tier, cap_max_tokens, max_running, \
                 reject_fast)"
            ))
        }
    };
    Ok(Rung {
        signal,
        engage,
        release,
        action,
    })
}

fn action_value(a: Action) -> Option<usize> {
    match a {
        Action::CapMaxTokens(n) | Action::MaxRunning(n) => Some(n),
        _ => None,
    }
}

pub(super) fn rung_dict<'py>(py: Python<'py>, r: &Rung) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("signal", r.signal.as_str())?;
    d.set_item("engage", r.engage)?;
    d.set_item("release", r.release)?;
    d.set_item("action", r.action.as_str())?;
    if let Some(v) = action_value(r.action) {
        d.set_item("value", v)?;
    }
    Ok(d)
}

pub(super) fn ladder_list<'py>(py: Python<'py>, c: &LadderConfig) -> PyResult<Bound<'py, PyList>> {
    let l = PyList::empty(py);
    for r in &c.rungs {
        l.append(rung_dict(py, r)?)?;
    }
    Ok(l)
}

pub(super) fn pressure_dict<'py>(py: Python<'py>, p: &Pressure) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("reserved_share", p.reserved_share)?;
    d.set_item("queue_depth", p.queue_depth)?;
    d.set_item("oldest_wait_s", p.oldest_wait_s)?;
    Ok(d)
}

/// The ladder's state for stats(): level, each rung with its climbs, and the
/// seconds spent at each level.
pub(super) fn ladder_stats<'py>(py: Python<'py>, l: &Ladder) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("level", l.level())?;
    let rungs = PyList::empty(py);
    for (i, r) in l.config().rungs.iter().enumerate() {
        let rd = rung_dict(py, r)?;
        rd.set_item("engaged", i < l.level())?;
        rd.set_item("climbs", l.climbs()[i])?;
        rungs.append(rd)?;
    }
    d.set_item("rungs", rungs)?;
    d.set_item("seconds_at_level", l.time_at().to_vec())?;
    Ok(d)
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
    }
    Ok(d)
}

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
