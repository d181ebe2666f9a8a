//! Pushes from registered buffers (`Worker::stage` / `push_staged` / `push_pull_staged`)
//! against real in-process PS shards: the PS ends each step in the same state as with
//! slice pushes, buffers are reused across steps, a buffer in flight is not handed out
//! again, and misuse gets typed errors.

mod common;

use std::sync::Arc;
use std::time::Duration;

use ibex_worker::{Dtype, Init, Optimizer, TransportKind, VarSpec, Worker, WorkerError};

const LR: f32 = 0.1;
/// 640 x 512 f32 = 1.25 MiB: split into two parts of 640 KiB, each above the descriptor
/// threshold (`remote_min`: 256 KiB on shm's defaults).
const BIG: [usize; 2] = [640, 512];

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

/// A gradient value that differs per element and step.
fn g(step: u64, i: usize) -> f32 {
    ((i * 31 + step as usize * 7) % 101) as f32 / 100.0 - 0.5
}

/// Per step: variables `a_*` pushed from slices, `b_*` (same specs) from registered buffers,
/// with the same gradients; afterwards both must hold identical values, equal to plain SGD.
async fn staged_equals_slices(transport: TransportKind) -> Worker {
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
    assert_eq!(
        w.placement("b_big").unwrap().parts.len(),
        2,
        "the big variable is split across both PS"
    );
    let row = BIG[1];
    let numel = BIG[0] * BIG[1];
    let mut expect_big = vec![0.5f32; numel];
    let mut expect_small = vec![0.5f32; small[0]];
    let mut first_ptrs = Vec::new();
    for step in 0..2u64 {
        let gb: Vec<f32> = (0..numel).map(|i| g(step, i)).collect();
        let gs: Vec<f32> = (0..small[0]).map(|i| g(step, i + 1000)).collect();
        // Sync mode, one worker: the step applies once both pushes are in, so the slice
        // push returns first and the staged push-pull completes the step.
        w.push(step, &[("a_big", &gb), ("a_small", &gs)])
            .await
            .unwrap();

        let mut staged = w.stage(&["b_big", "b_small"]).await.unwrap();
        let mut ptrs = Vec::new();
        for p in staged.parts_mut("b_big").unwrap() {
            if step == 1 {
                // Reused buffers still hold what step 0 wrote.
                let base = p.row_offset * row;
                assert!(
                    p.values
                        .iter()
                        .enumerate()
                        .all(|(i, v)| *v == g(0, base + i))
                );
            }
            for (i, v) in p.values.iter_mut().enumerate() {
                *v = g(step, p.row_offset * row + i);
            }
            ptrs.push(p.values.as_ptr() as usize);
        }
        staged.var_mut("b_small").unwrap().copy_from_slice(&gs);
        if step == 0 {
            first_ptrs = ptrs;
        } else {
            assert_eq!(
                ptrs, first_ptrs,
                "the registered buffers are reused across steps"
            );
        }
        let fresh = w.push_pull_staged(step, staged).await.unwrap();

        for (e, x) in expect_big.iter_mut().zip(&gb) {
            *e -= LR * x;
        }
        for (e, x) in expect_small.iter_mut().zip(&gs) {
            *e -= LR * x;
        }
        assert_eq!(fresh[0], expect_big);
        assert_eq!(fresh[1], expect_small);
        let all = w
            .pull(&["a_big", "a_small", "b_big", "b_small"], step + 1)
            .await
            .unwrap();
        assert_eq!(
            all[0], all[2],
            "staged and slice pushes leave the same PS state"
        );
        assert_eq!(all[1], all[3]);
        assert_eq!(all[2], expect_big);
    }
    w
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_pushes_over_shm_send_pool_descriptors() {
    let w = staged_equals_slices(TransportKind::Shm).await;
    for name in ["b_big", "b_small"] {
        for part in w.staging_info(name).unwrap() {
            assert_eq!(
                part.fallback, None,
                "{name}: every buffer lies in the shm connection's registered pool"
            );
        }
    }
    let p = w.comm_profile();
    // Remote: the two slice pushes' big parts, the two staged pushes' big parts, two parts each.
    assert_eq!(p.sent_remote.bytes, 4 * (BIG[0] * BIG[1] * 4) as u64, "{p}");
    // The shm provider names a buffer inside the pool by its offset there: the PS reads it
    // through its mapping of the pool (no CMA read), and the worker copied nothing past the
    // slice pushes' one copy into the same registered buffers. The connections count such
    // exposures: every big part, the slice pushes' as well as the staged ones.
    let from_pool: u64 = p.transport.iter().map(|(_, s)| s.exposed_from_pool).sum();
    assert_eq!(from_pool, 4 * 2, "{p}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_pushes_over_stock_grpc_go_inline_from_heap() {
    let w = staged_equals_slices(TransportKind::Grpc).await;
    for part in w.staging_info("b_big").unwrap() {
        let why = part.fallback.expect("stock gRPC has no pool");
        assert!(why.contains("stock gRPC"), "{why}");
    }
    let p = w.comm_profile();
    assert_eq!(p.sent_remote.bytes, 0, "{p}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_pushes_over_tcp_go_by_descriptor() {
    let w = staged_equals_slices(TransportKind::Tcp).await;
    // tcp reads land in the reader's buffer straight from the socket, so the big parts go
    // by descriptor as over shm, and the PS state still matches the slice pushes bit for bit.
    assert_eq!(
        w.comm_profile().sent_remote.bytes,
        4 * (BIG[0] * BIG[1] * 4) as u64,
        "{}",
        w.comm_profile()
    );
}

/// A buffer whose push has not returned is not handed out again; it is once the call returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_in_flight_is_not_handed_out_again() {
    let (spec, _stops) = common::start_sync_ps(TransportKind::Shm, 1, 2);
    let vars = [var("w", &[100_000])];
    let w0 = Arc::new(common::connect_worker(&spec, 0).await.unwrap());
    let w1 = common::connect_worker(&spec, 1).await.unwrap();
    w0.create_variables(&vars).await.unwrap();
    w1.create_variables(&vars).await.unwrap();

    let mut staged = w0.stage(&["w"]).await.unwrap();
    staged.var_mut("w").unwrap().fill(1.0);
    // While a lease is held, nobody else gets the buffer.
    assert!(
        matches!(w0.try_stage(&["w"]), Err(WorkerError::BufferBusy { ref name }) if name == "w")
    );
    let inflight = {
        let w0 = w0.clone();
        tokio::spawn(async move { w0.push_pull_staged(0, staged).await })
    };
    // The push-pull waits for worker 1's gradient: the PS may still read the buffer.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!inflight.is_finished());
    let e = w0.try_stage(&["w"]).unwrap_err();
    assert!(e.to_string().contains("in flight"), "{e}");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), w0.stage(&["w"]))
            .await
            .is_err(),
        "stage must wait"
    );

    w1.push(0, &[("w", &vec![3.0; 100_000])]).await.unwrap();
    let fresh = inflight.await.unwrap().unwrap();
    // The PS averages the two workers: 0.5 - 0.1 * (1 + 3) / 2.
    assert!(
        fresh[0].iter().all(|v| (*v - 0.3).abs() < 1e-6),
        "{:?}",
        &fresh[0][..4]
    );
    let mut again = tokio::time::timeout(Duration::from_secs(5), w0.stage(&["w"]))
        .await
        .unwrap()
        .unwrap();
    assert!(
        again.var_mut("w").unwrap().iter().all(|v| *v == 1.0),
        "the same buffer, untouched by the PS"
    );
    // A lease dropped unsent releases its buffers.
    drop(again);
    w0.try_stage(&["w"]).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misuse_gets_typed_errors() {
    let (spec, _stops) = common::start_sync_ps(TransportKind::Tcp, 2, 1);
    let w = common::connect_worker(&spec, 0).await.unwrap();
    let table = VarSpec {
        sparse: true,
        ..var("emb", &[10, 4])
    };
    w.create_variables(&[var("big", &BIG), var("v", &[5]), table])
        .await
        .unwrap();

    // Output vectors: one per name, reused (resized to the variable) across calls.
    let mut out = vec![Vec::new()];
    let e = w.pull_into(&["v", "big"], 0, &mut out).await.unwrap_err();
    assert!(matches!(e, WorkerError::Usage(_)), "{e}");
    assert!(e.to_string().contains("one per name"), "{e}");
    let mut out = vec![vec![7.0; 100], Vec::new()];
    w.pull_into(&["v", "big"], 0, &mut out).await.unwrap();
    assert_eq!(out[0], vec![0.5; 5]);
    assert_eq!(out[1].len(), BIG[0] * BIG[1]);

    let mut s = w.stage(&["v", "big"]).await.unwrap();
    match s.write("v", &[1.0; 3]) {
        Err(WorkerError::ShapeMismatch {
            name,
            expected: 5,
            got: 3,
        }) => assert_eq!(name, "v"),
        other => panic!("expected a shape mismatch, got {other:?}"),
    }
    let e = s.var_mut("big").unwrap_err();
    assert!(e.to_string().contains("parts_mut"), "{e}");
    let e = s.var_mut("other").unwrap_err();
    assert!(
        e.to_string().contains("not part of this staging lease"),
        "{e}"
    );
    // `write` scatters a whole gradient over the parts.
    let whole: Vec<f32> = (0..BIG[0] * BIG[1]).map(|i| i as f32).collect();
    s.write("big", &whole).unwrap();
    let parts = s.parts_mut("big").unwrap();
    assert_eq!(parts[1].values[0], (parts[1].row_offset * BIG[1]) as f32);
    drop(s);

    assert!(matches!(
        w.stage(&["nope"]).await,
        Err(WorkerError::UnknownVariable { .. })
    ));
    let e = w.stage(&["emb"]).await.unwrap_err();
    assert!(e.to_string().contains("sparse table"), "{e}");
    let e = w.stage(&["v", "v"]).await.unwrap_err();
    assert!(e.to_string().contains("listed twice"), "{e}");
}
