//! Python exceptions, one per kind of `KvError`, and the mapping between them.
//!
//! The public module path is `kvsched`, so tracebacks name `kvsched.Rejected`.
//! `Rejected` and its subclasses carry `reason`, `retry_after` and `tenant`.

use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::{create_exception, intern};

use crate::error::{KvError, RejectReason};

create_exception!(
    kvsched,
    KvSchedError,
    PyException,
    "Base class of every error kvsched raises."
);
create_exception!(
    kvsched,
    Rejected,
    KvSchedError,
    "A request was refused and nothing changed. `reason` says why (one of \
     kvsched.REJECT_REASONS), `retry_after` when a retry makes sense (seconds: exact for \
     rate_limited, the ladder's for shed, the configured hint for draining and not_ready, \
     an estimate from the running requests for pool_full, tenant_budget and concurrency; \
     None where the request cannot pass as things stand), `tenant` whose request it was, \
     `permanent` when no change in load can lift it, only new configuration (the request \
     itself, an unknown tenant, a request over its tenant's cap or rate burst): answer it \
     as a client error, without a Retry-After."
);
create_exception!(
    kvsched,
    InvalidRequest,
    Rejected,
    "The request can never be valid as given (empty prompt, max_tokens < 1, negative \
     token ids, wrong dtype or shape). reason == 'invalid'."
);
create_exception!(
    kvsched,
    UnknownTenant,
    Rejected,
    "No tenant has that name. reason == 'unknown_tenant'."
);
create_exception!(
    kvsched,
    UnknownRequest,
    KvSchedError,
    "No live request has that id (never admitted, or already finished or cancelled)."
);
create_exception!(
    kvsched,
    InvalidConfig,
    KvSchedError,
    "A configuration value is out of range or inconsistent; nothing was changed."
);
create_exception!(
    kvsched,
    TenantExists,
    KvSchedError,
    "add_tenant was given a name that is already registered."
);
create_exception!(
    kvsched,
    TenantInUse,
    KvSchedError,
    "remove_tenant was refused: the tenant still has live requests."
);
create_exception!(
    kvsched,
    PoolError,
    KvSchedError,
    "A page id that is out of range, the null page 0, or not allocated (double free)."
);
create_exception!(
    kvsched,
    OutOfPages,
    PoolError,
    "More pages were asked of a BlockPool than it has free; nothing was taken."
);
create_exception!(
    kvsched,
    StalePlan,
    KvSchedError,
    "commit() got a plan that is not the pending one (already committed, or from \
     another scheduler), or step() was called before the last plan was committed."
);
create_exception!(
    kvsched,
    InvalidState,
    KvSchedError,
    "A well-formed call that is wrong for the scheduler's state: a lifecycle transition \
     from the wrong state (mark_ready while draining), sampled ids that do not fit the \
     pending plan (count, dtype, a negative id), a reconfigure that kept racing concurrent \
     ones. Not a Rejected: no request was refused. Nothing changed."
);
create_exception!(
    kvsched,
    RestartRequired,
    KvSchedError,
    "A restart-only knob (block_size, num_blocks, ...) was changed on a live object."
);
create_exception!(
    kvsched,
    CheckpointError,
    KvSchedError,
    "A checkpoint that cannot be restored as a whole, and nothing was restored: a file \
     that is not a regular file or is too large, a damaged file (truncated, altered, \
     duplicated or reordered lines: the header, record count and checksum say which), \
     a duplicated request id, or records this scheduler would refuse. `refused` is \
     None for a file error, else {checkpoint request id: reason} for every refused record \
     (a reject reason, or \"duplicate\")."
);
create_exception!(
    kvsched,
    InternalError,
    KvSchedError,
    "An internal invariant broke: a bug in kvsched. Please report it."
);

/// Build a `Rejected`-family exception with its attributes set.
fn rejected(
    py: Python<'_>,
    reason: RejectReason,
    retry_after: Option<f64>,
    tenant: Option<&str>,
    message: String,
    permanent: bool,
) -> PyErr {
    let err = match reason {
        RejectReason::Invalid => InvalidRequest::new_err(message),
        RejectReason::UnknownTenant => UnknownTenant::new_err(message),
        _ => Rejected::new_err(message),
    };
    let value = err.value(py);
    // Setting attributes on a fresh exception instance cannot fail short of
    // memory exhaustion; the exception is still raised if it does.
    let _ = value.setattr(intern!(py, "reason"), reason.as_str());
    let _ = value.setattr(intern!(py, "retry_after"), retry_after);
    let _ = value.setattr(intern!(py, "tenant"), tenant);
    let _ = value.setattr(intern!(py, "permanent"), permanent);
    err
}

