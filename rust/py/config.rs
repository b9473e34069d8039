//! `kvsched.SchedulerConfig` and `kvsched.TenantConfig`.
//!
//! Each class's knobs are listed once, in a `knob_table!`: that table makes
//! the getters, the keyword arguments that rebuild the object (`replace` and
//! `reconfigure` start from them) and the repr, so a knob cannot be in one of
//! them and missing from another. The constructor stays written out (it turns
//! several arguments into one core value: admission with watermark_blocks,
//! ladder with ladder_retry_after_s); tests/test_config_knobs.py checks that
//! its parameters, and the stub's, are the table's.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::error::KvError;
use crate::{scheduler, tenant};

/// The knob table of a config class.
///
/// Each line is `name: Type = |c, py| getter` with an optional
/// `, kwarg value` (same `c` and `py`): `c` is the core config, `py` the GIL
/// token. The
/// getter is what Python reads as `obj.name`; the kwarg (the getter when left
/// out) is what the constructor takes back to rebuild this exact object (for
/// token_buckets: None when the buckets are derived, not the derived list).
///
/// It expands to the class's single `#[pymethods]` block (one getter per
/// line, plus the methods given after `@methods`) and to `knob_kwargs()`
/// (name -> kwarg, in the table's order).
macro_rules! knob_table {
    (@kwarg $self:ident, $pyv:ident, $name:ident, $c:ident, $py:ident) => {
        $self.$name($pyv)?
    };
    (@kwarg $self:ident, $pyv:ident, $name:ident, $c:ident, $py:ident, $kw:expr) => {{
        #[allow(unused_variables)]
        let $c = &$self.inner;
        #[allow(unused_variables)]
        let $py = $pyv;
        $kw
    }};
    (
        $class:ident;
        $(
            $(#[doc = $doc:literal])*
            $name:ident: $ty:ty = |$c:ident, $py:ident| $get:expr
            $(, kwarg $kw:expr)?;
        )*
        @methods { $($methods:tt)* }
    ) => {
        #[pymethods]
        impl $class {
            $(
                $(#[doc = $doc])*
                #[getter]
                #[allow(unused_variables)]
                fn $name(&self, $py: Python<'_>) -> PyResult<$ty> {
                    let $c = &self.inner;
                    Ok($get)
                }
            )*
            $($methods)*
        }

        impl $class {
            /// Every knob as the keyword argument that rebuilds this object.
            pub(super) fn knob_kwargs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                let d = PyDict::new(py);
                $(
                    d.set_item(stringify!($name), knob_table!(@kwarg self, py, $name, $c, $py $(, $kw)?))?;
                )*
                Ok(d)
            }
        }
    };
}

/// `name=value, ...` with Python's repr of each value, skipping `skip`.
fn kwargs_repr(kwargs: &Bound<'_, PyDict>, skip: &[&str]) -> PyResult<String> {
    let mut parts = Vec::with_capacity(kwargs.len());
    for (k, v) in kwargs.iter() {
        let k: String = k.extract()?;
        if !skip.contains(&k.as_str()) {
            parts.push(format!("{k}={}", v.repr()?));
        }
    }
    Ok(parts.join(", "))
}

/// Argument readers for the integer knobs (`from_py_with`): each names its
/// knob when a value is out of range, where pyo3's own conversion raises a bare
/// OverflowError. A reader, not a wrapper type, so the signatures' defaults
/// stay the plain `0` / `None` that `inspect.signature` shows.
macro_rules! int_knob_args {
    ($($f:ident -> $ret:ty = $via:ident($knob:literal);)*) => {$(
        fn $f(o: &Bound<'_, PyAny>) -> PyResult<$ret> {
            super::$via(o, $knob)
        }
    )*};
}

int_knob_args! {
    num_blocks_arg -> Option<usize> = opt_uint_knob("num_blocks");
    block_size_arg -> Option<usize> = opt_uint_knob("block_size");
    max_num_seqs_arg -> Option<usize> = opt_uint_knob("max_num_seqs");
    max_batched_tokens_arg -> Option<usize> = opt_uint_knob("max_batched_tokens");
    max_seq_len_arg -> Option<usize> = opt_uint_knob("max_seq_len");
    max_waiting_arg -> Option<usize> = opt_uint_knob("max_waiting");
    long_prefill_chunk_arg -> Option<usize> = opt_uint_knob("long_prefill_chunk");
    watermark_blocks_arg -> Option<usize> = opt_uint_knob("watermark_blocks");
    tier_arg -> u32 = uint_knob("tier");
    kv_floor_blocks_arg -> usize = uint_knob("kv_floor_blocks");
    kv_cap_blocks_arg -> Option<usize> = opt_uint_knob("kv_cap_blocks");
    max_concurrent_arg -> Option<u32> = opt_uint_knob("max_concurrent");
    max_step_tokens_arg -> Option<usize> = opt_uint_knob("max_step_tokens");
    vocab_size_arg -> Option<u32> = opt_uint_knob("vocab_size");
}

/// `token_buckets`: None or a sequence of sizes, each read like the other
/// integer knobs.
fn token_buckets_arg(o: &Bound<'_, PyAny>) -> PyResult<Option<Vec<usize>>> {
    if o.is_none() {
        return Ok(None);
    }
    let items: Vec<Bound<'_, PyAny>> = o.extract().map_err(|_| {
        let found = o
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "?".into());
        pyo3::exceptions::PyTypeError::new_err(format!(
            "token_buckets must be a list of ints, got {found}"
        ))
    })?;
    items
        .iter()
        .map(|i| super::uint_knob(i, "token_buckets entry"))
        .collect::<PyResult<Vec<usize>>>()
        .map(Some)
}

