//! Shared memory segments and wakeup descriptors: sealed memfds, their mappings, eventfds,
//! and the checks applied to descriptors received from the peer.
//!
//! Every segment is a memfd sealed against shrinking and growing before it is sent, so a
//! peer cannot truncate memory we have mapped (which would turn our next access into a
//! SIGBUS). A received descriptor is accepted only if it carries those seals (which only
//! memfds can) and has exactly the size announced in the hello.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use crate::error::{Error, Result};

/// A `mmap`ed range, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; concurrent access is governed by the ring and
// pool protocols of its users, and unmapping happens only once, on drop.
unsafe impl Send for Mapping {}
// SAFETY: see `Send`.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps all `len` bytes of `fd` shared, writable or read-only.
    pub fn map(fd: BorrowedFd<'_>, len: usize, writable: bool, what: &str) -> Result<Mapping> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh shared mapping chosen by the kernel aliases nothing of ours; the fd
        // is valid for the call.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::io(
                format!("mapping the shm {what} ({len} bytes)"),
                io::Error::last_os_error(),
            ));
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }

    /// Start of the mapping.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len came from a successful mmap and are unmapped exactly once; every
        // user of the memory holds an `Arc` of this mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A `Bytes` owner: `len` bytes at `off` inside a mapping kept alive by the `Arc`.
pub struct MappedSlice {
    /// The mapping.
    pub map: std::sync::Arc<Mapping>,
    /// Offset of the slice.
    pub off: usize,
    /// Length of the slice.
    pub len: usize,
}

impl AsRef<[u8]> for MappedSlice {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: off+len <= map.len (checked by whoever built the slice) and the mapping
        // lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.map.ptr().add(self.off), self.len) }
    }
}

fn cvt(r: libc::c_int, what: impl FnOnce() -> String) -> Result<libc::c_int> {
    if r < 0 {
        Err(Error::io(what(), io::Error::last_os_error()))
    } else {
        Ok(r)
    }
}

/// Creates a sealed memfd of `len` bytes, private to this user (mode 0600).
pub fn memfd(name: &CStr, len: usize) -> Result<OwnedFd> {
    let label = || name.to_string_lossy().into_owned();
    // SAFETY: `name` is a valid C string; the flags are plain integers.
    let raw =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    cvt(raw, || {
        format!("creating memfd {} (needs Linux >= 3.17)", label())
    })?;
    // SAFETY: `raw` is a fresh descriptor owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: plain syscalls on a descriptor we own.
    unsafe {
        cvt(libc::fchmod(raw, 0o600), || {
            format!("restricting memfd {} to mode 0600", label())
        })?;
        cvt(libc::ftruncate(raw, len as libc::off_t), || {
            format!("sizing memfd {} to {len} bytes", label())
        })?;
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        cvt(libc::fcntl(raw, libc::F_ADD_SEALS, seals), || {
            format!("sealing memfd {}", label())
        })?;
    }
    Ok(fd)
}

/// Opens a read-only description of `fd` (through /proc), so the peer receiving it cannot
/// map it writable. Falls back to a duplicate of `fd` if /proc is unavailable.
pub fn reopen_readonly(fd: BorrowedFd<'_>) -> Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}\0", fd.as_raw_fd());
    // SAFETY: `path` is NUL-terminated.
    let raw = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if raw >= 0 {
        // SAFETY: fresh descriptor owned by nobody else.
        return Ok(unsafe { OwnedFd::from_raw_fd(raw) });
    }
    fd.try_clone_to_owned()
        .map_err(|e| Error::io("duplicating a memfd", e))
}

/// Checks that a received descriptor is a memfd sealed against resizing and of `len` bytes.
pub fn check_memfd(fd: BorrowedFd<'_>, len: usize, what: &str) -> Result<()> {
    // SAFETY: plain fcntl on a descriptor we own.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(Error::Handshake(format!(
            "the peer's {what} is not a memfd (cannot read its seals)"
        )));
    }
    let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    if seals & need != need {
        return Err(Error::Handshake(format!(
            "the peer's {what} memfd is not sealed against resizing; refusing to map it"
        )));
    }
    // SAFETY: `st` is plain data filled by the kernel.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptor and out-pointer.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, || {
        format!("inspecting the peer's {what}")
    })?;
    if st.st_size as u64 != len as u64 {
        return Err(Error::Handshake(format!(
            "the peer's {what} is {} bytes but its hello announced {len}",
            st.st_size
        )));
    }
    Ok(())
}

/// A non-blocking eventfd.
pub fn eventfd() -> Result<OwnedFd> {
    // SAFETY: plain syscall.
    let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    cvt(raw, || "creating an eventfd".into())?;
    // SAFETY: fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Checks that a received descriptor is an eventfd.
pub fn check_eventfd(fd: BorrowedFd<'_>, what: &str) -> Result<()> {
    let target = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|e| Error::io(format!("inspecting the peer's {what}"), e))?;
    if target.as_os_str() != "anon_inode:[eventfd]" {
        return Err(Error::Handshake(format!(
            "the peer's {what} is {target:?}, not an eventfd"
        )));
    }
    Ok(())
}

/// Wakes whoever sleeps on the eventfd.
pub fn signal(fd: RawFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live buffer. Failure can only be EAGAIN (counter
    // saturated), which already means a wakeup is pending.
    unsafe { libc::write(fd, one.as_ptr().cast(), 8) };
}

/// Resets the eventfd's counter after a wakeup.
pub fn drain(fd: RawFd) {
    let mut buf = [0u8; 8];
    // SAFETY: reads at most 8 bytes into a live buffer; EAGAIN means already drained.
    unsafe { libc::read(fd, buf.as_mut_ptr().cast(), 8) };
}

#[cfg(all(test, not(ibex_loom)))]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn memfds_are_sealed_and_checked() {
        let fd = memfd(c"ibex-test", 8192).unwrap();
        check_memfd(fd.as_fd(), 8192, "segment").unwrap();
        let e = check_memfd(fd.as_fd(), 4096, "segment").unwrap_err();
        assert!(e.to_string().contains("announced 4096"), "{e}");
        // SAFETY: plain syscall; it must fail because of the seal.
        assert!(unsafe { libc::ftruncate(fd.as_raw_fd(), 100) } < 0);
        let ev = eventfd().unwrap();
        let e = check_memfd(ev.as_fd(), 8, "pool").unwrap_err();
        assert!(e.to_string().contains("not a memfd"), "{e}");
        check_eventfd(ev.as_fd(), "wakeup fd").unwrap();
        assert!(check_eventfd(fd.as_fd(), "wakeup fd").is_err());
    }

    #[test]
    fn readonly_reopen_cannot_be_mapped_writable() {
        let fd = memfd(c"ibex-test", 4096).unwrap();
        let ro = reopen_readonly(fd.as_fd()).unwrap();
        assert!(Mapping::map(ro.as_fd(), 4096, true, "pool").is_err());
        let rw = Mapping::map(fd.as_fd(), 4096, true, "pool").unwrap();
        let r = Mapping::map(ro.as_fd(), 4096, false, "pool").unwrap();
        // SAFETY: both mappings are 4096 bytes and live here.
        unsafe {
            *rw.ptr().add(10) = 42;
            assert_eq!(*r.ptr().add(10), 42);
        }
    }
}
