//! PyO3 bindings: translation only. Arguments are checked for type and shape
//! here; every decision is the core's.
//!
//! config.rs: SchedulerConfig and TenantConfig (each class's knobs in one
//! table); ladder.rs: ladder rungs in and out; pool.rs: BlockPool;
//! scheduler.rs: the Scheduler's methods; plan.rs: the plan buffers and
//! StepPlan; events.rs: StepEvents, FinishedRequest, event dicts; stats.rs:
//! the stats and pressure dicts; text.rs: TextStreams; checkpoint.rs: checkpoint records (the file
//! is kvsched/checkpoint.py's); errors.rs: the exceptions.
//!
//! Each class is `frozen` with a Mutex inside, so several Python threads can
//! share one object and get correct answers instead of "already borrowed".
//! The GIL is held throughout (the module declares `gil_used`): every call is
//! short, and the core never calls back into Python while it holds a lock;
//! errors become Python exceptions only after the lock is released.

mod checkpoint;
mod config;
mod errors;
mod events;
mod ladder;
mod plan;
mod pool;
mod scheduler;
mod stats;
mod text;

use std::borrow::Cow;
use std::sync::Mutex;

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyInt, PyString};

use crate::error::KvError;
use errors::invalid;

/// Run `f` on the locked object and return its result once the lock is released.
///
/// Errors are turned into Python exceptions only after the guard is gone:
/// building an exception runs Python code, which can hand the GIL to a thread
/// that then blocks on this lock while we wait for the GIL (a deadlock).
fn locked<T, R>(m: &Mutex<T>, f: impl FnOnce(&mut T) -> R) -> PyResult<R> {
    let result = match m.lock() {
        Ok(mut guard) => Ok(f(&mut guard)),
        Err(_) => Err(KvError::Internal(
            "an earlier panic left this object unusable; recreate it".into(),
        )),
    };
    Ok(result?)
}

/// `time.monotonic()`, the default for every `now=` argument.
fn monotonic(py: Python<'_>) -> PyResult<f64> {
    static MONOTONIC: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    MONOTONIC
        .import(py, "time", "monotonic")?
        .call0()?
        .extract()
}

fn now_or_monotonic(py: Python<'_>, now: Option<f64>) -> PyResult<f64> {
    // The core's one check on times (`scheduler::check_time`), here too for
    // the calls that only read (stats, pressure).
    let t = match now {
        Some(t) => t,
        None => monotonic(py)?,
    };
    crate::scheduler::check_time(t, "now")?;
    Ok(t)
}

/// A 1-D numpy int32 array argument, borrowed read-only.
fn int32_arg<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<PyReadonlyArray1<'py, i32>> {
    if let Ok(arr) = obj.cast::<PyArray1<i32>>() {
        return arr
            .try_readonly()
            .map_err(|e| invalid(format!("{what}: {e}")));
    }
    let found = match obj.cast::<PyUntypedArray>() {
        Ok(a) => format!("a {}-D {} array", a.ndim(), a.dtype().str()?),
        Err(_) => obj.get_type().name()?.to_string(),
    };
    Err(invalid(format!(
        "{what} must be a 1-D numpy int32 array (np.asarray(ids, dtype=np.int32)), got {found}"
    )))
}

/// The array's values: borrowed when contiguous, copied from a strided view.
fn int32_slice<'a>(arr: &'a PyReadonlyArray1<'_, i32>) -> Cow<'a, [i32]> {
    match arr.as_slice() {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => Cow::Owned(arr.as_array().iter().copied().collect()),
    }
}

/// A non-negative count from a Python int: negatives become 0 and ints too large
/// for 64 bits saturate, so the core's own checks give the reason.
fn count_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    if !obj.is_instance_of::<PyInt>() {
        return Err(invalid(format!(
            "{what} must be an int, got {}",
            obj.get_type().name()?
        )));
    }
    Ok(match obj.extract::<i64>() {
        Ok(v) => v.max(0) as usize,
        Err(_) if obj.gt(0)? => usize::MAX,
        Err(_) => 0,
    })
}

