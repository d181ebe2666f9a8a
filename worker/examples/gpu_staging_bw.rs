//! Staging-path bandwidth on a GPU machine: device-to-device through two in-process PS over
//! Ibex shm (`push_pull_device`: device-to-host into the registered pinned buffers, the PS
//! reads them, applies a zero-rate SGD step, and the values come back host-to-device; the
//! PS's apply is part of the cost)
//! against a plain `cudaMemcpy` round trip (device-to-host into pageable memory, then
//! host-to-device) of the same bytes, in the same run. Prints both rates and their ratio.
//!
//! `cargo run --release -p ibex-worker --features cuda --example gpu_staging_bw [MIB] [ITERS]`

use std::time::{Duration, Instant};

use ibex_ps::{Mode, PsConfig};
use ibex_worker::{
    ClusterSpec, Dtype, Gpu, Init, Optimizer, TransportKind, VarSpec, Worker, WorkerError,
};

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(64);
    let iters: u32 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(20);
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e @ (WorkerError::NoCudaDriver { .. } | WorkerError::NoCudaDevice { .. })) => {
            println!("skipped: no CUDA device ({e})");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    println!("device paths: {:?}", gpu.paths());
    let n = mib << 18;
    let bytes = (n * 4) as f64;

    // Two PS: the variable's 1 MiB parts spread over both, so the copies for one PS
    // overlap the send to the other.
    let ports = ibex_worker::free_ports("127.0.0.1", 2)?;
    let spec = ClusterSpec {
        ps: ports.iter().map(|p| format!("127.0.0.1:{p}")).collect(),
        workers: vec!["127.0.0.1:0".into()],
        transport: TransportKind::Shm,
        timeouts: Default::default(),
    };
    let mut stops = Vec::new();
    for i in 0..2 {
        let mut cfg = PsConfig::new(spec.ps_uri(i));
        cfg.shard = i as u32;
        cfg.num_workers = 1;
        cfg.mode = Mode::Async;
        cfg.sync_timeout = Duration::from_secs(60);
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        stops.push(stop);
        tokio::spawn(ibex_ps::run(cfg, async move {
            let _ = rx.await;
        }));
    }
    let w = Worker::connect(&spec, 0, &ibex_worker::transport_config()?).await?;
    let var = VarSpec {
        name: "t".into(),
        dtype: Dtype::F32,
        shape: vec![n],
        init: Init::Constant(1.0),
        optimizer: Optimizer::Sgd { lr: 0.0 },
        sparse: false,
    };
    w.create_variables(&[var]).await?;
    let host: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let src = gpu.upload(&host)?;
    let mut dst = gpu.alloc_zeros(n)?;

    // Warm-up allocates and pins the registered buffers.
    for step in 0..2 {
        w.push_pull_device(&gpu, step, &[("t", &src)], &mut [&mut dst])
            .await?;
    }
    let t0 = Instant::now();
    for step in 0..u64::from(iters) {
        w.push_pull_device(&gpu, 2 + step, &[("t", &src)], &mut [&mut dst])
            .await?;
    }
    let ibex = t0.elapsed().as_secs_f64() / f64::from(iters);
    if gpu.download(&dst)?.iter().any(|v| *v != 1.0) {
        return Err("the PS values did not survive the round trip".into());
    }

    let stream = gpu.stream().clone();
    for _ in 0..2 {
        let h = stream.clone_dtoh(&src).map_err(|e| format!("{e:?}"))?;
        stream
            .memcpy_htod(h.as_slice(), &mut dst)
            .map_err(|e| format!("{e:?}"))?;
    }
    stream.synchronize().map_err(|e| format!("{e:?}"))?;
    let t0 = Instant::now();
    for _ in 0..iters {
        let h = stream.clone_dtoh(&src).map_err(|e| format!("{e:?}"))?;
        stream
            .memcpy_htod(h.as_slice(), &mut dst)
            .map_err(|e| format!("{e:?}"))?;
        stream.synchronize().map_err(|e| format!("{e:?}"))?;
    }
    let plain = t0.elapsed().as_secs_f64() / f64::from(iters);
    if gpu.download(&dst)? != host {
        return Err("the plain round trip corrupted the data".into());
    }

    let gbs = |secs: f64| 2.0 * bytes / secs / 1e9;
    println!("tensor {mib} MiB, {iters} iterations, each moving it device->host->device");
    println!(
        "ibex shm staging (push_pull_device): {:8.3} ms  {:6.2} GB/s",
        ibex * 1e3,
        gbs(ibex)
    );
    println!(
        "plain cudaMemcpy D2H + H2D:          {:8.3} ms  {:6.2} GB/s",
        plain * 1e3,
        gbs(plain)
    );
    println!("ratio ibex / plain (time): {:.2}", ibex / plain);
    println!("pinning: {:?}", gpu.pinning());
    for s in stops {
        let _ = s.send(());
    }
    Ok(())
}
