//! What the worker's integration tests share: in-process sync-mode PS shards on free ports.

use std::time::Duration;

use ibex_ps::{Mode, PsConfig};
use ibex_worker::{ClusterSpec, TransportKind};

pub use ibex_test_support::free_port;

#[allow(dead_code)] // not every test binary that shares this module connects workers
/// Connects worker `index` of `spec` with the environment's transport settings, as the
/// binaries do.
pub async fn connect_worker(
    spec: &ClusterSpec,
    index: usize,
) -> Result<ibex_worker::Worker, ibex_worker::WorkerError> {
    let config = ibex_worker::transport_config().expect("IBEX_* environment variables");
    ibex_worker::Worker::connect(spec, index, &config).await
}

/// Starts `num_ps` sync-mode PS shards for `workers` workers on the current runtime; returns
/// the spec and their stop handles (dropping a handle stops its shard).
#[allow(dead_code)] // not every test binary that shares this module starts shards
pub fn start_sync_ps(
    transport: TransportKind,
    num_ps: usize,
    workers: u32,
) -> (ClusterSpec, Vec<tokio::sync::oneshot::Sender<()>>) {
    let spec = ClusterSpec {
        ps: (0..num_ps)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect(),
        workers: vec!["127.0.0.1:0".into(); workers as usize],
        transport,
        timeouts: Default::default(),
    };
    let mut stops = Vec::new();
    for i in 0..num_ps {
        let mut cfg = PsConfig::new(spec.ps_uri(i));
        cfg.shard = i as u32;
        cfg.num_workers = workers;
        cfg.mode = Mode::Sync;
        cfg.sync_timeout = Duration::from_secs(20);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        stops.push(tx);
        tokio::spawn(ibex_ps::run(cfg, async move {
            let _ = rx.await;
        }));
    }
    (spec, stops)
}
