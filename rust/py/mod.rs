//! PyO3 bindings: translation only. Arguments are checked for type and shape
//! here; every decision is the core's.
//!
//! Each class is `frozen` with a Mutex inside, so several Python threads can
//! share one object and get correct answers instead of "already borrowed".
//! The GIL is held throughout: every call is short, and the core never calls
//! back into Python while it holds a lock.

mod errors;

use std::borrow::Cow;
use std::sync::Mutex;

use numpy::{
    IntoPyArray, PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyInt};

use crate::error::{KvError, RejectReason};
use crate::{pool, scheduler, tenant};
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
    match now {
        Some(t) if t.is_finite() => Ok(t),
        Some(t) => Err(invalid(format!(
            "now must be a finite number of seconds, got {t}"
        ))),
        None => monotonic(py),
    }
}

/// A 1-D numpy int32 array, borrowed; non-contiguous views are copied.
fn int32_array<'a, 'py>(arr: &'a Option<PyReadonlyArray1<'py, i32>>) -> Cow<'a, [i32]> {
    let arr = arr.as_ref().expect("checked by int32_arg");
    match arr.as_slice() {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => Cow::Owned(arr.as_array().iter().copied().collect()),
    }
}

fn int32_arg<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<PyReadonlyArray1<'py, i32>> {
    if let Ok(arr) = obj.cast::<PyArray1<i32>>() {
        return arr
            .try_readonly()
            .map_err(|e| invalid(format!("{what}: {e}")));
    }
    let found = match obj.cast::<PyUntypedArray>() {
        Ok(a) => format!("a {}-D {} array", a.ndim(), a.dtype().str()?),
        Err(_) => format!("{}", obj.get_type().name()?),
    };
    Err(invalid(format!(
        "{what} must be a 1-D numpy int32 array (np.asarray(ids, dtype=np.int32)), got {found}"
    )))
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

// ---------------------------------------------------------------------------
// BlockPool

/// A pool of `num_blocks` KV pages of `block_size` tokens; page 0 is the null
/// page and is never handed out. Refcounted: `retain` adds an owner, `free`
/// drops one. Batch calls take and return numpy int32 arrays and are all or
/// nothing.
#[pyclass(name = "BlockPool", module = "kvsched", frozen)]
pub struct PyBlockPool {
    inner: Mutex<pool::BlockPool>,
}

#[pymethods]
impl PyBlockPool {
    #[new]
    #[pyo3(signature = (num_blocks, block_size))]
    fn new(num_blocks: usize, block_size: usize) -> PyResult<Self> {
        Ok(PyBlockPool {
            inner: Mutex::new(pool::BlockPool::new(num_blocks, block_size)?),
        })
    }

