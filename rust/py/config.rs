//! `kvsched.SchedulerConfig` and `kvsched.TenantConfig`.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::KvError;
use crate::{scheduler, tenant};

fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

/// An optional value as Python writes it.
fn py_opt<T: std::fmt::Debug>(v: Option<T>) -> String {
    v.map_or_else(|| "None".to_owned(), |v| format!("{v:?}"))
}

/// Scheduler configuration. `num_blocks` and `block_size` are restart-only;
/// every argument left out takes the core's default.
#[pyclass(name = "SchedulerConfig", module = "kvsched", frozen, from_py_object)]
#[derive(Clone)]
pub struct PySchedulerConfig {
    pub(super) inner: scheduler::SchedulerConfig,
}

#[pymethods]
impl PySchedulerConfig {
    #[new]
    #[pyo3(signature = (*, num_blocks=None, block_size=None, max_num_seqs=None,
        max_batched_tokens=None, max_seq_len=None, overhead_reserve=None, max_waiting=None,
        long_prefill_chunk=None, token_buckets=None, admission=None, watermark_blocks=None,
        preempt_lower_tiers=None, full_validation=None, prefix_caching=None,
        prefix_cache_key=None, ladder=None, ladder_retry_after_s=None, require_warmup=None,
        retry_after_hint_s=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: Option<usize>,
        block_size: Option<usize>,
        max_num_seqs: Option<usize>,
        max_batched_tokens: Option<usize>,
        max_seq_len: Option<usize>,
        overhead_reserve: Option<f64>,
        max_waiting: Option<usize>,
        long_prefill_chunk: Option<usize>,
        token_buckets: Option<Vec<usize>>,
        admission: Option<&str>,
        watermark_blocks: Option<usize>,
        preempt_lower_tiers: Option<bool>,
        full_validation: Option<bool>,
        prefix_caching: Option<bool>,
        prefix_cache_key: Option<Vec<u8>>,
        ladder: Option<&Bound<'_, PyAny>>,
        ladder_retry_after_s: Option<f64>,
        require_warmup: Option<bool>,
        retry_after_hint_s: Option<f64>,
    ) -> PyResult<Self> {
        let prefix_cache_key = match prefix_cache_key {
            None => None,
            Some(k) => Some(scheduler::SecretKey(k.as_slice().try_into().map_err(
                |_| {
                    KvError::InvalidConfig(format!(
                        "prefix_cache_key must be 16 bytes, got {}",
                        k.len()
                    ))
                },
            )?)),
        };
        let d = scheduler::SchedulerConfig::default();
        let admission = match (admission.unwrap_or("reserve"), watermark_blocks) {
            ("reserve", None) => scheduler::AdmissionMode::Reserve,
            ("overcommit", w) => scheduler::AdmissionMode::Overcommit {
                watermark_blocks: w.unwrap_or(scheduler::DEFAULT_WATERMARK_BLOCKS),
            },
            ("reserve", Some(_)) => {
                return Err(KvError::InvalidConfig(
                    "watermark_blocks only applies to admission=\"overcommit\"".into(),
                )
                .into())
            }
            (other, _) => {
                return Err(KvError::InvalidConfig(format!(
                    "admission must be \"reserve\" or \"overcommit\", got {other:?}"
                ))
                .into())
            }
        };
        let inner = scheduler::SchedulerConfig {
            num_blocks: num_blocks.unwrap_or(d.num_blocks),
            block_size: block_size.unwrap_or(d.block_size),
            max_num_seqs: max_num_seqs.unwrap_or(d.max_num_seqs),
            max_batched_tokens: max_batched_tokens.unwrap_or(d.max_batched_tokens),
            max_seq_len: max_seq_len.unwrap_or(d.max_seq_len),
            overhead_reserve: overhead_reserve.unwrap_or(d.overhead_reserve),
            max_waiting: max_waiting.unwrap_or(d.max_waiting),
            long_prefill_chunk: long_prefill_chunk.unwrap_or(d.long_prefill_chunk),
            token_buckets,
            admission,
            preempt_lower_tiers: preempt_lower_tiers.unwrap_or(d.preempt_lower_tiers),
            full_validation: full_validation.unwrap_or(d.full_validation),
            prefix_caching: prefix_caching.unwrap_or(d.prefix_caching),
            prefix_cache_key,
            ladder: scheduler::SchedulerConfig::default().ladder,
            require_warmup: require_warmup.unwrap_or(d.require_warmup),
            retry_after_hint_s: retry_after_hint_s.unwrap_or(d.retry_after_hint_s),
        };
        let mut inner = inner;
        inner.ladder = super::ops::ladder_arg(
            ladder,
            inner.max_num_seqs,
            inner.max_seq_len,
            ladder_retry_after_s,
        )?;
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
    /// Most prompt tokens one sequence gets in one step.
    #[getter]
    fn long_prefill_chunk(&self) -> usize {
        self.inner.long_prefill_chunk
    }
    /// The token buckets steps are padded to (sizes, ascending).
    #[getter]
    fn token_buckets(&self) -> PyResult<Vec<usize>> {
        Ok(self.inner.buckets()?.sizes().to_vec())
    }
    /// "reserve" (final-length reservation) or "overcommit" (with preemption).
    #[getter]
    fn admission(&self) -> &'static str {
        match self.inner.admission {
            scheduler::AdmissionMode::Reserve => "reserve",
            scheduler::AdmissionMode::Overcommit { .. } => "overcommit",
        }
    }
    /// Over-commit: blocks reserved beyond the prompt (None in reserve mode).
    #[getter]
    fn watermark_blocks(&self) -> Option<usize> {
        match self.inner.admission {
            scheduler::AdmissionMode::Reserve => None,
            scheduler::AdmissionMode::Overcommit { watermark_blocks } => Some(watermark_blocks),
        }
    }
    /// Whether a waiting higher-tier request preempts a lower-tier running one.
    #[getter]
    fn preempt_lower_tiers(&self) -> bool {
        self.inner.preempt_lower_tiers
    }
    /// Whether every plan is re-read in full after it is written (the cheap
    /// checks always run).
    #[getter]
    fn full_validation(&self) -> bool {
        self.inner.full_validation
    }
    /// Whether full blocks already computed for the same prefix (same
    /// namespace) are reused. The key is write-only: it is never shown.
    #[getter]
    fn prefix_caching(&self) -> bool {
        self.inner.prefix_caching
    }
    /// The degradation ladder's rungs, in climbing order (empty: off). Each a
    /// dict: signal, engage, release, action and, for cap_max_tokens and
    /// max_running, value.
    #[getter]
    fn ladder<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyList>> {
        super::ops::ladder_list(py, &self.inner.ladder)
    }
    /// Seconds a request shed by the ladder is told to wait.
    #[getter]
    fn ladder_retry_after_s(&self) -> f64 {
        self.inner.ladder.retry_after_s
    }
    /// Whether the scheduler starts cold and admits only after mark_ready().
    #[getter]
    fn require_warmup(&self) -> bool {
        self.inner.require_warmup
    }
    /// Seconds of retry_after where nothing better is known: refusals while not
    /// ready or draining, and pool_full / tenant_budget / concurrency refusals
    /// before a step rate is measured. Live.
    #[getter]
    fn retry_after_hint_s(&self) -> f64 {
        self.inner.retry_after_hint_s
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "SchedulerConfig(num_blocks={}, block_size={}, max_num_seqs={}, \
             max_batched_tokens={}, max_seq_len={}, overhead_reserve={:?}, max_waiting={}, \
             long_prefill_chunk={}, admission={:?}, watermark_blocks={}, \
             preempt_lower_tiers={}, prefix_caching={}, retry_after_hint_s={:?})",
            c.num_blocks,
            c.block_size,
            c.max_num_seqs,
            c.max_batched_tokens,
            c.max_seq_len,
            c.overhead_reserve,
            c.max_waiting,
            c.long_prefill_chunk,
            self.admission(),
            py_opt(self.watermark_blocks()),
            py_bool(c.preempt_lower_tiers),
            py_bool(c.prefix_caching),
            c.retry_after_hint_s,
        )
    }

    fn __eq__(&self, other: &Self) -> bool {
        self.inner == other.inner
    }

    /// A copy with some arguments changed (validated like the constructor); the
    /// write-only prefix_cache_key is carried over unless given.
    #[pyo3(signature = (**changes))]
    fn replace(&self, py: Python<'_>, changes: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        self.with_changes(py, changes)
    }
}

