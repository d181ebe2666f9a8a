//! Generated protobuf/gRPC code for Ibex, compiled from `protos/` by `protox` in `build.rs`
//! (no system `protoc`). One module per protobuf package; `bytes` fields are [`bytes::Bytes`]
//! so bulk data stays zero-copy after decoding.
//!
//! Clients are generic over the channel: `BenchClient::new(channel)` works with a stock
//! `tonic::transport::Channel` and with `ibex_transport::grpc::Channel` alike.

/// `ibex.bench.v1`: the benchmark and conformance service `Bench`.
pub mod bench {
    /// Version 1 of the package.
    pub mod v1 {
        #![allow(missing_docs)]
        tonic::include_proto!("ibex.bench.v1");
    }
}

/// `ibex.ps.v1`: the parameter-server service `ParameterServer`.
pub mod ps {
    /// Version 1 of the package.
    pub mod v1 {
        #![allow(missing_docs)]
        tonic::include_proto!("ibex.ps.v1");
    }
}

/// `helloworld`: the classic `Greeter` service, for the interop examples.
pub mod helloworld {
    #![allow(missing_docs)]
    tonic::include_proto!("helloworld");
}
