//! kvsched: the KV-cache manager and scheduler between a custom inference server
//! and its accelerator.
//!
//! The core is plain Rust: `cargo test` builds and tests it without Python. The
//! PyO3 bindings live in `py/`, behind the `python` feature that maturin enables.

pub mod admission;
pub mod buckets;
pub mod error;
pub mod groups;
pub mod ladder;
pub mod metrics;
pub mod page;
pub mod planner;
pub mod pool;
mod prefetch;
pub mod prefix;
pub mod scheduler;
pub mod tenant;
pub mod text;

#[cfg(feature = "python")]
mod py;

#[cfg(feature = "python")]
mod heap;

#[cfg(feature = "python")]
#[global_allocator]
static HEAP: mimalloc::MiMalloc = mimalloc::MiMalloc;

pub use error::{KvError, KvResult, RejectReason, Rejection};
pub use pool::BlockPool;
pub use scheduler::{AdmissionMode, Scheduler, SchedulerConfig};
pub use tenant::TenantConfig;
