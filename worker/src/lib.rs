//! `ibex-worker`: the client side of Ibex parameter-server training.
//!
//! A [`Worker`] connects to every parameter server of a [`ClusterSpec`] over the spec's
//! transport (Ibex shm/tcp/verbs, or stock gRPC), places variables across the PS shards
//! greedily by bytes (large variables are split along dim 0), and pulls/pushes many
//! variables with one concurrent request per shard. See `docs/ps.md`.
//!
//! [`Worker::stage`] hands out registered buffers to write gradients into, sent with no copy
//! ([`Worker::push_staged`]). With the `cuda` feature, `Worker::push_device` and friends move
//! tensors that live in GPU memory through those buffers (see `docs/gpu.md`).
#![warn(missing_docs)]

mod client;
#[cfg(feature = "cuda")]
mod cuda;
mod error;
mod overlap;
mod placement;
mod profile;
mod spec;
mod staging;
mod types;

pub use client::{OutBuf, Worker};
#[cfg(feature = "cuda")]
pub use cuda::{Gpu, GpuPaths, device_count, probe_driver};
/// The cudarc the `cuda` feature was built with: allocate device tensors with it.
#[cfg(feature = "cuda")]
pub use cudarc;
pub use error::WorkerError;
pub use ibex_proto::ps::v1 as pb;
pub use overlap::{LayerGrads, StepPush};
pub use placement::{PARTITION_BYTES, Part, Placement, place};
pub use profile::{CommProfile, Histogram};
pub use spec::*;
pub use staging::{Staged, StagedPart, StagingInfo};
pub use types::{Dtype, Init, Optimizer, VarSpec};