/// `kv_cache_groups`: None or a list of group names (a lone string is not a
/// list of them).
fn kv_cache_groups_arg(o: &Bound<'_, PyAny>) -> PyResult<Option<Vec<String>>> {
    if o.is_none() {
        return Ok(None);
    }
    let names = (!o.is_instance_of::<pyo3::types::PyString>())
        .then(|| o.extract::<Vec<String>>().ok())
        .flatten();
    names.map(Some).ok_or_else(|| {
        KvError::InvalidConfig(
            "kv_cache_groups must be a list of group names (\"full\", \"sliding_window:W\", \
             \"chunked_local:C\"), group 0 \"full\""
                .into(),
        )
        .into()
    })
}

/// Scheduler configuration. `num_blocks` and `block_size` are restart-only;
/// every argument left out takes the core's default.
#[pyclass(name = "SchedulerConfig", module = "kvsched", frozen, from_py_object)]
#[derive(Clone)]
pub struct PySchedulerConfig {
    pub(super) inner: scheduler::SchedulerConfig,
}

knob_table! {
    PySchedulerConfig;
    /// Pages in the pool, the null page 0 included. Restart-only.
    num_blocks: usize = |c, py| c.num_blocks;
    /// Tokens per page. Restart-only.
    block_size: usize = |c, py| c.block_size;
    /// Most sequences in one step (a plan has at most num_blocks - 1 rows).
    max_num_seqs: usize = |c, py| c.max_num_seqs;
    /// Token budget of one step.
    max_batched_tokens: usize = |c, py| c.max_batched_tokens;
    /// Longest prompt + max_tokens admitted (a plan row holds at most
    /// num_blocks - 1 pages).
    max_seq_len: usize = |c, py| c.max_seq_len;
    /// Share of the pool kept out of admission.
    overhead_reserve: f64 = |c, py| c.overhead_reserve;
    /// Admitted requests that may wait beyond the max_num_seqs that run (the
    /// sum saturates: a huge value means no limit but the pool).
    max_waiting: usize = |c, py| c.max_waiting;
    /// Most prompt tokens one sequence gets in one step.
    long_prefill_chunk: usize = |c, py| c.long_prefill_chunk;
    /// The token buckets steps are padded to (sizes, ascending).
    token_buckets: Vec<usize> = |c, py| c.buckets()?.sizes().to_vec(),
        kwarg c.token_buckets.clone();
    /// "reserve" (final-length reservation) or "overcommit" (with preemption).
    admission: &'static str = |c, py| match c.admission {
        scheduler::AdmissionMode::Reserve => "reserve",
        scheduler::AdmissionMode::Overcommit { .. } => "overcommit",
    };
    /// Over-commit: blocks reserved beyond the prompt (None in reserve mode;
    /// never more than the final length).
    watermark_blocks: Option<usize> = |c, py| match c.admission {
        scheduler::AdmissionMode::Reserve => None,
        scheduler::AdmissionMode::Overcommit { watermark_blocks } => Some(watermark_blocks),
    };
    /// Whether a waiting higher-tier request preempts a lower-tier running one.
    preempt_lower_tiers: bool = |c, py| c.preempt_lower_tiers;
    /// Whether every plan is re-read in full after it is written (the cheap
    /// checks always run).
    full_validation: bool = |c, py| c.full_validation;
    /// Whether full blocks already computed for the same prefix (same
    /// namespace) are reused. The key is write-only: it is never shown.
    prefix_caching: bool = |c, py| c.prefix_caching;
    /// Whose allocations may evict a tenant's cached blocks: "shared" (one
    /// LRU for all) or "tenant" (each tenant's own, kept within its unused
    /// floor; reserve admission only). Restart-only.
    prefix_cache_partition: &'static str = |c, py| match c.prefix_cache_partition {
        scheduler::CachePartition::Shared => "shared",
        scheduler::CachePartition::Tenant => "tenant",
    };
    /// The degradation ladder's rungs, in climbing order (empty: off). Each a
    /// dict: signal, engage, release, action and, for cap_max_tokens and
    /// max_running, value.
    ladder: Py<PyList> = |c, py| super::ladder::ladder_list(py, &c.ladder)?.unbind();
    /// Seconds a request shed by the ladder is told to wait.
    ladder_retry_after_s: f64 = |c, py| c.ladder.retry_after_s;
    /// Whether the scheduler starts cold and admits only after mark_ready().
    require_warmup: bool = |c, py| c.require_warmup;
    /// Seconds of retry_after where nothing better is known: refusals while not
    /// ready or draining, and pool_full / tenant_budget / concurrency refusals
    /// before a step rate is measured. Live.
    retry_after_hint_s: f64 = |c, py| c.retry_after_hint_s;
    /// The model's vocabulary size: prompt, sampled and restored token ids must
    /// be below it (None: only checked for being non-negative). Restart-only.
    vocab_size: Option<u32> = |c, py| c.vocab_size;
    /// The model's KV-cache groups, group 0 first: "full", "sliding_window:W"
    /// or "chunked_local:C" each (group 0 is "full"). One page table per
    /// group per request, from the one pool; a window group holds only what
    /// its window reads. Restart-only.
    kv_cache_groups: Vec<String> = |c, py| c.kv_cache_groups.kinds().iter().map(|k| k.name()).collect();

    @methods {
        #[new]
        #[pyo3(signature = (*, num_blocks=None, block_size=None, max_num_seqs=None,
            max_batched_tokens=None, max_seq_len=None, overhead_reserve=None, max_waiting=None,
            long_prefill_chunk=None, token_buckets=None, admission=None, watermark_blocks=None,
            preempt_lower_tiers=None, full_validation=None, prefix_caching=None,
            prefix_cache_key=None, prefix_cache_partition=None, ladder=None, ladder_retry_after_s=None, require_warmup=None,
            retry_after_hint_s=None, vocab_size=None, kv_cache_groups=None))]
        #[allow(clippy::too_many_arguments)]
        fn new(
            #[pyo3(from_py_with = num_blocks_arg)] num_blocks: Option<usize>,
            #[pyo3(from_py_with = block_size_arg)] block_size: Option<usize>,
            #[pyo3(from_py_with = max_num_seqs_arg)] max_num_seqs: Option<usize>,
            #[pyo3(from_py_with = max_batched_tokens_arg)] max_batched_tokens: Option<usize>,
            #[pyo3(from_py_with = max_seq_len_arg)] max_seq_len: Option<usize>,
            overhead_reserve: Option<f64>,
            #[pyo3(from_py_with = max_waiting_arg)] max_waiting: Option<usize>,
            #[pyo3(from_py_with = long_prefill_chunk_arg)] long_prefill_chunk: Option<usize>,
            #[pyo3(from_py_with = token_buckets_arg)] token_buckets: Option<Vec<usize>>,
            admission: Option<&str>,
            #[pyo3(from_py_with = watermark_blocks_arg)] watermark_blocks: Option<usize>,
            preempt_lower_tiers: Option<bool>,
            full_validation: Option<bool>,
            prefix_caching: Option<bool>,
            prefix_cache_key: Option<Vec<u8>>,
            prefix_cache_partition: Option<&str>,
            ladder: Option<&Bound<'_, PyAny>>,
            ladder_retry_after_s: Option<f64>,
            require_warmup: Option<bool>,
            retry_after_hint_s: Option<f64>,
            #[pyo3(from_py_with = vocab_size_arg)] vocab_size: Option<u32>,
            #[pyo3(from_py_with = kv_cache_groups_arg)] kv_cache_groups: Option<Vec<String>>,
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
            let prefix_cache_partition = match prefix_cache_partition {
                None => d.prefix_cache_partition,
                Some("shared") => scheduler::CachePartition::Shared,
                Some("tenant") => scheduler::CachePartition::Tenant,
                Some(other) => {
                    return Err(KvError::InvalidConfig(format!(
                        "prefix_cache_partition must be \"shared\" or \"tenant\", got {other:?}"
                    ))
                    .into())
                }
            };
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
                prefix_cache_partition,
                ladder: scheduler::SchedulerConfig::default().ladder,
                require_warmup: require_warmup.unwrap_or(d.require_warmup),
                retry_after_hint_s: retry_after_hint_s.unwrap_or(d.retry_after_hint_s),
                vocab_size,
                kv_cache_groups: match kv_cache_groups {
                    None => d.kv_cache_groups.clone(),
                    Some(names) => crate::groups::KvGroups::parse(&names)?,
                },
            };
            let mut inner = inner;
            inner.ladder = super::ladder::ladder_arg(
                ladder,
                inner.max_num_seqs,
                inner.max_seq_len,
                ladder_retry_after_s,
            )?;
            inner.validate()?;
            Ok(PySchedulerConfig { inner })
        }

        /// Every knob as Python writes it (the secret prefix_cache_key is
        /// never shown): `eval(repr(c))` rebuilds `c` but for the key.
        fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
            Ok(format!("SchedulerConfig({})", kwargs_repr(&self.knob_kwargs(py)?, &[])?))
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
}

