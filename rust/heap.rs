//! The extension's Rust heap: mimalloc, and a measure of the bytes it holds.
//!
//! Why mimalloc: its segments are large, aligned mappings that it asks the
//! kernel to back with transparent huge pages (`madvise(MADV_HUGEPAGE)`), so the
//! request records, token vectors and per-page arrays that a step walks sit on
//! few TLB entries. Measured beside glibc's malloc (benches/scaling.py, same
//! run, medians): step + commit at 1,024 running sequences 32.0 us instead of
//! 37.0 with the prefix cache on, 24.5 instead of 27.8 off; at 4,096, 0.81-0.86x.
//! With THP off for the process (`MIMALLOC_ALLOW_THP=0`, what a machine whose
//! THP setting is `never` gets) about half of that remains (~34 and ~27 us at
//! 1,024). mimalloc 2 (the `v2` feature) rather than 3: in the same run 3 was
//! 0.1-0.3 us slower per submit + cancel and up to 1.5 us per step at 1,024.
//! The price: size classes round blocks up (a 2,256-token vector of 9,024
//! bytes takes a 10,240-byte block: +13% heap held per token), and huge pages
//! raise the resident set while running (122 MB instead of 101 for 4,096 x 2k
//! sequences). README, "Benchmarks", has the table.
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

use libmimalloc_sys::{mi_heap_area_t, mi_heap_get_default, mi_heap_t, mi_heap_visit_blocks};

/// Bytes the extension's Rust code holds now: the full size class of every
/// live block in the calling thread's mimalloc heap (mimalloc 2 keeps one per
/// thread: blocks another thread allocated are in its heap, not counted). It
/// walks the pages, so it is for measurements, on the thread that did the work.
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
    // SAFETY: the default heap is this thread's own; the visitor only reads
    // each area and adds to `total`, which outlives the call.
    unsafe {
        mi_heap_visit_blocks(
            mi_heap_get_default(),
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
