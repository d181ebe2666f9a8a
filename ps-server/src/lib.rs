//! `ibex-ps`: a parameter-server shard. It holds its variables, applies optimizers to the
//! gradients workers push (sync: averaged once per step over all workers; async: as they
//! arrive), serves `ibex.ps.v1.ParameterServer` over Ibex (`shm://`, `tcp://`, `verbs://`)
//! or stock gRPC (`http://`), writes safetensors checkpoints, and exposes `/metrics`.
//! See `docs/ps.md`.
#![warn(missing_docs)]

mod bufs;
mod checkpoint;
mod config;
mod exposed;
#[doc(hidden)]
pub mod fuzzing;
mod init;
mod metrics;
mod optim;
mod service;
mod shard;

use std::sync::Arc;

use ibex_proto::ps::MAX_MESSAGE;
use ibex_proto::ps::v1::parameter_server_ibex::ParameterServerServer;

pub use bufs::{Buf, F32s};
pub use checkpoint::KEEP as CHECKPOINTS_KEPT;
pub use config::PsConfig;
pub use exposed::ExposeLimits;
pub use metrics::Metrics;
pub use optim::Optimizer;
pub use service::PsService;
pub use shard::{Grad, Limits, Mode, Shard, ShardConfig, Values, WorkerLoss};

/// Sends `tracing` output (the transport's warnings about refused or misbehaving peers,
/// limits hit) to stderr, at `warn` unless `RUST_LOG` says otherwise. For the `ibex-ps`
/// and `ibex` binaries; a library user sets up their own subscriber.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Why a PS could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum PsError {
    /// Bad flags or config file.
    #[error("configuration: {0}")]
    Config(String),
    /// Checkpoint could not be read or written.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// The metrics listener could not bind.
    #[error("metrics listener on {addr}: {source}")]
    Metrics {
        /// The address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// Serving failed (listen address in use, bad URI, ...).
    #[error("serving on {uri}: {message}")]
    Serve {
        /// The listen URI.
        uri: String,
        /// Why.
        message: String,
    },
}

/// Runs one PS shard until `shutdown` resolves, then finishes the calls in flight and
/// writes a final checkpoint (when a checkpoint directory is set).
pub async fn run(
    config: PsConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), PsError> {
    let shard = Arc::new(Shard::new(config.shard_config()));
    let id = config.shard;
    if config.restore {
        match shard.checkpoints().last() {
            Some(&step) => {
                shard
                    .restore_blocking(step)
                    .map_err(|s| PsError::Checkpoint(s.message().to_string()))?;
                eprintln!("ibex-ps shard {id}: restored step {step}");
            }
            None => {
                eprintln!("ibex-ps shard {id}: --restore found no checkpoint; starting at step 0")
            }
        }
    }
    let metrics = Arc::new(Metrics::default());
    let mut server = ibex_transport::grpc::Server::builder().config(config.transport.clone());
    // A keep-alive in the transport settings (`IBEX_KEEPALIVE_MS`) wins, as for every Ibex
    // connection.
    if config.transport.keepalive.is_none()
        && let Some(k) = config.keepalive
    {
        server = server
            .http2_keepalive_interval(Some(k))
            .http2_keepalive_timeout(Some(config.keepalive_timeout));
    }
    if !config.listen.starts_with("http://") {
        metrics.set_transport(server.stats());
    }
    let metrics_task = match &config.metrics {
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| PsError::Metrics {
                    addr: addr.clone(),
                    source,
                })?;
            let local = l.local_addr().map_err(|source| PsError::Metrics {
                addr: addr.clone(),
                source,
            })?;
            eprintln!("ibex-ps shard {id}: metrics on http://{local}/metrics");
            Some(tokio::spawn(metrics::serve(
                l,
                metrics.clone(),
                shard.clone(),
            )))
        }
        None => None,
    };
    let svc = ParameterServerServer::new(
        PsService::new(shard.clone(), metrics).with_expose_limits(config.expose),
    )
    .max_decoding_message_size(MAX_MESSAGE)
    .max_encoding_message_size(MAX_MESSAGE);
    eprintln!(
        "ibex-ps shard {id}: serving on {} ({} mode, {} workers, step {})",
        config.listen,
        config.mode.as_str(),
        config.num_workers,
        shard.step()
    );
    let uri = config.listen.clone();
    let serve_err = |message: String| PsError::Serve {
        uri: uri.clone(),
        message,
    };
    // An Ibex address, or http:// for stock gRPC: one server type serves both.
    let served = server
        .add_service(svc)
        .serve_any(&uri, shutdown)
        .await
        .map_err(|e| serve_err(e.to_string()));
    if let Some(t) = metrics_task {
        t.abort();
    }
    served?;
    if config.checkpoint_dir.is_some() {
        let (step, path) = shard
            .save()
            .await
            .map_err(|s| PsError::Checkpoint(s.message().to_string()))?;
        eprintln!(
            "ibex-ps shard {id}: shut down at step {step}, checkpoint {}",
            path.display()
        );
    }
    Ok(())
}