impl PySchedulerConfig {
    /// `replace`: this configuration's arguments with `changes` over them; a new
    /// admission mode takes its own default watermark; the key is carried over.
    pub(super) fn with_changes(
        &self,
        py: Python<'_>,
        changes: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let kw = self.kwargs(py)?;
        let mut new_key = false;
        if let Some(c) = changes {
            if c.contains("admission")? && !c.contains("watermark_blocks")? {
                let same = c
                    .get_item("admission")?
                    .map(|a| a.eq(self.admission()))
                    .transpose()?
                    .unwrap_or(true);
                if !same {
                    kw.del_item("watermark_blocks")?;
                }
            }
            new_key = c.contains("prefix_cache_key")?;
            kw.update(c.as_mapping())?;
        }
        let mut out: PySchedulerConfig = py
            .get_type::<PySchedulerConfig>()
            .call((), Some(&kw))?
            .extract()?;
        if !new_key {
            out.inner.prefix_cache_key = self.inner.prefix_cache_key;
        }
        Ok(out)
    }

    /// Every argument that rebuilds this configuration, but the secret key.
    pub(super) fn kwargs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.inner;
        let d = PyDict::new(py);
        d.set_item("num_blocks", c.num_blocks)?;
        d.set_item("block_size", c.block_size)?;
        d.set_item("max_num_seqs", c.max_num_seqs)?;
        d.set_item("max_batched_tokens", c.max_batched_tokens)?;
        d.set_item("max_seq_len", c.max_seq_len)?;
        d.set_item("overhead_reserve", c.overhead_reserve)?;
        d.set_item("max_waiting", c.max_waiting)?;
        d.set_item("long_prefill_chunk", c.long_prefill_chunk)?;
        d.set_item("token_buckets", c.token_buckets.clone())?;
        d.set_item("admission", self.admission())?;
        d.set_item("watermark_blocks", self.watermark_blocks())?;
        d.set_item("preempt_lower_tiers", c.preempt_lower_tiers)?;
        d.set_item("full_validation", c.full_validation)?;
        d.set_item("prefix_caching", c.prefix_caching)?;
        d.set_item("ladder", super::ops::ladder_list(py, &c.ladder)?)?;
        d.set_item("ladder_retry_after_s", c.ladder.retry_after_s)?;
        d.set_item("require_warmup", c.require_warmup)?;
        d.set_item("retry_after_hint_s", c.retry_after_hint_s)?;
        Ok(d)
    }
}