impl PySchedulerConfig {
    /// `replace`: this configuration's arguments with `changes` over them; a new
    /// admission mode takes its own default watermark; the key is carried over.
    pub(super) fn with_changes(
        &self,
        py: Python<'_>,
        changes: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let kw = self.knob_kwargs(py)?;
        let mut new_key = false;
        if let Some(c) = changes {
            if c.contains("admission")? && !c.contains("watermark_blocks")? {
                let mine = self.admission(py)?;
                let same = c
                    .get_item("admission")?
                    .map(|a| a.eq(mine))
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

knob_table! {
    PyTenantConfig;
    /// The tenant's name (unique; a metric label).
    name: String = |c, py| c.name.clone();
    /// 0 is the most important tier.
    tier: u32 = |c, py| c.tier;
    /// Blocks guaranteed to this tenant, never lent to others' reservations
    /// (at most 2**31 - 1; all floors together must fit the usable pool).
    kv_floor_blocks: usize = |c, py| c.kv_floor_blocks;
    /// Most blocks it may hold reserved at once (None, or more than the pool:
    /// bounded by the pool).
    kv_cap_blocks: Option<usize> = |c, py| c.kv_cap_blocks;
    /// Most live requests (None: no per-tenant limit; 0 pauses the tenant).
    max_concurrent: Option<u32> = |c, py| c.max_concurrent;
    /// Token-bucket refill rate, in prompt + max_tokens tokens per second (at
    /// least 1e-6).
    rate_tokens_per_s: Option<f64> = |c, py| c.rate_tokens_per_s;
    /// Token-bucket size (None: one second of rate).
    burst_tokens: Option<f64> = |c, py| c.burst_tokens;
    /// Share of service among the tenants of one tier.
    weight: f64 = |c, py| c.weight;
    /// Largest step (tokens) this tenant's sequences are pulled into (None: no cap).
    max_step_tokens: Option<usize> = |c, py| c.max_step_tokens;
    /// Prefix-cache namespace shared with the tenants naming the same one
    /// (None: its own; no other tenant can hit its blocks).
    prefix_namespace: Option<String> = |c, py| c.prefix_namespace.clone();

    @methods {
        #[new]
        #[pyo3(signature = (name, /, *, tier=0, kv_floor_blocks=0, kv_cap_blocks=None,
            max_concurrent=None, rate_tokens_per_s=None, burst_tokens=None, weight=1.0,
            max_step_tokens=None, prefix_namespace=None))]
        #[allow(clippy::too_many_arguments)]
        fn new(
            name: String,
            #[pyo3(from_py_with = tier_arg)] tier: u32,
            #[pyo3(from_py_with = kv_floor_blocks_arg)] kv_floor_blocks: usize,
            #[pyo3(from_py_with = kv_cap_blocks_arg)] kv_cap_blocks: Option<usize>,
            #[pyo3(from_py_with = max_concurrent_arg)] max_concurrent: Option<u32>,
            rate_tokens_per_s: Option<f64>,
            burst_tokens: Option<f64>,
            weight: f64,
            #[pyo3(from_py_with = max_step_tokens_arg)] max_step_tokens: Option<usize>,
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

        /// The name positionally, then every other knob as Python writes it:
        /// `eval(repr(t))` rebuilds `t`.
        fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
            let kwargs = self.knob_kwargs(py)?;
            let name = pyo3::types::PyString::new(py, &self.inner.name).repr()?;
            Ok(format!("TenantConfig({name}, {})", kwargs_repr(&kwargs, &["name"])?))
        }

        fn __eq__(&self, other: &Self) -> bool {
            self.inner == other.inner
        }
    }
}
