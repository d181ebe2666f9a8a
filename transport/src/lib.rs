//! Ibex transport: an adaptive eager/rendezvous message transport for parameter-server
//! training (the AR-gRPC design), with pluggable providers.
//!
//! Layers, bottom up:
//! - [`link`]: the provider contract; [`shm`] and [`tcp`] implement it.
//! - [`proto`]: the sans-IO protocol core.
//! - [`conn`]: the tokio driver binding a core to a link, and the user-facing API
//!   ([`Connection`], [`listen`], [`connect`], [`connect_auto`]).
#![warn(missing_docs)]

pub mod config;
pub mod error;
pub mod link;
mod map;
pub mod pool;
pub mod preface;
pub mod proto;
pub mod shm;
pub mod tcp;
pub mod tls;
#[cfg(feature = "verbs")]
pub mod verbs;
pub mod verbs_wire;

pub use config::Config;
pub use error::{Error, Result};
pub mod conn;

pub use conn::{
    Addr, ConnStats, Connection, Listener, RemoteBuf, choose_auto, connect, connect_auto, listen,
    listen_auto,
};
pub use link::RecvBuf;
pub use pool::{Pool, PoolBufMut};
#[cfg(feature = "grpc")]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(feature = "grpc")]
pub mod grpc;
