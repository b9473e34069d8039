//! `kvsched.StepPlan` and the plan buffers behind it.
//!
//! The plan arrays are numpy arrays the scheduler object owns, two sets used in
//! turn (double buffering). The core writes into them in place through raw
//! slices; to Python they are read-only, and cannot be made writeable again:
//! their memory is a Rust allocation whose numpy base is an opaque object
//! without a writable buffer (numpy refuses `flags.writeable = True` on such
//! an array and on every view of it), and the WRITEABLE flag is cleared on
//! every one. So a step creates no arrays for the kernel inputs at all, and
//! no caller can write another tenant's pages into a row the core reuses.
//!
//! The buffers are allocated fallibly: a plan shape whose buffers cannot be
//! allocated is an InvalidConfig naming the shape, never an abort or a panic.

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArray3, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PySlice;

use crate::error::{KvError, KvResult};
use crate::planner::{PlanBuffers, PlanShape};
use crate::scheduler::StepOutcome;

/// One buffer set: the arrays the core writes and the views handed out.
struct PlanArrays {
    token_ids: Py<PyArray1<i32>>,
    positions: Py<PyArray1<i32>>,
    /// Group 0's slots: a view of `group_slot_mapping[0]`.
    slot_mapping: Py<PyArray1<i32>>,
    cu_q_lens: Py<PyArray1<i32>>,
    kv_lens: Py<PyArray1<i32>>,
    /// Group 0's page table: a view of `group_page_indices[0]`.
    page_indices: Py<PyArray2<i32>>,
    num_seqs: Py<PyArray1<i32>>,
    distribution: Py<PyArray1<i32>>,
    logits_indices: Py<PyArray1<i32>>,
    /// [G, S, PPS]: every KV-cache group's page table, in one buffer.
    group_page_indices: Py<PyArray3<i32>>,
    /// [G, T]: every KV-cache group's slots, in one buffer.
    group_slot_mapping: Py<PyArray2<i32>>,
    /// Per bucket (same order as the buckets): views [:T] of the token arrays,
    /// and [:, :T] of the groups' slots.
    token_views: Vec<[Py<PyAny>; 4]>,
}

/// Clear the WRITEABLE flag: Python cannot write the plan arrays (the core's
/// page-table row cache trusts that rows hold what it wrote).
fn freeze(arr: &Bound<'_, PyAny>) -> PyResult<()> {
    arr.getattr("flags")?.setattr("writeable", false)
}

/// `len` int32 zeros, or None when the allocator refuses. The memory is
/// zeroed by the allocator (calloc-like), so pages never written cost nothing.
fn try_zeroed(len: usize) -> Option<Vec<i32>> {
    if len == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<i32>(len).ok()?;
    // SAFETY: the layout has a non-zero size. On success the block holds
    // `len` zeroed i32 (a valid value for every bit pattern of zeros),
    // allocated by the global allocator with the layout of `[i32; len]`,
    // which is what `Vec::from_raw_parts` requires of it (capacity `len`).
    unsafe {
        let p = std::alloc::alloc_zeroed(layout).cast::<i32>();
        if p.is_null() {
            return None;
        }
        Some(Vec::from_raw_parts(p, len, len))
    }
}

/// A plan buffer of `len` values, all `fill`, as a numpy array whose base is
/// rust-numpy's opaque container: numpy cannot make it writeable again.
fn plan_array<'py>(
    py: Python<'py>,
    shape: &PlanShape,
    what: &str,
    len: Option<usize>,
    fill: i32,
) -> PyResult<Bound<'py, PyArray1<i32>>> {
    let cannot = || {
        KvError::InvalidConfig(format!(
            "cannot allocate the step plan's {what} ({} int32 values) for the plan shape \
             T={} tokens, S={} sequences, PPS={} pages per sequence (S is max_num_seqs and \
             PPS is max_seq_len / block_size, both at most num_blocks - 1; T the largest \
             usable token bucket): lower max_num_seqs, max_seq_len or max_batched_tokens",
            len.map_or_else(|| "too many".to_owned(), |n| n.to_string()),
            shape.max_tokens,
            shape.max_seqs,
            shape.pages_per_seq
        ))
    };
    let len = len.ok_or_else(cannot)?;
    let mut v = try_zeroed(len).ok_or_else(cannot)?;
    if fill != 0 {
        v.fill(fill);
    }
    // Handed out as a view of the flat array, so `arr.base` is a frozen
    // ndarray (writes through it raise "read-only"), whose own base is the
    // opaque container.
    let flat = PyArray1::from_vec(py, v);
    freeze(flat.as_any())?;
    Ok(flat
        .as_any()
        .get_item(PySlice::new(py, 0, len as isize, 1))?
        .cast_into::<PyArray1<i32>>()?)
}

