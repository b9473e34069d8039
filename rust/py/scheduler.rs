//! `kvsched.Scheduler`, `StepPlan`, `StepEvents` and `FinishedRequest`.
//!
//! The plan arrays are numpy arrays this object owns, two sets used in turn
//! (double buffering). The core writes into them in place through raw slices;
//! to Python they are read-only (the WRITEABLE flag is cleared on every one, and
//! the per-bucket token arrays are views of them), so a step creates no arrays
//! for the kernel inputs at all.

use std::sync::Mutex;

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySlice};

use super::config::{PySchedulerConfig, PyTenantConfig};
use super::{count_arg, int32_arg, int32_slice, locked, now_or_monotonic, ops, salt_arg};
use crate::error::{KvError, KvResult, RejectReason};
use crate::metrics::{Histogram, LATENCY_BOUNDS};
use crate::planner::{PlanBuffers, PlanShape};
use crate::scheduler::{self, CommitEvents, FinishedRequest, StepOutcome, SubmitOptions};

/// One buffer set: the arrays the core writes and the views handed out.
struct PlanArrays {
    token_ids: Py<PyArray1<i32>>,
    positions: Py<PyArray1<i32>>,
    slot_mapping: Py<PyArray1<i32>>,
    cu_q_lens: Py<PyArray1<i32>>,
    kv_lens: Py<PyArray1<i32>>,
    page_indices: Py<PyArray2<i32>>,
    num_seqs: Py<PyArray1<i32>>,
    distribution: Py<PyArray1<i32>>,
    logits_indices: Py<PyArray1<i32>>,
    /// Per bucket (same order as the buckets): views [:T] of the token arrays.
    token_views: Vec<[Py<PyAny>; 3]>,
}

/// Clear the WRITEABLE flag: Python cannot write the plan arrays (the core's
/// page-table row cache trusts that rows hold what it wrote).
fn freeze(arr: &Bound<'_, PyAny>) -> PyResult<()> {
    arr.getattr("flags")?.setattr("writeable", false)
}

fn prefix_view(py: Python<'_>, base: &Bound<'_, PyAny>, len: usize) -> PyResult<Py<PyAny>> {
    Ok(base
        .get_item(PySlice::new(py, 0, len as isize, 1))?
        .unbind())
}

impl PlanArrays {
    fn new(py: Python<'_>, shape: &PlanShape, buckets: &[usize]) -> PyResult<Self> {
        let (t, s, pps) = (shape.max_tokens, shape.max_seqs, shape.pages_per_seq);
        let token_ids = PyArray1::<i32>::zeros(py, t, false);
        let positions = PyArray1::<i32>::zeros(py, t, false);
        let slot_mapping = PyArray1::from_vec(py, vec![shape.pad_slot; t]);
        let cu_q_lens = PyArray1::<i32>::zeros(py, s + 1, false);
        let kv_lens = PyArray1::<i32>::zeros(py, s, false);
        let page_indices = PyArray2::<i32>::zeros(py, [s, pps], false);
        let num_seqs = PyArray1::<i32>::zeros(py, 1, false);
        let distribution = PyArray1::<i32>::zeros(py, 3, false);
        let logits_indices = PyArray1::<i32>::zeros(py, s, false);
        for arr in [
            token_ids.as_any(),
            positions.as_any(),
            slot_mapping.as_any(),
            cu_q_lens.as_any(),
            kv_lens.as_any(),
            page_indices.as_any(),
            num_seqs.as_any(),
            distribution.as_any(),
            logits_indices.as_any(),
        ] {
            freeze(arr)?;
        }
        let token_views = buckets
            .iter()
            .map(|&b| {
                Ok([
                    prefix_view(py, token_ids.as_any(), b)?,
                    prefix_view(py, positions.as_any(), b)?,
                    prefix_view(py, slot_mapping.as_any(), b)?,
                ])
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(PlanArrays {
            token_ids: token_ids.unbind(),
            positions: positions.unbind(),
            slot_mapping: slot_mapping.unbind(),
            cu_q_lens: cu_q_lens.unbind(),
            kv_lens: kv_lens.unbind(),
            page_indices: page_indices.unbind(),
            num_seqs: num_seqs.unbind(),
            distribution: distribution.unbind(),
            logits_indices: logits_indices.unbind(),
            token_views,
        })
    }
}

fn not_contiguous(_: numpy::AsSliceError) -> KvError {
    KvError::Internal("a plan buffer is not contiguous".into())
}

/// The KV-cache manager and scheduler. Safe to share between threads.
///
/// Every time-dependent method takes `now` (seconds, float); left out, it is
/// `time.monotonic()`. Pass it always or never.
#[pyclass(name = "Scheduler", module = "kvsched", frozen)]
pub struct PyScheduler {
    inner: Mutex<scheduler::Scheduler>,
    arrays: [PlanArrays; 2],
    buckets: Vec<usize>,
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (config=None, /))]
    fn new(py: Python<'_>, config: Option<PySchedulerConfig>) -> PyResult<Self> {
        let config = config.map(|c| c.inner).unwrap_or_default();
        let core = scheduler::Scheduler::new(config)?;
        let shape = *core.plan_shape();
        let buckets = core.buckets().sizes().to_vec();
        Ok(PyScheduler {
            arrays: [
                PlanArrays::new(py, &shape, &buckets)?,
                PlanArrays::new(py, &shape, &buckets)?,
            ],
            buckets,
            inner: Mutex::new(core),
        })
    }

