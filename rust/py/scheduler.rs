//! `kvsched.Scheduler`: its methods, each translating arguments, calling the
//! core under its lock and translating the result. The plan buffers are in
//! plan.rs, the commit and terminal events in events.rs, the stats dicts in
//! stats.rs, checkpoint records in checkpoint.rs.

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList};

use super::checkpoint;
use super::config::{PySchedulerConfig, PyTenantConfig};
use super::events::{event_dict, PyFinishedRequest, PyStepEvents};
use super::plan::{PlanSet, PyStepPlan};
use super::stats::{pressure_dict, Snapshot};
use super::{count_arg, int32_arg, int32_slice, locked, now_or_monotonic, salt_arg};
use crate::error::{KvError, KvResult};
use crate::heap::GiveBackOnDrop;
use crate::scheduler::{self, StepOutcome, SubmitOptions};

/// The KV-cache manager and scheduler. Safe to share between threads.
///
/// Every time-dependent method takes `now` (seconds, float); left out, it is
/// `time.monotonic()`. Pass it always or never. A `now` that is not finite or
/// not in [0, 1e12] raises InvalidRequest and changes nothing; one up to 60 s
/// behind the latest is jitter (nothing refills), further behind re-bases the
/// clock and the rate buckets to it.
#[pyclass(name = "Scheduler", module = "kvsched", frozen)]
pub struct PyScheduler {
    inner: Mutex<scheduler::Scheduler>,
    plans: PlanSet,
    /// Last, so it drops after the two above: hands their pages back (heap.rs).
    _give_back: GiveBackOnDrop,
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (config=None, /))]
    fn new(py: Python<'_>, config: Option<PySchedulerConfig>) -> PyResult<Self> {
        let config = config.map(|c| c.inner).unwrap_or_default();
        let core = scheduler::Scheduler::new(config)?;
        let shape = *core.plan_shape();
        let plans = PlanSet::new(py, &shape, core.buckets().sizes())?;
        Ok(PyScheduler {
            plans,
            inner: Mutex::new(core),
            _give_back: GiveBackOnDrop,
        })
    }

    /// The configuration this scheduler runs with.
    #[getter]
    fn config(&self) -> PyResult<PySchedulerConfig> {
        Ok(PySchedulerConfig {
            inner: locked(&self.inner, |s| s.config().clone())?,
        })
    }

    /// The token buckets a step is padded to: one compiled program each. The
    /// configured ones up to the first holding the most tokens a step can hold
    /// (max_batched_tokens, at most the pool's slots), which becomes that
    /// number when it is larger than the pool's slots.
    #[getter]
    fn token_buckets(&self) -> Vec<usize> {
        self.plans.buckets().to_vec()
    }

    /// Fixed plan dimensions: max_tokens (largest bucket), max_seqs (S),
    /// pages_per_seq (PPS), block_size, pad_slot. S and PPS are at most
    /// num_blocks - 1: no plan can use more.
    #[getter]
    fn plan_shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = locked(&self.inner, |s| *s.plan_shape())?;
        let d = PyDict::new(py);
        d.set_item("max_tokens", s.max_tokens)?;
        d.set_item("max_seqs", s.max_seqs)?;
        d.set_item("pages_per_seq", s.pages_per_seq)?;
        d.set_item("block_size", s.block_size.get())?;
        d.set_item("pad_slot", s.pad_slot)?;
        Ok(d)
    }

    /// Register a tenant. Raises TenantExists, or InvalidConfig when its floor does
    /// not fit beside the other tenants' floors and reservations.
    #[pyo3(signature = (config, /))]
    fn add_tenant(&self, config: PyTenantConfig) -> PyResult<()> {
        Ok(locked(&self.inner, |s| s.add_tenant(config.inner))??)
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
        Ok(locked(&self.inner, |s| {
            s.update_tenant(config.inner, now)
        })??)
    }

    /// Remove a tenant; refused with TenantInUse while it has live requests.
    #[pyo3(signature = (name, /))]
    fn remove_tenant(&self, name: &str) -> PyResult<()> {
        Ok(locked(&self.inner, |s| s.remove_tenant(name))??)
    }

    /// Seconds until `tokens` fit in tenant `name`'s rate limit: 0.0 when they
    /// fit now or it has no rate limit, math.inf when they never will (more than
    /// its burst). Changes nothing. Raises UnknownTenant.
    #[pyo3(signature = (name, tokens, /, *, now=None))]
    fn rate_wait(
        &self,
        py: Python<'_>,
        name: &str,
        tokens: usize,
        now: Option<f64>,
    ) -> PyResult<f64> {
        let now = now_or_monotonic(py, now)?;
        Ok(locked(&self.inner, |s| s.rate_wait(name, tokens, now))??)
    }

    /// Take `tokens` from tenant `name`'s rate limit (down to empty) for work a
    /// refused request cost the caller, e.g. a prompt tokenized and then found
    /// too long. Nothing for a tenant without a rate limit. Raises UnknownTenant.
    #[pyo3(signature = (name, tokens, /, *, now=None))]
    fn charge_rate(
        &self,
        py: Python<'_>,
        name: &str,
        tokens: usize,
        now: Option<f64>,
    ) -> PyResult<()> {
        let now = now_or_monotonic(py, now)?;
        Ok(locked(&self.inner, |s| s.charge_rate(name, tokens, now))??)
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
    /// Admission reserves ceil((len(prompt_ids) + max_tokens) / block_size) blocks
    /// (over-commit: the prompt plus the watermark). `prompt_ids` is a 1-D numpy
    /// int32 array; sampling any of `stop_token_ids` finishes the request.
    ///
    /// Reserve mode looks up the prompt's longest cached prefix in the
    /// request's namespace (its tenant's, or the shared one the tenant names,
    /// mixed with `cache_salt` when given: str or bytes) and shares those pages
    /// at once; prefill starts after them.
    ///
    /// `retry_after` (seconds) of a refusal: rate_limited, the exact wait for
    /// the tenant's bucket; shed, the ladder's ladder_retry_after_s; draining
    /// and not_ready, retry_after_hint_s; pool_full, tenant_budget and
    /// concurrency, an estimate from what runs: the running requests holding
    /// the room, taken in order of the steps they have left ((max_tokens -
    /// generated) + (uncomputed prompt - 1) // long_prefill_chunk) until
    /// enough would end for this request to fit, k the steps of the last one
    /// taken, gives k * step period (the median gap between the last 32 pairs
    /// of consecutive steps that both ran something), or retry_after_hint_s
    /// before a step period is measured; None when even all running requests
    /// ending would not make room. None for refusals that can never pass
    /// (too_long, invalid, unknown_tenant, a request over its tenant's cap or
    /// burst, or, over-committed, over the pool).
    ///
    /// A request the scheduler's global limits (the live-request cap
    /// max_num_seqs + max_waiting, the pool) would refuse displaces requests of
    /// lower tiers when that makes room, all or nothing: those not yet running
    /// (with preempt_lower_tiers, running ones too), lowest tier and newest
    /// first. Each ends with a FinishedRequest, reason "shed", with a
    /// retry_after (delivered like a cancel's; a "displaced" event is logged).
    #[pyo3(signature = (tenant, prompt_ids, max_tokens, *, stop_token_ids=None,
        cache_salt=None, now=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        tenant: &str,
        prompt_ids: &Bound<'_, PyAny>,
        max_tokens: &Bound<'_, PyAny>,
        stop_token_ids: Option<Vec<i32>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        now: Option<f64>,
    ) -> PyResult<u64> {
        let arr = int32_arg(prompt_ids, "prompt_ids")?;
        let prompt = int32_slice(&arr);
        let max_tokens = count_arg(max_tokens, "max_tokens")?;
        let salt = cache_salt.map(salt_arg).transpose()?;
        let now = now_or_monotonic(py, now)?;
        let stops = stop_token_ids.unwrap_or_default();
        let opts = SubmitOptions {
            stop_token_ids: &stops,
            cache_salt: salt.as_deref(),
        };
        Ok(locked(&self.inner, |s| {
            s.submit_with(tenant, &prompt, max_tokens, &opts, now)
        })??)
    }

    /// Cancel a request: its pages and reservation are released at once, and
    /// its terminal event (a FinishedRequest, reason "cancelled", the tokens
    /// generated so far) is delivered by the next commit() or take_finished().
    /// Returns True when it was live; False when it had already ended on its
    /// own (finished, or handed back at a drain deadline: its terminal event
    /// exists and nothing changes), so a cancel racing the end of a request is
    /// not an error. Raises UnknownRequest for an id never issued, or one
    /// already ended by cancel() or stop() (ending it twice is a caller bug).
    #[pyo3(signature = (request_id, /, *, now=None))]
    fn cancel(&self, py: Python<'_>, request_id: u64, now: Option<f64>) -> PyResult<bool> {
        let now = now_or_monotonic(py, now)?;
        Ok(locked(&self.inner, |s| s.cancel_at(request_id, now))??)
    }

    /// End a live request as finished, reason "stop": the host matched a stop
    /// string in its detokenized text. Counted as finished (not cancelled) in
    /// stats and the e2e histogram; its pages are released at once and its
    /// FinishedRequest (the tokens generated so far) is delivered by the next
    /// commit() or take_finished(). Returns and raises as cancel() does.
    #[pyo3(signature = (request_id, /, *, now=None))]
    fn stop(&self, py: Python<'_>, request_id: u64, now: Option<f64>) -> PyResult<bool> {
        let now = now_or_monotonic(py, now)?;
        Ok(locked(&self.inner, |s| s.stop(request_id, now))??)
    }

    /// End a live request as "error": the host could not serve it (`error`
    /// says why: its logits were not finite, say). Its pages are released at
    /// once; its FinishedRequest (reason "error", with `error`, the tokens so
    /// far) is delivered by the next commit() or take_finished(), so the
    /// core's terminal event and what the host's client is told agree. Counted
    /// as not finished. Returns and raises as cancel() does.
    #[pyo3(signature = (request_id, error, /, *, now=None))]
    fn fail(
        &self,
        py: Python<'_>,
        request_id: u64,
        error: String,
        now: Option<f64>,
    ) -> PyResult<bool> {
        let now = now_or_monotonic(py, now)?;
        Ok(locked(&self.inner, |s| s.fail(request_id, error, now))??)
    }

    /// Terminal events of requests ended outside a commit (cancel, stop, a
    /// drain deadline) not delivered yet, in the order they ended. Each
    /// terminal event is delivered exactly once, by whichever comes first: this
    /// call or the next commit() (first in its `finished`). A loop whose step()
    /// returned None calls this to see them.
    fn take_finished<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let ended = locked(&self.inner, |s| s.take_finished())?;
        let out = PyList::empty(py);
        for f in ended {
            out.append(Py::new(py, PyFinishedRequest::new(py, f))?)?;
        }
        Ok(out)
    }

    /// Plan the next step: a StepPlan, or None when nothing can run.
    ///
    /// The plan's arrays are read-only views of buffers this scheduler owns and
    /// reuses: they stay valid until the second step() after this one (two buffer
    /// sets alternate), so the engine may keep reading them while the next step
    /// is planned. Copy them to keep them longer. Commit the plan before the next
    /// step().
    #[pyo3(signature = (*, now=None))]
    fn step(&self, py: Python<'_>, now: Option<f64>) -> PyResult<Option<PyStepPlan>> {
        let now = now_or_monotonic(py, now)?;
        let outcome = locked(&self.inner, |s| -> KvResult<Option<StepOutcome>> {
            // SAFETY: the scheduler's lock is held while the core writes.
            let mut bufs = unsafe { self.plans.borrow(py, s.next_parity())? };
            s.step(now, &mut bufs)
        })??;
        outcome.map(|out| self.plans.plan(py, out)).transpose()
    }

    /// Close a step: `sampled_ids` (1-D int32) holds one token per sequence in
    /// plan order (ignored where `plan.samples` is False). Appends tokens,
    /// finishes requests (max_tokens or a stop token) and frees their pages.
    /// Its `finished` also delivers, first, the terminal events of requests
    /// ended since the last delivery (cancel, stop, a drain deadline).
    /// Raises StalePlan for a plan that is not the pending one and InvalidState
    /// for sampled ids that do not fit it; then nothing changes.
    #[pyo3(signature = (plan, sampled_ids, /, *, now=None))]
    fn commit(
        &self,
        py: Python<'_>,
        plan: &Bound<'_, PyStepPlan>,
        sampled_ids: &Bound<'_, PyAny>,
        now: Option<f64>,
    ) -> PyResult<PyStepEvents> {
        // A malformed sampled array is a bad commit, not a refused request.
        let arr = int32_arg(sampled_ids, "sampled_ids")
            .map_err(|e| KvError::InvalidState(e.value(py).to_string()))?;
        let sampled = int32_slice(&arr);
        let now = now_or_monotonic(py, now)?;
        let step_id = plan.get().step_id;
        let events = locked(&self.inner, |s| s.commit(step_id, &sampled, now))??;
        PyStepEvents::new(py, events)
    }

    /// Close a step before its tokens are known (overlapped scheduling): each
    /// sequence that samples draws a placeholder, -(row + 1), so the next
    /// step() can be planned while the device still runs this one; that
    /// plan's `token_ids` hold the placeholder where a decode's input is the
    /// token this plan samples at that row (take it from the device's sampled
    /// array). `resolve` then gives the tokens and returns the events. At most
    /// one plan is advanced and not resolved. Raises StalePlan for a plan that
    /// is not the pending one or while another is unresolved; then nothing
    /// changes.
    #[pyo3(signature = (plan, /, *, now=None))]
    fn advance(
        &self,
        py: Python<'_>,
        plan: &Bound<'_, PyStepPlan>,
        now: Option<f64>,
    ) -> PyResult<()> {
        let now = now_or_monotonic(py, now)?;
        let step_id = plan.get().step_id;
        Ok(locked(&self.inner, |s| s.advance(step_id, now))??)
    }

    /// Give an advanced step its sampled tokens (1-D int32, one per sequence
    /// in plan order, ignored where `plan.samples` is False): they replace
    /// the placeholders, and a stop token ends its request now (one step
    /// late: the token the next plan computed for it is dropped). Returns the
    /// step's events as commit() would have (a request ended since the
    /// advance gets no token), after the terminal events queued since the
    /// last delivery. Raises StalePlan for a plan that is not the advanced
    /// one and InvalidState for ids that do not fit it; then nothing changes.
    #[pyo3(signature = (plan, sampled_ids, /, *, now=None))]
    fn resolve(
        &self,
        py: Python<'_>,
        plan: &Bound<'_, PyStepPlan>,
        sampled_ids: &Bound<'_, PyAny>,
        now: Option<f64>,
    ) -> PyResult<PyStepEvents> {
        let arr = int32_arg(sampled_ids, "sampled_ids")
            .map_err(|e| KvError::InvalidState(e.value(py).to_string()))?;
        let sampled = int32_slice(&arr);
        let now = now_or_monotonic(py, now)?;
        let step_id = plan.get().step_id;
        let events = locked(&self.inner, |s| s.resolve(step_id, &sampled, now))??;
        PyStepEvents::new(py, events)
    }

    /// The step advanced and not yet resolved (None when there is none).
    #[getter]
    fn unresolved_step(&self) -> PyResult<Option<u64>> {
        locked(&self.inner, |s| s.unresolved_step())
    }

    /// Live (admitted, unfinished) requests.
    #[getter]
    fn live_requests(&self) -> PyResult<usize> {
        locked(&self.inner, |s| s.live_requests())
    }

    /// A snapshot: pool counts, per-tenant usage, reservations, counters, latency
    /// histograms (seconds; buckets are cumulative over kvsched.LATENCY_BUCKETS
    /// plus +inf), and rejections by reason.
    #[pyo3(signature = (*, now=None))]
    fn stats<'py>(&self, py: Python<'py>, now: Option<f64>) -> PyResult<Bound<'py, PyDict>> {
        let now = now_or_monotonic(py, now)?;
        let snapshot = locked(&self.inner, |s| Snapshot::take(s, now))?;
        snapshot.to_dict(py)
    }

    // -- operations ----------------------------------------------------------------

    /// Change live knobs, given as SchedulerConfig keyword arguments; effective
    /// from the next step, validated as a whole, nothing changes on an error.
    /// Restart-only knobs (num_blocks, block_size, token_buckets, admission,
    /// prefix_caching, prefix_cache_key, prefix_cache_partition, vocab_size,
    /// kv_cache_groups, and raising
    /// max_num_seqs, max_seq_len or max_batched_tokens past the plan shape)
    /// raise RestartRequired naming the knob.
    #[pyo3(signature = (**knobs))]
    fn reconfigure(&self, py: Python<'_>, knobs: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
        // Built from a snapshot, applied only if nobody changed the config in
        // between (another thread's reconfigure would otherwise be undone).
        for _ in 0..8 {
            let snapshot = locked(&self.inner, |s| s.config().clone())?;
            let new = PySchedulerConfig {
                inner: snapshot.clone(),
            }
            .with_changes(py, knobs)?;
            let applied = locked(&self.inner, |s| {
                (s.config() == &snapshot).then(|| s.update_config(new.inner))
            })?;
            if let Some(result) = applied {
                return Ok(result?);
            }
        }
        Err(KvError::InvalidState(
            "reconfigure: the configuration kept changing under concurrent calls; retry".into(),
        )
        .into())
    }

    /// Events since the last call, oldest first: ladder rungs engaged and
    /// released, requests admitted with max_tokens capped. At most 4096 wait;
    /// older ones are dropped and counted in stats()["events_dropped"].
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = locked(&self.inner, |s| s.take_events())?;
        let out = PyList::empty(py);
        for e in &events {
            out.append(event_dict(py, e)?)?;
        }
        Ok(out)
    }

    /// Record the prefix cache's changes from now on for routers (KV events);
    /// nothing when prefix caching is off. Drain them with `drain_kv_events`
    /// (once a step: what is not drained accumulates, up to a bound).
    fn enable_kv_events(&self) -> PyResult<()> {
        locked(&self.inner, |s| s.enable_kv_events())
    }

    /// The prefix cache's changes since the last call, as one batch in vLLM's
    /// KV-event wire format (msgpack `[timestamp, events, data_parallel_rank]`;
    /// docs/fleet.md), or None when nothing changed or events are off.
    #[pyo3(signature = (timestamp, /, data_parallel_rank=0))]
    fn drain_kv_events<'py>(
        &self,
        py: Python<'py>,
        timestamp: f64,
        data_parallel_rank: i64,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let batch = locked(&self.inner, |s| {
            s.drain_kv_events(timestamp, data_parallel_rank)
        })?;
        Ok(batch.map(|b| PyBytes::new(py, &b)))
    }

    /// (events waiting to be drained, events lost to the bound since start).
    fn kv_events_pending(&self) -> PyResult<(usize, u64)> {
        locked(&self.inner, |s| s.kv_events_pending())
    }

    /// The blocks the prefix cache holds, as KV events name them: a list of
    /// (group, block hash), one per cached page.
    fn cached_blocks_on_wire(&self) -> PyResult<Vec<(u8, u64)>> {
        locked(&self.inner, |s| s.cached_blocks_on_wire())
    }

    /// The ladder's signals now: reserved_share, queue_depth, oldest_wait_s.
    #[pyo3(signature = (*, now=None))]
    fn pressure<'py>(&self, py: Python<'py>, now: Option<f64>) -> PyResult<Bound<'py, PyDict>> {
        let now = now_or_monotonic(py, now)?;
        let p = locked(&self.inner, |s| s.pressure(now))?;
        pressure_dict(py, &p)
    }

    /// "cold", "warming", "ready", "draining" or "drained".
    #[getter]
    fn lifecycle(&self) -> PyResult<&'static str> {
        locked(&self.inner, |s| s.lifecycle().as_str())
    }

    /// Liveness: the scheduler answers and can still run work (not drained).
    fn live(&self) -> PyResult<bool> {
        locked(&self.inner, |s| s.live())
    }

    /// Readiness: warm and admitting.
    fn ready(&self) -> PyResult<bool> {
        locked(&self.inner, |s| s.ready())
    }

    /// The engine started loading weights and compiling (cold -> warming).
    fn begin_warmup(&self) -> PyResult<()> {
        Ok(locked(&self.inner, |s| s.begin_warmup())??)
    }

    /// The engine is warm: weights resident, every bucket compiled, a synthetic
    /// request completed. Admission opens.
    fn mark_ready(&self) -> PyResult<()> {
        Ok(locked(&self.inner, |s| s.mark_ready())??)
    }

    /// Stop admitting (submit raises Rejected "draining") and keep stepping the
    /// in-flight requests; the first step at or after `deadline` (seconds, the
    /// clock of `now`) hands back whatever is unfinished, each with a terminal
    /// event (reason "drain_deadline", the tokens so far) for take_finished()
    /// (that step returns None). Then `checkpoint`.
    #[pyo3(signature = (deadline, /))]
    fn drain(&self, deadline: f64) -> PyResult<()> {
        Ok(locked(&self.inner, |s| s.drain(deadline))??)
    }

    /// Write the requests finished since the drain began and every unfinished
    /// one (tenant, prompt, tokens generated so far, options, reason) as JSON
    /// lines between a header and a checksummed trailer, durably (a temporary
    /// file, fsync, rename). Returns the counts.
    /// The file is kvsched.checkpoint's (this calls kvsched.checkpoint.save).
    #[pyo3(signature = (path, /))]
    fn checkpoint<'py>(
        slf: &Bound<'py, Self>,
        path: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        checkpoint_module(slf.py())?.call_method1("save", (slf, path))
    }

    /// Submit again every in-flight request of a checkpoint, all or nothing:
    /// each continues after the tokens it had generated. Returns {"restored":
    /// {old id: new id}, "refused": {} (always empty: any refusal restores
    /// nothing and raises CheckpointError), "finished": [the finished records]}.
    /// The file is kvsched.checkpoint's (this calls kvsched.checkpoint.restore).
    #[pyo3(signature = (path, /, *, now=None))]
    fn restore<'py>(
        slf: &Bound<'py, Self>,
        path: &Bound<'py, PyAny>,
        now: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kwargs = PyDict::new(slf.py());
        kwargs.set_item("now", now)?;
        checkpoint_module(slf.py())?.call_method("restore", (slf, path), Some(&kwargs))
    }

    /// The checkpoint as records (what checkpoint() writes, one a line): the
    /// requests finished since the drain began (kind "finished"), then every
    /// unfinished one (kind "in_flight": handed back at the drain deadline, or
    /// still live).
    fn checkpoint_records<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let (finished, in_flight) = locked(&self.inner, |s| s.checkpoint())?;
        checkpoint::records(py, &finished, &in_flight)
    }

    /// Submit again in-flight checkpoint records, all or nothing: each
    /// continues after the tokens it had generated. A malformed record raises
    /// InvalidRequest; a duplicated id, an unknown tenant or any refusal (pool
    /// full, ...) raises CheckpointError naming every refused id in `.refused`;
    /// either way nothing changes. So that nothing does, several records
    /// displace no lower-tier request (one that only displacement would
    /// admit is refused); a single record displaces like submit. Returns
    /// {"restored": {old id: new id}, "refused": {}} (always empty, kept for
    /// the result's shape).
    #[pyo3(signature = (records, /, *, now=None))]
    fn restore_records<'py>(
        &self,
        py: Python<'py>,
        records: &Bound<'py, PyAny>,
        now: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let now = now_or_monotonic(py, now)?;
        let records = checkpoint::read_records(records)?;
        let ids = locked(&self.inner, |s| s.restore_all(&records, now))??;
        let restored = PyDict::new(py);
        for (rec, id) in records.iter().zip(ids) {
            restored.set_item(rec.id, id)?;
        }
        let d = PyDict::new(py);
        d.set_item("restored", restored)?;
        d.set_item("refused", PyDict::new(py))?;
        Ok(d)
    }
}

/// `kvsched.checkpoint`, the module that owns the checkpoint file.
fn checkpoint_module(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    static MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    MODULE
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(py.import("kvsched.checkpoint")?.unbind())
        })
        .map(|m| m.bind(py))
}
