"""kvsched: the KV-cache manager and scheduler for LLM inference on one machine.

The core (block pool, tenants, admission, scheduling) is Rust, in ``kvsched._core``;
this package re-exports it and adds the pure-Python layers around it.
"""

from kvsched._core import (
    NULL_PAGE,
    REJECT_REASONS,
    BlockPool,
    InternalError,
    InvalidConfig,
    InvalidRequest,
    KvSchedError,
    OutOfPages,
    PoolError,
    Rejected,
    RestartRequired,
    Scheduler,
    SchedulerConfig,
    TenantConfig,
    TenantExists,
    TenantInUse,
    UnknownRequest,
    UnknownTenant,
    __version__,
    build_profile,
)

__all__ = [
    "NULL_PAGE",
    "REJECT_REASONS",
    "BlockPool",
    "InternalError",
    "InvalidConfig",
    "InvalidRequest",
    "KvSchedError",
    "OutOfPages",
    "PoolError",
    "Rejected",
    "RestartRequired",
    "Scheduler",
    "SchedulerConfig",
    "TenantConfig",
    "TenantExists",
    "TenantInUse",
    "UnknownRequest",
    "UnknownTenant",
    "__version__",
    "build_profile",
]
