//! Process-wide allocator settings for processes that move large messages every step.
//!
//! glibc serves every block above its mmap threshold (128 KiB at first, adapting up to
//! 32 MiB) with a fresh mapping and unmaps it on free, and trims the heap's free top back to
//! the kernel. A training step encodes and decodes the same tens of MB of message bodies
//! every step, so each step then page-faults all of them in again, a large share of a step
//! on shm. Keeping freed blocks in the process turns those faults into reuse.

/// Serves blocks up to 32 MiB (glibc's ceiling for the setting) from the heap and keeps
/// freed memory for reuse instead of returning it to the kernel. Call once at start-up,
/// before threads allocate (the PS binary and training workers do). The process's RSS then
/// stays at its peak instead of shrinking between steps. A no-op off glibc. Returns whether
/// the settings took.
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters; it is safe to call at any
        // time, and these values are within the ranges glibc documents.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    #[test]
    fn glibc_takes_the_settings() {
        assert!(super::keep_freed_memory());
    }
}
