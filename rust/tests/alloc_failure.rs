//! A pool whose prefix cache the allocator refuses is an InvalidConfig, never
//! an abort.
//!
//! Its own test binary: the global allocator here refuses, while armed, every
//! allocation of one given size, so the test can make exactly one of the
//! prefix cache's per-page arrays fail. The pool's size probe passes; an
//! infallible allocation of that array would then abort the process ("memory
//! allocation of N bytes failed"), so the cache allocates fallibly.
//!
//! Built without the `python` feature only (`cargo test`): with it, the crate
//! brings its own global allocator (mimalloc, rust/lib.rs) and a binary can
//! have one.
#![cfg(not(feature = "python"))]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use kvsched::error::KvError;
use kvsched::pool::BlockPool;

/// Refuses allocations of exactly `FAIL_SIZE` bytes (0: none).
struct Refusing;

static FAIL_SIZE: AtomicUsize = AtomicUsize::new(0);
static REFUSED: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Refusing {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if refuse(layout.size()) {
            return std::ptr::null_mut();
        }
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if refuse(layout.size()) {
            return std::ptr::null_mut();
        }
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if refuse(new_size) {
            return std::ptr::null_mut();
        }
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

fn refuse(size: usize) -> bool {
    let fail = FAIL_SIZE.load(Ordering::Relaxed);
    if fail != 0 && size == fail {
        REFUSED.fetch_add(1, Ordering::Relaxed);
        return true;
    }
    false
}

#[global_allocator]
static ALLOC: Refusing = Refusing;

/// One armed allocator at a time (the test harness runs tests on threads).
static ARMED: Mutex<()> = Mutex::new(());

/// Pages in the test pools: large enough that each array size below is
/// distinct from any other allocation the pool makes.
const PAGES: usize = 1_000_003;

fn refused_pool(fail_size: usize) -> Result<BlockPool, KvError> {
    REFUSED.store(0, Ordering::Relaxed);
    FAIL_SIZE.store(fail_size, Ordering::Relaxed);
    let pool = BlockPool::with_prefix_cache(PAGES, 16, true);
    FAIL_SIZE.store(0, Ordering::Relaxed);
    assert!(
        REFUSED.load(Ordering::Relaxed) > 0,
        "no allocation of {fail_size} bytes was made: the test no longer reaches the array"
    );
    pool
}

fn assert_refused(fail_size: usize) {
    let _one = ARMED.lock().unwrap_or_else(|e| e.into_inner());
    match refused_pool(fail_size) {
        Err(KvError::InvalidConfig(msg)) => {
            assert!(msg.contains("prefix cache"), "{msg}");
            assert!(msg.contains(&format!("num_blocks={PAGES}")), "{msg}");
        }
        Err(other) => panic!("expected InvalidConfig, got {other:?}"),
        Ok(_) => panic!("a pool was built although its prefix cache was refused"),
    }
    // Nothing is left broken: the same pool builds once memory is there.
    let pool = BlockPool::with_prefix_cache(PAGES, 16, true).unwrap();
    assert_eq!(pool.num_blocks(), PAGES);
}

#[test]
fn refused_names_array_is_an_error() {
    // The 16-byte name of each page.
    assert_refused(PAGES * 16);
}

#[test]
fn refused_parked_flags_are_an_error() {
    // One bool a page.
    assert_refused(PAGES);
}

#[test]
fn refused_index_is_an_error() {
    // The hash index: 64-byte buckets of 9 pages.
    assert_refused(PAGES.div_ceil(9) * 64);
}

#[test]
fn a_pool_without_prefix_caching_allocates_no_cache() {
    // Refusing the cache's sizes does not touch a pool that caches nothing.
    let _one = ARMED.lock().unwrap_or_else(|e| e.into_inner());
    FAIL_SIZE.store(PAGES * 16, Ordering::Relaxed);
    let pool = BlockPool::with_prefix_cache(PAGES, 16, false);
    FAIL_SIZE.store(0, Ordering::Relaxed);
    assert_eq!(pool.unwrap().num_blocks(), PAGES);
}
