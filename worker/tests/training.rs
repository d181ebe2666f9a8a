//! Data-parallel sync training through real PS shards (in-process, over each transport)
//! matches a single-process reference on the same data: two workers each push the gradient
//! of half the batch; the PS averages them, which equals the full-batch gradient.
//! Tolerance: 1e-4 relative (f32 sums in a different order than the f64 reference).

mod common;

use ibex_worker::{ClusterSpec, Dtype, Init, Optimizer, TransportKind, VarSpec};

const N: usize = 64;
const D: usize = 5;
const STEPS: u64 = 20;
const LR: f32 = 0.05;

fn data() -> (Vec<[f32; D]>, Vec<f32>) {
    let xs: Vec<[f32; D]> = (0..N)
        .map(|i| std::array::from_fn(|j| (((i * 7 + j * 13) % 17) as f32 - 8.0) / 8.0))
        .collect();
    let ys = xs
        .iter()
        .map(|x| 0.5 * x[0] - 1.5 * x[1] + 2.0 * x[2] + 0.25 * x[4] + 0.3)
        .collect();
    (xs, ys)
}

/// d(mean squared error)/d(w, b) over `rows`.
fn grad(w: &[f32], b: f32, xs: &[[f32; D]], ys: &[f32]) -> (Vec<f32>, f32) {
    let mut gw = vec![0f32; D];
    let mut gb = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        let err = x.iter().zip(w).map(|(a, b)| a * b).sum::<f32>() + b - y;
        for j in 0..D {
            gw[j] += 2.0 * err * x[j] / xs.len() as f32;
        }
        gb += 2.0 * err / xs.len() as f32;
    }
    (gw, gb)
}

async fn run(transport: TransportKind) {
    let (spec, stops) = common::start_sync_ps(transport, 2, 2);
    let vars = vec![
        VarSpec {
            name: "w".into(),
            dtype: Dtype::F32,
            shape: vec![D],
            init: Init::Zeros,
            optimizer: Optimizer::Sgd { lr: LR },
            sparse: false,
        },
        VarSpec {
            name: "b".into(),
            dtype: Dtype::F32,
            shape: vec![1],
            init: Init::Constant(0.1),
            optimizer: Optimizer::Sgd { lr: LR },
            sparse: false,
        },
    ];
    let (xs, ys) = data();
    let mut handles = Vec::new();
    for r in 0..2 {
        let (spec, vars, xs, ys) = (spec.clone(), vars.clone(), xs.clone(), ys.clone());
        handles.push(tokio::spawn(async move {
            let w = common::connect_worker(&spec, r).await.unwrap();
            w.create_variables(&vars).await.unwrap();
            let half = N / 2;
            let (xs, ys) = (&xs[r * half..(r + 1) * half], &ys[r * half..(r + 1) * half]);
            let mut vals = w.pull(&["w", "b"], 0).await.unwrap();
            for k in 0..STEPS {
                let (gw, gb) = grad(&vals[0], vals[1][0], xs, ys);
                vals = w.push_pull(k, &[("w", &gw), ("b", &[gb])]).await.unwrap();
            }
            assert_eq!(w.current_step().await.unwrap(), STEPS);
            (vals, w.comm_profile().to_string())
        }));
    }
    let mut results = Vec::new();
    for h in handles {
        results.push(h.await.unwrap());
    }
    assert_eq!(
        results[0].0, results[1].0,
        "both workers see the same values"
    );
    assert!(results[0].1.contains("PushPull 40"), "{}", results[0].1);

    // Single-process reference: full-batch gradient descent in f64.
    let mut w = [0f64; D];
    let mut b = 0.1f64;
    for _ in 0..STEPS {
        let mut gw = [0f64; D];
        let mut gb = 0f64;
        for (x, y) in xs.iter().zip(&ys) {
            let err = x
                .iter()
                .zip(&w)
                .map(|(a, b)| f64::from(*a) * b)
                .sum::<f64>()
                + b
                - f64::from(*y);
            for j in 0..D {
                gw[j] += 2.0 * err * f64::from(x[j]) / N as f64;
            }
            gb += 2.0 * err / N as f64;
        }
        for j in 0..D {
            w[j] -= f64::from(LR) * gw[j];
        }
        b -= f64::from(LR) * gb;
    }
    let got = &results[0].0;
    for (x, y) in got[0].iter().chain(&got[1]).zip(w.iter().chain([&b])) {
        assert!(
            (f64::from(*x) - y).abs() <= 1e-4 * (1.0 + y.abs()),
            "got {got:?}, reference w {w:?} b {b}"
        );
    }
    for s in stops {
        let _ = s.send(());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_training_matches_reference_over_tcp() {
    run(TransportKind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_training_matches_reference_over_shm() {
    run(TransportKind::Shm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_training_matches_reference_over_stock_grpc() {
    run(TransportKind::Grpc).await;
}

#[tokio::test]
async fn a_spec_without_ps_is_refused() {
    let spec = ClusterSpec {
        ps: vec![],
        workers: vec![],
        transport: TransportKind::Tcp,
        timeouts: Default::default(),
    };
    let e = common::connect_worker(&spec, 0).await.unwrap_err();
    assert!(e.to_string().contains("no PS"), "{e}");
}
