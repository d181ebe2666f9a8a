//! `ibex-worker`: the client side of Ibex parameter-server training.
//!
//! A [`Worker`] connects to every parameter server of a [`ClusterSpec`] over the spec's
//! transport (Ibex shm/tcp/verbs, or stock gRPC), places variables across the PS shards
//! greedily by bytes (large variables are split along dim 0), and pulls/pushes many
//! variables with one concurrent request per shard. See `docs/ps.md`.
#![warn(missing_docs)]

mod client;
mod error;
mod overlap;
mod placement;
mod profile;
mod spec;
mod types;

pub use client::Worker;
pub use error::WorkerError;
pub use ibex_proto::ps::v1 as pb;
pub use overlap::{LayerGrads, StepPush};
pub use placement::{PARTITION_BYTES, Part, Placement, place};
pub use profile::{CommProfile, Histogram};
pub use spec::*;
pub use types::{Dtype, Init, Optimizer, VarSpec};