    /// Take `n` free pages (one reference each); returns their ids as int32.
    /// Raises OutOfPages, taking nothing, when fewer than `n` are free.
    #[pyo3(signature = (n, /))]
    fn allocate<'py>(&self, py: Python<'py>, n: usize) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let mut out: Vec<i32> = Vec::new();
        locked(&self.inner, |p| p.allocate_into(n, &mut out))??;
        Ok(out.into_pyarray(py))
    }

    /// Take one free page; returns its id.
    fn allocate_one(&self) -> PyResult<u32> {
        Ok(locked(&self.inner, |x| x.allocate_one())??)
    }

    /// Drop one reference on each page in `pages` (1-D int32); pages left without
    /// references become free. Raises PoolError and changes nothing on the null
    /// page, an out-of-range id or a page with no reference to drop.
    #[pyo3(signature = (pages, /))]
    fn free(&self, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let arr = Some(int32_arg(pages, "pages")?);
        let pages = int32_array(&arr);
        Ok(locked(&self.inner, |x| x.free(&pages))??)
    }

    /// Drop one reference on one page.
    #[pyo3(signature = (page, /))]
    fn free_one(&self, page: i64) -> PyResult<()> {
        Ok(locked(&self.inner, |x| x.free(&[page]))??)
    }

    /// Add one reference to each (allocated) page in `pages`. All or nothing.
    #[pyo3(signature = (pages, /))]
    fn retain(&self, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let arr = Some(int32_arg(pages, "pages")?);
        let pages = int32_array(&arr);
        Ok(locked(&self.inner, |x| x.retain(&pages))??)
    }

    /// References held on `page` (0 when free).
    #[pyo3(signature = (page, /))]
    fn refcount(&self, page: i64) -> PyResult<u32> {
        let count = locked(&self.inner, |pool| {
            if page < 0 || page as usize >= pool.num_blocks() {
                return Err(KvError::InvalidPage {
                    page,
                    why: "out of range",
                });
            }
            Ok(pool.refcount(page as u32))
        })?;
        Ok(count?)
    }

    /// All pages, the null page included.
    #[getter]
    fn num_blocks(&self) -> PyResult<usize> {
        locked(&self.inner, |x| x.num_blocks())
    }

    /// Tokens per page.
    #[getter]
    fn block_size(&self) -> PyResult<usize> {
        locked(&self.inner, |x| x.block_size())
    }

    /// Pages that can be handed out (num_blocks - 1).
    #[getter]
    fn total(&self) -> PyResult<usize> {
        locked(&self.inner, |x| x.total())
    }

    /// Pages free now.
    #[getter]
    fn free_pages(&self) -> PyResult<usize> {
        locked(&self.inner, |x| x.free_count())
    }

    /// Pages with at least one reference.
    #[getter]
    fn used(&self) -> PyResult<usize> {
        locked(&self.inner, |x| x.used())
    }

    /// Pages with two or more references.
    #[getter]
    fn shared(&self) -> PyResult<usize> {
        locked(&self.inner, |x| x.shared())
    }

    fn __repr__(&self) -> PyResult<String> {
        locked(&self.inner, |p| {
            format!(
                "BlockPool(num_blocks={}, block_size={}, free={}, used={}, shared={})",
                p.num_blocks(),
                p.block_size(),
                p.free_count(),
                p.used(),
                p.shared()
            )
        })
    }
}

// ---------------------------------------------------------------------------
// Configs

/// An optional value as Python writes it.
fn py_opt<T: std::fmt::Debug>(v: Option<T>) -> String {
    v.map_or_else(|| "None".to_owned(), |v| format!("{v:?}"))
}

/// Scheduler configuration. `num_blocks` and `block_size` are restart-only;
/// every argument left out takes the core's default.
#[pyclass(name = "SchedulerConfig", module = "kvsched", frozen, from_py_object)]
#[derive(Clone)]
pub struct PySchedulerConfig {
    inner: scheduler::SchedulerConfig,
}

