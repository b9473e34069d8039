//! The extension's Rust heap: mimalloc, with a count of the bytes it holds.
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
//! memory figures (benches/scaling.py) read them here. Each block is counted at
//! its usable size, the size class mimalloc actually gave, so rounding is
//! counted as glibc's chunk overhead was. One relaxed atomic add per allocation
//! and per free.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use mimalloc::MiMalloc;

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

/// The global allocator: mimalloc plus the count of live bytes.
pub struct CountedMiMalloc;

static LIVE: AtomicUsize = AtomicUsize::new(0);

/// Bytes the extension's Rust code holds now (usable sizes of live blocks).
pub fn live_bytes() -> usize {
    LIVE.load(Relaxed)
}

// SAFETY: every call forwards to mimalloc's own GlobalAlloc with the same
// arguments; the count is bookkeeping beside it and never touches the blocks.
unsafe impl GlobalAlloc for CountedMiMalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = MiMalloc.alloc(layout);
        if !p.is_null() {
            LIVE.fetch_add(MiMalloc.usable_size(p), Relaxed);
        }
        p
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = MiMalloc.alloc_zeroed(layout);
        if !p.is_null() {
            LIVE.fetch_add(MiMalloc.usable_size(p), Relaxed);
        }
        p
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(MiMalloc.usable_size(ptr), Relaxed);
        MiMalloc.dealloc(ptr, layout);
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = MiMalloc.usable_size(ptr);
        let q = MiMalloc.realloc(ptr, layout, new_size);
        if !q.is_null() {
            // On failure the old block stays live and counted.
            LIVE.fetch_add(MiMalloc.usable_size(q), Relaxed);
            LIVE.fetch_sub(old, Relaxed);
        }
        q
    }
}
