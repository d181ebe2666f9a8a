//! Shared pieces of the gRPC conformance suite: the test service, and the transports the
//! same cases run over (stock tonic over HTTP/2/TCP as the reference, then Ibex).
#![allow(dead_code, unused_imports)]

pub mod service;
pub mod transports;

pub use service::{BenchImpl, Events};
pub use transports::{Chan, ServerHandle, Transport};

pub use ibex_test_support::pattern;