    /// The configuration this scheduler runs with.
    #[getter]
    fn config(&self) -> PyResult<PySchedulerConfig> {
        Ok(PySchedulerConfig {
            inner: locked(&self.inner, |s| s.config().clone())?,
        })
    }

    /// The token buckets a step is padded to: one compiled program each.
    #[getter]
    fn token_buckets(&self) -> Vec<usize> {
        self.buckets.clone()
    }

    /// Fixed plan dimensions: max_tokens (largest bucket), max_seqs (S),
    /// pages_per_seq (PPS), block_size, pad_slot.
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
            let a = &self.arrays[s.next_parity()];
            let (t, p, sm) = (
                a.token_ids.bind(py),
                a.positions.bind(py),
                a.slot_mapping.bind(py),
            );
            let (cu, kv, pi) = (
                a.cu_q_lens.bind(py),
                a.kv_lens.bind(py),
                a.page_indices.bind(py),
            );
            let (ns, di, li) = (
                a.num_seqs.bind(py),
                a.distribution.bind(py),
                a.logits_indices.bind(py),
            );
            // SAFETY: each array is its own contiguous allocation that this object
            // created; Python sees it read-only (WRITEABLE cleared, and views of it
            // inherit that); the module declares it needs the GIL, and the GIL plus
            // the scheduler lock make this the only access while the core writes.
            // Readers of an older plan see these bytes change, as documented.
            let mut bufs = unsafe {
                PlanBuffers {
                    token_ids: t.as_slice_mut().map_err(not_contiguous)?,
                    positions: p.as_slice_mut().map_err(not_contiguous)?,
                    slot_mapping: sm.as_slice_mut().map_err(not_contiguous)?,
                    cu_q_lens: cu.as_slice_mut().map_err(not_contiguous)?,
                    kv_lens: kv.as_slice_mut().map_err(not_contiguous)?,
                    page_indices: pi.as_slice_mut().map_err(not_contiguous)?,
                    num_seqs: ns.as_slice_mut().map_err(not_contiguous)?,
                    distribution: di.as_slice_mut().map_err(not_contiguous)?,
                    logits_indices: li.as_slice_mut().map_err(not_contiguous)?,
                }
            };
            s.step(now, &mut bufs)
        })??;
        let Some(out) = outcome else {
            return Ok(None);
        };
        let a = &self.arrays[out.parity];
        let b = self
            .buckets
            .iter()
            .position(|&b| b == out.bucket)
            .ok_or_else(|| KvError::Internal(format!("bucket {} unknown", out.bucket)))?;
        let [tv, pv, sv] = &a.token_views[b];
        let ids: Vec<i64> = out.request_ids.iter().map(|&id| id as i64).collect();
        Ok(Some(PyStepPlan {
            token_ids: tv.clone_ref(py),
            positions: pv.clone_ref(py),
            slot_mapping: sv.clone_ref(py),
            cu_q_lens: a.cu_q_lens.clone_ref(py).into_any(),
            kv_lens: a.kv_lens.clone_ref(py).into_any(),
            page_indices: a.page_indices.clone_ref(py).into_any(),
            num_seqs: a.num_seqs.clone_ref(py).into_any(),
            distribution: a.distribution.clone_ref(py).into_any(),
            logits_indices: a.logits_indices.clone_ref(py).into_any(),
            request_ids: ids.into_pyarray(py).unbind(),
            samples: out.samples.into_pyarray(py).unbind(),
            preempted: out.preempted,
            step_id: out.step_id,
            num_tokens: out.num_tokens,
            bucket: out.bucket,
            num_decode: out.num_decode,
            n: out.num_seqs,
        }))
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
        let (st, ladder, pressure, lifecycle, dropped) = locked(&self.inner, |s| {
            (
                s.stats(now),
                s.ladder().clone(),
                s.pressure(now),
                s.lifecycle(),
                s.events_dropped(),
            )
        })?;
        let d = stats_dict(py, &st)?;
        d.set_item("lifecycle", lifecycle.as_str())?;
        d.set_item("ladder", ops::ladder_stats(py, &ladder)?)?;
        d.set_item("pressure", ops::pressure_dict(py, &pressure)?)?;
        d.set_item("events_dropped", dropped)?;
        Ok(d)
    }

    // -- operations ----------------------------------------------------------------

    /// Change live knobs, given as SchedulerConfig keyword arguments; effective
    /// from the next step, validated as a whole, nothing changes on an error.
    /// Restart-only knobs (num_blocks, block_size, token_buckets, admission,
    /// prefix_caching, prefix_cache_key, and raising max_num_seqs, max_seq_len
    /// or max_batched_tokens past the plan shape) raise RestartRequired naming
    /// the knob.
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
            out.append(ops::event_dict(py, e)?)?;
        }
        Ok(out)
    }

    /// The ladder's signals now: reserved_share, queue_depth, oldest_wait_s.
    #[pyo3(signature = (*, now=None))]
    fn pressure<'py>(&self, py: Python<'py>, now: Option<f64>) -> PyResult<Bound<'py, PyDict>> {
        let now = now_or_monotonic(py, now)?;
        let p = locked(&self.inner, |s| s.pressure(now))?;
        ops::pressure_dict(py, &p)
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

    /// Write, as JSON lines, the requests finished since the drain began and
    /// every unfinished one (tenant, prompt, tokens generated so far, options,
    /// reason), durably (a temporary file, fsync, rename). Returns the counts.
    #[pyo3(signature = (path, /))]
    fn checkpoint<'py>(
        &self,
        py: Python<'py>,
        path: std::path::PathBuf,
    ) -> PyResult<Bound<'py, PyDict>> {
        let (finished, in_flight) = locked(&self.inner, |s| s.checkpoint())?;
        let path = path.to_string_lossy().into_owned();
        let (f, i) = ops::write_checkpoint(py, &path, &finished, &in_flight)?;
        let d = PyDict::new(py);
        d.set_item("finished", f)?;
        d.set_item("in_flight", i)?;
        Ok(d)
    }

    /// Submit again every in-flight request of a checkpoint: each continues
    /// after the tokens it had generated. Returns {"restored": {old id: new id},
    /// "refused": {old id: reason}, "finished": [the finished records]}.
    #[pyo3(signature = (path, /, *, now=None))]
    fn restore<'py>(
        &self,
        py: Python<'py>,
        path: std::path::PathBuf,
        now: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let now = now_or_monotonic(py, now)?;
        let text = std::fs::read_to_string(&path).map_err(|e| {
            pyo3::exceptions::PyOSError::new_err(format!("restore {}: {e}", path.display()))
        })?;
        let loads = py.import("json")?.getattr("loads")?;
        let restored = PyDict::new(py);
        let refused = PyDict::new(py);
        let finished = PyList::empty(py);
        let mut records = Vec::new();
        for (n, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let rec = loads.call1((line,))?;
            let rec = rec.cast_into::<PyDict>().map_err(|_| {
                KvError::InvalidRequest(format!("checkpoint line {}: not an object", n + 1))
            })?;
            let kind: String = rec
                .get_item("kind")?
                .map(|k| k.extract())
                .transpose()?
                .unwrap_or_default();
            match kind.as_str() {
                "finished" => finished.append(rec)?,
                "in_flight" => records.push(ops::read_in_flight(&rec)?),
                other => {
                    return Err(KvError::InvalidRequest(format!(
                        "checkpoint line {}: unknown kind {other:?}",
                        n + 1
                    ))
                    .into())
                }
            }
        }
        // Every record is checked before any is submitted: a bad file changes nothing.
        let outcomes = locked(&self.inner, |s| s.restore(&records, now))??;
        for (rec, outcome) in records.iter().zip(outcomes) {
            match outcome {
                Ok(id) => restored.set_item(rec.id, id)?,
                Err(r) => refused.set_item(rec.id, r.reason.as_str())?,
            }
        }
        let d = PyDict::new(py);
        d.set_item("restored", restored)?;
        d.set_item("refused", refused)?;
        d.set_item("finished", finished)?;
        Ok(d)
    }
}