#[pymethods]
impl PySchedulerConfig {
    #[new]
    #[pyo3(signature = (*, num_blocks=None, block_size=None, max_num_seqs=None,
        max_batched_tokens=None, max_seq_len=None, overhead_reserve=None, max_waiting=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: Option<usize>,
        block_size: Option<usize>,
        max_num_seqs: Option<usize>,
        max_batched_tokens: Option<usize>,
        max_seq_len: Option<usize>,
        overhead_reserve: Option<f64>,
        max_waiting: Option<usize>,
    ) -> PyResult<Self> {
        let d = scheduler::SchedulerConfig::default();
        let inner = scheduler::SchedulerConfig {
            num_blocks: num_blocks.unwrap_or(d.num_blocks),
            block_size: block_size.unwrap_or(d.block_size),
            max_num_seqs: max_num_seqs.unwrap_or(d.max_num_seqs),
            max_batched_tokens: max_batched_tokens.unwrap_or(d.max_batched_tokens),
            max_seq_len: max_seq_len.unwrap_or(d.max_seq_len),
            overhead_reserve: overhead_reserve.unwrap_or(d.overhead_reserve),
            max_waiting: max_waiting.unwrap_or(d.max_waiting),
        };
        inner.validate()?;
        Ok(PySchedulerConfig { inner })
    }

    /// Pages in the pool, the null page 0 included. Restart-only.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks
    }
    /// Tokens per page. Restart-only.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size
    }
    /// Most sequences in one step.
    #[getter]
    fn max_num_seqs(&self) -> usize {
        self.inner.max_num_seqs
    }
    /// Token budget of one step.
    #[getter]
    fn max_batched_tokens(&self) -> usize {
        self.inner.max_batched_tokens
    }
    /// Longest prompt + max_tokens admitted.
    #[getter]
    fn max_seq_len(&self) -> usize {
        self.inner.max_seq_len
    }
    /// Share of the pool kept out of admission.
    #[getter]
    fn overhead_reserve(&self) -> f64 {
        self.inner.overhead_reserve
    }
    /// Admitted requests that may wait beyond the max_num_seqs that run.
    #[getter]
    fn max_waiting(&self) -> usize {
        self.inner.max_waiting
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "SchedulerConfig(num_blocks={}, block_size={}, max_num_seqs={}, \
             max_batched_tokens={}, max_seq_len={}, overhead_reserve={:?}, max_waiting={})",
            c.num_blocks,
            c.block_size,
            c.max_num_seqs,
            c.max_batched_tokens,
            c.max_seq_len,
            c.overhead_reserve,
            c.max_waiting
        )
    }

    fn __eq__(&self, other: &Self) -> bool {
        self.inner == other.inner
    }
}

/// A tenant: `tier` (0 most important), `kv_floor_blocks` (guaranteed),
/// `kv_cap_blocks` (burst cap, None: the pool), `max_concurrent` live requests,
/// a token bucket on prompt + max_tokens (`rate_tokens_per_s`, `burst_tokens`,
/// default one second of rate) and a fair-share `weight`.
#[pyclass(name = "TenantConfig", module = "kvsched", frozen, from_py_object)]
#[derive(Clone)]
pub struct PyTenantConfig {
    inner: tenant::TenantConfig,
}

#[pymethods]
impl PyTenantConfig {
    #[new]
    #[pyo3(signature = (name, /, *, tier=0, kv_floor_blocks=0, kv_cap_blocks=None,
        max_concurrent=None, rate_tokens_per_s=None, burst_tokens=None, weight=1.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        name: String,
        tier: u32,
        kv_floor_blocks: usize,
        kv_cap_blocks: Option<usize>,
        max_concurrent: Option<u32>,
        rate_tokens_per_s: Option<f64>,
        burst_tokens: Option<f64>,
        weight: f64,
    ) -> PyResult<Self> {
        let inner = tenant::TenantConfig {
            name,
            tier,
            kv_floor_blocks,
            kv_cap_blocks,
            max_concurrent,
            rate_tokens_per_s,
            burst_tokens,
            weight,
        };
        inner.validate()?;
        Ok(PyTenantConfig { inner })
    }

    /// The tenant's name (unique; a metric label).
    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }
    /// 0 is the most important tier.
    #[getter]
    fn tier(&self) -> u32 {
        self.inner.tier
    }
    /// Blocks guaranteed to this tenant, never lent to others' reservations.
    #[getter]
    fn kv_floor_blocks(&self) -> usize {
        self.inner.kv_floor_blocks
    }
    /// Most blocks it may hold reserved at once (None: bounded by the pool).
    #[getter]
    fn kv_cap_blocks(&self) -> Option<usize> {
        self.inner.kv_cap_blocks
    }
    /// Most live requests (None: no per-tenant limit; 0 pauses the tenant).
    #[getter]
    fn max_concurrent(&self) -> Option<u32> {
        self.inner.max_concurrent
    }
    /// Token-bucket refill rate, in prompt + max_tokens tokens per second.
    #[getter]
    fn rate_tokens_per_s(&self) -> Option<f64> {
        self.inner.rate_tokens_per_s
    }
    /// Token-bucket size (None: one second of rate).
    #[getter]
    fn burst_tokens(&self) -> Option<f64> {
        self.inner.burst_tokens
    }
    /// Share of service among the tenants of one tier.
    #[getter]
    fn weight(&self) -> f64 {
        self.inner.weight
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "TenantConfig({:?}, tier={}, kv_floor_blocks={}, kv_cap_blocks={}, \
             max_concurrent={}, rate_tokens_per_s={}, burst_tokens={}, weight={:?})",
            c.name,
            c.tier,
            c.kv_floor_blocks,
            py_opt(c.kv_cap_blocks),
            py_opt(c.max_concurrent),
            py_opt(c.rate_tokens_per_s),
            py_opt(c.burst_tokens),
            c.weight
        )
    }

    fn __eq__(&self, other: &Self) -> bool {
        self.inner == other.inner
    }
}

