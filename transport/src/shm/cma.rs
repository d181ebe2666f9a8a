//! Cross Memory Attach: single-copy reads straight out of the peer's address space with
//! `process_vm_readv`, and the checks that decide whether it is allowed here.
//!
//! The kernel allows it when we could ptrace the peer: same user, and with Yama
//! `ptrace_scope = 1` only if the peer named us its ptracer. Each side therefore calls
//! `prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)` at setup, then reads a word the peer
//! advertised in its hello. If that read fails (EPERM, ENOSYS, seccomp, ptrace_scope >= 2,
//! separate user namespaces) the link falls back to the bounce area.

use std::io;
use std::sync::Once;

use crate::error::Error;

/// Lets any process of ours read this one with CMA (Yama `ptrace_scope = 1`). Harmless and
/// ignored where Yama is absent.
pub fn allow_peer_reads() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: prctl with integer arguments has no memory effects.
        let r = unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
        if r != 0 {
            tracing::debug!(error = %io::Error::last_os_error(), "PR_SET_PTRACER not applied (no Yama?)");
        }
    });
}

/// Reads `len` bytes at `remote` in process `pid` into `dst`, looping on partial reads.
///
/// # Safety
/// `dst..dst+len` must be valid for writes and not accessed by anyone else meanwhile.
pub unsafe fn read(pid: i32, remote: u64, dst: *mut u8, len: usize) -> Result<(), Error> {
    let mut done = 0usize;
    while done < len {
        let local = libc::iovec {
            // SAFETY: done < len, so the pointer stays within the destination.
            iov_base: unsafe { dst.add(done) }.cast(),
            iov_len: len - done,
        };
        let remote_iov = libc::iovec {
            iov_base: (remote as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: the local iovec lies in memory the caller vouched for; the remote one is
        // checked by the kernel against the peer's address space.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote_iov, 1, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::ESRCH) => Error::PeerGone(format!(
                    "peer process {pid} exited during a shared-memory read"
                )),
                Some(libc::EFAULT) => Error::Protocol(format!(
                    "peer region at {:#x}+{} is not mapped in process {pid} (descriptor does not match live memory)",
                    remote as usize + done,
                    len - done
                )),
                Some(libc::EINTR) => continue,
                _ => Error::io(
                    format!("reading {len} bytes from process {pid} with process_vm_readv"),
                    e,
                ),
            });
        }
        if n == 0 {
            return Err(Error::PeerGone(format!(
                "peer process {pid} returned a short read (exiting?)"
            )));
        }
        done += n as usize;
    }
    Ok(())
}

/// Tries a CMA read of the peer's advertised probe word. `Err` carries the reason the
/// fallback is needed, for the log.
pub fn probe(pid: i32, addr: u64, expected: u64) -> Result<(), String> {
    let mut word = 0u64;
    // SAFETY: `word` is a live local of exactly 8 bytes.
    match unsafe { read(pid, addr, (&mut word as *mut u64).cast(), 8) } {
        Ok(()) if word == expected => Ok(()),
        Ok(()) => Err(format!(
            "probe word of pid {pid} read back wrong (different pid namespace?)"
        )),
        Err(Error::Io { source, .. }) => Err(format!(
            "process_vm_readv on pid {pid} failed: {source} (Yama ptrace_scope, seccomp or a container policy)"
        )),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(all(test, not(ibex_loom)))]
mod tests {
    use super::*;

    #[test]
    fn reading_ourselves_works_and_bad_addresses_fail() {
        let pid = std::process::id() as i32;
        let src: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let mut dst = vec![0u8; 10_000];
        // SAFETY: dst is a live, exclusive buffer of the right length.
        let r = unsafe { read(pid, src.as_ptr() as u64, dst.as_mut_ptr(), dst.len()) };
        match r {
            Ok(()) => assert_eq!(src, dst),
            // A sandbox that forbids CMA even on ourselves: nothing more to check here.
            Err(Error::Io { .. }) => return,
            Err(e) => panic!("{e}"),
        }
        // SAFETY: as above; the remote address is unmapped so nothing is written.
        let r = unsafe { read(pid, 8, dst.as_mut_ptr(), 8) };
        assert!(matches!(r, Err(Error::Protocol(_))), "{r:?}");
        let word = 0x1234_5678_9abc_def0u64;
        assert!(probe(pid, &word as *const u64 as u64, word).is_ok());
        assert!(probe(pid, &word as *const u64 as u64, 1).is_err());
    }
}