/// One step's plan: the kernel's arrays (read-only views, see Scheduler.step for
/// how long they stay valid) and host-side fields.
#[pyclass(name = "StepPlan", module = "kvsched", frozen)]
pub struct PyStepPlan {
    /// int32 [T]: input token of each scheduled token; padding 0.
    #[pyo3(get)]
    token_ids: Py<PyAny>,
    /// int32 [T]: absolute position of each token; padding 0.
    #[pyo3(get)]
    positions: Py<PyAny>,
    /// int32 [T]: page * block_size + offset; padding num_blocks * block_size.
    #[pyo3(get)]
    slot_mapping: Py<PyAny>,
    /// int32 [S+1]: cumulative query lengths, decode sequences first.
    #[pyo3(get)]
    cu_q_lens: Py<PyAny>,
    /// int32 [S]: cached + newly scheduled tokens; padding 0.
    #[pyo3(get)]
    kv_lens: Py<PyAny>,
    /// int32 [S, PPS]: page ids of each sequence; padding page 0.
    #[pyo3(get)]
    page_indices: Py<PyAny>,
    /// int32 [1]: real sequences in the plan.
    #[pyo3(get)]
    num_seqs: Py<PyAny>,
    /// int32 [3]: (decode-only, decode-only, all).
    #[pyo3(get)]
    distribution: Py<PyAny>,
    /// int32 [S]: cu_q_lens[1:] - 1, the row whose logits are sampled.
    #[pyo3(get)]
    logits_indices: Py<PyAny>,
    /// int64 [n]: request id of each sequence, in plan order.
    #[pyo3(get)]
    request_ids: Py<PyArray1<i64>>,
    /// bool [n]: whether the token sampled for the sequence is used.
    #[pyo3(get)]
    samples: Py<PyArray1<bool>>,
    /// Requests preempted while planning this step (queued again).
    #[pyo3(get)]
    preempted: Vec<u64>,
    /// Identifies this plan for commit().
    #[pyo3(get)]
    step_id: u64,
    /// Real tokens in the plan.
    #[pyo3(get)]
    num_tokens: usize,
    /// T: the token bucket the arrays are padded to.
    #[pyo3(get)]
    bucket: usize,
    /// Decode sequences (they come first).
    #[pyo3(get)]
    num_decode: usize,
    n: usize,
}