// ---------------------------------------------------------------------------
// Scheduler

/// The KV-cache manager and scheduler. Safe to share between threads.
///
/// Every time-dependent method takes `now` (seconds, float); left out, it is
/// `time.monotonic()`. Pass it always or never.
#[pyclass(name = "Scheduler", module = "kvsched", frozen)]
pub struct PyScheduler {
    inner: Mutex<scheduler::Scheduler>,
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (config=None, /))]
    fn new(config: Option<PySchedulerConfig>) -> PyResult<Self> {
        let config = config.map(|c| c.inner).unwrap_or_default();
        Ok(PyScheduler {
            inner: Mutex::new(scheduler::Scheduler::new(config)?),
        })
    }

    /// The configuration this scheduler runs with.
    #[getter]
    fn config(&self) -> PyResult<PySchedulerConfig> {
        Ok(PySchedulerConfig {
            inner: locked(&self.inner, |s| s.config().clone())?,
        })
    }

    /// Register a tenant. Raises TenantExists, or InvalidConfig when its floor does
    /// not fit beside the other tenants' floors and reservations.
    #[pyo3(signature = (config, /))]
    fn add_tenant(&self, config: PyTenantConfig) -> PyResult<()> {
        Ok(locked(&self.inner, |x| x.add_tenant(config.inner))??)
    }

    /// Replace a tenant's configuration live (matched by name). A raised floor
    /// must be honourable now; a lowered cap limits only new admissions; the rate
    /// bucket keeps its level, clipped to the new size.
    #[pyo3(signature = (config, /, *, now=None))]
    fn update_tenant(
        &self,
        py: Python<'_>,
        config: PyTenantConfig,
        now: Option<f64>,
    ) -> PyResult<()> {
        let now = now_or_monotonic(py, now)?;
        Ok(locked(&self.inner, |x| {
            x.update_tenant(config.inner, now)
        })??)
    }

    /// Remove a tenant; refused with TenantInUse while it has live requests.
    #[pyo3(signature = (name, /))]
    fn remove_tenant(&self, name: &str) -> PyResult<()> {
        Ok(locked(&self.inner, |x| x.remove_tenant(name))??)
    }

    /// The current configuration of tenant `name`.
    #[pyo3(signature = (name, /))]
    fn tenant(&self, name: &str) -> PyResult<PyTenantConfig> {
        let config = locked(&self.inner, |s| {
            s.tenants().by_name(name).map(|t| t.config.clone())
        })??;
        Ok(PyTenantConfig { inner: config })
    }

    /// Admit a request and return its id, or raise Rejected (reason, retry_after).
    /// Admission reserves ceil((len(prompt_ids) + max_tokens) / block_size) blocks.
    /// `prompt_ids` is a 1-D numpy int32 array.
    #[pyo3(signature = (tenant, prompt_ids, max_tokens, *, now=None))]
    fn submit(
        &self,
        py: Python<'_>,
        tenant: &str,
        prompt_ids: &Bound<'_, PyAny>,
        max_tokens: &Bound<'_, PyAny>,
        now: Option<f64>,
    ) -> PyResult<u64> {
        let arr = Some(int32_arg(prompt_ids, "prompt_ids")?);
        let prompt = int32_array(&arr);
        let max_tokens = count_arg(max_tokens, "max_tokens")?;
        let now = now_or_monotonic(py, now)?;
        Ok(locked(&self.inner, |x| {
            x.submit(tenant, &prompt, max_tokens, now)
        })??)
    }

    /// Cancel a live request: its pages and reservation are released at once.
    /// Raises UnknownRequest for an id that is not live.
    #[pyo3(signature = (request_id, /))]
    fn cancel(&self, request_id: u64) -> PyResult<()> {
        locked(&self.inner, |s| s.cancel(request_id))??;
        Ok(())
    }

    /// Live (admitted, unfinished) requests.
    #[getter]
    fn live_requests(&self) -> PyResult<usize> {
        locked(&self.inner, |x| x.live_requests())
    }

    /// A snapshot: pool counts, per-tenant usage, reservations and counters, and
    /// rejections by reason.
    #[pyo3(signature = (*, now=None))]
    fn stats<'py>(&self, py: Python<'py>, now: Option<f64>) -> PyResult<Bound<'py, PyDict>> {
        let now = now_or_monotonic(py, now)?;
        let st = locked(&self.inner, |s| s.stats(now))?;
        stats_dict(py, &st)
    }
}

