//! Shared pieces of the gRPC conformance suite: the test service, and the transports the
//! same cases run over (stock tonic over HTTP/2/TCP as the reference, then Ibex).
#![allow(dead_code, unused_imports)]

pub mod service;
pub mod transports;

use bytes::Bytes;

pub use service::{BenchImpl, Events};
pub use transports::{Chan, ServerHandle, Transport};

/// A deterministic, position-dependent byte pattern: a shifted or truncated copy never
/// compares equal to the original.
pub fn pattern(len: usize, seed: u8) -> Bytes {
    // Build one 251-byte period (prime, so it does not line up with power-of-two sizes) and
    // repeat it with `extend_from_slice`, which stays fast in debug builds even for 64 MiB.
    let period: Vec<u8> = (0..251u32)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        let take = (len - v.len()).min(period.len());
        v.extend_from_slice(&period[..take]);
    }
    Bytes::from(v)
}
