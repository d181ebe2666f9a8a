//! GPU worker tests (`cargo test -p ibex-worker --features cuda --test cuda`). Each test
//! that needs a device prints "skipped: no CUDA device" and returns when there is none;
//! the missing-driver test runs for real where libcuda is absent and skips where present.
#![cfg(feature = "cuda")]

mod common;

use ibex_worker::{Dtype, Gpu, Init, Optimizer, TransportKind, VarSpec, WorkerError};

const LR: f32 = 0.1;
/// 640 x 512 f32: two parts of 640 KiB across two PS (descriptor path on shm).
const BIG: [usize; 2] = [640, 512];

fn gpu() -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e @ (WorkerError::NoCudaDriver { .. } | WorkerError::NoCudaDevice { .. })) => {
            println!("skipped: no CUDA device ({e})");
            None
        }
        Err(e) => panic!("opening CUDA device 0 failed: {e}"),
    }
}

#[test]
fn a_missing_driver_is_a_typed_error_not_a_panic() {
    if ibex_worker::probe_driver().is_ok() {
        println!(
            "skipped: a CUDA driver is installed here; this test checks the error when it is absent"
        );
        return;
    }
    let e = Gpu::open(0).unwrap_err();
    assert!(matches!(e, WorkerError::NoCudaDriver { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("libcuda.so") && msg.contains("install the NVIDIA driver"),
        "{msg}"
    );
    // Asking twice gives the same answer (nothing cached a half-loaded library).
    assert!(matches!(
        ibex_worker::device_count(),
        Err(WorkerError::NoCudaDriver { .. })
    ));
}

fn var(name: &str, shape: &[usize]) -> VarSpec {
    VarSpec {
        name: name.into(),
        dtype: Dtype::F32,
        shape: shape.to_vec(),
        init: Init::Constant(0.5),
        optimizer: Optimizer::Sgd { lr: LR },
        sparse: false,
    }
}

fn g(step: u64, i: usize) -> f32 {
    ((i * 31 + step as usize * 7) % 101) as f32 / 100.0 - 0.5
}

/// Device gradients pushed through the staging path leave the PS in the same state as the
/// same gradients pushed from host slices, and the fresh values land in device memory.
async fn device_matches_host(transport: TransportKind) {
    let Some(gpu) = gpu() else { return };
    let (spec, _stops) = common::start_sync_ps(transport, 2, 1);
    let w = common::connect_worker(&spec, 0).await.unwrap();
    let small = [7usize];
    w.create_variables(&[
        var("a_big", &BIG),
        var("a_small", &small),
        var("b_big", &BIG),
        var("b_small", &small),
    ])
    .await
    .unwrap();
    let numel = BIG[0] * BIG[1];
    let mut params = [
        gpu.alloc_zeros(numel).unwrap(),
        gpu.alloc_zeros(small[0]).unwrap(),
    ];
    {
        let [p0, p1] = &mut params;
        w.pull_device(&gpu, &["b_big", "b_small"], 0, &mut [p0, p1])
            .await
            .unwrap();
    }
    assert!(gpu.download(&params[1]).unwrap().iter().all(|v| *v == 0.5));
    for step in 0..3u64 {
        let gb: Vec<f32> = (0..numel).map(|i| g(step, i)).collect();
        let gs: Vec<f32> = (0..small[0]).map(|i| g(step, i + 1000)).collect();
        w.push(step, &[("a_big", &gb), ("a_small", &gs)])
            .await
            .unwrap();
        let (db, ds) = (gpu.upload(&gb).unwrap(), gpu.upload(&gs).unwrap());
        let [p0, p1] = &mut params;
        w.push_pull_device(
            &gpu,
            step,
            &[("b_big", &db), ("b_small", &ds)],
            &mut [p0, p1],
        )
        .await
        .unwrap();
        let host = w
            .pull(&["a_big", "a_small", "b_big", "b_small"], step + 1)
            .await
            .unwrap();
        assert_eq!(
            host[0], host[2],
            "device and host pushes leave the same PS state"
        );
        assert_eq!(host[1], host[3]);
        assert_eq!(
            gpu.download(&params[0]).unwrap(),
            host[2],
            "fresh values reached the device"
        );
        assert_eq!(gpu.download(&params[1]).unwrap(), host[3]);
    }
    println!(
        "{transport:?}: pinning {:?}; paths {:?}",
        gpu.pinning(),
        gpu.paths()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_pushes_over_shm_match_host_pushes() {
    device_matches_host(TransportKind::Shm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_pushes_over_stock_grpc_match_host_pushes() {
    device_matches_host(TransportKind::Grpc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_errors_are_typed() {
    let Some(gpu) = gpu() else { return };
    let (spec, _stops) = common::start_sync_ps(TransportKind::Shm, 1, 1);
    let w = common::connect_worker(&spec, 0).await.unwrap();
    w.create_variables(&[var("v", &[5])]).await.unwrap();
    let wrong = gpu.alloc_zeros(3).unwrap();
    match w.push_device(&gpu, 0, &[("v", &wrong)]).await {
        Err(WorkerError::ShapeMismatch {
            expected: 5,
            got: 3,
            ..
        }) => {}
        other => panic!("expected a shape mismatch, got {other:?}"),
    }
    let total = gpu.context().total_mem().unwrap();
    match gpu.alloc_zeros(total / 4 + (1 << 28)) {
        Err(WorkerError::CudaOutOfMemory { bytes, .. }) => assert!(bytes > total),
        other => panic!("expected out of memory, got {:?}", other.map(|s| s.len())),
    }
    assert!(matches!(
        Gpu::open(1 << 20),
        Err(WorkerError::NoCudaDevice { .. })
    ));
    let paths = gpu.paths();
    assert!(
        paths
            .gpudirect_rdma
            .as_ref()
            .unwrap_err()
            .contains("staging"),
        "{paths:?}"
    );
    assert!(
        paths.cuda_ipc.as_ref().unwrap_err().contains("staging"),
        "{paths:?}"
    );
}