fn reasons_dict<'py>(
    py: Python<'py>,
    counts: &[u64; RejectReason::COUNT],
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for r in RejectReason::ALL {
        d.set_item(r.as_str(), counts[r.index()])?;
    }
    Ok(d)
}

fn stats_dict<'py>(
    py: Python<'py>,
    st: &scheduler::SchedulerStats,
) -> PyResult<Bound<'py, PyDict>> {
    let p = &st.pool;
    let pool = PyDict::new(py);
    pool.set_item("num_blocks", p.num_blocks)?;
    pool.set_item("block_size", p.block_size)?;
    pool.set_item("total", p.total)?;
    pool.set_item("free", p.free)?;
    pool.set_item("used", p.used)?;
    pool.set_item("shared", p.shared)?;
    pool.set_item("overhead_reserve", p.overhead_reserve)?;
    pool.set_item("usable", p.usable)?;
    pool.set_item("reserved", p.reserved)?;
    pool.set_item("committed", p.committed)?;

    let tenants = PyDict::new(py);
    for t in &st.tenants {
        let d = PyDict::new(py);
        d.set_item("tier", t.tier)?;
        d.set_item("weight", t.weight)?;
        d.set_item("kv_floor_blocks", t.kv_floor_blocks)?;
        d.set_item("kv_cap_blocks", t.kv_cap_blocks)?;
        d.set_item("reserved_blocks", t.reserved_blocks)?;
        d.set_item("used_blocks", t.used_blocks)?;
        d.set_item("live_requests", t.live_requests)?;
        d.set_item("admitted", t.admitted)?;
        d.set_item("finished", t.finished)?;
        d.set_item("cancelled", t.cancelled)?;
        d.set_item("rejected", reasons_dict(py, &t.rejected)?)?;
        d.set_item("rate_tokens_available", t.rate_tokens_available)?;
        tenants.set_item(&t.name, d)?;
    }

    let out = PyDict::new(py);
    out.set_item("pool", pool)?;
    out.set_item("tenants", tenants)?;
    out.set_item("live_requests", st.live_requests)?;
    out.set_item("rejected", reasons_dict(py, &st.rejected)?)?;
    Ok(out)
}

/// kvsched's native core: the block pool, tenants, admission and scheduler.
#[pymodule(name = "_core")]
mod core_module {
    #[pymodule_export]
    use super::{PyBlockPool, PyScheduler, PySchedulerConfig, PyTenantConfig};

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
        m.add("NULL_PAGE", crate::pool::NULL_PAGE)?;
        Ok(())
    }
}
