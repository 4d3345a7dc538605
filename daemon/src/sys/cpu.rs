//! CPU hints.

/// Asks the CPU to fetch every cache line of `bytes` into its cache: a hint, with no
/// fault and no effect on the bytes (a no-op where no prefetch instruction is wired up).
pub fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: `prefetcht0` needs SSE, which every x86_64 CPU has (it is in the
        // architecture's baseline); it reads nothing architecturally and cannot fault, and
        // the address is inside `bytes` anyway.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}
