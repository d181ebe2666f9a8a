//! PushPull throughput of one in-process shard and one worker, per transport: sync steps of
//! a model of four variables (64 KiB, 256 KiB, 1 MiB, 4 MiB of f32; the largest is split in
//! four 1 MiB parts), SGD. Prints steps/s and gradient MB/s each way.
//!
//! `cargo bench -p ibex-ps --bench push_pull [-- STEPS]`

use std::time::{Duration, Instant};

use ibex_ps::{Mode, PsConfig};
use ibex_test_support::free_port;
use ibex_worker::{ClusterSpec, Dtype, Init, Optimizer, TransportKind, VarSpec, Worker};

async fn bench(transport: TransportKind, steps: u64) -> Result<(), Box<dyn std::error::Error>> {
    let spec = ClusterSpec {
        ps: vec![format!("127.0.0.1:{}", free_port())],
        workers: vec!["127.0.0.1:0".into()],
        transport,
        timeouts: Default::default(),
    };
    let mut cfg = PsConfig::new(spec.ps_uri(0));
    cfg.mode = Mode::Sync;
    cfg.sync_timeout = Duration::from_secs(30);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(ibex_ps::run(cfg, async move {
        let _ = rx.await;
    }));
    let w = Worker::connect(&spec, 0, &ibex_worker::transport_config()?).await?;
    let sizes = [16 << 10, 64 << 10, 256 << 10, 1 << 20];
    let vars: Vec<VarSpec> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| VarSpec {
            name: format!("v{i}"),
            dtype: Dtype::F32,
            shape: vec![n / 256, 256],
            init: Init::Zeros,
            optimizer: Optimizer::Sgd { lr: 1e-3 },
            sparse: false,
        })
        .collect();
    w.create_variables(&vars).await?;
    let grads: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![1e-3; n]).collect();
    let names: Vec<String> = (0..sizes.len()).map(|i| format!("v{i}")).collect();
    let pairs: Vec<(&str, &[f32])> = names
        .iter()
        .map(|n| n.as_str())
        .zip(grads.iter().map(|g| g.as_slice()))
        .collect();
    let bytes: usize = sizes.iter().sum::<usize>() * 4;
    // Warm-up: connection set-up, threshold probe, buffer caches.
    for k in 0..3 {
        w.push_pull(k, &pairs).await?;
    }
    let t0 = Instant::now();
    for k in 3..3 + steps {
        w.push_pull(k, &pairs).await?;
    }
    let dt = t0.elapsed().as_secs_f64();
    println!(
        "{:<6} {:>7.1} steps/s  {:>8.1} MB/s each way  ({} B gradients per step, {} steps)",
        format!("{transport:?}"),
        steps as f64 / dt,
        (bytes as f64 * steps as f64) / dt / 1e6,
        bytes,
        steps
    );
    drop(w);
    let _ = tx.send(());
    server.await??;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let steps = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(50);
    for t in [TransportKind::Shm, TransportKind::Tcp, TransportKind::Grpc] {
        bench(t, steps).await?;
    }
    Ok(())
}