/// An unsigned integer type a config knob is read into, with the text of its
/// largest value for the error.
trait KnobInt: TryFrom<u64> {
    const RANGE: &'static str;
}
impl KnobInt for usize {
    const RANGE: &'static str = if usize::BITS == 64 {
        "0 to 2**64-1"
    } else {
        "0 to 2**32-1"
    };
}
impl KnobInt for u32 {
    const RANGE: &'static str = "0 to 2**32-1";
}

/// An unsigned integer config knob from any Python int (or object with
/// `__index__`, as pyo3's own conversion takes): one out of range is
/// InvalidConfig naming the knob and the range, instead of pyo3's bare
/// OverflowError; a wrong type is a TypeError naming the knob. Nothing is built
/// from a refused argument, so a refusal changes nothing.
fn uint_knob<T: KnobInt>(obj: &Bound<'_, PyAny>, knob: &str) -> PyResult<T> {
    let py = obj.py();
    let refused = || -> PyResult<PyErr> {
        // Python refuses to print ints of more than ~4300 digits; say so then.
        let shown = match obj.repr() {
            Ok(r) if r.len()? <= 48 => r.to_string(),
            _ => "an int too large to print".to_owned(),
        };
        Ok(KvError::InvalidConfig(format!(
            "{knob} out of range: must be an integer from {}, got {shown}",
            T::RANGE
        ))
        .into())
    };
    match obj.extract::<u64>() {
        Ok(v) => match T::try_from(v) {
            Ok(v) => Ok(v),
            Err(_) => Err(refused()?),
        },
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(py) => Err(refused()?),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyTypeError>(py) => {
            Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "{knob} must be an int, got {}",
                obj.get_type().name()?
            )))
        }
        Err(e) => Err(e),
    }
}

/// `uint_knob` for a knob that may be None.
fn opt_uint_knob<T: KnobInt>(obj: &Bound<'_, PyAny>, knob: &str) -> PyResult<Option<T>> {
    if obj.is_none() {
        return Ok(None);
    }
    uint_knob(obj, knob).map(Some)
}

/// A prefix-cache salt: str (its UTF-8 bytes) or bytes.
fn salt_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(s.to_str()?.as_bytes().to_vec());
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    Err(invalid(format!(
        "cache_salt must be str or bytes, got {}",
        obj.get_type().name()?
    )))
}

/// Bytes the extension's Rust code holds now: its heap is mimalloc (heap.rs),
/// which glibc's `mallinfo2` does not see. For benches/scaling.py; not an API.
#[pyfunction]
fn heap_bytes() -> usize {
    crate::heap::live_bytes()
}

/// kvsched's native core: the block pool, tenants, admission and scheduler.
///
/// `gil_used = true`: on free-threaded Python the interpreter keeps the GIL on
/// while this module is loaded, which the plan buffers' safety argument relies on.
#[pymodule(name = "_core", gil_used = true)]
mod core_module {
    #[pymodule_export]
    use super::config::{PySchedulerConfig, PyTenantConfig};
    #[pymodule_export]
    use super::events::{PyFinishedRequest, PyStepEvents};
    #[pymodule_export]
    use super::plan::PyStepPlan;
    #[pymodule_export]
    use super::pool::PyBlockPool;
    #[pymodule_export]
    use super::scheduler::PyScheduler;
    #[pymodule_export]
    use super::text::PyTextStreams;

    use pyo3::prelude::*;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        super::errors::register(m)?;
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add(
            "build_profile",
            if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
        )?;
        m.add("NULL_PAGE", crate::page::NULL_PAGE)?;
        // Private, so set as an attribute (not in `__all__`, not in the stub).
        m.setattr("_heap_bytes", wrap_pyfunction!(super::heap_bytes, m)?)?;
        let reasons: Vec<&str> = crate::scheduler::FinishReason::ALL
            .iter()
            .map(|r| r.as_str())
            .collect();
        m.add(
            "FINISH_REASONS",
            pyo3::types::PyTuple::new(m.py(), reasons)?,
        )?;
        let bounds: Vec<f64> = crate::metrics::LATENCY_BOUNDS.to_vec();
        m.add(
            "LATENCY_BUCKETS",
            pyo3::types::PyTuple::new(m.py(), bounds)?,
        )?;
        Ok(())
    }
}
