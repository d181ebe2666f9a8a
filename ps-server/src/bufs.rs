//! Reused f32 buffers for gradients and pulled values.
//!
//! Every step moves the same tensor sizes, so the shard keeps the buffers of one step for the
//! next instead of asking the allocator for ~100 MB of fresh pages (each first touch a page
//! fault). A buffer is `Vec<f32>`, so it is f32-aligned: remote gradients are read straight
//! into it and the optimizer consumes it in place, with no decode copy.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

/// Free buffers by exact element count, bounded in total bytes.
#[derive(Debug)]
pub(crate) struct BufPool {
    free: Mutex<Free>,
    limit_bytes: usize,
}

#[derive(Debug, Default)]
struct Free {
    by_len: HashMap<usize, Vec<Vec<f32>>>,
    bytes: usize,
}

impl BufPool {
    /// A pool keeping at most `limit_bytes` of idle buffers.
    pub(crate) fn new(limit_bytes: usize) -> Arc<BufPool> {
        Arc::new(BufPool {
            free: Mutex::new(Free::default()),
            limit_bytes,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Free> {
        // Plain map updates in single statements: a panic elsewhere cannot leave it torn.
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A buffer of exactly `len` elements; contents unspecified (the caller overwrites all).
    /// Fails instead of aborting when the memory cannot be had.
    pub(crate) fn take(self: &Arc<Self>, len: usize) -> Result<Buf, String> {
        let reused = {
            let mut f = self.lock();
            let v = f.by_len.get_mut(&len).and_then(|l| l.pop());
            if v.is_some() {
                f.bytes -= len * 4;
            }
            v
        };
        let v = match reused {
            Some(v) => v,
            None => {
                let mut v = Vec::new();
                v.try_reserve_exact(len)
                    .map_err(|e| format!("allocating {} B: {e}", len.saturating_mul(4)))?;
                v.resize(len, 0.0);
                v
            }
        };
        Ok(Buf {
            v,
            pool: Some(self.clone()),
        })
    }

    fn give_back(&self, v: Vec<f32>) {
        let bytes = v.len() * 4;
        if bytes == 0 {
            return;
        }
        let mut f = self.lock();
        if f.bytes + bytes <= self.limit_bytes {
            f.bytes += bytes;
            f.by_len.entry(v.len()).or_default().push(v);
        }
    }

    /// Bytes of idle buffers kept.
    #[cfg(test)]
    pub(crate) fn idle_bytes(&self) -> usize {
        self.lock().bytes
    }
}

/// An owned f32 buffer that returns to its pool when dropped.
#[derive(Debug, Default)]
pub struct Buf {
    v: Vec<f32>,
    pool: Option<Arc<BufPool>>,
}

impl From<Vec<f32>> for Buf {
    fn from(v: Vec<f32>) -> Buf {
        Buf { v, pool: None }
    }
}

impl std::ops::Deref for Buf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.v
    }
}

impl std::ops::DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.v
    }
}

impl Buf {
    /// The values as little-endian bytes, without copying on little-endian machines; the
    /// buffer returns to its pool when the last `Bytes` is dropped.
    #[cfg_attr(target_endian = "little", allow(unused_mut))]
    pub(crate) fn into_le_bytes(mut self) -> Bytes {
        #[cfg(target_endian = "big")]
        for x in self.v.iter_mut() {
            *x = f32::from_bits(x.to_bits().to_le());
        }
        Bytes::from_owner(LeView(self))
    }
}

/// A buffer seen as bytes (already in little-endian order).
struct LeView(Buf);

impl AsRef<[u8]> for LeView {
    fn as_ref(&self) -> &[u8] {
        let v: &[f32] = &self.0;
        // SAFETY: any initialised f32 slice is a valid byte slice of 4x its length, and
        // u8 has no alignment requirement.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), v.len() * 4) }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        if let Some(p) = self.pool.take() {
            p.give_back(std::mem::take(&mut self.v));
        }
    }
}