fn prefix_view(py: Python<'_>, base: &Bound<'_, PyAny>, len: usize) -> PyResult<Py<PyAny>> {
    Ok(base
        .get_item(PySlice::new(py, 0, len as isize, 1))?
        .unbind())
}

impl PlanArrays {
    fn new(py: Python<'_>, shape: &PlanShape, buckets: &[usize]) -> PyResult<Self> {
        let (t, s, pps) = (shape.max_tokens, shape.max_seqs, shape.pages_per_seq);
        let arr =
            |what: &str, len: Option<usize>, fill: i32| plan_array(py, shape, what, len, fill);
        let g = shape.num_groups;
        let token_ids = arr("token_ids", Some(t), 0)?;
        let positions = arr("positions", Some(t), 0)?;
        // [G, T] and [G, S, PPS] as views of one flat buffer each: their base
        // is the flat array, whose base refuses writeable. Group 0's arrays
        // are views of their first rows.
        let group_slot_mapping = arr("slot_mapping", t.checked_mul(g), shape.pad_slot)?;
        let group_slot_mapping: Bound<'_, PyArray2<i32>> = group_slot_mapping.reshape([g, t])?;
        let slot_mapping = group_slot_mapping
            .get_item(0)?
            .cast_into::<PyArray1<i32>>()?;
        let cu_q_lens = arr("cu_q_lens", s.checked_add(1), 0)?;
        let kv_lens = arr("kv_lens", Some(s), 0)?;
        let pages = s.checked_mul(pps).and_then(|n| n.checked_mul(g));
        let group_page_indices = arr("page_indices", pages, 0)?;
        let group_page_indices: Bound<'_, PyArray3<i32>> =
            group_page_indices.reshape([g, s, pps])?;
        let page_indices = group_page_indices
            .get_item(0)?
            .cast_into::<PyArray2<i32>>()?;
        debug_assert!(page_indices.is_c_contiguous() && group_page_indices.is_c_contiguous());
        let num_seqs = arr("num_seqs", Some(1), 0)?;
        let distribution = arr("distribution", Some(3), 0)?;
        let logits_indices = arr("logits_indices", Some(s), 0)?;
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
            group_page_indices.as_any(),
            group_slot_mapping.as_any(),
        ] {
            freeze(arr)?;
        }
        let token_views = buckets
            .iter()
            .map(|&b| {
                let all = PySlice::full(py);
                let first = PySlice::new(py, 0, b as isize, 1);
                Ok([
                    prefix_view(py, token_ids.as_any(), b)?,
                    prefix_view(py, positions.as_any(), b)?,
                    prefix_view(py, slot_mapping.as_any(), b)?,
                    group_slot_mapping.as_any().get_item((all, first))?.unbind(),
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
            group_page_indices: group_page_indices.unbind(),
            group_slot_mapping: group_slot_mapping.unbind(),
            token_views,
        })
    }
}

fn not_contiguous(_: numpy::AsSliceError) -> KvError {
    KvError::Internal("a plan buffer is not contiguous".into())
}

/// The two buffer sets a scheduler's plans alternate between, and the token
/// buckets whose views each set hands out.
pub(super) struct PlanSet {
    arrays: [PlanArrays; 2],
    buckets: Vec<usize>,
}

impl PlanSet {
    pub(super) fn new(py: Python<'_>, shape: &PlanShape, buckets: &[usize]) -> PyResult<Self> {
        Ok(PlanSet {
            arrays: [
                PlanArrays::new(py, shape, buckets)?,
                PlanArrays::new(py, shape, buckets)?,
            ],
            buckets: buckets.to_vec(),
        })
    }

    /// The token buckets a step is padded to.
    pub(super) fn buckets(&self) -> &[usize] {
        &self.buckets
    }

