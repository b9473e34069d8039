//! The degradation ladder of `SchedulerConfig(ladder=...)`: rung dicts in and out.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

use crate::error::KvError;
use crate::ladder::{Action, LadderConfig, Rung, Signal};

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
