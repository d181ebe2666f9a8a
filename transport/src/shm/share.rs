//! One pool per process pair: every shm connection between the same two processes shares
//! one registered pool per side, instead of a 256 MiB memfd per connection and side.
//!
//! - Our side: [`own_pool`] returns the live pool already serving the same peer process
//!   (identified by its pid and start time, so a reused pid is a different peer), or makes
//!   one. The pool's read-only description is kept with it and sent again to each new
//!   connection of the pair.
//! - The peer's side: [`peer_pool`] maps a received pool descriptor once per memfd
//!   (identified by device and inode) and hands later connections the same mapping.
//!
//! A pool is readable by the peer it was sent to. It is never shared with a third process,
//! so what one connection's peer can read through it is what that same process could read
//! through its other connections anyway. The registries hold weak references: a pool goes
//! away with the last connection (and the last buffer) of the pair. Entries record the pid
//! that made them, so a forked child, which inherits the registries and the shared
//! mappings, never carves its parent's pool (the two allocators would hand out the same
//! bytes).

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};

use super::segment::{self, Mapping};
use crate::error::{Error, Result};
use crate::pool::Pool;

/// Our registered pool for one peer process, with the read-only description the peer maps.
pub(crate) struct OwnPool {
    pub pool: Arc<Pool>,
    /// Reopened read-only, so no peer can map our pool writable.
    pub readonly: OwnedFd,
}

/// Who a pool serves: a peer process and the pool size both sides announced.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct PeerKey {
    pid: i32,
    /// The peer's start time (clock ticks after boot, `/proc/<pid>/stat` field 22).
    start: u64,
    size: usize,
    /// A connection to this very process has two ends here; each end is its own "process"
    /// of the pair (otherwise both ends would carve one pool and map it as the peer's too).
    dialer: bool,
}

impl PeerKey {
    /// The key for the peer behind `pid` (SO_PEERCRED, our namespace). `None` when the
    /// peer cannot be told apart from a later process with the same pid (no /proc, or a
    /// peer outside our pid namespace): that connection gets a pool of its own.
    pub fn of(pid: i32, size: usize, dialer: bool) -> Option<PeerKey> {
        if pid <= 0 {
            return None;
        }
        let start = start_time(pid)?;
        Some(PeerKey {
            pid,
            start,
            size,
            dialer: dialer && pid as u32 == std::process::id(),
        })
    }
}

fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses; it ends at the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

struct Entry<T> {
    maker: u32,
    item: Weak<T>,
}

type Registry<K, T> = Mutex<Option<HashMap<K, Entry<T>>>>;

static OURS: Registry<PeerKey, OwnPool> = Mutex::new(None);
static THEIRS: Registry<(u64, u64), Mapping> = Mutex::new(None);

/// Finds a live entry made by this process, or makes one with `make`; dead entries (and
/// any inherited from a parent) are dropped on the way, so the map holds at most the
/// process's live pools.
fn get_or_make<K: Eq + std::hash::Hash, T>(
    registry: &Registry<K, T>,
    key: K,
    make: impl FnOnce() -> Result<Arc<T>>,
) -> Result<(Arc<T>, bool)> {
    let me = std::process::id();
    // A panic while the lock was held cannot leave the map inconsistent (one insert).
    let mut guard = registry.lock().unwrap_or_else(|p| p.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    map.retain(|_, e| e.maker == me && e.item.strong_count() > 0);
    if let Some(item) = map.get(&key).and_then(|e| e.item.upgrade()) {
        return Ok((item, true));
    }
    let item = make()?;
    map.insert(
        key,
        Entry {
            maker: me,
            item: Arc::downgrade(&item),
        },
    );
    Ok((item, false))
}

/// Our pool for the peer `key` (a fresh one when `key` is `None`), and whether it was
/// already serving another connection of the pair.
pub(crate) fn own_pool(key: Option<PeerKey>, size: usize) -> Result<(Arc<OwnPool>, bool)> {
    let make = || -> Result<Arc<OwnPool>> {
        let fd = segment::memfd(c"ibex-shm-pool", size)?;
        let readonly = segment::reopen_readonly(fd.as_fd())?;
        let map = Arc::new(Mapping::map(fd.as_fd(), size, true, "pool")?);
        let (base, len) = (map.ptr(), map.len());
        // SAFETY: the mapping is read-write, `len` bytes long and kept alive by the Arc the
        // pool owns; the pool is the only thing in this process that carves it (the
        // registry hands out the pool, never the mapping).
        let pool = unsafe { Pool::from_raw(base, len, Box::new(map)) };
        Ok(Arc::new(OwnPool { pool, readonly }))
    };
    match key {
        Some(key) => get_or_make(&OURS, key, make),
        None => Ok((make()?, false)),
    }
}

/// Maps the peer's pool `fd` (already checked: a sealed memfd of `len` bytes), or returns
/// the mapping an earlier connection made of the same memfd, and whether it did.
pub(crate) fn peer_pool(fd: BorrowedFd<'_>, len: usize) -> Result<(Arc<Mapping>, bool)> {
    let map = || Ok(Arc::new(Mapping::map(fd, len, false, "peer pool")?));
    let Some(id) = inode(fd) else {
        return Ok((map()?, false));
    };
    let (m, shared) = get_or_make(&THEIRS, id, map)?;
    if m.len() != len {
        // Same inode, other size: impossible for a sealed memfd; never trust it anyway.
        return Err(Error::Handshake(format!(
            "the peer's pool memfd is {} bytes here but {len} bytes in its hello",
            m.len()
        )));
    }
    Ok((m, shared))
}

fn inode(fd: BorrowedFd<'_>) -> Option<(u64, u64)> {
    // SAFETY: `st` is plain data filled by the kernel.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptor and out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return None;
    }
    Some((st.st_dev, st.st_ino))
}

#[cfg(all(test, not(ibex_loom)))]
mod tests {
    use super::*;

    #[test]
    fn start_time_parses_a_name_with_spaces_and_parentheses() {
        let me = std::process::id() as i32;
        let t = start_time(me).expect("our own start time");
        assert!(t > 0);
        assert_eq!(start_time(me), Some(t), "stable");
        assert_eq!(start_time(i32::MAX), None);
    }

    #[test]
    fn one_pool_per_peer_and_one_mapping_per_memfd() {
        let me = std::process::id() as i32;
        let k = PeerKey::of(me, 1 << 20, true).expect("key");
        let (a, shared_a) = own_pool(Some(k), 1 << 20).unwrap();
        let (b, shared_b) = own_pool(Some(k), 1 << 20).unwrap();
        assert!(!shared_a && shared_b);
        assert!(Arc::ptr_eq(&a.pool, &b.pool));
        // The other end of a self-connection, or another size, is another pool.
        let other = PeerKey::of(me, 1 << 20, false).unwrap();
        assert!(!Arc::ptr_eq(
            &own_pool(Some(other), 1 << 20).unwrap().0.pool,
            &a.pool
        ));
        assert!(!Arc::ptr_eq(
            &own_pool(None, 1 << 20).unwrap().0.pool,
            &a.pool
        ));

        let (m1, s1) = peer_pool(a.readonly.as_fd(), 1 << 20).unwrap();
        let (m2, s2) = peer_pool(b.readonly.as_fd(), 1 << 20).unwrap();
        assert!(!s1 && s2 && Arc::ptr_eq(&m1, &m2));
        assert!(peer_pool(a.readonly.as_fd(), 1 << 19).is_err());

        // Gone with its last user: the next one is fresh.
        drop((a, b, m1, m2));
        assert!(!own_pool(Some(k), 1 << 20).unwrap().1);
    }
}
