//! Every failure kvsched can report, typed. No pyo3 here: the bindings map each
//! variant to a Python exception (rust/py/errors.rs).
//!
//! A call that returns an error has changed nothing, except that a rejected
//! submit is counted (per tenant and reason) so operators can see it.

use std::fmt;

/// Why a request was refused. Stable strings: they appear in metrics and in
/// `Rejected.reason` on the Python side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RejectReason {
    UnknownTenant,
    Invalid,
    TooLong,
    TenantBudget,
    PoolFull,
    RateLimited,
    Concurrency,
    Shed,
    Draining,
    NotReady,
}

impl RejectReason {
    pub const ALL: [RejectReason; 10] = [
        RejectReason::UnknownTenant,
        RejectReason::Invalid,
        RejectReason::TooLong,
        RejectReason::TenantBudget,
        RejectReason::PoolFull,
        RejectReason::RateLimited,
        RejectReason::Concurrency,
        RejectReason::Shed,
        RejectReason::Draining,
        RejectReason::NotReady,
    ];
    pub const COUNT: usize = Self::ALL.len();

    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::UnknownTenant => "unknown_tenant",
            RejectReason::Invalid => "invalid",
            RejectReason::TooLong => "too_long",
            RejectReason::TenantBudget => "tenant_budget",
            RejectReason::PoolFull => "pool_full",
            RejectReason::RateLimited => "rate_limited",
            RejectReason::Concurrency => "concurrency",
            RejectReason::Shed => "shed",
            RejectReason::Draining => "draining",
            RejectReason::NotReady => "not_ready",
        }
    }

    /// Dense index for per-reason counter arrays.
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A refused request: the reason, when it is worth retrying (seconds), and a
/// sentence for the log. `retry_after` is None only where a retry cannot pass
/// as things stand: unknown_tenant, invalid, too_long, a request over its
/// tenant's cap or rate burst (or, over-committed, over the pool), and a
/// capacity refusal whose room not even every running request ending would
/// make (see `Scheduler::room_wait`).
#[derive(Clone, Debug, PartialEq)]
pub struct Rejection {
    pub reason: RejectReason,
    pub retry_after: Option<f64>,
    pub tenant: Option<String>,
    pub message: String,
    /// No change in load can lift it, only new configuration: the request
    /// itself (invalid, too long), an unknown tenant, or a request its tenant's
    /// configured limits can never hold (over its cap, over its rate burst,
    /// over-committed past the whole pool). A server answers it as a client
    /// error, with no Retry-After (a retry loop would never end).
    pub permanent: bool,
}

impl Rejection {
    /// This refusal, marked permanent (see the field).
    pub fn forever(mut self) -> Self {
        self.permanent = true;
        self
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum KvError {
    /// `submit` refused a request. Counted per tenant and reason.
    Rejected(Rejection),
    /// Arguments that can never be valid (empty prompt, max_tokens < 1, negative ids...).
    InvalidRequest(String),
    /// A configuration value out of range or inconsistent with the rest.
    InvalidConfig(String),
    UnknownTenant(String),
    UnknownRequest(u64),
    /// The tenant exists already (add_tenant).
    TenantExists(String),
    /// The tenant still has live requests (remove_tenant).
    TenantInUse {
        tenant: String,
        live_requests: u32,
    },
    /// A page id out of range, the null page, or a page that is not allocated.
    InvalidPage {
        page: i64,
        why: &'static str,
    },
    /// More pages asked of the pool than it has free.
    OutOfPages {
        requested: usize,
        free: usize,
    },
    /// `commit` got a plan that is not the one pending, or `step` was called
    /// while a plan is still waiting for its commit.
    StalePlan(String),
    /// A call that is well-formed but wrong for the object's state: a lifecycle
    /// transition from the wrong state, a commit whose sampled ids do not fit the
    /// pending plan, a reconfigure that kept racing concurrent ones. Not a
    /// rejection: no request was refused.
    InvalidState(String),
    /// A knob that only takes effect at start-up was changed on a live object.
    RestartRequired(&'static str),
    /// A checkpoint that cannot be restored as a whole: a damaged file, a
    /// duplicated request id, or records this scheduler would refuse. Nothing
    /// was restored. `refused` names each refused record (its id in the
    /// checkpoint) and why: a rejection reason, or "duplicate".
    Checkpoint {
        message: String,
        refused: Vec<(u64, String)>,
    },
    /// An internal invariant broke: a bug in kvsched, never the caller's fault.
    Internal(String),
}

impl KvError {
    pub fn rejected(
        reason: RejectReason,
        retry_after: Option<f64>,
        tenant: Option<&str>,
        message: impl Into<String>,
    ) -> Self {
        KvError::Rejected(Rejection {
            reason,
            retry_after,
            tenant: tenant.map(str::to_owned),
            message: message.into(),
            permanent: matches!(
                reason,
                RejectReason::Invalid | RejectReason::TooLong | RejectReason::UnknownTenant
            ),
        })
    }

    /// The rejection reason, if this error is a rejection.
    pub fn reason(&self) -> Option<RejectReason> {
        match self {
            KvError::Rejected(r) => Some(r.reason),
            _ => None,
        }
    }
}

impl fmt::Display for KvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvError::Rejected(r) => write!(f, "rejected ({}): {}", r.reason, r.message),
            KvError::InvalidRequest(m) => write!(f, "invalid request: {m}"),
            KvError::InvalidConfig(m) => write!(f, "invalid configuration: {m}"),
            KvError::UnknownTenant(t) => write!(f, "unknown tenant {t:?}"),
            KvError::UnknownRequest(id) => write!(f, "unknown request id {id}"),
            KvError::TenantExists(t) => write!(f, "tenant {t:?} already exists"),
            KvError::TenantInUse {
                tenant,
                live_requests,
            } => write!(
                f,
                "tenant {tenant:?} has {live_requests} live request(s); cancel or finish them first"
            ),
            KvError::InvalidPage { page, why } => write!(f, "page {page}: {why}"),
            KvError::OutOfPages { requested, free } => {
                write!(f, "asked for {requested} page(s), {free} free")
            }
            KvError::StalePlan(m) => write!(f, "stale plan: {m}"),
            KvError::InvalidState(m) => write!(f, "invalid state: {m}"),
            KvError::RestartRequired(knob) => write!(
                f,
                "{knob} cannot change on a live scheduler; build a new one with the new value"
            ),
            KvError::Checkpoint { message, .. } => write!(f, "checkpoint: {message}"),
            KvError::Internal(m) => write!(f, "internal error (a kvsched bug): {m}"),
        }
    }
}

impl std::error::Error for KvError {}

pub type KvResult<T> = Result<T, KvError>;
