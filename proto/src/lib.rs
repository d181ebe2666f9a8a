//! Generated protobuf/gRPC code for Ibex, compiled from `protos/` by `protox` in `build.rs`
//! (no system `protoc`). One module per protobuf package; `bytes` fields are [`bytes::Bytes`]
//! so bulk data stays zero-copy after decoding.
//!
//! Clients are generic over the channel: `BenchClient::new(channel)` works with a stock
//! `tonic::transport::Channel` and with `ibex_transport::grpc::Channel` alike.

mod optimizer;
pub mod tensor;

pub use optimizer::Optimizer;

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
    /// Largest protobuf body either side of the service encodes or decodes: bodies carry
    /// whole shards' tensors, far past tonic's 4 MiB default, and none can be larger than
    /// the transport takes by default in one message.
    pub const MAX_MESSAGE: usize = ibex_transport::config::DEFAULT_MAX_MESSAGE_SIZE as usize;

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

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use prost::Message;

    use super::bench::v1::{Ack, Payload};

    #[test]
    fn bytes_fields_decode_as_slices_of_the_input() {
        let big = Bytes::from(vec![0xab; 4096]);
        let msg = Payload {
            buffers: vec![big.clone(), Bytes::new(), Bytes::from_static(b"x")],
        };
        let wire = Bytes::from(msg.encode_to_vec());
        let back = Payload::decode(wire.clone()).unwrap();
        assert_eq!(back, msg);
        // `bytes` fields are `Bytes` views into the received buffer: no copy after decoding.
        let range = wire.as_ptr() as usize..wire.as_ptr() as usize + wire.len();
        assert!(range.contains(&(back.buffers[0].as_ptr() as usize)));
    }

    #[test]
    fn ack_round_trips() {
        let a = Ack {
            bytes: u64::MAX,
            buffers: 7,
        };
        assert_eq!(Ack::decode(a.encode_to_vec().as_slice()).unwrap(), a);
    }
}