#[pymethods]
impl PyStepPlan {
    /// Sequences in the plan.
    fn __len__(&self) -> usize {
        self.n
    }

    fn __repr__(&self) -> String {
        format!(
            "StepPlan(step_id={}, num_seqs={}, num_decode={}, num_tokens={}, bucket={})",
            self.step_id, self.n, self.num_decode, self.num_tokens, self.bucket
        )
    }
}

/// A request's terminal event (exactly one per admitted request): how it
/// ended, its output and timings (seconds, on the clock of the `now` values;
/// first_scheduled and first_token equal `finished` for a request that ended
/// before it got there).
#[pyclass(name = "FinishedRequest", module = "kvsched", frozen)]
pub struct PyFinishedRequest {
    #[pyo3(get)]
    request_id: u64,
    #[pyo3(get)]
    tenant: String,
    /// "length" (max_tokens reached), "stop" (a stop token was sampled, or
    /// Scheduler.stop), "cancelled" (Scheduler.cancel) or "drain_deadline"
    /// (unfinished at the drain's deadline, handed back).
    #[pyo3(get)]
    reason: &'static str,
    #[pyo3(get)]
    prompt_len: usize,
    /// int32: the generated tokens (a stop token included); for a request
    /// cancelled, stopped or handed back, those generated until then.
    #[pyo3(get)]
    output_ids: Py<PyArray1<i32>>,
    #[pyo3(get)]
    arrival: f64,
    #[pyo3(get)]
    first_scheduled: f64,
    #[pyo3(get)]
    first_token: f64,
    #[pyo3(get)]
    finished: f64,
    /// Times it was preempted and recomputed.
    #[pyo3(get)]
    preemptions: u32,
    /// Prompt tokens served from the prefix cache (not computed for it).
    #[pyo3(get)]
    cached_tokens: usize,
}

