//! In-process PS shards and clients for the integration tests.
#![allow(dead_code)]

use std::time::Duration;

use ibex_ps::{Mode, PsConfig};
use ibex_worker::{ClusterSpec, TransportKind};
use tokio::sync::oneshot;

pub use ibex_test_support::free_port;

/// Connects worker `index` of `spec` with the environment's transport settings, as the
/// binaries do.
pub async fn connect_worker(
    spec: &ClusterSpec,
    index: usize,
) -> Result<ibex_worker::Worker, ibex_worker::WorkerError> {
    let config = ibex_worker::transport_config().expect("IBEX_* environment variables");
    ibex_worker::Worker::connect(spec, index, &config).await
}

/// Running in-process shards; dropping stops them.
pub struct Cluster {
    pub spec: ClusterSpec,
    stops: Vec<oneshot::Sender<()>>,
    tasks: Vec<tokio::task::JoinHandle<Result<(), ibex_ps::PsError>>>,
}

impl Cluster {
    pub async fn start(
        num_ps: usize,
        workers: u32,
        mode: Mode,
        transport: TransportKind,
        tweak: impl Fn(&mut PsConfig),
    ) -> Cluster {
        let ps: Vec<String> = (0..num_ps)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect();
        let spec = ClusterSpec {
            ps,
            workers: (0..workers).map(|i| format!("w{i}:0")).collect(),
            transport,
            timeouts: Default::default(),
        };
        let mut stops = Vec::new();
        let mut tasks = Vec::new();
        for i in 0..num_ps {
            let mut cfg = PsConfig::new(spec.ps_uri(i));
            // The `IBEX_*` environment, as the binary reads it (CI reruns these suites
            // with busy-polling on).
            cfg.transport = ibex_transport::Config::from_env().expect("IBEX_* variables");
            cfg.shard = i as u32;
            cfg.num_workers = workers;
            cfg.mode = mode;
            cfg.sync_timeout = Duration::from_secs(5);
            tweak(&mut cfg);
            let (tx, rx) = oneshot::channel::<()>();
            stops.push(tx);
            tasks.push(tokio::spawn(ibex_ps::run(cfg, async move {
                let _ = rx.await;
            })));
        }
        Cluster { spec, stops, tasks }
    }

    /// Stops every shard gracefully and returns their results.
    pub async fn stop(mut self) -> Vec<Result<(), ibex_ps::PsError>> {
        for s in self.stops.drain(..) {
            let _ = s.send(());
        }
        let mut out = Vec::new();
        for t in self.tasks.drain(..) {
            out.push(t.await.unwrap());
        }
        out
    }
}
