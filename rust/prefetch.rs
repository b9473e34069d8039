//! Software prefetch: start loading a line that a loop reads a few
//! iterations later, where the hardware cannot guess the address (a commit
//! visits requests scattered over the heap).

/// Start loading the cache line holding `p` into every cache level. A hint:
/// nothing is read, and no address (null, dangling, unmapped) can fault.
#[inline(always)]
pub fn line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 only hints the cache hierarchy; it never faults and
    // reads nothing architecturally, whatever the address (Intel SDM and AMD
    // APM, PREFETCHh). SSE is part of the x86-64 baseline.
    unsafe {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