/// A tenant: `tier` (0 most important), `kv_floor_blocks` (guaranteed),
/// `kv_cap_blocks` (burst cap, None: the pool), `max_concurrent` live requests,
/// a token bucket on prompt + max_tokens (`rate_tokens_per_s`, `burst_tokens`,
/// default one second of rate) and a fair-share `weight`.
#[pyclass(name = "TenantConfig", module = "kvsched", frozen, from_py_object)]
#[derive(Clone)]
pub struct PyTenantConfig {
    pub(super) inner: tenant::TenantConfig,
}

#[pymethods]
impl PyTenantConfig {
    #[new]
    #[pyo3(signature = (name, /, *, tier=0, kv_floor_blocks=0, kv_cap_blocks=None,
        max_concurrent=None, rate_tokens_per_s=None, burst_tokens=None, weight=1.0,
        max_step_tokens=None, prefix_namespace=None))]
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
        max_step_tokens: Option<usize>,
        prefix_namespace: Option<String>,
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
            max_step_tokens,
            prefix_namespace,
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
    /// Largest step (tokens) this tenant's sequences are pulled into (None: no cap).
    #[getter]
    fn max_step_tokens(&self) -> Option<usize> {
        self.inner.max_step_tokens
    }
    /// Prefix-cache namespace shared with the tenants naming the same one
    /// (None: its own; no other tenant can hit its blocks).
    #[getter]
    fn prefix_namespace(&self) -> Option<&str> {
        self.inner.prefix_namespace.as_deref()
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "TenantConfig({:?}, tier={}, kv_floor_blocks={}, kv_cap_blocks={}, \
             max_concurrent={}, rate_tokens_per_s={}, burst_tokens={}, weight={:?}, \
             max_step_tokens={}, prefix_namespace={})",
            c.name,
            c.tier,
            c.kv_floor_blocks,
            py_opt(c.kv_cap_blocks),
            py_opt(c.max_concurrent),
            py_opt(c.rate_tokens_per_s),
            py_opt(c.burst_tokens),
            c.weight,
            py_opt(c.max_step_tokens),
            py_opt(c.prefix_namespace.as_deref())
        )
    }

    fn __eq__(&self, other: &Self) -> bool {
        self.inner == other.inner
    }
}
