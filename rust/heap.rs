//! The extension's Rust heap: mimalloc, and a measure of the bytes it holds.
//!
//! Why mimalloc: its arenas are large, aligned mappings that it asks the kernel
//! to back with transparent huge pages (`madvise(MADV_HUGEPAGE)`), so the
//! request records, token vectors and per-page arrays that a step walks sit on
//! few TLB entries. Measured beside glibc's malloc (same run, 1,024 running
//! sequences, medians): step + commit ~33 us instead of ~36 with the prefix
//! cache on, ~26.5 instead of ~28.5 with it off; about half of that is THP
//! (`MIMALLOC_ALLOW_THP=0`, what a machine whose THP setting is `never` gets:
//! ~34.5 and ~27.7). The price: size classes round blocks up (a 2,256-token
//! vector of 9,024 bytes takes a 10,240-byte block), and huge pages raise the
//! resident set while running. README, "Benchmarks", has the figures.
//!
//! Freed pages go back to the OS when a Scheduler is dropped ([`give_back`]);
//! otherwise mimalloc keeps them for reuse, as glibc's malloc does.
//!
//! Only the `python` feature installs it: the plain core (`cargo test`, the rlib)
//! keeps the system allocator and imposes nothing on a program that links it.
//!
//! The count: glibc's `mallinfo2` no longer sees these bytes, so the benchmark's
//! memory figures (benches/scaling.py) read them here, by walking mimalloc's
//! pages when asked ([`live_bytes`]) rather than counting on every allocation
//! (an atomic add and a size lookup per malloc and free cost ~0.1 us on a
//! submit + cancel). Each block counts at its full size class, so rounding is
//! counted as glibc's chunk overhead was.

use std::ffi::c_void;

use libmimalloc_sys::{mi_heap_area_t, mi_heap_t, mi_heap_visit_blocks};

/// Bytes the extension's Rust code holds now: the full size class of every
/// live block, over all of mimalloc's pages (every thread's). It walks the
/// pages, so it is for measurements, taken while no other thread allocates.
pub fn live_bytes() -> usize {
    unsafe extern "C" fn add_area(
        _heap: *const mi_heap_t,
        area: *const mi_heap_area_t,
        _block: *mut c_void,
        _block_size: usize,
        total: *mut c_void,
    ) -> bool {
        // SAFETY: mimalloc passes a valid area; `total` is the usize below.
        let (area, total) = unsafe { (&*area, &mut *total.cast::<usize>()) };
        *total += area.used * area.full_block_size;
        true
    }
    let mut total = 0usize;
    // SAFETY: a null heap is the main heap (all threads' pages); the visitor
    // only reads each area and adds to `total`, which outlives the call.
    unsafe {
        mi_heap_visit_blocks(
            std::ptr::null_mut(),
            false,
            Some(add_area),
            (&mut total as *mut usize).cast(),
        );
    }
    total
}

/// Hand the pages of freed blocks back to the OS now, rather than after
/// mimalloc's purge delay on some later allocation. Called when a Scheduler is
/// dropped: its pool arrays and request records are the big frees.
pub fn give_back() {
    // SAFETY: mi_collect only walks the allocator's own free lists.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

/// A field that calls [`give_back`] when its owner is dropped. Put it last:
/// fields drop in declaration order, so the others are freed by then.
#[derive(Default)]
pub struct GiveBackOnDrop;

impl Drop for GiveBackOnDrop {
    fn drop(&mut self) {
        give_back();
    }
}
