"""kvsched: the KV-cache manager and scheduler for LLM inference on one machine.

The core (block pool, tenants, admission, scheduling) is Rust, in ``kvsched._core``;
this package re-exports it and adds the pure-Python layers around it.
"""

from typing import Literal

# How a request ends, whoever ends it (the core, the engine, the server): one
# vocabulary. kvsched.FINISH_REASONS is the core's tuple of the same names.
FinishReason = Literal["length", "stop", "cancelled", "drain_deadline", "shed", "error"]

from kvsched._core import (  # noqa: E402
    FINISH_REASONS,
    LATENCY_BUCKETS,
    NULL_PAGE,
    REJECT_REASONS,
    BlockPool,
    CheckpointError,
    FinishedRequest,
    InternalError,
    InvalidConfig,
    InvalidRequest,
    InvalidState,
    KvSchedError,
    OutOfPages,
    PoolError,
    Rejected,
    RestartRequired,
    Scheduler,
    SchedulerConfig,
    StalePlan,
    StepEvents,
    StepPlan,
    TenantConfig,
    TenantExists,
    TenantInUse,
    UnknownRequest,
    UnknownTenant,
    __version__,
    build_profile,
)

__all__ = [
    "FINISH_REASONS",
    "FinishReason",
    "LATENCY_BUCKETS",
    "FinishedRequest",
    "StepEvents",
    "StepPlan",
    "StalePlan",
    "InvalidState",
    "NULL_PAGE",
    "REJECT_REASONS",
    "BlockPool",
    "CheckpointError",
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
