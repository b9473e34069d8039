//! `kvsched.BlockPool`.

use std::sync::Mutex;

use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;

use super::{int32_arg, int32_slice, locked};
use crate::pool;

/// `num_blocks` / `block_size` out of range: InvalidConfig naming them.
fn pool_blocks_arg(o: &Bound<'_, PyAny>) -> PyResult<usize> {
    super::uint_knob(o, "num_blocks")
}

fn pool_block_size_arg(o: &Bound<'_, PyAny>) -> PyResult<usize> {
    super::uint_knob(o, "block_size")
}

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
    fn new(
        #[pyo3(from_py_with = pool_blocks_arg)] num_blocks: usize,
        #[pyo3(from_py_with = pool_block_size_arg)] block_size: usize,
    ) -> PyResult<Self> {
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
        let arr = int32_arg(pages, "pages")?;
        let pages = int32_slice(&arr);
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
        let arr = int32_arg(pages, "pages")?;
        let pages = int32_slice(&arr);
        Ok(locked(&self.inner, |x| x.retain(&pages))??)
    }

    /// References held on `page` (0 when free).
    #[pyo3(signature = (page, /))]
    fn refcount(&self, page: i64) -> PyResult<u32> {
        Ok(locked(&self.inner, |pool| pool.refcount_checked(page))??)
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
