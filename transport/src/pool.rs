//! The registered pool: one region of memory the provider has made directly reachable by
//! the peer (shm: a shared segment both processes map; verbs: a registered slab), carved
//! into buffers. A message sent from a pool buffer needs no copy at all on providers that
//! can map it, and at most the provider's one copy elsewhere.
//!
//! Allocation is first-fit over a free list of 64-byte-aligned ranges with coalescing on
//! free. The pool outlives every buffer carved from it (buffers hold an `Arc`).

use std::collections::BTreeMap;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use crate::error::{Error, Result};

const ALIGN: usize = 64;

/// A region of provider-registered memory. See the module docs.
pub struct Pool {
    base: *mut u8,
    size: usize,
    /// Free ranges: offset -> length.
    free: Mutex<BTreeMap<usize, usize>>,
    _owner: Box<dyn Send + Sync>,
}

// SAFETY: `base` points into memory kept alive by `_owner` for the pool's lifetime; disjoint
// ranges are handed out under the `free` mutex, so no two buffers alias.
unsafe impl Send for Pool {}
// SAFETY: see `Send`; all mutation of shared state goes through the mutex.
unsafe impl Sync for Pool {}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("size", &self.size)
            .field("free", &self.free_bytes())
            .finish()
    }
}

impl Pool {
    /// Builds a pool over `base..base+size`, kept alive by `owner`.
    ///
    /// # Safety
    /// The range must be valid for reads and writes, and stay mapped and unused by anything
    /// else for as long as `owner` lives.
    pub unsafe fn from_raw(base: *mut u8, size: usize, owner: Box<dyn Send + Sync>) -> Arc<Pool> {
        let mut free = BTreeMap::new();
        let usable = size & !(ALIGN - 1);
        if usable > 0 {
            free.insert(0, usable);
        }
        Arc::new(Pool {
            base,
            size,
            free: Mutex::new(free),
            _owner: owner,
        })
    }

    /// A pool over plain heap memory: for providers with nothing better (tcp) and for tests.
    pub fn heap(size: usize) -> Arc<Pool> {
        let mut v = vec![0u8; size].into_boxed_slice();
        let base = v.as_mut_ptr();
        // SAFETY: the boxed slice is owned by the pool and never moves or shrinks.
        unsafe { Pool::from_raw(base, size, Box::new(v)) }
    }

    /// Total size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Start of the region.
    pub fn base(&self) -> *const u8 {
        self.base
    }

    /// Bytes not handed out.
    pub fn free_bytes(&self) -> usize {
        self.free.lock().map(|f| f.values().sum()).unwrap_or(0)
    }

    /// If `ptr..ptr+len` lies inside this pool, its offset.
    pub fn offset_of(&self, ptr: *const u8, len: usize) -> Option<usize> {
        let start = self.base as usize;
        let p = ptr as usize;
        if p >= start && p.checked_add(len)? <= start + self.size {
            Some(p - start)
        } else {
            None
        }
    }

    /// Allocates `len` bytes (zero-length requests get a 1-byte slot so every buffer is
    /// distinct). Fails with a clear error when the pool is exhausted.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Result<PoolBufMut> {
        let need = len.max(1).div_ceil(ALIGN) * ALIGN;
        let mut free = self
            .free
            .lock()
            .map_err(|_| Error::Config("pool lock poisoned".into()))?;
        let found = free
            .iter()
            .find(|&(_, &l)| l >= need)
            .map(|(&o, &l)| (o, l));
        let Some((off, flen)) = found else {
            return Err(Error::TooLarge {
                len: len as u64,
                limit: free.values().copied().max().unwrap_or(0) as u64,
                which: "largest free block of the registered pool (Config::pool_size)",
            });
        };
        free.remove(&off);
        if flen > need {
            free.insert(off + need, flen - need);
        }
        Ok(PoolBufMut {
            pool: self.clone(),
            off,
            len,
            cap: need,
        })
    }

    fn release(&self, off: usize, cap: usize) {
        let Ok(mut free) = self.free.lock() else {
            return;
        };
        let mut start = off;
        let mut len = cap;
        if let Some((&po, &pl)) = free.range(..off).next_back()
            && po + pl == off
        {
            free.remove(&po);
            start = po;
            len += pl;
        }
        if let Some(&nl) = free.get(&(off + cap)) {
            free.remove(&(off + cap));
            len += nl;
        }
        free.insert(start, len);
    }
}

/// A writable buffer carved from a [`Pool`]. Fill it, then [`PoolBufMut::freeze`] it and send
/// the `Bytes`: the provider recognises pool memory and moves it with no copy.
pub struct PoolBufMut {
    pool: Arc<Pool>,
    off: usize,
    len: usize,
    cap: usize,
}

impl std::fmt::Debug for PoolBufMut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolBufMut")
            .field("off", &self.off)
            .field("len", &self.len)
            .finish()
    }
}

impl PoolBufMut {
    /// Offset inside the pool.
    pub fn offset(&self) -> usize {
        self.off
    }

    /// Shrinks the visible length (the allocation keeps its size until freed).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Makes the buffer immutable and shareable. It returns to the pool when the last
    /// `Bytes` referring to it is dropped.
    pub fn freeze(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl Deref for PoolBufMut {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: off..off+len lies in the pool (alloc checked it) and is ours alone.
        unsafe { std::slice::from_raw_parts(self.pool.base.add(self.off), self.len) }
    }
}

impl DerefMut for PoolBufMut {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.pool.base.add(self.off), self.len) }
    }
}

impl AsRef<[u8]> for PoolBufMut {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Drop for PoolBufMut {
    fn drop(&mut self) {
        self.pool.release(self.off, self.cap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_coalesces() {
        let p = Pool::heap(4096);
        let a = p.alloc(100).unwrap();
        let b = p.alloc(1000).unwrap();
        let c = p.alloc(64).unwrap();
        assert_eq!(p.offset_of(a.as_ptr(), a.len()), Some(a.offset()));
        drop(b);
        drop(a);
        drop(c);
        assert_eq!(p.free_bytes(), 4096);
        // After coalescing, one block spans everything again.
        let all = p.alloc(4096).unwrap();
        assert_eq!(all.offset(), 0);
    }

    #[test]
    fn exhaustion_is_an_error_naming_the_pool() {
        let p = Pool::heap(1024);
        let _a = p.alloc(1000).unwrap();
        let e = p.alloc(512).unwrap_err();
        assert!(e.to_string().contains("pool"), "{e}");
    }

    #[test]
    fn frozen_bytes_return_memory_on_drop() {
        let p = Pool::heap(4096);
        let mut b = p.alloc(10).unwrap();
        b.copy_from_slice(b"0123456789");
        let bytes = b.freeze();
        let clone = bytes.slice(2..4);
        assert_eq!(&clone[..], b"23");
        drop(bytes);
        assert!(p.free_bytes() < 4096);
        drop(clone);
        assert_eq!(p.free_bytes(), 4096);
    }

    #[test]
    fn offset_of_rejects_outside_ranges() {
        let p = Pool::heap(4096);
        let outside = [0u8; 8];
        assert_eq!(p.offset_of(outside.as_ptr(), 8), None);
        assert_eq!(p.offset_of(p.base(), 4097), None);
    }
}
