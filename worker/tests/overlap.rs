//! Layer-by-layer pushes (`Worker::begin_step`) against real PS shards: the same gradients
//! pushed in parts give exactly the values one `push_pull` per step gives, the pull waits for
//! every worker, and bad input or a failed push ends the step with an error, not a hang.

mod common;

use std::sync::Arc;
use std::time::Duration;

use ibex_worker::{Dtype, Init, Optimizer, TransportKind, VarSpec, WorkerError};

const STEPS: u64 = 6;

fn vars() -> Vec<VarSpec> {
    let v = |name: &str, shape: Vec<usize>| VarSpec {
        name: name.into(),
        dtype: Dtype::F32,
        shape,
        init: Init::Constant(0.5),
        optimizer: Optimizer::Momentum {
            lr: 0.1,
            momentum: 0.9,
        },
        sparse: false,
    };
    // Large enough that the kernels take the one-sided path over shm.
    vec![
        v("l1/kernel", vec![256, 512]),
        v("l1/bias", vec![512]),
        v("l2/kernel", vec![512, 10]),
        v("l2/bias", vec![10]),
    ]
}

/// A gradient that depends on the worker, the step and the current values.
fn grad(worker: usize, step: u64, values: &[f32]) -> Vec<f32> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            0.01 * v + ((i % 7) as f32 - 3.0) * 1e-3 * (worker as f32 + 1.0) + step as f32 * 1e-4
        })
        .collect()
}

const NAMES: [&str; 4] = ["l1/kernel", "l1/bias", "l2/kernel", "l2/bias"];

async fn train(transport: TransportKind, layered: bool) -> Vec<Vec<f32>> {
    let (spec, _stops) = common::start_sync_ps(transport, 2, 2);
    let mut handles = Vec::new();
    for r in 0..2 {
        let spec = spec.clone();
        handles.push(tokio::spawn(async move {
            let w = Arc::new(common::connect_worker(&spec, r).await.unwrap());
            w.create_variables(&vars()).await.unwrap();
            let mut vals = w.pull(&NAMES, 0).await.unwrap();
            for k in 0..STEPS {
                let g: Vec<Vec<f32>> = vals.iter().map(|v| grad(r, k, v)).collect();
                vals = if layered {
                    // The output layer first, as backpropagation produces it.
                    let mut step = w.begin_step(k);
                    step.push(vec![
                        (NAMES[2].into(), g[2].clone()),
                        (NAMES[3].into(), g[3].clone()),
                    ])
                    .unwrap();
                    step.push(vec![
                        (NAMES[0].into(), g[0].clone()),
                        (NAMES[1].into(), g[1].clone()),
                    ])
                    .unwrap();
                    step.finish_pull(&NAMES).await.unwrap()
                } else {
                    let pairs: Vec<(&str, &[f32])> = NAMES
                        .iter()
                        .copied()
                        .zip(g.iter().map(Vec::as_slice))
                        .collect();
                    w.push_pull(k, &pairs).await.unwrap()
                };
            }
            assert_eq!(w.current_step().await.unwrap(), STEPS);
            vals
        }));
    }
    let a = handles.remove(0).await.unwrap();
    let b = handles.remove(0).await.unwrap();
    assert_eq!(a, b, "both workers see the same values");
    a
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layered_pushes_equal_one_push_pull_per_step() {
    for transport in [TransportKind::Shm, TransportKind::Tcp] {
        let whole = train(transport, false).await;
        let layered = train(transport, true).await;
        // Two workers: each sum has two terms, and f32 addition of two terms is exact in
        // either order, so the results must agree bit for bit.
        assert_eq!(whole, layered, "{transport:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pull_waits_for_every_worker_and_errors_end_the_step() {
    let (spec, _stops) = common::start_sync_ps(TransportKind::Tcp, 2, 2);
    let w0 = Arc::new(common::connect_worker(&spec, 0).await.unwrap());
    let w1 = Arc::new(common::connect_worker(&spec, 1).await.unwrap());
    w0.create_variables(&vars()).await.unwrap();
    w1.create_variables(&vars()).await.unwrap();
    let zeros: Vec<Vec<f32>> = vars().iter().map(|v| vec![0.0; v.numel()]).collect();

    // Bad input is refused before anything is sent.
    let mut s = w0.begin_step(0);
    assert!(matches!(
        s.push(vec![("nope".into(), vec![0.0])]),
        Err(WorkerError::UnknownVariable { .. })
    ));
    assert!(matches!(
        s.push(vec![(NAMES[3].into(), vec![0.0; 3])]),
        Err(WorkerError::ShapeMismatch {
            expected: 10,
            got: 3,
            ..
        })
    ));

    // Worker 0 pushes everything; its pull cannot return until worker 1 has pushed too.
    for (n, g) in NAMES.iter().zip(&zeros) {
        s.push(vec![((*n).into(), g.clone())]).unwrap();
    }
    let early = tokio::spawn(s.finish_pull(&NAMES));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !early.is_finished(),
        "the pull of step 1 returned before worker 1 pushed step 0"
    );
    let mut s1 = w1.begin_step(0);
    for (n, g) in NAMES.iter().zip(&zeros) {
        s1.push(vec![((*n).into(), g.clone())]).unwrap();
    }
    let v1 = s1.finish_pull(&NAMES).await.unwrap();
    assert_eq!(early.await.unwrap().unwrap(), v1);

    // A push for a step the PS has already applied fails, and the pending pull is abandoned
    // at once rather than left waiting for a step that cannot come.
    let mut stale = w0.begin_step(0);
    stale.push(vec![(NAMES[3].into(), vec![0.0; 10])]).unwrap();
    let t = std::time::Instant::now();
    let e = stale.finish_pull(&NAMES).await.unwrap_err();
    assert!(matches!(e, WorkerError::StaleStep { .. }), "{e:?}");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );

    // The last step number has no next step: a usage error, not an overflow to step 0.
    let e = w0
        .begin_step(u64::MAX)
        .finish_pull(&NAMES)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, WorkerError::Usage(m) if m.contains("u64::MAX")),
        "{e:?}"
    );
}