#[pymethods]
impl PyFinishedRequest {
    /// Submit to first token.
    #[getter]
    fn ttft(&self) -> f64 {
        self.first_token - self.arrival
    }
    /// Submit to finish.
    #[getter]
    fn e2e(&self) -> f64 {
        self.finished - self.arrival
    }
    /// Submit to first entering the running set.
    #[getter]
    fn queue_time(&self) -> f64 {
        self.first_scheduled - self.arrival
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "FinishedRequest(request_id={}, tenant={:?}, reason={:?}, output_len={})",
            self.request_id,
            self.tenant,
            self.reason,
            PyUntypedArrayMethods::len(self.output_ids.bind(py))
        )
    }
}

impl PyFinishedRequest {
    fn new(py: Python<'_>, f: FinishedRequest) -> Self {
        PyFinishedRequest {
            request_id: f.id,
            tenant: f.tenant,
            reason: f.reason.as_str(),
            prompt_len: f.prompt_len,
            output_ids: f.output.into_pyarray(py).unbind(),
            arrival: f.arrival,
            first_scheduled: f.first_scheduled,
            first_token: f.first_token,
            finished: f.finished,
            preemptions: f.preemptions,
            cached_tokens: f.cached_tokens,
        }
    }
}

/// What a commit did: new tokens (arrays, in plan order), finished requests,
/// and requests the step preempted.
#[pyclass(name = "StepEvents", module = "kvsched", frozen)]
pub struct PyStepEvents {
    /// int64 [k]: requests that got a token.
    #[pyo3(get)]
    request_ids: Py<PyArray1<i64>>,
    /// int32 [k]: the token each got.
    #[pyo3(get)]
    tokens: Py<PyArray1<i32>>,
    /// list[FinishedRequest].
    #[pyo3(get)]
    finished: Py<PyList>,
    /// Request ids preempted (and queued again) by this step.
    #[pyo3(get)]
    preempted: Vec<u64>,
}

impl PyStepEvents {
    fn new(py: Python<'_>, ev: CommitEvents) -> PyResult<Self> {
        let ids: Vec<i64> = ev.request_ids.iter().map(|&id| id as i64).collect();
        let finished = PyList::empty(py);
        for f in ev.finished {
            finished.append(Py::new(py, PyFinishedRequest::new(py, f))?)?;
        }
        Ok(PyStepEvents {
            request_ids: ids.into_pyarray(py).unbind(),
            tokens: ev.tokens.into_pyarray(py).unbind(),
            finished: finished.unbind(),
            preempted: ev.preempted,
        })
    }
}