    /// Buffer set `parity` as the slices the core writes a plan into.
    ///
    /// # Safety
    ///
    /// The caller holds the scheduler's lock for as long as the slices live.
    /// Each array is its own contiguous allocation that this object created;
    /// Python sees it read-only (WRITEABLE cleared, and views of it inherit
    /// that); the module declares it needs the GIL, and the GIL plus the
    /// scheduler lock make this the only access while the core writes. Readers
    /// of an older plan see these bytes change, as documented.
    pub(super) unsafe fn borrow<'a>(
        &'a self,
        py: Python<'a>,
        parity: usize,
    ) -> KvResult<PlanBuffers<'a>> {
        let a = &self.arrays[parity];
        // SAFETY: see the function's contract. Group 0's page table and slots
        // are the first rows of the groups' buffers: each buffer is borrowed
        // once, then split.
        let (page_indices, group_page_indices) = unsafe {
            a.group_page_indices
                .bind(py)
                .as_slice_mut()
                .map_err(not_contiguous)?
        }
        .split_at_mut(a.page_indices.bind(py).len());
        let (slot_mapping, group_slot_mapping) = unsafe {
            a.group_slot_mapping
                .bind(py)
                .as_slice_mut()
                .map_err(not_contiguous)?
        }
        .split_at_mut(a.slot_mapping.bind(py).len());
        // SAFETY: see the function's contract.
        unsafe {
            Ok(PlanBuffers {
                page_indices,
                group_page_indices,
                slot_mapping,
                group_slot_mapping,
                token_ids: a
                    .token_ids
                    .bind(py)
                    .as_slice_mut()
                    .map_err(not_contiguous)?,
                positions: a
                    .positions
                    .bind(py)
                    .as_slice_mut()
                    .map_err(not_contiguous)?,
                cu_q_lens: a
                    .cu_q_lens
                    .bind(py)
                    .as_slice_mut()
                    .map_err(not_contiguous)?,
                kv_lens: a.kv_lens.bind(py).as_slice_mut().map_err(not_contiguous)?,
                num_seqs: a.num_seqs.bind(py).as_slice_mut().map_err(not_contiguous)?,
                distribution: a
                    .distribution
                    .bind(py)
                    .as_slice_mut()
                    .map_err(not_contiguous)?,
                logits_indices: a
                    .logits_indices
                    .bind(py)
                    .as_slice_mut()
                    .map_err(not_contiguous)?,
            })
        }
    }

    /// The StepPlan of a planned step: views of the buffer set it was written to.
    pub(super) fn plan(&self, py: Python<'_>, out: StepOutcome) -> PyResult<PyStepPlan> {
        let a = &self.arrays[out.parity];
        let b = self
            .buckets
            .iter()
            .position(|&b| b == out.bucket)
            .ok_or_else(|| KvError::Internal(format!("bucket {} unknown", out.bucket)))?;
        let [tv, pv, sv, gsv] = &a.token_views[b];
        // In place (same size and alignment): no second buffer to allocate.
        let ids: Vec<i64> = out.request_ids.into_iter().map(|id| id as i64).collect();
        // Summed by the core as it wrote the plan: a numpy reduction over a
        // few values (or a borrow of the array here) costs more than that.
        let kv_tokens = out.kv_tokens as i64;
        Ok(PyStepPlan {
            token_ids: tv.clone_ref(py),
            positions: pv.clone_ref(py),
            slot_mapping: sv.clone_ref(py),
            cu_q_lens: a.cu_q_lens.clone_ref(py).into_any(),
            kv_lens: a.kv_lens.clone_ref(py).into_any(),
            page_indices: a.page_indices.clone_ref(py).into_any(),
            num_seqs: a.num_seqs.clone_ref(py).into_any(),
            distribution: a.distribution.clone_ref(py).into_any(),
            logits_indices: a.logits_indices.clone_ref(py).into_any(),
            group_page_indices: a.group_page_indices.clone_ref(py).into_any(),
            group_slot_mapping: gsv.clone_ref(py),
            request_ids: ids.into_pyarray(py).unbind(),
            samples: out.samples.into_pyarray(py).unbind(),
            preempted: out.preempted,
            step_id: out.step_id,
            num_tokens: out.num_tokens,
            bucket: out.bucket,
            num_decode: out.num_decode,
            kv_tokens,
            n: out.num_seqs,
        })
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
    /// int32 [G, S, PPS]: every KV-cache group's page table (group 0's is
    /// `page_indices`); a window group's row holds page 0 before the first
    /// block its sequence still reads.
    #[pyo3(get)]
    group_page_indices: Py<PyAny>,
    /// int32 [G, T]: every KV-cache group's slots (group 0's is `slot_mapping`).
    #[pyo3(get)]
    group_slot_mapping: Py<PyAny>,
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
    pub(super) step_id: u64,
    /// Real tokens in the plan.
    #[pyo3(get)]
    num_tokens: usize,
    /// T: the token bucket the arrays are padded to.
    #[pyo3(get)]
    bucket: usize,
    /// Decode sequences (they come first).
    #[pyo3(get)]
    num_decode: usize,
    /// KV tokens the step reads: kv_lens summed over the plan's sequences.
    #[pyo3(get)]
    kv_tokens: i64,
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