/// A gradient's values as they arrived: read into a pooled buffer (remote), or still the
/// little-endian bytes of the request body (inline).
#[derive(Debug)]
pub enum F32s {
    /// Owned, aligned values.
    Buf(Buf),
    /// Little-endian f32 bytes (`len % 4 == 0`, checked on arrival).
    Le(Bytes),
}

impl From<Vec<f32>> for F32s {
    fn from(v: Vec<f32>) -> F32s {
        F32s::Buf(v.into())
    }
}

impl F32s {
    /// Element count.
    pub fn len(&self) -> usize {
        match self {
            F32s::Buf(b) => b.len(),
            F32s::Le(b) => b.len() / 4,
        }
    }

    /// True when there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values as an f32 slice when they can be seen as one without a copy.
    pub(crate) fn as_f32(&self) -> Option<&[f32]> {
        match self {
            F32s::Buf(b) => Some(b),
            #[cfg(target_endian = "little")]
            F32s::Le(b) if (b.as_ptr() as usize).is_multiple_of(std::mem::align_of::<f32>()) => {
                // SAFETY: the pointer is f32-aligned, the length a multiple of 4 (checked
                // on arrival), every bit pattern is a valid f32, and on a little-endian
                // machine the bytes are already in native order. `b` outlives the slice.
                Some(unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<f32>(), b.len() / 4) })
            }
            F32s::Le(_) => None,
        }
    }

    /// Adds the values into `dst` (same length) without materialising them.
    pub(crate) fn add_to(&self, dst: &mut [f32]) {
        match self.as_f32() {
            Some(v) => dst.iter_mut().zip(v).for_each(|(d, x)| *d += x),
            None => {
                if let F32s::Le(b) = self {
                    for (d, c) in dst.iter_mut().zip(b.chunks_exact(4)) {
                        *d += f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    }
                }
            }
        }
    }

    /// An owned buffer with the values: moved when they already are one, else one copy into
    /// a pooled buffer.
    pub(crate) fn into_buf(self, pool: &Arc<BufPool>) -> Result<Buf, String> {
        match self {
            F32s::Buf(b) => Ok(b),
            F32s::Le(bytes) => {
                let mut b = pool.take(bytes.len() / 4)?;
                ibex_proto::tensor::f32_from_le_into(&mut b, &bytes);
                Ok(b)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_and_are_reused_up_to_the_limit() {
        let p = BufPool::new(1000);
        let a = p.take(100).unwrap();
        let ptr = a.as_ptr();
        drop(a);
        assert_eq!(p.idle_bytes(), 400);
        let b = p.take(100).unwrap();
        assert_eq!(b.as_ptr(), ptr, "the same memory is handed out again");
        let big = p.take(300).unwrap();
        drop(b);
        drop(big);
        assert_eq!(
            p.idle_bytes(),
            400,
            "a buffer past the limit is freed, not kept"
        );
    }

    #[test]
    fn inline_bytes_add_and_convert_like_floats() {
        let p = BufPool::new(1 << 20);
        let le: Vec<u8> = [1.0f32, 2.0, -3.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        // Misaligned on purpose: the byte path must still be right.
        let mut raw = vec![0u8];
        raw.extend_from_slice(&le);
        let g = F32s::Le(Bytes::from(raw).slice(1..));
        let mut acc = vec![1.0f32; 3];
        g.add_to(&mut acc);
        assert_eq!(acc, [2.0, 3.0, -2.0]);
        assert_eq!(&*g.into_buf(&p).unwrap(), &[1.0, 2.0, -3.0]);
        let bytes = Buf::from(vec![0.5f32, 4.0]).into_le_bytes();
        assert_eq!(
            &bytes[..],
            &[0.5f32.to_le_bytes(), 4.0f32.to_le_bytes()].concat()[..]
        );
    }
}