#[pymethods]
impl PyStepEvents {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "StepEvents(tokens={}, finished={}, preempted={})",
            PyUntypedArrayMethods::len(self.tokens.bind(py)),
            self.finished.bind(py).len(),
            self.preempted.len()
        )
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

fn histogram_dict<'py>(py: Python<'py>, h: &Histogram) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("count", h.count())?;
    d.set_item("sum", h.sum())?;
    let mut cumulative = Vec::with_capacity(LATENCY_BOUNDS.len() + 1);
    let mut acc = 0u64;
    for &c in h.counts() {
        acc += c;
        cumulative.push(acc);
    }
    d.set_item("buckets", cumulative)?;
    d.set_item("p50", h.quantile(0.5))?;
    d.set_item("p99", h.quantile(0.99))?;
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
    pool.set_item("cached", p.cached)?;
    pool.set_item("evictable", p.evictable)?;
    pool.set_item("evictions", p.evictions)?;

    let tenants = PyDict::new(py);
    for t in &st.tenants {
        let m = &t.metrics;
        let d = PyDict::new(py);
        d.set_item("tier", t.tier)?;
        d.set_item("weight", t.weight)?;
        d.set_item("kv_floor_blocks", t.kv_floor_blocks)?;
        d.set_item("kv_cap_blocks", t.kv_cap_blocks)?;
        d.set_item("reserved_blocks", t.reserved_blocks)?;
        d.set_item("used_blocks", t.used_blocks)?;
        d.set_item("shared_blocks", t.shared_blocks)?;
        d.set_item("live_requests", t.live_requests)?;
        d.set_item("waiting", t.waiting)?;
        d.set_item("running", t.running)?;
        d.set_item("admitted", t.admitted)?;
        d.set_item("finished", t.finished)?;
        d.set_item("cancelled", t.cancelled)?;
        d.set_item("rejected", reasons_dict(py, &t.rejected)?)?;
        d.set_item("rate_tokens_available", t.rate_tokens_available)?;
        d.set_item("tokens_in", m.tokens_in)?;
        d.set_item("tokens_out", m.tokens_out)?;
        d.set_item("prefill_tokens", m.prefill_tokens)?;
        d.set_item("preemptions", m.preemptions)?;
        let prefix = PyDict::new(py);
        prefix.set_item("query_blocks", m.prefix_query_blocks)?;
        prefix.set_item("hit_blocks", m.prefix_hit_blocks)?;
        prefix.set_item("query_tokens", m.prefix_query_tokens)?;
        prefix.set_item("hit_tokens", m.prefix_hit_tokens)?;
        let rate = |hit: u64, query: u64| {
            if query == 0 {
                0.0
            } else {
                hit as f64 / query as f64
            }
        };
        prefix.set_item(
            "hit_rate_blocks",
            rate(m.prefix_hit_blocks, m.prefix_query_blocks),
        )?;
        prefix.set_item(
            "hit_rate_tokens",
            rate(m.prefix_hit_tokens, m.prefix_query_tokens),
        )?;
        d.set_item("prefix_cache", prefix)?;
        d.set_item("virtual_time", t.vtime)?;
        d.set_item("queue_time", histogram_dict(py, &m.queue_time)?)?;
        d.set_item("ttft", histogram_dict(py, &m.ttft)?)?;
        d.set_item("inter_token", histogram_dict(py, &m.inter_token)?)?;
        d.set_item("e2e", histogram_dict(py, &m.e2e)?)?;
        tenants.set_item(&t.name, d)?;
    }

    let out = PyDict::new(py);
    out.set_item("pool", pool)?;
    out.set_item("tenants", tenants)?;
    out.set_item("live_requests", st.live_requests)?;
    out.set_item("running", st.running)?;
    out.set_item("waiting", st.waiting)?;
    out.set_item("steps", st.steps)?;
    out.set_item("preemptions", st.preemptions)?;
    out.set_item("rejected", reasons_dict(py, &st.rejected)?)?;
    out.set_item("step_gap", histogram_dict(py, &st.step_gap)?)?;
    Ok(out)
}
