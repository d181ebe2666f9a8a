//! `ibex-ps` processes: a shard killed with SIGKILL mid-training and restarted with
//! `--restore` continues, after `Worker::recover`, from the newest checkpoint every shard
//! holds, with no step lost or applied twice: the final values equal a reference computed
//! here with the same f32 operations. SIGTERM shuts down gracefully with a final checkpoint.

mod common;

use std::path::Path;
use std::time::Duration;

use ibex_test_support::{Launch, Server};
use ibex_worker::{
    ClusterSpec, Dtype, Init, Optimizer, TransportKind, VarSpec, Worker, WorkerError,
};

const STEPS: u64 = 10;
const KILL_AFTER: u64 = 8;
const EVERY: u64 = 3;

fn spawn_ps(spec: &ClusterSpec, i: usize, dir: &Path, restore: bool) -> Server {
    let mut c = Launch::new(env!("CARGO_BIN_EXE_ibex-ps"));
    c.listen(&spec.ps_uri(i))
        .args([
            "--shard",
            &i.to_string(),
            "--num-workers",
            "1",
            "--mode",
            "sync",
        ])
        .args([
            "--checkpoint-every",
            &EVERY.to_string(),
            "--sync-timeout-secs",
            "10",
        ])
        .arg("--checkpoint-dir")
        .arg(dir);
    if restore {
        c.arg("--restore");
    }
    c.spawn().expect("ibex-ps")
}

fn vars() -> Vec<VarSpec> {
    let v = |name: &str, optimizer| VarSpec {
        name: name.into(),
        dtype: Dtype::F32,
        shape: vec![8],
        init: Init::Normal { std: 1.0, seed: 11 },
        optimizer,
        sparse: false,
    };
    vec![
        v(
            "a",
            Optimizer::Momentum {
                lr: 0.1,
                momentum: 0.9,
            },
        ),
        v("b", Optimizer::Sgd { lr: 0.2 }),
    ]
}

/// The gradient depends on the values and the step, so a lost or repeated step shows.
fn grad(vals: &[f32], k: u64) -> Vec<f32> {
    vals.iter().map(|x| x * 0.5 + k as f32 * 0.01).collect()
}

async fn train(w: &Worker, from: u64, to: u64) {
    for k in from..to {
        let vals = w.pull(&["a", "b"], k).await.unwrap();
        let (ga, gb) = (grad(&vals[0], k), grad(&vals[1], k));
        w.push(k, &[("a", &ga), ("b", &gb)]).await.unwrap();
    }
}

fn reference(a0: &[f32], b0: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (mut a, mut b, mut v) = (a0.to_vec(), b0.to_vec(), vec![0f32; a0.len()]);
    for k in 0..STEPS {
        let (ga, gb) = (grad(&a, k), grad(&b, k));
        for i in 0..a.len() {
            v[i] = 0.9 * v[i] + ga[i];
            a[i] -= 0.1 * v[i];
            b[i] -= 0.2 * gb[i];
        }
    }
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_then_restore_loses_and_repeats_no_step() {
    kill_restore(false).await
}

/// The same, with the worker kept across the restart: its channel to the killed shard
/// reconnects on the next call (as a tonic channel would), so a training process survives a
/// PS restart without making a new `Worker`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_worker_reconnects_after_a_restart() {
    kill_restore(true).await
}

async fn kill_restore(keep_worker: bool) {
    let dir = tempfile::tempdir().unwrap();
    let spec = ClusterSpec {
        ps: (0..2)
            .map(|_| format!("127.0.0.1:{}", common::free_port()))
            .collect(),
        workers: vec!["127.0.0.1:0".into()],
        transport: TransportKind::Tcp,
        timeouts: Default::default(),
    };
    let mut ps: Vec<Server> = (0..2)
        .map(|i| spawn_ps(&spec, i, dir.path(), false))
        .collect();
    let w = common::connect_worker(&spec, 0).await.unwrap();
    w.create_variables(&vars()).await.unwrap();
    assert_ne!(
        w.placement("a").unwrap().parts[0].ps,
        w.placement("b").unwrap().parts[0].ps,
        "one variable per shard"
    );
    let init = w.pull(&["a", "b"], 0).await.unwrap();
    train(&w, 0, KILL_AFTER).await;

    // Shard 0 dies without warning; shard 1 has applied step 7 too (8 steps).
    ps[0].kill().unwrap();
    assert!(
        w.pull(&["a"], KILL_AFTER).await.is_err(),
        "the dead shard is noticed"
    );
    ps[0] = spawn_ps(&spec, 0, dir.path(), true);
    let w = if keep_worker {
        // Calls fail `Unavailable` until the shard is back, then go through. (The worker
        // still knows its variables; the shard restored them from its checkpoint.)
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            match w.stats().await {
                Ok(_) => break w,
                Err(WorkerError::Unavailable { .. }) if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                Err(e) => panic!("the worker never reached the restarted shard: {e}"),
            }
        }
    } else {
        drop(w);
        let w = common::connect_worker(&spec, 0).await.unwrap();
        w.create_variables(&vars()).await.unwrap();
        w
    };
    let stats = w.stats().await.unwrap();
    assert_eq!(
        stats[0].step, 6,
        "shard 0 restored its newest checkpoint (every {EVERY} steps)"
    );
    assert_eq!(stats[1].step, KILL_AFTER);
    assert_eq!(stats[1].checkpoint_steps, vec![3, 6]);
    let resume = w.recover().await.unwrap();
    assert_eq!(resume, 6);
    assert_eq!(w.current_step().await.unwrap(), 6);
    train(&w, resume, STEPS).await;

    let got = w.pull(&["a", "b"], STEPS).await.unwrap();
    let (ra, rb) = reference(&init[0], &init[1]);
    for (g, r) in got.iter().zip([&ra, &rb]) {
        for (x, y) in g.iter().zip(r.iter()) {
            assert!(
                (x - y).abs() <= 1e-6 * (1.0 + y.abs()),
                "got {g:?}\nexpected {r:?}"
            );
        }
    }
    drop(w);

    // SIGTERM: graceful shutdown with a final checkpoint of step 10.
    for c in &ps {
        c.terminate().unwrap();
    }
    for c in &mut ps {
        // A hang guard: the final checkpoint of two tiny shards takes milliseconds.
        assert!(c.wait(Duration::from_secs(60)).unwrap().success());
    }
    for i in 0..2 {
        assert!(
            dir.path()
                .join(format!("shard-{i}/step-{STEPS:012}.safetensors"))
                .exists()
        );
    }
}