impl From<KvError> for PyErr {
    fn from(err: KvError) -> PyErr {
        Python::attach(|py| {
            let message = err.to_string();
            match err {
                KvError::Rejected(r) => rejected(
                    py,
                    r.reason,
                    r.retry_after,
                    r.tenant.as_deref(),
                    r.message,
                    r.permanent,
                ),
                KvError::InvalidRequest(_) => {
                    rejected(py, RejectReason::Invalid, None, None, message, true)
                }
                KvError::UnknownTenant(name) => rejected(
                    py,
                    RejectReason::UnknownTenant,
                    None,
                    Some(&name),
                    message,
                    true,
                ),
                KvError::UnknownRequest(_) => UnknownRequest::new_err(message),
                KvError::InvalidConfig(_) => InvalidConfig::new_err(message),
                KvError::TenantExists(_) => TenantExists::new_err(message),
                KvError::TenantInUse { .. } => TenantInUse::new_err(message),
                KvError::InvalidPage { .. } => PoolError::new_err(message),
                KvError::OutOfPages { .. } => OutOfPages::new_err(message),
                KvError::StalePlan(_) => StalePlan::new_err(message),
                KvError::InvalidState(_) => InvalidState::new_err(message),
                KvError::RestartRequired(_) => RestartRequired::new_err(message),
                KvError::Checkpoint { refused, .. } => checkpoint_error(py, message, &refused),
                KvError::Internal(_) => InternalError::new_err(message),
            }
        })
    }
}

/// A `CheckpointError` with its `refused` map ({checkpoint request id: reason}).
fn checkpoint_error(py: Python<'_>, message: String, refused: &[(u64, String)]) -> PyErr {
    let err = CheckpointError::new_err(message);
    let map = pyo3::types::PyDict::new(py);
    for (id, why) in refused {
        // As for `rejected`: a failure here is memory exhaustion; the error is
        // still raised.
        let _ = map.set_item(id, why);
    }
    let _ = err.value(py).setattr(intern!(py, "refused"), map);
    err
}

/// A malformed argument caught at the boundary (wrong type, dtype or shape).
pub fn invalid(message: impl Into<String>) -> PyErr {
    Python::attach(|py| rejected(py, RejectReason::Invalid, None, None, message.into(), true))
}

/// Register the exceptions on the module and give the `Rejected` family class-level
/// defaults, so `reason` reads sensibly even on an instance raised by user code.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvSchedError", py.get_type::<KvSchedError>())?;
    m.add("Rejected", py.get_type::<Rejected>())?;
    m.add("InvalidRequest", py.get_type::<InvalidRequest>())?;
    m.add("UnknownTenant", py.get_type::<UnknownTenant>())?;
    m.add("UnknownRequest", py.get_type::<UnknownRequest>())?;
    m.add("InvalidConfig", py.get_type::<InvalidConfig>())?;
    m.add("TenantExists", py.get_type::<TenantExists>())?;
    m.add("TenantInUse", py.get_type::<TenantInUse>())?;
    m.add("PoolError", py.get_type::<PoolError>())?;
    m.add("OutOfPages", py.get_type::<OutOfPages>())?;
    m.add("StalePlan", py.get_type::<StalePlan>())?;
    m.add("InvalidState", py.get_type::<InvalidState>())?;
    m.add("RestartRequired", py.get_type::<RestartRequired>())?;
    m.add("CheckpointError", py.get_type::<CheckpointError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;

    let rejected_ty = py.get_type::<Rejected>();
    rejected_ty.setattr("reason", py.None())?;
    rejected_ty.setattr("retry_after", py.None())?;
    rejected_ty.setattr("tenant", py.None())?;
    rejected_ty.setattr("permanent", false)?;
    py.get_type::<CheckpointError>()
        .setattr("refused", py.None())?;
    py.get_type::<InvalidRequest>()
        .setattr("reason", RejectReason::Invalid.as_str())?;
    py.get_type::<UnknownTenant>()
        .setattr("reason", RejectReason::UnknownTenant.as_str())?;
    let reasons: Vec<&str> = RejectReason::ALL.iter().map(|r| r.as_str()).collect();
    m.add("REJECT_REASONS", pyo3::types::PyTuple::new(py, reasons)?)?;
    Ok(())
}
